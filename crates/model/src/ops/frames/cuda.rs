//! The frame models' operations on the GPU (`frames.cu`, and the
//! image path's convolution for the ConvLSTM's gates). A batch of frame
//! sequences [n, f, h, w, c] is stored as images [n·f, h, w, c].
//!
//! | wrapper | CPU reference |
//! |---|---|
//! | `conv_lstm_forward` / `conv_lstm_backward` | `layers::ConvLstm` |
//! | `pixel_mse` | `loss::pixel_mse` |

use cudarc::driver::{CudaView, CudaViewMut, LaunchConfig, PushKernelArg};

use crate::cuda::backend::{CudaBackend, DeviceBuffer};
use crate::cuda::kernels as k;
use crate::cuda::launch::{elementwise, launch, u32_of};
use crate::cuda::params::{FramesParams, MseParams};
use crate::cuda::tensor::{AnyView, CudaTensor};
use crate::cuda::{CudaError, CudaResult};
use crate::ops::conv::cuda::{conv2d_backward, conv2d_forward, ConvPlan, ConvShape};
use crate::ops::loss::cuda::{GradScale, XentOutput};

/// A ConvLSTM over `frames` steps of [h, w, channels] images, `hidden`
/// channels of state, gates by one `kernel`×`kernel` convolution.
#[derive(Clone, Copy, Debug)]
pub struct ConvLstmShape {
    pub frames: usize,
    pub h: usize,
    pub w: usize,
    pub channels: usize,
    pub hidden: usize,
    pub kernel: usize,
}

impl ConvLstmShape {
    /// Samples in a batch of frames [n·f, h, w, channels].
    fn samples(&self, x: &CudaTensor, op: &'static str) -> CudaResult<usize> {
        let ok = matches!(*x.shape(), [nf, h, w, c]
            if self.frames > 0 && nf.is_multiple_of(self.frames) && h == self.h && w == self.w && c == self.channels);
        if !ok {
            return Err(CudaError::shape(
                op,
                format!(
                    "frames [n·{}, {}, {}, {}]",
                    self.frames, self.h, self.w, self.channels
                ),
                format!("{:?}", x.shape()),
            ));
        }
        Ok(x.shape()[0] / self.frames)
    }

    /// The gates' convolution over one step of `n` samples.
    fn conv(&self, n: usize) -> ConvShape {
        ConvShape {
            n,
            h: self.h,
            w: self.w,
            cin: self.channels + self.hidden,
            cout: 4 * self.hidden,
            k: self.kernel,
            stride: 1,
            pad: self.kernel / 2,
        }
    }

    fn params(&self, n: usize, step: usize) -> CudaResult<FramesParams> {
        let op = "conv_lstm";
        Ok(FramesParams {
            n: u32_of(op, n)?,
            frames: u32_of(op, self.frames)?,
            step: u32_of(op, step)?,
            pixels: u32_of(op, self.h * self.w)?,
            channels: u32_of(op, self.channels)?,
            hidden: u32_of(op, self.hidden)?,
        })
    }
}

/// What a ConvLSTM's backward needs besides its input and output: the cell
/// states [n·f, h, w, hidden] of every step, in f32, and with
/// `step_recompute` off the activated gates [n·f, h, w, 4·hidden] too
/// (f32). Without them backward reruns each step's gates' convolution:
/// one more convolution per step for 4/5 less kept, the same bits.
#[derive(Debug)]
pub struct ConvLstmSaved {
    pub gates: Option<DeviceBuffer<f32>>,
    pub cells: DeviceBuffer<f32>,
}

/// [x_t, h_{t−1}] of every sample, [n, h, w, channels + hidden].
fn step_input(
    be: &CudaBackend,
    x: &CudaTensor,
    hs: &CudaTensor,
    s: &ConvLstmShape,
    n: usize,
    step: usize,
) -> CudaResult<CudaTensor> {
    let width = s.channels + s.hidden;
    let mut xh = CudaTensor::uninit(be, &[n, s.h, s.w, width], x.dtype())?;
    let p = s.params(n, step)?;
    let cfg = elementwise(xh.len());
    let f = be.function(k::FRAMES_STEP_CONCAT.of(x.dtype()))?;
    // SAFETY: frames_step_concat_T(FramesParams, const T* x [n·f, h, w, c],
    // const T* hs [n·f, h, w, hidden], T* xh [n, h, w, c + hidden]); the
    // shapes were checked by the caller, grid-stride over xh.
    unsafe {
        launch(be.compute_stream(), &f, cfg, "frames_step_concat", |b| {
            b.arg(&p).arg(x).arg(hs).arg(&mut xh);
        })
    }?;
    Ok(xh)
}

/// Every hidden state [n·f, h, w, hidden] of a ConvLSTM over frames
/// [n·f, h, w, channels], from zero state; `weight` and `bias` are the
/// gates' convolution's. `step_recompute` keeps the cells only.
pub fn conv_lstm_forward(
    be: &CudaBackend,
    x: &CudaTensor,
    weight: &AnyView<'_>,
    bias: &AnyView<'_>,
    s: ConvLstmShape,
    plan: ConvPlan,
    step_recompute: bool,
) -> CudaResult<(CudaTensor, ConvLstmSaved)> {
    let n = s.samples(x, "conv_lstm")?;
    let units = x.shape()[0] * s.h * s.w * s.hidden;
    let mut gates = match step_recompute {
        true => None,
        false => Some(be.alloc::<f32>(4 * units)?),
    };
    let mut cells = be.alloc::<f32>(units)?;
    let mut hs = CudaTensor::uninit(be, &[x.shape()[0], s.h, s.w, s.hidden], x.dtype())?;
    if hs.is_empty() {
        return Ok((hs, ConvLstmSaved { gates, cells }));
    }
    let cell = match step_recompute {
        true => k::CONV_LSTM_CELL_FORWARD_CELLS,
        false => k::CONV_LSTM_CELL_FORWARD,
    };
    let f = be.function(cell.of(x.dtype()))?;
    for step in 0..s.frames {
        let xh = step_input(be, x, &hs, &s, n, step)?;
        let pre = conv2d_forward(be, &xh, weight, Some(bias), s.conv(n), plan)?;
        drop(xh);
        let p = s.params(n, step)?;
        // SAFETY: conv_lstm_cell_forward_T(FramesParams, const T* pre [n, h,
        // w, 4·hidden], float* gates [n·f, h, w, 4·hidden], float* cells
        // [n·f, h, w, hidden], T* hs [n·f, h, w, hidden]), or its _cells
        // form without gates; grid-stride over n·h·w·hidden, each thread
        // its own unit's elements.
        unsafe {
            launch(
                be.compute_stream(),
                &f,
                elementwise(n * s.h * s.w * s.hidden),
                "conv_lstm_cell_forward",
                |b| {
                    b.arg(&p).arg(&pre);
                    if let Some(gates) = gates.as_mut() {
                        b.arg(&mut gates.slice);
                    }
                    b.arg(&mut cells.slice).arg(&mut hs);
                },
            )
        }?;
    }
    Ok((hs, ConvLstmSaved { gates, cells }))
}

/// ConvLSTM backward through time from g [n·f, h, w, hidden]: the gates'
/// convolution's dW and db accumulated (+=), dx returned. Each step's
/// convolution input is gathered again from x and the output, and without
/// kept gates its convolution is rerun for them.
#[allow(clippy::too_many_arguments)]
pub fn conv_lstm_backward(
    be: &CudaBackend,
    x: &CudaTensor,
    hs: &CudaTensor,
    g: &CudaTensor,
    saved: &ConvLstmSaved,
    weight: &AnyView<'_>,
    bias: &AnyView<'_>,
    weight_grad: &mut CudaViewMut<'_, f32>,
    bias_grad: &mut CudaViewMut<'_, f32>,
    s: ConvLstmShape,
    plan: ConvPlan,
) -> CudaResult<CudaTensor> {
    let op = "conv_lstm backward";
    let n = s.samples(x, op)?;
    g.expect_shape(op, hs.shape())?;
    let mut dx = CudaTensor::uninit(be, x.shape(), x.dtype())?;
    if dx.is_empty() {
        return Ok(dx);
    }
    let state = n * s.h * s.w * s.hidden;
    let mut dh_next = be.alloc_zeros::<f32>(state)?;
    let mut dc_carry = be.alloc_zeros::<f32>(state)?;
    let split = be.function(k::FRAMES_STEP_SPLIT.of(g.dtype()))?;
    for step in (0..s.frames).rev() {
        let p = s.params(n, step)?;
        let xh = step_input(be, x, hs, &s, n, step)?;
        let mut d_pre = CudaTensor::uninit(be, &[n, s.h, s.w, 4 * s.hidden], g.dtype())?;
        let cells = &saved.cells.slice;
        match &saved.gates {
            Some(gates) => {
                let f = be.function(k::CONV_LSTM_CELL_BACKWARD.of(g.dtype()))?;
                // SAFETY: conv_lstm_cell_backward_T(FramesParams, const
                // float* gates, const float* cells (every step), const T* g
                // [n·f, h, w, hidden], const float* dh_next, float* dc [n,
                // h, w, hidden], T* d_pre [n, h, w, 4·hidden]); grid-stride
                // over n·h·w·hidden.
                unsafe {
                    launch(
                        be.compute_stream(),
                        &f,
                        elementwise(state),
                        "conv_lstm_cell_backward",
                        |b| {
                            b.arg(&p).arg(&gates.slice).arg(cells).arg(g);
                            b.arg(&dh_next.slice)
                                .arg(&mut dc_carry.slice)
                                .arg(&mut d_pre);
                        },
                    )
                }?;
            }
            None => {
                let pre = conv2d_forward(be, &xh, weight, Some(bias), s.conv(n), plan)?;
                let f = be.function(k::CONV_LSTM_CELL_BACKWARD_RERUN.of(g.dtype()))?;
                // SAFETY: conv_lstm_cell_backward_rerun_T(FramesParams, const
                // T* pre [n, h, w, 4·hidden] (the step's, computed again),
                // then as conv_lstm_cell_backward_T; grid-stride over
                // n·h·w·hidden.
                unsafe {
                    launch(
                        be.compute_stream(),
                        &f,
                        elementwise(state),
                        "conv_lstm_cell_backward_rerun",
                        |b| {
                            b.arg(&p).arg(&pre).arg(cells).arg(g);
                            b.arg(&dh_next.slice)
                                .arg(&mut dc_carry.slice)
                                .arg(&mut d_pre);
                        },
                    )
                }?;
            }
        }
        let dxh = conv2d_backward(
            be,
            &xh,
            &d_pre,
            weight,
            weight_grad,
            Some(bias_grad),
            s.conv(n),
            plan,
        )?;
        drop((xh, d_pre));
        let cfg = elementwise(dxh.len());
        // SAFETY: frames_step_split_T(FramesParams, const T* dxh [n, h, w,
        // c + hidden], T* dx [n·f, h, w, c], float* dh_next [n, h, w,
        // hidden]); grid-stride over dxh.
        unsafe {
            launch(be.compute_stream(), &split, cfg, "frames_step_split", |b| {
                b.arg(&p).arg(&dxh).arg(&mut dx).arg(&mut dh_next.slice);
            })
        }?;
    }
    Ok(dx)
}

/// Mean squared error of `y` against u8 `targets` read as t/255 (the same
/// count), a row per frame of `y` [rows, ...]: the loss kernels' output,
/// with gradient 2·(y − t)/count times the loss scale and the share.
pub fn pixel_mse(
    be: &CudaBackend,
    y: &CudaTensor,
    targets: &CudaView<'_, u8>,
    scale: GradScale<'_>,
) -> CudaResult<XentOutput> {
    scale.check("pixel_mse")?;
    let rows = y.shape().first().copied().unwrap_or(0);
    if rows == 0 || y.len() != targets.len() {
        return Err(CudaError::shape(
            "pixel_mse",
            format!("{} target pixels for predictions {:?}", y.len(), y.shape()),
            format!("{}", targets.len()),
        ));
    }
    let p = MseParams {
        rows: u32_of("pixel_mse", rows)?,
        cols: u32_of("pixel_mse", y.len() / rows)?,
        share: scale.share,
    };
    let mut grad = CudaTensor::uninit(be, y.shape(), y.dtype())?;
    let mut row_loss = be.alloc::<f32>(rows)?;
    let mut row_correct = be.alloc::<u32>(rows)?;
    let f = be.function(k::PIXEL_MSE.of(y.dtype()))?;
    let cfg = LaunchConfig {
        grid_dim: (rows.div_ceil(8) as u32, 1, 1),
        block_dim: (32, 8, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: pixel_mse_T(MseParams, const T* y [rows, cols], const u8*
    // target [rows, cols], const float* loss_scale [1], T* grad [rows,
    // cols], float* row_loss, u32* row_correct [rows]) with block (32, 8),
    // a row per warp; lengths checked above.
    unsafe {
        launch(be.compute_stream(), &f, cfg, "pixel_mse", |b| {
            b.arg(&p)
                .arg(y)
                .arg(targets)
                .arg(scale.loss_scale)
                .arg(&mut grad)
                .arg(&mut row_loss.slice)
                .arg(&mut row_correct.slice);
        })
    }?;
    Ok(XentOutput {
        grad,
        row_loss,
        row_correct,
    })
}
