//! Evaluation sharded over the ranks of a data-parallel run: rank r scores
//! slice r of each evaluation batch (`slice_of`, consecutive), the ranks'
//! results are gathered and joined in rank order, so every rank holds the
//! whole batch's result in the batch's order and the run's figures come
//! out alike on all. Each rank evaluates about 1/N of the set.
//!
//! A rank that fails (out of memory, say) says so in its record: every
//! rank then returns the same error (the first rank's refusal, for the
//! memory policy, which re-runs the evaluation on all), so no rank waits
//! for a batch another will never send.
//!
//! The loss is summed per slice, then in rank order: its last bits can
//! differ from one process's, which sums per micro-batch; predictions and
//! counts are the same.

use headroom_dist::collective::slice_of;
use headroom_loader::Batch;

use crate::learner::EvalResult;
use crate::ranks::{Ranks, Refusal};
use crate::{PipelineError, Result};

/// `score` on this rank's slice of `batch`, joined with the other ranks'
/// (`stats`: this rank's pool, for the error of a refusal).
pub(crate) fn score_sharded(
    ranks: &Ranks,
    batch: &Batch,
    stats: headroom_model::PoolStats,
    score: impl FnOnce(&Batch) -> Result<EvalResult>,
) -> Result<EvalResult> {
    let own = slice_of(batch.len(), ranks.world, ranks.rank);
    let local = if own.is_empty() {
        Ok(empty())
    } else {
        score(&batch.slice(own))
    };
    let mut record = Vec::new();
    match &local {
        Ok(result) => {
            record.push(0);
            encode(result, &mut record);
        }
        Err(e) => match Refusal::of(e) {
            Some(refusal) => {
                record.push(1);
                let mut bytes = [0u8; 17];
                refusal.write(&mut bytes);
                record.extend_from_slice(&bytes);
            }
            None => record.push(2),
        },
    }
    let all = ranks.gather_varying(&record, "gathering an evaluation batch's results")?;
    let status = |code: u8| all.iter().position(|r| r.first() == Some(&code));
    if let Some(k) = status(2) {
        // Not our own refusal: the memory policy would re-run it alone.
        return Err(match local {
            Err(e) if !e.is_out_of_memory() => e,
            _ => PipelineError::Stage {
                stage: "evaluation",
                reason: format!("rank {k} failed evaluating (its own output says why)"),
            },
        });
    }
    if let Some(k) = status(1) {
        let refusal = all[k]
            .get(1..18)
            .and_then(Refusal::read)
            .ok_or_else(|| malformed(k))?;
        if k != ranks.rank {
            tracing::warn!("rank {k} ran out of memory evaluating; every rank follows it");
        }
        return Err(refusal.error(&stats));
    }
    let mut joined = empty();
    for (k, record) in all.iter().enumerate() {
        let part = decode(record.get(1..).unwrap_or_default()).ok_or_else(|| malformed(k))?;
        joined.loss_sum += part.loss_sum;
        joined.predictions.extend(part.predictions);
        if let Some(sum) = part.baseline_loss_sum {
            *joined.baseline_loss_sum.get_or_insert(0.0) += sum;
        }
        if let Some(values) = part.values {
            joined.values.get_or_insert_with(Vec::new).extend(values);
        }
        if let Some(hits) = part.top5_correct {
            *joined.top5_correct.get_or_insert(0) += hits;
        }
    }
    Ok(joined)
}

fn malformed(rank: usize) -> PipelineError {
    PipelineError::Stage {
        stage: "evaluation",
        reason: format!("rank {rank} sent a malformed evaluation record"),
    }
}

fn empty() -> EvalResult {
    EvalResult {
        loss_sum: 0.0,
        predictions: Vec::new(),
        baseline_loss_sum: None,
        values: None,
        top5_correct: None,
    }
}

fn encode(result: &EvalResult, out: &mut Vec<u8>) {
    out.extend_from_slice(&result.loss_sum.to_le_bytes());
    let optional = |out: &mut Vec<u8>, word: Option<[u8; 8]>| {
        out.push(u8::from(word.is_some()));
        out.extend_from_slice(&word.unwrap_or_default());
    };
    optional(out, result.baseline_loss_sum.map(f64::to_le_bytes));
    optional(out, result.top5_correct.map(u64::to_le_bytes));
    out.extend_from_slice(&(result.predictions.len() as u64).to_le_bytes());
    for p in &result.predictions {
        out.extend_from_slice(&p.to_le_bytes());
    }
    optional(
        out,
        result
            .values
            .as_ref()
            .map(|v| (v.len() as u64).to_le_bytes()),
    );
    for v in result.values.iter().flatten() {
        out.extend_from_slice(&v.to_le_bytes());
    }
}

fn decode(bytes: &[u8]) -> Option<EvalResult> {
    let mut at = 0usize;
    let mut take = |n: usize| -> Option<&[u8]> {
        let part = bytes.get(at..at + n)?;
        at += n;
        Some(part)
    };
    let word = |b: &[u8]| -> Option<[u8; 8]> { b.try_into().ok() };
    let loss_sum = f64::from_le_bytes(word(take(8)?)?);
    let has_baseline = take(1)?[0] != 0;
    let baseline = f64::from_le_bytes(word(take(8)?)?);
    let has_top5 = take(1)?[0] != 0;
    let top5 = u64::from_le_bytes(word(take(8)?)?);
    let count = u64::from_le_bytes(word(take(8)?)?) as usize;
    let mut predictions = Vec::with_capacity(count.min(bytes.len() / 4));
    for _ in 0..count {
        predictions.push(u32::from_le_bytes(take(4)?.try_into().ok()?));
    }
    let has_values = take(1)?[0] != 0;
    let count = u64::from_le_bytes(word(take(8)?)?) as usize;
    let mut values = Vec::with_capacity(count.min(bytes.len() / 4));
    for _ in 0..count {
        values.push(f32::from_le_bytes(take(4)?.try_into().ok()?));
    }
    Some(EvalResult {
        loss_sum,
        predictions,
        baseline_loss_sum: has_baseline.then_some(baseline),
        values: has_values.then_some(values),
        top5_correct: has_top5.then_some(top5),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_result_survives_the_wire() {
        let result = EvalResult {
            loss_sum: 1.25,
            predictions: vec![3, 1, 4],
            baseline_loss_sum: Some(0.5),
            values: Some(vec![1.0, -2.5]),
            top5_correct: Some(7),
        };
        let mut bytes = Vec::new();
        encode(&result, &mut bytes);
        assert_eq!(decode(&bytes), Some(result));
        let mut bytes = Vec::new();
        encode(&empty(), &mut bytes);
        assert_eq!(decode(&bytes), Some(empty()));
        assert_eq!(decode(&bytes[..bytes.len() - 1]), None);
    }
}
