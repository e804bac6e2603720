//! Moving-Fashion-MNIST: sequences of frames in which garments of a source
//! image set (Fashion-MNIST's train images for training, its test images for
//! testing) move in straight lines and bounce off the edges, made on the fly
//! as Moving-MNIST is made from MNIST.
//!
//! Sample `i` is a pure function of (seed, i): a counter-based hash picks
//! each garment's image, start position and velocity, so any sample can be
//! drawn on its own — workers need no shared state, and a resumed run reads
//! the very sequences it would have read. A sample is its `frames` frames
//! stacked along the height, one u8 "image" `[frames·size, size, 1]` with
//! label 0, so batches, workers and prefetching carry it unchanged (the
//! model's next-frame pairs come from `Batch::next_frame_pairs`). Where
//! garments overlap a pixel is the brighter of the two.

use std::sync::Arc;

use crate::rng::{key, SplitMix64, DOMAIN_MOVING};
use crate::{Dataset, LoaderError};

/// Pixels a garment moves per frame: at least, and below.
const SPEED: (f64, f64) = (2.0, 4.0);

/// What the sequences look like.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MovingConfig {
    /// Frames per sequence (the model reads all but the last).
    pub frames: usize,
    /// Frame height and width.
    pub size: usize,
    /// Garments per sequence.
    pub garments: usize,
    /// Sequences in the dataset.
    pub sequences: usize,
    /// Keys the random numbers; one per split, so they differ.
    pub seed: u64,
}

/// A garment's path through one sequence.
#[derive(Clone, Debug, PartialEq)]
pub struct GarmentPath {
    /// Its index in the source images.
    pub image: usize,
    /// Top-left corner (row, column) in each frame.
    pub positions: Vec<(usize, usize)>,
}

/// Sequences of moving garments over a source of single-channel images.
pub struct MovingFashionMnist {
    source: Arc<dyn Dataset>,
    config: MovingConfig,
    /// The garment's side (source images are square).
    side: usize,
}

impl MovingFashionMnist {
    /// Sequences over `source` (square single-channel images no larger than
    /// a frame); errors name the bad setting.
    pub fn new(source: Arc<dyn Dataset>, config: MovingConfig) -> Result<Self, LoaderError> {
        let [h, w, c] = source.sample_shape();
        let bad = |field, message: String| Err(LoaderError::Config { field, message });
        if h != w || c != 1 {
            return bad(
                "source",
                format!("garments must be square single-channel images, got [{h}, {w}, {c}]"),
            );
        }
        if config.size < h {
            return bad(
                "size",
                format!("frames of {} px cannot hold {h}-px garments", config.size),
            );
        }
        if config.frames == 0 || config.garments == 0 || source.is_empty() {
            return bad(
                "frames",
                "need at least one frame, one garment and one source image".into(),
            );
        }
        Ok(Self {
            source,
            config,
            side: h,
        })
    }

    pub fn config(&self) -> &MovingConfig {
        &self.config
    }

    /// The garments of sample `index` and where they are in each frame.
    pub fn paths(&self, index: usize) -> Vec<GarmentPath> {
        let mut rng = SplitMix64::new(key(&[DOMAIN_MOVING, self.config.seed, index as u64]));
        let room = (self.config.size - self.side) as f64;
        (0..self.config.garments)
            .map(|_| {
                let image = rng.below(self.source.len() as u64) as usize;
                let (mut y, mut x) = (rng.unit_f64() * room, rng.unit_f64() * room);
                let angle = rng.unit_f64() * std::f64::consts::TAU;
                let speed = SPEED.0 + rng.unit_f64() * (SPEED.1 - SPEED.0);
                let (mut vy, mut vx) = (speed * angle.sin(), speed * angle.cos());
                let positions = (0..self.config.frames)
                    .map(|_| {
                        let at = (y.round() as usize, x.round() as usize);
                        (y, vy) = bounce(y + vy, vy, room);
                        (x, vx) = bounce(x + vx, vx, room);
                        at
                    })
                    .collect();
                GarmentPath { image, positions }
            })
            .collect()
    }

    /// Draws `garment` at `(row, col)` of a frame, keeping the brighter pixel.
    fn draw(&self, frame: &mut [u8], garment: &[u8], (row, col): (usize, usize)) {
        let (size, side) = (self.config.size, self.side);
        for (r, line) in garment.chunks_exact(side).enumerate() {
            let start = (row + r) * size + col;
            for (out, &g) in frame[start..start + side].iter_mut().zip(line) {
                *out = (*out).max(g);
            }
        }
    }
}

/// A coordinate moved past an edge of [0, room] is reflected back inside,
/// and its velocity turned round.
fn bounce(p: f64, v: f64, room: f64) -> (f64, f64) {
    if p < 0.0 {
        ((-p).min(room), -v)
    } else if p > room {
        ((2.0 * room - p).max(0.0), -v)
    } else {
        (p, v)
    }
}

impl Dataset for MovingFashionMnist {
    fn len(&self) -> usize {
        self.config.sequences
    }

    fn sample_shape(&self) -> [usize; 3] {
        [self.config.frames * self.config.size, self.config.size, 1]
    }

    fn num_classes(&self) -> usize {
        1
    }

    /// The source images' fingerprint and the settings that draw the
    /// sequences from them (the sequences are a function of both).
    fn fingerprint(&self) -> Option<u32> {
        let source = self.source.fingerprint()?;
        let mut digest = crc32fast::Hasher::new();
        digest.update(&source.to_le_bytes());
        digest.update(format!("{:?}", self.config).as_bytes());
        Some(digest.finalize())
    }

    fn read(&self, index: usize, out: &mut [u8]) -> Result<u32, LoaderError> {
        if index >= self.config.sequences {
            return Err(LoaderError::Index {
                index,
                len: self.config.sequences,
            });
        }
        let frame_len = self.config.size * self.config.size;
        let expected = self.config.frames * frame_len;
        if out.len() != expected {
            return Err(LoaderError::Buffer {
                index,
                expected,
                actual: out.len(),
            });
        }
        out.fill(0);
        let mut garment = vec![0u8; self.side * self.side];
        for path in self.paths(index) {
            self.source.read(path.image, &mut garment)?;
            for (frame, &at) in out.chunks_exact_mut(frame_len).zip(&path.positions) {
                self.draw(frame, &garment, at);
            }
        }
        Ok(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounce_reflects_and_turns_the_velocity() {
        assert_eq!(bounce(-1.5, -2.0, 10.0), (1.5, 2.0));
        assert_eq!(bounce(11.0, 3.0, 10.0), (9.0, -3.0));
        assert_eq!(bounce(4.0, 3.0, 10.0), (4.0, 3.0));
    }
}
