//! The arithmetic of the forward pass: the matrix product (the `gemm`
//! crate, a transpose being a change of strides, never a copy), the norms
//! and the activations, all in f32 as transformers computes them on the CPU.

use gemm::{gemm, Parallelism};

/// Below this many multiply-adds a product runs on the calling thread: the
/// tiny fixture models would spend longer handing work to threads.
const PARALLEL_WORK: usize = 1 << 18;

/// How a weight matrix is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// [out, in] (torch's nn.Linear).
    OutIn,
    /// [in, out] (GPT-2's Conv1D).
    InOut,
}

/// y[n, out] = x[n, in] · W (+ bias), W laid out as `layout` says.
pub fn project(
    x: &[f32],
    n: usize,
    w: &[f32],
    inp: usize,
    out: usize,
    layout: Layout,
    bias: Option<&[f32]>,
) -> Vec<f32> {
    assert_eq!(x.len(), n * inp, "project: input is not n × in");
    assert_eq!(w.len(), inp * out, "project: weight is not in × out");
    let mut y = vec![0.0f32; n * out];
    if n == 0 || out == 0 {
        return y;
    }
    if inp > 0 {
        // Element (k, j) of the right operand.
        let (rhs_row, rhs_col) = match layout {
            Layout::OutIn => (1isize, inp as isize),
            Layout::InOut => (out as isize, 1isize),
        };
        let parallelism = if n * inp * out >= PARALLEL_WORK {
            Parallelism::Rayon(0)
        } else {
            Parallelism::None
        };
        // SAFETY: the asserts above give x n·in elements (row stride in,
        // column stride 1), w in·out elements under either layout's strides,
        // and y n·out elements (row stride out); y is a fresh buffer that
        // aliases neither input.
        unsafe {
            gemm(
                n,
                out,
                inp,
                y.as_mut_ptr(),
                1,
                out as isize,
                false,
                x.as_ptr(),
                1,
                inp as isize,
                w.as_ptr(),
                rhs_col,
                rhs_row,
                1.0,
                1.0,
                false,
                false,
                false,
                parallelism,
            );
        }
    }
    if let Some(bias) = bias {
        for row in y.chunks_exact_mut(out) {
            for (v, b) in row.iter_mut().zip(bias) {
                *v += b;
            }
        }
    }
    y
}

/// Llama's RMSNorm over rows of `weight.len()`: x / sqrt(mean(x²) + eps) · w.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32) -> Vec<f32> {
    let d = weight.len();
    let mut y = vec![0.0f32; x.len()];
    for (row, out) in x.chunks_exact(d).zip(y.chunks_exact_mut(d)) {
        let mean = row.iter().map(|v| v * v).sum::<f32>() / d as f32;
        let inv = 1.0 / (mean + eps).sqrt();
        for ((o, v), w) in out.iter_mut().zip(row).zip(weight) {
            *o = w * (v * inv);
        }
    }
    y
}

/// LayerNorm over rows: (x − mean) / sqrt(var + eps) · w + b (biased var).
pub fn layer_norm(x: &[f32], weight: &[f32], bias: &[f32], eps: f32) -> Vec<f32> {
    let d = weight.len();
    let mut y = vec![0.0f32; x.len()];
    for (row, out) in x.chunks_exact(d).zip(y.chunks_exact_mut(d)) {
        let mean = row.iter().sum::<f32>() / d as f32;
        let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / d as f32;
        let inv = 1.0 / (var + eps).sqrt();
        for (((o, v), w), b) in out.iter_mut().zip(row).zip(weight).zip(bias) {
            *o = (v - mean) * inv * w + b;
        }
    }
    y
}

/// GPT-2's gelu_new (the tanh approximation).
pub fn gelu_new(x: f32) -> f32 {
    const C: f32 = 0.797_884_6; // sqrt(2 / pi)
    0.5 * x * (1.0 + (C * (x + 0.044715 * x * x * x)).tanh())
}

/// SiLU: x · sigmoid(x).
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// Softmax in place.
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f32;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    for v in x.iter_mut() {
        *v /= sum;
    }
}
