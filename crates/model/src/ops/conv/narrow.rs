//! Convolutions to fewer than 8 output channels (`conv_narrow.cu`),
//! which `ConvAlgorithm::Auto` runs directly instead of through im2col and
//! a matrix product one to seven columns wide (see the `.cu` file for why).
//! Forward, input gradient and weight gradient, each against the CPU layer
//! in `tests/cuda_parity/conv.rs::narrow_convolution_matches_the_cpu_layer`. And
//! convolutions from few input channels to a multiple of 8 (a network's
//! first layer), whose im2col product is a few columns deep: the thin
//! kernels, `tests/cuda_parity/conv.rs::thin_convolution_matches_the_cpu_layer`.

use cudarc::driver::{CudaViewMut, LaunchConfig, PushKernelArg};

use super::partials::add_weight_partials;
use super::plan::{ConvPlan, ConvShape};
use crate::cuda::backend::CudaBackend;
use crate::cuda::kernels as k;
use crate::cuda::launch::{elementwise, launch, BLOCK};
use crate::cuda::params::{FastDiv, NarrowParams};
use crate::cuda::tensor::checked_len;
use crate::cuda::tensor::{AnyView, CudaTensor, DType};
use crate::cuda::CudaResult;

/// Output channels the narrow kernels hold in registers (`NARROW_COUT`).
const NARROW_COUT: usize = 7;

/// The weight gradient's pixels are split this many ways (fewer when there
/// are fewer than `MIN_SPLIT_ROWS` pixels a split): a constant, so that the
/// partial sums, and so the bits, depend on the shape alone.
const SPLITS: usize = 1024;
const MIN_SPLIT_ROWS: usize = 256;

fn params(s: &ConvShape, (oh, ow): (usize, usize), rows_per_split: usize) -> NarrowParams {
    let by = |d: usize| FastDiv::new(d as u32);
    NarrowParams {
        n: s.n as u32,
        h: s.h as u32,
        w: s.w as u32,
        cin: s.cin as u32,
        cout: s.cout as u32,
        oh: oh as u32,
        ow: ow as u32,
        k: s.k as u32,
        stride: s.stride as u32,
        pad: s.pad as u32,
        rows_per_split: rows_per_split as u32,
        by_opix: by(oh * ow),
        by_ow: by(ow),
        by_hw: by(s.h * s.w),
        by_w: by(s.w),
        by_cin: by(s.cin),
        by_cout: by(s.cout),
        by_stride: by(s.stride),
    }
}

/// Threads of a thin weight-gradient block (`THIN_THREADS`): each holds 8
/// outputs of one (tap, input channel), so a block takes shapes of at most
/// this many k·k·cin·cout/8.
const THIN_THREADS: usize = 256;

/// The direct kernels of conv_narrow.cu that `Auto` (and `Tune`) runs a convolution
/// with, where a matrix product would be a few columns wide or deep.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Direct {
    /// To fewer than 8 outputs (`NARROW_COUT`), f16 or f32: a thread per
    /// output pixel, per input element, per weight.
    Narrow,
    /// f16 from input channels not a multiple of 8 (the implicit kernels
    /// take those) to a multiple of 8 outputs (16-byte rows of y, W and dy,
    /// W on 16 bytes), at most `THIN_THREADS` groups of (tap, input
    /// channel, 8 outputs): a first layer.
    Thin,
}

/// Which direct kernels `Auto` runs convolution `s` with, if any (a 1×1
/// one with stride 1 and no padding is a plain matrix product before
/// this).
pub(super) fn direct_kind(
    be: &CudaBackend,
    plan: ConvPlan,
    dtype: DType,
    s: &ConvShape,
    weight: &AnyView<'_>,
) -> Option<Direct> {
    if !plan.algorithm.by_shape() || s.is_pointwise() {
        None
    } else if s.cout <= NARROW_COUT {
        Some(Direct::Narrow)
    } else if dtype == DType::F16
        && !s.cin.is_multiple_of(8)
        && s.cout.is_multiple_of(8)
        && s.kk() * s.cout / 8 <= THIN_THREADS
        && weight.is_aligned_to(be.compute_stream(), 16)
    {
        Some(Direct::Thin)
    } else {
        None
    }
}

/// y [n, oh, ow, cout] = conv(x, W) in x's type by `kind`'s forward.
pub(super) fn direct_forward(
    be: &CudaBackend,
    x: &CudaTensor,
    weight: &AnyView<'_>,
    y: &mut CudaTensor,
    s: &ConvShape,
    out: (usize, usize),
    kind: Direct,
) -> CudaResult<()> {
    checked_len("direct convolution", &[s.n, s.h, s.w, s.cin])?;
    let total = checked_len("direct convolution", &[s.n, out.0, out.1, s.cout])?;
    let p = params(s, out, 0);
    let (f, threads) = match kind {
        Direct::Narrow => (
            be.function(k::NARROW_FORWARD.of(x.dtype()))?,
            total / s.cout,
        ),
        Direct::Thin => (be.function(&k::THIN_FORWARD)?, total / 8),
    };
    // SAFETY: narrow_forward_T / thin_forward_f16 (NarrowParams, const T* x
    // [n, h, w, cin], const T* w [k, k, cin, cout], T* y [n, oh, ow, cout]):
    // the caller checked x's and W's shapes and made y in x's type; every
    // index fits in 32 bits (ConvShape::check and the checks above).
    // narrow: a thread per output pixel, cout ≤ NARROW_COUT. thin
    // (direct_kind): f16, cout a multiple of 8 and W on 16 bytes (y is a
    // whole tensor), so the 16-byte accesses are aligned; a thread per 8
    // outputs.
    unsafe {
        launch(
            be.compute_stream(),
            &f,
            elementwise(threads),
            "direct convolution forward",
            |b| {
                b.arg(&p).arg(x).arg(weight).arg(y);
            },
        )
    }?;
    Ok(())
}

/// The weight gradient's splits of the output pixels (at most `SPLITS`,
/// at least `MIN_SPLIT_ROWS` pixels each where there are that many, no
/// more partial sums than `workspace` holds): (splits, pixels a split,
/// weights).
fn wgrad_splits(
    s: &ConvShape,
    out: (usize, usize),
    workspace: usize,
) -> CudaResult<(usize, usize, usize)> {
    let rows = s.n * out.0 * out.1;
    let n_w = s.kk() * s.cout;
    let room = (workspace / (n_w * 4)).max(1);
    let splits = rows.div_ceil(MIN_SPLIT_ROWS).clamp(1, SPLITS).min(room);
    let rows_per_split = rows.div_ceil(splits);
    let splits = rows.div_ceil(rows_per_split);
    checked_len("convolution weight gradient", &[splits, n_w])?;
    Ok((splits, rows_per_split, n_w))
}

/// dX [n, h, w, cin] = the input gradient of dy, overwritten.
pub(super) fn narrow_grad_input(
    be: &CudaBackend,
    dy: &CudaTensor,
    weight: &AnyView<'_>,
    dx: &mut CudaTensor,
    s: &ConvShape,
    out: (usize, usize),
) -> CudaResult<()> {
    let total = checked_len("narrow convolution", &[s.n, s.h, s.w, s.cin])?;
    let p = params(s, out, 0);
    let f = be.function(k::NARROW_GRAD_INPUT.of(dy.dtype()))?;
    // SAFETY: narrow_grad_input_T(NarrowParams, const T* dy [n, oh, ow,
    // cout], const T* w, T* dx [n, h, w, cin]): shapes checked by the
    // caller (dx made like x), one thread per element of dx, each written
    // once.
    unsafe {
        launch(
            be.compute_stream(),
            &f,
            elementwise(total),
            "narrow convolution input gradient",
            |b| {
                b.arg(&p).arg(dy).arg(weight).arg(dx);
            },
        )
    }?;
    Ok(())
}

/// dW [k, k, cin, cout] += the weight gradient by `kind`'s kernel: f32
/// partial sums over fixed splits of the output pixels, then
/// `wgrad_reduce` adds them in split order (no atomics: the same bits
/// every run).
#[allow(clippy::too_many_arguments)]
pub(super) fn direct_wgrad(
    be: &CudaBackend,
    x: &CudaTensor,
    dy: &CudaTensor,
    weight_grad: &mut CudaViewMut<'_, f32>,
    s: &ConvShape,
    out: (usize, usize),
    workspace: usize,
    kind: Direct,
) -> CudaResult<()> {
    let (splits, rows_per_split, n_w) = wgrad_splits(s, out, workspace)?;
    let mut partial = CudaTensor::uninit(be, &[splits * n_w], DType::F32)?;
    let p = params(s, out, rows_per_split);
    let (f, grid_dim, block) = match kind {
        Direct::Narrow => (
            be.function(k::NARROW_WGRAD.of(x.dtype()))?,
            (n_w.div_ceil(BLOCK as usize) as u32, splits as u32, 1),
            BLOCK,
        ),
        Direct::Thin => (
            be.function(&k::THIN_WGRAD)?,
            (splits as u32, 1, 1),
            THIN_THREADS as u32,
        ),
    };
    let cfg = LaunchConfig {
        grid_dim,
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: narrow_wgrad_T / thin_wgrad_f16 (NarrowParams, const T* x,
    // const T* dy, float* partial [splits, k·k·cin·cout]): shapes checked
    // by the caller. narrow: block row y writes only its split's n_w
    // partials, threads past n_w return, and splits ≤ SPLITS keeps grid y
    // under 65536. thin (direct_kind): k·k·cin·cout/8 ≤ THIN_THREADS, the
    // block's width, dy's rows of cout (a multiple of 8) on 16 bytes, and
    // block x writes only its split's n_w partials.
    unsafe {
        launch(
            be.compute_stream(),
            &f,
            cfg,
            "direct weight gradient",
            |b| {
                b.arg(&p).arg(x).arg(dy).arg(&mut partial);
            },
        )
    }?;
    add_weight_partials(be, &partial, weight_grad, splits)
}
