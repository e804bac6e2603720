//! What a convolution is and how it runs: its shapes (`ConvShape`), the
//! algorithm (`ConvAlgorithm`) and workspace (`ConvPlan`). Plain values that
//! the launches (`cuda.rs`), the direct kernels (`narrow.rs`) and the tuner
//! (`tune.rs`) all read: a leaf of the family.

use crate::cuda::launch::same_len;
use crate::cuda::params::*;
use crate::cuda::tensor::{checked_len, CudaTensor};
use crate::cuda::{CudaError, CudaResult};

/// Shapes of one convolution; the weight is [k, k, cin, cout] = W[K, cout]
/// with K = k·k·cin, as in the CPU's `Conv2d`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct ConvShape {
    pub n: usize,
    pub h: usize,
    pub w: usize,
    pub cin: usize,
    pub cout: usize,
    pub k: usize,
    pub stride: usize,
    pub pad: usize,
}

impl ConvShape {
    /// (oh, ow), or an error if the kernel does not fit the padded input.
    pub fn out_hw(&self) -> CudaResult<(usize, usize)> {
        let dim = |size: usize| -> Option<usize> {
            let padded = size.checked_add(self.pad.checked_mul(2)?)?;
            let span = padded.checked_sub(self.k)?;
            Some(span / self.stride + 1)
        };
        match (self.stride > 0 && self.k > 0, dim(self.h), dim(self.w)) {
            (true, Some(oh), Some(ow)) if self.h > 0 && self.w > 0 => Ok((oh, ow)),
            _ => Err(CudaError::shape(
                "conv2d",
                "a kernel that fits the padded input, stride ≥ 1",
                format!("{self:?}"),
            )),
        }
    }

    /// Columns of the im2col matrix: k·k·cin.
    pub fn kk(&self) -> usize {
        self.k * self.k * self.cin
    }

    /// A 1×1 convolution with stride 1 and no padding: one matrix product,
    /// no im2col.
    pub fn is_pointwise(&self) -> bool {
        self.k == 1 && self.stride == 1 && self.pad == 0
    }

    /// The kernels' parameters; `check` has made every product here fit
    /// in 32 bits.
    pub(super) fn params(&self, oh: usize, ow: usize, n0: usize, images: usize) -> ConvParams {
        let by = |d: usize| FastDiv::new(d as u32);
        ConvParams {
            h: self.h as u32,
            w: self.w as u32,
            cin: self.cin as u32,
            oh: oh as u32,
            ow: ow as u32,
            k: self.k as u32,
            stride: self.stride as u32,
            pad: self.pad as u32,
            n0: n0 as u32,
            images: images as u32,
            by_kk: by(self.kk()),
            by_opix: by(oh * ow),
            by_ow: by(ow),
            by_kcin: by(self.k * self.cin),
            by_cin: by(self.cin),
            by_image: by(self.h * self.w * self.cin),
            by_wcin: by(self.w * self.cin),
            by_stride: by(self.stride),
        }
    }

    pub(super) fn check(&self, x: &CudaTensor, weight_len: usize) -> CudaResult<(usize, usize)> {
        x.expect_shape("conv2d input", &[self.n, self.h, self.w, self.cin])?;
        same_len(
            "conv2d",
            "weight [k, k, cin, cout]",
            self.kk() * self.cout,
            weight_len,
        )?;
        let (oh, ow) = self.out_hw()?;
        // Every index the kernels form must fit in 32 bits.
        checked_len("conv2d", &[self.n, oh, ow, self.kk().max(self.cout)])?;
        Ok((oh, ow))
    }
}

/// Default budget for the im2col scratch matrix: the batch is processed in
/// groups of whole images whose A fits in it (at least one image). On the
/// emulator, going from 64 MiB to 16 took the reference model's step peak
/// from 101 to 69 MiB at batch 128 and from 250 to 211 MiB at batch 512.
pub const CONV_SCRATCH_BYTES: usize = 16 << 20;

/// How the GPU runs a convolution.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConvPlan {
    /// `device.conv_algorithm`.
    pub algorithm: ConvAlgorithm,
    /// `device.conv_workspace`: the most an im2col matrix may take (the
    /// batch goes through it in groups of whole images).
    pub workspace: usize,
}

/// The library's default is the plain im2col path, which every GPU and
/// shape takes; a training run's default is `device.conv_algorithm`'s
/// (`auto`, in the pipeline's config).
impl Default for ConvPlan {
    fn default() -> Self {
        ConvPlan {
            algorithm: ConvAlgorithm::Im2col,
            workspace: CONV_SCRATCH_BYTES,
        }
    }
}

/// How the products of a convolution run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConvAlgorithm {
    /// An im2col matrix in a workspace, multiplied by cuBLAS.
    Im2col,
    /// conv_mma.cu: the matrix gathered tile by tile into shared memory and
    /// multiplied on the tensor cores, where the shape allows it (f16,
    /// channels in and out multiples of 8, sm_80 or newer; otherwise
    /// im2col), for the forward and both gradients.
    ImplicitGemm,
    /// Each convolution by its shape: implicit GEMM where it was the faster
    /// of the two on an H100 (stride 1, at most `AUTO_IMPLICIT_CHANNELS`
    /// channels in and out), direct kernels for fewer than 8 output channels
    /// and, in f16, from input channels not a multiple of 8 to a multiple
    /// of 8 outputs (`conv_narrow.cu`: a first layer), im2col + cuBLAS
    /// elsewhere. A rule, not a timing: every run of a model picks the
    /// same, so its bits (and a resumed run's) do not depend on how a
    /// timing fell.
    Auto,
    /// `Auto`'s direct kernels, and for the rest each product timed both
    /// ways (implicit GEMM and im2col) on this GPU the first time its shape
    /// runs, the faster kept (`conv_tune.rs`). Two runs may choose, and so
    /// compute, differently; a resumed run keeps its checkpoint's choices.
    Tune,
}

impl ConvAlgorithm {
    /// The words `device.conv_algorithm` takes, in this order.
    pub const NAMES: [&'static str; 4] = ["im2col", "implicit_gemm", "auto", "tune"];
    const ALL: [ConvAlgorithm; 4] = [
        ConvAlgorithm::Im2col,
        ConvAlgorithm::ImplicitGemm,
        ConvAlgorithm::Auto,
        ConvAlgorithm::Tune,
    ];

    /// The setting's word for this algorithm.
    pub fn as_str(self) -> &'static str {
        match self {
            ConvAlgorithm::Im2col => "im2col",
            ConvAlgorithm::ImplicitGemm => "implicit_gemm",
            ConvAlgorithm::Auto => "auto",
            ConvAlgorithm::Tune => "tune",
        }
    }

    /// The algorithm a word names, or what was expected instead.
    pub fn from_name(name: &str) -> Result<Self, String> {
        match Self::ALL.iter().find(|a| a.as_str() == name) {
            Some(algorithm) => Ok(*algorithm),
            None => Err(format!(
                "expected \"im2col\", \"implicit_gemm\", \"auto\" or \"tune\", got \"{name}\""
            )),
        }
    }

    /// Whether the algorithm picks kernels by the convolution's shape
    /// (`Auto`, `Tune`), which takes the direct kernels where they apply.
    pub(super) fn by_shape(self) -> bool {
        matches!(self, ConvAlgorithm::Auto | ConvAlgorithm::Tune)
    }
}

/// Written and read as its word (`"implicit_gemm"`), as an experiment's
/// TOML holds it.
impl serde::Serialize for ConvAlgorithm {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

impl<'de> serde::Deserialize<'de> for ConvAlgorithm {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let name = <String as serde::Deserialize>::deserialize(deserializer)?;
        Self::from_name(&name).map_err(<D::Error as serde::de::Error>::custom)
    }
}

/// `ConvAlgorithm::Auto` takes the implicit kernel up to this many channels.
/// On an H100 (docs/measurements/nvidia-h100.md) it took a 3×3
/// stride-1 convolution's step from 1.10 to 0.52 ms at 32 channels (batch
/// 512) and from 0.54 to 0.43 at 64, but from 0.30 to 0.49 at 128 (not
/// profiled further: its 64-column tiles gather each input tile twice
/// there, and cuBLAS's GEMM is wider); with stride 2 im2col was faster at
/// 64 and 128 channels (measured before the input gradient gathered only
/// the taps that reach each parity class: `implicit_products`).
pub(crate) const AUTO_IMPLICIT_CHANNELS: usize = 64;
