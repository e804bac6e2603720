//! Our CUDA kernels: their sources (compiled into the binary with
//! `include_str!`), the signature of every entry point, and NVRTC
//! compilation with an on-disk cache.
//!
//! A kernel file is compiled once per process and device on first use (see
//! `CudaBackend::function`): for the device's exact architecture to a CUBIN
//! when NVRTC supports it (no JIT at load time, and a CUBIN loads on any
//! driver of the same CUDA major version), otherwise to PTX for the newest
//! virtual architecture NVRTC knows, which the driver JIT-compiles. Images
//! are cached under `kernel_cache_dir()`, keyed by a hash of the source,
//! the options, the target and the NVRTC version.

use std::ffi::{c_char, c_int, CStr, CString};
use std::path::PathBuf;

use cudarc::nvrtc::{result as nvrtc, sys as nvrtc_sys};

use super::dtype::{DType, HalfFormat};
use super::params::*;
use super::{libs, CudaError, CudaResult};

/// Text spliced into every kernel file in place of `#include "common.cuh"`.
pub const COMMON: &str = include_str!("../ops/common.cuh");
const INCLUDE_COMMON: &str = "#include \"common.cuh\"";

/// One `extern "C" __global__` entry point.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelSig {
    /// Kernel file (without `.cu`).
    pub file: &'static str,
    pub name: &'static str,
    /// `size_of` of the parameter struct passed first, by value.
    pub params_bytes: usize,
    /// Pointer arguments after it.
    pub buffers: usize,
}

/// One `.cu` file and the entry points it defines.
#[derive(Debug)]
pub struct KernelFile {
    pub name: &'static str,
    pub source: &'static str,
    pub kernels: &'static [KernelSig],
}

macro_rules! sig {
    ($file:literal, $name:expr, $params:ty, $buffers:expr) => {
        KernelSig {
            file: $file,
            name: $name,
            params_bytes: std::mem::size_of::<$params>(),
            buffers: $buffers,
        }
    };
}

/// A layer kernel's two entry points, one per activation storage type: the
/// `.cu` file defines a template over the storage and instantiates it as
/// `NAME_f16` (mixed precision) and `NAME_f32` (f32 training).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelPair {
    pub f16: KernelSig,
    pub f32: KernelSig,
}

impl KernelPair {
    /// The entry point for activations stored as `dtype`.
    pub fn of(&self, dtype: DType) -> &KernelSig {
        match dtype {
            DType::F16 => &self.f16,
            DType::F32 => &self.f32,
        }
    }
}

macro_rules! pair {
    ($file:literal, $name:literal, $params:ty, $buffers:expr) => {
        KernelPair {
            f16: sig!($file, concat!($name, "_f16"), $params, $buffers),
            f32: sig!($file, concat!($name, "_f32"), $params, $buffers),
        }
    };
}

/// The ranks' copies of a slice summed in rank order (data parallel).
pub const RANK_SUM: KernelSig = sig!("collective", "rank_sum_f32", RankSumParams, 2);
pub const CAST_F32_TO_F16: KernelSig = sig!("cast", "cast_f32_to_f16", CastParams, 2);
pub const CAST_F16_TO_F32: KernelSig = sig!("cast", "cast_f16_to_f32", CastParams, 2);
pub const NORMALIZE_U8: KernelPair = pair!("cast", "normalize_u8", NormalizeParams, 2);
pub const GATHER_CROP_FLIP: KernelPair = pair!("cast", "gather_crop_flip_u8", GatherParams, 3);

pub const RELU_FORWARD: KernelPair = pair!("elementwise", "relu_forward", EwParams, 2);
pub const RELU_BACKWARD: KernelPair = pair!("elementwise", "relu_backward", EwParams, 3);
pub const SILU_FORWARD: KernelPair = pair!("elementwise", "silu_forward", EwParams, 2);
pub const SILU_BACKWARD: KernelPair = pair!("elementwise", "silu_backward", EwParams, 3);
pub const GELU_FORWARD: KernelPair = pair!("elementwise", "gelu_forward", EwParams, 2);
pub const GELU_BACKWARD: KernelPair = pair!("elementwise", "gelu_backward", EwParams, 3);
pub const DROPOUT_APPLY: KernelPair = pair!("elementwise", "dropout_apply", DropoutParams, 3);
pub const DROPOUT_COUNT: KernelSig = sig!("elementwise", "dropout_count", DropoutParams, 1);
pub const DROPOUT_COUNTER_RESTORE: KernelSig =
    sig!("elementwise", "dropout_counter_restore", DropoutParams, 3);
pub const ADD_INPLACE: KernelPair = pair!("elementwise", "add_inplace", EwParams, 2);
pub const ADD: KernelPair = pair!("elementwise", "add", EwParams, 3);
pub const BIAS_ADD: KernelPair = pair!("elementwise", "bias_add", RowsColsParams, 2);
pub const BIAS_GRAD: KernelPair = pair!("elementwise", "bias_grad", ColumnSumParams, 2);

pub const BN_STATS_PARTIAL: KernelPair = pair!("batchnorm", "bn_stats_partial", BnDims, 3);
pub const BN_STATS_FINALIZE: KernelSig =
    sig!("batchnorm", "bn_stats_finalize", BnFinalizeParams, 10);
pub const BN_EVAL_PREPARE: KernelSig = sig!("batchnorm", "bn_eval_prepare", BnEvalParams, 6);
pub const BN_APPLY: KernelPair = pair!("batchnorm", "bn_apply", BnApplyParams, 4);
pub const BN_APPLY_ADD: KernelPair = pair!("batchnorm", "bn_apply_add", BnApplyParams, 5);
pub const BN_BACKWARD_PARTIAL: KernelPair =
    pair!("batchnorm", "bn_backward_partial", BnBackwardParams, 7);
pub const BN_BACKWARD_PARTIAL_MASK: KernelPair =
    pair!("batchnorm", "bn_backward_partial_mask", BnBackwardParams, 6);
pub const BN_BACKWARD_FINALIZE: KernelSig =
    sig!("batchnorm", "bn_backward_finalize", BnBackwardParams, 9);
pub const BN_BACKWARD_APPLY: KernelPair =
    pair!("batchnorm", "bn_backward_apply", BnBackwardParams, 9);
/// bn_apply, bn_apply_add and bn_backward_apply 8 channels at a time (f16,
/// channels % 8 == 0).
pub const BN_APPLY_V8: KernelSig = sig!("batchnorm", "bn_apply_v8_f16", BnApplyParams, 4);
pub const BN_APPLY_ADD_V8: KernelSig = sig!("batchnorm", "bn_apply_add_v8_f16", BnApplyParams, 5);
pub const BN_BACKWARD_APPLY_V8: KernelSig =
    sig!("batchnorm", "bn_backward_apply_v8_f16", BnBackwardParams, 9);
/// bn_stats_partial, bn_backward_partial and bn_backward_partial_mask 8
/// channels a thread (f16, channels % 8 == 0), blocks of 256 threads.
pub const BN_STATS_PARTIAL_V8: KernelSig = sig!("batchnorm", "bn_stats_partial_v8_f16", BnDims, 3);
pub const BN_BACKWARD_PARTIAL_V8: KernelSig = sig!(
    "batchnorm",
    "bn_backward_partial_v8_f16",
    BnBackwardParams,
    7
);
pub const BN_BACKWARD_PARTIAL_MASK_V8: KernelSig = sig!(
    "batchnorm",
    "bn_backward_partial_mask_v8_f16",
    BnBackwardParams,
    6
);
pub const BN_RUNNING_RESTORE: KernelSig =
    sig!("batchnorm", "bn_running_restore", BnRestoreParams, 5);

pub const LAYER_NORM_FORWARD: KernelPair = pair!("layernorm", "layer_norm_forward", LnParams, 5);
pub const LAYER_NORM_BACKWARD: KernelPair = pair!("layernorm", "layer_norm_backward", LnParams, 5);
pub const LAYER_NORM_GRAD_PARTIAL: KernelPair =
    pair!("layernorm", "layer_norm_grad_partial", LnParams, 5);
pub const LAYER_NORM_GRAD_FINALIZE: KernelSig =
    sig!("layernorm", "layer_norm_grad_finalize", LnParams, 4);

pub const EMBEDDING_FORWARD: KernelPair = pair!("sequence", "embedding_forward", EmbedParams, 4);
pub const EMBEDDING_GRAD_TABLE: KernelPair =
    pair!("sequence", "embedding_grad_table", EmbedParams, 3);
pub const EMBEDDING_GRAD_POSITIONS: KernelPair =
    pair!("sequence", "embedding_grad_positions", EmbedParams, 2);
pub const ATTENTION_FORWARD: KernelPair = pair!("sequence", "attention_forward", AttnParams, 3);
pub const ATTENTION_BACKWARD_QUERY: KernelPair =
    pair!("sequence", "attention_backward_query", AttnParams, 6);
pub const ATTENTION_BACKWARD_KEY: KernelPair =
    pair!("sequence", "attention_backward_key", AttnParams, 5);
pub const LSTM_CELL_FORWARD: KernelPair = pair!("sequence", "lstm_cell_forward", LstmParams, 5);
pub const LSTM_CELL_BACKWARD: KernelPair = pair!("sequence", "lstm_cell_backward", LstmParams, 6);

pub const FRAMES_STEP_CONCAT: KernelPair = pair!("frames", "frames_step_concat", FramesParams, 3);
pub const FRAMES_STEP_SPLIT: KernelPair = pair!("frames", "frames_step_split", FramesParams, 3);
pub const CONV_LSTM_CELL_FORWARD: KernelPair =
    pair!("frames", "conv_lstm_cell_forward", FramesParams, 4);
pub const CONV_LSTM_CELL_FORWARD_CELLS: KernelPair =
    pair!("frames", "conv_lstm_cell_forward_cells", FramesParams, 3);
pub const CONV_LSTM_CELL_BACKWARD: KernelPair =
    pair!("frames", "conv_lstm_cell_backward", FramesParams, 6);
pub const CONV_LSTM_CELL_BACKWARD_RERUN: KernelPair =
    pair!("frames", "conv_lstm_cell_backward_rerun", FramesParams, 6);
pub const PIXEL_MSE: KernelPair = pair!("frames", "pixel_mse", MseParams, 6);

pub const UPSAMPLE2X_FORWARD: KernelPair = pair!("unet", "upsample2x_forward", UpsampleParams, 2);
pub const UPSAMPLE2X_BACKWARD: KernelPair = pair!("unet", "upsample2x_backward", UpsampleParams, 2);
pub const CHANNELS_CONCAT: KernelPair = pair!("unet", "channels_concat", ConcatParams, 3);
pub const CHANNELS_SPLIT: KernelPair = pair!("unet", "channels_split", ConcatParams, 3);

pub const POOL_FORWARD: KernelPair = pair!("pool", "global_avg_pool_forward", PoolParams, 2);
pub const POOL_BACKWARD: KernelPair = pair!("pool", "global_avg_pool_backward", PoolParams, 2);
pub const MAX_POOL_FORWARD: KernelPair = pair!("pool", "max_pool_forward", MaxPoolParams, 2);
/// max_pool_forward that also writes each output's argmax (u32).
pub const MAX_POOL_FORWARD_TRAIN: KernelPair =
    pair!("pool", "max_pool_forward_train", MaxPoolParams, 3);
pub const MAX_POOL_BACKWARD: KernelPair = pair!("pool", "max_pool_backward", MaxPoolParams, 3);

pub const DEPTHWISE_FORWARD: KernelPair =
    pair!("depthwise", "depthwise_forward", DepthwiseParams, 4);
pub const DEPTHWISE_BACKWARD_INPUT: KernelPair =
    pair!("depthwise", "depthwise_backward_input", DepthwiseParams, 3);
pub const DEPTHWISE_WGRAD_PARTIAL: KernelPair =
    pair!("depthwise", "depthwise_wgrad_partial", DepthwiseParams, 3);
pub const DEPTHWISE_WGRAD_REDUCE: KernelSig = sig!(
    "depthwise",
    "depthwise_wgrad_reduce",
    DepthwiseReduceParams,
    2
);

pub const SOFTMAX_XENT: KernelPair = pair!("loss", "softmax_xent", XentParams, 6);
pub const SOFTMAX_XENT_SOFT: KernelPair = pair!("loss", "softmax_xent_soft", XentParams, 6);
pub const SOFTMAX_FOCAL: KernelPair = pair!("loss", "softmax_focal", FocalParams, 6);
pub const SOFTMAX_FOCAL_SOFT: KernelPair = pair!("loss", "softmax_focal_soft", FocalParams, 6);
pub const XENT_REDUCE: KernelSig = sig!("loss", "xent_reduce", XentReduceParams, 4);

pub const IM2COL: KernelPair = pair!("conv", "im2col", ConvParams, 2);
pub const COL2IM: KernelPair = pair!("conv", "col2im", ConvParams, 2);
/// im2col / col2im 8 channels at a time (f16, cin % 8 == 0).
pub const IM2COL_V8: KernelSig = sig!("conv", "im2col_v8_f16", ConvParams, 2);
pub const COL2IM_V8: KernelSig = sig!("conv", "col2im_v8_f16", ConvParams, 2);
/// Implicit-GEMM convolution, f16 only, by column tile (32 or 64): the
/// forward and the input gradient.
pub const IMPLICIT_CONV_N32: KernelSig =
    sig!("conv_mma", "implicit_conv_n32_f16", ImplicitConvParams, 3);
pub const IMPLICIT_CONV_N64: KernelSig =
    sig!("conv_mma", "implicit_conv_n64_f16", ImplicitConvParams, 3);
pub const IMPLICIT_DGRAD_N32: KernelSig =
    sig!("conv_mma", "implicit_dgrad_n32_f16", ImplicitConvParams, 3);
pub const IMPLICIT_DGRAD_N64: KernelSig =
    sig!("conv_mma", "implicit_dgrad_n64_f16", ImplicitConvParams, 3);
/// The implicit weight gradient's partial sums, by column tile, and their
/// reduction into dW.
pub const IMPLICIT_WGRAD_N32: KernelSig =
    sig!("conv_mma", "implicit_wgrad_n32_f16", WgradParams, 3);
pub const IMPLICIT_WGRAD_N64: KernelSig =
    sig!("conv_mma", "implicit_wgrad_n64_f16", WgradParams, 3);
pub const IMPLICIT_WGRAD_N128: KernelSig =
    sig!("conv_mma", "implicit_wgrad_n128_f16", WgradParams, 3);
pub const WGRAD_REDUCE: KernelSig = sig!("conv", "wgrad_reduce", WgradReduceParams, 2);
/// Direct convolution to fewer than 8 output channels: forward, input
/// gradient, and the weight gradient's partial sums (reduced by
/// `WGRAD_REDUCE`).
pub const NARROW_FORWARD: KernelPair = pair!("conv_narrow", "narrow_forward", NarrowParams, 3);
pub const NARROW_GRAD_INPUT: KernelPair =
    pair!("conv_narrow", "narrow_grad_input", NarrowParams, 3);
pub const NARROW_WGRAD: KernelPair = pair!("conv_narrow", "narrow_wgrad", NarrowParams, 3);
/// Direct convolution from few input channels to a multiple of 8 outputs
/// (f16): forward, and the weight gradient's partial sums.
pub const THIN_FORWARD: KernelSig = sig!("conv_narrow", "thin_forward_f16", NarrowParams, 3);
pub const THIN_WGRAD: KernelSig = sig!("conv_narrow", "thin_wgrad_f16", NarrowParams, 3);

pub const GRAD_SUMSQ: KernelSig = sig!("optim", "grad_sumsq", SumSqParams, 2);
pub const STEP_FINALIZE: KernelSig = sig!("optim", "step_finalize", FinalizeParams, 4);
/// The read-only check that the update leaves every master weight, moment
/// (and f16 compute copy) finite: sets the StepState's update_overflow.
pub const ADAMW_CHECK: KernelSig = sig!("optim", "adamw_check", AdamWParams, 5);
/// The same for a group without a compute copy (f32 training).
pub const ADAMW_CHECK_F32: KernelSig = sig!("optim", "adamw_check_f32", AdamWParams, 5);
/// The verdict with the check folded in, the loss scaler and t.
pub const STEP_COMMIT: KernelSig = sig!("optim", "step_commit", FinalizeParams, 2);
/// The fused AdamW step with the f16 compute copy written (mixed precision).
pub const ADAMW_FUSED: KernelSig = sig!("optim", "adamw_fused", AdamWParams, 6);
/// The same without a compute copy (f32 training: layers read the masters).
pub const ADAMW_FUSED_F32: KernelSig = sig!("optim", "adamw_fused_f32", AdamWParams, 5);

/// Every kernel file and its entry points.
pub static FILES: &[KernelFile] = &[
    KernelFile {
        name: "collective",
        source: include_str!("../ops/collective/collective.cu"),
        kernels: &[RANK_SUM],
    },
    KernelFile {
        name: "cast",
        source: include_str!("../ops/cast/cast.cu"),
        kernels: &[
            CAST_F32_TO_F16,
            CAST_F16_TO_F32,
            NORMALIZE_U8.f16,
            NORMALIZE_U8.f32,
            GATHER_CROP_FLIP.f16,
            GATHER_CROP_FLIP.f32,
        ],
    },
    KernelFile {
        name: "elementwise",
        source: include_str!("../ops/activation/elementwise.cu"),
        kernels: &[
            RELU_FORWARD.f16,
            RELU_FORWARD.f32,
            RELU_BACKWARD.f16,
            RELU_BACKWARD.f32,
            SILU_FORWARD.f16,
            SILU_FORWARD.f32,
            SILU_BACKWARD.f16,
            SILU_BACKWARD.f32,
            GELU_FORWARD.f16,
            GELU_FORWARD.f32,
            GELU_BACKWARD.f16,
            GELU_BACKWARD.f32,
            DROPOUT_APPLY.f16,
            DROPOUT_APPLY.f32,
            DROPOUT_COUNT,
            DROPOUT_COUNTER_RESTORE,
            ADD_INPLACE.f16,
            ADD_INPLACE.f32,
            ADD.f16,
            ADD.f32,
            BIAS_ADD.f16,
            BIAS_ADD.f32,
            BIAS_GRAD.f16,
            BIAS_GRAD.f32,
        ],
    },
    KernelFile {
        name: "batchnorm",
        source: include_str!("../ops/batch_norm/batchnorm.cu"),
        kernels: &[
            BN_STATS_PARTIAL.f16,
            BN_STATS_PARTIAL.f32,
            BN_STATS_FINALIZE,
            BN_EVAL_PREPARE,
            BN_APPLY.f16,
            BN_APPLY.f32,
            BN_APPLY_ADD.f16,
            BN_APPLY_ADD.f32,
            BN_BACKWARD_PARTIAL.f16,
            BN_BACKWARD_PARTIAL.f32,
            BN_BACKWARD_PARTIAL_MASK.f16,
            BN_BACKWARD_PARTIAL_MASK.f32,
            BN_BACKWARD_FINALIZE,
            BN_BACKWARD_APPLY.f16,
            BN_BACKWARD_APPLY.f32,
            BN_APPLY_V8,
            BN_APPLY_ADD_V8,
            BN_BACKWARD_APPLY_V8,
            BN_STATS_PARTIAL_V8,
            BN_BACKWARD_PARTIAL_V8,
            BN_BACKWARD_PARTIAL_MASK_V8,
            BN_RUNNING_RESTORE,
        ],
    },
    KernelFile {
        name: "sequence",
        source: include_str!("../ops/sequence/sequence.cu"),
        kernels: &[
            EMBEDDING_FORWARD.f16,
            EMBEDDING_FORWARD.f32,
            EMBEDDING_GRAD_TABLE.f16,
            EMBEDDING_GRAD_TABLE.f32,
            EMBEDDING_GRAD_POSITIONS.f16,
            EMBEDDING_GRAD_POSITIONS.f32,
            ATTENTION_FORWARD.f16,
            ATTENTION_FORWARD.f32,
            ATTENTION_BACKWARD_QUERY.f16,
            ATTENTION_BACKWARD_QUERY.f32,
            ATTENTION_BACKWARD_KEY.f16,
            ATTENTION_BACKWARD_KEY.f32,
            LSTM_CELL_FORWARD.f16,
            LSTM_CELL_FORWARD.f32,
            LSTM_CELL_BACKWARD.f16,
            LSTM_CELL_BACKWARD.f32,
        ],
    },
    KernelFile {
        name: "frames",
        source: include_str!("../ops/frames/frames.cu"),
        kernels: &[
            FRAMES_STEP_CONCAT.f16,
            FRAMES_STEP_CONCAT.f32,
            FRAMES_STEP_SPLIT.f16,
            FRAMES_STEP_SPLIT.f32,
            CONV_LSTM_CELL_FORWARD.f16,
            CONV_LSTM_CELL_FORWARD.f32,
            CONV_LSTM_CELL_FORWARD_CELLS.f16,
            CONV_LSTM_CELL_FORWARD_CELLS.f32,
            CONV_LSTM_CELL_BACKWARD.f16,
            CONV_LSTM_CELL_BACKWARD.f32,
            CONV_LSTM_CELL_BACKWARD_RERUN.f16,
            CONV_LSTM_CELL_BACKWARD_RERUN.f32,
            PIXEL_MSE.f16,
            PIXEL_MSE.f32,
        ],
    },
    KernelFile {
        name: "layernorm",
        source: include_str!("../ops/layer_norm/layernorm.cu"),
        kernels: &[
            LAYER_NORM_FORWARD.f16,
            LAYER_NORM_FORWARD.f32,
            LAYER_NORM_BACKWARD.f16,
            LAYER_NORM_BACKWARD.f32,
            LAYER_NORM_GRAD_PARTIAL.f16,
            LAYER_NORM_GRAD_PARTIAL.f32,
            LAYER_NORM_GRAD_FINALIZE,
        ],
    },
    KernelFile {
        name: "unet",
        source: include_str!("../ops/pool/unet.cu"),
        kernels: &[
            UPSAMPLE2X_FORWARD.f16,
            UPSAMPLE2X_FORWARD.f32,
            UPSAMPLE2X_BACKWARD.f16,
            UPSAMPLE2X_BACKWARD.f32,
            CHANNELS_CONCAT.f16,
            CHANNELS_CONCAT.f32,
            CHANNELS_SPLIT.f16,
            CHANNELS_SPLIT.f32,
        ],
    },
    KernelFile {
        name: "pool",
        source: include_str!("../ops/pool/pool.cu"),
        kernels: &[
            POOL_FORWARD.f16,
            POOL_FORWARD.f32,
            POOL_BACKWARD.f16,
            POOL_BACKWARD.f32,
            MAX_POOL_FORWARD.f16,
            MAX_POOL_FORWARD.f32,
            MAX_POOL_FORWARD_TRAIN.f16,
            MAX_POOL_FORWARD_TRAIN.f32,
            MAX_POOL_BACKWARD.f16,
            MAX_POOL_BACKWARD.f32,
        ],
    },
    KernelFile {
        name: "loss",
        source: include_str!("../ops/loss/loss.cu"),
        kernels: &[
            SOFTMAX_XENT.f16,
            SOFTMAX_XENT.f32,
            SOFTMAX_XENT_SOFT.f16,
            SOFTMAX_XENT_SOFT.f32,
            SOFTMAX_FOCAL.f16,
            SOFTMAX_FOCAL.f32,
            SOFTMAX_FOCAL_SOFT.f16,
            SOFTMAX_FOCAL_SOFT.f32,
            XENT_REDUCE,
        ],
    },
    KernelFile {
        name: "conv",
        source: include_str!("../ops/conv/conv.cu"),
        kernels: &[
            IM2COL.f16,
            IM2COL.f32,
            COL2IM.f16,
            COL2IM.f32,
            IM2COL_V8,
            COL2IM_V8,
            WGRAD_REDUCE,
        ],
    },
    KernelFile {
        name: "conv_mma",
        source: include_str!("../ops/conv/conv_mma.cu"),
        kernels: &[
            IMPLICIT_CONV_N32,
            IMPLICIT_CONV_N64,
            IMPLICIT_DGRAD_N32,
            IMPLICIT_DGRAD_N64,
            IMPLICIT_WGRAD_N32,
            IMPLICIT_WGRAD_N64,
            IMPLICIT_WGRAD_N128,
        ],
    },
    KernelFile {
        name: "conv_narrow",
        source: include_str!("../ops/conv/conv_narrow.cu"),
        kernels: &[
            NARROW_FORWARD.f16,
            NARROW_FORWARD.f32,
            NARROW_GRAD_INPUT.f16,
            NARROW_GRAD_INPUT.f32,
            NARROW_WGRAD.f16,
            NARROW_WGRAD.f32,
            THIN_FORWARD,
            THIN_WGRAD,
        ],
    },
    KernelFile {
        name: "depthwise",
        source: include_str!("../ops/conv/depthwise.cu"),
        kernels: &[
            DEPTHWISE_FORWARD.f16,
            DEPTHWISE_FORWARD.f32,
            DEPTHWISE_BACKWARD_INPUT.f16,
            DEPTHWISE_BACKWARD_INPUT.f32,
            DEPTHWISE_WGRAD_PARTIAL.f16,
            DEPTHWISE_WGRAD_PARTIAL.f32,
            DEPTHWISE_WGRAD_REDUCE,
        ],
    },
    KernelFile {
        name: "optim",
        source: include_str!("optim.cu"),
        kernels: &[
            GRAD_SUMSQ,
            STEP_FINALIZE,
            ADAMW_CHECK,
            ADAMW_CHECK_F32,
            STEP_COMMIT,
            ADAMW_FUSED,
            ADAMW_FUSED_F32,
        ],
    },
];

/// The file that defines `sig`.
pub fn file_of(sig: &KernelSig) -> Option<&'static KernelFile> {
    FILES.iter().find(|f| f.name == sig.file)
}

impl KernelFile {
    /// The source as NVRTC compiles it: `common.cuh` spliced in.
    pub fn full_source(&self) -> String {
        self.source.replacen(INCLUDE_COMMON, COMMON, 1)
    }
}

/// What to compile for. The number is the compute capability ×10 + minor
/// (80 = 8.0, 90 = 9.0).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Target {
    /// PTX for the virtual architecture `compute_NN` (JIT-compiled by the
    /// driver at load time; runs on that architecture and newer).
    Ptx(u32),
    /// A CUBIN for the real architecture `sm_NN` (that architecture only).
    Cubin(u32),
}

impl Target {
    fn arch_option(self) -> String {
        match self {
            Target::Ptx(a) => format!("--gpu-architecture=compute_{a}"),
            Target::Cubin(a) => format!("--gpu-architecture=sm_{a}"),
        }
    }

    fn extension(self) -> &'static str {
        match self {
            Target::Ptx(_) => "ptx",
            Target::Cubin(_) => "cubin",
        }
    }
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Target::Ptx(a) => write!(f, "compute_{a} (PTX)"),
            Target::Cubin(a) => write!(f, "sm_{a} (CUBIN)"),
        }
    }
}

/// Options every kernel is compiled with (besides the architecture). No fast
/// math: expf/logf/sqrtf keep their accuracy, which the parity tests assume.
const OPTIONS: &[&str] = &["--std=c++17"];

/// NVRTC's version (major, minor).
pub fn nvrtc_version() -> CudaResult<(i32, i32)> {
    libs::ensure_nvrtc()?;
    let (mut major, mut minor): (c_int, c_int) = (0, 0);
    // SAFETY: NVRTC is loadable (checked above); nvrtcVersion writes two ints.
    unsafe { nvrtc_sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| CudaError::Nvrtc {
            op: "nvrtcVersion",
            detail: format!("{e}"),
        })?;
    Ok((major, minor))
}

/// The real architectures (×10 + minor) this NVRTC can compile for.
pub fn supported_archs() -> CudaResult<Vec<u32>> {
    libs::ensure_nvrtc()?;
    let nvrtc_err = |op, e: nvrtc::NvrtcError| CudaError::Nvrtc {
        op,
        detail: format!("{e}"),
    };
    let mut count: c_int = 0;
    // SAFETY: NVRTC is loadable; the call writes one int.
    unsafe { nvrtc_sys::nvrtcGetNumSupportedArchs(&mut count) }
        .result()
        .map_err(|e| nvrtc_err("nvrtcGetNumSupportedArchs", e))?;
    let mut archs = vec![0 as c_int; count.max(0) as usize];
    if !archs.is_empty() {
        // SAFETY: `archs` has room for the `count` ints the call writes.
        unsafe { nvrtc_sys::nvrtcGetSupportedArchs(archs.as_mut_ptr()) }
            .result()
            .map_err(|e| nvrtc_err("nvrtcGetSupportedArchs", e))?;
    }
    Ok(archs.into_iter().map(|a| a.max(0) as u32).collect())
}

/// The target for a device of compute capability `arch` (×10 + minor): its
/// CUBIN if NVRTC supports it, else PTX for the newest supported
/// architecture below it, else an error.
pub fn target_for(arch: u32) -> CudaResult<Target> {
    let archs = supported_archs()?;
    if archs.contains(&arch) {
        return Ok(Target::Cubin(arch));
    }
    match archs.iter().copied().filter(|&a| a <= arch).max() {
        Some(a) => Ok(Target::Ptx(a)),
        None => Err(CudaError::Unsupported {
            op: "kernel compilation",
            reason: format!(
                "NVRTC supports architectures {archs:?}; the GPU is sm_{arch}, older than all of them"
            ),
        }),
    }
}

/// Owns an nvrtcProgram and destroys it on drop.
struct Program(nvrtc_sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: the program was created by create_program and is destroyed
        // only here, once. A failure to free is ignored (nothing to do).
        let _ = unsafe { nvrtc::destroy_program(self.0) };
    }
}

fn nvrtc_err(op: &'static str, e: nvrtc::NvrtcError) -> CudaError {
    CudaError::Nvrtc {
        op,
        detail: format!("{e}"),
    }
}

/// `file` compiled for `target` with NVRTC, with `extra` options after ours.
fn compiled(file: &KernelFile, target: Target, extra: &[&str]) -> CudaResult<Program> {
    compiled_with(file, "", target, extra)
}

/// As `compiled`, with `appended` after the file's source.
fn compiled_with(
    file: &KernelFile,
    appended: &str,
    target: Target,
    extra: &[&str],
) -> CudaResult<Program> {
    libs::ensure_nvrtc()?;
    let source = CString::new(file.full_source() + appended).map_err(|_| CudaError::Nvrtc {
        op: "nvrtcCreateProgram",
        detail: format!("{}.cu contains a NUL byte", file.name),
    })?;
    let name = CString::new(format!("{}.cu", file.name)).expect("file names have no NUL");
    let program = Program(
        nvrtc::create_program(&source, Some(&name))
            .map_err(|e| nvrtc_err("nvrtcCreateProgram", e))?,
    );
    let mut options: Vec<String> = OPTIONS.iter().map(|s| s.to_string()).collect();
    options.push(target.arch_option());
    options.extend(extra.iter().map(|s| s.to_string()));
    // SAFETY: `program` is live (destroyed only by its Drop); `source` and
    // `name` outlive the call.
    let result = unsafe { nvrtc::compile_program(program.0, &options) };
    match result {
        Ok(()) => Ok(program),
        Err(e) => Err(CudaError::Compile {
            file: file.name,
            target: target.to_string(),
            log: format!("{e}\n{}", program_log(&program)),
        }),
    }
}

fn program_log(program: &Program) -> String {
    // SAFETY: the program is live (destroyed only by its Drop).
    unsafe { nvrtc::get_program_log(program.0) }
        .map(|raw| c_chars_to_string(&raw))
        .unwrap_or_else(|_| "(no log)".into())
}

/// What ptxas says of each entry point of `file` compiled for `sm_{arch}`
/// (`--ptxas-options=-v`: registers, shared memory, spill bytes), as its
/// log text.
///
/// NVRTC 12.9 and newer keep a cache of their own, which a macro on the
/// command line does not miss: a second run found every program there and
/// ptxas, never run, wrote no report. So each report compiles a source
/// that differs from every other, by one global variable no kernel reads.
pub fn ptxas_report(file: &KernelFile, arch: u32) -> CudaResult<String> {
    cubin_with_report(file, arch).map(|(_, log)| log)
}

/// `file` compiled to a CUBIN for `sm_{arch}` with ptxas's report (as
/// `ptxas_report`): the image and the log of one compile.
pub fn cubin_with_report(file: &KernelFile, arch: u32) -> CudaResult<(Vec<u8>, String)> {
    static CALLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let fresh = format!(
        "\n__device__ int headroom_ptxas_report_{}_{nanos}_{call};\n",
        std::process::id()
    );
    let target = Target::Cubin(arch);
    let program = compiled_with(file, &fresh, target, &["--ptxas-options=-v"])?;
    let log = program_log(&program);
    Ok((image_of(&program, target)?, log))
}

/// Compiles `file` for `target` with NVRTC, without the disk cache. Returns
/// the PTX text (without its trailing NUL) or the CUBIN bytes.
pub fn compile(file: &KernelFile, target: Target) -> CudaResult<Vec<u8>> {
    compile_half(file, target, HalfFormat::F16)
}

/// As `compile`, with the 2-byte storage in `half`'s format.
pub fn compile_half(file: &KernelFile, target: Target, half: HalfFormat) -> CudaResult<Vec<u8>> {
    let program = compiled(file, target, half.nvrtc_defines())?;
    image_of(&program, target)
}

/// The PTX text (without its trailing NUL) or the CUBIN bytes of a
/// compiled program.
fn image_of(program: &Program, target: Target) -> CudaResult<Vec<u8>> {
    match target {
        Target::Ptx(_) => {
            // SAFETY: `program` is live (destroyed only by its Drop) and
            // compiled successfully; the call copies its PTX out.
            let raw =
                unsafe { nvrtc::get_ptx(program.0) }.map_err(|e| nvrtc_err("nvrtcGetPTX", e))?;
            Ok(c_chars_to_string(&raw).into_bytes())
        }
        Target::Cubin(_) => {
            let mut size = 0usize;
            // SAFETY: `program` is live and compiled; the call writes one usize.
            unsafe { nvrtc_sys::nvrtcGetCUBINSize(program.0, &mut size) }
                .result()
                .map_err(|e| nvrtc_err("nvrtcGetCUBINSize", e))?;
            let mut cubin = vec![0u8; size];
            // SAFETY: `cubin` has the `size` bytes the call writes.
            unsafe { nvrtc_sys::nvrtcGetCUBIN(program.0, cubin.as_mut_ptr() as *mut c_char) }
                .result()
                .map_err(|e| nvrtc_err("nvrtcGetCUBIN", e))?;
            Ok(cubin)
        }
    }
}

fn c_chars_to_string(raw: &[c_char]) -> String {
    // SAFETY: c_char and u8 have the same size and alignment.
    let bytes = unsafe { std::slice::from_raw_parts(raw.as_ptr() as *const u8, raw.len()) };
    match CStr::from_bytes_until_nul(bytes) {
        Ok(s) => s.to_string_lossy().into_owned(),
        Err(_) => String::from_utf8_lossy(bytes).into_owned(),
    }
}

/// Where compiled kernels are cached: `$HEADROOM_KERNEL_CACHE`, else
/// `$XDG_CACHE_HOME/headroom/kernels`, else `$HOME/.cache/headroom/kernels`
/// (None if none is set: no disk cache).
pub fn kernel_cache_dir() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("HEADROOM_KERNEL_CACHE") {
        return Some(PathBuf::from(dir));
    }
    if let Some(dir) = std::env::var_os("XDG_CACHE_HOME") {
        return Some(PathBuf::from(dir).join("headroom/kernels"));
    }
    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/headroom/kernels"))
}

/// FNV-1a, 64 bits: a hash that stays the same across Rust releases (the
/// cache key must).
fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for part in parts {
        for &b in part.iter().chain(&[0xffu8]) {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

/// The cache file name of `file` compiled for `target`.
pub fn cache_key(file: &KernelFile, target: Target, half: HalfFormat) -> CudaResult<String> {
    let (major, minor) = nvrtc_version()?;
    let source = file.full_source();
    let mut options = OPTIONS.join(" ");
    for define in half.nvrtc_defines() {
        options.push(' ');
        options.push_str(define);
    }
    let hash = fnv1a(&[
        source.as_bytes(),
        options.as_bytes(),
        target.arch_option().as_bytes(),
        format!("nvrtc {major}.{minor}").as_bytes(),
    ]);
    Ok(format!(
        "{}-{}-{hash:016x}.{}",
        file.name,
        match target {
            Target::Ptx(a) => format!("compute_{a}"),
            Target::Cubin(a) => format!("sm_{a}"),
        },
        target.extension()
    ))
}

/// `compile`, through the disk cache: a cached image is read back; a fresh
/// one is written to a temporary name and renamed into place (a failure to
/// write the cache is not an error).
pub fn load_or_compile(file: &KernelFile, target: Target, half: HalfFormat) -> CudaResult<Vec<u8>> {
    let path = match kernel_cache_dir() {
        Some(dir) => Some(dir.join(cache_key(file, target, half)?)),
        None => None,
    };
    if let Some(path) = &path {
        if let Ok(image) = std::fs::read(path) {
            if !image.is_empty() {
                return Ok(image);
            }
        }
    }
    let image = compile_half(file, target, half)?;
    if let Some(path) = &path {
        let _ = write_atomically(path, &image);
    }
    Ok(image)
}

fn write_atomically(path: &std::path::Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = path.parent().ok_or(std::io::ErrorKind::NotFound)?;
    std::fs::create_dir_all(dir)?;
    let tmp = dir.join(format!(
        ".{}.{}.tmp",
        path.file_name()
            .and_then(|n| n.to_str())
            .unwrap_or("kernel"),
        std::process::id()
    ));
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_signature_belongs_to_its_file_and_names_are_unique() {
        let mut names = std::collections::HashSet::new();
        for file in FILES {
            assert!(
                file.source.contains(INCLUDE_COMMON),
                "{}.cu must include common.cuh",
                file.name
            );
            for k in file.kernels {
                assert_eq!(k.file, file.name, "{}", k.name);
                assert!(names.insert(k.name), "duplicate kernel {}", k.name);
                let decl = format!("extern \"C\" __global__ void {}(", k.name);
                assert!(file.source.contains(&decl), "{}.cu lacks {decl}", file.name);
                assert!(std::ptr::eq(file_of(k).unwrap(), file));
            }
        }
    }

    #[test]
    fn the_cache_hash_is_stable() {
        // FNV-1a of "a" then the separator: pinned so that a change of the
        // hash (which would orphan every cached kernel) is deliberate.
        assert_eq!(fnv1a(&[b"a"]), 0x089b_c907_b544_c769);
        assert_ne!(fnv1a(&[b"ab", b"c"]), fnv1a(&[b"a", b"bc"]));
    }
}
