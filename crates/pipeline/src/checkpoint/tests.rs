//! The checkpoint format's unit tests: round trips, corruption, non-finite
//! values, atomic writes.
use super::*;

pub(crate) fn sample(step: u64) -> Checkpoint {
    Checkpoint {
        meta: CheckpointMeta {
            config_fingerprint: 7,
            config_json: "{}".into(),
            model_json: Checkpoint::model_json(&ModelSpec {
                input: [2, 2, 1],
                mean: 0.0,
                std: 1.0,
                layers: vec![headroom_model::LayerSpec::Relu],
                checkpoint: Default::default(),
                tokens: None,
                frames: None,
            }),
            epoch: step / 10,
            batches_done: (step % 10) as usize,
            step,
            consecutive_skips: 0,
            progress: EpochProgress {
                loss_sum: 1.5,
                correct: 3,
                seen: 4,
                skipped: 0,
                train_seconds: 0.25,
            },
            tuned_convs: vec![TunedConv {
                shape: headroom_model::cuda::ops::ConvShape {
                    n: 128,
                    h: 28,
                    w: 28,
                    cin: 32,
                    cout: 64,
                    k: 3,
                    stride: 2,
                    pad: 1,
                },
                product: headroom_model::cuda::ops::ConvProduct::InputGrad,
                path: headroom_model::cuda::ops::ConvPath::Implicit,
                implicit_ms: 0.125,
                im2col_ms: 0.25,
            }],
            monitor: MonitorState::default(),
        },
        params: vec![vec![1.0, -2.5], vec![3.0]],
        buffers: vec![vec![0.5]],
        optimizer: AdamWState {
            step: 3,
            first_moment: vec![vec![0.1, 0.2], vec![0.3]],
            second_moment: vec![vec![0.01, 0.02], vec![0.03]],
        },
        loss_scale: Some(LossScalerState {
            scale: 32768.0,
            clean_steps: 17,
        }),
    }
}

/// `checkpoint`'s file as format 3 wrote it: the meta without its last
/// field, the tuned convolutions (a list of none: one byte).
fn format_3_bytes(checkpoint: &Checkpoint) -> Vec<u8> {
    assert!(checkpoint.meta.tuned_convs.is_empty());
    let mut bytes = checkpoint.encode().unwrap();
    bytes[8..12].copy_from_slice(&3u32.to_le_bytes());
    let meta_len = u64::from_le_bytes(bytes[12..20].try_into().unwrap());
    assert_eq!(bytes[20 + meta_len as usize - 1], 0, "an empty list");
    bytes.remove(20 + meta_len as usize - 1);
    bytes[12..20].copy_from_slice(&(meta_len - 1).to_le_bytes());
    bytes.truncate(bytes.len() - 4);
    let crc = crc32fast::hash(&bytes);
    bytes.extend_from_slice(&crc.to_le_bytes());
    bytes
}

#[test]
fn a_watching_run_writes_format_5_and_any_other_format_4_as_before() {
    let plain = sample(12);
    let bytes = plain.encode().unwrap();
    assert_eq!(bytes[8..12], 4u32.to_le_bytes());
    assert_eq!(
        Checkpoint::decode(&bytes, Path::new("v4.ckpt")).unwrap(),
        plain
    );
    let mut watching = sample(12);
    watching.meta.monitor = MonitorState {
        best: Some((0.25, 3)),
        epochs_since_best: 2,
    };
    let bytes = watching.encode().unwrap();
    assert_eq!(bytes[8..12], 5u32.to_le_bytes());
    assert_eq!(
        Checkpoint::decode(&bytes, Path::new("v5.ckpt")).unwrap(),
        watching
    );
}

#[test]
fn a_format_3_file_without_tuned_convolutions_still_loads() {
    let mut checkpoint = sample(12);
    checkpoint.meta.tuned_convs.clear();
    let bytes = format_3_bytes(&checkpoint);
    let loaded = Checkpoint::decode(&bytes, Path::new("v3.ckpt")).unwrap();
    assert_eq!(loaded, checkpoint);
    // The same bytes claiming format 4 lack the meta's last field.
    let mut claimed = bytes.clone();
    claimed[8..12].copy_from_slice(&4u32.to_le_bytes());
    claimed.truncate(claimed.len() - 4);
    let crc = crc32fast::hash(&claimed);
    claimed.extend_from_slice(&crc.to_le_bytes());
    let err = Checkpoint::decode(&claimed, Path::new("v4.ckpt")).unwrap_err();
    assert!(err.to_string().contains("cannot decode metadata"), "{err}");
}

#[test]
fn a_format_2_file_without_a_loss_scale_still_loads() {
    let mut checkpoint = Checkpoint {
        loss_scale: None,
        ..sample(12)
    };
    checkpoint.meta.tuned_convs.clear();
    let mut bytes = format_3_bytes(&checkpoint);
    // Format 2: version 2 and no loss-scale flag before the checksum.
    bytes[8..12].copy_from_slice(&2u32.to_le_bytes());
    bytes.truncate(bytes.len() - 5);
    let crc = crc32fast::hash(&bytes);
    bytes.extend_from_slice(&crc.to_le_bytes());
    let loaded = Checkpoint::decode(&bytes, Path::new("old.ckpt")).unwrap();
    assert_eq!(loaded, checkpoint);
    bytes.truncate(bytes.len() - 4);
    bytes[8..12].copy_from_slice(&1u32.to_le_bytes());
    let crc = crc32fast::hash(&bytes);
    bytes.extend_from_slice(&crc.to_le_bytes());
    let err = Checkpoint::decode(&bytes, Path::new("older.ckpt")).unwrap_err();
    assert!(err.to_string().contains("format version 1"), "{err}");
}

/// Writes `checkpoint` (which `mark` gives one value of 4242.5), then
/// turns that value into `poison` in the file, its checksum made to
/// match: a file as a run that carried the value would have left it.
fn write_poisoned(
    dir: &Path,
    mut checkpoint: Checkpoint,
    mark: fn(&mut Checkpoint) -> &mut f32,
    poison: f32,
) -> PathBuf {
    *mark(&mut checkpoint) = 4242.5;
    let path = write(dir, &checkpoint, 5).unwrap();
    let mut bytes = std::fs::read(&path).unwrap();
    let marker = 4242.5f32.to_le_bytes();
    let at = bytes.windows(4).position(|w| w == marker).unwrap();
    bytes[at..at + 4].copy_from_slice(&poison.to_le_bytes());
    let body = bytes.len() - 4;
    let crc = crc32fast::hash(&bytes[..body]);
    bytes[body..].copy_from_slice(&crc.to_le_bytes());
    std::fs::write(&path, bytes).unwrap();
    path
}

#[test]
fn a_non_finite_weight_buffer_or_moment_is_refused_by_name_and_resume_takes_the_one_before() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), &sample(1), 5).unwrap();
    type Mark = fn(&mut Checkpoint) -> &mut f32;
    let cases: [(Mark, f32, &str); 4] = [
        (
            |c| &mut c.params[0][1],
            f32::NAN,
            "parameter 0 (value 1: NaN)",
        ),
        (
            |c| &mut c.buffers[0][0],
            f32::INFINITY,
            "buffer 0 (value 0: inf)",
        ),
        (
            |c| &mut c.optimizer.first_moment[1][0],
            f32::NEG_INFINITY,
            "first moment of parameter 1 (value 0: -inf)",
        ),
        (
            |c| &mut c.optimizer.second_moment[0][1],
            f32::NAN,
            "second moment of parameter 0 (value 1: NaN)",
        ),
    ];
    for (mark, poison, named) in cases {
        let path = write_poisoned(dir.path(), sample(2), mark, poison);
        let err = load(&path).unwrap_err().to_string();
        assert!(err.contains(named) && err.contains("non-finite"), "{err}");
        let (found, skipped) = newest_valid(dir.path()).unwrap();
        assert_eq!(found.unwrap().1.meta.step, 1, "fell back to the good one");
        assert_eq!(skipped.len(), 1);
        std::fs::remove_file(&path).unwrap();
    }
}

#[test]
fn a_non_finite_state_is_never_written_and_prunes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let good = write(dir.path(), &sample(1), 1).unwrap();
    let mut bad = sample(2);
    bad.buffers[0][0] = f32::NAN;
    let err = write(dir.path(), &bad, 1).unwrap_err().to_string();
    assert!(
        err.contains("buffer 0 (value 0: NaN) is not finite"),
        "{err}"
    );
    assert_eq!(
        list(dir.path()).unwrap(),
        vec![good],
        "keep = 1 pruned nothing"
    );
    let leftovers: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
    assert_eq!(leftovers.len(), 1, "no temporary left behind");
}

#[test]
fn round_trip_and_keep_last_k() {
    let dir = tempfile::tempdir().unwrap();
    for step in [5, 10, 15, 20] {
        write(dir.path(), &sample(step), 2).unwrap();
    }
    assert_eq!(list(dir.path()).unwrap().len(), 2);
    let (found, skipped) = newest_valid(dir.path()).unwrap();
    let (path, checkpoint) = found.unwrap();
    assert!(skipped.is_empty());
    assert!(path.ends_with(file_name(20)));
    assert_eq!(checkpoint, sample(20));
    assert_eq!(
        checkpoint.model().unwrap().layers,
        vec![headroom_model::LayerSpec::Relu]
    );
}

#[test]
fn corrupt_newest_is_skipped_and_named() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), &sample(1), 3).unwrap();
    let newest = write(dir.path(), &sample(2), 3).unwrap();
    let mut bytes = fs::read(&newest).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0xFF;
    fs::write(&newest, &bytes).unwrap();
    let (found, skipped) = newest_valid(dir.path()).unwrap();
    assert_eq!(found.unwrap().1.meta.step, 1);
    assert_eq!(skipped.len(), 1);
    let reason = skipped[0].to_string();
    assert!(
        reason.contains("checksum") && reason.contains(&file_name(2)),
        "{reason}"
    );
}

#[test]
fn every_truncation_is_rejected_with_the_path() {
    let bytes = sample(1).encode().unwrap();
    for cut in 0..bytes.len() {
        let err = Checkpoint::decode(&bytes[..cut], Path::new("x.ckpt")).unwrap_err();
        assert!(err.to_string().contains("x.ckpt"), "{err}");
    }
}

#[test]
fn a_corrupt_length_is_reported_as_corruption_unless_the_checksum_holds() {
    let mut bytes = sample(3).encode().unwrap();
    let meta_len = u64::from_le_bytes(bytes[12..20].try_into().unwrap()) as usize;
    // The first parameter's length, after the list's count.
    let at = 20 + meta_len + 4;
    assert_eq!(bytes[at..at + 8], 2u64.to_le_bytes());
    bytes[at..at + 8].copy_from_slice(&u64::MAX.to_le_bytes());
    let err = Checkpoint::decode(&bytes, Path::new("torn.ckpt")).unwrap_err();
    assert!(err.to_string().contains(CHECKSUM_FAILED), "{err}");

    // Written that way, checksum and all: the parse error is the news.
    let body = bytes.len() - 4;
    let crc = crc32fast::hash(&bytes[..body]);
    bytes[body..].copy_from_slice(&crc.to_le_bytes());
    let err = Checkpoint::decode(&bytes, Path::new("odd.ckpt")).unwrap_err();
    let message = err.to_string();
    assert!(
        message.contains("odd.ckpt")
            && message.contains("tensor length")
            && message.contains("implausible"),
        "{message}"
    );
}

#[test]
fn a_file_streamed_to_disk_holds_the_bytes_encode_makes() {
    let dir = tempfile::tempdir().unwrap();
    let mut large = sample(4);
    // Longer than one block of values, not a multiple of it.
    large.params[0] = (0..3 * VALUES_PER_BLOCK + 5)
        .map(|i| i as f32 * 0.5)
        .collect();
    let path = write(dir.path(), &large, 1).unwrap();
    assert_eq!(fs::read(&path).unwrap(), large.encode().unwrap());
    assert_eq!(load(&path).unwrap(), large);
}

/// A state written out of order, short or long fails the write, names
/// what was wrong, and leaves the checkpoints there as they were.
#[test]
fn a_malformed_state_fails_the_write_and_leaves_no_file() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), &sample(1), 3).unwrap();
    let meta = sample(2).meta;
    type Writes = fn(&mut dyn StateWriter) -> Result<()>;
    let cases: [(&str, Writes); 4] = [
        ("the state ended", |out| out.list(0)),
        ("the end before the last list", |out| {
            out.list(0)?;
            out.finish(0, None)
        }),
        ("more values than the tensor holds", |out| {
            out.list(1)?;
            out.tensor(2)?;
            out.values(&[1.0, 2.0, 3.0])
        }),
        ("a tensor out of place", |out| {
            out.list(1)?;
            out.tensor(1)?;
            out.tensor(1)
        }),
    ];
    for (reason, state) in cases {
        let err = write_with(dir.path(), &meta, 3, state)
            .unwrap_err()
            .to_string();
        assert!(err.contains(reason), "{err}");
        let names: Vec<_> = fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, [std::ffi::OsString::from(file_name(1))]);
    }
}

#[test]
fn full_disk_keeps_the_previous_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), &sample(1), 3).unwrap();
    // The temporary file of the next write is /dev/full: every write to
    // it fails with ENOSPC, as on a full disk.
    let tmp = dir.path().join(format!(".{}.tmp", file_name(2)));
    std::os::unix::fs::symlink("/dev/full", &tmp).unwrap();
    let err = write(dir.path(), &sample(2), 3).unwrap_err().to_string();
    assert!(err.contains(".tmp"), "{err}");
    assert!(!tmp.exists(), "the temporary file is cleaned up");
    let (found, skipped) = newest_valid(dir.path()).unwrap();
    assert!(skipped.is_empty());
    assert_eq!(found.unwrap().1, sample(1));
}

#[test]
fn a_named_checkpoint_that_is_there_but_unusable_is_not_called_missing() {
    let dir = tempfile::tempdir().unwrap();
    let absent = load_named(&dir.path().join("nothing.ckpt"))
        .unwrap_err()
        .to_string();
    assert!(absent.contains("no such checkpoint file"), "{absent}");
    let looped = dir.path().join("loop.ckpt");
    std::os::unix::fs::symlink(&looped, &looped).unwrap();
    let err = load_named(&looped).unwrap_err().to_string();
    assert!(err.contains("symlink loop"), "{err}");
    assert!(!err.contains("no such"), "{err}");
    let dangling = dir.path().join("dangling.ckpt");
    std::os::unix::fs::symlink(dir.path().join("gone"), &dangling).unwrap();
    let err = load_named(&dangling).unwrap_err().to_string();
    assert!(err.contains("dangling symlink"), "{err}");
}
