use cudarc::driver::{CudaView, CudaViewMut, PushKernelArg};
use half::f16;

use crate::cuda::backend::CudaBackend;
use crate::cuda::kernels::{self as k};
use crate::cuda::launch::*;
use crate::cuda::params::*;
use crate::cuda::tensor::{checked_len, CudaTensor, DType};
use crate::cuda::{CudaError, CudaResult};

// ---------------------------------------------------------------------------
// Casts and input normalisation

/// f32 → f16 between views of equal length.
pub fn cast_f32_to_f16_into(
    be: &CudaBackend,
    x: &CudaView<'_, f32>,
    y: &mut CudaViewMut<'_, f16>,
) -> CudaResult<()> {
    same_len("cast_f32_to_f16", "output", x.len(), y.len())?;
    let n = x.len();
    if n == 0 {
        return Ok(());
    }
    let p = CastParams {
        n: u32_of("cast_f32_to_f16", n)?,
    };
    let f = be.function(&k::CAST_F32_TO_F16)?;
    // SAFETY: cast_f32_to_f16(CastParams, const float*, hr_half*); x and y
    // hold n elements each.
    unsafe {
        launch(
            be.compute_stream(),
            &f,
            elementwise(n),
            "cast_f32_to_f16",
            |b| {
                b.arg(&p).arg(x).arg(y);
            },
        )
    }?;
    Ok(())
}

/// f16 → f32 between views of equal length.
pub fn cast_f16_to_f32_into(
    be: &CudaBackend,
    x: &CudaView<'_, f16>,
    y: &mut CudaViewMut<'_, f32>,
) -> CudaResult<()> {
    same_len("cast_f16_to_f32", "output", x.len(), y.len())?;
    let n = x.len();
    if n == 0 {
        return Ok(());
    }
    let p = CastParams {
        n: u32_of("cast_f16_to_f32", n)?,
    };
    let f = be.function(&k::CAST_F16_TO_F32)?;
    // SAFETY: cast_f16_to_f32(CastParams, const hr_half*, float*); x and y
    // hold n elements each.
    unsafe {
        launch(
            be.compute_stream(),
            &f,
            elementwise(n),
            "cast_f16_to_f32",
            |b| {
                b.arg(&p).arg(x).arg(y);
            },
        )
    }?;
    Ok(())
}

pub fn cast_f32_to_f16(be: &CudaBackend, x: &CudaTensor) -> CudaResult<CudaTensor> {
    let mut y = CudaTensor::uninit(be, x.shape(), DType::F16)?;
    cast_f32_to_f16_into(be, &x.f32_view()?, &mut y.f16_view_mut()?)?;
    Ok(y)
}

pub fn cast_f16_to_f32(be: &CudaBackend, x: &CudaTensor) -> CudaResult<CudaTensor> {
    let mut y = CudaTensor::uninit(be, x.shape(), DType::F32)?;
    cast_f16_to_f32_into(be, &x.f16_view()?, &mut y.f32_view_mut()?)?;
    Ok(y)
}

/// How u8 pixels become a network input: (x/255 - mean)/std, stored as
/// `dtype` (the network's activations).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Normalization {
    pub mean: f32,
    pub std: f32,
    pub dtype: DType,
}

/// u8 pixels (already on the device) → the network's input, computed as
/// the CPU's `Tensor::from_u8_normalized` does: x·(1/(255·std)) - mean/std.
pub fn normalize_u8(
    be: &CudaBackend,
    pixels: &CudaView<'_, u8>,
    shape: &[usize],
    norm: Normalization,
) -> CudaResult<CudaTensor> {
    let n = checked_len("normalize_u8", shape)?;
    same_len("normalize_u8", "pixels", n, pixels.len())?;
    let mut y = CudaTensor::uninit(be, shape, norm.dtype)?;
    if n == 0 {
        return Ok(y);
    }
    let p = NormalizeParams {
        n: n as u32,
        scale: 1.0 / (255.0 * norm.std),
        shift: norm.mean / norm.std,
    };
    let f = be.function(k::NORMALIZE_U8.of(norm.dtype))?;
    {
        // SAFETY: normalize_u8_T(NormalizeParams, const u8*, T*); pixels and
        // y hold n elements each.
        unsafe {
            launch(
                be.compute_stream(),
                &f,
                elementwise(n),
                "normalize_u8",
                |b| {
                    b.arg(&p).arg(pixels).arg(&mut y);
                },
            )
        }?;
    }
    Ok(y)
}

/// A batch of `n` samples made on the device from a resident u8 NHWC set
/// of `samples` images of `[h, w, c]`: crop, flip and normalisation by
/// `recipes` (two words per sample, the loader's `SampleRecipe::packed`),
/// bit for bit what `normalize_u8` gives for the same batch made on the
/// host. The caller has checked every recipe against the set
/// (`staging::check_recipes`).
#[allow(clippy::too_many_arguments)]
pub fn gather_crop_flip(
    be: &CudaBackend,
    images: &CudaView<'_, u8>,
    recipes: &CudaView<'_, u32>,
    n: usize,
    [h, w, c]: [usize; 3],
    norm: Normalization,
) -> CudaResult<CudaTensor> {
    let shape = [n, h, w, c];
    let len = checked_len("gather_crop_flip", &shape)?;
    same_len("gather_crop_flip", "recipes", 2 * n, recipes.len())?;
    if !images.len().is_multiple_of((h * w * c).max(1)) {
        return Err(CudaError::shape(
            "gather_crop_flip",
            format!("whole images of {h} x {w} x {c}"),
            format!("{} bytes", images.len()),
        ));
    }
    let mut y = CudaTensor::uninit(be, &shape, norm.dtype)?;
    if len == 0 {
        return Ok(y);
    }
    let p = GatherParams {
        n: n as u32,
        h: h as u32,
        w: w as u32,
        c: c as u32,
        scale: 1.0 / (255.0 * norm.std),
        shift: norm.mean / norm.std,
    };
    let f = be.function(k::GATHER_CROP_FLIP.of(norm.dtype))?;
    {
        // SAFETY: gather_crop_flip_u8_T(GatherParams, const u8* images,
        // const u32* recipes [2n], T* y [n*h*w*c]); every recipe's id
        // is below the set's size and its crop inside the padding (checked
        // by the caller), so every read of `images` is in bounds.
        unsafe {
            launch(
                be.compute_stream(),
                &f,
                elementwise(len),
                "gather_crop_flip_u8",
                |b| {
                    b.arg(&p).arg(images).arg(recipes).arg(&mut y);
                },
            )
        }?;
    }
    Ok(y)
}
