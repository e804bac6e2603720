//! Moving-Fashion-MNIST sequences: reproducible by index, inside the frame,
//! garments from the split they are given, overlaps by the brighter pixel,
//! and carried by the loader's workers unchanged.

use std::sync::Arc;

use headroom_loader::{
    DataLoader, Dataset, LoaderConfig, LoaderError, MovingConfig, MovingFashionMnist,
};

/// Square "garments" of `side` px, image k filled with the value `base + k`
/// (so a pixel tells which image it came from) except a zero border row.
struct Solid {
    side: usize,
    base: u8,
    count: usize,
}

impl Dataset for Solid {
    fn len(&self) -> usize {
        self.count
    }
    fn sample_shape(&self) -> [usize; 3] {
        [self.side, self.side, 1]
    }
    fn num_classes(&self) -> usize {
        1
    }
    fn read(&self, index: usize, out: &mut [u8]) -> Result<u32, LoaderError> {
        out.fill(self.base + index as u8);
        Ok(0)
    }
}

fn moving(base: u8, seed: u64, sequences: usize) -> MovingFashionMnist {
    let source = Arc::new(Solid {
        side: 6,
        base,
        count: 5,
    });
    let config = MovingConfig {
        frames: 12,
        size: 16,
        garments: 2,
        sequences,
        seed,
    };
    MovingFashionMnist::new(source, config).unwrap()
}

fn read(data: &MovingFashionMnist, index: usize) -> Vec<u8> {
    let [h, w, c] = data.sample_shape();
    let mut out = vec![0u8; h * w * c];
    assert_eq!(data.read(index, &mut out).unwrap(), 0);
    out
}

#[test]
fn a_sample_is_a_function_of_seed_and_index_alone() {
    let data = moving(10, 7, 50);
    assert_eq!(data.sample_shape(), [12 * 16, 16, 1]);
    let late = read(&data, 42);
    // Reading others first, or from another instance, changes nothing.
    let _ = (read(&data, 0), read(&data, 41));
    assert_eq!(read(&moving(10, 7, 50), 42), late);
    assert_ne!(read(&data, 43), late);
    assert_ne!(read(&moving(10, 8, 50), 42), late, "the seed matters");
    assert!(matches!(
        data.read(50, &mut vec![0; 12 * 256]),
        Err(LoaderError::Index { index: 50, len: 50 })
    ));
}

#[test]
fn garments_stay_inside_move_and_bounce() {
    let data = moving(10, 1, 200);
    let mut turned = 0;
    for index in 0..200 {
        for path in data.paths(index) {
            assert!(path.image < 5);
            assert_eq!(path.positions.len(), 12);
            for &(row, col) in &path.positions {
                assert!(row + 6 <= 16 && col + 6 <= 16, "{:?}", path.positions);
            }
            let steps: Vec<(i64, i64)> = path
                .positions
                .windows(2)
                .map(|w| (w[1].0 as i64 - w[0].0 as i64, w[1].1 as i64 - w[0].1 as i64))
                .collect();
            // 2 to 4 px a frame (rounded; less on a frame that bounces).
            assert!(steps.iter().all(|(dy, dx)| dy.abs() <= 5 && dx.abs() <= 5));
            let still = steps.iter().filter(|(dy, dx)| *dy == 0 && *dx == 0).count();
            assert!(still <= 2, "{:?}", path.positions);
            let sign_flip = |a: i64, b: i64| a * b < 0;
            turned += steps
                .windows(2)
                .filter(|s| sign_flip(s[0].0, s[1].0) || sign_flip(s[0].1, s[1].1))
                .count();
        }
    }
    assert!(
        turned > 100,
        "garments bounce off the edges ({turned} turns)"
    );
}

#[test]
fn pixels_come_from_the_given_split_and_overlaps_take_the_max() {
    // "Train" images are 10..15, "test" images 100..105.
    for (base, data) in [(10u8, moving(10, 3, 100)), (100u8, moving(100, 3, 100))] {
        let mut overlaps = 0;
        for index in 0..100 {
            let sample = read(&data, index);
            let paths = data.paths(index);
            for (f, frame) in sample.chunks_exact(256).enumerate() {
                for (p, &pixel) in frame.iter().enumerate() {
                    let (r, c) = (p / 16, p % 16);
                    let covering: Vec<u8> = paths
                        .iter()
                        .filter(|g| {
                            let (gr, gc) = g.positions[f];
                            (gr..gr + 6).contains(&r) && (gc..gc + 6).contains(&c)
                        })
                        .map(|g| base + g.image as u8)
                        .collect();
                    overlaps += usize::from(covering.len() == 2 && covering[0] != covering[1]);
                    assert_eq!(pixel, covering.iter().copied().max().unwrap_or(0));
                }
            }
        }
        assert!(overlaps > 0, "some garments overlap");
    }
}

#[test]
fn the_loader_carries_sequences_and_splits_next_frame_pairs() {
    let data: Arc<dyn Dataset> = Arc::new(moving(10, 5, 16));
    let config = LoaderConfig {
        batch_size: 4,
        workers: 2,
        ..LoaderConfig::default()
    };
    let loader = DataLoader::new(Arc::clone(&data), config).unwrap();
    let batch = loader.epoch(0, 0).next().unwrap().unwrap();
    assert_eq!(batch.shape, [4, 12 * 16, 16, 1]);
    let (inputs, targets) = batch.next_frame_pairs(11);
    assert_eq!((inputs.len(), targets.len()), (4 * 11 * 256, 4 * 11 * 256));
    let first = batch.sample(0);
    assert_eq!(&inputs[..11 * 256], &first[..11 * 256]);
    assert_eq!(&targets[..11 * 256], &first[256..]);
    // In order: sample 0 of an unshuffled epoch is sequence 0.
    assert_eq!(first, read_dyn(data.as_ref(), 0));
}

fn read_dyn(data: &dyn Dataset, index: usize) -> Vec<u8> {
    let [h, w, c] = data.sample_shape();
    let mut out = vec![0u8; h * w * c];
    data.read(index, &mut out).unwrap();
    out
}

#[test]
fn bad_sources_and_sizes_are_named() {
    let source = Arc::new(Solid {
        side: 6,
        base: 0,
        count: 2,
    });
    let config = MovingConfig {
        frames: 3,
        size: 4,
        garments: 2,
        sequences: 1,
        seed: 0,
    };
    let err = MovingFashionMnist::new(source, config)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("size") && err.contains("6-px"), "{err}");
}
