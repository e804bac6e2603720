//! Global-norm clipping: the norm, when scaling happens, and non-finite norms.

use headroom_model::{Param, Tensor};
use headroom_optim::{clip_grad_norm, grad_norm};

fn with_grad(name: &str, grad: &[f32]) -> Param {
    let mut p = Param::new(name, Tensor::zeros(&[grad.len()]), true);
    p.grad.data_mut().copy_from_slice(grad);
    p
}

fn grads(params: &[Param]) -> Vec<Vec<f32>> {
    params.iter().map(|p| p.grad.data().to_vec()).collect()
}

#[test]
fn norm_is_global_over_all_params() {
    // √(3² + 4² + 12²) = 13, spread over three parameters.
    let mut params = vec![
        with_grad("a", &[3.0]),
        with_grad("b", &[-4.0]),
        with_grad("c", &[0.0, 12.0]),
    ];
    assert_eq!(grad_norm(&params), 13.0);
    let refs: Vec<&Param> = params.iter().collect();
    assert_eq!(grad_norm(&refs), 13.0);
    let mut refs: Vec<&mut Param> = params.iter_mut().collect();
    assert_eq!(grad_norm(&refs), 13.0);
    assert_eq!(clip_grad_norm(&mut refs, 100.0), 13.0);
    let none: [&Param; 0] = [];
    assert_eq!(grad_norm(&none), 0.0);
}

#[test]
fn norm_accumulates_in_f64() {
    // 4096² = 2²⁴ followed by 2²⁰ ones: an f32 running sum stays at 2²⁴
    // (adding 1 to 2²⁴ rounds back), the true sum is 2²⁴ + 2²⁰.
    let mut g = vec![1.0f32; 1 << 20];
    g.insert(0, 4096.0);
    let params = [with_grad("big", &g)];
    let want = (((1u64 << 24) + (1u64 << 20)) as f64).sqrt();
    let got = grad_norm(&params) as f64;
    assert!((got - want).abs() < 1e-3, "got {got}, want {want}");
}

#[test]
fn clips_above_max_norm_with_pytorch_coefficient() {
    let mut params = vec![with_grad("a", &[3.0, 0.0]), with_grad("b", &[-4.0])];
    let mut refs: Vec<&mut Param> = params.iter_mut().collect();
    let norm = clip_grad_norm(&mut refs, 1.0);
    assert_eq!(norm, 5.0, "returns the norm before clipping");
    let coef = 1.0 / (5.0 + 1e-6);
    let got = grads(&params);
    assert!((got[0][0] as f64 - 3.0 * coef).abs() < 1e-7, "{got:?}");
    assert_eq!(got[0][1], 0.0);
    assert!((got[1][0] as f64 + 4.0 * coef).abs() < 1e-7, "{got:?}");
    let after = grad_norm(&params);
    assert!(
        after < 1.0 && after > 1.0 - 1e-6,
        "norm after clipping {after}"
    );
}

#[test]
fn leaves_grads_alone_at_or_below_max_norm() {
    for max_norm in [5.0, 5.5, f32::INFINITY] {
        let mut params = vec![with_grad("a", &[3.0, 0.0]), with_grad("b", &[-4.0])];
        let before = grads(&params);
        let mut refs: Vec<&mut Param> = params.iter_mut().collect();
        assert_eq!(clip_grad_norm(&mut refs, max_norm), 5.0);
        assert_eq!(grads(&params), before, "max_norm {max_norm}");
    }
}

#[test]
fn non_finite_norm_leaves_grads_untouched() {
    let cases: [(&[f32], bool); 4] = [
        (&[1.0, f32::NAN], true),
        (&[f32::INFINITY, 1.0], false),
        (&[f32::NEG_INFINITY, 1.0], false),
        // Finite gradients whose norm overflows f32: the caller skips the step.
        (&[3e38, 3e38], false),
    ];
    for (g, nan) in cases {
        let mut params = vec![with_grad("a", &[2.0, 2.0]), with_grad("b", g)];
        let before = grads(&params);
        let mut refs: Vec<&mut Param> = params.iter_mut().collect();
        let norm = clip_grad_norm(&mut refs, 1.0);
        if nan {
            assert!(norm.is_nan(), "{g:?}: {norm}");
        } else {
            assert_eq!(norm, f32::INFINITY, "{g:?}");
        }
        let after = grads(&params);
        for (a, b) in after.iter().flatten().zip(before.iter().flatten()) {
            assert!(a == b || (a.is_nan() && b.is_nan()), "{g:?}: {after:?}");
        }
    }
}
