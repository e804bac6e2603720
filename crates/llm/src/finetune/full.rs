//! A full fine-tune on the CPU: AdamW over every weight of the model
//! (`Model::full_gradients`, by the checkpoint's tensor names), with the
//! LoRA loop's pieces: the epoch's order from (seed, epoch)
//! (`batch::order`), micro-batches of `batch_size` examples right-padded
//! (`batch::pad`), `accumulate` of them per optimizer step with each
//! micro-batch's mean-loss gradient weighted by its counted tokens over the
//! step's (the gradient of the step's token mean, as the LoRA loop), the
//! same schedule (`LrSchedule`), `max_steps`, and the same AdamW update
//! (PyTorch's, decoupled weight decay, `finetune::adamw`) applied tensor by
//! tensor with f32 moments per tensor name. The trained weights are the
//! model's own (`Model::set_weight`); `merge::write_model_dir` writes them
//! as a Hugging Face directory in the base's dtypes. With a maximum
//! gradient norm ([`FullTrainer::set_max_grad_norm`]) the step's summed
//! gradient is scaled, as torch's `clip_grad_norm_` does, when its global
//! L2 norm (summed in f64 in tensor-name order) is over it. The state a
//! checkpoint needs ([`FullState`]: every weight, both moments, step, epoch
//! and position) is read out and put back whole (`full_run`: the run
//! directory, checkpoints and resume); no randomness is kept besides the
//! order, a function of (seed, epoch).
//!
//! Memory: four f32 copies of the weights, the model, the step's gradient
//! sum and AdamW's two moments, plus, while a micro-batch runs, its own
//! gradients (one more copy, added into the sum and dropped; with
//! `accumulate` 1 the micro-batch's gradients are the sum) and the pass's
//! activations (`Model::lora_pass_memory` with no adapters: every block's
//! input, one block's tape, a chunk of logits). The update copies one tensor
//! at a time (`Model::weight`).

use std::collections::BTreeMap;

use crate::data::Rows;
use crate::error::{LlmError, Result};
use crate::finetune::{
    adamw, batch, micro_batches, total_steps, validate, FinetuneOptions, LrSchedule, StepLog,
};
use crate::lora::WeightGrads;
use crate::model::Model;

/// A full fine-tune's settings (the LoRA loop's, without r, alpha, dropout
/// and targets).
#[derive(Clone, Debug)]
pub struct FullOptions {
    pub epochs: usize,
    pub lr: f32,
    /// Examples per micro-batch (one `full_gradients` pass).
    pub batch_size: usize,
    /// Micro-batches per optimizer step.
    pub accumulate: usize,
    pub schedule: LrSchedule,
    pub weight_decay: f32,
    /// Stop after this many optimizer steps (all of the epochs when None).
    pub max_steps: Option<usize>,
    pub seed: u64,
}

impl Default for FullOptions {
    fn default() -> Self {
        Self {
            epochs: 1,
            lr: 2e-5,
            batch_size: 1,
            accumulate: 8,
            schedule: LrSchedule::Constant,
            weight_decay: 0.0,
            max_steps: None,
            seed: 0,
        }
    }
}

impl FullOptions {
    /// The LoRA options with the same loop settings, for the checks and
    /// the step count the two loops share.
    fn as_loop(&self) -> FinetuneOptions {
        FinetuneOptions {
            epochs: self.epochs,
            lr: self.lr,
            batch_size: self.batch_size,
            accumulate: self.accumulate,
            schedule: self.schedule,
            weight_decay: self.weight_decay,
            max_steps: self.max_steps,
            seed: self.seed,
            dropout: 0.0,
            ..FinetuneOptions::default()
        }
    }
}

/// AdamW's moments of one tensor.
#[derive(Clone, Debug, PartialEq)]
pub struct Moments {
    pub m: Vec<f32>,
    pub v: Vec<f32>,
}

/// Where a full fine-tune is, besides the model's weights: what a
/// checkpoint saves with them.
#[derive(Clone, Debug, PartialEq)]
pub struct FullState {
    /// AdamW's moments by weight name.
    pub moments: BTreeMap<String, Moments>,
    /// Optimizer steps done.
    pub step: usize,
    /// The epoch under way (from 0) and the examples of its order used.
    pub epoch: usize,
    pub position: usize,
}

/// The full fine-tune one step at a time (a caller can stop between
/// steps); it trains `model` in place.
pub struct FullTrainer<'a> {
    model: &'a mut Model,
    data: &'a dyn Rows,
    options: FullOptions,
    pad: u32,
    total: usize,
    moments: BTreeMap<String, Moments>,
    step: usize,
    epoch: usize,
    position: usize,
    order: Option<(usize, Vec<usize>)>,
    max_grad_norm: Option<f32>,
    last_grad_norm: Option<f32>,
}

impl<'a> FullTrainer<'a> {
    /// Zero moments for every weight of `model`, at step 0.
    pub fn new(model: &'a mut Model, data: &'a dyn Rows, options: &FullOptions) -> Result<Self> {
        let lo = options.as_loop();
        validate(&lo, data)?;
        let moments = model
            .weight_names()
            .into_iter()
            .map(|(name, shape)| {
                let n = shape.iter().product();
                let zeros = Moments {
                    m: vec![0.0; n],
                    v: vec![0.0; n],
                };
                (name, zeros)
            })
            .collect();
        Ok(Self {
            pad: batch::pad_id(&model.config),
            total: total_steps(&lo, data.len()),
            model,
            data,
            options: options.clone(),
            moments,
            step: 0,
            epoch: 0,
            position: 0,
            order: None,
            max_grad_norm: None,
            last_grad_norm: None,
        })
    }

    /// Continues from `state` (a checkpoint's; the model holds the
    /// checkpoint's weights), which must name every weight of the model
    /// with its size.
    pub fn with_state(
        model: &'a mut Model,
        data: &'a dyn Rows,
        options: &FullOptions,
        state: FullState,
    ) -> Result<Self> {
        let mut trainer = Self::new(model, data, options)?;
        let fits = state.moments.len() == trainer.moments.len()
            && trainer.moments.iter().all(|(name, m)| {
                state
                    .moments
                    .get(name)
                    .is_some_and(|s| s.m.len() == m.m.len() && s.v.len() == m.v.len())
            });
        if !fits {
            return Err(LlmError::Input(
                "the saved moments do not name the model's weights with their sizes".into(),
            ));
        }
        if state.position > data.len() {
            return Err(LlmError::Input(format!(
                "the saved position {} is past the {} examples of the data",
                state.position,
                data.len()
            )));
        }
        trainer.moments = state.moments;
        trainer.step = state.step;
        trainer.epoch = state.epoch;
        trainer.position = state.position;
        Ok(trainer)
    }

    /// Clip each step's summed gradient to this global L2 norm (None: no
    /// clipping); refused unless positive and finite.
    pub fn set_max_grad_norm(&mut self, max: Option<f32>) -> Result<()> {
        if let Some(m) = max.filter(|m| !(m.is_finite() && *m > 0.0)) {
            return Err(LlmError::Input(format!(
                "max_grad_norm {m} must be a positive number"
            )));
        }
        self.max_grad_norm = max;
        Ok(())
    }

    /// The last step's gradient norm before clipping (None before a step).
    pub fn last_grad_norm(&self) -> Option<f32> {
        self.last_grad_norm
    }

    /// The state a checkpoint saves (the weights are the model's).
    pub fn state(&self) -> FullState {
        FullState {
            moments: self.moments.clone(),
            step: self.step,
            epoch: self.epoch,
            position: self.position,
        }
    }

    /// AdamW's moments by weight name, without a copy.
    pub fn moments(&self) -> &BTreeMap<String, Moments> {
        &self.moments
    }

    /// The examples of the epoch's order used.
    pub fn position(&self) -> usize {
        self.position
    }

    pub fn total_steps(&self) -> usize {
        self.total
    }

    /// Optimizer steps taken.
    pub fn steps_done(&self) -> usize {
        self.step
    }

    /// The epoch under way (from 0).
    pub fn epoch(&self) -> usize {
        self.epoch
    }

    /// The model as trained so far.
    pub fn model(&self) -> &Model {
        self.model
    }

    /// No step is left: `max_steps` reached, or every epoch done.
    pub fn done(&self) -> bool {
        self.step >= self.total || self.epoch >= self.options.epochs
    }

    /// One optimizer step on the next `batch_size · accumulate` examples
    /// of the epoch's order (fewer at an epoch's end): every weight moved
    /// by AdamW along the gradient of the step's token-mean loss.
    pub fn step(&mut self) -> Result<StepLog> {
        if self.done() {
            return Err(LlmError::Input("the run has no step left".into()));
        }
        let o = &self.options;
        let n = self.data.len();
        let epoch = self.epoch;
        if self.order.as_ref().map(|(e, _)| *e) != Some(epoch) {
            self.order = Some((epoch, batch::order(n, o.seed, epoch)));
        }
        let Some((_, order)) = &self.order else {
            unreachable!("the order was set above")
        };
        let start = self.position;
        let end = (start + o.batch_size * o.accumulate).min(n);
        let micro = micro_batches(self.data, order, start, end, o.batch_size, self.pad)?;
        let tokens: usize = micro.iter().map(|b| b.counted).sum();
        if tokens == 0 {
            return Err(LlmError::Input(format!(
                "step {}: no label of its examples is counted (all -100)",
                self.step + 1
            )));
        }
        let mut sum: Option<WeightGrads> = None;
        let mut loss = 0.0f64;
        for mb in micro.iter().filter(|mb| mb.counted > 0) {
            let (l, mut grads) = self.model.full_gradients(&mb.ids, &mb.labels)?;
            // The micro-batch's mean-loss gradient, weighted by its share
            // of the step's counted tokens.
            let w = mb.counted as f32 / tokens as f32;
            loss += l as f64 * mb.counted as f64;
            match &mut sum {
                None => {
                    if w != 1.0 {
                        for g in grads.values_mut() {
                            g.data.iter_mut().for_each(|d| *d *= w);
                        }
                    }
                    sum = Some(grads);
                }
                Some(sum) => {
                    for (name, g) in grads {
                        if let Some(s) = sum.get_mut(&name) {
                            s.data
                                .iter_mut()
                                .zip(&g.data)
                                .for_each(|(s, d)| *s += w * d);
                        }
                    }
                }
            }
        }
        let Some(mut sum) = sum else {
            unreachable!("a step with counted tokens ran a micro-batch")
        };
        // The global norm, summed in f64 over the tensors in name order
        // (a BTreeMap's), so it is the same whatever the threads did.
        let squares: f64 = sum
            .values()
            .map(|g| {
                g.data
                    .iter()
                    .map(|&d| f64::from(d) * f64::from(d))
                    .sum::<f64>()
            })
            .sum();
        let norm = squares.sqrt() as f32;
        self.last_grad_norm = Some(norm);
        if let Some(max) = self.max_grad_norm {
            // torch.nn.utils.clip_grad_norm_: scale by max / (norm + 1e-6)
            // when that is below 1.
            let scale = max / (norm + 1e-6);
            if scale < 1.0 {
                for g in sum.values_mut() {
                    g.data.iter_mut().for_each(|d| *d *= scale);
                }
            }
        }
        let lr = o.schedule.lr_at(o.lr, self.step, self.total);
        let t = self.step as u64 + 1;
        for (name, g) in &sum {
            let Some(mom) = self.moments.get_mut(name) else {
                return Err(LlmError::Input(format!(
                    "the gradients name `{name}`, which is no weight of the model"
                )));
            };
            let mut p = self.model.weight(name)?.data;
            if p.len() != g.data.len() || p.len() != mom.m.len() {
                return Err(LlmError::Input(format!(
                    "weight `{name}`: {} values, its gradient {} and its moments {}",
                    p.len(),
                    g.data.len(),
                    mom.m.len()
                )));
            }
            adamw(
                &mut p,
                &g.data,
                &mut mom.m,
                &mut mom.v,
                lr,
                o.weight_decay,
                t,
            );
            self.model.set_weight(name, &p)?;
        }
        self.step += 1;
        self.position = end;
        let epoch_end = end >= n;
        if epoch_end {
            self.epoch += 1;
            self.position = 0;
        }
        Ok(StepLog {
            step: self.step,
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

/// Trains every weight of `model` in place on `data`, calling `on_step`
/// after each optimizer step; writes no file (`merge::write_model_dir`
/// writes the result).
pub fn finetune_full(
    model: &mut Model,
    data: &dyn Rows,
    options: &FullOptions,
    mut on_step: impl FnMut(&StepLog),
) -> Result<()> {
    let mut trainer = FullTrainer::new(model, data, options)?;
    while !trainer.done() {
        let log = trainer.step()?;
        on_step(&log);
    }
    Ok(())
}
