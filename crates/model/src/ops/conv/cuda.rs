use cudarc::driver::{CudaFunction, CudaViewMut, LaunchConfig, PushKernelArg};

use super::narrow::{direct_forward, direct_kind, direct_wgrad, narrow_grad_input};
use super::partials::add_weight_partials;
pub use super::plan::{ConvAlgorithm, ConvPlan, ConvShape, CONV_SCRATCH_BYTES};
use super::tune::{choose_path, ConvPath, ConvProduct};
use crate::cuda::backend::CudaBackend;
use crate::cuda::gemm::{gemm, Operand};
use crate::cuda::kernels::{self as k, KernelPair, KernelSig};
use crate::cuda::launch::*;
use crate::cuda::params::*;
use crate::cuda::tensor::{checked_len, same_dtype, AnyView, AnyViewMut, CudaTensor, DType};
use crate::cuda::CudaResult;
use crate::ops::linear::cuda::{bias_add, bias_grad_into};

// ---------------------------------------------------------------------------
// Convolution (im2col + cuBLAS) and the fully connected layer

fn images_per_chunk(s: &ConvShape, opix: usize, scratch_bytes: usize, dtype: DType) -> usize {
    let per_image = (opix * s.kk() * dtype.size()).max(1);
    (scratch_bytes / per_image).clamp(1, s.n.max(1))
}

fn im2col(
    be: &CudaBackend,
    x: &CudaTensor,
    p: &ConvParams,
    a: &mut CudaTensor,
    total: usize,
) -> CudaResult<()> {
    let (f, cfg) = per_element(
        be,
        &k::IM2COL,
        &k::IM2COL_V8,
        x.dtype(),
        p.cin as usize,
        total,
    )?;
    // SAFETY: im2col_T(ConvParams, const T* x [n, h, w, cin], T* a), a made
    // with x's type, writes images·oh·ow·kk = total ≤ a.len() elements and
    // reads only images n0..n0+images of x, which the caller checked against
    // x's shape. im2col_v8_f16 does the same 8 at a time: f16, cin % 8 == 0
    // (by_eight), x and a whole tensors, so its 16-byte accesses are aligned.
    unsafe {
        launch(be.compute_stream(), &f, cfg, "im2col", |b| {
            b.arg(p).arg(x).arg(a);
        })
    }?;
    Ok(())
}

/// A per-element kernel over `n` elements in rows of `c` channels: the
/// 8-at-a-time entry point where `by_eight` allows, else the scalar one for
/// `dtype`, with its launch.
fn per_element(
    be: &CudaBackend,
    scalar: &KernelPair,
    eight: &KernelSig,
    dtype: DType,
    c: usize,
    n: usize,
) -> CudaResult<(CudaFunction, LaunchConfig)> {
    if by_eight(dtype, c) {
        Ok((be.function(eight)?, elementwise(n / 8)))
    } else {
        Ok((be.function(scalar.of(dtype))?, elementwise(n)))
    }
}

/// Rows of the implicit kernel's block tile (conv_mma.cu `IC_BM`).
const IMPLICIT_ROWS: usize = 128;

/// Whether conv_mma.cu's kernels take convolution `s` (forward and both
/// gradients): 8-channel vectors of its input, of its output gradient and
/// of its weight must each lie in one tap and be 16-byte aligned (a
/// network's parameters start at multiples of 8 elements of their group,
/// `network.rs::PARAM_ALIGN`), and the GPU must have `mma.m16n8k16` and
/// `cp.async` (`ArchFeatures::implicit_gemm`: sm_80; below, im2col).
fn implicit_takes(be: &CudaBackend, dtype: DType, s: &ConvShape, weight: &AnyView<'_>) -> bool {
    dtype == DType::F16
        && s.cin.is_multiple_of(8)
        && s.cout.is_multiple_of(8)
        && crate::cuda::arch::ArchFeatures::of(be.info().arch()).implicit_gemm()
        && weight.is_aligned_to(be.compute_stream(), 16)
}

/// The rows and taps of one launch of the implicit kernel: the output's
/// pixels and every tap (the forward), or one parity class (py, px) of
/// dx's pixels, (s·y + py, s·x + px), and the taps that reach them,
/// tap_y0 + s·j (the input gradient; conv_mma.cu's header).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct ImplicitProduct {
    /// The grid of the rows, and where its (0, 0) lies in the output.
    row_h: usize,
    row_w: usize,
    row_y0: usize,
    row_x0: usize,
    /// W's first tap along y and x, and how many (a step apart).
    tap_y0: usize,
    tap_x0: usize,
    taps_y: usize,
    taps_x: usize,
}

/// The products of a forward (one) or of an input gradient (one per
/// parity class with pixels: stride² of them, fewer where dx is smaller
/// than the stride).
fn implicit_products(
    s: &ConvShape,
    (oh, ow): (usize, usize),
    transposed: bool,
) -> Vec<ImplicitProduct> {
    if !transposed {
        return vec![ImplicitProduct {
            row_h: oh,
            row_w: ow,
            row_y0: 0,
            row_x0: 0,
            tap_y0: 0,
            tap_x0: 0,
            taps_y: s.k,
            taps_x: s.k,
        }];
    }
    let st = s.stride;
    // (pixels of the class along a side, its first tap, its taps)
    let class = |size: usize, p: usize| {
        let first = (p + s.pad) % st;
        (
            size.saturating_sub(p).div_ceil(st),
            first,
            s.k.saturating_sub(first).div_ceil(st),
        )
    };
    let mut products = Vec::with_capacity(st * st);
    for py in 0..st {
        for px in 0..st {
            let ((row_h, tap_y0, taps_y), (row_w, tap_x0, taps_x)) =
                (class(s.h, py), class(s.w, px));
            if row_h * row_w > 0 {
                products.push(ImplicitProduct {
                    row_h,
                    row_w,
                    row_y0: py,
                    row_x0: px,
                    tap_y0,
                    tap_x0,
                    taps_y,
                    taps_x,
                });
            }
        }
    }
    products
}

/// The implicit kernel's product `out = gather(src) · B(weight)`, forward
/// (`transposed` false: src is x, out is y) or for the input gradient
/// (src is dy, out is dx, a launch per parity class of its pixels).
fn implicit_conv(
    be: &CudaBackend,
    src: &CudaTensor,
    weight: &AnyView<'_>,
    out: &mut CudaTensor,
    s: &ConvShape,
    (oh, ow): (usize, usize),
    transposed: bool,
) -> CudaResult<()> {
    // (gathered channels, its size, output channels, output size)
    let (chans, (src_h, src_w), cols, (out_h, out_w)) = if transposed {
        (s.cout, (oh, ow), s.cin, (s.h, s.w))
    } else {
        (s.cin, (s.h, s.w), s.cout, (oh, ow))
    };
    // Forward B[(tap, ci), co] = W[tap, ci, co]; transposed B[(tap, co), ci]
    // = W[tap, ci, co].
    let (b_chan_stride, b_col_stride) = if transposed { (1, s.cout) } else { (s.cout, 1) };
    let (sig, tile_cols) = match (transposed, cols <= 32) {
        (false, true) => (&k::IMPLICIT_CONV_N32, 32),
        (false, false) => (&k::IMPLICIT_CONV_N64, 64),
        (true, true) => (&k::IMPLICIT_DGRAD_N32, 32),
        (true, false) => (&k::IMPLICIT_DGRAD_N64, 64),
    };
    let f = be.function(sig)?;
    let by = |d: usize| FastDiv::new(d.max(1) as u32);
    for c in implicit_products(s, (oh, ow), transposed) {
        let rows = s.n * c.row_h * c.row_w;
        let p = ImplicitConvParams {
            rows: rows as u32,
            cols: cols as u32,
            depth: (c.taps_y * c.taps_x * chans) as u32,
            chans: chans as u32,
            src_h: src_h as u32,
            src_w: src_w as u32,
            row_h: c.row_h as u32,
            row_w: c.row_w as u32,
            out_h: out_h as u32,
            out_w: out_w as u32,
            step: if transposed { s.stride as u32 } else { 1 },
            row_y0: c.row_y0 as u32,
            row_x0: c.row_x0 as u32,
            tap_y0: c.tap_y0 as u32,
            tap_x0: c.tap_x0 as u32,
            taps_x: c.taps_x as u32,
            k: s.k as u32,
            stride: s.stride as u32,
            pad: s.pad as u32,
            transposed: transposed as u32,
            b_chan_stride: b_chan_stride as u32,
            b_col_stride: b_col_stride as u32,
            by_row_pix: by(c.row_h * c.row_w),
            by_row_w: by(c.row_w),
            by_chans: by(chans),
            by_taps_x: by(c.taps_x),
            by_stride: by(s.stride),
        };
        let cfg = LaunchConfig {
            grid_dim: (
                u32_of("implicit conv", rows.div_ceil(IMPLICIT_ROWS))?,
                u32_of("implicit conv", cols.div_ceil(tile_cols))?,
                1,
            ),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: implicit_conv_nBN_f16 / implicit_dgrad_nBN_f16
        // (ImplicitConvParams, const half* src, const half* w, half* out):
        // src is a whole f16 tensor (256-byte aligned, as the kernel's
        // 16-byte gathers need) of n·src_h·src_w·chans elements, w holds
        // k·k·cin·cout, out is a whole tensor of n·out_h·out_w·cols; the
        // rows of a product are pixels of out and its taps taps of W, so the
        // kernel reads and writes only inside those (the caller checked the
        // shapes, and implicit_takes the channel multiples of 8 and the
        // architecture).
        unsafe {
            launch(be.compute_stream(), &f, cfg, "implicit conv", |b| {
                b.arg(&p).arg(src).arg(weight).arg(&mut *out);
            })
        }?;
    }
    Ok(())
}

/// Blocks the implicit weight gradient aims for: the pixels are split until
/// its grid has about this many (a constant, not the GPU's SM count, so
/// the sum's order and bits do not depend on the GPU).
const WGRAD_TARGET_BLOCKS: usize = 512;
/// Pixels the weight-gradient kernel sums per step (conv_mma.cu `WG_BM`),
/// and the rows of dW in its block tile (`WG_BK`).
const WGRAD_STEP: usize = 32;
const WGRAD_ROWS: usize = 64;

/// dW += Aᵀ·dY by conv_mma.cu's kernel: `splits` blocks along the pixels
/// each write an f32 partial of dW (at most `workspace` bytes of them,
/// at least one split), which `wgrad_reduce` adds to dW in split order.
fn implicit_wgrad(
    be: &CudaBackend,
    x: &CudaTensor,
    dy: &CudaTensor,
    weight_grad: &mut CudaViewMut<'_, f32>,
    s: &ConvShape,
    (oh, ow): (usize, usize),
    workspace: usize,
) -> CudaResult<()> {
    let by = |d: usize| FastDiv::new(d as u32);
    let rows = s.n * oh * ow;
    let depth = s.kk();
    let dw_len = depth * s.cout;
    let (sig, tile_cols) = if s.cout <= 32 {
        (&k::IMPLICIT_WGRAD_N32, 32)
    } else if s.cout.is_multiple_of(128) {
        (&k::IMPLICIT_WGRAD_N128, 128)
    } else {
        (&k::IMPLICIT_WGRAD_N64, 64)
    };
    let tiles = depth.div_ceil(WGRAD_ROWS) * s.cout.div_ceil(tile_cols);
    let steps = rows.div_ceil(WGRAD_STEP);
    let room = (workspace / (dw_len * 4)).max(1);
    let wanted = WGRAD_TARGET_BLOCKS
        .div_ceil(tiles)
        .clamp(1, steps)
        .min(room);
    let rows_per_split = steps.div_ceil(wanted) * WGRAD_STEP;
    let splits = rows.div_ceil(rows_per_split);
    checked_len("implicit weight gradient", &[splits, dw_len])?;
    let mut partial = CudaTensor::uninit(be, &[splits * dw_len], DType::F32)?;
    let p = WgradParams {
        rows: rows as u32,
        depth: depth as u32,
        cout: s.cout as u32,
        cin: s.cin as u32,
        h: s.h as u32,
        w: s.w as u32,
        opix: (oh * ow) as u32,
        ow: ow as u32,
        k: s.k as u32,
        stride: s.stride as u32,
        pad: s.pad as u32,
        rows_per_split: rows_per_split as u32,
        by_opix: by(oh * ow),
        by_ow: by(ow),
        by_cin: by(s.cin),
        by_k: by(s.k),
    };
    let f = be.function(sig)?;
    let cfg = LaunchConfig {
        grid_dim: (
            depth.div_ceil(WGRAD_ROWS) as u32,
            s.cout.div_ceil(tile_cols) as u32,
            splits as u32,
        ),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: implicit_wgrad_nBN_f16(WgradParams, const half* x, const half*
    // dy, float* partial): x [n, h, w, cin] and dy [n, oh, ow, cout] are
    // whole f16 tensors (256-byte aligned for the 16-byte loads; the caller
    // checked their shapes, implicit_takes the multiples of 8), and block z
    // writes only its depth·cout slice of partial, which holds splits of them.
    unsafe {
        launch(
            be.compute_stream(),
            &f,
            cfg,
            "implicit weight gradient",
            |b| {
                b.arg(&p).arg(x).arg(dy).arg(&mut partial);
            },
        )
    }?;
    add_weight_partials(be, &partial, weight_grad, splits)
}

/// y = conv(x, W) (+ bias), [n, oh, ow, cout] in x's type.
pub fn conv2d_forward(
    be: &CudaBackend,
    x: &CudaTensor,
    weight: &AnyView<'_>,
    bias: Option<&AnyView<'_>>,
    s: ConvShape,
    plan: ConvPlan,
) -> CudaResult<CudaTensor> {
    let (oh, ow) = s.check(x, weight.len())?;
    let dtype = x.dtype();
    same_dtype("conv2d", dtype, &[weight.dtype()])?;
    let opix = oh * ow;
    let mut y = CudaTensor::uninit(be, &[s.n, oh, ow, s.cout], dtype)?;
    if y.is_empty() {
        return Ok(y);
    }
    if s.is_pointwise() {
        gemm(
            be,
            s.n * opix,
            s.cout,
            s.cin,
            &x.view(),
            Operand {
                transpose: false,
                ld: s.cin,
            },
            weight,
            Operand {
                transpose: false,
                ld: s.cout,
            },
            &mut y.view_mut(),
            s.cout,
            1.0,
            0.0,
        )?;
    } else if let Some(kind) = direct_kind(be, plan, dtype, &s, weight) {
        direct_forward(be, x, weight, &mut y, &s, (oh, ow), kind)?;
    } else {
        let takes = implicit_takes(be, dtype, &s, weight);
        let run = |path| forward_by(be, path, x, weight, &mut y, &s, (oh, ow), plan.workspace);
        let path = choose_path(be, plan, takes, &s, ConvProduct::Forward, run)?;
        forward_by(be, path, x, weight, &mut y, &s, (oh, ow), plan.workspace)?;
    }
    if let Some(bias) = bias {
        same_len("conv2d", "bias", s.cout, bias.len())?;
        bias_add(be, &mut y.view_mut(), bias)?;
    }
    Ok(y)
}

/// y = conv(x, W) by `path`, the batch through an im2col workspace of at
/// most `workspace` bytes in groups of whole images.
#[allow(clippy::too_many_arguments)]
fn forward_by(
    be: &CudaBackend,
    path: ConvPath,
    x: &CudaTensor,
    weight: &AnyView<'_>,
    y: &mut CudaTensor,
    s: &ConvShape,
    (oh, ow): (usize, usize),
    workspace: usize,
) -> CudaResult<()> {
    if path == ConvPath::Implicit {
        return implicit_conv(be, x, weight, y, s, (oh, ow), false);
    }
    let (opix, kk, dtype) = (oh * ow, s.kk(), x.dtype());
    let ipc = images_per_chunk(s, opix, workspace, dtype);
    let mut a = CudaTensor::uninit(be, &[ipc * opix * kk], dtype)?;
    for n0 in (0..s.n).step_by(ipc) {
        let images = ipc.min(s.n - n0);
        let p = s.params(oh, ow, n0, images);
        im2col(be, x, &p, &mut a, images * opix * kk)?;
        let rows = images * opix;
        let mut y_all = y.view_mut();
        let mut yv = y_all.slice_mut(n0 * opix * s.cout..(n0 + images) * opix * s.cout);
        gemm(
            be,
            rows,
            s.cout,
            kk,
            &a.view().slice(0..rows * kk),
            Operand {
                transpose: false,
                ld: kk,
            },
            weight,
            Operand {
                transpose: false,
                ld: s.cout,
            },
            &mut yv,
            s.cout,
            1.0,
            0.0,
        )?;
    }
    Ok(())
}

/// Backward: dW += Aᵀ·dY (f32, accumulated), db += Σ dY, returns dX.
#[allow(clippy::too_many_arguments)]
pub fn conv2d_backward(
    be: &CudaBackend,
    x: &CudaTensor,
    dy: &CudaTensor,
    weight: &AnyView<'_>,
    weight_grad: &mut CudaViewMut<'_, f32>,
    bias_grad: Option<&mut CudaViewMut<'_, f32>>,
    s: ConvShape,
    plan: ConvPlan,
) -> CudaResult<CudaTensor> {
    let mut dx = CudaTensor::uninit(be, x.shape(), x.dtype())?;
    let dx_out = Some(&mut dx);
    conv2d_backward_into(be, x, dy, weight, weight_grad, bias_grad, dx_out, s, plan)?;
    Ok(dx)
}

/// Backward without dX: dW += Aᵀ·dY, db += Σ dY (a network's first layer,
/// whose input no gradient is wanted for).
#[allow(clippy::too_many_arguments)]
pub fn conv2d_backward_params(
    be: &CudaBackend,
    x: &CudaTensor,
    dy: &CudaTensor,
    weight: &AnyView<'_>,
    weight_grad: &mut CudaViewMut<'_, f32>,
    bias_grad: Option<&mut CudaViewMut<'_, f32>>,
    s: ConvShape,
    plan: ConvPlan,
) -> CudaResult<()> {
    conv2d_backward_into(be, x, dy, weight, weight_grad, bias_grad, None, s, plan)
}

/// dW and db accumulated, and dX overwritten when `input_grad` is given.
#[allow(clippy::too_many_arguments)]
fn conv2d_backward_into(
    be: &CudaBackend,
    x: &CudaTensor,
    dy: &CudaTensor,
    weight: &AnyView<'_>,
    weight_grad: &mut CudaViewMut<'_, f32>,
    bias_grad: Option<&mut CudaViewMut<'_, f32>>,
    mut input_grad: Option<&mut CudaTensor>,
    s: ConvShape,
    plan: ConvPlan,
) -> CudaResult<()> {
    let (oh, ow) = s.check(x, weight.len())?;
    let dtype = x.dtype();
    same_dtype("conv2d backward", dtype, &[dy.dtype(), weight.dtype()])?;
    dy.expect_shape("conv2d backward", &[s.n, oh, ow, s.cout])?;
    same_len(
        "conv2d backward",
        "weight gradient",
        weight.len(),
        weight_grad.len(),
    )?;
    let opix = oh * ow;
    if let Some(db) = bias_grad {
        same_len("conv2d backward", "bias gradient", s.cout, db.len())?;
        bias_grad_into(be, dy, db)?;
    }
    if dy.is_empty() {
        // No output pixels: the input gradient is zero.
        if let Some(dx) = input_grad {
            *dx = CudaTensor::zeros(be, x.shape(), dtype)?;
        }
        return Ok(());
    }
    let w_t = Operand {
        transpose: true,
        ld: s.cout,
    };
    if s.is_pointwise() {
        // dW[cin × cout] += xᵀ · dY
        gemm(
            be,
            s.cin,
            s.cout,
            s.n * opix,
            &x.view(),
            Operand {
                transpose: true,
                ld: s.cin,
            },
            &dy.view(),
            Operand {
                transpose: false,
                ld: s.cout,
            },
            &mut AnyViewMut::F32(weight_grad.slice_mut(..)),
            s.cout,
            1.0,
            1.0,
        )?;
        // dX[n·h·w × cin] = dY · Wᵀ
        if let Some(dx) = input_grad {
            gemm(
                be,
                s.n * opix,
                s.cin,
                s.cout,
                &dy.view(),
                Operand {
                    transpose: false,
                    ld: s.cout,
                },
                weight,
                w_t,
                &mut dx.view_mut(),
                s.cin,
                1.0,
                0.0,
            )?;
        }
        return Ok(());
    }
    if let Some(kind) = direct_kind(be, plan, dtype, &s, weight) {
        direct_wgrad(be, x, dy, weight_grad, &s, (oh, ow), plan.workspace, kind)?;
        // The narrow kernels' gather takes any cout: the thin shapes' too.
        if let Some(dx) = input_grad {
            narrow_grad_input(be, dy, weight, dx, &s, (oh, ow))?;
        }
        return Ok(());
    }
    let takes = implicit_takes(be, dtype, &s, weight);
    let out = (oh, ow);
    let wgrad_trial = |path| {
        // Timed into a scratch gradient: the product accumulates.
        let mut scratch = CudaTensor::zeros(be, &[weight_grad.len()], DType::F32)?;
        let mut dw = scratch.f32_mut()?.slice_mut(..);
        weight_grad_by(be, path, x, dy, weight, &mut dw, &s, out, plan.workspace)
    };
    let wgrad_path = choose_path(be, plan, takes, &s, ConvProduct::WeightGrad, wgrad_trial)?;
    let dgrad_path = match input_grad.as_deref_mut() {
        Some(dx) => {
            let trial = |path| input_grad_by(be, path, dy, weight, dx, &s, out, plan.workspace);
            Some(choose_path(
                be,
                plan,
                takes,
                &s,
                ConvProduct::InputGrad,
                trial,
            )?)
        }
        None => None,
    };
    let mut im2col_dw = None;
    match wgrad_path {
        ConvPath::Implicit => implicit_wgrad(be, x, dy, weight_grad, &s, out, plan.workspace)?,
        ConvPath::Im2col => im2col_dw = Some((x, weight_grad)),
    }
    let mut im2col_dx = None;
    if let Some(dx) = input_grad {
        match dgrad_path {
            Some(ConvPath::Implicit) => implicit_conv(be, dy, weight, dx, &s, out, true)?,
            _ => im2col_dx = Some(dx),
        }
    }
    // Both products by im2col share each group's matrix (as before tuning).
    im2col_backward(
        be,
        dy,
        weight,
        im2col_dw,
        im2col_dx,
        &s,
        out,
        plan.workspace,
    )
}

/// dW += Aᵀ·dY by `path`.
#[allow(clippy::too_many_arguments)]
fn weight_grad_by(
    be: &CudaBackend,
    path: ConvPath,
    x: &CudaTensor,
    dy: &CudaTensor,
    weight: &AnyView<'_>,
    weight_grad: &mut CudaViewMut<'_, f32>,
    s: &ConvShape,
    out: (usize, usize),
    workspace: usize,
) -> CudaResult<()> {
    match path {
        ConvPath::Implicit => implicit_wgrad(be, x, dy, weight_grad, s, out, workspace),
        ConvPath::Im2col => im2col_backward(
            be,
            dy,
            weight,
            Some((x, weight_grad)),
            None,
            s,
            out,
            workspace,
        ),
    }
}

/// dX = the input gradient by `path` (x is not read: its shape is dX's).
#[allow(clippy::too_many_arguments)]
fn input_grad_by(
    be: &CudaBackend,
    path: ConvPath,
    dy: &CudaTensor,
    weight: &AnyView<'_>,
    dx: &mut CudaTensor,
    s: &ConvShape,
    out: (usize, usize),
    workspace: usize,
) -> CudaResult<()> {
    match path {
        ConvPath::Implicit => implicit_conv(be, dy, weight, dx, s, out, true),
        ConvPath::Im2col => im2col_backward(be, dy, weight, None, Some(dx), s, out, workspace),
    }
}

/// The backward's products by im2col + cuBLAS, a group of whole images at
/// a time through a workspace of at most `workspace` bytes: dW += Aᵀ·dY
/// where `weight_grad` (x, dW) is given, dX = col2im(dY·Wᵀ) where `dx` is.
/// When both are, each group's matrix serves both (A, then dA in its place).
#[allow(clippy::too_many_arguments)]
fn im2col_backward(
    be: &CudaBackend,
    dy: &CudaTensor,
    weight: &AnyView<'_>,
    mut weight_grad: Option<(&CudaTensor, &mut CudaViewMut<'_, f32>)>,
    mut dx: Option<&mut CudaTensor>,
    s: &ConvShape,
    (oh, ow): (usize, usize),
    workspace: usize,
) -> CudaResult<()> {
    if weight_grad.is_none() && dx.is_none() {
        return Ok(());
    }
    let (opix, kk, dtype) = (oh * ow, s.kk(), dy.dtype());
    let ipc = images_per_chunk(s, opix, workspace, dtype);
    let mut a = CudaTensor::uninit(be, &[ipc * opix * kk], dtype)?;
    for n0 in (0..s.n).step_by(ipc) {
        let images = ipc.min(s.n - n0);
        let rows = images * opix;
        let p = s.params(oh, ow, n0, images);
        let dy_all = dy.view();
        let dy_rows = dy_all.slice(n0 * opix * s.cout..(n0 + images) * opix * s.cout);
        // dW[K × cout] += Aᵀ · dY for this group of images.
        if let Some((x, dw)) = weight_grad.as_mut() {
            im2col(be, x, &p, &mut a, rows * kk)?;
            gemm(
                be,
                kk,
                s.cout,
                rows,
                &a.view().slice(0..rows * kk),
                Operand {
                    transpose: true,
                    ld: kk,
                },
                &dy_rows,
                Operand {
                    transpose: false,
                    ld: s.cout,
                },
                &mut AnyViewMut::F32(dw.slice_mut(..)),
                s.cout,
                1.0,
                1.0,
            )?;
        }
        let Some(dx) = dx.as_deref_mut() else {
            continue;
        };
        // dA = dY · Wᵀ into the same scratch (stream order: after a dW
        // product has read A), then col2im into dX.
        {
            let mut a_all = a.view_mut();
            let mut av = a_all.slice_mut(0..rows * kk);
            gemm(
                be,
                rows,
                kk,
                s.cout,
                &dy_rows,
                Operand {
                    transpose: false,
                    ld: s.cout,
                },
                weight,
                Operand {
                    transpose: true,
                    ld: s.cout,
                },
                &mut av,
                kk,
                1.0,
                0.0,
            )?;
        }
        let total = images * s.h * s.w * s.cin;
        let (col2im, cfg) = per_element(be, &k::COL2IM, &k::COL2IM_V8, dtype, s.cin, total)?;
        // SAFETY: col2im_T(ConvParams, const T* da [rows, kk], T* dx
        // [n, h, w, cin]) reads rows·kk ≤ a.len() elements and writes the
        // `images` images from n0 of dx, inside its n images; col2im_v8_f16
        // the same 8 at a time (by_eight: aligned 16-byte accesses).
        unsafe {
            launch(be.compute_stream(), &col2im, cfg, "col2im", |b| {
                b.arg(&p).arg(&a).arg(dx);
            })
        }?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conv_shapes_and_chunking() {
        let s = ConvShape {
            n: 128,
            h: 28,
            w: 28,
            cin: 32,
            cout: 64,
            k: 3,
            stride: 2,
            pad: 1,
        };
        assert_eq!(s.out_hw().unwrap(), (14, 14));
        assert_eq!(s.kk(), 288);
        // 196 pixels × 288 columns × 2 B = 112,896 B per image in f16,
        // twice that in f32.
        assert_eq!(
            images_per_chunk(&s, 196, CONV_SCRATCH_BYTES, DType::F16),
            128
        );
        assert_eq!(images_per_chunk(&s, 196, 1_000_000, DType::F16), 8);
        assert_eq!(images_per_chunk(&s, 196, 1_000_000, DType::F32), 4);
        assert_eq!(images_per_chunk(&s, 196, 1, DType::F16), 1);
        let bad = ConvShape { k: 40, ..s };
        assert!(bad.out_hw().is_err());
    }

    /// The input gradient's parity classes: every pixel of dx in exactly
    /// one, and a class's taps exactly those that reach its pixels, those
    /// (ky, kx) with iy + pad − ky and ix + pad − kx multiples of the
    /// stride (the kernel still checks that the dy position is inside).
    #[test]
    fn input_gradient_classes_take_every_tap_that_reaches_a_pixel() {
        for (h, w, k, stride, pad) in [
            (28, 28, 3, 2, 1),
            (5, 7, 3, 2, 1),
            (8, 8, 3, 3, 2),
            (7, 6, 1, 2, 0),
            (6, 6, 2, 2, 0),
            (1, 5, 3, 2, 1),
            (9, 9, 5, 1, 0),
            (10, 11, 5, 3, 2),
        ] {
            let s = ConvShape {
                n: 1,
                h,
                w,
                cin: 8,
                cout: 8,
                k,
                stride,
                pad,
            };
            let out = s.out_hw().unwrap();
            let mut seen = vec![0; h * w];
            for c in implicit_products(&s, out, true) {
                let taps = |first: usize, count: usize| -> Vec<usize> {
                    (0..count).map(|j| first + stride * j).collect()
                };
                let (tys, txs) = (taps(c.tap_y0, c.taps_y), taps(c.tap_x0, c.taps_x));
                for y in 0..c.row_h {
                    for x in 0..c.row_w {
                        let (iy, ix) = (c.row_y0 + stride * y, c.row_x0 + stride * x);
                        seen[iy * w + ix] += 1;
                        let reach = |i: usize| -> Vec<usize> {
                            (0..k)
                                .filter(|kk| (i + pad).abs_diff(*kk) % stride == 0)
                                .collect()
                        };
                        assert_eq!(tys, reach(iy), "{s:?}: taps of row {iy}");
                        assert_eq!(txs, reach(ix), "{s:?}: taps of column {ix}");
                    }
                }
            }
            assert!(seen.iter().all(|&n| n == 1), "{s:?}: {seen:?}");
        }
        let forward = implicit_products(
            &ConvShape {
                n: 2,
                h: 9,
                w: 9,
                cin: 8,
                cout: 8,
                k: 3,
                stride: 2,
                pad: 1,
            },
            (5, 5),
            false,
        );
        assert_eq!(forward.len(), 1);
        assert_eq!((forward[0].taps_y, forward[0].taps_x), (3, 3));
    }
}
