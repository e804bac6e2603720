//! Random bytes and random truncations fed to every reader of files from
//! disk: each must answer with an error (or, rarely, a valid value), never a
//! panic, and never allocate more than the input can justify. This file is
//! its own test binary, so the memory bound is measured on its own process.

use std::path::Path;

use headroom_loader::IdxDataset;
use headroom_pipeline::checkpoint::{Checkpoint, CheckpointMeta, EpochProgress};

struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// One random mutation: a cut, flipped bytes, a random 32-bit field, or noise.
fn mutate(rng: &mut XorShift, valid: &[u8]) -> Vec<u8> {
    let mut bytes = valid.to_vec();
    match rng.below(4) {
        0 => bytes.truncate(rng.below(valid.len())),
        1 => {
            for _ in 0..1 + rng.below(8) {
                let at = rng.below(bytes.len());
                bytes[at] ^= 1 << rng.below(8);
            }
        }
        2 => {
            let at = rng.below(bytes.len().saturating_sub(4) / 4) * 4;
            let value = (rng.next() as u32).to_be_bytes();
            bytes[at..at + 4].copy_from_slice(&value);
        }
        _ => {
            let len = rng.below(2 * valid.len());
            bytes = (0..len).map(|_| rng.next() as u8).collect();
        }
    }
    bytes
}

fn peak_rss_mib() -> u64 {
    headroom_pipeline::peak_rss_bytes().unwrap_or(0) >> 20
}

fn idx_files(count: u32) -> (Vec<u8>, Vec<u8>) {
    let mut images = vec![0, 0, 8, 3];
    for d in [count, 28, 28] {
        images.extend_from_slice(&d.to_be_bytes());
    }
    images.extend((0..count as usize * 784).map(|i| (i % 251) as u8));
    let mut labels = vec![0, 0, 8, 1];
    labels.extend_from_slice(&count.to_be_bytes());
    labels.extend((0..count).map(|i| (i % 10) as u8));
    (images, labels)
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    use std::io::Write;
    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    encoder.write_all(bytes).unwrap();
    encoder.finish().unwrap()
}

fn open_pair(dir: &Path, images: &[u8], labels: &[u8]) -> bool {
    let (image_path, label_path) = (dir.join("images"), dir.join("labels"));
    std::fs::write(&image_path, images).unwrap();
    std::fs::write(&label_path, labels).unwrap();
    match IdxDataset::open(&image_path, &label_path) {
        Ok(_) => true,
        Err(e) => {
            let text = e.to_string();
            assert!(
                text.contains("images") || text.contains("labels"),
                "error names no file: {text}"
            );
            false
        }
    }
}

#[test]
fn idx_reader_survives_random_bytes_and_truncations() {
    let dir = tempfile::tempdir().unwrap();
    let (images, labels) = idx_files(32);
    let (gz_images, gz_labels) = (gzip(&images), gzip(&labels));
    let before = peak_rss_mib();
    let mut rng = XorShift(0x9E37_79B9_7F4A_7C15);
    let mut accepted = 0;
    for round in 0..1500 {
        let (valid_images, valid_labels) = if round % 2 == 0 {
            (&images, &labels)
        } else {
            (&gz_images, &gz_labels)
        };
        let broken_images = mutate(&mut rng, valid_images);
        let broken_labels = if rng.below(4) == 0 {
            mutate(&mut rng, valid_labels)
        } else {
            valid_labels.clone()
        };
        accepted += open_pair(dir.path(), &broken_images, &broken_labels) as usize;
    }
    assert!(accepted < 1500, "mutations should mostly be caught");
    let growth = peak_rss_mib().saturating_sub(before);
    assert!(
        growth < 256,
        "peak RSS grew by {growth} MiB on inputs of a few KiB"
    );
}

fn sample_checkpoint() -> Checkpoint {
    Checkpoint {
        meta: CheckpointMeta {
            config_fingerprint: 1,
            config_json: "{}".into(),
            model_json: "{}".into(),
            epoch: 2,
            batches_done: 5,
            step: 99,
            consecutive_skips: 0,
            progress: EpochProgress::default(),
            tuned_convs: Vec::new(),
            monitor: Default::default(),
        },
        params: vec![vec![0.5; 300], vec![-1.0; 17]],
        buffers: vec![vec![1.0; 32]],
        optimizer: headroom_optim::AdamWState {
            step: 99,
            first_moment: vec![vec![0.1; 300], vec![0.2; 17]],
            second_moment: vec![vec![0.01; 300], vec![0.02; 17]],
        },
        loss_scale: Some(headroom_optim::LossScalerState {
            scale: 1024.0,
            clean_steps: 5,
        }),
    }
}

/// Re-seals a mutated file with a valid checksum, so that the decoder behind
/// the checksum is exercised too.
fn reseal(bytes: &mut [u8]) {
    if bytes.len() >= 12 {
        let body_len = bytes.len() - 4;
        let crc = crc32fast::hash(&bytes[..body_len]);
        bytes[body_len..].copy_from_slice(&crc.to_le_bytes());
    }
}

#[test]
fn checkpoint_reader_survives_random_bytes_and_truncations() {
    let valid = sample_checkpoint().encode().unwrap();
    let path = Path::new("fuzzed.ckpt");
    let before = peak_rss_mib();
    let mut rng = XorShift(0xD1B5_4A32_D192_ED03);
    for round in 0..5000 {
        let mut bytes = mutate(&mut rng, &valid);
        if round % 2 == 0 {
            let n = bytes.len().min(8);
            bytes[..n].copy_from_slice(&b"HDRMCKPT"[..n]);
            reseal(&mut bytes);
        }
        if let Err(e) = Checkpoint::decode(&bytes, path) {
            assert!(e.to_string().contains("fuzzed.ckpt"), "{e}");
        }
    }
    let growth = peak_rss_mib().saturating_sub(before);
    assert!(
        growth < 256,
        "peak RSS grew by {growth} MiB on inputs of a few KiB"
    );
}

#[test]
fn shard_reader_survives_random_bytes_and_truncations() {
    use headroom_loader::{Dataset, ShardCacheConfig, ShardSize, ShardedDataset};
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    headroom_loader::write_synthetic_store(&store, 60, [8, 8, 1], 10, ShardSize::Samples(20))
        .unwrap();
    let mut files: Vec<_> = std::fs::read_dir(&store)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    let originals: Vec<Vec<u8>> = files.iter().map(|f| std::fs::read(f).unwrap()).collect();
    let before = peak_rss_mib();
    let mut rng = XorShift(0xA076_1D64_78BD_642F);
    let mut caught = 0;
    for _ in 0..600 {
        let victim = rng.below(files.len());
        std::fs::write(&files[victim], mutate(&mut rng, &originals[victim])).unwrap();
        let outcome = ShardedDataset::open(&store, ShardCacheConfig::default()).and_then(|data| {
            let mut pixels = vec![0u8; 64];
            (0..data.len()).try_for_each(|i| data.read(i, &mut pixels).map(|_| ()))
        });
        if let Err(e) = outcome {
            caught += 1;
            let text = e.to_string();
            assert!(
                text.contains(&store.display().to_string()),
                "error names no file: {text}"
            );
        }
        std::fs::write(&files[victim], &originals[victim]).unwrap();
    }
    assert!(caught > 500, "only {caught} of 600 corruptions were caught");
    let growth = peak_rss_mib().saturating_sub(before);
    assert!(
        growth < 256,
        "peak RSS grew by {growth} MiB on inputs of a few KiB"
    );
}
