//! A dense f32 tensor. Images are NHWC (channels-last) everywhere; a batch of
//! feature vectors is [N, C].
//!
//! Storage is reference-counted so that a layer can keep its input for
//! backward without copying it (a ReLU output saved by the ReLU for its mask
//! and by the next convolution for its weight gradient is one buffer).
//! Writing to a shared tensor copies it first (`Arc::make_mut`).
//!
//! Every buffer is a block of the device's caching pool (`crate::memory`):
//! it is taken from the pool when the tensor is made and given back when the
//! last handle to it is dropped. The `try_` constructors are subject to the
//! pool's budget and return `ModelError::OutOfMemory` when it would be
//! exceeded; layers, losses and the network use only those. `zeros` and the
//! copy-on-write in `data_mut` are infallible (setup and tests).

use std::mem::MaybeUninit;
use std::sync::Arc;

use rayon::prelude::*;

use crate::memory::{self, MemoryPool};
use crate::{Device, ModelError, Result};

#[derive(Clone, Debug)]
pub struct Tensor {
    shape: Vec<usize>,
    storage: Storage,
}

#[derive(Clone, Debug)]
enum Storage {
    Cpu(Arc<Block>),
}

/// A CPU buffer on loan from a pool; `data.len()` is the tensor's length,
/// its capacity the block's size.
pub(crate) struct Block {
    data: Vec<f32>,
    /// None for empty buffers, which hold no memory.
    pool: Option<Arc<MemoryPool>>,
}

impl Block {
    /// `len` elements written by `init`, from the current pool.
    ///
    /// # Safety
    /// `init` must initialise every element of the slice it is given.
    unsafe fn build(
        len: usize,
        checked: bool,
        init: impl FnOnce(&mut [MaybeUninit<f32>]),
    ) -> Result<Self> {
        if len == 0 {
            return Ok(Self {
                data: Vec::new(),
                pool: None,
            });
        }
        let pool = memory::current(Device::Cpu);
        let mut data = pool.alloc(len, checked)?;
        init(&mut data.spare_capacity_mut()[..len]);
        // SAFETY: the caller's `init` initialised all `len` elements, within
        // the capacity the pool gave us.
        unsafe { data.set_len(len) };
        Ok(Self {
            data,
            pool: Some(pool),
        })
    }

    fn copy_of(src: &[f32], checked: bool) -> Result<Self> {
        // SAFETY: copy_from_slice writes every element.
        unsafe {
            Self::build(src.len(), checked, |out| {
                for (o, &v) in out.iter_mut().zip(src) {
                    o.write(v);
                }
            })
        }
    }

    fn adopt(data: Vec<f32>, checked: bool) -> Result<Self> {
        if data.capacity() == 0 {
            return Ok(Self { data, pool: None });
        }
        let pool = memory::current(Device::Cpu);
        pool.adopt(&data, checked)?;
        Ok(Self {
            data,
            pool: Some(pool),
        })
    }
}

impl Drop for Block {
    fn drop(&mut self) {
        if let Some(pool) = self.pool.take() {
            pool.release(std::mem::take(&mut self.data));
        }
    }
}

/// The copy `Arc::make_mut` makes of a shared buffer (infallible).
impl Clone for Block {
    fn clone(&self) -> Self {
        match Self::copy_of(&self.data, false) {
            Ok(block) => block,
            // An unchecked allocation fails only if the OS refuses, where a
            // `Vec` would abort the process too.
            Err(e) => panic!("copying a shared tensor: {e}"),
        }
    }
}

impl std::fmt::Debug for Block {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.data.fmt(f)
    }
}

/// Writes `value` everywhere, in parallel for large buffers.
fn fill_uninit(out: &mut [MaybeUninit<f32>], value: f32) {
    const CHUNK: usize = 1 << 16;
    if out.len() <= CHUNK {
        out.fill(MaybeUninit::new(value));
    } else {
        out.par_chunks_mut(CHUNK)
            .for_each(|c| c.fill(MaybeUninit::new(value)));
    }
}

fn shape_len(op: &'static str, shape: &[usize]) -> Result<usize> {
    shape
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| ModelError::Shape {
            op,
            expected: "a shape whose element count fits in memory".into(),
            got: format!("{shape:?}"),
        })
}

impl Tensor {
    fn with_block(shape: &[usize], block: Block) -> Self {
        Self {
            shape: shape.to_vec(),
            storage: Storage::Cpu(Arc::new(block)),
        }
    }

    /// Zeros; infallible, outside the pool's budget (setup and tests). Use
    /// `try_zeros` on any path that must respect the budget.
    pub fn zeros(shape: &[usize]) -> Self {
        let len = shape.iter().product();
        // SAFETY: fill_uninit writes every element.
        match unsafe { Block::build(len, false, |out| fill_uninit(out, 0.0)) } {
            Ok(block) => Self::with_block(shape, block),
            Err(e) => panic!("Tensor::zeros({shape:?}): {e}"),
        }
    }

    /// Zeros from the pool; `ModelError::OutOfMemory` past the budget.
    pub fn try_zeros(shape: &[usize]) -> Result<Self> {
        Self::try_full(shape, 0.0)
    }

    /// Every element `value`; `ModelError::OutOfMemory` past the budget.
    pub fn try_full(shape: &[usize], value: f32) -> Result<Self> {
        let len = shape_len("Tensor::try_full", shape)?;
        // SAFETY: fill_uninit writes every element.
        let block = unsafe { Block::build(len, true, |out| fill_uninit(out, value))? };
        Ok(Self::with_block(shape, block))
    }

    /// Element i is `f(i)`, in order; `ModelError::OutOfMemory` past the
    /// budget.
    pub fn try_from_fn(shape: &[usize], mut f: impl FnMut(usize) -> f32) -> Result<Self> {
        let len = shape_len("Tensor::try_from_fn", shape)?;
        // SAFETY: the loop writes every element.
        let block = unsafe {
            Block::build(len, true, |out| {
                for (i, o) in out.iter_mut().enumerate() {
                    o.write(f(i));
                }
            })?
        };
        Ok(Self::with_block(shape, block))
    }

    /// A copy of `data` in a pool block; `ModelError::OutOfMemory` past the
    /// budget.
    pub fn try_from_slice(shape: &[usize], data: &[f32]) -> Result<Self> {
        check_len("Tensor::try_from_slice", shape, data.len())?;
        Ok(Self::with_block(shape, Block::copy_of(data, true)?))
    }

    /// A pool block of `shape` whose elements `init` writes, without zeroing
    /// it first (zeroing a reused block is a whole extra pass over memory).
    /// `ModelError::OutOfMemory` past the budget.
    ///
    /// # Safety
    /// `init` must initialise every element of the slice it is given.
    pub unsafe fn try_init_with(
        shape: &[usize],
        init: impl FnOnce(&mut [MaybeUninit<f32>]),
    ) -> Result<Self> {
        let len = shape_len("Tensor::try_init_with", shape)?;
        // SAFETY: forwarded to our caller.
        let block = unsafe { Block::build(len, true, init)? };
        Ok(Self::with_block(shape, block))
    }

    /// Takes over `data` (accounted in the pool, and kept as a cached block
    /// of its capacity when dropped). Fails on a length mismatch, or with
    /// `ModelError::OutOfMemory` if holding it would take the pool past its
    /// budget (the buffer is then freed).
    pub fn from_vec(shape: &[usize], data: Vec<f32>) -> Result<Self> {
        check_len("Tensor::from_vec", shape, data.len())?;
        Ok(Self::with_block(shape, Block::adopt(data, true)?))
    }

    /// Takes over `data` for a parameter or buffer at setup: accounted in the
    /// pool like `from_vec`, but outside the budget, like `zeros`.
    ///
    /// # Panics
    /// If `data` does not hold `shape`'s element count (a bug in the caller).
    pub(crate) fn from_vec_unbudgeted(shape: &[usize], data: Vec<f32>) -> Self {
        assert_eq!(
            shape.iter().product::<usize>(),
            data.len(),
            "Tensor::from_vec_unbudgeted({shape:?})"
        );
        match Block::adopt(data, false) {
            Ok(block) => Self::with_block(shape, block),
            Err(e) => panic!("Tensor::from_vec_unbudgeted({shape:?}): {e}"),
        }
    }

    /// Builds a normalised f32 NHWC batch from u8 pixels: (x/255 - mean)/std.
    pub fn from_u8_normalized(shape: &[usize], pixels: &[u8], mean: f32, std: f32) -> Result<Self> {
        check_len("Tensor::from_vec", shape, pixels.len())?;
        let scale = 1.0 / (255.0 * std);
        let shift = mean / std;
        // SAFETY: the zip writes every element (the lengths are equal).
        unsafe {
            Self::try_init_with(shape, |out| {
                for (o, &p) in out.iter_mut().zip(pixels) {
                    o.write(p as f32 * scale - shift);
                }
            })
        }
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    pub fn len(&self) -> usize {
        self.data().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn device(&self) -> Device {
        match self.storage {
            Storage::Cpu(_) => Device::Cpu,
        }
    }

    pub fn data(&self) -> &[f32] {
        match &self.storage {
            Storage::Cpu(block) => &block.data,
        }
    }

    /// Mutable access; copies the buffer first if another tensor shares it
    /// (infallible: outside the budget; see `try_data_mut`).
    pub fn data_mut(&mut self) -> &mut [f32] {
        match &mut self.storage {
            Storage::Cpu(block) => Arc::make_mut(block).data.as_mut_slice(),
        }
    }

    /// Mutable access; copies the buffer first if another tensor shares it,
    /// failing with `ModelError::OutOfMemory` if that copy is past the
    /// budget.
    pub fn try_data_mut(&mut self) -> Result<&mut [f32]> {
        match &mut self.storage {
            Storage::Cpu(block) => {
                if Arc::get_mut(block).is_none() {
                    *block = Arc::new(Block::copy_of(&block.data, true)?);
                }
                let unique = Arc::get_mut(block).expect("a fresh copy has one owner");
                Ok(unique.data.as_mut_slice())
            }
        }
    }

    /// Whether no other tensor shares this one's buffer (writing to it will
    /// not copy).
    pub fn is_unique(&mut self) -> bool {
        match &mut self.storage {
            Storage::Cpu(block) => Arc::get_mut(block).is_some(),
        }
    }

    /// Takes the buffer out of the pool's care (copying only if it is shared;
    /// the copy is an ordinary allocation).
    pub fn into_vec(self) -> Vec<f32> {
        match self.storage {
            Storage::Cpu(block) => match Arc::try_unwrap(block) {
                Ok(mut block) => {
                    if let Some(pool) = block.pool.take() {
                        pool.detach(&block.data);
                    }
                    std::mem::take(&mut block.data)
                }
                Err(shared) => shared.data.clone(),
            },
        }
    }

    /// Samples `start..start + len` of the batch (the first dimension), as a
    /// new tensor; `ModelError::OutOfMemory` past the budget. Splits a batch
    /// into micro-batches.
    pub fn try_narrow_batch(&self, start: usize, len: usize) -> Result<Self> {
        let n = self.batch();
        if self.shape.is_empty() || start.checked_add(len).is_none_or(|end| end > n) {
            return Err(ModelError::Shape {
                op: "Tensor::try_narrow_batch",
                expected: format!("a range of samples within the batch of {n}"),
                got: format!("{start}..{}", start.saturating_add(len)),
            });
        }
        let per_sample: usize = self.shape[1..].iter().product();
        let mut shape = self.shape.clone();
        shape[0] = len;
        Self::try_from_slice(
            &shape,
            &self.data()[start * per_sample..(start + len) * per_sample],
        )
    }

    pub fn reshape(mut self, shape: &[usize]) -> Result<Self> {
        let len: usize = shape.iter().product();
        if len != self.len() {
            return Err(ModelError::Shape {
                op: "Tensor::reshape",
                expected: format!("{} elements", self.len()),
                got: format!("shape {shape:?} with {len} elements"),
            });
        }
        self.shape = shape.to_vec();
        Ok(self)
    }

    /// Fails with a named error unless the shape is exactly `expected`.
    pub fn expect_shape(&self, op: &'static str, expected: &[usize]) -> Result<()> {
        if self.shape != expected {
            return Err(ModelError::Shape {
                op,
                expected: format!("{expected:?}"),
                got: format!("{:?}", self.shape),
            });
        }
        Ok(())
    }

    /// The first dimension: the batch size.
    pub fn batch(&self) -> usize {
        self.shape.first().copied().unwrap_or(0)
    }
}

fn check_len(op: &'static str, shape: &[usize], got: usize) -> Result<()> {
    let len = shape_len(op, shape)?;
    if len != got {
        return Err(ModelError::Shape {
            op,
            expected: format!("{len} elements for shape {shape:?}"),
            got: format!("{got} elements"),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_storage_is_copied_on_write() {
        let a = Tensor::from_vec(&[2], vec![1.0, 2.0]).unwrap();
        let mut b = a.clone();
        b.data_mut()[0] = 5.0;
        assert_eq!(a.data(), &[1.0, 2.0]);
        assert_eq!(b.data(), &[5.0, 2.0]);
        let mut c = a.clone();
        c.try_data_mut().unwrap()[1] = 7.0;
        assert_eq!(a.data(), &[1.0, 2.0]);
        assert_eq!(c.data(), &[1.0, 7.0]);
    }

    #[test]
    fn from_vec_rejects_wrong_length() {
        let err = Tensor::from_vec(&[2, 3], vec![0.0; 5]).unwrap_err();
        assert!(err.to_string().contains("6 elements"), "{err}");
        let err = Tensor::try_from_slice(&[2, 3], &[0.0; 7]).unwrap_err();
        assert!(err.to_string().contains("6 elements"), "{err}");
    }

    #[test]
    fn u8_normalisation_matches_formula() {
        let t = Tensor::from_u8_normalized(&[1, 1, 1, 2], &[0, 255], 0.5, 0.25).unwrap();
        assert!((t.data()[0] + 2.0).abs() < 1e-6);
        assert!((t.data()[1] - 2.0).abs() < 1e-6);
        assert!(Tensor::from_u8_normalized(&[1, 2], &[0], 0.5, 0.25).is_err());
    }

    #[test]
    fn constructors_agree() {
        let a = Tensor::try_from_fn(&[2, 3], |i| i as f32).unwrap();
        let b = Tensor::try_from_slice(&[2, 3], &[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]).unwrap();
        assert_eq!(a.data(), b.data());
        assert_eq!(Tensor::try_full(&[3], 2.5).unwrap().data(), &[2.5; 3]);
        let big = Tensor::try_zeros(&[300_000]).unwrap();
        assert!(big.data().iter().all(|&v| v == 0.0));
        assert!(Tensor::try_zeros(&[0, 4]).unwrap().is_empty());
        assert_eq!(a.clone().into_vec(), vec![0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
        assert_eq!(a.into_vec(), vec![0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
    }

    #[test]
    fn narrow_batch_copies_whole_samples() {
        let t = Tensor::try_from_fn(&[4, 2, 3], |i| i as f32).unwrap();
        let mid = t.try_narrow_batch(1, 2).unwrap();
        assert_eq!(mid.shape(), &[2, 2, 3]);
        assert_eq!(mid.data(), &t.data()[6..18]);
        assert!(t.try_narrow_batch(3, 2).is_err());
        assert!(t.try_narrow_batch(usize::MAX, 2).is_err());
        assert_eq!(t.try_narrow_batch(4, 0).unwrap().shape(), &[0, 2, 3]);
    }
}
