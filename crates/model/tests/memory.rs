//! Out of memory through the network: an ordinary error from forward or
//! backward, wherever it strikes, with nothing leaked and the step
//! retryable. Each test works in a private pool (`MemoryPool::scope`), so
//! the budgets and faults here do not reach tests running beside them.

mod common;

use common::{batch, grads, small, step};
use headroom_model::{
    measure_step_peak, Device, MemoryPool, ModelError, Network, OomInjection, Tensor,
};

#[test]
fn a_step_under_a_too_small_budget_is_an_error_and_leaks_nothing() {
    let spec = common::reference();
    let mut net = Network::build(&spec, 0).unwrap();
    let (pixels, labels) = batch(&spec, 16, 0);
    let pool = MemoryPool::new(Device::Cpu);
    pool.scope(|| {
        let x = net.input_from_u8(16, &pixels).unwrap();
        let baseline = pool.stats().in_use_bytes;
        let buffers = net.buffer_values();

        // Far too small: the first activation does not fit.
        pool.set_limit(Some(baseline + (1 << 20)));
        let err = step(&mut net, &x, &labels, 1.0).unwrap_err();
        let ModelError::OutOfMemory {
            requested,
            in_use,
            reserved,
            limit,
        } = err
        else {
            panic!("expected OutOfMemory, got {err:?}");
        };
        assert_eq!(limit, Some(baseline + (1 << 20)));
        assert!(reserved + requested > baseline + (1 << 20));
        assert!(in_use <= reserved);
        assert_eq!(pool.stats().in_use_bytes, baseline, "nothing leaked");
        assert_eq!(
            net.buffer_values(),
            buffers,
            "a failed forward has no effect"
        );

        // Enough for the forward but not for the backward.
        pool.set_limit(None);
        pool.reset_peak();
        net.zero_grad();
        let logits = net.forward(&x, headroom_model::Mode::Train).unwrap();
        let forward_peak = pool.stats().peak_in_use_bytes;
        drop(logits);
        net.clear_saved();
        net.restore_buffer_values(&buffers).unwrap();
        pool.reset_peak();
        step(&mut net, &x, &labels, 1.0).unwrap();
        let step_peak = pool.stats().peak_in_use_bytes;
        assert!(step_peak > forward_peak);
        net.restore_buffer_values(&buffers).unwrap();
        pool.set_limit(Some(forward_peak + (step_peak - forward_peak) / 4));
        pool.empty_cache();
        net.zero_grad();
        let err = step(&mut net, &x, &labels, 1.0).unwrap_err();
        assert!(err.is_out_of_memory(), "{err}");
        net.clear_saved();
        assert_eq!(pool.stats().in_use_bytes, baseline, "nothing leaked");

        // With the budget at the measured peak, the step fits.
        pool.set_limit(Some(step_peak));
        pool.reset_peak();
        net.restore_buffer_values(&buffers).unwrap();
        net.zero_grad();
        step(&mut net, &x, &labels, 1.0).unwrap();
        assert!(pool.stats().peak_reserved_bytes <= step_peak);
        assert!(pool.stats().oom_events >= 2);
        assert_eq!(pool.stats().in_use_bytes, baseline);
    });
    assert_eq!(pool.stats().in_use_bytes, 0);
}

#[test]
fn a_fault_at_any_allocation_of_a_step_is_an_error_and_the_retry_is_exact() {
    let spec = small();
    let (pixels, labels) = batch(&spec, 8, 0);
    // The undisturbed step.
    let mut clean = Network::build(&spec, 5).unwrap();
    let x = clean.input_from_u8(8, &pixels).unwrap();
    clean.zero_grad();
    step(&mut clean, &x, &labels, 1.0).unwrap();
    let want_grads = grads(&mut clean);
    let want_buffers = clean.buffer_values();

    let pool = MemoryPool::new(Device::Cpu);
    let mut net = Network::build(&spec, 5).unwrap();
    let allocations = pool.scope(|| {
        let before = pool.stats().allocations;
        let buffers = net.buffer_values();
        net.zero_grad();
        step(&mut net, &x, &labels, 1.0).unwrap();
        net.restore_buffer_values(&buffers).unwrap();
        pool.stats().allocations - before
    });
    assert!(allocations > 20, "{allocations}");
    for k in 1..=allocations {
        pool.scope(|| {
            let baseline = pool.stats().in_use_bytes;
            // The retry policy: remember the running statistics; on out of
            // memory drop what the step holds (a failed loss leaves the
            // forward's activations saved), put the statistics back, zero
            // the gradients and retry.
            let buffers = net.buffer_values();
            net.zero_grad();
            pool.inject_oom(OomInjection::Nth(k));
            let err = step(&mut net, &x, &labels, 1.0).unwrap_err();
            assert!(err.is_out_of_memory(), "fault {k}: {err}");
            net.clear_saved();
            assert_eq!(pool.stats().in_use_bytes, baseline, "fault {k} leaked");
            net.restore_buffer_values(&buffers).unwrap();
            net.zero_grad();
            step(&mut net, &x, &labels, 1.0).unwrap();
            assert_eq!(grads(&mut net), want_grads, "retry after fault {k}");
            assert_eq!(net.buffer_values(), want_buffers, "retry after fault {k}");
            net.restore_buffer_values(&buffers).unwrap();
        });
    }
    assert_eq!(pool.stats().oom_events, allocations);
}

#[test]
fn measure_step_peak_reports_errors_and_leaves_no_state() {
    // A batch of one cannot train a batch norm on a 1×1 map: the dry run
    // returns that error and leaves no state behind.
    let spec = common::parse(
        r#"
[model]
input = [1, 1, 2]
mean = 0.0
std = 1.0
layers = [ { type = "batch_norm" }, { type = "global_avg_pool" }, { type = "linear", out = 2 } ]
"#,
    )
    .unwrap();
    let mut net = Network::build(&spec, 0).unwrap();
    assert!(measure_step_peak(&mut net, 1).is_err());
    assert!(measure_step_peak(&mut net, 2).unwrap() > 0);
    // Nothing saved is left behind either way.
    let x = Tensor::try_zeros(&[2, 1, 1, 2]).unwrap();
    assert!(net.backward(&x).is_err());
}
