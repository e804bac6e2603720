//! What `cargo xtask bench` measures: the training step of an experiment's
//! model (forward, loss, backward, clip, AdamW, with the experiment's
//! settings; submitted and collected as the training loop does, so a GPU
//! step is queued while the one before runs) on fixed random data after a
//! warm-up; the loader alone; and the machine's peak FP32 rate, measured with
//! an FMA loop on every compute thread, so "share of peak" is a measured
//! ratio rather than a datasheet guess.

use std::sync::Arc;
use std::time::{Duration, Instant};

use headroom_loader::{
    Batch, DataLoader, Dataset, IdxDataset, LoaderConfig, ShardCacheConfig, ShardedDataset,
    ShuffleMode, Split,
};
use headroom_model::cuda::ops::TunedConv;
use headroom_model::memory::MemoryPool;
use headroom_model::Device;
use serde::{Deserialize, Serialize};

use crate::config::ExperimentConfig;
use crate::learner::{Learner, StepLr};
use crate::{data, PipelineError, Result};

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct StepBench {
    pub batch: usize,
    pub threads: usize,
    pub steps: usize,
    pub samples_per_sec: f64,
    pub step_ms: f64,
    /// Forward + backward FLOP/s, counting backward as twice the forward,
    /// in direct-convolution-equivalent FLOP: the arithmetic the direct
    /// definition of every layer would do (`macs_per_sample`), whatever
    /// algorithm ran, and whatever the backward leaves out (the first
    /// trainable layer's input gradient, a frozen layer's weight gradient).
    /// Winograd does less, so its share of the machine's FMA peak can pass
    /// 100%.
    pub gflops: f64,
    pub peak_rss_bytes: Option<u64>,
    pub parameters: usize,
    /// Parameters the optimizer updates (a LoRA fine-tune: the adapters).
    #[serde(default)]
    pub trainable_parameters: usize,
    pub macs_per_sample: u64,
    /// "cpu", or the GPU's description.
    #[serde(default)]
    pub device: String,
    /// Peak bytes of the learner's tensors (device memory on a GPU).
    #[serde(default)]
    pub peak_tensor_bytes: u64,
    /// The CPU convolutions' algorithm setting ("auto", "direct",
    /// "winograd", "winograd4"; HEADROOM_CONV_ALGORITHM chooses it).
    #[serde(default)]
    pub conv_algorithm: String,
    /// Where a step's time goes, from extra steps after the timed ones
    /// (`--profile`). On the GPU they are launched one kernel at a time, so
    /// the segments sum to an eager step's time, not a graph replay's; on
    /// the CPU they are wall time between marks. Empty when not asked.
    #[serde(default)]
    pub profile: Vec<ProfileRow>,
    /// What `device.conv_algorithm = "tune"` chose for each product of the
    /// step's convolutions, with both timings (empty under other settings).
    #[serde(default)]
    pub tuned_convs: Vec<TunedConv>,
}

/// One segment of a profiled step.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ProfileRow {
    pub label: String,
    /// GPU milliseconds a step spends in it.
    pub ms_per_step: f64,
    /// How many times a step passes through it.
    pub per_step: f64,
}

/// How many steps `--profile` times, after the timed ones.
pub const PROFILE_STEPS: usize = 10;

/// Times `steps` training steps at `batch` after `warmup` untimed ones, on
/// the device `config.device.kind` names.
pub fn training_step(
    config: &ExperimentConfig,
    batch: usize,
    threads: usize,
    warmup: usize,
    steps: usize,
    profile: bool,
) -> Result<StepBench> {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .map_err(|e| PipelineError::Stage {
            stage: "bench",
            reason: e.to_string(),
        })?;
    pool.install(|| {
        let mut config = crate::finetune::as_trained(config);
        config.train.batch_size = batch;
        let options = crate::parts::cuda_options(&config)?;
        let pool = MemoryPool::new(Device::Cpu);
        let initialise = crate::finetune::initialise_for_timing;
        let layers = headroom_model::LayerRegistry::default();
        let mut learner = crate::parts::open_with(&config, pool, options, initialise, &layers)?;
        let batch = synthetic_batch(&config, batch, learner.num_classes());
        let lr = config.optimizer.lr;
        run_steps(learner.as_mut(), &batch, lr, warmup)?;
        let started = Instant::now();
        run_steps(learner.as_mut(), &batch, lr, steps)?;
        let seconds = started.elapsed().as_secs_f64();
        let peak_tensor_bytes = learner.memory_stats().peak_in_use_bytes;
        let profile = match profile {
            true => profile_steps(learner.as_mut(), &batch, lr)?,
            false => Vec::new(),
        };
        let macs = learner.macs_per_sample()?;
        let samples_per_sec = (batch.len() * steps) as f64 / seconds;
        Ok(StepBench {
            batch: batch.len(),
            threads,
            steps,
            samples_per_sec,
            step_ms: seconds / steps as f64 * 1e3,
            gflops: samples_per_sec * macs as f64 * 2.0 * 3.0 / 1e9,
            peak_rss_bytes: crate::peak_rss_bytes(),
            parameters: learner.num_params(),
            trainable_parameters: learner.num_trainable_params(),
            macs_per_sample: macs,
            device: learner.device_name(),
            peak_tensor_bytes,
            conv_algorithm: format!("{:?}", headroom_model::layers::conv_algorithm())
                .to_lowercase(),
            profile,
            tuned_convs: learner.tuned_convolutions(),
        })
    })
}

/// `steps` training steps as the training loop runs them: up to
/// `pipeline_depth()` steps left in flight while the next is submitted, and
/// every one collected by the end.
fn run_steps(learner: &mut dyn Learner, batch: &Batch, lr: f32, steps: usize) -> Result<()> {
    let at = move |_: u64| lr;
    for _ in 0..steps {
        learner.submit_batch(
            batch,
            StepLr {
                applied: 0,
                at: &at,
            },
        )?;
        while learner.steps_in_flight() > learner.pipeline_depth() {
            learner.collect_step()?;
        }
    }
    while learner.collect_step()?.is_some() {}
    Ok(())
}

/// `PROFILE_STEPS` more steps, timed segment by segment.
fn profile_steps(learner: &mut dyn Learner, batch: &Batch, lr: f32) -> Result<Vec<ProfileRow>> {
    if !learner.profile_start()? {
        return Ok(Vec::new());
    }
    run_steps(learner, batch, lr, PROFILE_STEPS)?;
    let steps = PROFILE_STEPS as f64;
    Ok(learner
        .profile_finish()?
        .into_iter()
        .map(|segment| ProfileRow {
            label: segment.label,
            ms_per_step: segment.ms / steps,
            per_step: segment.count as f64 / steps,
        })
        .collect())
}

/// Fixed pseudo-random samples and cycling labels in the layout the
/// experiment's loader delivers: images, text windows of `length + 1` ids
/// below the vocabulary, or `frames + 1` frames stacked along the height.
fn synthetic_batch(config: &ExperimentConfig, n: usize, classes: usize) -> Batch {
    let model = &config.model;
    let [h, w, c] = model.input;
    let (shape, values) = match (model.tokens, model.frames) {
        (Some(tokens), _) => ([1, tokens.length + 1, 1], tokens.vocab.clamp(1, 256)),
        (None, Some(frames)) => ([(frames + 1) * h, w, c], 256),
        (None, None) => (model.input, 256),
    };
    let sample = shape.iter().product::<usize>();
    Batch {
        epoch: 0,
        index: 0,
        shape: [n, shape[0], shape[1], shape[2]],
        pixels: (0..n * sample)
            .map(|i| (((i * 2_654_435_761) >> 13) % values) as u8)
            .collect(),
        labels: (0..n).map(|i| (i % classes.max(1)) as u32).collect(),
        soft_targets: None,
        recipes: None,
        features: None,
        values: None,
    }
}

/// The machine's FP32 multiply-add peak on `threads` threads, in GFLOP/s.
pub fn peak_gflops(threads: usize, avx2_only: bool) -> f64 {
    let per_thread = Duration::from_millis(300);
    let flops: f64 = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|_| scope.spawn(move || fma_loop(per_thread, avx2_only)))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or(0.0)).sum()
    });
    flops / 1e9
}

/// FLOP/s of one thread running independent FMA chains for `time`.
fn fma_loop(time: Duration, avx2_only: bool) -> f64 {
    #[cfg(target_arch = "x86_64")]
    {
        if !avx2_only && std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU supports AVX-512F (checked just above).
            return unsafe { fma::avx512(time) };
        }
        if std::arch::is_x86_feature_detected!("fma") {
            // SAFETY: the CPU supports AVX2 FMA (checked just above).
            return unsafe { fma::avx2(time) };
        }
    }
    // Elsewhere there is no wider kernel to hold back from.
    let _ = avx2_only;
    fma::portable(time)
}

mod fma {
    use std::time::{Duration, Instant};

    /// Enough independent accumulators to cover FMA latency × throughput.
    const CHAINS: usize = 12;
    const ROUNDS: usize = 1 << 16;

    macro_rules! fma_kernel {
        ($name:ident, $feature:literal, $vec:ty, $lanes:expr, $set1:ident, $fmadd:ident, $add:ident, $store:ident) => {
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = $feature)]
            pub unsafe fn $name(time: Duration) -> f64 {
                use std::arch::x86_64::*;
                let (a, b) = ($set1(0.999_9), $set1(1e-7));
                let mut acc: [$vec; CHAINS] = [$set1(1.0); CHAINS];
                let started = Instant::now();
                let mut rounds = 0u64;
                while started.elapsed() < time {
                    for _ in 0..ROUNDS {
                        for x in acc.iter_mut() {
                            *x = $fmadd(*x, a, b);
                        }
                    }
                    rounds += ROUNDS as u64;
                }
                let mut sum = acc[0];
                for x in &acc[1..] {
                    sum = $add(sum, *x);
                }
                let mut out = [0.0f32; $lanes];
                $store(out.as_mut_ptr(), sum);
                std::hint::black_box(out);
                (rounds * CHAINS as u64 * $lanes * 2) as f64 / started.elapsed().as_secs_f64()
            }
        };
    }

    fma_kernel!(
        avx512,
        "avx512f",
        __m512,
        16,
        _mm512_set1_ps,
        _mm512_fmadd_ps,
        _mm512_add_ps,
        _mm512_storeu_ps
    );
    fma_kernel!(
        avx2,
        "avx2,fma",
        __m256,
        8,
        _mm256_set1_ps,
        _mm256_fmadd_ps,
        _mm256_add_ps,
        _mm256_storeu_ps
    );

    pub fn portable(time: Duration) -> f64 {
        let mut acc = [1.0f32; CHAINS * 8];
        let started = Instant::now();
        let mut rounds = 0u64;
        while started.elapsed() < time {
            for _ in 0..ROUNDS {
                for x in acc.iter_mut() {
                    *x = *x * 0.999_9 + 1e-7;
                }
            }
            rounds += ROUNDS as u64;
        }
        std::hint::black_box(acc);
        (rounds * (CHAINS * 8) as u64 * 2) as f64 / started.elapsed().as_secs_f64()
    }
}

/// One loader configuration over a shard store (or Fashion-MNIST in memory
/// when `store` is None), crop + flip as in the experiment.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct StoreBench {
    pub source: String,
    pub workers: usize,
    pub batch: usize,
    pub samples_per_sec: f64,
    pub cache_peak_bytes: u64,
    pub shard_reads: u64,
    pub peak_rss_bytes: Option<u64>,
}

/// Times `epochs` epochs after one untimed warm-up epoch.
pub fn loader_over_store(
    config: &ExperimentConfig,
    store: Option<(&std::path::Path, ShardCacheConfig)>,
    workers: usize,
    batch: usize,
    epochs: u64,
) -> Result<StoreBench> {
    let mut shards = None;
    let (dataset, source): (Arc<dyn Dataset>, String) = match &store {
        Some((dir, cache)) => {
            let label = if cache.full_load {
                "shards, full load".to_string()
            } else {
                format!("shards, cache {}", cache.max_cache_shards)
            };
            let opened = Arc::new(ShardedDataset::open(dir, *cache)?);
            shards = Some(Arc::clone(&opened));
            (opened, label)
        }
        None => {
            let dir = data::locate_fashion_mnist(config.data.dir.as_deref(), false)?;
            (
                Arc::new(IdxDataset::fashion_mnist(&dir, Split::Train)?),
                "IDX in memory".into(),
            )
        }
    };
    let loader = DataLoader::new(
        dataset,
        LoaderConfig {
            batch_size: batch,
            workers,
            shuffle_mode: ShuffleMode::ShardBlocks,
            ..data::loader_config(config, true)?
        },
    )?;
    let mut samples = 0;
    for b in loader.epoch(0, 0) {
        b?;
    }
    let started = Instant::now();
    for epoch in 1..=epochs {
        for b in loader.epoch(epoch, 0) {
            samples += b?.labels.len();
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    let memory = loader.memory_report();
    let shard_reads = shards.map_or(0, |s| s.cache_stats().misses);
    Ok(StoreBench {
        source,
        workers,
        batch,
        samples_per_sec: samples as f64 / seconds,
        cache_peak_bytes: memory.cache_peak_bytes,
        shard_reads,
        peak_rss_bytes: crate::peak_rss_bytes(),
    })
}
