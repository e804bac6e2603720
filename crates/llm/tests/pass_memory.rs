//! `Model::lora_pass_memory` against what a pass really allocates: a
//! counting allocator records the peak of live heap bytes during
//! `lora_gradients` above what was live before it. The estimate must bound
//! the peak (it is what a run is refused by before its first step) without
//! being loose enough to refuse runs that fit (within 3× here).

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use common::*;
use headroom_llm::lora::new_adapters;
use headroom_llm::Model;

struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call is forwarded to the system allocator unchanged; the
// counters only observe the sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let live = LIVE.fetch_add(layout.size(), Ordering::SeqCst) + layout.size();
        PEAK.fetch_max(live, Ordering::SeqCst);
        // SAFETY: the caller's layout is passed on as given.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Ordering::SeqCst);
        // SAFETY: ptr came from System.alloc with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

#[test]
fn the_estimate_bounds_what_a_pass_allocates() {
    // One test function: the counters are process-wide, so the cases run
    // one after the other, on one thread of work each.
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .expect("pool");
    for (name, targets) in [
        ("llama", vec!["q_proj", "v_proj", "down_proj"]),
        ("gpt2", vec!["c_attn", "c_fc"]),
        // bf16: the products convert its weights into the thread's scratch.
        ("qwen2", vec!["q_proj", "v_proj", "down_proj"]),
    ] {
        let model = Model::load(&fixture(name)).expect("loads");
        let adapters = new_adapters(&model, 4, 8.0, &targets, 3).expect("adapters");
        let values: usize = adapters.values().map(|a| a.a.len() + a.b.len()).sum();
        let per_block = adapters.len() / model.config.num_layers;
        let reference = Reference::load(name);
        let batch = as_ids(&reference.rows("input_ids"));
        let labels = reference.rows("labels");
        let (rows, t) = (batch.len(), batch[0].len());
        let estimate = pool.install(|| model.lora_pass_memory(rows, t, values, 4, per_block));
        // The first pass in a fresh thread pool also sets up the product's
        // per-thread workspace; later ones allocate only what the pass needs.
        let mut peaks = Vec::new();
        for _ in 0..2 {
            let before = LIVE.load(Ordering::SeqCst);
            PEAK.store(before, Ordering::SeqCst);
            let result = pool.install(|| model.lora_gradients(&adapters, &batch, &labels));
            peaks.push(PEAK.load(Ordering::SeqCst) - before);
            drop(result.expect("gradients"));
        }
        let (first, peak) = (peaks[0], peaks[1]);
        println!("{name}: first pass {first} B, then {peak} B; estimate {estimate:?}");
        assert!(
            first <= estimate.total(),
            "{name}: the first pass allocated {first} B above the estimate {estimate:?}"
        );
        assert!(
            peak <= estimate.per_pass(),
            "{name}: a pass allocated {peak} B above the estimate {estimate:?}"
        );
        assert!(
            estimate.per_pass() <= 3 * peak,
            "{name}: the estimate {} B is over 3× the {peak} B allocated",
            estimate.per_pass()
        );
    }
}
