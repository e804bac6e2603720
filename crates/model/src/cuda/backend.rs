//! The CUDA device: probing, and `CudaBackend`, which holds the context, a
//! compute stream and a copy stream, the cuBLAS handle, the kernel module
//! cache and the device-memory accounting.

use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::cublas::CudaBlas;
use cudarc::driver::{
    result as driver, sys, CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, CudaView,
    DevicePtr, DeviceRepr, ValidAsZeroBits,
};
use cudarc::nvrtc::Ptx;

use super::dtype::HalfFormat;
use super::error::{alloc_error, Context};
use super::kernels::{self, KernelSig, Target};
use super::profile::Profiler;
use super::{arch, libs, CudaError, CudaResult};
use crate::profile::ProfileSegment;

/// What `CudaBackend::probe` reports about a GPU.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    pub ordinal: usize,
    pub name: String,
    /// Bytes.
    pub total_memory: u64,
    /// Bytes free when probed (other processes' use included).
    pub free_memory: u64,
    /// (major, minor), e.g. (9, 0) for an H100.
    pub compute_capability: (u32, u32),
    /// The CUDA version the driver supports, (major, minor), e.g. (13, 0).
    pub driver_version: (u32, u32),
    pub multiprocessors: u32,
}

impl DeviceInfo {
    /// Compute capability as major×10 + minor (90 for 9.0).
    pub fn arch(&self) -> u32 {
        self.compute_capability.0 * 10 + self.compute_capability.1
    }

    /// The driver's CUDA version in `cuDriverGetVersion`'s form (12040).
    pub fn driver_code(&self) -> i32 {
        (self.driver_version.0 * 1000 + self.driver_version.1 * 10) as i32
    }
}

impl std::fmt::Display for DeviceInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        write!(
            f,
            "cuda:{} {} (sm_{}, {} SMs, {:.1} GiB, {:.1} GiB free, driver CUDA {}.{})",
            self.ordinal,
            self.name,
            self.arch(),
            self.multiprocessors,
            gib(self.total_memory),
            gib(self.free_memory),
            self.driver_version.0,
            self.driver_version.1
        )
    }
}

/// "cuda" if a usable GPU is found, else "cpu". Never panics.
pub fn auto_device_kind() -> &'static str {
    match CudaBackend::probe() {
        Ok(Some(_)) => "cuda",
        _ => "cpu",
    }
}

/// Live device memory held by CUDA tensors, with an optional budget. Reuse of
/// freed memory is the driver's stream-ordered pool (cuMemAllocAsync), which
/// the backend tells to keep what is freed (release threshold = max) so that
/// the steady state of training allocates nothing from the OS, like the CPU
/// pool; `CudaBackend::empty_cache` trims it.
#[derive(Debug, Default)]
pub struct DeviceMemory {
    inner: Mutex<MemInner>,
}

#[derive(Debug, Default)]
struct MemInner {
    in_use: u64,
    peak: u64,
    /// The most in use since `begin_watermark`.
    watermark: u64,
    limit: Option<u64>,
    allocations: u64,
    oom_events: u64,
}

/// A snapshot of the device-memory statistics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceMemoryStats {
    /// Bytes held by live CUDA tensors and buffers.
    pub in_use_bytes: u64,
    pub peak_in_use_bytes: u64,
    /// Bytes the driver's pool holds (in use + cached); 0 when the device
    /// has no stream-ordered allocator.
    pub reserved_bytes: u64,
    pub limit: Option<u64>,
    pub allocations: u64,
    pub oom_events: u64,
}

impl DeviceMemory {
    fn lock(&self) -> MutexGuard<'_, MemInner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Accounts `bytes`, or refuses past the budget. The peak counts them
    /// only once they are held (`note_held`): a reservation the driver then
    /// refuses never held memory.
    fn reserve(self: &Arc<Self>, bytes: u64) -> CudaResult<Lease> {
        let mut m = self.lock();
        if let Some(limit) = m.limit {
            if m.in_use.saturating_add(bytes) > limit {
                m.oom_events += 1;
                return Err(CudaError::OutOfMemory {
                    requested: bytes,
                    in_use: m.in_use,
                    limit: Some(limit),
                });
            }
        }
        m.in_use += bytes;
        Ok(Lease {
            bytes,
            memory: Arc::clone(self),
        })
    }

    /// A reservation now holds device memory.
    fn note_held(&self) {
        let mut m = self.lock();
        m.peak = m.peak.max(m.in_use);
        m.watermark = m.watermark.max(m.in_use);
        m.allocations += 1;
    }

    fn note_oom(&self) -> u64 {
        let mut m = self.lock();
        m.oom_events += 1;
        m.in_use
    }
}

/// The accounting of one allocation; gives its bytes back when dropped.
#[derive(Debug)]
pub struct Lease {
    bytes: u64,
    memory: Arc<DeviceMemory>,
}

impl Lease {
    /// The bytes this lease accounts.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let mut m = self.memory.lock();
        m.in_use = m.in_use.saturating_sub(self.bytes);
    }
}

/// A device buffer with its memory accounting.
#[derive(Debug)]
pub struct DeviceBuffer<T> {
    pub slice: CudaSlice<T>,
    _lease: Lease,
}

impl<T> DeviceBuffer<T> {
    pub fn len(&self) -> usize {
        self.slice.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slice.len() == 0
    }
}

impl<T> std::ops::Deref for DeviceBuffer<T> {
    type Target = CudaSlice<T>;
    fn deref(&self) -> &CudaSlice<T> {
        &self.slice
    }
}

impl<T> std::ops::DerefMut for DeviceBuffer<T> {
    fn deref_mut(&mut self) -> &mut CudaSlice<T> {
        &mut self.slice
    }
}

/// The driver's default memory pool of the device (a driver handle, usable
/// from any thread).
#[derive(Clone, Copy, Debug)]
struct MemPool(sys::CUmemoryPool);

// SAFETY: a CUmemoryPool is a driver object handle; the driver API may be
// called with it from any thread.
unsafe impl Send for MemPool {}
// SAFETY: as above; we never mutate the handle itself.
unsafe impl Sync for MemPool {}

/// One GPU: context, streams, cuBLAS, compiled kernels, memory accounting.
pub struct CudaBackend {
    info: DeviceInfo,
    target: Target,
    /// The encoding of every `DType::F16` buffer and of the kernels'
    /// 2-byte storage, fixed for the backend's life.
    half: HalfFormat,
    ctx: Arc<CudaContext>,
    compute: Arc<CudaStream>,
    copy: Arc<CudaStream>,
    blas: CudaBlas,
    /// The workspace cuBLAS is given (`set_memory_limit` sizes it); after
    /// `blas`, so the handle is destroyed before the memory is freed.
    blas_workspace: Mutex<Option<DeviceBuffer<u8>>>,
    modules: Mutex<HashMap<&'static str, Arc<CudaModule>>>,
    functions: Mutex<HashMap<&'static str, CudaFunction>>,
    memory: Arc<DeviceMemory>,
    pool: Option<MemPool>,
    profiler: Profiler,
    /// State an op family keeps per device, one value per type (e.g. the
    /// convolutions' tuning table, ops/conv_tune.rs): the backend holds it
    /// without naming the families, so they depend on it and not back.
    op_state: Mutex<HashMap<TypeId, Arc<dyn Any + Send + Sync>>>,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend")
            .field("info", &self.info)
            .field("target", &self.target)
            .field("half", &self.half)
            .finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into())
}

/// cuBLAS's workspace: NVIDIA's recommendation (32 MiB on Hopper and
/// newer, 4 MiB before), but at most 1/32 of a tensor budget (and at least
/// 64 KiB), so that a small budget keeps its room for tensors (cuBLAS then
/// picks algorithms that need less). Fixed by the device and budget alone,
/// so a run and its resumption, eager steps and graph replays, get the
/// same algorithms.
pub fn blas_workspace_bytes(arch: u32, limit: Option<u64>) -> u64 {
    let recommended: u64 = if arch >= 90 { 32 << 20 } else { 4 << 20 };
    let cap = limit.map_or(u64::MAX, |l| l / 32 / 256 * 256);
    recommended.min(cap).max(64 << 10)
}

impl CudaBackend {
    /// Looks for GPU 0. `Ok(None)` when there is no CUDA driver library or
    /// no GPU; `Err` when a driver is there but cannot be used (too old, a
    /// broken installation), with the driver's reason. Never panics: the
    /// driver library is checked for before any call into it, and a panic
    /// inside cudarc (a symbol missing from an old driver) is caught and
    /// returned as an error.
    pub fn probe() -> CudaResult<Option<DeviceInfo>> {
        Self::probe_device(0)
    }

    /// `probe` for GPU `ordinal`.
    pub fn probe_device(ordinal: usize) -> CudaResult<Option<DeviceInfo>> {
        if !libs::driver_present() {
            return Ok(None);
        }
        std::panic::catch_unwind(|| probe_inner(ordinal)).unwrap_or_else(|p| {
            Err(CudaError::Unavailable(format!(
                "the CUDA driver library panicked while probing: {}",
                panic_message(p.as_ref())
            )))
        })
    }

    /// Opens GPU `ordinal`: context, streams, cuBLAS, and the kernel target
    /// (NVRTC must be loadable; kernels themselves compile on first use).
    pub fn new(ordinal: usize) -> CudaResult<Self> {
        Self::with_half(ordinal, HalfFormat::F16)
    }

    /// As `new`, with the 2-byte activations and compute weights stored in
    /// `half`'s format (every kernel file compiled for it). bf16 on a GPU
    /// older than sm_80 is refused, naming the GPU.
    pub fn with_half(ordinal: usize, half: HalfFormat) -> CudaResult<Self> {
        let Some(info) = Self::probe_device(ordinal)? else {
            return Err(CudaError::Unavailable(format!(
                "no CUDA driver or no GPU {ordinal}"
            )));
        };
        if half == HalfFormat::Bf16 && !arch::ArchFeatures::of(info.arch()).mma_bf16 {
            return Err(CudaError::Unsupported {
                op: "device.precision",
                reason: format!(
                    "{half} needs a GPU of compute capability {}.{} or newer (its conversions \
                     and tensor-core products); GPU {ordinal}, {}, is sm_{}: use \
                     device.precision = \"f16\" or \"f32\"",
                    half.min_arch() / 10,
                    half.min_arch() % 10,
                    info.name,
                    info.arch()
                ),
            });
        }
        libs::ensure_nvrtc()?;
        libs::ensure_cublas()?;
        let target = kernels::target_for(info.arch())?;
        arch::check_nvrtc_for_driver(kernels::nvrtc_version()?, info.driver_code(), target)?;
        std::panic::catch_unwind(move || Self::open(info, target, half)).unwrap_or_else(|p| {
            Err(CudaError::Unavailable(format!(
                "a CUDA library panicked while opening the device: {}",
                panic_message(p.as_ref())
            )))
        })
    }

    fn open(info: DeviceInfo, target: Target, half: HalfFormat) -> CudaResult<Self> {
        let ctx = CudaContext::new(info.ordinal).during("cuDevicePrimaryCtxRetain")?;
        // cudarc's event tracking is off: it would record an event after, and
        // wait on one before, every use of every buffer (host work on each
        // kernel argument), and a captured step (`StepGraph`) must not wait
        // on events recorded outside its capture. Every kernel, GEMM,
        // allocation and free runs on the compute stream, in stream order;
        // the one thing on the other stream, the staging ring's copies, is
        // ordered by the ring's own events.
        // SAFETY: set before this context has any buffer.
        unsafe { ctx.disable_event_tracking() };
        // Non-blocking streams: neither synchronises with the legacy default
        // stream.
        let compute = ctx.new_stream().during("cuStreamCreate (compute)")?;
        let copy = ctx.new_stream().during("cuStreamCreate (copy)")?;
        let blas = CudaBlas::new(Arc::clone(&compute)).during("cublasCreate")?;
        let pool = if ctx.has_async_alloc() {
            // SAFETY: the device handle comes from the live context.
            let pool = unsafe { driver::device::get_default_mem_pool(ctx.cu_device()) }
                .during("cuDeviceGetDefaultMemPool")?;
            let mut threshold = u64::MAX;
            // SAFETY: RELEASE_THRESHOLD takes a u64 (cuuint64_t) by pointer.
            unsafe {
                sys::cuMemPoolSetAttribute(
                    pool,
                    sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                    &mut threshold as *mut u64 as *mut std::ffi::c_void,
                )
            }
            .result()
            .during("cuMemPoolSetAttribute")?;
            Some(MemPool(pool))
        } else {
            None
        };
        let backend = Self {
            info,
            target,
            half,
            ctx,
            compute,
            copy,
            blas,
            blas_workspace: Mutex::new(None),
            modules: Mutex::new(HashMap::new()),
            functions: Mutex::new(HashMap::new()),
            memory: Arc::new(DeviceMemory::default()),
            pool,
            profiler: Profiler::default(),
            op_state: Mutex::new(HashMap::new()),
        };
        backend.size_blas_workspace(None)?;
        Ok(backend)
    }

    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// This device's `T`, made with `T::default()` on first use (see
    /// `op_state`).
    pub(crate) fn op_state<T: Any + Default + Send + Sync>(&self) -> Arc<T> {
        let mut states = self.op_state.lock().unwrap_or_else(|p| p.into_inner());
        let state = states
            .entry(TypeId::of::<T>())
            .or_insert_with(|| Arc::new(T::default()));
        match Arc::clone(state).downcast::<T>() {
            Ok(state) => state,
            Err(_) => unreachable!("op_state holds each value under its own type's id"),
        }
    }

    /// Starts timing the compute stream's work between marks (see
    /// `profile`); the caller keeps graph captures out of it.
    pub fn profile_start(&self) -> CudaResult<()> {
        self.profiler.start(&self.compute)
    }

    /// Ends a segment of the running profile, if one runs; `label` is only
    /// called then.
    pub fn profile_mark(&self, label: impl FnOnce() -> String) -> CudaResult<()> {
        self.profiler.mark(&self.compute, label)
    }

    /// Stops the profile and returns its segments.
    pub fn profile_finish(&self) -> CudaResult<Vec<ProfileSegment>> {
        self.profiler.finish()
    }

    /// What the kernels are compiled for on this device.
    pub fn target(&self) -> Target {
        self.target
    }

    /// The encoding of this backend's 2-byte storage (`DType::F16`).
    pub fn half(&self) -> HalfFormat {
        self.half
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The stream every kernel and GEMM runs on.
    pub fn compute_stream(&self) -> &Arc<CudaStream> {
        &self.compute
    }

    /// The stream host→device copies of input batches run on.
    pub fn copy_stream(&self) -> &Arc<CudaStream> {
        &self.copy
    }

    pub(crate) fn blas(&self) -> &CudaBlas {
        &self.blas
    }

    /// Waits for all work queued on the compute stream.
    pub fn synchronize(&self) -> CudaResult<()> {
        self.compute.synchronize().during("cuStreamSynchronize")
    }

    /// The kernel `sig`, compiling (or reading from the disk cache) its file
    /// on first use.
    pub fn function(&self, sig: &KernelSig) -> CudaResult<CudaFunction> {
        if let Some(f) = lock(&self.functions).get(sig.name) {
            return Ok(f.clone());
        }
        let module = self.module(sig.file)?;
        let f = module
            .load_function(sig.name)
            .during("cuModuleGetFunction")?;
        lock(&self.functions).insert(sig.name, f.clone());
        Ok(f)
    }

    fn module(&self, file: &'static str) -> CudaResult<Arc<CudaModule>> {
        let mut modules = lock(&self.modules);
        if let Some(m) = modules.get(file) {
            return Ok(Arc::clone(m));
        }
        let kf = kernels::FILES
            .iter()
            .find(|f| f.name == file)
            .ok_or_else(|| CudaError::Unsupported {
                op: "kernel lookup",
                reason: format!("no kernel file {file}.cu"),
            })?;
        let image = kernels::load_or_compile(kf, self.target, self.half)?;
        let module = match self.load_image(image) {
            Ok(m) => m,
            // A stale or damaged cache entry: compile afresh once.
            Err(_) => self.load_image(kernels::compile_half(kf, self.target, self.half)?)?,
        };
        modules.insert(file, Arc::clone(&module));
        Ok(module)
    }

    fn load_image(&self, image: Vec<u8>) -> CudaResult<Arc<CudaModule>> {
        let ptx = match self.target {
            Target::Cubin(_) => Ptx::from_binary(image),
            Target::Ptx(_) => Ptx::from_src(String::from_utf8_lossy(&image).replace('\0', "")),
        };
        self.ctx.load_module(ptx).during("cuModuleLoadData")
    }

    /// A device buffer of `len` elements on the compute stream, accounted in
    /// the budget; its contents are unspecified until written. Out of memory
    /// (budget or driver) is `CudaError::OutOfMemory`; on a driver refusal
    /// the pool's cache is trimmed and the allocation retried once.
    pub fn alloc<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        len: usize,
    ) -> CudaResult<DeviceBuffer<T>> {
        let bytes = (len as u64).saturating_mul(std::mem::size_of::<T>() as u64);
        let lease = self.memory.reserve(bytes)?;
        // SAFETY: the memory is uninitialised, but T is a plain number type
        // for which every bit pattern is a value (ValidAsZeroBits: u8, u32,
        // f16, f32, f64, StepState); every kernel and copy writes before the
        // host can read.
        let first = unsafe { self.compute.alloc::<T>(len) };
        let slice = match first {
            Ok(s) => s,
            Err(e) if e.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => {
                self.empty_cache()?;
                // SAFETY: as above.
                match unsafe { self.compute.alloc::<T>(len) } {
                    Ok(s) => s,
                    Err(e) => {
                        // In use before this refused request.
                        let in_use = self.memory.note_oom().saturating_sub(bytes);
                        return Err(alloc_error(e, bytes, in_use));
                    }
                }
            }
            Err(e) => {
                let in_use = self.memory.lock().in_use.saturating_sub(bytes);
                return Err(alloc_error(e, bytes, in_use));
            }
        };
        self.memory.note_held();
        Ok(DeviceBuffer {
            slice,
            _lease: lease,
        })
    }

    /// `alloc` followed by a memset to zero on the compute stream.
    pub fn alloc_zeros<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        len: usize,
    ) -> CudaResult<DeviceBuffer<T>> {
        let mut buf = self.alloc::<T>(len)?;
        if len > 0 {
            self.compute
                .memset_zeros(&mut buf.slice)
                .during("cuMemsetD8Async")?;
        }
        Ok(buf)
    }

    /// Copies host data into a new accounted device buffer (compute stream).
    pub fn upload<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        data: &[T],
    ) -> CudaResult<DeviceBuffer<T>> {
        let mut buf = self.alloc::<T>(data.len())?;
        if !data.is_empty() {
            self.compute
                .memcpy_htod(data, &mut buf.slice)
                .during("cuMemcpyHtoDAsync")?;
        }
        Ok(buf)
    }

    /// Copies `from` into `to` (same length) on the compute stream.
    pub fn copy_device<T: DeviceRepr>(
        &self,
        from: &DeviceBuffer<T>,
        to: &mut DeviceBuffer<T>,
    ) -> CudaResult<()> {
        self.compute
            .memcpy_dtod(&from.slice, &mut to.slice)
            .during("cuMemcpyDtoDAsync")
    }

    /// Copies a device buffer to the host, waiting for the compute stream.
    pub fn download<T: DeviceRepr + ValidAsZeroBits + Clone + Default>(
        &self,
        src: &CudaSlice<T>,
    ) -> CudaResult<Vec<T>> {
        let out = self.compute.clone_dtoh(src).during("cuMemcpyDtoHAsync")?;
        self.synchronize()?;
        Ok(out)
    }

    /// Copies `src` into `dst` (same length) on the host, waiting for the
    /// compute stream: a download into memory the caller already has.
    pub fn download_into<T: DeviceRepr>(
        &self,
        src: &CudaView<'_, T>,
        dst: &mut [T],
    ) -> CudaResult<()> {
        self.compute
            .memcpy_dtoh(src, dst)
            .during("cuMemcpyDtoHAsync")?;
        self.synchronize()
    }

    /// Sets the budget on bytes held by live CUDA buffers (None: the GPU's
    /// size) and sizes cuBLAS's workspace to it
    /// (`blas_workspace_bytes`). Call it before any GEMM is captured into a
    /// graph: a capture must use the workspace its replays will find.
    pub fn set_memory_limit(&self, limit: Option<u64>) -> CudaResult<()> {
        self.memory.lock().limit = limit;
        self.size_blas_workspace(limit)
    }

    /// Gives cuBLAS a workspace of `blas_workspace_bytes(arch, limit)` from
    /// the accounted memory (the old one, if any, is freed in stream order
    /// after the GEMMs that used it). Left to itself cuBLAS allocates its
    /// own outside the budget and the peak figures, and a new one in every
    /// graph capture.
    fn size_blas_workspace(&self, limit: Option<u64>) -> CudaResult<()> {
        let bytes = blas_workspace_bytes(self.info.arch(), limit);
        let mut current = lock(&self.blas_workspace);
        if current.as_ref().map(|w| w.len() as u64) == Some(bytes) {
            return Ok(());
        }
        // cuBLAS lets go of the old workspace before it is freed (so that a
        // tight budget has room for the new one, and a refused allocation
        // leaves cuBLAS with none rather than a freed one).
        self.give_blas_workspace(0, 0)?;
        *current = None;
        let workspace = self.alloc::<u8>(bytes as usize)?;
        // Event tracking is off: the guard records nothing.
        self.give_blas_workspace(workspace.slice.device_ptr(&self.compute).0, bytes)?;
        *current = Some(workspace);
        Ok(())
    }

    /// `cublasSetWorkspace` with `bytes` at device address `ptr` (0 and 0:
    /// none).
    fn give_blas_workspace(&self, ptr: u64, bytes: u64) -> CudaResult<()> {
        // SAFETY: the handle is live (self.blas). The memory at `ptr` is the
        // `bytes` of a 256-byte aligned buffer that `blas_workspace` holds
        // until cuBLAS is given another or the handle is destroyed (it is
        // dropped after `blas`); the old one is freed in stream order after
        // the GEMMs that used it, on the handle's stream.
        unsafe {
            cudarc::cublas::sys::cublasSetWorkspace_v2(
                *self.blas.handle(),
                ptr as *mut std::ffi::c_void,
                bytes as usize,
            )
        }
        .result()
        .during("cublasSetWorkspace")
    }

    pub fn memory_stats(&self) -> DeviceMemoryStats {
        let reserved = self.pool.map_or(0, |pool| {
            let mut value = 0u64;
            // SAFETY: RESERVED_MEM_CURRENT writes a u64 (cuuint64_t).
            let r = unsafe {
                sys::cuMemPoolGetAttribute(
                    pool.0,
                    sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT,
                    &mut value as *mut u64 as *mut std::ffi::c_void,
                )
            };
            if r == sys::CUresult::CUDA_SUCCESS {
                value
            } else {
                0
            }
        });
        let m = self.memory.lock();
        DeviceMemoryStats {
            in_use_bytes: m.in_use,
            peak_in_use_bytes: m.peak,
            reserved_bytes: reserved,
            limit: m.limit,
            allocations: m.allocations,
            oom_events: m.oom_events,
        }
    }

    /// Accounts `bytes` of device memory that no buffer of ours holds (a
    /// captured graph's working set), or refuses past the budget like an
    /// allocation; given back when the lease drops.
    pub(crate) fn hold(&self, bytes: u64) -> CudaResult<Lease> {
        let lease = self.memory.reserve(bytes)?;
        self.memory.note_held();
        Ok(lease)
    }

    /// Starts measuring the most bytes in use from now; returns the bytes
    /// in use now.
    pub(crate) fn begin_watermark(&self) -> u64 {
        let mut m = self.memory.lock();
        m.watermark = m.in_use;
        m.in_use
    }

    /// The most bytes in use since `begin_watermark`.
    pub(crate) fn watermark(&self) -> u64 {
        self.memory.lock().watermark
    }

    /// Resets the peak to the current use.
    pub fn reset_peak(&self) {
        let mut m = self.memory.lock();
        m.peak = m.in_use;
    }

    /// Waits for both streams, then returns the pool's cached (freed, not in
    /// use) memory, and what destroyed graphs held, to the driver.
    pub fn empty_cache(&self) -> CudaResult<()> {
        self.compute.synchronize().during("cuStreamSynchronize")?;
        self.copy.synchronize().during("cuStreamSynchronize")?;
        if let Some(pool) = self.pool {
            // SAFETY: the pool handle is the device's default pool.
            unsafe { sys::cuMemPoolTrimTo(pool.0, 0) }
                .result()
                .during("cuMemPoolTrimTo")?;
            // The memory of destroyed CUDA graphs, which the driver keeps
            // apart from the pool.
            // SAFETY: the device handle comes from the live context.
            unsafe { sys::cuDeviceGraphMemTrim(self.ctx.cu_device()) }
                .result()
                .during("cuDeviceGraphMemTrim")?;
        }
        Ok(())
    }
}

/// The CUDA version the driver supports, in `cuDriverGetVersion`'s form
/// (12040 for 12.4); callable before `cuInit`.
pub(crate) fn driver_version() -> CudaResult<i32> {
    let mut version = 0i32;
    // SAFETY: the driver library is loaded (callers checked
    // `libs::driver_present`); the call writes one int.
    unsafe { sys::cuDriverGetVersion(&mut version) }
        .result()
        .during("cuDriverGetVersion")?;
    Ok(version)
}

/// The time between two recorded events, in milliseconds, after waiting
/// for both. cudarc's `cuda-13000` bindings call `cuEventElapsedTime_v2`,
/// which drivers before CUDA 12.8 lack (cudarc would panic on the missing
/// symbol); there the original entry point, same arguments, is called.
pub(crate) fn event_elapsed_ms(
    from: &cudarc::driver::CudaEvent,
    to: &cudarc::driver::CudaEvent,
) -> CudaResult<f32> {
    if driver_version()? >= arch::EVENT_ELAPSED_V2_DRIVER {
        return from.elapsed_ms(to).during("cuEventElapsedTime_v2");
    }
    from.synchronize().during("cuEventSynchronize")?;
    to.synchronize().during("cuEventSynchronize")?;
    type ElapsedFn = unsafe extern "C" fn(*mut f32, sys::CUevent, sys::CUevent) -> sys::CUresult;
    // SAFETY: the driver library is loaded (an event exists); the symbol
    // is the driver API's cuEventElapsedTime, whose C signature is
    // `CUresult (float*, CUevent, CUevent)`.
    let elapsed =
        unsafe { sys::culib().get::<ElapsedFn>(b"cuEventElapsedTime\0") }.map_err(|e| {
            CudaError::Unavailable(format!("the driver has no cuEventElapsedTime: {e}"))
        })?;
    let mut ms = 0f32;
    // SAFETY: both events are live, recorded and complete (waited for
    // above); the call writes one float. cudarc binds a context to the
    // thread before each of its calls, and the events' own synchronize did.
    unsafe { elapsed(&mut ms, from.cu_event(), to.cu_event()) }
        .result()
        .during("cuEventElapsedTime")?;
    Ok(ms)
}

fn probe_inner(ordinal: usize) -> CudaResult<Option<DeviceInfo>> {
    // Before cuInit: a driver too old for this build is refused by name
    // even where cuInit itself would fail.
    let version = driver_version()?;
    arch::check_driver(version)?;
    match driver::init() {
        Ok(()) => {}
        Err(e) if e.0 == sys::CUresult::CUDA_ERROR_NO_DEVICE => return Ok(None),
        Err(e) => {
            return Err(CudaError::Unavailable(format!(
                "cuInit failed: {e} (driver for CUDA {})",
                arch::version_text(version)
            )))
        }
    }
    let count = driver::device::get_count().during("cuDeviceGetCount")?;
    if count <= 0 || ordinal >= count as usize {
        return Ok(None);
    }
    let dev = driver::device::get(ordinal as i32).during("cuDeviceGet")?;
    let name = driver::device::get_name(dev).during("cuDeviceGetName")?;
    let attr = |a| {
        // SAFETY: `dev` was returned by cuDeviceGet.
        unsafe { driver::device::get_attribute(dev, a) }.during("cuDeviceGetAttribute")
    };
    use sys::CUdevice_attribute::*;
    let major = attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
    let minor = attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
    let sms = attr(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
    // Free memory needs a context: retain the primary one briefly.
    let ctx = CudaContext::new(ordinal).during("cuDevicePrimaryCtxRetain")?;
    let (free, total) = ctx.mem_get_info().during("cuMemGetInfo")?;
    drop(ctx);
    Ok(Some(DeviceInfo {
        ordinal,
        name,
        total_memory: total as u64,
        free_memory: free as u64,
        compute_capability: (major.max(0) as u32, minor.max(0) as u32),
        driver_version: (
            (version / 1000).max(0) as u32,
            ((version % 1000) / 10).max(0) as u32,
        ),
        multiprocessors: sms.max(0) as u32,
    }))
}

// One backend is shared by the threads of a run.
const _: fn() = || {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<CudaBackend>();
};
