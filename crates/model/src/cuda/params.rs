//! Kernel parameters, passed by value: each struct mirrors the struct of the
//! same name in the `.cu` files (`src/ops/<family>/*.cu`,
//! `src/cuda/optim.cu`, `src/ops/common.cuh`) field for field (u32 ↔ `u32`,
//! f32 ↔ `float`, u64 ↔ `u64`). Both sides assert the size; `tests/cuda_ptx.rs` checks
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
    /// collective.cu: rank_sum_f32 (the ranks' copies of a slice, in rank order).
    RankSumParams(12) { n: u32, world: u32, stride: u32 }
    /// elementwise.cu: dropout_apply, dropout_count, dropout_counter_restore.
    DropoutParams(24) { n: u32, p: f32, scale: f32, seed_lo: u32, seed_hi: u32, previous: u32 }
    /// elementwise.cu: bias_add.
    RowsColsParams(8) { rows: u32, cols: u32 }
    /// elementwise.cu: bias_grad, by chunks of rows.
    ColumnSumParams(16) { rows: u32, cols: u32, rows_per_chunk: u32, chunks: u32 }
    /// unet.cu: upsample2x_forward, upsample2x_backward (the input's size).
    UpsampleParams(16) { n: u32, h: u32, w: u32, c: u32 }
    /// unet.cu: channels_concat, channels_split.
    ConcatParams(12) { rows: u32, c1: u32, c2: u32 }
    /// sequence.cu: the embedding kernels (`positions` 0 or 1).
    EmbedParams(20) { rows: u32, dim: u32, length: u32, vocab: u32, positions: u32 }
    /// sequence.cu: the attention kernels; `scale` = 1/√d.
    AttnParams(20) { n: u32, t: u32, heads: u32, d: u32, scale: f32 }
    /// sequence.cu: the LSTM cell kernels, for time step `step`.
    LstmParams(16) { n: u32, t: u32, hidden: u32, step: u32 }
    /// frames.cu: the ConvLSTM step kernels (`pixels` = h·w of a frame).
    FramesParams(24) { n: u32, frames: u32, step: u32, pixels: u32, channels: u32, hidden: u32 }
    /// frames.cu: pixel_mse (a row per frame, `cols` values each).
    MseParams(12) { rows: u32, cols: u32, share: f32 }
    /// layernorm.cu: every kernel.
    LnParams(20) { rows: u32, cols: u32, rows_per_chunk: u32, chunks: u32, eps: f32 }
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
    BnApplyParams(20) { rows: u32, channels: u32, relu: u32, by_channels: FastDiv }
    /// batchnorm.cu: bn_backward_partial, bn_backward_partial_mask,
    /// bn_backward_finalize, bn_backward_apply.
    BnBackwardParams(28) {
        rows: u32, channels: u32, rows_per_chunk: u32, chunks: u32, relu: u32,
        by_channels: FastDiv,
    }
    /// pool.cu: global_avg_pool_forward, global_avg_pool_backward.
    PoolParams(16) { n: u32, hw: u32, c: u32, inv_hw: f32 }
    /// depthwise.cu: depthwise_forward, depthwise_backward_input,
    /// depthwise_wgrad_partial (`bias` 0 or 1).
    DepthwiseParams(44) {
        n: u32, h: u32, w: u32, c: u32, m: u32, oh: u32, ow: u32,
        kernel: u32, stride: u32, pad: u32, bias: u32,
    }
    /// depthwise.cu: depthwise_wgrad_reduce (`len` elements from `offset`
    /// of each image's `row` partials).
    DepthwiseReduceParams(16) { images: u32, len: u32, offset: u32, row: u32 }
    /// pool.cu: max_pool_forward, max_pool_forward_train, max_pool_backward
    /// (the input's size, the output's, the window).
    MaxPoolParams(32) { n: u32, h: u32, w: u32, c: u32, oh: u32, ow: u32, kernel: u32, stride: u32 }
    /// loss.cu: softmax_xent, softmax_xent_soft (which ignores smoothing).
    /// The gradient's scale is loss_scale * share / rows, the loss scale
    /// read from device memory.
    XentParams(16) { rows: u32, classes: u32, smoothing: f32, share: f32 }
    /// loss.cu: softmax_focal, softmax_focal_soft.
    FocalParams(20) { rows: u32, classes: u32, smoothing: f32, share: f32, gamma: f32 }
    /// loss.cu: xent_reduce.
    XentReduceParams(4) { rows: u32 }
    /// common.cuh: division of n < 2^31 by a fixed d as a multiply-high,
    /// an add and a shift (`FastDiv::new`).
    FastDiv(8) { m: u32, s: u32 }
    /// conv.cu: im2col, col2im, for images [n0, n0 + images), with the
    /// divisors of their index math.
    ConvParams(104) {
        h: u32, w: u32, cin: u32, oh: u32, ow: u32,
        k: u32, stride: u32, pad: u32, n0: u32, images: u32,
        by_kk: FastDiv, by_opix: FastDiv, by_ow: FastDiv, by_kcin: FastDiv,
        by_cin: FastDiv, by_image: FastDiv, by_wcin: FastDiv, by_stride: FastDiv,
    }
    /// conv_mma.cu: implicit_conv_n32_f16, implicit_conv_n64_f16 (the
    /// forward) and implicit_dgrad_n32_f16, implicit_dgrad_n64_f16 (the
    /// input gradient, `transposed = 1`, one parity class of dx's pixels a
    /// launch).
    ImplicitConvParams(128) {
        rows: u32, cols: u32, depth: u32, chans: u32,
        src_h: u32, src_w: u32, row_h: u32, row_w: u32, out_h: u32, out_w: u32,
        step: u32, row_y0: u32, row_x0: u32, tap_y0: u32, tap_x0: u32, taps_x: u32,
        k: u32, stride: u32, pad: u32, transposed: u32,
        b_chan_stride: u32, b_col_stride: u32,
        by_row_pix: FastDiv, by_row_w: FastDiv, by_chans: FastDiv, by_taps_x: FastDiv,
        by_stride: FastDiv,
    }
    /// conv_mma.cu: implicit_wgrad_n32_f16, _n64_f16, _n128_f16 (the
    /// weight gradient's partial sums, one per split of the pixels).
    WgradParams(80) {
        rows: u32, depth: u32, cout: u32, cin: u32, h: u32, w: u32,
        opix: u32, ow: u32, k: u32, stride: u32, pad: u32, rows_per_split: u32,
        by_opix: FastDiv, by_ow: FastDiv, by_cin: FastDiv, by_k: FastDiv,
    }
    /// conv.cu: wgrad_reduce (the implicit and narrow weight gradients).
    WgradReduceParams(8) { n: u32, splits: u32 }
    /// conv_narrow.cu: narrow_forward, narrow_grad_input, narrow_wgrad
    /// (fewer than 8 output channels).
    NarrowParams(100) {
        n: u32, h: u32, w: u32, cin: u32, cout: u32, oh: u32, ow: u32,
        k: u32, stride: u32, pad: u32, rows_per_split: u32,
        by_opix: FastDiv, by_ow: FastDiv, by_hw: FastDiv, by_w: FastDiv,
        by_cin: FastDiv, by_cout: FastDiv, by_stride: FastDiv,
    }
    /// optim.cu: grad_sumsq.
    SumSqParams(8) { n: u32, offset: u32 }
    /// batchnorm.cu: bn_running_restore.
    BnRestoreParams(4) { channels: u32 }
    /// optim.cu: step_finalize and step_commit: the clip norm and the loss scaler's
    /// settings, fixed for a run.
    FinalizeParams(28) {
        partials: u32, max_norm: f32,
        growth_factor: f32, backoff_factor: f32, growth_interval: u32,
        min_scale: f32, max_scale: f32,
    }
    /// optim.cu: adamw_check, adamw_fused.
    AdamWParams(28) {
        n: u32, zero_grad: u32,
        /// 1: apply the weight decay (a decay group).
        decay: u32,
        beta1_complement: f32, beta2: f32, beta2_complement: f32, eps: f32,
    }
    /// optim.cu: the factors of one learning rate at one t.
    AdamWScalars(12) { decay_factor: f32, neg_step_size: f32, bias_correction2_sqrt: f32 }
    /// optim.cu: the learning rate of the next step, written by the host
    /// (a pinned copy on the stream) for each count of applied steps the
    /// step may find: `at[applied - first_applied]` is the one it uses.
    StepSchedule(64) {
        first_applied: u64,
        candidates: u32,
        unused: u32,
        at: [AdamWScalars; SCHEDULE_CANDIDATES],
    }
    /// common.cuh: the optimizer's verdict on the last step and the dynamic
    /// loss scaler's state, in device memory: written by step_finalize,
    /// adamw_check and step_commit, read by adamw_fused, bn_running_restore
    /// and (when it likes) the host.
    StepState(56) {
        /// found_inf, schedule_missed or update_overflow: the step changed
        /// nothing.
        skipped: u32,
        /// A gradient was inf or NaN.
        found_inf: u32,
        /// The host's schedule had no learning rate for this step's t.
        schedule_missed: u32,
        /// Global L2 norm of the unscaled gradients (before clipping).
        grad_norm: f32,
        /// The clip coefficient applied (1 when not clipped).
        clip_factor: f32,
        /// clip_factor / loss_scale: what a stored gradient was multiplied by.
        grad_factor: f32,
        /// The step's AdamW factors, for its t.
        decay_factor: f32,
        neg_step_size: f32,
        bias_correction2_sqrt: f32,
        /// The loss scale of the next step.
        next_scale: f32,
        /// Clean steps since the scale last changed.
        clean_steps: u32,
        /// The gradients were finite but the update would have left a
        /// master weight or an AdamW moment (or, in mixed precision, the
        /// f16 compute copy of a finite master) not finite: the step was
        /// refused, as the CPU's `AdamW::step_if_finite` refuses it, and the
        /// loss scale left as it was.
        update_overflow: u32,
        /// Steps applied so far: AdamW's t of the last applied one.
        applied: u64,
    }
}

impl FastDiv {
    /// Granlund and Montgomery's round-up multiplier for d ≥ 1 (0 is taken
    /// as 1): with l = ⌈log2 d⌉, m = ⌊2^32 (2^l - d) / d⌋ + 1, and
    /// n / d = (mulhi(n, m) + n) >> l for every n < 2^31. m < 2^32 since
    /// 2^l < 2d.
    pub fn new(d: u32) -> Self {
        let d = u64::from(d.max(1));
        let l = 64 - (d - 1).leading_zeros();
        let m = ((1u64 << 32) * ((1u64 << l) - d)) / d + 1;
        Self { m: m as u32, s: l }
    }

    /// What `hr_div` computes on the device.
    pub fn quotient(self, n: u32) -> u32 {
        let high = ((u64::from(n) * u64::from(self.m)) >> 32) as u32;
        (high + n) >> self.s
    }
}

/// Learning-rate candidates a `StepSchedule` holds (optim.cu's
/// HR_SCHEDULE_CANDIDATES): a step may be queued with up to this many minus
/// one steps still in flight.
pub const SCHEDULE_CANDIDATES: usize = 4;

// SAFETY: all-zero bits are a valid StepState (found_inf = 0, zeros).
unsafe impl ValidAsZeroBits for StepState {}
// SAFETY: three f32; zeros are valid.
unsafe impl ValidAsZeroBits for AdamWScalars {}
// SAFETY: integers and f32 scalars; zeros are valid.
unsafe impl ValidAsZeroBits for StepSchedule {}

#[cfg(test)]
mod tests {
    use super::FastDiv;

    /// Every divisor an index may meet up to 4096, and large ones, against
    /// every dividend class that matters: small, around multiples of d, and
    /// up to 2^31 - 1.
    #[test]
    fn fast_division_is_exact_below_two_to_the_31() {
        let mut divisors: Vec<u32> = (1..=4096).collect();
        for shift in 12..31 {
            let p = 1u32 << shift;
            divisors.extend([p - 1, p, p + 1, p / 3 * 2 + 1]);
        }
        divisors.push(i32::MAX as u32);
        for d in divisors {
            let f = FastDiv::new(d);
            let mut dividends: Vec<u32> = (0..600).collect();
            for k in [1u32, 2, 3, 7, 1000, 65_537] {
                if let Some(m) = d.checked_mul(k).filter(|&m| m < 1 << 31) {
                    dividends.extend([m - 1, m, m.saturating_add(1)]);
                }
            }
            dividends.extend([(1 << 31) - 1, (1 << 31) - 2, (1 << 30) + 12_345]);
            for n in dividends.into_iter().filter(|&n| n < 1 << 31) {
                assert_eq!(f.quotient(n), n / d, "{n} / {d} with {f:?}");
            }
        }
    }

    #[test]
    fn a_zero_divisor_divides_by_one() {
        assert_eq!(FastDiv::new(0).quotient(1234), 1234);
    }
}
