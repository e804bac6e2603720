//! The data loader: a persistent worker pool that turns an epoch's sample
//! order into batches, delivered in order with bounded prefetch.
//!
//! ```text
//! EpochIter ──Task{job, batch}──▶ shared task queue ──▶ worker ×W
//!     ▲                                                    │
//!     └── reorder buffer ◀── bounded reply channel ◀──────┘ (one per EpochIter)
//! ```
//!
//! Each `EpochIter` owns its reply channel (capacity `prefetch`) and an
//! `EpochJob` shared with the tasks it sends. It never has more than
//! `prefetch` batches dispatched and not yet delivered, so the reply channel
//! never fills and memory stays bounded. Dropping the iterator sets the job's
//! `cancelled` flag (workers skip its remaining tasks, and stop a batch in
//! progress) and drops the receiver (late results are discarded on send), so
//! nothing from an old epoch can reach a newer iterator.

use std::borrow::Cow;
use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use serde::{Deserialize, Serialize};

use crate::augment::{self, AugmentConfig, AugmentParams, MAX_MAGNITUDE, MAX_NUM_OPS};
use crate::sampler::{EpochOrder, ShuffleMode};
use crate::{mix, randaugment, Dataset, Element, LoaderError, SampleKind, ShardLayout};

mod checks;
use checks::{config_err, validate};

/// Upper bounds that catch configuration typos (e.g. a byte count given as
/// a worker count) before they exhaust threads or memory.
const MAX_WORKERS: usize = 1024;
const MAX_PREFETCH: usize = 1 << 16;

/// How batches are made and delivered.
#[derive(Clone, Debug)]
pub struct LoaderConfig {
    /// Samples per batch (> 0).
    pub batch_size: usize,
    /// Visit the samples in a random order that depends on (seed, epoch).
    pub shuffle: bool,
    /// Drop the final incomplete batch (training); keep it (evaluation).
    pub drop_last: bool,
    /// Seed of the sample order and of the augmentations.
    pub seed: u64,
    /// Worker threads; 0 = produce batches in the calling thread.
    pub workers: usize,
    /// Batches dispatched ahead of the consumer (> 0): the bound on batches
    /// in flight or waiting.
    pub prefetch: usize,
    /// Augmentations applied to every sample.
    pub augment: AugmentConfig,
    /// The longest wait for the next batch before `LoaderError::Timeout` (> 0).
    pub timeout: Duration,
    /// How a shuffled epoch is ordered; [`ShuffleMode::ShardBlocks`] keeps a
    /// shard cache from thrashing (it needs a dataset with a shard layout,
    /// e.g. [`crate::ShardedDataset`], and is global shuffling otherwise).
    pub shuffle_mode: ShuffleMode,
    /// The most bytes the loader may hold: the dataset's memory limit
    /// (shard cache, or the whole in-memory dataset) + the batches in flight
    /// (`prefetch` batches, 1 without workers). Checked by
    /// [`DataLoader::new`]; `None` = no check.
    pub memory_budget: Option<u64>,
    /// The consumer holds the whole dataset (a GPU with the training set
    /// resident): batches carry [`SampleRecipe`]s and labels, no pixels.
    /// Only crop and flip can be applied this way: RandAugment, Mixup and
    /// CutMix are refused.
    pub resident: bool,
    /// One rank's share of a data-parallel run: of each global batch of
    /// `batch_size × world` samples (the epoch's order cut as one process
    /// would cut it), this loader makes slice `rank`. Needs `drop_last`, so
    /// every rank has the same batches. Default: the whole (rank 0 of 1).
    pub shard: Shard,
}

/// Which slice of each global batch a loader makes ([`LoaderConfig::shard`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shard {
    pub rank: usize,
    pub world: usize,
}

impl Default for Shard {
    fn default() -> Self {
        Self { rank: 0, world: 1 }
    }
}

impl Default for LoaderConfig {
    /// Batches of 32 in order, no workers, prefetch 2, no augmentation,
    /// 60 s timeout, global shuffling (when `shuffle` is set), no budget.
    fn default() -> Self {
        Self {
            batch_size: 32,
            shuffle: false,
            drop_last: false,
            seed: 0,
            workers: 0,
            prefetch: 2,
            augment: AugmentConfig::default(),
            timeout: Duration::from_secs(60),
            shuffle_mode: ShuffleMode::Global,
            memory_budget: None,
            resident: false,
            shard: Shard::default(),
        }
    }
}

/// Where a loader is in its run, for checkpoints: resuming from it with
/// [`DataLoader::resume`] reproduces the rest of the run exactly.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct LoaderState {
    /// The loader's seed (checked on resume).
    pub seed: u64,
    /// The epoch in progress.
    pub epoch: u64,
    /// Batches of `epoch` already delivered. When it equals
    /// `batches_per_epoch()` the epoch is complete and the next one is
    /// `epoch + 1`.
    pub batches_consumed: usize,
}

/// The loader's memory, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoaderMemory {
    /// Held by the dataset now (shard cache, or the in-memory dataset).
    pub cache_bytes: u64,
    /// The most the dataset ever held.
    pub cache_peak_bytes: u64,
    /// The most bytes of batches made and not yet delivered at once.
    pub prefetched_bytes_max: u64,
    /// The bound checked against the budget: the dataset's limit + batches
    /// in flight at their largest.
    pub limit_bytes: u64,
    /// `LoaderConfig::memory_budget`.
    pub budget: Option<u64>,
}

/// A batch of samples, u8 NHWC (or f32 features), with their labels.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Batch {
    /// The epoch it belongs to.
    pub epoch: u64,
    /// Its batch number within the epoch.
    pub index: usize,
    /// `[n, h, w, c]`.
    pub shape: [usize; 4],
    /// `n * h * w * c` bytes.
    pub pixels: Vec<u8>,
    /// `n` labels: the samples' own labels, also when mixed.
    pub labels: Vec<u32>,
    /// With Mixup or CutMix: `n * num_classes` target probabilities (each
    /// row sums to 1). `None` when batches are not mixed.
    pub soft_targets: Option<Vec<f32>>,
    /// With [`LoaderConfig::resident`]: how to make each sample from the
    /// copy of the dataset its consumer holds, and `pixels` is empty.
    pub recipes: Option<Vec<SampleRecipe>>,
    /// For a dataset of f32 elements ([`crate::Element::F32`]):
    /// `n * h * w * c` values, NHWC, and `pixels` is empty.
    pub features: Option<Vec<f32>>,
    /// For a dataset with numeric targets ([`crate::SampleKind::values`]):
    /// `n * values` targets, sample after sample, as the dataset stores them.
    pub values: Option<Vec<f32>>,
}

/// One sample of a batch as an instruction instead of pixels: dataset
/// sample `id`, zero-padded by `pad` on every side and cropped back at
/// (`dy`, `dx`), then mirrored left to right if `flip` (the loader's crop and
/// flip, with the same random draws). A consumer holding the whole dataset
/// (a GPU) makes the pixels itself and nothing else crosses to it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SampleRecipe {
    pub id: u32,
    pub pad: u8,
    pub dy: u8,
    pub dx: u8,
    pub flip: bool,
}

impl SampleRecipe {
    /// The sample as two words for a device kernel: `id`, then
    /// `dy | dx << 8 | flip << 16 | pad << 24`.
    pub fn packed(&self) -> [u32; 2] {
        let word = u32::from(self.dy)
            | u32::from(self.dx) << 8
            | u32::from(self.flip) << 16
            | u32::from(self.pad) << 24;
        [self.id, word]
    }

    /// Writes the sample into `out` from the raw sample `src` (HWC,
    /// `shape`), as the loader would have.
    pub fn apply(&self, src: &[u8], out: &mut [u8], shape: [usize; 3]) {
        let params = AugmentParams {
            pad: usize::from(self.pad),
            dy: usize::from(self.dy),
            dx: usize::from(self.dx),
            flip: self.flip,
        };
        augment::apply(src, out, shape, params);
    }
}

impl Batch {
    /// Number of samples in the batch.
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    /// Whether the batch holds no samples (never the case for a delivered batch).
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// Samples `range` of the batch as a batch of their own (same epoch and
    /// batch number), copied.
    pub fn slice(&self, range: std::ops::Range<usize>) -> Batch {
        let n = self.len();
        let sample = self.shape[1] * self.shape[2] * self.shape[3];
        let classes = self.soft_targets.as_ref().map_or(0, |t| t.len() / n.max(1));
        let per_sample = |v: &Vec<f32>| {
            let k = v.len() / n.max(1);
            v[range.start * k..range.end * k].to_vec()
        };
        Batch {
            epoch: self.epoch,
            index: self.index,
            shape: [range.len(), self.shape[1], self.shape[2], self.shape[3]],
            pixels: match (&self.recipes, &self.features) {
                (None, None) => self.pixels[range.start * sample..range.end * sample].to_vec(),
                _ => Vec::new(),
            },
            labels: self.labels[range.clone()].to_vec(),
            soft_targets: self
                .soft_targets
                .as_ref()
                .map(|t| t[range.start * classes..range.end * classes].to_vec()),
            features: self.features.as_ref().map(per_sample),
            values: self.values.as_ref().map(per_sample),
            recipes: self.recipes.as_ref().map(|r| r[range].to_vec()),
        }
    }

    /// The batch with every image mirrored left to right, for flip
    /// test-time augmentation; labels and targets unchanged. Mirroring a
    /// crop-then-flip recipe toggles its flip.
    pub fn mirrored(&self) -> Batch {
        let [_, _, width, channels] = self.shape;
        let row = (width * channels).max(1);
        let mut pixels = Vec::with_capacity(self.pixels.len());
        for line in self.pixels.chunks_exact(row) {
            for x in (0..width).rev() {
                pixels.extend_from_slice(&line[x * channels..(x + 1) * channels]);
            }
        }
        Batch {
            epoch: self.epoch,
            index: self.index,
            shape: self.shape,
            pixels,
            labels: self.labels.clone(),
            soft_targets: self.soft_targets.clone(),
            recipes: self.recipes.as_ref().map(|recipes| {
                recipes
                    .iter()
                    .map(|r| SampleRecipe {
                        flip: !r.flip,
                        ..*r
                    })
                    .collect()
            }),
            features: self.features.clone(),
            values: self.values.clone(),
        }
    }

    /// The batch in consecutive parts of at most `size` samples (at least
    /// one). A batch that fits whole is lent as it is, not copied.
    pub fn micro_batches(&self, size: usize) -> impl Iterator<Item = Cow<'_, Batch>> {
        let (n, size) = (self.len(), size.max(1));
        (0..n).step_by(size).map(move |start| {
            let end = (start + size).min(n);
            if start == 0 && end == n {
                Cow::Borrowed(self)
            } else {
                Cow::Owned(self.slice(start..end))
            }
        })
    }

    /// The pixels of sample `i` of the batch (h*w*c bytes).
    pub fn sample(&self, i: usize) -> &[u8] {
        let len = self.shape[1] * self.shape[2] * self.shape[3];
        &self.pixels[i * len..(i + 1) * len]
    }

    /// For a batch of text windows (samples `[1, length + 1, 1]`, see
    /// [`crate::TextWindows`]): the model's input, the first `length` ids of
    /// each window, and its per-token targets, the last `length` (each
    /// position's next byte); both `n * length`, row-major.
    pub fn next_token_pairs(&self) -> (Vec<u32>, Vec<u32>) {
        let window = self.shape[1] * self.shape[2] * self.shape[3];
        let length = window.saturating_sub(1);
        let mut inputs = Vec::with_capacity(self.len() * length);
        let mut targets = Vec::with_capacity(self.len() * length);
        for sample in self.pixels.chunks_exact(window.max(1)) {
            inputs.extend(sample[..length].iter().map(|&b| u32::from(b)));
            targets.extend(sample[1..].iter().map(|&b| u32::from(b)));
        }
        (inputs, targets)
    }

    /// For a batch of frame sequences (samples of `frames + 1` frames
    /// stacked along the height, see [`crate::MovingFashionMnist`]): the
    /// model's input, the first `frames` frames of each sample, and its
    /// targets, the last `frames` (each frame's successor); both
    /// `n * frames * frame_len` bytes, sample after sample.
    pub fn next_frame_pairs(&self, frames: usize) -> (Vec<u8>, Vec<u8>) {
        let sample_len = self.shape[1] * self.shape[2] * self.shape[3];
        let frame_len = sample_len / (frames + 1);
        let kept = frames * frame_len;
        let mut inputs = Vec::with_capacity(self.len() * kept);
        let mut targets = Vec::with_capacity(self.len() * kept);
        for sample in self.pixels.chunks_exact(sample_len.max(1)) {
            inputs.extend_from_slice(&sample[..kept]);
            targets.extend_from_slice(&sample[sample_len - kept..]);
        }
        (inputs, targets)
    }
}

/// What the workers and the iterators share.
struct Shared {
    dataset: Arc<dyn Dataset>,
    config: LoaderConfig,
    shape: [usize; 3],
    /// Bytes of a sample's record ([`SampleKind::record_len`]): `h*w*c` for
    /// u8 images.
    sample_len: usize,
    kind: SampleKind,
    num_classes: usize,
    len: usize,
    batches: usize,
    layout: Option<ShardLayout>,
    /// Bytes of the largest batch (pixels, labels, soft targets).
    batch_bytes: u64,
    /// The bound of [`LoaderMemory::limit_bytes`].
    limit_bytes: u64,
    inflight: Arc<Inflight>,
}

impl Shared {
    /// The epoch-order position of batch `batch`'s first sample: this
    /// rank's slice of global batch `batch`.
    fn first_position(&self, batch: usize) -> usize {
        let shard = self.config.shard;
        (batch * shard.world + shard.rank) * self.config.batch_size
    }
}

/// Bytes of batches made and not yet delivered.
#[derive(Default)]
struct Inflight {
    current: AtomicU64,
    peak: AtomicU64,
}

/// Counts a batch's bytes in [`Inflight`] until dropped.
struct InflightGuard {
    counter: Arc<Inflight>,
    bytes: u64,
}

impl InflightGuard {
    fn new(counter: &Arc<Inflight>, bytes: u64) -> Self {
        let now = counter.current.fetch_add(bytes, Ordering::Relaxed) + bytes;
        counter.peak.fetch_max(now, Ordering::Relaxed);
        Self {
            counter: Arc::clone(counter),
            bytes,
        }
    }
}

impl Drop for InflightGuard {
    fn drop(&mut self) {
        self.counter
            .current
            .fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

/// Per-thread buffers for producing samples.
struct Scratch {
    src: Vec<u8>,
    tmp: Vec<u8>,
}

impl Scratch {
    fn new(sample_len: usize) -> Self {
        Self {
            src: vec![0; sample_len],
            tmp: vec![0; sample_len],
        }
    }
}

/// One epoch iterator's state shared with its tasks.
struct EpochJob {
    generation: u64,
    epoch: u64,
    order: EpochOrder,
    cancelled: AtomicBool,
    reply: Sender<Reply>,
}

struct Task {
    job: Arc<EpochJob>,
    batch: usize,
}

struct Reply {
    generation: u64,
    batch: usize,
    result: Result<Batch, LoaderError>,
    _bytes: Option<InflightGuard>,
}

/// Produces batches from a [`Dataset`] with a pool of persistent workers.
pub struct DataLoader {
    shared: Arc<Shared>,
    tasks: Option<Sender<Task>>,
    workers: Vec<JoinHandle<()>>,
    next_generation: AtomicU64,
}

impl DataLoader {
    /// Validates `config` against `dataset` and starts `config.workers`
    /// threads, which live until the loader is dropped.
    pub fn new(dataset: Arc<dyn Dataset>, config: LoaderConfig) -> Result<Self, LoaderError> {
        let shared = Arc::new(validate(dataset, config)?);
        tracing::debug!(
            samples = shared.len,
            batches_per_epoch = shared.batches,
            workers = shared.config.workers,
            prefetch = shared.config.prefetch,
            "data loader created"
        );
        let mut loader = DataLoader {
            shared: Arc::clone(&shared),
            tasks: None,
            workers: Vec::new(),
            next_generation: AtomicU64::new(0),
        };
        if shared.config.workers > 0 {
            let (tx, rx) = crossbeam_channel::unbounded::<Task>();
            loader.tasks = Some(tx);
            for w in 0..shared.config.workers {
                let (shared, rx) = (Arc::clone(&shared), rx.clone());
                let handle = std::thread::Builder::new()
                    .name(format!("headroom-loader-{w}"))
                    .spawn(move || worker_main(&shared, &rx))
                    .map_err(|source| LoaderError::Spawn { worker: w, source })?;
                // On error, dropping `loader` joins the workers started so far.
                loader.workers.push(handle);
            }
        }
        Ok(loader)
    }

    /// Batches in one epoch: `len / batch_size`, rounded up unless
    /// `drop_last`.
    pub fn batches_per_epoch(&self) -> usize {
        self.shared.batches
    }

    /// The dataset batches are read from.
    pub fn dataset(&self) -> &Arc<dyn Dataset> {
        &self.shared.dataset
    }

    /// The configuration the loader was built with.
    pub fn config(&self) -> &LoaderConfig {
        &self.shared.config
    }

    /// The loader's memory now and at its peaks.
    pub fn memory_report(&self) -> LoaderMemory {
        let usage = self.shared.dataset.memory_usage();
        LoaderMemory {
            cache_bytes: usage.current,
            cache_peak_bytes: usage.peak,
            prefetched_bytes_max: self.shared.inflight.peak.load(Ordering::Relaxed),
            limit_bytes: self.shared.limit_bytes,
            budget: self.shared.config.memory_budget,
        }
    }

    /// Continues a run from a checkpointed [`LoaderState`]: the batches of
    /// `state.epoch` from `state.batches_consumed` on, exactly as an
    /// uninterrupted run would have produced them. Fails if the state was
    /// saved by a loader with another seed.
    pub fn resume(&self, state: &LoaderState) -> Result<EpochIter<'_>, LoaderError> {
        if state.seed != self.shared.config.seed {
            return Err(config_err(
                "seed",
                format!(
                    "the saved loader state has seed {} but this loader has seed {}: resuming \
                     would not reproduce the run",
                    state.seed, self.shared.config.seed
                ),
            ));
        }
        Ok(self.epoch(state.epoch, state.batches_consumed))
    }

    /// The batches of `epoch`, starting at batch number `start` (exact
    /// mid-epoch resume), delivered in order. Each batch is a function of
    /// (dataset, config, epoch, batch number) only.
    ///
    /// Several iterators may be alive at once; each has its own prefetch
    /// window. Errors are delivered in batch order (the batches before a
    /// failing one come first), except a timeout, which reports the batch
    /// being waited for; after an error the iterator ends. A `start` past
    /// the end of the epoch yields one [`LoaderError::Start`];
    /// `start == batches_per_epoch()` yields nothing.
    pub fn epoch(&self, epoch: u64, start: usize) -> EpochIter<'_> {
        let s = &self.shared;
        let mut it = EpochIter {
            loader: self,
            epoch,
            next: start,
            end: s.batches,
            finished: false,
            pending: None,
            mode: Mode::Idle,
        };
        if start > s.batches {
            it.pending = Some(LoaderError::Start {
                epoch,
                start,
                batches: s.batches,
            });
            return it;
        }
        if start == s.batches {
            it.finished = true;
            return it;
        }
        let order = EpochOrder::new(
            s.len,
            s.config.shuffle,
            s.config.shuffle_mode,
            s.layout.as_ref(),
            s.config.seed,
            epoch,
        );
        // Tell the dataset what it will be asked for (read-ahead, eviction).
        let bs = s.config.batch_size;
        s.dataset.prefetch_order(
            &mut (start..s.batches)
                .flat_map(|b| {
                    let first = s.first_position(b);
                    first..(first + bs).min(s.len)
                })
                .map(|p| order.index(p)),
        );
        it.mode = match &self.tasks {
            None => Mode::Inline {
                order,
                scratch: Scratch::new(s.sample_len),
            },
            Some(_) => {
                let (reply, rx) = crossbeam_channel::bounded(s.config.prefetch);
                tracing::trace!(epoch, start, "loader epoch starts");
                let job = Arc::new(EpochJob {
                    generation: self.next_generation.fetch_add(1, Ordering::Relaxed),
                    epoch,
                    order,
                    cancelled: AtomicBool::new(false),
                    reply,
                });
                Mode::Pool {
                    job,
                    rx,
                    dispatched: start,
                    ready: VecDeque::with_capacity(s.config.prefetch),
                }
            }
        };
        it
    }
}

impl Drop for DataLoader {
    fn drop(&mut self) {
        // Closing the task queue ends the workers once they have drained it
        // (tasks of dropped iterators are skipped without work).
        self.tasks = None;
        for handle in self.workers.drain(..) {
            let _ = handle.join();
        }
    }
}

impl std::fmt::Debug for DataLoader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DataLoader")
            .field("len", &self.shared.len)
            .field("sample_shape", &self.shared.shape)
            .field("batches_per_epoch", &self.shared.batches)
            .field("config", &self.shared.config)
            .finish_non_exhaustive()
    }
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_string()
    }
}

/// Fills batch `batch` of an epoch. Returns `Ok(None)` if `cancelled` was
/// set meanwhile. The guard counts the batch's bytes until it is delivered.
fn produce(
    s: &Shared,
    order: &EpochOrder,
    epoch: u64,
    batch: usize,
    scratch: &mut Scratch,
    cancelled: &AtomicBool,
) -> Result<Option<(Batch, InflightGuard)>, LoaderError> {
    let bs = s.config.batch_size;
    let first = s.first_position(batch);
    let n = bs.min(s.len - first);
    let len = s.sample_len;
    let augment = &s.config.augment;
    let plain = augment.per_sample_identity();
    let rand_augment = augment.rand_augment.filter(|r| r.num_ops > 0);
    let seed = s.config.seed;
    let [h, w, c] = s.shape;
    let guard = InflightGuard::new(
        &s.inflight,
        s.batch_bytes * n as u64 / s.config.batch_size as u64,
    );
    if s.config.resident {
        let made = recipes(s, order, epoch, batch, scratch, cancelled)?;
        return Ok(made.map(|(labels, recipes)| {
            let batch = Batch {
                epoch,
                index: batch,
                shape: [n, h, w, c],
                pixels: Vec::new(),
                labels,
                soft_targets: None,
                recipes: Some(recipes),
                features: None,
                values: None,
            };
            (batch, guard)
        }));
    }
    if s.kind != SampleKind::default() {
        return typed_batch(s, order, (epoch, batch), n, scratch, cancelled)
            .map(|made| made.map(|b| (b, guard)));
    }
    let mut pixels = vec![0u8; n * len];
    let mut labels = Vec::with_capacity(n);
    for (k, out) in pixels.chunks_exact_mut(len).enumerate() {
        if cancelled.load(Ordering::Relaxed) {
            return Ok(None);
        }
        let index = order.index(first + k);
        let label = read_sample(s, (epoch, batch, index), || {
            if plain {
                s.dataset.read(index, out)
            } else {
                let label = s.dataset.read(index, &mut scratch.src)?;
                let params = augment.params(seed, epoch, index);
                augment::apply(&scratch.src, out, [h, w, c], params);
                if let Some(ra) = rand_augment {
                    randaugment::apply(out, &mut scratch.tmp, [h, w, c], ra, seed, epoch, index);
                }
                Ok(label)
            }
        })?;
        labels.push(label);
    }
    let soft_targets = mix::draw(
        augment,
        seed,
        epoch,
        batch * s.config.shard.world + s.config.shard.rank,
        h,
        w,
    )
    .map(|m| mix::apply(m, &mut pixels, &labels, [n, h, w, c], s.num_classes));
    Ok(Some((
        Batch {
            epoch,
            index: batch,
            shape: [n, h, w, c],
            pixels,
            labels,
            soft_targets,
            recipes: None,
            features: None,
            values: None,
        },
        guard,
    )))
}

/// Batch `batch` of a dataset whose samples are typed records
/// ([`SampleKind`]): each record split into its elements (pixels, or f32
/// features) and its numeric targets. No augmentation applies
/// (`validate_kind`). None if cancelled.
fn typed_batch(
    s: &Shared,
    order: &EpochOrder,
    (epoch, batch): (u64, usize),
    n: usize,
    scratch: &mut Scratch,
    cancelled: &AtomicBool,
) -> Result<Option<Batch>, LoaderError> {
    let first = s.first_position(batch);
    let [h, w, c] = s.shape;
    let elements = h * w * c;
    let element_bytes = elements * s.kind.element.size();
    let f32s = |bytes: &[u8], out: &mut Vec<f32>| {
        out.extend(
            bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        )
    };
    let mut pixels = Vec::new();
    let mut features = Vec::new();
    match s.kind.element {
        Element::U8 => pixels.reserve(n * elements),
        Element::F32 => features.reserve(n * elements),
    }
    let mut values = Vec::with_capacity(n * s.kind.values);
    let mut labels = Vec::with_capacity(n);
    for k in 0..n {
        if cancelled.load(Ordering::Relaxed) {
            return Ok(None);
        }
        let index = order.index(first + k);
        let record = &mut scratch.src;
        let label = read_sample(s, (epoch, batch, index), || s.dataset.read(index, record))?;
        let (sample, targets) = record.split_at(element_bytes);
        match s.kind.element {
            Element::U8 => pixels.extend_from_slice(sample),
            Element::F32 => f32s(sample, &mut features),
        }
        f32s(targets, &mut values);
        labels.push(label);
    }
    Ok(Some(Batch {
        epoch,
        index: batch,
        shape: [n, h, w, c],
        pixels,
        labels,
        soft_targets: None,
        recipes: None,
        features: (s.kind.element == Element::F32).then_some(features),
        values: (s.kind.values > 0).then_some(values),
    }))
}

/// Runs `read` for sample `index` of batch `batch` (a dataset read, and
/// any augmentation), turning its error or panic into an error naming the
/// sample, and checks the label it returns.
fn read_sample(
    s: &Shared,
    (epoch, batch, index): (u64, usize, usize),
    read: impl FnOnce() -> Result<u32, LoaderError>,
) -> Result<u32, LoaderError> {
    let sample_err = |source| LoaderError::Sample {
        epoch,
        batch,
        index,
        source: Box::new(match source {
            // The wrapper names the sample already.
            LoaderError::Shard {
                path,
                index: Some(i),
                message,
            } if i == index => LoaderError::Shard {
                path,
                index: None,
                message,
            },
            other => other,
        }),
    };
    let label = catch_unwind(AssertUnwindSafe(read))
        .map_err(|payload| LoaderError::Panic {
            epoch,
            batch,
            index,
            message: panic_message(payload.as_ref()),
        })?
        .map_err(sample_err)?;
    if label as usize >= s.num_classes {
        return Err(sample_err(LoaderError::Label {
            index,
            label,
            num_classes: s.num_classes,
        }));
    }
    Ok(label)
}

type LabelsAndRecipes = (Vec<u32>, Vec<SampleRecipe>);

/// The labels and recipes of batch `batch` for a consumer that holds the
/// dataset (`LoaderConfig::resident`): the same samples and the same random
/// crops and flips as a pixel batch. The label is read with the sample (the
/// dataset API reads both); the pixels are dropped. None if cancelled.
fn recipes(
    s: &Shared,
    order: &EpochOrder,
    epoch: u64,
    batch: usize,
    scratch: &mut Scratch,
    cancelled: &AtomicBool,
) -> Result<Option<LabelsAndRecipes>, LoaderError> {
    let bs = s.config.batch_size;
    let first = s.first_position(batch);
    let n = bs.min(s.len - first);
    let augment = &s.config.augment;
    let mut labels = Vec::with_capacity(n);
    let mut recipes = Vec::with_capacity(n);
    for k in 0..n {
        if cancelled.load(Ordering::Relaxed) {
            return Ok(None);
        }
        let index = order.index(first + k);
        let label = read_sample(s, (epoch, batch, index), || {
            s.dataset.read(index, &mut scratch.src)
        })?;
        let p = augment.params(s.config.seed, epoch, index);
        // validate_resident bounds the ids (2^32) and the crop (pad <= 127).
        recipes.push(SampleRecipe {
            id: index as u32,
            pad: p.pad as u8,
            dy: p.dy as u8,
            dx: p.dx as u8,
            flip: p.flip,
        });
        labels.push(label);
    }
    Ok(Some((labels, recipes)))
}

fn worker_main(s: &Shared, tasks: &Receiver<Task>) {
    let mut scratch = Scratch::new(s.sample_len);
    while let Ok(Task { job, batch }) = tasks.recv() {
        if job.cancelled.load(Ordering::Relaxed) {
            continue;
        }
        // `produce` catches panics per sample; this catches anything else so
        // that the worker survives and the consumer hears about it.
        let result = catch_unwind(AssertUnwindSafe(|| {
            produce(
                s,
                &job.order,
                job.epoch,
                batch,
                &mut scratch,
                &job.cancelled,
            )
        }))
        .unwrap_or_else(|payload| {
            Err(LoaderError::Panic {
                epoch: job.epoch,
                batch,
                index: batch * s.config.batch_size,
                message: panic_message(payload.as_ref()),
            })
        });
        let (result, bytes) = match result {
            Ok(Some((b, guard))) => (Ok(b), Some(guard)),
            Ok(None) => continue,
            Err(e) => (Err(e), None),
        };
        // Fails only if the iterator is gone: the batch is discarded.
        let _ = job.reply.send(Reply {
            generation: job.generation,
            batch,
            result,
            _bytes: bytes,
        });
    }
}

enum Mode {
    /// Nothing to produce (an empty range, or an invalid start).
    Idle,
    /// `workers == 0`: batches are produced in the calling thread.
    Inline { order: EpochOrder, scratch: Scratch },
    /// Batches come from the worker pool.
    Pool {
        job: Arc<EpochJob>,
        rx: Receiver<Reply>,
        /// The next batch number to dispatch.
        dispatched: usize,
        /// Reorder buffer: slot `i` holds batch `next + i` (or its error)
        /// once it arrives. Errors are delivered in batch order too, so the
        /// batches before a failing one arrive whatever the worker count.
        ready: VecDeque<Option<Reply>>,
    },
}

/// The batches of one epoch, in order. See [`DataLoader::epoch`].
pub struct EpochIter<'a> {
    loader: &'a DataLoader,
    epoch: u64,
    /// The next batch number to deliver.
    next: usize,
    end: usize,
    finished: bool,
    pending: Option<LoaderError>,
    mode: Mode,
}

impl EpochIter<'_> {
    /// The epoch being iterated.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The batch number the next call to `next` delivers.
    pub fn position(&self) -> usize {
        self.next
    }

    /// Where the run stands: `epoch` with `position()` batches delivered.
    /// Save it with a checkpoint; [`DataLoader::resume`] continues from it.
    pub fn state(&self) -> LoaderState {
        LoaderState {
            seed: self.loader.shared.config.seed,
            epoch: self.epoch,
            batches_consumed: self.next,
        }
    }

    fn finish(&mut self) {
        self.finished = true;
        if let Mode::Pool { job, .. } = &self.mode {
            job.cancelled.store(true, Ordering::Relaxed);
        }
    }

    /// Sends tasks until `prefetch` batches are dispatched and not delivered.
    fn top_up(&mut self) -> Result<(), LoaderError> {
        let Mode::Pool {
            job, dispatched, ..
        } = &mut self.mode
        else {
            return Ok(());
        };
        let tasks = self
            .loader
            .tasks
            .as_ref()
            .expect("pool mode has a task queue");
        let window = self.loader.shared.config.prefetch;
        while *dispatched < self.end && *dispatched - self.next < window {
            let task = Task {
                job: Arc::clone(job),
                batch: *dispatched,
            };
            tasks.send(task).map_err(|_| LoaderError::WorkersGone {
                epoch: self.epoch,
                batch: self.next,
            })?;
            *dispatched += 1;
        }
        Ok(())
    }

    fn next_from_pool(&mut self) -> Result<Batch, LoaderError> {
        self.top_up()?;
        let timeout = self.loader.shared.config.timeout;
        let deadline = Instant::now() + timeout;
        loop {
            let Mode::Pool { job, rx, ready, .. } = &mut self.mode else {
                unreachable!("next_from_pool in pool mode only");
            };
            if let Some(reply) = ready.front_mut().and_then(Option::take) {
                ready.pop_front();
                // The batch is the consumer's now: stop counting it before
                // dispatching the next one.
                let Reply { result, _bytes, .. } = reply;
                drop(_bytes);
                let batch = result?;
                self.next += 1;
                self.top_up()?;
                return Ok(batch);
            }
            let reply = match rx.recv_deadline(deadline) {
                Ok(reply) => reply,
                Err(RecvTimeoutError::Timeout) => {
                    return Err(LoaderError::Timeout {
                        epoch: self.epoch,
                        batch: self.next,
                        timeout,
                    });
                }
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(LoaderError::WorkersGone {
                        epoch: self.epoch,
                        batch: self.next,
                    });
                }
            };
            if reply.generation != job.generation {
                continue; // cannot happen: each iterator has its own channel
            }
            let slot = reply.batch - self.next;
            if ready.len() <= slot {
                ready.resize_with(slot + 1, || None);
            }
            ready[slot] = Some(reply);
        }
    }
}

impl Iterator for EpochIter<'_> {
    type Item = Result<Batch, LoaderError>;

    fn next(&mut self) -> Option<Self::Item> {
        if let Some(e) = self.pending.take() {
            self.finish();
            return Some(Err(e));
        }
        if self.finished || self.next >= self.end {
            self.finish();
            return None;
        }
        let result = match &mut self.mode {
            Mode::Idle => return None,
            Mode::Inline { order, scratch } => {
                let never = AtomicBool::new(false);
                let r = produce(
                    &self.loader.shared,
                    order,
                    self.epoch,
                    self.next,
                    scratch,
                    &never,
                );
                r.map(|b| b.expect("an uncancelled batch is always produced").0)
                    .inspect(|_| self.next += 1)
            }
            Mode::Pool { .. } => self.next_from_pool(),
        };
        if result.is_err() {
            self.finish();
        }
        Some(result)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        if self.pending.is_some() {
            return (1, Some(1));
        }
        let left = if self.finished {
            0
        } else {
            self.end.saturating_sub(self.next)
        };
        (0, Some(left))
    }
}

impl Drop for EpochIter<'_> {
    fn drop(&mut self) {
        // Workers skip this job's queued tasks and abandon a batch in
        // progress; results already sent die with the receiver.
        self.finish();
    }
}

impl std::fmt::Debug for EpochIter<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EpochIter")
            .field("epoch", &self.epoch)
            .field("next", &self.next)
            .field("end", &self.end)
            .field("finished", &self.finished)
            .finish_non_exhaustive()
    }
}
