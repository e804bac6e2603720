//! Gradients reduced in buckets on a communication thread, as backward
//! produces them.
//!
//! The trainer hands over each tensor's final gradient (`ready`) in the
//! order backward produces them (the last layer first), the order the
//! plan was made in. A bucket holds
//! consecutive tensors up to the configured size; when its last tensor
//! arrives it goes to the communication thread, which runs the ordered
//! all-reduce on it while backward goes on with the earlier layers.
//! `finish` waits for every bucket and writes the sums back. The buckets'
//! composition depends on the tensors' sizes and the bucket size only, so
//! every rank cuts them alike and each bucket's sum has the same bits
//! everywhere.
//!
//! A rank whose step failed part-way (out of memory, a non-finite loss)
//! still sends every bucket (`abort_step` fills the missing tensors with
//! zeros), so its peers are never left waiting; the step's status,
//! exchanged after, makes every rank undo it.
//!
//! Sharded (ZeRO-1, [`GradientReducer::sharded`]): every tensor has an
//! owner rank ([`BucketPlan::owners`]: consecutive tensors, about 1/N of
//! the values each), each bucket is only reduce-scattered (each rank gets
//! the sums of its own tensors, added in the same rank order, so the same
//! bits as the all-reduce's), and after the owners' updates
//! [`GradientReducer::gather_owned`] brings every rank every tensor's new
//! values. The same bytes on the wire as the all-reduce.
//!
//! Memory: one copy of every gradient (the buckets, allocated once) and
//! the all-reduce's receive space, one bucket's worth.

use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};

use std::ops::Range;
use std::sync::Arc;

use crate::collective::{all_gather_slices, all_reduce_ordered, reduce_scatter_ordered};
use crate::transport::lock;
use crate::{DistError, Result, SharedTransport};

/// The buckets' highest tag: tags above it are the trainer's own
/// messages (`FIRST_CONTROL_TAG`); MPI guarantees tags up to 32767.
const MAX_BUCKETS: usize = 30_000;
/// Tags from here on are free for the trainer's control messages.
pub const FIRST_CONTROL_TAG: u16 = 30_001;

/// How tensors, in the order backward produces them, are cut into
/// buckets.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BucketPlan {
    /// Per tensor: its bucket and its offset in the bucket.
    place: Vec<(usize, usize)>,
    /// Per bucket: its length and how many tensors it holds.
    buckets: Vec<(usize, usize)>,
}

impl BucketPlan {
    /// Consecutive tensors of `lens` (production order) fill a bucket until
    /// it holds at least `bucket_values` values; a tensor is never split.
    /// More than 30,000 buckets are avoided by growing the size.
    pub fn new(lens: &[usize], bucket_values: usize) -> Self {
        let total: usize = lens.iter().sum();
        let size = bucket_values.max(total.div_ceil(MAX_BUCKETS)).max(1);
        let mut place = Vec::with_capacity(lens.len());
        let mut buckets: Vec<(usize, usize)> = Vec::new();
        let mut open: Option<(usize, usize)> = None;
        for &len in lens {
            let (filled, count) = open.get_or_insert((0, 0));
            place.push((buckets.len(), *filled));
            *filled += len;
            *count += 1;
            if *filled >= size {
                buckets.extend(open.take());
            }
        }
        buckets.extend(open);
        Self { place, buckets }
    }

    pub fn buckets(&self) -> usize {
        self.buckets.len()
    }

    /// Each bucket's length in values.
    pub fn bucket_lens(&self) -> impl Iterator<Item = usize> + '_ {
        self.buckets.iter().map(|b| b.0)
    }

    pub fn tensors(&self) -> usize {
        self.place.len()
    }

    /// Each tensor's owner in a world of `world` under a sharded
    /// optimizer: consecutive tensors (in the plan's order), a tensor to
    /// the rank whose share of the values holds its middle, so each rank
    /// owns about 1/N of them and every rank's tensors are consecutive.
    pub fn owners(&self, lens: &[usize], world: usize) -> Vec<usize> {
        let total: u128 = lens.iter().map(|&l| l as u128).sum();
        let world = world.max(1);
        let mut start = 0u128;
        lens.iter()
            .map(|&len| {
                let middle = 2 * start + len as u128;
                start += len as u128;
                if total == 0 {
                    return 0;
                }
                ((middle * world as u128) / (2 * total)).min(world as u128 - 1) as usize
            })
            .collect()
    }

    /// Per bucket, per rank: the values of the bucket its tensors take
    /// (`owners` from [`Self::owners`]; empty where it owns none there).
    pub fn owner_slices(&self, owners: &[usize], world: usize) -> Vec<Vec<Range<usize>>> {
        let world = world.max(1);
        // Per bucket, per rank j: where the first tensor owned by rank j or
        // a later one starts (the bucket's end if none). The owners never
        // decrease along the plan, so rank j's slice runs to rank j+1's start.
        let mut starts: Vec<Vec<usize>> = self
            .buckets
            .iter()
            .map(|&(len, _)| vec![len; world + 1])
            .collect();
        for (tensor, &(bucket, offset)) in self.place.iter().enumerate().rev() {
            let owner = owners.get(tensor).copied().unwrap_or(0).min(world - 1);
            for start in &mut starts[bucket][..=owner] {
                *start = offset;
            }
        }
        starts
            .iter()
            .map(|s| (0..world).map(|j| s[j]..s[j + 1]).collect())
            .collect()
    }
}

struct Shards {
    rank: usize,
    owners: Vec<usize>,
    slices: Arc<Vec<Vec<Range<usize>>>>,
}

struct Job {
    bucket: usize,
    values: Vec<f32>,
}

struct Done {
    bucket: usize,
    values: Vec<f32>,
    result: Result<()>,
}

/// One rank's gradient reducer: the plan, the buckets, and the thread
/// that reduces them.
pub struct GradientReducer {
    plan: BucketPlan,
    lens: Vec<usize>,
    /// The buckets at home; None while one is with the thread.
    home: Vec<Option<Vec<f32>>>,
    /// Tensors handed over this step, per bucket.
    arrived: Vec<usize>,
    /// Tensors handed over this step.
    given: Vec<bool>,
    launched: usize,
    /// Sharded: each tensor's owner and, per bucket, each rank's slice.
    shards: Option<Shards>,
    transport: SharedTransport,
    timeout: Duration,
    jobs: Option<Sender<Job>>,
    done: Receiver<Done>,
    thread: Option<JoinHandle<()>>,
}

impl GradientReducer {
    /// A reducer for tensors of `lens` (production order), in buckets of
    /// `bucket_values`, each all-reduce allowed `timeout` before the ranks
    /// that did not answer are named. Fails when the thread cannot start
    /// or the buckets cannot be allocated.
    pub fn new(
        transport: SharedTransport,
        lens: &[usize],
        bucket_values: usize,
        timeout: Duration,
    ) -> Result<Self> {
        Self::build(transport, lens, bucket_values, timeout, false)
    }

    /// A reducer for a sharded optimizer (ZeRO-1): each bucket is only
    /// reduce-scattered, so that after [`Self::finish`] a rank holds the
    /// sums of the tensors it owns ([`Self::owner`]); its peers' new
    /// values come with [`Self::gather_owned`] after the update.
    pub fn sharded(
        transport: SharedTransport,
        lens: &[usize],
        bucket_values: usize,
        timeout: Duration,
    ) -> Result<Self> {
        Self::build(transport, lens, bucket_values, timeout, true)
    }

    fn build(
        transport: SharedTransport,
        lens: &[usize],
        bucket_values: usize,
        timeout: Duration,
        sharded: bool,
    ) -> Result<Self> {
        let plan = BucketPlan::new(lens, bucket_values);
        let shards = if sharded {
            let (rank, world) = {
                let t = lock(&transport)?;
                (t.rank(), t.world())
            };
            let owners = plan.owners(lens, world);
            let slices = Arc::new(plan.owner_slices(&owners, world));
            Some(Shards {
                rank,
                owners,
                slices,
            })
        } else {
            None
        };
        let mut home = Vec::with_capacity(plan.buckets());
        for len in plan.bucket_lens() {
            let mut bucket = Vec::new();
            bucket.try_reserve_exact(len).map_err(|_| {
                DistError::Thread(format!("no memory for a gradient bucket of {len} values"))
            })?;
            bucket.resize(len, 0.0);
            home.push(Some(bucket));
        }
        let (jobs, job_rx) = crossbeam_channel::unbounded::<Job>();
        let (done_tx, done) = crossbeam_channel::unbounded::<Done>();
        let buckets = plan.buckets();
        let slices = shards.as_ref().map(|s| Arc::clone(&s.slices));
        let shared = transport.clone();
        let thread = std::thread::Builder::new()
            .name("headroom-allreduce".into())
            .spawn(move || communicate(&shared, &job_rx, &done_tx, timeout, buckets, slices))
            .map_err(|e| DistError::Thread(format!("cannot start the all-reduce thread: {e}")))?;
        Ok(Self {
            arrived: vec![0; plan.buckets()],
            given: vec![false; lens.len()],
            plan,
            lens: lens.to_vec(),
            home,
            launched: 0,
            shards,
            transport,
            timeout,
            jobs: Some(jobs),
            done,
            thread: Some(thread),
        })
    }

    pub fn plan(&self) -> &BucketPlan {
        &self.plan
    }

    /// The rank that owns (updates) tensor `tensor` under a sharded
    /// optimizer; None when the reducer is not sharded (every rank
    /// updates every tensor).
    pub fn owner(&self, tensor: usize) -> Option<usize> {
        let shards = self.shards.as_ref()?;
        shards.owners.get(tensor).copied()
    }

    /// Whether this rank owns `tensor` (always, unsharded).
    pub fn owns(&self, tensor: usize) -> bool {
        match &self.shards {
            None => true,
            Some(s) => s.owners.get(tensor) == Some(&s.rank),
        }
    }

    /// Sharded: every rank's new values of the tensors it owns, to every
    /// rank. `tensors` (by plan index) holds this rank's tensors' new
    /// values, which are sent; the others' are overwritten with their
    /// owners'. Bucket by bucket, as the gradients went. Unsharded it does
    /// nothing (every rank made every update).
    pub fn gather_owned(&mut self, tensors: &mut [&mut [f32]]) -> Result<()> {
        let Some(shards) = &self.shards else {
            return Ok(());
        };
        if tensors.len() != self.lens.len()
            || tensors.iter().zip(&self.lens).any(|(t, &l)| t.len() != l)
        {
            return Err(DistError::Thread(format!(
                "{} tensors handed to the gather, the plan has {}",
                tensors.len(),
                self.lens.len()
            )));
        }
        let mut transport = lock(&self.transport)?;
        let mut first = 0;
        for bucket in 0..self.plan.buckets() {
            let count = self.plan.buckets[bucket].1;
            let values = self.home[bucket]
                .as_mut()
                .ok_or_else(|| DistError::Thread(format!("bucket {bucket} is away")))?;
            let members = first..first + count;
            for tensor in members.clone() {
                if shards.owners[tensor] == shards.rank {
                    let offset = self.plan.place[tensor].1;
                    values[offset..offset + self.lens[tensor]].copy_from_slice(tensors[tensor]);
                }
            }
            all_gather_slices(
                transport.as_mut(),
                bucket as u16,
                values,
                &shards.slices[bucket],
                Instant::now() + self.timeout,
                &format!("gathering the updated weights of bucket {bucket}"),
            )?;
            for tensor in members {
                if shards.owners[tensor] != shards.rank {
                    let offset = self.plan.place[tensor].1;
                    tensors[tensor].copy_from_slice(&values[offset..offset + self.lens[tensor]]);
                }
            }
            first += count;
        }
        Ok(())
    }

    /// Tensor `tensor` (production order) has its final gradient for this
    /// step: copied into its bucket, which is launched when complete.
    pub fn ready(&mut self, tensor: usize, grad: &[f32]) -> Result<()> {
        let (&(bucket, offset), &len) = self
            .plan
            .place
            .get(tensor)
            .zip(self.lens.get(tensor))
            .ok_or_else(|| DistError::Thread(format!("tensor {tensor} is not in the plan")))?;
        if grad.len() != len || self.given[tensor] {
            return Err(DistError::Thread(format!(
                "tensor {tensor}: {} values handed over (expected {len}, once a step)",
                grad.len()
            )));
        }
        let values = self.home[bucket]
            .as_mut()
            .ok_or_else(|| DistError::Thread(format!("bucket {bucket} was launched already")))?;
        values[offset..offset + len].copy_from_slice(grad);
        self.given[tensor] = true;
        self.arrived[bucket] += 1;
        if self.arrived[bucket] == self.plan.buckets[bucket].1 {
            self.launch(bucket)?;
        }
        Ok(())
    }

    fn launch(&mut self, bucket: usize) -> Result<()> {
        let values = self.home[bucket]
            .take()
            .ok_or_else(|| DistError::Thread(format!("bucket {bucket} was launched already")))?;
        let jobs = self.jobs.as_ref().ok_or_else(gone)?;
        jobs.send(Job { bucket, values }).map_err(|_| gone())?;
        self.launched += 1;
        Ok(())
    }

    /// A step that failed part-way: every tensor not handed over counts as
    /// zeros and every bucket is sent, so the peers' all-reduces complete.
    pub fn abort_step(&mut self) -> Result<()> {
        for tensor in 0..self.lens.len() {
            if !self.given[tensor] {
                let (bucket, offset) = self.plan.place[tensor];
                if let Some(values) = self.home[bucket].as_mut() {
                    values[offset..offset + self.lens[tensor]].fill(0.0);
                }
                self.given[tensor] = true;
                self.arrived[bucket] += 1;
            }
        }
        for bucket in 0..self.plan.buckets() {
            if self.home[bucket].is_some() && self.arrived[bucket] == self.plan.buckets[bucket].1 {
                self.launch(bucket)?;
            }
        }
        Ok(())
    }

    /// Waits for every bucket of the step and hands each tensor's sum to
    /// `write(tensor, sum)` (sharded: each tensor this rank owns); the
    /// reducer is then ready for the next step.
    /// Every tensor must have been handed over (or `abort_step` called).
    pub fn finish(&mut self, mut write: impl FnMut(usize, &[f32])) -> Result<()> {
        if let Some(tensor) = self.given.iter().position(|g| !g) {
            // The step is sent whole (zeros) and taken back first, so that
            // the peers are not left waiting and the reducer stays whole.
            self.abort_step()?;
            self.collect()?;
            self.given.fill(false);
            self.arrived.fill(0);
            return Err(DistError::Thread(format!(
                "tensor {tensor}'s gradient was never handed over this step"
            )));
        }
        self.collect()?;
        for (tensor, &(bucket, offset)) in self.plan.place.iter().enumerate() {
            let owned = match &self.shards {
                None => true,
                Some(s) => s.owners[tensor] == s.rank,
            };
            if !owned {
                continue;
            }
            if let Some(values) = self.home[bucket].as_ref() {
                write(tensor, &values[offset..offset + self.lens[tensor]]);
            }
        }
        self.given.fill(false);
        self.arrived.fill(0);
        Ok(())
    }

    /// Takes back every launched bucket; the first error wins.
    fn collect(&mut self) -> Result<()> {
        let mut first_error = None;
        while self.launched > 0 {
            let done = self.done.recv().map_err(|_| gone())?;
            self.launched -= 1;
            self.home[done.bucket] = Some(done.values);
            if let Err(e) = done.result {
                first_error.get_or_insert(e);
            }
        }
        first_error.map_or(Ok(()), Err)
    }
}

impl Drop for GradientReducer {
    fn drop(&mut self) {
        self.jobs = None;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn gone() -> DistError {
    DistError::Thread("the all-reduce thread is gone".into())
}

/// The communication thread: each bucket's all-reduce in the plan's
/// order, whatever order they arrive in (a rank that aborts a step sends
/// its buckets in another order than backward would), so every rank's
/// sequence of messages is the same.
fn communicate(
    transport: &SharedTransport,
    jobs: &Receiver<Job>,
    done: &Sender<Done>,
    timeout: Duration,
    buckets: usize,
    slices: Option<Arc<Vec<Vec<Range<usize>>>>>,
) {
    let mut scratch = Vec::new();
    let mut waiting: Vec<Option<Vec<f32>>> = (0..buckets).map(|_| None).collect();
    let mut next = 0;
    while let Ok(Job { bucket, values }) = jobs.recv() {
        if let Some(slot) = waiting.get_mut(bucket) {
            *slot = Some(values);
        }
        while let Some(mut values) = waiting.get_mut(next).and_then(Option::take) {
            let deadline = Instant::now() + timeout;
            let result = lock(transport).and_then(|mut t| match &slices {
                None => all_reduce_ordered(
                    t.as_mut(),
                    next as u16,
                    &mut values,
                    &mut scratch,
                    deadline,
                    &format!("the all-reduce of gradient bucket {next}"),
                ),
                Some(slices) => reduce_scatter_ordered(
                    t.as_mut(),
                    next as u16,
                    &mut values,
                    &slices[next],
                    &mut scratch,
                    deadline,
                    &format!("the reduce-scatter of gradient bucket {next}"),
                ),
            });
            if done
                .send(Done {
                    bucket: next,
                    values,
                    result,
                })
                .is_err()
            {
                return;
            }
            next = (next + 1) % buckets.max(1);
        }
    }
}
