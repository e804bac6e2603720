//! The arithmetic of the forward pass: the matrix product (the `gemm`
//! crate, a transpose being a change of strides, never a copy), the norms
//! and the activations, all in f32 as transformers computes them on the CPU.

use gemm::gemm;
pub(crate) use gemm::Parallelism;

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

/// splitmix64: the next value of a seeded stream (every draw of this crate:
/// adapters' initialisation, dropout masks, orders, sampling, random
/// weights), small and good enough for all of them.
pub fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
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

/// A matrix read in place: element (i, j) is `data[offset + i·rs + j·cs]`,
/// so a transpose or one head's columns of a wider row is a view, never a
/// copy.
#[derive(Clone, Copy)]
pub struct View<'a> {
    pub data: &'a [f32],
    pub offset: usize,
    pub rows: usize,
    pub cols: usize,
    pub rs: usize,
    pub cs: usize,
}

impl<'a> View<'a> {
    /// A row-major [rows, cols] matrix.
    pub fn new(data: &'a [f32], rows: usize, cols: usize) -> Self {
        Self {
            data,
            offset: 0,
            rows,
            cols,
            rs: cols,
            cs: 1,
        }
    }

    /// `cols` columns from `first` of every row of a matrix whose rows are
    /// `stride` apart, rows `rows` from row `row`.
    pub fn columns(
        data: &'a [f32],
        row: usize,
        rows: usize,
        first: usize,
        cols: usize,
        stride: usize,
    ) -> Self {
        Self {
            data,
            offset: row * stride + first,
            rows,
            cols,
            rs: stride,
            cs: 1,
        }
    }

    pub fn t(self) -> Self {
        Self {
            rows: self.cols,
            cols: self.rows,
            rs: self.cs,
            cs: self.rs,
            ..self
        }
    }

    /// Whether every element lies inside `data`.
    fn in_bounds(&self) -> bool {
        if self.rows == 0 || self.cols == 0 {
            return true;
        }
        let last = self.offset + (self.rows - 1) * self.rs + (self.cols - 1) * self.cs;
        last < self.data.len()
    }
}

/// dst[m, n] (row-major, contiguous) = a · b, or += a · b with `accumulate`.
pub fn gemm_into(dst: &mut [f32], a: View, b: View, accumulate: bool, parallel: bool) {
    let n = b.cols;
    gemm_strided(dst, n, 1, a, b, accumulate, parallel);
}

/// dst = a · b (or += with `accumulate`), element (i, j) of dst at
/// i · `dst_rs` + j · `dst_cs`.
/// `parallel` lets the product use rayon's threads when it is large enough;
/// the gemm crate splits rows and columns, never the sum, so the result
/// does not depend on the thread count.
pub fn gemm_strided(
    dst: &mut [f32],
    dst_rs: usize,
    dst_cs: usize,
    a: View,
    b: View,
    accumulate: bool,
    parallel: bool,
) {
    let threads = parallelism(parallel, a.rows, b.cols, a.cols);
    gemm_views(dst, dst_rs, dst_cs, a, b, accumulate, threads);
}

/// Whether an [m, k] · [k, n] product may use rayon's threads: when asked
/// and large enough.
pub(crate) fn parallelism(parallel: bool, m: usize, n: usize, k: usize) -> Parallelism {
    if parallel && m * n * k >= PARALLEL_WORK {
        Parallelism::Rayon(0)
    } else {
        Parallelism::None
    }
}

/// [`gemm_strided`] with the threads decided by the caller (a product run
/// in panels decides once, for the whole).
pub(crate) fn gemm_views(
    dst: &mut [f32],
    dst_rs: usize,
    dst_cs: usize,
    a: View,
    b: View,
    accumulate: bool,
    parallelism: Parallelism,
) {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    assert_eq!(b.rows, k, "gemm_into: inner dimensions differ");
    assert!(
        m == 0 || n == 0 || (m - 1) * dst_rs + (n - 1) * dst_cs < dst.len(),
        "gemm_into: destination overruns"
    );
    assert!(a.in_bounds() && b.in_bounds(), "gemm_into: a view overruns");
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            for i in 0..m {
                for j in 0..n {
                    dst[i * dst_rs + j * dst_cs] = 0.0;
                }
            }
        }
        return;
    }
    // SAFETY: the asserts above keep every element of both views (offset +
    // (rows − 1)·rs + (cols − 1)·cs) inside their slices and dst's last
    // element inside dst; dst is borrowed mutably, so it aliases neither.
    unsafe {
        gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            dst_cs as isize,
            dst_rs as isize,
            accumulate,
            a.data.as_ptr().add(a.offset),
            a.cs as isize,
            a.rs as isize,
            b.data.as_ptr().add(b.offset),
            b.cs as isize,
            b.rs as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            parallelism,
        );
    }
}

/// op(a) · op(b) as a fresh [m, n]: op(a) [m, k] (a stored [k, m] when
/// `ta`), op(b) [k, n] (b stored [n, k] when `tb`).
pub fn matmul(a: &[f32], b: &[f32], m: usize, k: usize, n: usize, ta: bool, tb: bool) -> Vec<f32> {
    let mut c = vec![0.0f32; m * n];
    let a = if ta {
        View::new(a, k, m).t()
    } else {
        View::new(a, m, k)
    };
    let b = if tb {
        View::new(b, n, k).t()
    } else {
        View::new(b, k, n)
    };
    gemm_into(&mut c, a, b, false, true);
    c
}

/// The derivative of [`gelu_new`].
pub fn gelu_new_grad(x: f32) -> f32 {
    const C: f32 = 0.797_884_6;
    let u = C * (x + 0.044715 * x * x * x);
    let th = u.tanh();
    0.5 * (1.0 + th) + 0.5 * x * (1.0 - th * th) * C * (1.0 + 3.0 * 0.044715 * x * x)
}

/// RMSNorm's dx from dy, its input x, weight and eps.
pub fn rms_norm_backward(x: &[f32], weight: &[f32], eps: f32, dy: &[f32]) -> Vec<f32> {
    let d = weight.len();
    let mut dx = vec![0.0f32; x.len()];
    for ((xr, dyr), dxr) in x
        .chunks_exact(d)
        .zip(dy.chunks_exact(d))
        .zip(dx.chunks_exact_mut(d))
    {
        let mean = xr.iter().map(|v| v * v).sum::<f32>() / d as f32;
        let r = 1.0 / (mean + eps).sqrt();
        let gx: f32 = xr
            .iter()
            .zip(dyr)
            .zip(weight)
            .map(|((x, dy), w)| w * dy * x)
            .sum();
        for (((o, x), dy), w) in dxr.iter_mut().zip(xr).zip(dyr).zip(weight) {
            *o = r * w * dy - x * r * r * r * gx / d as f32;
        }
    }
    dx
}

/// LayerNorm's dx from dy, its input x, weight and eps:
/// (g − mean(g) − x̂ · mean(g · x̂)) / σ with g = dy · w.
pub fn layer_norm_backward(x: &[f32], weight: &[f32], eps: f32, dy: &[f32]) -> Vec<f32> {
    let d = weight.len();
    let mut dx = vec![0.0f32; x.len()];
    for ((xr, dyr), dxr) in x
        .chunks_exact(d)
        .zip(dy.chunks_exact(d))
        .zip(dx.chunks_exact_mut(d))
    {
        let mean = xr.iter().sum::<f32>() / d as f32;
        let var = xr.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / d as f32;
        let inv = 1.0 / (var + eps).sqrt();
        let (mut g_mean, mut gx_mean) = (0.0f32, 0.0f32);
        for ((x, dy), w) in xr.iter().zip(dyr).zip(weight) {
            let g = dy * w;
            g_mean += g;
            gx_mean += g * (x - mean) * inv;
        }
        g_mean /= d as f32;
        gx_mean /= d as f32;
        for (((o, x), dy), w) in dxr.iter_mut().zip(xr).zip(dyr).zip(weight) {
            let xhat = (x - mean) * inv;
            *o = (dy * w - g_mean - xhat * gx_mean) * inv;
        }
    }
    dx
}
