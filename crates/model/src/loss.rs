//! Softmax cross-entropy, with label smoothing or soft targets, and focal
//! loss (Lin et al. 2017) over the same targets.
//!
//! The loss is the mean over the batch; the returned gradient is
//! dLoss/dlogits (already divided by the batch size). Each row is computed
//! around its maximum (log-sum-exp in f64), so logits of any magnitude are
//! safe; a non-finite logit gives a non-finite loss and gradient, which the
//! loss-scaling check downstream relies on seeing.
//!
//! `value_loss`, for regression: MSE or Huber against f32 targets; and
//! for multi-label classification, binary cross-entropy of each output's
//! sigmoid against a 0/1 target (computed from the logit, never through a
//! sigmoid that could round to 0 or 1).
//!
//! `pixel_mse`, for frame prediction: the mean squared error between
//! predicted pixels and u8 target pixels read as values in [0, 1]. Chosen
//! over per-pixel BCE with logits because the copy-last-frame baseline,
//! whose "predictions" are hard 0/1-ish pixel values, has a finite,
//! comparable MSE (its BCE would hinge on a clamp of log 0), and because
//! MSE in [0, 1] units reads directly as squared pixel error.

use rayon::prelude::*;

use crate::layers::vector_math::{self, lane_max, lane_sum, wide};
use crate::{ModelError, Result, Tensor};

#[derive(Clone, Debug)]
pub struct LossOutput {
    /// Mean loss over the batch.
    pub loss: f32,
    /// dLoss/dlogits, [n, k].
    pub grad: Tensor,
    /// Samples whose arg-max logit is the label (or the target's arg-max).
    pub correct: usize,
}

/// Mean squared error of `predictions` (any shape) against `targets`, u8
/// pixels of the same count read as t/255. `correct` is 0: a regression
/// has no correct predictions to count.
pub fn pixel_mse(predictions: &Tensor, targets: &[u8]) -> Result<LossOutput> {
    if predictions.len() != targets.len() || targets.is_empty() {
        return Err(ModelError::Shape {
            op: "pixel_mse",
            expected: format!("{} target pixels", predictions.len()),
            got: format!("{}", targets.len()),
        });
    }
    let scale = 2.0 / targets.len() as f32;
    let p = predictions.data();
    let target = |i: usize| f32::from(targets[i]) / 255.0;
    let grad = Tensor::try_from_fn(predictions.shape(), |i| scale * (p[i] - target(i)))?;
    let sum: f64 = (0..p.len())
        .map(|i| f64::from(p[i] - target(i)).powi(2))
        .sum();
    Ok(LossOutput {
        loss: (sum / targets.len() as f64) as f32,
        grad,
        correct: 0,
    })
}

/// How a regression's error is scored (`value_loss`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ValueLoss {
    /// Mean squared error.
    Mse,
    /// Huber: squared within `delta` of the target, linear beyond it, so
    /// that outliers pull less.
    Huber { delta: f32 },
    /// Binary cross-entropy of `sigmoid(prediction)` against a target in
    /// [0, 1]: one independent yes/no per output (multi-label).
    Bce,
}

/// The mean over every predicted value of `kind`'s error against
/// `targets` (f32, as many as `predictions`: [n, k] for k targets per
/// sample). `correct` is 0: a regression has nothing to count as correct.
pub fn value_loss(predictions: &Tensor, targets: &[f32], kind: ValueLoss) -> Result<LossOutput> {
    if predictions.len() != targets.len() || targets.is_empty() {
        return Err(ModelError::Shape {
            op: "value_loss",
            expected: format!("{} targets", predictions.len()),
            got: format!("{}", targets.len()),
        });
    }
    let count = targets.len() as f32;
    let p = predictions.data();
    let (mut sum, mut grad) = (0.0f64, Vec::with_capacity(p.len()));
    for (&y, &t) in p.iter().zip(targets) {
        let e = y - t;
        let (loss, slope) = match kind {
            ValueLoss::Mse => (e * e, 2.0 * e),
            ValueLoss::Huber { delta } if e.abs() <= delta => (0.5 * e * e, e),
            ValueLoss::Huber { delta } => (delta * (e.abs() - 0.5 * delta), delta * e.signum()),
            // -t·log σ(y) - (1-t)·log(1-σ(y)) = max(y, 0) - y·t + log(1 + e^-|y|);
            // its slope is σ(y) - t.
            ValueLoss::Bce => (
                y.max(0.0) - y * t + (-y.abs()).exp().ln_1p(),
                sigmoid(y) - t,
            ),
        };
        sum += f64::from(loss);
        grad.push(slope / count);
    }
    Ok(LossOutput {
        loss: (sum / f64::from(count)) as f32,
        grad: Tensor::from_vec(predictions.shape(), grad)?,
        correct: 0,
    })
}

/// The logistic function, without overflow for large |x|.
pub fn sigmoid(x: f32) -> f32 {
    if x >= 0.0 {
        1.0 / (1.0 + (-x).exp())
    } else {
        let e = x.exp();
        e / (1.0 + e)
    }
}

/// The same error for u8 predictions (a baseline that copies pixels): the
/// mean of ((a - b)/255)² over the pixels.
pub fn pixel_mse_u8(predictions: &[u8], targets: &[u8]) -> f64 {
    let sum: f64 = predictions
        .iter()
        .zip(targets)
        .map(|(&a, &b)| ((f64::from(a) - f64::from(b)) / 255.0).powi(2))
        .sum();
    sum / targets.len().max(1) as f64
}

fn logits_shape(logits: &Tensor) -> Result<(usize, usize)> {
    match *logits.shape() {
        [n, k] if n > 0 && k > 0 => Ok((n, k)),
        _ => Err(ModelError::Shape {
            op: "cross_entropy",
            expected: "logits [n, classes] with n ≥ 1 and classes ≥ 1".into(),
            got: format!("{:?}", logits.shape()),
        }),
    }
}

/// Index of the first maximum (NaN never wins).
fn argmax(row: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best
}

/// Writes softmax(row) into `probs` and returns log Σ exp(row) in f64.
/// The exponentials are `vector_math::exp`'s (f32, within 2 ulp), summed
/// in f64 over eight lanes: with f64 `exp` one value at a time, the loss
/// was 4% of a transformer's step.
fn softmax_row(row: &[f32], probs: &mut [f32]) -> f64 {
    let mut lse = 0.0;
    wide(
        #[inline(always)]
        || {
            let max = lane_max(row);
            for (p, &v) in probs.iter_mut().zip(row) {
                *p = vector_math::exp(v - max);
            }
            let sum = lane_sum(
                probs,
                probs,
                #[inline(always)]
                |e, _| e as f64,
            );
            let inv = 1.0 / sum;
            for p in probs.iter_mut() {
                *p = (*p as f64 * inv) as f32;
            }
            lse = max as f64 + sum.ln();
        },
    );
    lse
}

/// One label per row, each below the class count `k`.
fn check_labels(op: &'static str, labels: &[u32], n: usize, k: usize) -> Result<()> {
    if labels.len() != n {
        return Err(ModelError::Shape {
            op,
            expected: format!("{n} labels, one per row of the logits"),
            got: format!("{} labels", labels.len()),
        });
    }
    if let Some((i, &bad)) = labels.iter().enumerate().find(|(_, &l)| l as usize >= k) {
        return Err(ModelError::Shape {
            op,
            expected: format!("labels below the class count {k}"),
            got: format!("label {bad} at sample {i}"),
        });
    }
    Ok(())
}

/// Mean label-smoothed cross-entropy of `logits` [n, k] against `labels`
/// (PyTorch semantics: the target is (1 - s)·onehot + s/k).
pub fn softmax_cross_entropy(
    logits: &Tensor,
    labels: &[u32],
    smoothing: f32,
) -> Result<LossOutput> {
    let (n, k) = logits_shape(logits)?;
    check_labels("cross_entropy", labels, n, k)?;
    if !(0.0..1.0).contains(&smoothing) {
        return Err(ModelError::Shape {
            op: "cross_entropy",
            expected: "label smoothing in [0, 1)".into(),
            got: format!("{smoothing}"),
        });
    }
    let s = smoothing as f64;
    let off = s / k as f64;
    let on = 1.0 - s + off;
    let inv_n = 1.0 / n as f64;
    let mut grad_tensor = Tensor::try_zeros(&[n, k])?;
    let grad = grad_tensor.try_data_mut()?;
    // Rows in parallel, each row's loss kept and summed in row order after:
    // the same bits whatever the thread count.
    let mut row_losses = vec![(0.0f64, false); n];
    logits
        .data()
        .par_chunks_exact(k)
        .zip(grad.par_chunks_exact_mut(k))
        .zip(labels.par_iter())
        .zip(row_losses.par_iter_mut())
        .with_min_len(64)
        .for_each(|(((row, g), &label), out)| {
            let label = label as usize;
            let lse = softmax_row(row, g);
            // -Σ t·log p with log p = x - lse and Σ t = 1, where t is
            // `off` but at the label.
            let p_label = g[label] as f64;
            wide(
                #[inline(always)]
                || {
                    let total = lane_sum(
                        row,
                        row,
                        #[inline(always)]
                        |v, _| v as f64,
                    );
                    let dot = off * total + (on - off) * row[label] as f64;
                    for p in g.iter_mut() {
                        *p = ((*p as f64 - off) * inv_n) as f32;
                    }
                    *out = (lse - dot, argmax(row) == label);
                },
            );
            g[label] = ((p_label - on) * inv_n) as f32;
        });
    let total: f64 = row_losses.iter().map(|&(loss, _)| loss).sum();
    let correct = row_losses.iter().filter(|&&(_, hit)| hit).count();
    Ok(LossOutput {
        loss: (total * inv_n) as f32,
        grad: grad_tensor,
        correct,
    })
}

/// Mean cross-entropy of `logits` [n, k] against soft target distributions
/// `targets` [n, k] (Mixup, CutMix): loss = -Σ t·log softmax(x). The
/// gradient is (Σt)·p - t, which is p - t for targets that sum to one.
/// `correct` counts rows where argmax(logits) == argmax(targets).
pub fn soft_cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<LossOutput> {
    let (n, k) = logits_shape(logits)?;
    targets.expect_shape("soft_cross_entropy targets", logits.shape())?;
    let inv_n = 1.0 / n as f64;
    let mut grad_tensor = Tensor::try_zeros(&[n, k])?;
    let grad = grad_tensor.try_data_mut()?;
    let mut total = 0.0f64;
    let mut correct = 0;
    for ((row, t), g) in logits
        .data()
        .chunks_exact(k)
        .zip(targets.data().chunks_exact(k))
        .zip(grad.chunks_exact_mut(k))
    {
        let lse = softmax_row(row, g);
        let mut mass = 0.0f64;
        for (&v, &tj) in row.iter().zip(t) {
            total -= tj as f64 * (v as f64 - lse);
            mass += tj as f64;
        }
        for (p, &tj) in g.iter_mut().zip(t) {
            *p = ((mass * *p as f64 - tj as f64) * inv_n) as f32;
        }
        if argmax(row) == argmax(t) {
            correct += 1;
        }
    }
    Ok(LossOutput {
        loss: (total * inv_n) as f32,
        grad: grad_tensor,
        correct,
    })
}

/// Mean focal loss of `logits` [n, k] against `labels`, with label
/// smoothing: the targets are those of `softmax_cross_entropy`, and each
/// class's log-probability is weighted by (1 - p)^gamma. gamma = 0 is
/// cross-entropy.
pub fn focal_loss(
    logits: &Tensor,
    labels: &[u32],
    smoothing: f32,
    gamma: f32,
) -> Result<LossOutput> {
    let (n, k) = logits_shape(logits)?;
    if !(0.0..1.0).contains(&smoothing) {
        return Err(ModelError::Shape {
            op: "focal_loss",
            expected: "label smoothing in [0, 1)".into(),
            got: format!("{smoothing}"),
        });
    }
    check_labels("focal_loss", labels, n, k)?;
    let off = smoothing / k as f32;
    let mut targets = Tensor::try_zeros(&[n, k])?;
    for (row, &label) in targets.try_data_mut()?.chunks_exact_mut(k).zip(labels) {
        row.fill(off);
        row[label as usize] += 1.0 - smoothing;
    }
    let mut out = soft_focal_loss(logits, &targets, gamma)?;
    // A label is right when it is the arg-max, as in the cross-entropy.
    out.correct = logits
        .data()
        .chunks_exact(k)
        .zip(labels)
        .filter(|(row, &l)| argmax(row) == l as usize)
        .count();
    Ok(out)
}

/// Mean focal loss of `logits` [n, k] against target distributions
/// `targets` [n, k] (smoothed labels, Mixup, CutMix):
/// loss = -Σ_j t_j·(1 - p_j)^γ·log p_j.
///
/// With q_j = 1 - p_j, ℓ_j = log p_j and c_j = q_j^γ - γ·p_j·ℓ_j·q_j^(γ-1),
/// dloss/dx_i = p_i·Σ_j t_j·c_j - t_i·c_i (for γ = 0: (Σt)·p - t). q_j is
/// computed from the other classes' exponentials, not as 1 - p_j, so a
/// confident row keeps its small weights exact; ℓ_j·q_j^(γ-1) tends to 0
/// as q_j does (ℓ_j ≈ -q_j), which is its value at q_j = 0.
pub fn soft_focal_loss(logits: &Tensor, targets: &Tensor, gamma: f32) -> Result<LossOutput> {
    let (n, k) = logits_shape(logits)?;
    targets.expect_shape("focal_loss targets", logits.shape())?;
    if !(gamma >= 0.0 && gamma.is_finite()) {
        return Err(ModelError::Shape {
            op: "focal_loss",
            expected: "gamma finite and >= 0".into(),
            got: format!("{gamma}"),
        });
    }
    let gamma = gamma as f64;
    let inv_n = 1.0 / n as f64;
    let mut grad_tensor = Tensor::try_zeros(&[n, k])?;
    let grad = grad_tensor.try_data_mut()?;
    let mut total = 0.0f64;
    let mut correct = 0;
    let mut c = vec![0.0f64; k];
    for ((row, t), g) in logits
        .data()
        .chunks_exact(k)
        .zip(targets.data().chunks_exact(k))
        .zip(grad.chunks_exact_mut(k))
    {
        let top = argmax(row);
        let max = row[top] as f64;
        // e_j = exp(x_j - max): e_top = 1, the rest sum to `others`.
        let others: f64 = row
            .iter()
            .enumerate()
            .filter(|&(j, _)| j != top)
            .map(|(_, &v)| (v as f64 - max).exp())
            .sum();
        let sum = 1.0 + others;
        let mut weighted = 0.0f64;
        for (j, (&v, &tj)) in row.iter().zip(t).enumerate() {
            let (p, q, log_p) = if j == top {
                (1.0 / sum, others / sum, -others.ln_1p())
            } else {
                let e = (v as f64 - max).exp();
                let p = e / sum;
                (p, (sum - e) / sum, v as f64 - max - sum.ln())
            };
            let q_gamma = q.powf(gamma);
            total -= tj as f64 * q_gamma * log_p;
            // ℓ·q^(γ-1), written as ℓ·q^γ/q, with its limit 0 at q = 0.
            let log_p_q = if q > 0.0 { log_p * q_gamma / q } else { 0.0 };
            c[j] = q_gamma - gamma * p * log_p_q;
            weighted += tj as f64 * c[j];
            g[j] = p as f32;
        }
        // Non-finite logits: make the whole row NaN, as the cross-entropy does.
        if !max.is_finite() || row.iter().any(|v| !v.is_finite()) {
            total = f64::NAN;
        }
        for ((gj, &tj), cj) in g.iter_mut().zip(t).zip(&c) {
            *gj = ((*gj as f64 * weighted - tj as f64 * cj) * inv_n) as f32;
        }
        if argmax(row) == argmax(t) {
            correct += 1;
        }
    }
    Ok(LossOutput {
        loss: (total * inv_n) as f32,
        grad: grad_tensor,
        correct,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::init::InitRng;

    fn random(shape: &[usize], seed: u64, scale: f32) -> Tensor {
        let mut rng = InitRng::new(seed);
        let len = shape.iter().product();
        Tensor::from_vec(
            shape,
            (0..len).map(|_| scale * rng.normal() as f32).collect(),
        )
        .unwrap()
    }

    /// Central differences of `f` around `x`, element by element.
    fn numeric_grad(x: &Tensor, eps: f32, f: impl Fn(&Tensor) -> f32) -> Vec<f64> {
        (0..x.len())
            .map(|i| {
                let mut plus = x.clone();
                plus.data_mut()[i] += eps;
                let mut minus = x.clone();
                minus.data_mut()[i] -= eps;
                (f(&plus) as f64 - f(&minus) as f64) / (2.0 * eps as f64)
            })
            .collect()
    }

    fn assert_close(analytic: &[f32], numeric: &[f64], tol: f64) {
        for (i, (&a, &n)) in analytic.iter().zip(numeric).enumerate() {
            let scale = (a as f64).abs().max(n.abs()).max(1e-2);
            assert!(
                (a as f64 - n).abs() / scale < tol,
                "element {i}: analytic {a}, numeric {n}"
            );
        }
    }

    #[test]
    fn uniform_logits_give_ln_k() {
        let logits = Tensor::zeros(&[4, 10]);
        let out = softmax_cross_entropy(&logits, &[0, 3, 9, 5], 0.0).unwrap();
        assert!((out.loss as f64 - 10f64.ln()).abs() < 1e-6, "{}", out.loss);
        // Smoothing does not change it: every log-probability is -ln k.
        let out = softmax_cross_entropy(&logits, &[0, 3, 9, 5], 0.3).unwrap();
        assert!((out.loss as f64 - 10f64.ln()).abs() < 1e-6, "{}", out.loss);
        // Gradient (1/k - target)/n.
        let g = out.grad.data();
        let on = 0.7 + 0.03;
        assert!((g[0] as f64 - (0.1 - on) / 4.0).abs() < 1e-7);
        assert!((g[1] as f64 - (0.1 - 0.03) / 4.0).abs() < 1e-7);
    }

    #[test]
    fn known_value_with_smoothing() {
        // One row [1, 2, 3], label 0, smoothing 0.3:
        // target = [0.7 + 0.1, 0.1, 0.1]; loss = -Σ t·log p.
        let logits = Tensor::from_vec(&[1, 3], vec![1.0, 2.0, 3.0]).unwrap();
        let out = softmax_cross_entropy(&logits, &[0], 0.3).unwrap();
        let lse = (1f64.exp() + 2f64.exp() + 3f64.exp()).ln();
        let expected = -(0.8 * (1.0 - lse) + 0.1 * (2.0 - lse) + 0.1 * (3.0 - lse));
        assert!(
            (out.loss as f64 - expected).abs() < 1e-6,
            "{} vs {expected}",
            out.loss
        );
        assert_eq!(out.correct, 0);
    }

    #[test]
    fn gradient_matches_finite_differences() {
        let logits = random(&[5, 7], 1, 2.0);
        let labels = [0, 6, 3, 3, 1];
        for smoothing in [0.0, 0.1] {
            let out = softmax_cross_entropy(&logits, &labels, smoothing).unwrap();
            let numeric = numeric_grad(&logits, 1e-2, |x| {
                softmax_cross_entropy(x, &labels, smoothing).unwrap().loss
            });
            assert_close(out.grad.data(), &numeric, 1e-2);
        }
    }

    #[test]
    fn soft_targets_gradient_matches_finite_differences_and_hard_targets() {
        let logits = random(&[4, 6], 2, 1.5);
        // Mixup-like targets: 0.6 / 0.4 between two classes.
        let mut t = vec![0.0f32; 24];
        for (i, (a, b)) in [(0, 1), (2, 5), (3, 3), (4, 0)].into_iter().enumerate() {
            t[i * 6 + a] += 0.6;
            t[i * 6 + b] += 0.4;
        }
        let targets = Tensor::from_vec(&[4, 6], t).unwrap();
        let out = soft_cross_entropy(&logits, &targets).unwrap();
        let numeric = numeric_grad(&logits, 1e-2, |x| {
            soft_cross_entropy(x, &targets).unwrap().loss
        });
        assert_close(out.grad.data(), &numeric, 1e-2);

        // One-hot targets agree with the hard-label loss, smoothed ones with
        // label smoothing.
        let labels = [1u32, 4, 0, 5];
        for s in [0.0f32, 0.2] {
            let mut t = vec![s / 6.0; 24];
            for (i, &l) in labels.iter().enumerate() {
                t[i * 6 + l as usize] += 1.0 - s;
            }
            let soft = soft_cross_entropy(&logits, &Tensor::from_vec(&[4, 6], t).unwrap()).unwrap();
            let hard = softmax_cross_entropy(&logits, &labels, s).unwrap();
            assert!((soft.loss - hard.loss).abs() < 1e-6);
            assert_eq!(soft.correct, hard.correct);
            for (a, b) in soft.grad.data().iter().zip(hard.grad.data()) {
                assert!((a - b).abs() < 1e-7);
            }
        }
    }

    #[test]
    fn counts_correct_predictions() {
        let logits =
            Tensor::from_vec(&[3, 3], vec![5.0, 1.0, 0.0, 0.0, 0.0, 9.0, 1.0, 2.0, 0.5]).unwrap();
        let out = softmax_cross_entropy(&logits, &[0, 2, 0], 0.0).unwrap();
        assert_eq!(out.correct, 2);
    }

    #[test]
    fn huge_logits_are_stable() {
        let logits = Tensor::from_vec(&[2, 3], vec![1e4, 0.0, -1e4, 1e4, 1e4 - 1.0, 0.0]).unwrap();
        let out = softmax_cross_entropy(&logits, &[0, 1], 0.0).unwrap();
        assert!(out.loss.is_finite());
        assert!(out.grad.data().iter().all(|g| g.is_finite()));
        // Row 0: loss ≈ 0. Row 1: lse - x₁ = 1 + ln(1 + e⁻¹) = ln(1 + e).
        let row1 = (1.0f64 + 1f64.exp()).ln();
        assert!((out.loss as f64 - row1 / 2.0).abs() < 1e-5, "{}", out.loss);
        // A label on a hopeless class: large but finite loss.
        let out = softmax_cross_entropy(&logits, &[2, 2], 0.0).unwrap();
        assert!(out.loss.is_finite() && out.loss > 1e3, "{}", out.loss);
        // Gradient rows sum to zero.
        for row in out.grad.data().chunks(3) {
            assert!(row.iter().sum::<f32>().abs() < 1e-6);
        }
    }

    #[test]
    fn non_finite_logits_propagate() {
        let logits = Tensor::from_vec(&[1, 2], vec![f32::NAN, 0.0]).unwrap();
        let out = softmax_cross_entropy(&logits, &[0], 0.0).unwrap();
        assert!(!out.loss.is_finite());
    }

    #[test]
    fn bad_inputs_are_named_errors() {
        let logits = Tensor::zeros(&[2, 3]);
        let err = softmax_cross_entropy(&logits, &[0], 0.0).unwrap_err();
        assert!(err.to_string().contains("2 labels"), "{err}");
        let err = softmax_cross_entropy(&logits, &[0, 3], 0.0).unwrap_err();
        assert!(matches!(err, ModelError::Shape { .. }));
        assert!(err.to_string().contains("label 3 at sample 1"), "{err}");
        for s in [1.0, -0.1, f32::NAN] {
            let err = softmax_cross_entropy(&logits, &[0, 1], s).unwrap_err();
            assert!(err.to_string().contains("smoothing"), "{err}");
        }
        let err = softmax_cross_entropy(&Tensor::zeros(&[2, 3, 1]), &[0, 1], 0.0).unwrap_err();
        assert!(err.to_string().contains("cross_entropy"), "{err}");
        let err = softmax_cross_entropy(&Tensor::zeros(&[0, 3]), &[], 0.0).unwrap_err();
        assert!(err.to_string().contains("cross_entropy"), "{err}");
        let err = soft_cross_entropy(&logits, &Tensor::zeros(&[2, 4])).unwrap_err();
        assert!(err.to_string().contains("soft_cross_entropy"), "{err}");
    }

    #[test]
    fn focal_loss_with_gamma_zero_is_cross_entropy() {
        let logits = random(&[5, 7], 3, 2.0);
        let labels = [0, 6, 3, 3, 1];
        for s in [0.0f32, 0.1] {
            let focal = focal_loss(&logits, &labels, s, 0.0).unwrap();
            let ce = softmax_cross_entropy(&logits, &labels, s).unwrap();
            assert!(
                (focal.loss - ce.loss).abs() < 1e-6,
                "{} vs {}",
                focal.loss,
                ce.loss
            );
            assert_eq!(focal.correct, ce.correct);
            for (a, b) in focal.grad.data().iter().zip(ce.grad.data()) {
                assert!((a - b).abs() < 1e-7, "{a} vs {b}");
            }
        }
    }

    #[test]
    fn focal_loss_known_value() {
        // One row [1, 2, 3], label 2, gamma 2: -(1 - p₂)²·log p₂.
        let logits = Tensor::from_vec(&[1, 3], vec![1.0, 2.0, 3.0]).unwrap();
        let out = focal_loss(&logits, &[2], 0.0, 2.0).unwrap();
        let lse = (1f64.exp() + 2f64.exp() + 3f64.exp()).ln();
        let p2 = (3.0 - lse).exp();
        let expected = -(1.0 - p2).powi(2) * (3.0 - lse);
        assert!(
            (out.loss as f64 - expected).abs() < 1e-6,
            "{} vs {expected}",
            out.loss
        );
        assert_eq!(out.correct, 1);
    }

    #[test]
    fn focal_loss_gradient_matches_finite_differences() {
        let logits = random(&[5, 7], 4, 2.0);
        let labels = [0, 6, 3, 3, 1];
        for gamma in [0.5f32, 1.0, 2.0, 3.5] {
            for smoothing in [0.0f32, 0.1] {
                let out = focal_loss(&logits, &labels, smoothing, gamma).unwrap();
                let numeric = numeric_grad(&logits, 1e-2, |x| {
                    focal_loss(x, &labels, smoothing, gamma).unwrap().loss
                });
                assert_close(out.grad.data(), &numeric, 1e-2);
            }
        }
        // Soft (Mixup) targets.
        let mut t = vec![0.0f32; 5 * 7];
        for (i, (a, b)) in [(0, 1), (2, 5), (3, 3), (4, 0), (6, 2)]
            .into_iter()
            .enumerate()
        {
            t[i * 7 + a] += 0.7;
            t[i * 7 + b] += 0.3;
        }
        let targets = Tensor::from_vec(&[5, 7], t).unwrap();
        let out = soft_focal_loss(&logits, &targets, 2.0).unwrap();
        let numeric = numeric_grad(&logits, 1e-2, |x| {
            soft_focal_loss(x, &targets, 2.0).unwrap().loss
        });
        assert_close(out.grad.data(), &numeric, 1e-2);
    }

    #[test]
    fn focal_loss_is_stable_and_checks_its_inputs() {
        // A confident right row: loss and gradient tiny but finite, for
        // gammas below and above 1.
        let logits = Tensor::from_vec(&[2, 3], vec![1e4, 0.0, -1e4, 40.0, 0.0, 0.0]).unwrap();
        for gamma in [0.5f32, 2.0] {
            let out = focal_loss(&logits, &[0, 0], 0.0, gamma).unwrap();
            assert!(out.loss.is_finite() && out.loss >= 0.0, "{}", out.loss);
            assert!(out.grad.data().iter().all(|g| g.is_finite()));
            // A hopeless label: large but finite.
            let out = focal_loss(&logits, &[2, 1], 0.0, gamma).unwrap();
            assert!(out.loss.is_finite() && out.loss > 10.0, "{}", out.loss);
        }
        let nan = Tensor::from_vec(&[1, 2], vec![f32::NAN, 0.0]).unwrap();
        assert!(!focal_loss(&nan, &[0], 0.0, 2.0).unwrap().loss.is_finite());
        let logits = Tensor::zeros(&[2, 3]);
        for gamma in [-1.0, f32::NAN, f32::INFINITY] {
            let err = focal_loss(&logits, &[0, 1], 0.0, gamma).unwrap_err();
            assert!(err.to_string().contains("gamma"), "{err}");
        }
        assert!(focal_loss(&logits, &[0], 0.0, 2.0).is_err());
        assert!(focal_loss(&logits, &[0, 3], 0.0, 2.0).is_err());
        assert!(focal_loss(&logits, &[0, 1], 1.0, 2.0).is_err());
    }

    #[test]
    fn pixel_mse_gradient_matches_finite_differences() {
        let x = random(&[2, 3, 2, 2, 1], 21, 0.8);
        let targets: Vec<u8> = (0..x.len()).map(|i| (i * 37 % 256) as u8).collect();
        let out = pixel_mse(&x, &targets).unwrap();
        let numeric = numeric_grad(&x, 1e-2, |x| pixel_mse(x, &targets).unwrap().loss);
        assert_close(out.grad.data(), &numeric, 1e-2);
        assert_eq!(out.grad.shape(), x.shape());
        assert_eq!(out.correct, 0);
    }

    #[test]
    fn pixel_mse_reads_targets_in_zero_one_and_matches_the_u8_baseline() {
        let targets = [0u8, 255, 51, 204];
        let exact = Tensor::from_vec(&[4], targets.map(|t| t as f32 / 255.0).to_vec()).unwrap();
        assert!(pixel_mse(&exact, &targets).unwrap().loss < 1e-12);
        // Predicting 0 everywhere: (0 + 1 + 0.04 + 0.64) / 4.
        let zeros = Tensor::zeros(&[4]);
        let loss = pixel_mse(&zeros, &targets).unwrap().loss;
        assert!((loss - 0.42).abs() < 1e-6, "{loss}");
        assert!((pixel_mse_u8(&[0; 4], &targets) - 0.42).abs() < 1e-9);
        assert!(pixel_mse(&zeros, &targets[..3]).is_err());
    }

    #[test]
    fn value_loss_gradients_match_central_differences_for_mse_and_huber() {
        let predictions = random(&[6, 2], 21, 2.0);
        let targets: Vec<f32> = (0..12).map(|i| (i as f32 - 6.0) * 0.4).collect();
        for kind in [
            ValueLoss::Mse,
            ValueLoss::Huber { delta: 0.7 },
            ValueLoss::Bce,
        ] {
            let out = value_loss(&predictions, &targets, kind).unwrap();
            let numeric = numeric_grad(&predictions, 1e-3, |p| {
                value_loss(p, &targets, kind).unwrap().loss
            });
            assert_close(out.grad.data(), &numeric, 2e-2);
            assert_eq!(out.correct, 0);
        }
        // MSE of a known error; Huber is linear beyond delta.
        let two = Tensor::from_vec(&[2, 1], vec![3.0, -1.0]).unwrap();
        let mse = value_loss(&two, &[1.0, -1.0], ValueLoss::Mse).unwrap();
        assert_eq!(mse.loss, 2.0);
        let huber = value_loss(&two, &[1.0, -1.0], ValueLoss::Huber { delta: 1.0 }).unwrap();
        assert_eq!(huber.loss, 0.75, "(1 * (2 - 0.5) + 0) / 2");
        assert!(value_loss(&two, &[1.0], ValueLoss::Mse).is_err());
        // BCE: a logit of 0 is p = 0.5, ln 2 either way; a confident wrong
        // logit costs about the logit itself, and stays finite.
        let logits = Tensor::from_vec(&[1, 3], vec![0.0, 100.0, -100.0]).unwrap();
        let bce = value_loss(&logits, &[1.0, 0.0, 0.0], ValueLoss::Bce).unwrap();
        let expected = (std::f32::consts::LN_2 + 100.0 + 0.0) / 3.0;
        assert!((bce.loss - expected).abs() < 1e-4, "{}", bce.loss);
        assert_close(bce.grad.data(), &[-0.5 / 3.0, 1.0 / 3.0, 0.0], 1e-6);
    }
}
