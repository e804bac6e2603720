//! LoRA fine-tuning on the CPU: the base frozen, adapters on
//! `target_modules`, batch 1 with gradient accumulation, AdamW on the
//! adapters alone, a constant or warm-up + cosine learning rate, the loss
//! reported per optimizer step. The AdamW here is PyTorch's update on plain
//! f32 vectors: `headroom_optim::AdamW` steps `headroom_model::Param`
//! tensors, and this crate stays a leaf (docs/architecture.md). Memory: the
//! model, the adapters with their gradient sums and two moments (4× the
//! adapters), and one example's activations (`Model::lora_gradients`).
//! Dropout masks come from (seed, step, example), so a rerun is the same
//! run. Not here: checkpoints and resume.

use crate::data::Dataset;
use crate::error::{LlmError, Result};
use crate::lora::{new_adapters, Adapters, Dropout};
use crate::model::Model;
use crate::peft::LoraConfig;

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum LrSchedule {
    Constant,
    /// Linear from 0 over `warmup_steps`, then a half cosine to 0 at the
    /// last step (transformers' `get_cosine_schedule_with_warmup`).
    WarmupCosine {
        warmup_steps: usize,
    },
}

impl LrSchedule {
    /// The rate of optimizer step `step` (from 0) of `total`.
    pub fn lr_at(self, lr: f32, step: usize, total: usize) -> f32 {
        match self {
            LrSchedule::Constant => lr,
            LrSchedule::WarmupCosine { warmup_steps } => {
                if step < warmup_steps {
                    return lr * step as f32 / warmup_steps as f32;
                }
                let progress = (step - warmup_steps) as f64
                    / (total.saturating_sub(warmup_steps)).max(1) as f64;
                (lr as f64 * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos())) as f32
            }
        }
    }
}

#[derive(Clone, Debug)]
pub struct FinetuneOptions {
    pub r: usize,
    pub alpha: f32,
    pub dropout: f32,
    pub target_modules: Vec<String>,
    pub epochs: usize,
    pub lr: f32,
    /// Examples (batch 1) whose gradients are averaged into one step.
    pub accumulate: usize,
    pub schedule: LrSchedule,
    pub weight_decay: f32,
    /// Stop after this many optimizer steps (all of the epochs when None).
    pub max_steps: Option<usize>,
    pub seed: u64,
}

impl Default for FinetuneOptions {
    fn default() -> Self {
        Self {
            r: 8,
            alpha: 16.0,
            dropout: 0.0,
            target_modules: vec!["q_proj".into(), "v_proj".into()],
            epochs: 1,
            lr: 2e-4,
            accumulate: 8,
            schedule: LrSchedule::Constant,
            weight_decay: 0.0,
            max_steps: None,
            seed: 0,
        }
    }
}

/// What one optimizer step reports.
#[derive(Clone, Copy, Debug)]
pub struct StepLog {
    pub step: usize,
    pub total_steps: usize,
    pub epoch: usize,
    /// The mean loss of the step's examples, before the update.
    pub loss: f32,
    pub lr: f32,
}

/// splitmix64, as the adapters' initialisation draws.
fn next(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Epoch `epoch`'s order of `n` examples: a function of (seed, epoch).
fn order(n: usize, seed: u64, epoch: usize) -> Vec<usize> {
    let mut state = seed ^ (epoch as u64).wrapping_mul(0xD1B5_4A32_D192_ED03);
    let mut ids: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        let j = (next(&mut state) % (i as u64 + 1)) as usize;
        ids.swap(i, j);
    }
    ids
}

/// PyTorch's AdamW (β 0.9, 0.999, ε 1e-8) on one vector.
fn adamw(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], lr: f32, wd: f32, t: u64) {
    let (b1, b2, eps) = (0.9f64, 0.999f64, 1e-8f32);
    let bc1 = 1.0 - b1.powf(t as f64);
    let bc2_sqrt = (1.0 - b2.powf(t as f64)).sqrt() as f32;
    let step = (lr as f64 / bc1) as f32;
    let decay = 1.0 - lr * wd;
    for (((p, &g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
        *m = 0.9 * *m + 0.1 * g;
        *v = 0.999 * *v + 0.001 * g * g;
        *p = *p * decay - step * *m / (v.sqrt() / bc2_sqrt + eps);
    }
}

/// Trains fresh adapters on `data`, calling `on_step` after each optimizer
/// step; returns them with the config their files record.
pub fn finetune(
    model: &Model,
    data: &Dataset,
    options: &FinetuneOptions,
    mut on_step: impl FnMut(&StepLog),
) -> Result<(Adapters, LoraConfig)> {
    if !(0.0..1.0).contains(&options.dropout) {
        return Err(LlmError::Input(format!(
            "LoRA dropout {} must be in [0, 1)",
            options.dropout
        )));
    }
    if options.accumulate == 0 || options.epochs == 0 {
        return Err(LlmError::Input(
            "accumulate and epochs must be at least 1".into(),
        ));
    }
    if !(options.lr.is_finite() && options.lr > 0.0) {
        return Err(LlmError::Input(format!(
            "learning rate {} must be a positive number",
            options.lr
        )));
    }
    if data.examples.is_empty() {
        return Err(LlmError::Input("no training examples".into()));
    }
    let targets: Vec<&str> = options.target_modules.iter().map(String::as_str).collect();
    let mut adapters = new_adapters(model, options.r, options.alpha, &targets, options.seed)?;
    let mut keys: Vec<String> = adapters.keys().cloned().collect();
    keys.sort();
    let zeros = |a: &Adapters| -> Vec<(Vec<f32>, Vec<f32>)> {
        keys.iter()
            .map(|k| (vec![0.0; a[k].a.len()], vec![0.0; a[k].b.len()]))
            .collect()
    };
    let mut m = zeros(&adapters);
    let mut v = zeros(&adapters);
    let n = data.examples.len();
    let per_epoch = n.div_ceil(options.accumulate);
    let mut total = per_epoch * options.epochs;
    if let Some(max) = options.max_steps {
        total = total.min(max);
    }
    let mut step = 0usize;
    'epochs: for epoch in 0..options.epochs {
        for group in order(n, options.seed, epoch).chunks(options.accumulate) {
            if step >= total {
                break 'epochs;
            }
            let mut sums = zeros(&adapters);
            let mut loss = 0.0f64;
            for &i in group {
                let e = &data.examples[i];
                // Masks from (seed, step, example): a rerun draws the same.
                let mut state = options.seed ^ 0x5EED_D50F_0000_0000;
                state = next(&mut state) ^ step as u64;
                state = next(&mut state) ^ i as u64;
                let mut dropout = Dropout {
                    p: options.dropout,
                    state,
                };
                let (l, grads) = model.lora_gradients_with(
                    &adapters,
                    std::slice::from_ref(&e.ids),
                    std::slice::from_ref(&e.labels),
                    (options.dropout > 0.0).then_some(&mut dropout),
                )?;
                loss += l as f64;
                for (key, (sa, sb)) in keys.iter().zip(sums.iter_mut()) {
                    if let Some((da, db)) = grads.get(key) {
                        sa.iter_mut().zip(da).for_each(|(s, d)| *s += d);
                        sb.iter_mut().zip(db).for_each(|(s, d)| *s += d);
                    }
                }
            }
            let count = group.len() as f32;
            let lr = options.schedule.lr_at(options.lr, step, total);
            for (((key, (ga, gb)), (ma, mb)), (va, vb)) in
                keys.iter().zip(&mut sums).zip(&mut m).zip(&mut v)
            {
                ga.iter_mut().chain(gb.iter_mut()).for_each(|g| *g /= count);
                let Some(ad) = adapters.get_mut(key) else {
                    continue;
                };
                let t = step as u64 + 1;
                adamw(&mut ad.a, ga, ma, va, lr, options.weight_decay, t);
                adamw(&mut ad.b, gb, mb, vb, lr, options.weight_decay, t);
            }
            on_step(&StepLog {
                step: step + 1,
                total_steps: total,
                epoch,
                loss: (loss / group.len() as f64) as f32,
                lr,
            });
            step += 1;
        }
    }
    let config = LoraConfig {
        r: options.r,
        alpha: options.alpha,
        dropout: options.dropout,
        target_modules: {
            let mut t = options.target_modules.clone();
            t.sort();
            t.dedup();
            t
        },
        use_rslora: false,
    };
    Ok((adapters, config))
}
