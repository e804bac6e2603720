//! A step's examples as micro-batches: each epoch's order (a function of
//! (seed, epoch)), a micro-batch's rows right-padded to its longest row with
//! labels -100 on the padding, the counted tokens that weight each
//! micro-batch's gradient, and the dropout stream of (seed, step,
//! micro-batch). Memory: one micro-batch's ids and labels (copied from the
//! dataset so the rows can be padded), and one epoch's order.
//!
//! Right padding needs no attention mask: attention is causal, so a real
//! token at position i sees positions 0..=i only, all of them real; the
//! padding after the row's last real token is seen by no real token, and
//! its labels (-100) add nothing to the loss. A padded row's loss and
//! gradients are therefore those of the row alone
//! (tests/finetune_batch.rs checks it).

use crate::config::ModelConfig;
use crate::data::Example;

/// The id a micro-batch pads its shorter rows with: the config's
/// `pad_token_id`, else its first `eos_token_id`, else 0. Which id it is
/// does not change the result (no real token sees the padding).
pub fn pad_id(config: &ModelConfig) -> u32 {
    config
        .pad_token_id
        .or_else(|| config.eos_token_ids.first().copied())
        .unwrap_or(0)
}

/// The labels the causal loss counts: position i predicts label i + 1, so
/// label 0 is never read, and -100 is skipped.
pub fn counted(labels: &[i64]) -> usize {
    labels.iter().skip(1).filter(|&&l| l != -100).count()
}

/// Rows of one length, ready for `Model::lora_gradients_with`.
#[derive(Clone, Debug, PartialEq)]
pub struct MicroBatch {
    pub ids: Vec<Vec<u32>>,
    pub labels: Vec<Vec<i64>>,
    /// The labels the loss counts, over all rows.
    pub counted: usize,
}

/// `examples` right-padded with `pad` to the longest of them, labels -100
/// on the padding.
pub fn pad(examples: &[&Example], pad: u32) -> MicroBatch {
    let t = examples.iter().map(|e| e.ids.len()).max().unwrap_or(0);
    let mut batch = MicroBatch {
        ids: Vec::with_capacity(examples.len()),
        labels: Vec::with_capacity(examples.len()),
        counted: 0,
    };
    for e in examples {
        let mut ids = e.ids.clone();
        let mut labels = e.labels.clone();
        ids.resize(t, pad);
        labels.resize(t, -100);
        batch.counted += counted(&labels);
        batch.ids.push(ids);
        batch.labels.push(labels);
    }
    batch
}

use crate::math::splitmix64 as next;

/// Epoch `epoch`'s order of `n` examples: a function of (seed, epoch), so
/// a resumed run finds the order it stopped in.
pub fn order(n: usize, seed: u64, epoch: usize) -> Vec<usize> {
    let mut state = seed ^ (epoch as u64).wrapping_mul(0xD1B5_4A32_D192_ED03);
    let mut ids: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        let j = (next(&mut state) % (i as u64 + 1)) as usize;
        ids.swap(i, j);
    }
    ids
}

/// The dropout stream's start for micro-batch `micro` of optimizer step
/// `step` (from 0): a function of (seed, step, micro-batch), so a rerun and
/// a resumed run draw the same masks.
pub(crate) fn dropout_state(seed: u64, step: usize, micro: usize) -> u64 {
    let mut state = seed ^ 0x5EED_D50F_0000_0000;
    state = next(&mut state) ^ step as u64;
    next(&mut state) ^ (micro as u64).wrapping_mul(0xA24B_AED4_963E_E407)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn padding_is_on_the_right_and_not_counted() {
        let a = Example {
            ids: vec![5, 6, 7],
            labels: vec![-100, 6, 7],
        };
        let b = Example {
            ids: vec![8, 9],
            labels: vec![8, 9],
        };
        let batch = pad(&[&a, &b], 2);
        assert_eq!(batch.ids, vec![vec![5, 6, 7], vec![8, 9, 2]]);
        assert_eq!(batch.labels, vec![vec![-100, 6, 7], vec![8, 9, -100]]);
        assert_eq!(batch.counted, 2 + 1);
    }

    #[test]
    fn orders_are_permutations_fixed_by_seed_and_epoch() {
        let a = order(10, 3, 1);
        let mut sorted = a.clone();
        sorted.sort();
        assert_eq!(sorted, (0..10).collect::<Vec<_>>());
        assert_eq!(a, order(10, 3, 1));
        assert_ne!(a, order(10, 3, 2));
        assert_ne!(dropout_state(1, 2, 0), dropout_state(1, 2, 1));
        assert_ne!(dropout_state(1, 2, 0), dropout_state(1, 3, 0));
    }
}
