//! Casts and input normalisation: f32 ↔ f16 between views, and the u8
//! pixel batches' normalisation (`normalize_u8`, and `gather_crop_flip`
//! that crops, flips and normalises resident images in one pass), from
//! `cast.cu` (launches `cuda.rs`; the CPU side is `Tensor`'s). Each launch
//! writes a new tensor (or the caller's view); nothing is kept between
//! calls.
//!
//! | launch (`cuda.rs`) | CPU reference |
//! |---|---|
//! | `cast_f32_to_f16`, `cast_f16_to_f32` | `half` conversions |
//! | `normalize_u8`, `gather_crop_flip` | `Tensor::from_u8_normalized` |
//!
//! Parity tests: `tests/cuda_parity/cast.rs`.

pub(crate) mod cuda;
