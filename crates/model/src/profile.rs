//! Where a step's time goes (`cargo xtask bench --profile`), as labelled
//! segments summed over the steps profiled: on the GPU the time between
//! timing events on the compute stream (`cuda::profile`), on the CPU the
//! wall time between marks (`Network::profile_start`), taken after each
//! layer's forward and backward, the loss and the optimizer. A layer's own
//! threads finish before its mark, so a CPU segment is that layer's whole
//! parallel section.
//!
//! The CPU profiler belongs to the thread that runs the network (layers
//! run one after another on it), so containers (`Residual`) mark their
//! parts without being handed anything, and networks on other threads
//! (tests running side by side) never mark into it.

use std::cell::RefCell;
use std::time::Instant;

use crate::Layer;

thread_local! {
    static PROFILER: RefCell<Option<CpuProfiler>> = const { RefCell::new(None) };
}

/// Starts a profile on this thread (a running one starts over).
pub(crate) fn start() {
    PROFILER.with(|p| *p.borrow_mut() = Some(CpuProfiler::start()));
}

/// Ends this thread's profile: its segments (none if none ran).
pub(crate) fn finish() -> Vec<ProfileSegment> {
    PROFILER.with(|p| {
        p.borrow_mut()
            .take()
            .map(CpuProfiler::finish)
            .unwrap_or_default()
    })
}

/// Ends a segment labelled `label` here, if this thread is profiling.
pub(crate) fn mark(label: impl FnOnce() -> String) {
    PROFILER.with(|p| {
        if let Some(profiler) = p.borrow_mut().as_mut() {
            profiler.mark(label());
        }
    });
}

/// The mark after `layer` ran on a tensor of `shape` ("fwd conv3x3/1
/// 16->16 in 14x14x16"), unless the layer marks its own parts.
pub(crate) fn mark_layer(pass: &str, layer: &dyn Layer, side: &str, shape: &[usize]) {
    if !layer.marks_its_parts() {
        mark(|| format!("{pass} {} {side} {}", layer.describe(), dims(shape)));
    }
}

/// A batch tensor's per-sample shape, "14x14x16".
pub(crate) fn dims(shape: &[usize]) -> String {
    let inner: Vec<String> = shape.iter().skip(1).map(usize::to_string).collect();
    inner.join("x")
}

/// Runs `f` with this thread's profile paused: what `f` runs is charged,
/// whole, to the caller's next mark (a checkpointed group).
pub(crate) fn paused<R>(f: impl FnOnce() -> R) -> R {
    let held = PROFILER.with(|p| p.borrow_mut().take());
    let out = f();
    if held.is_some() {
        PROFILER.with(|p| *p.borrow_mut() = held);
    }
    out
}

/// One labelled segment of a profile, summed over the steps profiled.
#[derive(Clone, Debug, PartialEq)]
pub struct ProfileSegment {
    pub label: String,
    /// Milliseconds between the previous mark and this one, summed.
    pub ms: f64,
    /// How many marks carried this label.
    pub count: u64,
}

/// Adds `ms` to the segment `label`, a new one at the end if none has it:
/// the segments keep the order their labels first appeared in.
pub(crate) fn add_segment(segments: &mut Vec<ProfileSegment>, label: String, ms: f64) {
    match segments.iter_mut().find(|s| s.label == label) {
        Some(segment) => {
            segment.ms += ms;
            segment.count += 1;
        }
        None => segments.push(ProfileSegment {
            label,
            ms,
            count: 1,
        }),
    }
}

/// The CPU's marks: wall time since the previous one.
pub(crate) struct CpuProfiler {
    last: Instant,
    segments: Vec<ProfileSegment>,
}

impl CpuProfiler {
    pub fn start() -> Self {
        Self {
            last: Instant::now(),
            segments: Vec::new(),
        }
    }

    pub fn mark(&mut self, label: String) {
        let now = Instant::now();
        let ms = (now - self.last).as_secs_f64() * 1e3;
        add_segment(&mut self.segments, label, ms);
        // The label's formatting is not charged to the next segment.
        self.last = Instant::now();
    }

    pub fn finish(self) -> Vec<ProfileSegment> {
        self.segments
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn marks_sum_by_label_in_first_seen_order() {
        let mut profiler = CpuProfiler::start();
        for _ in 0..3 {
            std::thread::sleep(std::time::Duration::from_millis(2));
            profiler.mark("fwd a".into());
            profiler.mark("fwd b".into());
        }
        let segments = profiler.finish();
        let labels: Vec<_> = segments
            .iter()
            .map(|s| (s.label.as_str(), s.count))
            .collect();
        assert_eq!(labels, [("fwd a", 3), ("fwd b", 3)]);
        assert!(segments[0].ms >= 6.0, "{segments:?}");
        assert!(segments[1].ms < segments[0].ms, "{segments:?}");
    }
}
