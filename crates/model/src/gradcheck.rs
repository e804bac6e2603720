//! Central finite-difference checks of a layer's backward, used by every
//! layer's tests. The loss is L = Σ out·R for a fixed random R, so dL/dout = R
//! and every output element contributes. Computed in f64 around f32 values,
//! with a relative tolerance on each element.

use crate::init::InitRng;
use crate::{Layer, Mode, Result, Tensor};

#[derive(Debug)]
pub struct GradCheckReport {
    pub checked: usize,
    pub worst_rel_error: f64,
    pub worst_at: String,
}

/// A tensor of standard-normal values drawn from `seed`, for tests.
pub fn random_tensor(shape: &[usize], seed: u64) -> Tensor {
    let mut rng = InitRng::new(seed);
    let data = (0..shape.iter().product())
        .map(|_| rng.normal() as f32)
        .collect();
    Tensor::from_vec(shape, data).unwrap_or_else(|_| Tensor::zeros(shape))
}

/// Values ±1 plus N(0, 0.2²) noise, signs random: for layers with a ReLU
/// after a normalisation, whose outputs must stay away from the kink.
pub fn bimodal(shape: &[usize], seed: u64) -> Tensor {
    let mut rng = InitRng::new(seed);
    let data = (0..shape.iter().product())
        .map(|_| {
            let sign = if rng.uniform() < 0.5 { -1.0 } else { 1.0 };
            (sign + 0.2 * rng.normal()) as f32
        })
        .collect();
    Tensor::from_vec(shape, data).unwrap_or_else(|_| Tensor::zeros(shape))
}

/// Checks input gradients and every parameter gradient of `layer` at `input`.
/// Returns Err(description) if any element's error exceeds `tolerance`
/// (relative to max(|analytic|, |numeric|, 1e-2)).
pub fn check_layer(
    layer: &mut dyn Layer,
    input: &Tensor,
    eps: f32,
    tolerance: f64,
) -> std::result::Result<GradCheckReport, String> {
    run(layer, input, eps, tolerance).map_err(|e| e.to_string())?
}

fn run(
    layer: &mut dyn Layer,
    input: &Tensor,
    eps: f32,
    tolerance: f64,
) -> Result<std::result::Result<GradCheckReport, String>> {
    let out = layer.forward(input, Mode::Train)?;
    let mut rng = InitRng::new(0xC0FFEE);
    let r: Vec<f32> = (0..out.len()).map(|_| rng.normal() as f32).collect();
    let r = Tensor::from_vec(out.shape(), r)?;
    for p in layer.params_mut() {
        p.zero_grad();
    }
    let grad_in = layer.backward(&r)?;
    let analytic_params: Vec<Vec<f32>> = layer
        .params_mut()
        .into_iter()
        .map(|p| p.grad.data().to_vec())
        .collect();

    let mut report = GradCheckReport {
        checked: 0,
        worst_rel_error: 0.0,
        worst_at: String::new(),
    };
    let loss = |layer: &mut dyn Layer, x: &Tensor| -> Result<f64> {
        let y = layer.forward(x, Mode::Train)?;
        layer.clear_saved();
        Ok(y.data()
            .iter()
            .zip(r.data())
            .map(|(&a, &b)| a as f64 * b as f64)
            .sum())
    };

    for i in sample_indices(input.len()) {
        let mut plus = input.clone();
        plus.data_mut()[i] += eps;
        let mut minus = input.clone();
        minus.data_mut()[i] -= eps;
        let numeric = (loss(layer, &plus)? - loss(layer, &minus)?) / (2.0 * eps as f64);
        record(
            &mut report,
            grad_in.data()[i] as f64,
            numeric,
            format!("input[{i}]"),
        );
    }
    // Frozen parameters get no gradient by design: nothing to check.
    let frozen: Vec<bool> = layer.params_mut().iter().map(|p| p.frozen).collect();
    let param_count = analytic_params.len();
    for (p, analytic) in analytic_params.iter().enumerate().take(param_count) {
        if frozen[p] {
            continue;
        }
        for i in sample_indices(analytic.len()) {
            let numeric = {
                let nudge = |layer: &mut dyn Layer, delta: f32| {
                    layer.params_mut()[p].value.data_mut()[i] += delta;
                };
                nudge(layer, eps);
                let up = loss(layer, input)?;
                nudge(layer, -2.0 * eps);
                let down = loss(layer, input)?;
                nudge(layer, eps);
                (up - down) / (2.0 * eps as f64)
            };
            let name = layer.params_mut()[p].name.clone();
            record(
                &mut report,
                analytic[i] as f64,
                numeric,
                format!("{name}[{i}]"),
            );
        }
    }
    if report.worst_rel_error > tolerance {
        return Ok(Err(format!(
            "gradient check failed: relative error {:.3e} at {} (tolerance {tolerance:.1e}, {} elements checked)",
            report.worst_rel_error, report.worst_at, report.checked
        )));
    }
    Ok(Ok(report))
}

/// Every index for small tensors; an even spread of 64 for large ones.
fn sample_indices(len: usize) -> Vec<usize> {
    if len <= 64 {
        (0..len).collect()
    } else {
        (0..64)
            .map(|k| k * len / 64 + (k * 7) % (len / 64).max(1))
            .collect()
    }
}

fn record(report: &mut GradCheckReport, analytic: f64, numeric: f64, at: String) {
    let scale = analytic.abs().max(numeric.abs()).max(1e-2);
    let rel = (analytic - numeric).abs() / scale;
    report.checked += 1;
    if rel > report.worst_rel_error {
        report.worst_rel_error = rel;
        report.worst_at = format!("{at} (analytic {analytic:.6e}, numeric {numeric:.6e})");
    }
}
