//! Parity tests of the losses (`src/ops/loss`).

use super::*;

// Loss

#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn soft_target_cross_entropy_matches_the_cpu_loss() {
    let be = gpu_or_skip!();
    let (n, k) = (29usize, 10usize);
    let logits = random(&[n, k], 310, 3.0, 0.0);
    // Mixup-like targets: two classes per row, weights λ and 1 - λ, then
    // label smoothing 0.1 as the learner applies it.
    let mut targets = vec![0.0f32; n * k];
    for (i, row) in targets.chunks_exact_mut(k).enumerate() {
        let lambda = (i as f32 * 0.37).fract();
        row[(i * 3) % k] += lambda;
        row[(i * 7 + 1) % k] += 1.0 - lambda;
        for t in row.iter_mut() {
            *t = 0.9 * *t + 0.1 / k as f32;
        }
    }
    let cpu = soft_cross_entropy(
        &logits,
        &Tensor::from_vec(&[n, k], targets.clone()).unwrap(),
    )
    .unwrap();
    let targets_d = upload_f32(&be, &targets);
    for (loss_scale, share) in [(1.0f32, 1.0f32), (1024.0, 0.25)] {
        let scale_d = upload_f32(&be, &[loss_scale]);
        let scale = ops::GradScale {
            loss_scale: &scale_d,
            share,
        };
        let out = ops::soft_cross_entropy(&be, &upload(&be, &logits), &targets_d.as_view(), scale)
            .unwrap();
        let what = format!("soft xent scale={loss_scale} share={share}");
        // f32 softmax vs f64, then one f16 rounding of the gradient.
        assert_loss_matches(
            &be,
            &what,
            &out,
            &cpu,
            loss_scale * share,
            (2e-3, 1e-3),
            1e-4,
        );
    }
    let short = upload_f32(&be, &targets[..k]);
    let one = upload_f32(&be, &[1.0]);
    let unit = ops::GradScale {
        loss_scale: &one,
        share: 1.0,
    };
    assert!(
        ops::soft_cross_entropy(&be, &upload(&be, &logits), &short.as_view(), unit).is_err(),
        "the targets' length is checked"
    );
}

/// Focal loss (`train.loss = "focal"`), hard labels with label smoothing
/// and soft targets, γ of 0 (the cross-entropy), 0.5 and 2, f32 and f16
/// logits: the CPU's loss, gradient (times the loss scale and the
/// micro-batch's share) and correct count. The rows include a confident
/// one (p of its top class ≈ 1), whose small weights the kernel must
/// keep, and a NaN logit, which must poison the loss.
#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn focal_loss_matches_the_cpu_loss() {
    let be = gpu_or_skip!();
    let (n, k) = (13usize, 10usize);
    let mut logits = random(&[n, k], 340, 3.0, 0.0);
    logits.data_mut()[2 * k + 4] = 12.0;
    let labels: Vec<u32> = (0..n as u32).map(|i| (i * 7 + 3) % k as u32).collect();
    let mut targets = vec![0.0f32; n * k];
    for (i, row) in targets.chunks_exact_mut(k).enumerate() {
        let lambda = (i as f32 * 0.37).fract();
        row[(i * 3) % k] += lambda;
        row[(i * 7 + 1) % k] += 1.0 - lambda;
        for t in row.iter_mut() {
            *t = 0.9 * *t + 0.1 / k as f32;
        }
    }
    let targets_t = Tensor::from_vec(&[n, k], targets.clone()).unwrap();
    let labels_d = ops::upload_labels(&be, &labels, k).unwrap();
    let targets_d = upload_f32(&be, &targets);
    let (loss_scale, share) = (256.0f32, 0.5f32);
    let scale_d = upload_f32(&be, &[loss_scale]);
    let scale = ops::GradScale {
        loss_scale: &scale_d,
        share,
    };
    for gamma in [0.0f32, 0.5, 2.0] {
        let hard = focal_loss(&logits, &labels, 0.1, gamma).unwrap();
        let soft = soft_focal_loss(&logits, &targets_t, gamma).unwrap();
        if gamma == 0.0 {
            let xent = softmax_cross_entropy(&logits, &labels, 0.1).unwrap();
            assert!(
                (hard.loss - xent.loss).abs() <= 1e-5 * xent.loss,
                "γ = 0 is the cross-entropy"
            );
        }
        for (dtype, rel, abs) in [(DType::F32, 1e-4, 1e-5), (DType::F16, 2e-3, 1e-3)] {
            let x = CudaTensor::from_tensor(&be, &logits, dtype).unwrap();
            let outs = [
                (
                    "hard",
                    &hard,
                    ops::focal_loss(&be, &x, &labels_d.slice.as_view(), 0.1, gamma, scale),
                ),
                (
                    "soft",
                    &soft,
                    ops::soft_focal_loss(&be, &x, &targets_d.as_view(), gamma, scale),
                ),
            ];
            for (what, cpu, out) in outs {
                let what = format!("focal {what} γ={gamma} {dtype:?}");
                let out = out.unwrap();
                assert_loss_matches(&be, &what, &out, cpu, loss_scale * share, (rel, abs), 1e-4);
            }
        }
    }
    let mut poisoned = logits.clone();
    poisoned.data_mut()[5] = f32::NAN;
    let x = CudaTensor::from_tensor(&be, &poisoned, DType::F32).unwrap();
    let out = ops::focal_loss(&be, &x, &labels_d.slice.as_view(), 0.1, 2.0, scale).unwrap();
    assert!(
        out.read_summary(&be).unwrap().0.is_nan(),
        "a NaN logit poisons the loss"
    );
    let x = CudaTensor::from_tensor(&be, &logits, DType::F32).unwrap();
    for bad in [-1.0f32, f32::NAN, f32::INFINITY] {
        assert!(
            ops::focal_loss(&be, &x, &labels_d.slice.as_view(), 0.1, bad, scale).is_err(),
            "γ = {bad} is refused"
        );
    }
}

#[test]
#[cfg_attr(
    not(headroom_nvrtc),
    ignore = "NVRTC not found: python3 -m pip install nvidia-cuda-nvrtc"
)]
fn softmax_cross_entropy_matches_the_cpu_loss() {
    let be = gpu_or_skip!();
    let (n, k) = (37usize, 10usize);
    let mut logits = random(&[n, k], 300, 3.0, 0.0);
    let labels: Vec<u32> = (0..n as u32).map(|i| (i * 7 + 3) % k as u32).collect();
    let labels_d = ops::upload_labels(&be, &labels, k).unwrap();
    for smoothing in [0.0f32, 0.1] {
        for (loss_scale, share) in [(1.0f32, 1.0f32), (1024.0, 0.25)] {
            let cpu = softmax_cross_entropy(&logits, &labels, smoothing).unwrap();
            let scale_d = upload_f32(&be, &[loss_scale]);
            let scale = ops::GradScale {
                loss_scale: &scale_d,
                share,
            };
            let out = ops::softmax_cross_entropy(
                &be,
                &upload(&be, &logits),
                &labels_d.slice.as_view(),
                smoothing,
                scale,
            )
            .unwrap();
            let what = format!("xent s={smoothing} scale={loss_scale} share={share}");
            // f32 softmax vs f64, then one f16 rounding of the gradient.
            assert_loss_matches(
                &be,
                &what,
                &out,
                &cpu,
                loss_scale * share,
                (2e-3, 1e-3),
                1e-4,
            );
        }
    }
    // A NaN logit gives a NaN loss (the inf/NaN check downstream sees it).
    logits.data_mut()[3] = f32::NAN;
    let one = upload_f32(&be, &[1.0]);
    let unit = ops::GradScale {
        loss_scale: &one,
        share: 1.0,
    };
    let out = ops::softmax_cross_entropy(
        &be,
        &upload(&be, &logits),
        &labels_d.slice.as_view(),
        0.0,
        unit,
    )
    .unwrap();
    assert!(out.read_summary(&be).unwrap().0.is_nan());
    assert!(
        ops::upload_labels(&be, &[10], k).is_err(),
        "labels are validated"
    );
}
