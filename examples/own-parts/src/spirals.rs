//! A dataset of your own: points on `arms` interleaved spirals, the class
//! being the arm. Each sample is made from its index and the seed alone, so
//! the set needs no files, every worker thread reads it without locks, and
//! a resumed run sees exactly the samples the killed one would have.
//!
//! A sample is two u8 "pixels" (x and y scaled to 0..=255) of shape
//! `[1, 1, 2]`; the model normalises them like any image.

use headroom_loader::{Dataset, LoaderError};

/// Arms (classes) of the examples' spirals.
pub const ARMS: usize = 3;

pub struct Spirals {
    samples: usize,
    arms: usize,
    seed: u64,
}

impl Spirals {
    pub fn new(samples: usize, arms: usize, seed: u64) -> Self {
        Self {
            samples,
            arms: arms.max(1),
            seed,
        }
    }

    /// The point of sample `index` and its arm.
    pub fn point(&self, index: usize) -> ([f32; 2], u32) {
        let arm = index % self.arms;
        let mut state = self.seed ^ (index as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let mut uniform = || {
            // splitmix64: a fixed function of (seed, index).
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 24) as f32
        };
        let radius = uniform();
        let noise = (uniform() - 0.5) * 0.3;
        let angle = radius * 3.0 * std::f32::consts::PI
            + arm as f32 * std::f32::consts::TAU / self.arms as f32
            + noise;
        ([radius * angle.cos(), radius * angle.sin()], arm as u32)
    }
}

fn to_u8(v: f32) -> u8 {
    ((v + 1.0) * 127.5).round().clamp(0.0, 255.0) as u8
}

impl Dataset for Spirals {
    fn len(&self) -> usize {
        self.samples
    }

    fn sample_shape(&self) -> [usize; 3] {
        [1, 1, 2]
    }

    fn num_classes(&self) -> usize {
        self.arms
    }

    fn read(&self, index: usize, out: &mut [u8]) -> Result<u32, LoaderError> {
        if index >= self.samples {
            return Err(LoaderError::Index {
                index,
                len: self.samples,
            });
        }
        if out.len() != 2 {
            return Err(LoaderError::Buffer {
                index,
                expected: 2,
                actual: out.len(),
            });
        }
        let ([x, y], arm) = self.point(index);
        out.copy_from_slice(&[to_u8(x), to_u8(y)]);
        Ok(arm)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_are_a_function_of_index_and_seed() {
        let (a, b) = (Spirals::new(100, 3, 1), Spirals::new(100, 3, 1));
        let (mut x, mut y) = ([0u8; 2], [0u8; 2]);
        for i in 0..100 {
            assert_eq!(a.read(i, &mut x).unwrap(), b.read(i, &mut y).unwrap());
            assert_eq!(x, y);
        }
        let other = Spirals::new(100, 3, 2);
        let differ = (0..100).any(|i| {
            other.read(i, &mut y).unwrap();
            a.read(i, &mut x).unwrap();
            x != y
        });
        assert!(differ, "another seed gives other points");
    }

    #[test]
    fn every_arm_has_its_share_and_bad_reads_are_errors() {
        let set = Spirals::new(30, 3, 0);
        let mut counts = [0; 3];
        let mut out = [0u8; 2];
        for i in 0..30 {
            counts[set.read(i, &mut out).unwrap() as usize] += 1;
        }
        assert_eq!(counts, [10, 10, 10]);
        assert!(matches!(
            set.read(30, &mut out),
            Err(LoaderError::Index { .. })
        ));
        assert!(matches!(
            set.read(0, &mut [0u8; 3]),
            Err(LoaderError::Buffer { .. })
        ));
    }
}
