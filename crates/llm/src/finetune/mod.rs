//! LoRA fine-tuning on the CPU: the base frozen, adapters on
//! `target_modules`, micro-batches of `batch_size` examples (right-padded,
//! `batch`) with `accumulate` of them per optimizer step, AdamW on the
//! adapters alone, a constant or warm-up + cosine learning rate, the loss
//! reported per optimizer step. A step's gradient is that of the mean loss
//! over every counted token of its examples (transformers ≥ 4.46 with
//! `num_items_in_batch`): each micro-batch's mean-loss gradient is weighted
//! by its counted tokens over the step's, so batch 4 × accumulate 1 is
//! batch 1 × accumulate 4 up to f32 rounding. The AdamW here is PyTorch's
//! update on plain f32 vectors: `headroom_optim::AdamW` steps
//! `headroom_model::Param` tensors, and this crate stays a leaf
//! (docs/architecture.md).
//!
//! [`Trainer`] holds the whole state of a run ([`TrainState`]: adapters,
//! moments, step, epoch and position in the epoch's order); the order comes
//! from (seed, epoch) and the dropout masks from (seed, step, micro-batch),
//! so a state saved and restored (`checkpoint`) continues bit for bit. The
//! run directory (checkpoints, resume, `metrics.jsonl`) is `run`; `full`
//! is a full fine-tune (every weight) built from the same pieces, and
//! `full_run` its run directory, from `run`'s and `checkpoint`'s. Memory:
//! the model, the adapters with their gradient sums and two moments (4×
//! the adapters), and one micro-batch's activations
//! (`Model::lora_gradients`: batch · layers · heads · T² for attention).

pub mod batch;
pub mod checkpoint;
pub mod full;
pub mod full_run;
pub mod run;

use crate::data::Rows;
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
    /// Examples per micro-batch (one pass of `lora_gradients`), padded on
    /// the right to the longest.
    pub batch_size: usize,
    /// Micro-batches per optimizer step.
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
            batch_size: 1,
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
    /// The mean loss over the step's counted tokens, before the update.
    pub loss: f32,
    pub lr: f32,
    /// The labels the step's loss counted.
    pub tokens: usize,
    /// The examples the step trained on.
    pub examples: usize,
    /// The step was its epoch's last.
    pub epoch_end: bool,
}

/// PyTorch's AdamW (β 0.9, 0.999, ε 1e-8, decoupled weight decay `wd`) on
/// one vector at step `t` (from 1).
pub fn adamw(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], lr: f32, wd: f32, t: u64) {
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

/// Everything a run carries from one step to the next.
#[derive(Clone, Debug)]
pub struct TrainState {
    pub adapters: Adapters,
    /// The adapters' keys, sorted: the order of `m` and `v`.
    pub keys: Vec<String>,
    /// AdamW's first and second moments, (A, B) for each key.
    pub m: Vec<(Vec<f32>, Vec<f32>)>,
    pub v: Vec<(Vec<f32>, Vec<f32>)>,
    /// Optimizer steps taken.
    pub step: usize,
    /// The epoch under way (from 0) and the examples of its order used.
    pub epoch: usize,
    pub position: usize,
}

impl TrainState {
    /// A fresh state: `adapters` with zero moments at step 0.
    pub fn new(adapters: Adapters) -> Self {
        let mut keys: Vec<String> = adapters.keys().cloned().collect();
        keys.sort();
        let zeros: Vec<(Vec<f32>, Vec<f32>)> = keys
            .iter()
            .map(|k| {
                let a = &adapters[k];
                (vec![0.0; a.a.len()], vec![0.0; a.b.len()])
            })
            .collect();
        Self {
            adapters,
            keys,
            m: zeros.clone(),
            v: zeros,
            step: 0,
            epoch: 0,
            position: 0,
        }
    }
}

/// Checks `options` against `data` before any work.
pub fn validate(options: &FinetuneOptions, data: &dyn Rows) -> Result<()> {
    if !(0.0..1.0).contains(&options.dropout) {
        return Err(LlmError::Input(format!(
            "LoRA dropout {} must be in [0, 1)",
            options.dropout
        )));
    }
    if options.accumulate == 0 || options.epochs == 0 || options.batch_size == 0 {
        return Err(LlmError::Input(
            "batch_size, accumulate and epochs must be at least 1".into(),
        ));
    }
    if !(options.lr.is_finite() && options.lr > 0.0) {
        return Err(LlmError::Input(format!(
            "learning rate {} must be a positive number",
            options.lr
        )));
    }
    if !options.weight_decay.is_finite() || options.weight_decay < 0.0 {
        return Err(LlmError::Input(format!(
            "weight decay {} must be a number of 0 or more",
            options.weight_decay
        )));
    }
    if data.is_empty() {
        return Err(LlmError::Input("no training examples".into()));
    }
    Ok(())
}

/// The optimizer steps `options` make on `n` examples.
pub fn total_steps(options: &FinetuneOptions, n: usize) -> usize {
    let per_step = options.batch_size.max(1) * options.accumulate.max(1);
    let all = n.div_ceil(per_step) * options.epochs;
    options.max_steps.map_or(all, |max| all.min(max))
}

/// The micro-batches of examples `order[start..end]`, `batch_size` a
/// micro-batch, each right-padded with `pad` (`batch::pad`).
pub(crate) fn micro_batches(
    data: &dyn Rows,
    order: &[usize],
    start: usize,
    end: usize,
    batch_size: usize,
    pad: u32,
) -> Result<Vec<batch::MicroBatch>> {
    order[start..end]
        .chunks(batch_size.max(1))
        .map(|ids| {
            let rows = ids
                .iter()
                .map(|&i| data.row(i))
                .collect::<Result<Vec<_>>>()?;
            let rows: Vec<_> = rows.iter().collect();
            Ok(batch::pad(&rows, pad))
        })
        .collect()
}

/// The training loop one step at a time, so a caller can checkpoint and
/// stop between steps.
pub struct Trainer<'a> {
    model: &'a Model,
    data: &'a dyn Rows,
    options: FinetuneOptions,
    pad: u32,
    total: usize,
    state: TrainState,
    /// The order of the epoch it names.
    order: Option<(usize, Vec<usize>)>,
}

impl<'a> Trainer<'a> {
    /// Fresh adapters (A drawn from `seed`, B zero) at step 0.
    pub fn new(model: &'a Model, data: &'a dyn Rows, options: &FinetuneOptions) -> Result<Self> {
        validate(options, data)?;
        let targets: Vec<&str> = options.target_modules.iter().map(String::as_str).collect();
        let adapters = new_adapters(model, options.r, options.alpha, &targets, options.seed)?;
        Self::with_state(model, data, options, TrainState::new(adapters))
    }

    /// Continues from `state` (a checkpoint's), which must fit `options`.
    pub fn with_state(
        model: &'a Model,
        data: &'a dyn Rows,
        options: &FinetuneOptions,
        state: TrainState,
    ) -> Result<Self> {
        validate(options, data)?;
        let fits = state.keys.len() == state.adapters.len()
            && state.m.len() == state.keys.len()
            && state.v.len() == state.keys.len()
            && state
                .keys
                .iter()
                .zip(&state.m)
                .zip(&state.v)
                .all(|((k, m), v)| {
                    state.adapters.get(k).is_some_and(|a| {
                        a.r == options.r
                            && a.a.len() == m.0.len()
                            && a.b.len() == m.1.len()
                            && a.a.len() == v.0.len()
                            && a.b.len() == v.1.len()
                    })
                });
        if !fits {
            return Err(LlmError::Input(
                "the saved training state does not fit the adapters' settings".into(),
            ));
        }
        if state.position > data.len() {
            return Err(LlmError::Input(format!(
                "the saved position {} is past the {} examples of the data",
                state.position,
                data.len()
            )));
        }
        Ok(Self {
            model,
            data,
            options: options.clone(),
            pad: batch::pad_id(&model.config),
            total: total_steps(options, data.len()),
            state,
            order: None,
        })
    }

    pub fn total_steps(&self) -> usize {
        self.total
    }

    pub fn state(&self) -> &TrainState {
        &self.state
    }

    pub fn into_state(self) -> TrainState {
        self.state
    }

    /// No step is left: `max_steps` reached, or every epoch done.
    pub fn done(&self) -> bool {
        self.state.step >= self.total || self.state.epoch >= self.options.epochs
    }

    /// The config the adapters' files record.
    pub fn lora_config(&self) -> LoraConfig {
        lora_config(&self.options)
    }

    /// One optimizer step on the next `batch_size · accumulate` examples
    /// of the epoch's order (fewer at an epoch's end).
    pub fn step(&mut self) -> Result<StepLog> {
        if self.done() {
            return Err(LlmError::Input("the run has no step left".into()));
        }
        let o = &self.options;
        let n = self.data.len();
        let epoch = self.state.epoch;
        if self.order.as_ref().map(|(e, _)| *e) != Some(epoch) {
            self.order = Some((epoch, batch::order(n, o.seed, epoch)));
        }
        let Some((_, order)) = &self.order else {
            unreachable!("the order was set above")
        };
        let start = self.state.position;
        let end = (start + o.batch_size * o.accumulate).min(n);
        let micro = micro_batches(self.data, order, start, end, o.batch_size, self.pad)?;
        let tokens: usize = micro.iter().map(|b| b.counted).sum();
        if tokens == 0 {
            return Err(LlmError::Input(format!(
                "step {}: no label of its examples is counted (all -100)",
                self.state.step + 1
            )));
        }
        let st = &mut self.state;
        let mut sums: Vec<(Vec<f32>, Vec<f32>)> =
            st.m.iter()
                .map(|(a, b)| (vec![0.0; a.len()], vec![0.0; b.len()]))
                .collect();
        let mut loss = 0.0f64;
        for (j, mb) in micro.iter().enumerate() {
            if mb.counted == 0 {
                continue;
            }
            let mut dropout = Dropout {
                p: o.dropout,
                state: batch::dropout_state(o.seed, st.step, j),
            };
            let (l, grads) = self.model.lora_gradients_with(
                &st.adapters,
                &mb.ids,
                &mb.labels,
                (o.dropout > 0.0).then_some(&mut dropout),
            )?;
            // The micro-batch's mean-loss gradient, weighted by its share
            // of the step's counted tokens.
            let w = mb.counted as f32 / tokens as f32;
            loss += l as f64 * mb.counted as f64;
            for (key, (sa, sb)) in st.keys.iter().zip(sums.iter_mut()) {
                if let Some((da, db)) = grads.get(key) {
                    sa.iter_mut().zip(da).for_each(|(s, d)| *s += w * d);
                    sb.iter_mut().zip(db).for_each(|(s, d)| *s += w * d);
                }
            }
        }
        let lr = o.schedule.lr_at(o.lr, st.step, self.total);
        let t = st.step as u64 + 1;
        for (((key, (ga, gb)), (ma, mb)), (va, vb)) in
            st.keys.iter().zip(&sums).zip(&mut st.m).zip(&mut st.v)
        {
            let Some(ad) = st.adapters.get_mut(key) else {
                continue;
            };
            adamw(&mut ad.a, ga, ma, va, lr, o.weight_decay, t);
            adamw(&mut ad.b, gb, mb, vb, lr, o.weight_decay, t);
        }
        st.step += 1;
        st.position = end;
        let epoch_end = end >= n;
        if epoch_end {
            st.epoch += 1;
            st.position = 0;
        }
        Ok(StepLog {
            step: st.step,
            total_steps: self.total,
            epoch,
            loss: (loss / tokens as f64) as f32,
            lr,
            tokens,
            examples: end - start,
            epoch_end,
        })
    }
}

/// The adapter files' config for `options`.
pub fn lora_config(options: &FinetuneOptions) -> LoraConfig {
    let mut target_modules = options.target_modules.clone();
    target_modules.sort();
    target_modules.dedup();
    LoraConfig {
        r: options.r,
        alpha: options.alpha,
        dropout: options.dropout,
        target_modules,
        use_rslora: false,
    }
}

/// Trains fresh adapters on `data`, calling `on_step` after each optimizer
/// step; returns them with the config their files record. No files are
/// written: `run` is the loop with a run directory.
pub fn finetune(
    model: &Model,
    data: &dyn Rows,
    options: &FinetuneOptions,
    mut on_step: impl FnMut(&StepLog),
) -> Result<(Adapters, LoraConfig)> {
    let mut trainer = Trainer::new(model, data, options)?;
    while !trainer.done() {
        let log = trainer.step()?;
        on_step(&log);
    }
    let config = trainer.lora_config();
    Ok((trainer.into_state().adapters, config))
}
