//! The caching memory pool under every tensor allocation.
//!
//! One pool per device, process-wide (`Device::Cpu.pool()`), thread-safe (one
//! mutex around the bins: allocations are per layer, not per element). The
//! CUDA device will run the same policy over device pointers.
//!
//! Policy:
//! - Size classes: requests are rounded up to a class, 256 bytes at least,
//!   then four classes per power of two (2ᵖ, 1.25·2ᵖ, 1.5·2ᵖ, 1.75·2ᵖ), so a
//!   block wastes less than 25% (12% on average) of its size. Measured on
//!   the reference ResNet (peak in use of one training step, all buffers
//!   from the pool): 154 MiB at batch 128 and 110 MiB at batch 100 with
//!   these classes, 177 MiB at both with powers of two (up to 50% waste),
//!   145 MiB at batch 128 unrounded.
//! - Because any cached block can be released on demand, an allocation is
//!   refused under a budget only when in-use + request would exceed it: the
//!   peak in use of a step (`Network::measure_step`) is what it needs.
//! - Reuse: a freed block goes back to the bin of its class and the next
//!   request of that class takes it (most recently freed first: it is still
//!   warm in the caches). Freed activation memory therefore stays in the
//!   process from one step to the next instead of going back to the OS and
//!   being faulted in again: a ReLU forward + backward on a 12.25 MiB
//!   activation (2 cores) takes 10-13 ms with fresh `Vec`s (glibc maps and
//!   unmaps blocks that large on every call) and 0.5-0.8 ms from the pool.
//! - Statistics (`PoolStats`): bytes in use (held by live tensors, counted
//!   in whole blocks), bytes reserved (in use + cached: what the process holds
//!   from the OS for tensors), their peaks, and counters.
//! - Budget (`set_limit`): the limit is on RESERVED bytes, i.e. on what the
//!   process holds from the OS for tensors, as a GPU's memory would be. An
//!   allocation that would take reserved past the limit first releases cached
//!   blocks (largest first) and then, if it still does not fit, fails with
//!   `ModelError::OutOfMemory` — an ordinary error value, never a panic and
//!   never a silent spill past the limit. The pool is left consistent.
//! - Adopted buffers (`Tensor::from_vec` takes over a `Vec` allocated
//!   elsewhere) are accounted like blocks of their capacity and cached on
//!   drop like blocks of the largest class they cover. Adopting one also
//!   releases an idle cached block of that class, if there is one, so that
//!   code which always allocates its own buffers cannot make the cache grow
//!   without bound.
//! - Infallible constructors (`Tensor::zeros`, the copy in `data_mut` on a
//!   shared tensor) are meant for setup and tests: they are accounted but not
//!   refused by the budget (and so can show `reserved > limit` in the
//!   statistics). Everything a forward, backward or loss allocates goes
//!   through the fallible path.
//! - Headroom: under `RLIMIT_AS` / `RLIMIT_DATA` a fallible block (and
//!   `try_scratch`) that would leave less than `address_space::headroom()`
//!   under the limit is refused as the system's refusal, before the OS is
//!   asked: the pool taking address space up to the limit would leave the
//!   next ordinary allocation of any thread to abort the process.
//!
//! `MemoryPool::new` makes a private pool and `MemoryPool::scope` routes this
//! thread's CPU tensor allocations to it for the duration of a closure: tests
//! use it to check the policy and measure one step in isolation from other
//! threads, and `Network::measure_step` uses it for its dry run.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use crate::{address_space, Device, ModelError, Result};

/// Smallest block, in bytes.
const MIN_BLOCK: u64 = 256;
/// Bytes per element of the CPU's f32 tensors.
const F32_BYTES: u64 = 4;

/// A snapshot of a pool's statistics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Bytes of the blocks held by live tensors (whole blocks, so a request
    /// rounded up to its class counts at the class size).
    pub in_use_bytes: u64,
    /// Bytes held from the OS for tensors: in use + cached.
    pub reserved_bytes: u64,
    /// Highest `in_use_bytes` since creation or `reset_peak`.
    pub peak_in_use_bytes: u64,
    /// Highest `reserved_bytes` since creation or `reset_peak`.
    pub peak_reserved_bytes: u64,
    /// Successful allocations (cache hits + misses; adopted buffers count as
    /// misses).
    pub allocations: u64,
    /// Allocations served from a cached block.
    pub cache_hits: u64,
    /// Allocations that took new memory from the OS.
    pub cache_misses: u64,
    /// Allocations refused (budget, injected fault, or the OS).
    pub oom_events: u64,
}

impl PoolStats {
    /// Reserved but not in use: what `empty_cache` would release.
    pub fn cached_bytes(&self) -> u64 {
        self.reserved_bytes.saturating_sub(self.in_use_bytes)
    }
}

/// A planned allocation failure, for tests of the out-of-memory policy.
/// Only fallible allocations count (and fail).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OomInjection {
    /// The next fallible allocation fails, once.
    Next,
    /// The n-th fallible allocation from now fails (1 = the next), once.
    Nth(u64),
    /// Every fallible allocation fails until `clear_injection`.
    Always,
}

/// Bytes for people: bytes below a KiB, KiB below a MiB, MiB below a GiB,
/// then GiB (a budget of a few KiB must not read "0.0 MiB").
pub fn bytes_text(bytes: u64) -> String {
    match bytes {
        b if b < 1 << 10 => format!("{b} B"),
        b if b < 1 << 20 => format!("{:.1} KiB", b as f64 / 1024.0),
        b if b < 1 << 30 => format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64),
        b => format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64),
    }
}

/// The rounded size of a request of `bytes`: at least `MIN_BLOCK`, then four
/// classes per power of two.
pub fn class_bytes(bytes: u64) -> u64 {
    if bytes <= MIN_BLOCK {
        return MIN_BLOCK;
    }
    // 2ᵖ < bytes ≤ 2ᵖ⁺¹: classes 2ᵖ + k·2ᵖ⁻², k = 1..=4.
    let p = 63 - (bytes - 1).leading_zeros();
    let step = 1u64 << (p - 2);
    bytes.div_ceil(step) * step
}

/// The largest class not above `bytes` (None below the smallest block): the
/// bin a buffer of that capacity is cached in.
fn floor_class(bytes: u64) -> Option<u64> {
    if bytes < MIN_BLOCK {
        return None;
    }
    let p = 63 - bytes.leading_zeros();
    let step = 1u64 << p.saturating_sub(2);
    Some(bytes / step * step)
}

fn cap_bytes(v: &Vec<f32>) -> u64 {
    v.capacity() as u64 * F32_BYTES
}

#[derive(Debug)]
enum Injection {
    /// Fail when the countdown reaches 1.
    Countdown(u64),
    Always,
}

#[derive(Default)]
struct Inner {
    /// Cached blocks by class (bytes); every Vec has len 0.
    bins: BTreeMap<u64, Vec<Vec<f32>>>,
    stats: PoolStats,
    limit: Option<u64>,
    injection: Option<Injection>,
}

impl Inner {
    fn note_peaks(&mut self) {
        let s = &mut self.stats;
        s.peak_in_use_bytes = s.peak_in_use_bytes.max(s.in_use_bytes);
        s.peak_reserved_bytes = s.peak_reserved_bytes.max(s.reserved_bytes);
    }

    /// Consumes one step of an injected fault; true if this allocation fails.
    fn injected_failure(&mut self) -> bool {
        match &mut self.injection {
            None => false,
            Some(Injection::Always) => true,
            Some(Injection::Countdown(n)) => {
                if *n <= 1 {
                    self.injection = None;
                    true
                } else {
                    *n -= 1;
                    false
                }
            }
        }
    }

    /// The operating system (or the driver) refused `requested` bytes: no
    /// budget was passed, whatever the pool's limit is.
    fn refused_by_system(&mut self, requested: u64) -> ModelError {
        self.refusal(requested, None)
    }

    /// The budget (or an injected fault) refused `requested` bytes.
    fn oom(&mut self, requested: u64) -> ModelError {
        self.refusal(requested, self.limit)
    }

    fn refusal(&mut self, requested: u64, limit: Option<u64>) -> ModelError {
        self.stats.oom_events += 1;
        ModelError::OutOfMemory {
            requested,
            in_use: self.stats.in_use_bytes,
            reserved: self.stats.reserved_bytes,
            limit,
        }
    }

    /// Releases cached blocks, largest first, until reserved ≤ `target` or
    /// the cache is empty; the blocks are freed by the caller outside the
    /// lock.
    fn release_cached(&mut self, target: u64, freed: &mut Vec<Vec<f32>>) {
        while self.stats.reserved_bytes > target {
            let Some(mut entry) = self.bins.last_entry() else {
                break;
            };
            match entry.get_mut().pop() {
                Some(block) => {
                    self.stats.reserved_bytes -= cap_bytes(&block);
                    freed.push(block);
                }
                None => {
                    entry.remove();
                }
            }
        }
    }

    /// Makes room for `bytes` more reserved under the limit, releasing cached
    /// blocks if needed; Err if even an empty cache would not do.
    fn fit(&mut self, bytes: u64, freed: &mut Vec<Vec<f32>>) -> Result<()> {
        if let Some(limit) = self.limit {
            if self.stats.reserved_bytes + bytes > limit {
                self.release_cached(limit.saturating_sub(bytes), freed);
                if self.stats.reserved_bytes + bytes > limit {
                    return Err(self.oom(bytes));
                }
            }
        }
        Ok(())
    }

    /// A cached block that can hold `len` elements: one of the request's
    /// class, or (for adopted buffers) one of the class below whose capacity
    /// happens to be enough.
    fn take_cached(&mut self, class: u64, len: usize) -> Option<Vec<f32>> {
        if let Some(block) = self.bins.get_mut(&class).and_then(Vec::pop) {
            return Some(block);
        }
        let below = floor_class(len as u64 * F32_BYTES)?;
        if below == class {
            return None;
        }
        let bin = self.bins.get_mut(&below)?;
        let at = bin.iter().rposition(|b| b.capacity() >= len)?;
        Some(bin.swap_remove(at))
    }
}

/// A caching allocator for one device's tensors; see the module docs.
pub struct MemoryPool {
    device: Device,
    inner: Mutex<Inner>,
}

impl std::fmt::Debug for MemoryPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryPool")
            .field("device", &self.device)
            .field("stats", &self.stats())
            .field("limit", &self.limit())
            .finish()
    }
}

static CPU_POOL: OnceLock<Arc<MemoryPool>> = OnceLock::new();

thread_local! {
    /// The pool this thread's CPU allocations go to inside `MemoryPool::scope`.
    static SCOPED: RefCell<Option<Arc<MemoryPool>>> = const { RefCell::new(None) };
}

fn global(device: Device) -> &'static Arc<MemoryPool> {
    match device {
        Device::Cpu => CPU_POOL.get_or_init(|| MemoryPool::new(Device::Cpu)),
    }
}

/// The process-wide pool of `device`.
pub(crate) fn device_pool(device: Device) -> &'static MemoryPool {
    global(device)
}

/// The pool new tensors on `device` come from on this thread: the scoped one
/// inside `MemoryPool::scope`, else the device's.
pub(crate) fn current(device: Device) -> Arc<MemoryPool> {
    SCOPED
        .try_with(|s| s.borrow().clone())
        .ok()
        .flatten()
        .filter(|p| p.device == device)
        .unwrap_or_else(|| Arc::clone(global(device)))
}

/// Restores the previous scoped pool, also on unwinding.
struct ScopeGuard(Option<Arc<MemoryPool>>);

impl Drop for ScopeGuard {
    fn drop(&mut self) {
        let previous = self.0.take();
        // Fails only while the thread's locals are being destroyed.
        let _ = SCOPED.try_with(|s| *s.borrow_mut() = previous);
    }
}

impl MemoryPool {
    /// A private pool (tests, dry runs). Tensors use it only inside `scope`.
    pub fn new(device: Device) -> Arc<Self> {
        Arc::new(Self {
            device,
            inner: Mutex::new(Inner::default()),
        })
    }

    pub fn device(&self) -> Device {
        self.device
    }

    /// Runs `f` with this thread's tensor allocations on this pool's device
    /// going to this pool. Tensors made inside return their blocks here when
    /// dropped, wherever that happens. Nested scopes restore the outer one.
    pub fn scope<R>(self: &Arc<Self>, f: impl FnOnce() -> R) -> R {
        let previous = SCOPED.with(|s| s.borrow_mut().replace(Arc::clone(self)));
        let _guard = ScopeGuard(previous);
        f()
    }

    /// A poisoned lock only means another thread panicked while holding it;
    /// every update below leaves the counters consistent before it can panic,
    /// so the state is still valid.
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn stats(&self) -> PoolStats {
        self.lock().stats
    }

    /// Releases every cached (reserved but unused) block; returns the bytes
    /// released.
    pub fn empty_cache(&self) -> u64 {
        let mut freed = Vec::new();
        let released = {
            let mut g = self.lock();
            let before = g.stats.reserved_bytes;
            g.release_cached(0, &mut freed);
            g.bins.clear();
            before - g.stats.reserved_bytes
        };
        drop(freed);
        released
    }

    /// Restarts the peaks from the current figures.
    pub fn reset_peak(&self) {
        let mut g = self.lock();
        g.stats.peak_in_use_bytes = g.stats.in_use_bytes;
        g.stats.peak_reserved_bytes = g.stats.reserved_bytes;
    }

    /// Sets (or removes) the budget on reserved bytes. Lowering it below the
    /// current reserve releases cached blocks now; blocks in use stay (the
    /// next fallible allocation fails until enough are freed).
    pub fn set_limit(&self, limit: Option<u64>) {
        let mut freed = Vec::new();
        {
            let mut g = self.lock();
            g.limit = limit;
            if let Some(limit) = limit {
                g.release_cached(limit, &mut freed);
            }
        }
        drop(freed);
    }

    pub fn limit(&self) -> Option<u64> {
        self.lock().limit
    }

    /// Plans an allocation failure (replacing any earlier plan). `Nth(0)`
    /// clears the plan.
    pub fn inject_oom(&self, plan: OomInjection) {
        self.lock().injection = match plan {
            OomInjection::Next => Some(Injection::Countdown(1)),
            OomInjection::Nth(0) => None,
            OomInjection::Nth(n) => Some(Injection::Countdown(n)),
            OomInjection::Always => Some(Injection::Always),
        };
    }

    pub fn clear_injection(&self) {
        self.lock().injection = None;
    }

    /// An empty Vec with capacity for at least `len` f32s, from the cache or
    /// the OS. `checked`: subject to the budget and injected faults.
    pub(crate) fn alloc(&self, len: usize, checked: bool) -> Result<Vec<f32>> {
        if len == 0 {
            return Ok(Vec::new());
        }
        let requested = len as u64 * F32_BYTES;
        let class = class_bytes(requested);
        let mut freed = Vec::new();
        {
            let mut g = self.lock();
            if checked && g.injected_failure() {
                return Err(g.oom(class));
            }
            if let Some(block) = g.take_cached(class, len) {
                let s = &mut g.stats;
                s.in_use_bytes += cap_bytes(&block);
                s.allocations += 1;
                s.cache_hits += 1;
                g.note_peaks();
                return Ok(block);
            }
            if checked {
                let fitted = g.fit(class, &mut freed);
                if let Err(e) = fitted {
                    drop(g);
                    drop(freed);
                    return Err(e);
                }
            }
            let s = &mut g.stats;
            s.reserved_bytes += class;
            s.in_use_bytes += class;
            s.allocations += 1;
            s.cache_misses += 1;
            g.note_peaks();
        }
        drop(freed);
        // The OS allocation happens outside the lock, and only when it
        // leaves the headroom under the process's own limits for what
        // cannot fail softly (`address_space`); refused there, it is the
        // system's refusal, as the OS's own would be.
        let mut block: Vec<f32> = Vec::new();
        let got = if !checked || address_space::admits(class) {
            block
                .try_reserve_exact((class / F32_BYTES) as usize)
                .map_err(|_| ())
        } else {
            Err(())
        };
        let mut g = self.lock();
        match got {
            Ok(()) => {
                // reserve_exact may round up; account what we really hold.
                let actual = cap_bytes(&block);
                let s = &mut g.stats;
                s.reserved_bytes = s.reserved_bytes + actual - class;
                s.in_use_bytes = s.in_use_bytes + actual - class;
                g.note_peaks();
                Ok(block)
            }
            Err(_) => {
                let s = &mut g.stats;
                s.reserved_bytes -= class;
                s.in_use_bytes -= class;
                s.allocations -= 1;
                s.cache_misses -= 1;
                Err(g.refused_by_system(class))
            }
        }
    }

    /// Accounts a buffer allocated elsewhere that a tensor takes over.
    /// `checked`: subject to the budget and injected faults (on Err the
    /// caller still owns, and drops, the buffer).
    pub(crate) fn adopt(&self, buffer: &Vec<f32>, checked: bool) -> Result<()> {
        let bytes = cap_bytes(buffer);
        if bytes == 0 {
            return Ok(());
        }
        let mut freed = Vec::new();
        let result = {
            let mut g = self.lock();
            if checked && g.injected_failure() {
                Err(g.oom(bytes))
            } else {
                // An idle cached block of the class this buffer will be
                // cached in is redundant from now on.
                if let Some(class) = floor_class(bytes) {
                    if let Some(idle) = g.bins.get_mut(&class).and_then(Vec::pop) {
                        g.stats.reserved_bytes -= cap_bytes(&idle);
                        freed.push(idle);
                    }
                }
                let fitted = if checked {
                    g.fit(bytes, &mut freed)
                } else {
                    Ok(())
                };
                fitted.map(|()| {
                    let s = &mut g.stats;
                    s.reserved_bytes += bytes;
                    s.in_use_bytes += bytes;
                    s.allocations += 1;
                    s.cache_misses += 1;
                    g.note_peaks();
                })
            }
        };
        drop(freed);
        result
    }

    /// Takes back a tensor's buffer: cached for reuse, or freed if too small
    /// to cache or if the reserve is over the limit.
    pub(crate) fn release(&self, mut buffer: Vec<f32>) {
        let bytes = cap_bytes(&buffer);
        if bytes == 0 {
            return;
        }
        buffer.clear();
        let mut g = self.lock();
        g.stats.in_use_bytes -= bytes;
        let over = g.limit.is_some_and(|l| g.stats.reserved_bytes > l);
        match floor_class(bytes) {
            Some(class) if !over => g.bins.entry(class).or_default().push(buffer),
            _ => {
                g.stats.reserved_bytes -= bytes;
                drop(g);
                drop(buffer);
            }
        }
    }

    /// Forgets a buffer that leaves the pool's care (`Tensor::into_vec`).
    pub(crate) fn detach(&self, buffer: &Vec<f32>) {
        let bytes = cap_bytes(buffer);
        if bytes == 0 {
            return;
        }
        let mut g = self.lock();
        g.stats.in_use_bytes -= bytes;
        g.stats.reserved_bytes -= bytes;
    }
}

/// A buffer of `len` elements' capacity for layer scratch outside the pool
/// (a kernel's output before a tensor adopts it, transposed weights,
/// per-thread partials): `ModelError::OutOfMemory` when the OS refuses,
/// which the out-of-memory policy handles, instead of the abort an
/// infallible `Vec` allocation would be. Like a pool block, it is refused when it would leave less than the
/// headroom under the process's limits (`address_space`).
pub fn try_scratch<T>(len: usize) -> Result<Vec<T>> {
    let mut buffer = Vec::new();
    let bytes = (len as u64).saturating_mul(std::mem::size_of::<T>() as u64);
    let got = if address_space::admits(bytes) {
        buffer.try_reserve_exact(len).map_err(|_| ())
    } else {
        Err(())
    };
    match got {
        Ok(()) => Ok(buffer),
        Err(()) => {
            let pool = current(Device::Cpu);
            let mut g = pool.lock();
            Err(g.refused_by_system((len * std::mem::size_of::<T>()) as u64))
        }
    }
}

/// `len` zeros, fallibly (see `try_scratch`).
pub fn try_zeroed(len: usize) -> Result<Vec<f32>> {
    let mut buffer = try_scratch(len)?;
    buffer.resize(len, 0.0);
    Ok(buffer)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Tensor;

    /// A private pool, so that tests running in parallel threads (all on the
    /// process-wide pool otherwise) do not see each other's allocations.
    fn private() -> Arc<MemoryPool> {
        MemoryPool::new(Device::Cpu)
    }

    fn zeros(n: usize) -> Result<Tensor> {
        Tensor::try_zeros(&[n])
    }

    #[test]
    fn byte_figures_keep_a_unit_that_shows_them() {
        assert_eq!(bytes_text(0), "0 B");
        assert_eq!(bytes_text(1023), "1023 B");
        assert_eq!(bytes_text(10 << 10), "10.0 KiB");
        assert_eq!(bytes_text(3 << 19), "1.5 MiB");
        assert_eq!(bytes_text(5 << 29), "2.50 GiB");
        let refused = ModelError::OutOfMemory {
            requested: 4096,
            in_use: 512,
            reserved: 0,
            limit: Some(10 << 10),
        };
        let text = refused.to_string();
        assert!(
            text.contains(
                "a 4.0 KiB block did not fit (512 B in use, 0 B reserved, limit 10.0 KiB)"
            ),
            "{text}"
        );
    }

    #[test]
    fn stats_follow_a_sequence_of_allocations() {
        let pool = private();
        pool.scope(|| {
            let a = zeros(1000).unwrap(); // 4000 B -> 4096
            let b = zeros(64).unwrap(); // 256 B -> 256
            let s = pool.stats();
            assert_eq!((s.in_use_bytes, s.reserved_bytes), (4352, 4352));
            assert_eq!((s.allocations, s.cache_hits, s.cache_misses), (2, 0, 2));
            drop(a);
            let s = pool.stats();
            assert_eq!((s.in_use_bytes, s.reserved_bytes), (256, 4352));
            assert_eq!(s.cached_bytes(), 4096);
            // 3600 B rounds to the same 4096 class: the freed block is reused.
            let c = zeros(900).unwrap();
            let s = pool.stats();
            assert_eq!((s.in_use_bytes, s.reserved_bytes), (4352, 4352));
            assert_eq!((s.allocations, s.cache_hits, s.cache_misses), (3, 1, 2));
            // A different class misses.
            let d = zeros(2000).unwrap(); // 8000 B -> 8192
            let s = pool.stats();
            assert_eq!((s.in_use_bytes, s.reserved_bytes), (12544, 12544));
            assert_eq!((s.peak_in_use_bytes, s.peak_reserved_bytes), (12544, 12544));
            drop((b, c, d));
            let s = pool.stats();
            assert_eq!((s.in_use_bytes, s.reserved_bytes), (0, 12544));
            pool.reset_peak();
            let s = pool.stats();
            assert_eq!((s.peak_in_use_bytes, s.peak_reserved_bytes), (0, 12544));
            assert_eq!(s.oom_events, 0);
        });
    }

    #[test]
    fn freed_blocks_are_reused_and_stay_warm() {
        let pool = private();
        pool.scope(|| {
            let first = zeros(100_000).unwrap();
            let ptr = first.data().as_ptr();
            drop(first);
            for _ in 0..10 {
                let again = zeros(100_000).unwrap();
                assert_eq!(again.data().as_ptr(), ptr, "the same block comes back");
            }
            let s = pool.stats();
            assert_eq!((s.cache_hits, s.cache_misses), (10, 1));
            assert_eq!(s.reserved_bytes, class_bytes(400_000));
        });
    }

    #[test]
    fn a_refusal_by_the_system_under_a_budget_is_not_called_the_budgets() {
        let pool = private();
        // A budget far above anything the system can give: the block fits
        // it, and the allocator refuses it.
        pool.set_limit(Some(u64::MAX / 2));
        pool.scope(|| {
            let err = zeros(1 << 60).unwrap_err();
            match &err {
                ModelError::OutOfMemory { limit, .. } => assert_eq!(*limit, None, "{err}"),
                other => panic!("expected OutOfMemory, got {other:?}"),
            }
            let text = err.to_string();
            assert!(
                text.contains("refused by the system, not by a budget"),
                "{text}"
            );
            assert_eq!(pool.stats().in_use_bytes, 0, "nothing left accounted");
        });
        let err = try_scratch::<f32>(1 << 60).unwrap_err();
        assert!(
            matches!(err, ModelError::OutOfMemory { limit: None, .. }),
            "{err}"
        );
    }

    #[test]
    fn a_budget_refusal_is_an_error_with_the_figures_and_leaves_the_pool_consistent() {
        let pool = private();
        pool.set_limit(Some(10_000));
        assert_eq!(pool.limit(), Some(10_000));
        pool.scope(|| {
            let a = zeros(1000).unwrap(); // 4096
            let before = pool.stats();
            let err = zeros(1500).unwrap_err(); // 6000 B -> 6144: 10240 > 10000
            match err {
                ModelError::OutOfMemory {
                    requested,
                    in_use,
                    reserved,
                    limit,
                } => {
                    assert_eq!((requested, in_use, reserved), (6144, 4096, 4096));
                    assert_eq!(limit, Some(10_000));
                }
                other => panic!("expected OutOfMemory, got {other:?}"),
            }
            assert!(err_text(1500).contains("out of memory"));
            let after = pool.stats();
            assert_eq!(after.oom_events, 2);
            assert_eq!(
                PoolStats {
                    oom_events: 0,
                    ..after
                },
                before,
                "nothing else changed"
            );
            // What fits still works.
            let b = zeros(1200).unwrap(); // 4800 -> 5120 (+ 4096 ≤ 10000)
            assert!(pool.stats().reserved_bytes <= 10_000);
            drop((a, b));
            // With everything freed the big one fits: cached blocks are
            // released (largest first) to make room.
            let c = zeros(2000).unwrap(); // 8192
            let s = pool.stats();
            assert!(s.reserved_bytes <= 10_000, "{s:?}");
            assert_eq!(s.in_use_bytes, 8192);
            drop(c);
            // Copy-on-write and adoption are checked too.
            let big = zeros(2000).unwrap();
            let mut shared = big.clone();
            assert!(shared.try_data_mut().unwrap_err().is_out_of_memory());
            assert!(Tensor::from_vec(&[2000], vec![0.0; 2000])
                .unwrap_err()
                .is_out_of_memory());
            drop((big, shared));
            assert_eq!(pool.stats().in_use_bytes, 0);
        });
        // Removing the budget lets anything through again.
        pool.set_limit(None);
        pool.scope(|| zeros(100_000).unwrap());
    }

    fn err_text(n: usize) -> String {
        zeros(n)
            .map(|_| String::new())
            .unwrap_or_else(|e| e.to_string())
    }

    #[test]
    fn infallible_constructors_are_accounted_but_not_refused() {
        let pool = private();
        pool.set_limit(Some(1000));
        pool.scope(|| {
            let t = Tensor::zeros(&[1000]);
            let s = pool.stats();
            assert_eq!(s.in_use_bytes, 4096);
            assert!(s.reserved_bytes > 1000, "visible in the statistics");
            drop(t);
            // Over the limit, a freed block is not cached.
            assert_eq!(pool.stats().reserved_bytes, 0);
        });
    }

    #[test]
    fn empty_cache_releases_what_is_not_in_use() {
        let pool = private();
        pool.scope(|| {
            let keep = zeros(10_000).unwrap();
            drop(zeros(20_000).unwrap());
            drop(zeros(300).unwrap());
            let s = pool.stats();
            assert_eq!(
                s.reserved_bytes,
                class_bytes(40_000) + class_bytes(80_000) + 1280
            );
            let released = pool.empty_cache();
            assert_eq!(released, class_bytes(80_000) + 1280);
            let s = pool.stats();
            assert_eq!(s.reserved_bytes, class_bytes(40_000));
            assert_eq!(s.in_use_bytes, s.reserved_bytes);
            drop(keep);
            assert_eq!(pool.empty_cache(), class_bytes(40_000));
            assert_eq!(pool.stats().reserved_bytes, 0);
        });
    }

    #[test]
    fn lowering_the_limit_releases_cached_blocks() {
        let pool = private();
        pool.scope(|| {
            drop(zeros(10_000).unwrap());
            drop(zeros(1000).unwrap());
        });
        assert_eq!(pool.stats().reserved_bytes, class_bytes(40_000) + 4096);
        pool.set_limit(Some(5000));
        assert_eq!(pool.stats().reserved_bytes, 4096, "the largest went first");
    }

    #[test]
    fn adopted_buffers_are_accounted_and_reused() {
        let pool = private();
        pool.scope(|| {
            let v = vec![1.0f32; 3000]; // capacity 3000: 12000 B, bin 10240
            let t = Tensor::from_vec(&[3000], v).unwrap();
            let s = pool.stats();
            assert_eq!((s.in_use_bytes, s.reserved_bytes), (12_000, 12_000));
            let ptr = t.data().as_ptr();
            drop(t);
            assert_eq!(pool.stats().in_use_bytes, 0);
            // A request of the same length finds it although its class
            // (12288) is above the buffer's.
            let again = zeros(3000).unwrap();
            assert_eq!(again.data().as_ptr(), ptr);
            drop(again);
            // Adopting another buffer of that bin releases the idle one.
            let t = Tensor::from_vec(&[3000], vec![2.0; 3000]).unwrap();
            assert_eq!(pool.stats().reserved_bytes, 12_000);
            // into_vec hands the buffer back to the caller, out of the pool.
            let v = t.into_vec();
            assert_eq!(v.len(), 3000);
            let s = pool.stats();
            assert_eq!((s.in_use_bytes, s.reserved_bytes), (0, 0));
            // Tiny buffers are freed, not cached.
            drop(Tensor::from_vec(&[3], vec![1.0, 2.0, 3.0]).unwrap());
            assert_eq!(pool.stats().reserved_bytes, 0);
        });
    }

    #[test]
    fn injected_faults_fail_the_planned_allocation() {
        let pool = private();
        pool.scope(|| {
            pool.inject_oom(OomInjection::Nth(3));
            assert!(zeros(10).is_ok());
            assert!(
                Tensor::zeros(&[10]).len() == 10,
                "infallible ones do not count"
            );
            assert!(zeros(10).is_ok());
            let err = zeros(10).unwrap_err();
            assert!(matches!(
                err,
                ModelError::OutOfMemory {
                    requested: 256,
                    limit: None,
                    ..
                }
            ));
            assert!(zeros(10).is_ok(), "it fails once");
            pool.inject_oom(OomInjection::Next);
            assert!(
                Tensor::from_vec(&[1], vec![1.0]).is_err(),
                "adoption counts"
            );
            pool.inject_oom(OomInjection::Always);
            assert!(zeros(10).is_err());
            assert!(zeros(10).is_err());
            pool.clear_injection();
            assert!(zeros(10).is_ok());
            pool.inject_oom(OomInjection::Nth(2));
            pool.inject_oom(OomInjection::Nth(0));
            assert!(zeros(10).is_ok() && zeros(10).is_ok(), "Nth(0) clears");
            let s = pool.stats();
            assert_eq!(s.oom_events, 4);
            assert_eq!(s.in_use_bytes, 0, "refusals leak nothing");
        });
    }

    #[test]
    fn scopes_nest_and_route_only_this_thread() {
        let outer = private();
        let inner = private();
        outer.scope(|| {
            let a = zeros(100).unwrap();
            inner.scope(|| {
                let b = zeros(100).unwrap();
                // Another thread is not affected by this thread's scope.
                std::thread::scope(|s| {
                    s.spawn(|| drop(zeros(100).unwrap()));
                });
                drop(b);
            });
            let c = zeros(100).unwrap();
            drop((a, c));
        });
        assert_eq!(outer.stats().allocations, 2);
        assert_eq!(inner.stats().allocations, 1);
    }

    #[test]
    fn parallel_allocation_and_release_keep_the_books() {
        let pool = private();
        let threads = 8;
        let rounds = 500;
        std::thread::scope(|s| {
            for t in 0..threads {
                let pool = &pool;
                s.spawn(move || {
                    pool.scope(|| {
                        let mut live = Vec::new();
                        let mut x = t as u64 + 1;
                        for i in 0..rounds {
                            x = x
                                .wrapping_mul(6364136223846793005)
                                .wrapping_add(1442695040888963407);
                            let len = 1 + (x >> 40) as usize % 5000;
                            let mut t = zeros(len).unwrap();
                            t.data_mut()[len - 1] = i as f32;
                            live.push(t);
                            if live.len() > 4 {
                                // Free one of the older ones, sometimes on
                                // another thread.
                                let old = live.swap_remove((x >> 20) as usize % live.len());
                                assert!(old.data().iter().all(|v| v.is_finite()));
                                if i % 7 == 0 {
                                    std::thread::spawn(move || drop(old)).join().unwrap();
                                }
                            }
                        }
                    });
                });
            }
        });
        let s = pool.stats();
        assert_eq!(s.in_use_bytes, 0, "{s:?}");
        assert_eq!(s.allocations, (threads * rounds) as u64);
        assert_eq!(s.cache_hits + s.cache_misses, s.allocations);
        assert!(s.cache_hits > 0);
        assert!(s.peak_in_use_bytes <= s.peak_reserved_bytes);
        assert_eq!(pool.empty_cache(), s.reserved_bytes);
        assert_eq!(pool.stats().reserved_bytes, 0);
    }

    #[test]
    fn the_device_pool_is_process_wide_and_counts_tensors() {
        // Other tests allocate concurrently on the global pool: only
        // monotonic counters and our own live block can be asserted.
        let pool = Device::Cpu.pool();
        assert!(std::ptr::eq(pool, Device::Cpu.pool()));
        assert_eq!(pool.device(), Device::Cpu);
        let before = pool.stats().allocations;
        let t = Tensor::try_zeros(&[1 << 16]).unwrap();
        let s = pool.stats();
        assert!(s.allocations > before);
        assert!(s.in_use_bytes >= 1 << 18 && s.reserved_bytes >= s.in_use_bytes);
        assert!(s.peak_in_use_bytes >= s.in_use_bytes);
        drop(t);
        assert!(format!("{pool:?}").contains("MemoryPool"));
    }

    #[test]
    fn classes_round_up_with_four_per_power_of_two() {
        assert_eq!(class_bytes(1), 256);
        assert_eq!(class_bytes(256), 256);
        assert_eq!(class_bytes(257), 320);
        assert_eq!(class_bytes(320), 320);
        assert_eq!(class_bytes(321), 384);
        assert_eq!(class_bytes(448), 448);
        assert_eq!(class_bytes(449), 512);
        assert_eq!(class_bytes(513), 640);
        // The 28×28×32 activation at batch 128: 12.25 MiB -> 14 MiB.
        assert_eq!(class_bytes(128 * 28 * 28 * 32 * 4), 14 << 20);
        let mut prev = 0;
        for b in 1..100_000u64 {
            let c = class_bytes(b);
            assert!(c >= b && c >= prev);
            assert!(b <= 256 || (c - b) * 4 < b, "{b} -> {c}");
            assert_eq!(class_bytes(c), c, "a class is its own class");
            assert_eq!(floor_class(c), Some(c));
            let f = floor_class(b.max(256)).unwrap();
            assert!(f <= b.max(256) && class_bytes(f) == f);
            prev = c;
        }
        assert_eq!(floor_class(255), None);
        assert_eq!(floor_class(300), Some(256));
    }

    #[test]
    fn injection_plans_count_fallible_allocations() {
        let pool = MemoryPool::new(Device::Cpu);
        pool.inject_oom(OomInjection::Nth(3));
        assert!(pool.alloc(10, true).is_ok());
        assert!(
            pool.alloc(10, false).is_ok(),
            "infallible ones do not count"
        );
        assert!(pool.alloc(10, true).is_ok());
        assert!(pool.alloc(10, true).is_err());
        assert!(pool.alloc(10, true).is_ok(), "it fails once");
        pool.inject_oom(OomInjection::Always);
        assert!(pool.alloc(10, true).is_err());
        assert!(pool.alloc(10, true).is_err());
        pool.clear_injection();
        assert!(pool.alloc(10, true).is_ok());
        assert_eq!(pool.stats().oom_events, 3);
    }
}
