//! The element types of device tensors: a leaf that the kernel registry and
//! the tensors both name, so neither imports the other for it.

/// Element type of a `CudaTensor`.
///
/// `F16` is the backend's 2-byte floating-point storage, whose encoding is
/// the backend's `HalfFormat`: IEEE binary16 (the default), or bfloat16 on a
/// backend opened for it. The kernels' `_f16` entry points, the
/// `f16`-named views and the `half::f16` element type of device buffers all
/// mean that storage (the bits of a buffer are reinterpreted, never
/// converted, so `half::f16` is only a 2-byte carrier there); every host
/// conversion goes through `CudaBackend::half()`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DType {
    F16,
    F32,
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::F16 => 2,
            DType::F32 => 4,
        }
    }
}

/// How a backend encodes its 2-byte activations and compute weights.
///
/// bf16 keeps f32's exponent range (no loss scaling needed) with 8
/// significand bits against f16's 11; it needs sm_80 or newer
/// (`cvt.rn.bf16.f32` and bf16 `mma`). Each `.cu` file is compiled once per
/// format a backend asks for: `HR_BF16` defined selects bf16's conversions
/// and tensor-core instruction (ops/common.cuh).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum HalfFormat {
    #[default]
    F16,
    Bf16,
}

impl HalfFormat {
    /// The oldest architecture (×10 + minor) that has this format's
    /// conversions and tensor-core products.
    pub const fn min_arch(self) -> u32 {
        match self {
            HalfFormat::F16 => 0,
            HalfFormat::Bf16 => 80,
        }
    }

    pub const fn name(self) -> &'static str {
        match self {
            HalfFormat::F16 => "f16",
            HalfFormat::Bf16 => "bf16",
        }
    }

    /// `v` encoded, rounded to nearest even as the kernels' conversions.
    pub fn encode(self, v: f32) -> half::f16 {
        match self {
            HalfFormat::F16 => half::f16::from_f32(v),
            HalfFormat::Bf16 => half::f16::from_bits(half::bf16::from_f32(v).to_bits()),
        }
    }

    pub fn decode(self, h: half::f16) -> f32 {
        match self {
            HalfFormat::F16 => h.to_f32(),
            HalfFormat::Bf16 => half::bf16::from_bits(h.to_bits()).to_f32(),
        }
    }

    /// `v` as this format stores it.
    pub fn round(self, v: f32) -> f32 {
        self.decode(self.encode(v))
    }

    /// One rounding's relative error at most: 2^-11 for f16, 2^-8 for bf16.
    pub const fn unit_roundoff(self) -> f32 {
        match self {
            HalfFormat::F16 => 1.0 / 2048.0,
            HalfFormat::Bf16 => 1.0 / 256.0,
        }
    }

    /// The NVRTC options that compile a kernel file for this format.
    pub(crate) const fn nvrtc_defines(self) -> &'static [&'static str] {
        match self {
            HalfFormat::F16 => &[],
            HalfFormat::Bf16 => &["-DHR_BF16"],
        }
    }
}

impl std::fmt::Display for HalfFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}
