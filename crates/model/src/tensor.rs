//! A dense f32 tensor. Images are NHWC (channels-last) everywhere; a batch of
//! feature vectors is [N, C].
//!
//! Storage is reference-counted so that a layer can keep its input for
//! backward without copying it (a ReLU output saved by the ReLU for its mask
//! and by the next convolution for its weight gradient is one buffer).
//! Writing to a shared tensor copies it first (`Arc::make_mut`).

use std::sync::Arc;

use crate::{Device, ModelError, Result};

#[derive(Clone, Debug)]
pub struct Tensor {
    shape: Vec<usize>,
    storage: Storage,
}

#[derive(Clone, Debug)]
enum Storage {
    Cpu(Arc<Vec<f32>>),
}

impl Tensor {
    pub fn zeros(shape: &[usize]) -> Self {
        let len = shape.iter().product();
        Self {
            shape: shape.to_vec(),
            storage: Storage::Cpu(Arc::new(vec![0.0; len])),
        }
    }

    pub fn from_vec(shape: &[usize], data: Vec<f32>) -> Result<Self> {
        let len: usize = shape.iter().product();
        if len != data.len() {
            return Err(ModelError::Shape {
                op: "Tensor::from_vec",
                expected: format!("{len} elements for shape {shape:?}"),
                got: format!("{} elements", data.len()),
            });
        }
        Ok(Self {
            shape: shape.to_vec(),
            storage: Storage::Cpu(Arc::new(data)),
        })
    }

    /// Builds a normalised f32 NHWC batch from u8 pixels: (x/255 - mean)/std.
    pub fn from_u8_normalized(shape: &[usize], pixels: &[u8], mean: f32, std: f32) -> Result<Self> {
        let scale = 1.0 / (255.0 * std);
        let shift = mean / std;
        let data = pixels.iter().map(|&p| p as f32 * scale - shift).collect();
        Self::from_vec(shape, data)
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
            Storage::Cpu(data) => data,
        }
    }

    /// Mutable access; copies the buffer first if another tensor shares it.
    pub fn data_mut(&mut self) -> &mut [f32] {
        match &mut self.storage {
            Storage::Cpu(data) => Arc::make_mut(data).as_mut_slice(),
        }
    }

    /// Takes the buffer out, copying only if it is shared.
    pub fn into_vec(self) -> Vec<f32> {
        match self.storage {
            Storage::Cpu(data) => Arc::unwrap_or_clone(data),
        }
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
    }

    #[test]
    fn from_vec_rejects_wrong_length() {
        let err = Tensor::from_vec(&[2, 3], vec![0.0; 5]).unwrap_err();
        assert!(err.to_string().contains("6 elements"), "{err}");
    }

    #[test]
    fn u8_normalisation_matches_formula() {
        let t = Tensor::from_u8_normalized(&[1, 1, 1, 2], &[0, 255], 0.5, 0.25).unwrap();
        assert!((t.data()[0] + 2.0).abs() < 1e-6);
        assert!((t.data()[1] - 2.0).abs() < 1e-6);
    }
}
