//! Kernel parameters, passed by value: each struct mirrors the struct of the
//! same name in `crates/model/kernels/*.cu` field for field (u32 ↔ `u32`,
//! f32 ↔ `float`). Both sides assert the size; `tests/cuda_ptx.rs` checks
//! every kernel's first PTX parameter against `size_of` of its struct here.
//! Buffers are passed as separate pointer arguments after the struct.

use cudarc::driver::{DeviceRepr, ValidAsZeroBits};

macro_rules! kernel_params {
    ($($(#[$meta:meta])* $name:ident ($bytes:expr) { $($(#[$fmeta:meta])* $field:ident: $ty:ty),* $(,)? })*) => {
        $(
            $(#[$meta])*
            #[repr(C)]
            #[derive(Clone, Copy, Debug, Default, PartialEq)]
            pub struct $name {
                $($(#[$fmeta])* pub $field: $ty),*
            }

            const _: () = assert!(std::mem::size_of::<$name>() == $bytes);

            // SAFETY: a #[repr(C)] struct of u32/f32 fields with the layout of
            // its mirror in the .cu file (sizes asserted on both sides); it
            // holds no pointers.
            unsafe impl DeviceRepr for $name {}
        )*
    };
}

kernel_params! {
    /// cast.cu: cast_f32_to_f16, cast_f16_to_f32.
    CastParams(4) { n: u32 }
    /// cast.cu: normalize_u8_to_f16, y = x * scale - shift.
    NormalizeParams(12) { n: u32, scale: f32, shift: f32 }
    /// cast.cu: gather_crop_flip_u8_to_f16 (batch from a resident set).
    GatherParams(24) { n: u32, h: u32, w: u32, c: u32, scale: f32, shift: f32 }
    /// elementwise.cu: relu_forward, relu_backward, add_inplace, add.
    EwParams(4) { n: u32 }
    /// elementwise.cu: bias_add, bias_grad.
    RowsColsParams(8) { rows: u32, cols: u32 }
    /// batchnorm.cu: bn_stats_partial.
    BnDims(16) { rows: u32, channels: u32, rows_per_chunk: u32, chunks: u32 }
    /// batchnorm.cu: bn_stats_finalize.
    BnFinalizeParams(28) {
        rows: u32, channels: u32, rows_per_chunk: u32, chunks: u32,
        eps: f32, momentum: f32,
        /// 0 in recompute mode (activation checkpointing, dry runs).
        update_running: u32,
    }
    /// batchnorm.cu: bn_eval_prepare.
    BnEvalParams(8) { channels: u32, eps: f32 }
    /// batchnorm.cu: bn_apply (relu = 1 fuses the ReLU), bn_apply_add.
    BnApplyParams(12) { rows: u32, channels: u32, relu: u32 }
    /// batchnorm.cu: bn_backward_partial, bn_backward_partial_mask,
    /// bn_backward_finalize, bn_backward_apply.
    BnBackwardParams(20) { rows: u32, channels: u32, rows_per_chunk: u32, chunks: u32, relu: u32 }
    /// pool.cu: global_avg_pool_forward, global_avg_pool_backward.
    PoolParams(16) { n: u32, hw: u32, c: u32, inv_hw: f32 }
    /// loss.cu: softmax_xent, softmax_xent_soft (which ignores smoothing).
    /// grad_scale = loss_scale / rows.
    XentParams(16) { rows: u32, classes: u32, smoothing: f32, grad_scale: f32 }
    /// loss.cu: xent_reduce.
    XentReduceParams(4) { rows: u32 }
    /// conv.cu: im2col, col2im, for images [n0, n0 + images).
    ConvParams(40) {
        h: u32, w: u32, cin: u32, oh: u32, ow: u32,
        k: u32, stride: u32, pad: u32, n0: u32, images: u32,
    }
    /// optim.cu: grad_sumsq.
    SumSqParams(8) { n: u32, offset: u32 }
    /// optim.cu: step_finalize.
    FinalizeParams(12) { partials: u32, inv_loss_scale: f32, max_norm: f32 }
    /// optim.cu: adamw_fused.
    AdamWParams(28) {
        n: u32, zero_grad: u32,
        /// 1: apply the weight decay (a decay group).
        decay: u32,
        beta1_complement: f32, beta2: f32, beta2_complement: f32, eps: f32,
    }
    /// optim.cu: what adamw_fused reads of the step from device memory (the
    /// learning rate and t change every step; a captured step replays them
    /// from here).
    AdamWScalars(12) { decay_factor: f32, neg_step_size: f32, bias_correction2_sqrt: f32 }
    /// optim.cu: the optimizer step's verdict, written by step_finalize into
    /// device memory and read by adamw_fused and (when it likes) the host.
    StepState(16) {
        /// 1 if any gradient was inf or NaN: the step was skipped.
        found_inf: u32,
        /// Global L2 norm of the unscaled gradients (before clipping).
        grad_norm: f32,
        /// The clip coefficient applied (1 when not clipped).
        clip_factor: f32,
        /// clip_factor / loss_scale: what a stored gradient was multiplied by.
        grad_factor: f32,
    }
}

// SAFETY: all-zero bits are a valid StepState (found_inf = 0, zeros).
unsafe impl ValidAsZeroBits for StepState {}
// SAFETY: three f32; zeros are valid.
unsafe impl ValidAsZeroBits for AdamWScalars {}
