use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

use crate::cuda::backend::CudaBackend;
use crate::cuda::kernels::{self as k, KernelPair};
use crate::cuda::launch::*;
use crate::cuda::params::*;
use crate::cuda::tensor::{same_dtype, CudaTensor};
use crate::cuda::CudaResult;

// ---------------------------------------------------------------------------
// Elementwise layers

/// ReLU forward (NaN propagates). The output is what backward needs.
pub fn relu_forward(be: &CudaBackend, x: &CudaTensor) -> CudaResult<CudaTensor> {
    let n = x.len();
    let mut y = CudaTensor::uninit(be, x.shape(), x.dtype())?;
    if n > 0 {
        let p = EwParams { n: n as u32 };
        let f = be.function(k::RELU_FORWARD.of(x.dtype()))?;
        // SAFETY: relu_forward_T(EwParams, const T*, T*); x and y
        // hold n elements.
        unsafe {
            launch(
                be.compute_stream(),
                &f,
                elementwise(n),
                "relu_forward",
                |b| {
                    b.arg(&p).arg(x).arg(&mut y);
                },
            )
        }?;
    }
    Ok(y)
}

/// ReLU backward: dx = y > 0 ? g : 0 with y the forward's output.
pub fn relu_backward(be: &CudaBackend, g: &CudaTensor, y: &CudaTensor) -> CudaResult<CudaTensor> {
    g.expect_shape("relu backward", y.shape())?;
    same_dtype("relu backward", g.dtype(), &[y.dtype()])?;
    let n = g.len();
    let mut dx = CudaTensor::uninit(be, g.shape(), g.dtype())?;
    if n > 0 {
        let p = EwParams { n: n as u32 };
        let f = be.function(k::RELU_BACKWARD.of(g.dtype()))?;
        // SAFETY: relu_backward_T(EwParams, const T* g, const T* y, T* dx);
        // all hold n elements.
        unsafe {
            launch(
                be.compute_stream(),
                &f,
                elementwise(n),
                "relu_backward",
                |b| {
                    b.arg(&p).arg(g).arg(y).arg(&mut dx);
                },
            )
        }?;
    }
    Ok(dx)
}

/// A smooth activation: its derivative needs the forward's input, which
/// backward reads (`layers::smooth_activation`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Smooth {
    /// x·σ(x).
    Silu,
    /// GELU, tanh approximation.
    Gelu,
}

impl Smooth {
    /// The forward and backward kernels, with their names for errors.
    fn kernels(self) -> [(KernelPair, &'static str); 2] {
        match self {
            Smooth::Silu => [
                (k::SILU_FORWARD, "silu_forward"),
                (k::SILU_BACKWARD, "silu_backward"),
            ],
            Smooth::Gelu => [
                (k::GELU_FORWARD, "gelu_forward"),
                (k::GELU_BACKWARD, "gelu_backward"),
            ],
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Smooth::Silu => "silu",
            Smooth::Gelu => "gelu",
        }
    }
}

/// SiLU or GELU forward; backward needs `x`.
pub fn smooth_forward(be: &CudaBackend, kind: Smooth, x: &CudaTensor) -> CudaResult<CudaTensor> {
    let n = x.len();
    let mut y = CudaTensor::uninit(be, x.shape(), x.dtype())?;
    if n > 0 {
        let p = EwParams { n: n as u32 };
        let [(kernel, op), _] = kind.kernels();
        let f = be.function(kernel.of(x.dtype()))?;
        // SAFETY: silu_forward_T / gelu_forward_T(EwParams, const T* x,
        // T* y); x and y hold n elements.
        unsafe {
            launch(be.compute_stream(), &f, elementwise(n), op, |b| {
                b.arg(&p).arg(x).arg(&mut y);
            })
        }?;
    }
    Ok(y)
}

/// SiLU or GELU backward: dx = g · f'(x), x the forward's input.
pub fn smooth_backward(
    be: &CudaBackend,
    kind: Smooth,
    g: &CudaTensor,
    x: &CudaTensor,
) -> CudaResult<CudaTensor> {
    g.expect_shape("smooth activation backward", x.shape())?;
    same_dtype("smooth activation backward", g.dtype(), &[x.dtype()])?;
    let n = g.len();
    let mut dx = CudaTensor::uninit(be, g.shape(), g.dtype())?;
    if n > 0 {
        let p = EwParams { n: n as u32 };
        let [_, (kernel, op)] = kind.kernels();
        let f = be.function(kernel.of(g.dtype()))?;
        // SAFETY: silu_backward_T / gelu_backward_T(EwParams, const T* g,
        // const T* x, T* dx); all hold n elements.
        unsafe {
            launch(be.compute_stream(), &f, elementwise(n), op, |b| {
                b.arg(&p).arg(g).arg(x).arg(&mut dx);
            })
        }?;
    }
    Ok(dx)
}

/// A dropout layer's mask: zero with probability `p`, else 1/(1 − p), by
/// a hash of (`seed`, the counter on the device, the index).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DropoutMask {
    pub p: f32,
    pub seed: u64,
}

impl DropoutMask {
    fn params(&self, op: &'static str, n: usize, previous: bool) -> CudaResult<DropoutParams> {
        Ok(DropoutParams {
            n: u32_of(op, n)?,
            p: self.p,
            scale: 1.0 / (1.0 - self.p),
            seed_lo: self.seed as u32,
            seed_hi: (self.seed >> 32) as u32,
            previous: previous as u32,
        })
    }
}

/// One block of one warp (the counter's kernels).
fn one_warp() -> LaunchConfig {
    LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (32, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn expect_counter(op: &'static str, counter: &CudaSlice<f32>) -> CudaResult<()> {
    same_len(op, "counter limbs", 4, counter.len())
}

/// `x` times the mask of `counter` (forward), or of the counter before the
/// last forward (`previous`: backward, or a recomputed forward).
pub fn dropout_apply(
    be: &CudaBackend,
    mask: DropoutMask,
    counter: &CudaSlice<f32>,
    previous: bool,
    x: &CudaTensor,
) -> CudaResult<CudaTensor> {
    expect_counter("dropout", counter)?;
    let n = x.len();
    let p = mask.params("dropout", n, previous)?;
    let mut y = CudaTensor::uninit(be, x.shape(), x.dtype())?;
    if n > 0 {
        let f = be.function(k::DROPOUT_APPLY.of(x.dtype()))?;
        // SAFETY: dropout_apply_T(DropoutParams, const float* counter [4],
        // const T* x, T* y); x and y hold n elements.
        unsafe {
            launch(
                be.compute_stream(),
                &f,
                elementwise(n),
                "dropout_apply",
                |b| {
                    b.arg(&p).arg(counter).arg(x).arg(&mut y);
                },
            )
        }?;
    }
    Ok(y)
}

/// Advances the counter by one (after a training forward).
pub fn dropout_count(
    be: &CudaBackend,
    mask: DropoutMask,
    counter: &mut CudaSlice<f32>,
) -> CudaResult<()> {
    expect_counter("dropout_count", counter)?;
    let p = mask.params("dropout_count", 0, false)?;
    let f = be.function(&k::DROPOUT_COUNT)?;
    // SAFETY: dropout_count(DropoutParams, float* counter [4]): one thread.
    unsafe {
        launch(be.compute_stream(), &f, one_warp(), "dropout_count", |b| {
            b.arg(&p).arg(counter);
        })
    }?;
    Ok(())
}

/// Puts back the counter saved before the step if `verdict` says the step
/// was skipped.
pub fn dropout_restore_if_skipped(
    be: &CudaBackend,
    mask: DropoutMask,
    verdict: &CudaSlice<StepState>,
    saved: &CudaSlice<f32>,
    counter: &mut CudaSlice<f32>,
) -> CudaResult<()> {
    expect_counter("dropout_restore_if_skipped", saved)?;
    expect_counter("dropout_restore_if_skipped", counter)?;
    let p = mask.params("dropout_restore_if_skipped", 0, false)?;
    let f = be.function(&k::DROPOUT_COUNTER_RESTORE)?;
    // SAFETY: dropout_counter_restore(DropoutParams, const StepState* [1],
    // const float* saved [4], float* counter [4]): threads 0..4 copy.
    unsafe {
        launch(
            be.compute_stream(),
            &f,
            one_warp(),
            "dropout_counter_restore",
            |b| {
                b.arg(&p).arg(verdict).arg(saved).arg(counter);
            },
        )
    }?;
    Ok(())
}

/// acc += b (the residual sum in forward and in backward).
pub fn add_inplace(be: &CudaBackend, acc: &mut CudaTensor, b_in: &CudaTensor) -> CudaResult<()> {
    b_in.expect_shape("residual add", acc.shape())?;
    same_dtype("residual add", acc.dtype(), &[b_in.dtype()])?;
    let n = acc.len();
    if n == 0 {
        return Ok(());
    }
    let p = EwParams { n: n as u32 };
    let f = be.function(k::ADD_INPLACE.of(acc.dtype()))?;
    // SAFETY: add_inplace_T(EwParams, T* acc, const T* b); both
    // hold n elements and are distinct tensors (the borrow checker
    // guarantees acc is not b_in).
    unsafe {
        launch(
            be.compute_stream(),
            &f,
            elementwise(n),
            "add_inplace",
            |b| {
                b.arg(&p).arg(acc).arg(b_in);
            },
        )
    }?;
    Ok(())
}

/// out = a + b.
pub fn add(be: &CudaBackend, a: &CudaTensor, b_in: &CudaTensor) -> CudaResult<CudaTensor> {
    b_in.expect_shape("add", a.shape())?;
    same_dtype("add", a.dtype(), &[b_in.dtype()])?;
    let n = a.len();
    let mut out = CudaTensor::uninit(be, a.shape(), a.dtype())?;
    if n > 0 {
        let p = EwParams { n: n as u32 };
        let f = be.function(k::ADD.of(a.dtype()))?;
        // SAFETY: add_T(EwParams, const T*, const T*, T*);
        // all hold n elements.
        unsafe {
            launch(be.compute_stream(), &f, elementwise(n), "add", |b| {
                b.arg(&p).arg(a).arg(b_in).arg(&mut out);
            })
        }?;
    }
    Ok(out)
}
