//! A thin, safe layer over the CUDA driver API (cudarc's raw `sys` bindings,
//! loaded at run time). Every call's status is checked and turned into an
//! [`Error`]; resources are RAII types. The library is probed before first
//! use, because cudarc panics when libcuda is missing.

// Stream and other handles are opaque: passed to the driver (which
// validates them), never dereferenced here.
#![allow(clippy::not_unsafe_ptr_arg_deref)]

use crate::error::{Error, KvswapStatus, Result};
use cudarc::driver::sys;
use std::ffi::{c_void, CStr};
use std::sync::OnceLock;

pub use sys::{CUcontext, CUdevice, CUdeviceptr, CUfunction, CUstream};

/// A kernel's parameter array for `cuLaunchKernel`: one pointer per local
/// holding an argument's value, in the kernel's parameter order. The locals
/// must outlive the launch call.
macro_rules! kernel_params {
    ($($arg:ident),+ $(,)?) => {
        [$(&mut $arg as *mut _ as *mut ::std::ffi::c_void),+]
    };
}
pub(crate) use kernel_params;

/// Converts a driver status into a kvswap error that names the call.
pub fn check(r: sys::CUresult, what: &str) -> Result<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    let mut name: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: cuGetErrorName writes a static string pointer or leaves it NULL.
    unsafe { sys::cuGetErrorName(r, &mut name) };
    let name = if name.is_null() {
        format!("{r:?}")
    } else {
        // SAFETY: non-null pointers from cuGetErrorName are static C strings.
        unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned()
    };
    let status = match r {
        sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => KvswapStatus::OutOfMemory,
        sys::CUresult::CUDA_ERROR_NO_DEVICE | sys::CUresult::CUDA_ERROR_INVALID_DEVICE => KvswapStatus::NoDevice,
        _ => KvswapStatus::DeviceError,
    };
    Err(Error::new(status, format!("{what} failed: {name}")))
}

/// The oldest driver the CUDA backend runs on: CUDA 12.3, the first with
/// `cuStreamGetCaptureInfo_v3`.
/// cbindgen:ignore
pub const MIN_DRIVER_VERSION: i32 = 12030;

/// `KVSWAP_STATUS_UNSUPPORTED` below `MIN_DRIVER_VERSION` (every CUDA path
/// checks it before its first call that needs a newer symbol: cudarc panics
/// on a missing one), or when the NVRTC found is of a newer CUDA major
/// version than the driver (its CUBINs would not load).
/// `what`: the part of kvswap that needs it.
pub fn check_driver_version(what: &str) -> Result<()> {
    let v = driver_version();
    check_min_driver(v, MIN_DRIVER_VERSION, what)?;
    if super::nvrtc::available() {
        check_nvrtc_major(super::nvrtc::version()?, v, what)?;
    }
    Ok(())
}

/// The NVRTC (major, minor) against the driver's CUDA version `driver`: a
/// CUBIN of NVRTC major M needs a driver of major M or newer (CUDA's
/// minor-version compatibility holds within one major only).
pub fn check_nvrtc_major(nvrtc: (i32, i32), driver: i32, what: &str) -> Result<()> {
    if nvrtc.0 > driver / 1000 {
        return Err(Error::new(
            KvswapStatus::Unsupported,
            format!(
                "NVRTC {}.{} makes kernels for CUDA {} drivers, but the driver supports CUDA {}.{}: {what} cannot load them \
                 (update the driver, or put an NVRTC of CUDA {} first on LD_LIBRARY_PATH)",
                nvrtc.0,
                nvrtc.1,
                nvrtc.0,
                driver / 1000,
                driver % 1000 / 10,
                driver / 1000
            ),
        ));
    }
    Ok(())
}

/// `KVSWAP_STATUS_UNSUPPORTED` when the driver's CUDA version `v` is below
/// `min`, naming both; `what` needs `min`.
fn check_min_driver(v: i32, min: i32, what: &str) -> Result<()> {
    if v < min {
        return Err(Error::new(
            KvswapStatus::Unsupported,
            format!(
                "the CUDA driver supports CUDA {}.{}; {what} needs {}.{} or newer (use the CPU backend, or update the driver)",
                v / 1000,
                v % 1000 / 10,
                min / 1000,
                min % 1000 / 10
            ),
        ));
    }
    Ok(())
}

/// The driver's CUDA version (e.g. 13000 for 13.0), 0 when it cannot say.
pub fn driver_version() -> i32 {
    static VERSION: OnceLock<i32> = OnceLock::new();
    *VERSION.get_or_init(|| {
        let mut v = 0;
        // SAFETY: out-pointer is a local; only called once libcuda is loaded
        // (every caller holds a device).
        if unsafe { sys::cuDriverGetVersion(&mut v) } == sys::CUresult::CUDA_SUCCESS {
            v
        } else {
            0
        }
    })
}

/// Whether libcuda can be loaded (probed once per process; loading it
/// initialises nothing).
pub fn culib_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: only probes whether the library can be opened.
    *PRESENT.get_or_init(|| unsafe { sys::is_culib_present() })
}

/// Loads libcuda and runs cuInit once per process; NO_DEVICE when absent.
pub fn init() -> Result<()> {
    static INIT: OnceLock<Result<()>> = OnceLock::new();
    INIT.get_or_init(|| {
        // SAFETY: only probes whether the library can be opened.
        if !unsafe { sys::is_culib_present() } {
            return Err(Error::new(
                KvswapStatus::NoDevice,
                "no CUDA driver: libcuda.so could not be loaded (is the NVIDIA driver installed?)",
            ));
        }
        // SAFETY: the library is present; cuInit(0) has no other precondition.
        check(unsafe { sys::cuInit(0) }, "cuInit").map_err(|e| Error::new(KvswapStatus::NoDevice, e.message))
    })
    .clone()
}

/// The calling thread in relaxed stream-capture mode until dropped, then
/// back in the mode it had (`cuThreadExchangeStreamCaptureMode`).
///
/// In CUDA's default `cudaStreamCaptureModeGlobal`, a potentially unsafe
/// call (a host wait, an allocation or free, a module load) made by any
/// thread while some thread captures a stream in global mode fails and
/// invalidates that capture, even when the call has nothing to do with
/// the captured stream. Every such call kvswap makes is of its own
/// resources (its events, its non-blocking internal stream, its memory),
/// never a wait on a stream being captured (those are refused first), so
/// it runs in relaxed mode, as PyTorch's allocator does for its
/// allocations: an engine's global-mode capture on another stream or
/// thread goes on undisturbed. Made only where the driver is loaded (a
/// live CUDA object implies `init`); a failed exchange leaves the mode as
/// it was.
pub struct RelaxedCapture(Option<sys::CUstreamCaptureMode>);

impl RelaxedCapture {
    pub fn enter() -> RelaxedCapture {
        RELAXED_CALLS.with(|w| w.set(w.get() + 1));
        let mut mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
        // SAFETY: in/out-pointer is a local; the driver is loaded (callers
        // hold a CUDA object).
        let r = unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) };
        RelaxedCapture((r == sys::CUresult::CUDA_SUCCESS).then_some(mode))
    }
}

impl Drop for RelaxedCapture {
    fn drop(&mut self) {
        if let Some(mut mode) = self.0 {
            // SAFETY: restores the mode `enter` exchanged (guards nest:
            // each restores what it found).
            unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) };
        }
    }
}

thread_local! {
    /// Calls this thread made in relaxed mode (waits, allocations, frees,
    /// module loads, pageable copies: every [`RelaxedCapture`]), which
    /// [`Graph::capture`] compares around its body: relaxed mode no longer
    /// makes such a call inside a capture fail, so the count proves there
    /// was none.
    static RELAXED_CALLS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Calls the calling thread made in relaxed capture mode so far (waits,
/// allocations, frees, loads, pageable copies; tests and benchmarks).
pub fn relaxed_calls() -> u64 {
    RELAXED_CALLS.with(|w| w.get())
}

pub fn device_count() -> Result<i32> {
    init()?;
    let mut n = 0;
    // SAFETY: writes one int.
    check(unsafe { sys::cuDeviceGetCount(&mut n) }, "cuDeviceGetCount")?;
    Ok(n)
}

/// A device's primary context, retained for the lifetime of this value.
pub struct Device {
    pub ordinal: i32,
    pub dev: CUdevice,
    pub ctx: CUcontext,
    pub name: String,
    pub total_mem: usize,
    pub cc: (i32, i32),
    pub sm_count: i32,
    /// Largest shared memory a block may opt in to, in bytes.
    pub smem_optin: i32,
}

// SAFETY: CUcontext handles may be used from any thread (with the context
// made current there), which `CtxGuard` does.
unsafe impl Send for Device {}
unsafe impl Sync for Device {}

impl Device {
    pub fn open(ordinal: i32) -> Result<Device> {
        let n = device_count()?;
        if n == 0 {
            return Err(Error::new(KvswapStatus::NoDevice, "the CUDA driver reports no device"));
        }
        if ordinal < 0 || ordinal >= n {
            return Err(Error::new(
                KvswapStatus::NoDevice,
                format!("CUDA device {ordinal} does not exist: {n} device(s) present (KVSWAP_DEVICE)"),
            ));
        }
        let mut dev = 0;
        // SAFETY: valid ordinal; out-pointers are locals.
        unsafe {
            check(sys::cuDeviceGet(&mut dev, ordinal), "cuDeviceGet")?;
        }
        let attr = |a: sys::CUdevice_attribute| -> Result<i32> {
            let mut v = 0;
            // SAFETY: valid device handle.
            check(unsafe { sys::cuDeviceGetAttribute(&mut v, a, dev) }, "cuDeviceGetAttribute")?;
            Ok(v)
        };
        use sys::CUdevice_attribute::*;
        if attr(CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY)? == 0 || attr(CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING)? == 0 {
            return Err(Error::new(
                KvswapStatus::NoDevice,
                format!("CUDA device {ordinal} cannot map host memory with unified addressing"),
            ));
        }
        let cc = (attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?, attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?);
        let sm_count = attr(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
        let smem_optin = attr(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?;
        let mut name_buf = [0 as std::ffi::c_char; 256];
        let mut total_mem = 0usize;
        let mut ctx: CUcontext = std::ptr::null_mut();
        let _relaxed = RelaxedCapture::enter();
        // SAFETY: buffers are large enough; dev is valid.
        unsafe {
            check(sys::cuDeviceGetName(name_buf.as_mut_ptr(), 255, dev), "cuDeviceGetName")?;
            check(sys::cuDeviceTotalMem_v2(&mut total_mem, dev), "cuDeviceTotalMem")?;
            check(sys::cuDevicePrimaryCtxRetain(&mut ctx, dev), "cuDevicePrimaryCtxRetain")?;
        }
        // SAFETY: NUL-terminated by the driver within 255 bytes.
        let name = unsafe { CStr::from_ptr(name_buf.as_ptr()) }.to_string_lossy().into_owned();
        Ok(Device { ordinal, dev, ctx, name, total_mem, cc, sm_count, smem_optin })
    }

    /// Makes this device's context current on the calling thread until the
    /// guard drops (restoring whatever the engine had current).
    pub fn bind(&self) -> Result<CtxGuard> {
        // SAFETY: ctx is a retained primary context.
        check(unsafe { sys::cuCtxPushCurrent_v2(self.ctx) }, "cuCtxPushCurrent")?;
        Ok(CtxGuard)
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        let _relaxed = RelaxedCapture::enter();
        // SAFETY: balanced with the retain in `open`.
        unsafe { sys::cuDevicePrimaryCtxRelease_v2(self.dev) };
    }
}

/// Pops the context pushed by [`Device::bind`].
pub struct CtxGuard;

impl Drop for CtxGuard {
    fn drop(&mut self) {
        let mut old: CUcontext = std::ptr::null_mut();
        // SAFETY: balanced with the push in `bind`.
        unsafe { sys::cuCtxPopCurrent_v2(&mut old) };
    }
}

/// Device memory, freed on drop.
pub struct DeviceBuffer {
    pub ptr: CUdeviceptr,
    pub bytes: usize,
}

impl DeviceBuffer {
    /// `bytes` of device memory (the device's context must be current).
    pub fn alloc(bytes: usize, what: &str) -> Result<DeviceBuffer> {
        let mut ptr = 0;
        let _relaxed = RelaxedCapture::enter();
        // SAFETY: out-pointer is a local.
        check(unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes.max(1)) }, &format!("cuMemAlloc({bytes} bytes, {what})"))?;
        Ok(DeviceBuffer { ptr, bytes })
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        let _relaxed = RelaxedCapture::enter();
        // SAFETY: allocated by cuMemAlloc; freeing needs no current context
        // for allocations made in a primary context that is still retained.
        let r = unsafe { sys::cuMemFree_v2(self.ptr) };
        // A failure leaks the buffer; drop cannot return it, so it is logged.
        if r != sys::CUresult::CUDA_SUCCESS {
            log::warn!("kvswap: cuMemFree of {} bytes failed ({r:?}); the buffer is leaked", self.bytes);
        }
    }
}

/// Pinned, device-mapped, portable host memory (not write-combined, so the
/// CPU reads it at full speed), freed on drop.
pub struct PinnedBuffer {
    pub host: *mut u8,
    pub dev: CUdeviceptr,
    pub bytes: usize,
}

// SAFETY: plain memory owned by this value; regions are handed out disjointly.
unsafe impl Send for PinnedBuffer {}
unsafe impl Sync for PinnedBuffer {}

impl PinnedBuffer {
    pub fn alloc(bytes: usize) -> Result<PinnedBuffer> {
        let mut host: *mut c_void = std::ptr::null_mut();
        let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
        let _relaxed = RelaxedCapture::enter();
        // SAFETY: out-pointer is a local.
        check(unsafe { sys::cuMemHostAlloc(&mut host, bytes.max(1), flags) }, &format!("cuMemHostAlloc({} MiB pinned)", bytes >> 20))
            .map_err(|e| if e.status == KvswapStatus::DeviceError { Error::new(KvswapStatus::OutOfMemory, e.message) } else { e })?;
        let mut dev = 0;
        // SAFETY: host was returned by cuMemHostAlloc with DEVICEMAP.
        if let Err(e) = check(unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, host, 0) }, "cuMemHostGetDevicePointer") {
            // SAFETY: freeing what we just allocated.
            unsafe { sys::cuMemFreeHost(host) };
            return Err(e);
        }
        Ok(PinnedBuffer { host: host as *mut u8, dev, bytes })
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        let _relaxed = RelaxedCapture::enter();
        // SAFETY: allocated by cuMemHostAlloc.
        unsafe { sys::cuMemFreeHost(self.host as *mut c_void) };
    }
}

/// A stream the library owns (non-blocking: it never syncs with the legacy
/// default stream), destroyed on drop.
pub struct OwnedStream(pub CUstream);

// SAFETY: stream handles may be used from any thread.
unsafe impl Send for OwnedStream {}
unsafe impl Sync for OwnedStream {}

impl OwnedStream {
    pub fn new() -> Result<OwnedStream> {
        let mut s: CUstream = std::ptr::null_mut();
        let _relaxed = RelaxedCapture::enter();
        // SAFETY: out-pointer is a local.
        check(unsafe { sys::cuStreamCreate(&mut s, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32) }, "cuStreamCreate")?;
        Ok(OwnedStream(s))
    }
    pub fn sync(&self) -> Result<()> {
        stream_sync(self.0)
    }
}

impl Drop for OwnedStream {
    fn drop(&mut self) {
        let _relaxed = RelaxedCapture::enter();
        // SAFETY: created by cuStreamCreate.
        unsafe { sys::cuStreamDestroy_v2(self.0) };
    }
}

/// Waits for `s` (never one being captured: callers check first). Relaxed
/// capture mode (see [`RelaxedCapture`]).
pub fn stream_sync(s: CUstream) -> Result<()> {
    let _relaxed = RelaxedCapture::enter();
    // SAFETY: the caller passes a live stream handle.
    check(unsafe { sys::cuStreamSynchronize(s) }, "cuStreamSynchronize")
}

/// Whether `s` is being captured into a CUDA graph.
pub fn is_capturing(s: CUstream) -> Result<bool> {
    let mut st = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: live stream handle; out-pointer is a local.
    check(unsafe { sys::cuStreamIsCapturing(s, &mut st) }, "cuStreamIsCapturing")?;
    Ok(st != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
}

/// The id of the capture sequence `s` is part of, or None when it is not
/// being captured (unique per capture, so a new capture on the same stream
/// has another id). Allowed while capturing.
pub fn capture_id(s: CUstream) -> Result<Option<u64>> {
    let mut st = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    let mut id: sys::cuuint64_t = 0;
    use std::ptr::null_mut;
    // SAFETY: live stream handle; out-pointers are locals, the optional
    // ones NULL. The symbol exists: CudaBackend::new refuses drivers older
    // than MIN_DRIVER_VERSION (cudarc would panic on a missing one).
    let r = unsafe { sys::cuStreamGetCaptureInfo_v3(s, &mut st, &mut id, null_mut(), null_mut(), null_mut(), null_mut()) };
    check(r, "cuStreamGetCaptureInfo")?;
    Ok((st != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE).then_some(id as u64))
}

/// The context a stream belongs to.
pub fn stream_context(s: CUstream) -> Result<CUcontext> {
    let mut c: CUcontext = std::ptr::null_mut();
    // SAFETY: the caller passes a stream handle; the driver validates it.
    check(unsafe { sys::cuStreamGetCtx(s, &mut c) }, "cuStreamGetCtx")?;
    Ok(c)
}

/// Where a pointer lives, as the driver sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PtrInfo {
    /// CU_MEMORYTYPE_DEVICE (2) or CU_MEMORYTYPE_HOST (1), etc.
    pub memory_type: u32,
    pub device_ordinal: i32,
    pub range_start: u64,
    pub range_size: u64,
}

/// What the driver says of the memory at `p`: its kind, device and range
/// (for a virtual-memory allocator's memory, the whole reserved address
/// range, mapped or not), and the one physical mapping that holds `p`
/// (`MAPPING_BASE_ADDR`, `MAPPING_SIZE`), whether `p` is mapped, and
/// whether the current context's device may read and write it.
#[derive(Clone, Copy, Debug)]
pub struct Mapping {
    pub info: PtrInfo,
    pub mapped: bool,
    pub read_write: bool,
    pub mapping_base: u64,
    pub mapping_size: u64,
}

/// The pointer attributes of `p` in one driver call, or None for memory the
/// driver does not know (pageable host memory, an unmapped address:
/// `cuPointerGetAttributes` then succeeds with every attribute zero).
pub fn describe(p: u64) -> Result<Option<Mapping>> {
    use sys::CUpointer_attribute::*;
    // 64-bit slots for the flags: the driver writes at most that much.
    let (mut mem_type, mut ordinal, mut start, mut size) = (0u32, -1i32, 0u64, 0usize);
    let (mut mapped, mut access, mut base, mut msize) = (0u64, 0u64, 0u64, 0usize);
    let mut attrs = [
        CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
        CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
        CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
        CU_POINTER_ATTRIBUTE_RANGE_SIZE,
        CU_POINTER_ATTRIBUTE_MAPPED,
        CU_POINTER_ATTRIBUTE_ACCESS_FLAGS,
        CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR,
        CU_POINTER_ATTRIBUTE_MAPPING_SIZE,
    ];
    let mut data: [*mut c_void; 8] = [
        &mut mem_type as *mut u32 as *mut c_void,
        &mut ordinal as *mut i32 as *mut c_void,
        &mut start as *mut u64 as *mut c_void,
        &mut size as *mut usize as *mut c_void,
        &mut mapped as *mut u64 as *mut c_void,
        &mut access as *mut u64 as *mut c_void,
        &mut base as *mut u64 as *mut c_void,
        &mut msize as *mut usize as *mut c_void,
    ];
    // SAFETY: each data slot points to storage at least as large as the
    // attribute's type.
    let r = unsafe { sys::cuPointerGetAttributes(8, attrs.as_mut_ptr(), data.as_mut_ptr(), p) };
    check(r, "cuPointerGetAttributes")?;
    const READWRITE: u64 = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE as u64;
    Ok((mem_type != 0).then_some(Mapping {
        info: PtrInfo { memory_type: mem_type, device_ordinal: ordinal, range_start: start, range_size: size as u64 },
        mapped: mapped & 0xff != 0,
        read_write: access & 0xffff_ffff == READWRITE,
        mapping_base: base,
        mapping_size: msize as u64,
    }))
}

/// [`describe`], None also where the driver cannot say.
pub fn mapping(p: u64) -> Option<Mapping> {
    describe(p).ok().flatten()
}

/// Whether `p` is device memory the CPU cannot read: device memory that is
/// not managed (managed and pinned host memory are readable). False for
/// memory the driver does not know (pageable host memory) and when it
/// cannot tell (also before anything in the process ran `cuInit`: then no
/// device memory exists). Needs libcuda loadable ([`culib_present`]).
pub fn is_device_only(p: u64) -> bool {
    use sys::CUpointer_attribute::*;
    let mut mem_type: u32 = 0;
    let mut managed: u32 = 0;
    let mut attrs = [CU_POINTER_ATTRIBUTE_MEMORY_TYPE, CU_POINTER_ATTRIBUTE_IS_MANAGED];
    let mut data: [*mut c_void; 2] = [&mut mem_type as *mut u32 as *mut c_void, &mut managed as *mut u32 as *mut c_void];
    // SAFETY: each data slot points to storage of the attribute's type.
    let r = unsafe { sys::cuPointerGetAttributes(2, attrs.as_mut_ptr(), data.as_mut_ptr(), p) };
    const DEVICE: u32 = 2; // CU_MEMORYTYPE_DEVICE
    r == sys::CUresult::CUDA_SUCCESS && mem_type == DEVICE && managed == 0
}

/// An event the library owns, without timing (cheap to record).
pub struct Event(pub sys::CUevent);

// SAFETY: event handles may be used from any thread.
unsafe impl Send for Event {}
unsafe impl Sync for Event {}

impl Event {
    pub fn new(timing: bool) -> Result<Event> {
        let mut e: sys::CUevent = std::ptr::null_mut();
        let flags = if timing { 0 } else { sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32 };
        let _relaxed = RelaxedCapture::enter();
        // SAFETY: out-pointer is a local.
        check(unsafe { sys::cuEventCreate(&mut e, flags) }, "cuEventCreate")?;
        Ok(Event(e))
    }
    pub fn record(&self, s: CUstream) -> Result<()> {
        // SAFETY: live event and stream.
        check(unsafe { sys::cuEventRecord(self.0, s) }, "cuEventRecord")
    }
    /// Waits for the event's last record (always an eager one: captured
    /// calls record none). Relaxed capture mode.
    pub fn sync(&self) -> Result<()> {
        let _relaxed = RelaxedCapture::enter();
        // SAFETY: live event.
        check(unsafe { sys::cuEventSynchronize(self.0) }, "cuEventSynchronize")
    }
    /// Milliseconds between two recorded timing events (benchmarks). The
    /// bindings have only `cuEventElapsedTime_v2`, a CUDA 12.8 symbol: older
    /// drivers get `KVSWAP_STATUS_UNSUPPORTED`, not cudarc's panic.
    pub fn elapsed_ms(&self, end: &Event) -> Result<f32> {
        check_min_driver(driver_version(), 12080, "event timing (cuEventElapsedTime_v2, kvswap bench)")?;
        let mut ms = 0f32;
        // SAFETY: both events live and recorded.
        check(unsafe { sys::cuEventElapsedTime_v2(&mut ms, self.0, end.0) }, "cuEventElapsedTime")?;
        Ok(ms)
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        let _relaxed = RelaxedCapture::enter();
        // SAFETY: created by cuEventCreate.
        unsafe { sys::cuEventDestroy_v2(self.0) };
    }
}

/// A loaded module and its kernels, with the context it was loaded in
/// (`cuModuleUnload` acts on the current context, so the drop binds it).
pub struct Module(sys::CUmodule, CUcontext);

// SAFETY: module and function handles may be used from any thread.
unsafe impl Send for Module {}
unsafe impl Sync for Module {}

impl Module {
    /// Loads a CUBIN image (the device's context must be current).
    pub fn load(image: &[u8]) -> Result<Module> {
        let mut m: sys::CUmodule = std::ptr::null_mut();
        let mut ctx: CUcontext = std::ptr::null_mut();
        // SAFETY: out-pointer is a local.
        check(unsafe { sys::cuCtxGetCurrent(&mut ctx) }, "cuCtxGetCurrent")?;
        let _relaxed = RelaxedCapture::enter();
        // SAFETY: image is a complete CUBIN produced by NVRTC.
        check(unsafe { sys::cuModuleLoadData(&mut m, image.as_ptr() as *const c_void) }, "cuModuleLoadData")?;
        Ok(Module(m, ctx))
    }
    pub fn function(&self, name: &CStr) -> Result<Kernel> {
        let mut f: CUfunction = std::ptr::null_mut();
        // SAFETY: live module; name is NUL-terminated.
        check(unsafe { sys::cuModuleGetFunction(&mut f, self.0, name.as_ptr()) }, &format!("cuModuleGetFunction({name:?})"))?;
        Ok(Kernel(f))
    }
}

impl Drop for Module {
    fn drop(&mut self) {
        // SAFETY: loaded by cuModuleLoadData in context self.1, a retained
        // primary context (its `Device` is dropped after the module: every
        // owner declares the module before the device). The push is
        // balanced by the pop; a failed push leaves the module to the
        // context's own teardown.
        let _relaxed = RelaxedCapture::enter();
        unsafe {
            if sys::cuCtxPushCurrent_v2(self.1) == sys::CUresult::CUDA_SUCCESS {
                sys::cuModuleUnload(self.0);
                let mut old: CUcontext = std::ptr::null_mut();
                sys::cuCtxPopCurrent_v2(&mut old);
            }
        }
    }
}

/// A TMA tensor map (`cuTensorMapEncodeTiled`, host-side encoding only: no
/// device work), passed to a kernel by value as a `__grid_constant__`
/// parameter (128 bytes; cudarc's type is 128-byte aligned, the kernel's
/// TmaMap 64: the driver places parameters at the kernel's own offsets).
#[repr(transparent)]
#[derive(Clone, Copy)]
pub struct TensorMap(sys::CUtensorMap);

impl TensorMap {
    /// `rows` rows of `row_bytes` bytes (at most 128: one swizzle span),
    /// `stride` bytes apart from `base` (16-byte aligned, as `stride`),
    /// copied `box_rows` rows at a time into the 128-byte-swizzled layout
    /// wgmma reads K-major; rows past the end arrive zero-filled. Rows
    /// packed back to back are promoted into L2 256 bytes at a time,
    /// strided ones 128 (no bytes between rows read).
    pub fn rows_u8_swizzle128(base: u64, row_bytes: u32, rows: u64, stride: u64, box_rows: u32) -> Result<TensorMap> {
        use sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT8;
        use sys::CUtensorMapL2promotion::{CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B};
        use sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B;
        let l2 = if stride == row_bytes as u64 { CU_TENSOR_MAP_L2_PROMOTION_L2_256B } else { CU_TENSOR_MAP_L2_PROMOTION_L2_128B };
        Self::encode(
            "rows",
            CU_TENSOR_MAP_DATA_TYPE_UINT8,
            base,
            &[row_bytes as u64, rows],
            &[stride],
            &[row_bytes, box_rows],
            CU_TENSOR_MAP_SWIZZLE_128B,
            l2,
        )
    }

    /// `len` f32 values from `base` (16-byte aligned), copied `box_len` at a
    /// time (`box_len * 4` a multiple of 16); values past the end arrive as 0.
    pub fn f32_vector(base: u64, len: u64, box_len: u32) -> Result<TensorMap> {
        use sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT32;
        use sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_NONE;
        use sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_NONE;
        Self::encode("vector", CU_TENSOR_MAP_DATA_TYPE_FLOAT32, base, &[len], &[], &[box_len], CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_NONE)
    }

    #[allow(clippy::too_many_arguments)]
    fn encode(
        what: &str,
        dtype: sys::CUtensorMapDataType,
        base: u64,
        dims: &[u64],
        strides: &[u64],
        boxes: &[u32],
        swizzle: sys::CUtensorMapSwizzle,
        l2: sys::CUtensorMapL2promotion,
    ) -> Result<TensorMap> {
        debug_assert!(dims.len() == boxes.len() && strides.len() + 1 == dims.len());
        let unit = [1u32; 5];
        // SAFETY: CUtensorMap is plain bytes, written by the call below
        // before any use.
        let mut m: sys::CUtensorMap = unsafe { std::mem::zeroed() };
        // A stride array of at least one entry even at rank 1 (not read there).
        let strides_or_dummy = if strides.is_empty() { &[0u64][..] } else { strides };
        // SAFETY: out-pointer to a local; dims and boxes hold `rank` entries,
        // strides rank - 1 (a dummy at rank 1), unit 5 >= rank; base is the
        // caller's device buffer (the driver checks its alignment).
        check(
            unsafe {
                sys::cuTensorMapEncodeTiled(
                    &mut m,
                    dtype,
                    dims.len() as u32,
                    base as *mut c_void,
                    dims.as_ptr(),
                    strides_or_dummy.as_ptr(),
                    boxes.as_ptr(),
                    unit.as_ptr(),
                    sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
                    swizzle,
                    l2,
                    sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
                )
            },
            &format!("cuTensorMapEncodeTiled({what})"),
        )?;
        Ok(TensorMap(m))
    }
}

/// A kernel of a loaded module (valid while the module lives).
#[derive(Clone, Copy)]
pub struct Kernel(pub CUfunction);

// SAFETY: function handles may be used from any thread.
unsafe impl Send for Kernel {}
unsafe impl Sync for Kernel {}

impl Kernel {
    /// The most threads a block of this kernel can have (its launch bound,
    /// or fewer where its registers do not fit).
    pub fn max_threads_per_block(&self) -> Result<u32> {
        let mut v = 0i32;
        // SAFETY: live function handle; v is a local out-parameter.
        check(
            unsafe { sys::cuFuncGetAttribute(&mut v, sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, self.0) },
            "cuFuncGetAttribute(MAX_THREADS_PER_BLOCK)",
        )?;
        Ok(v as u32)
    }

    /// Raises the kernel's dynamic shared memory limit to `bytes`.
    pub fn set_max_dynamic_smem(&self, bytes: i32) -> Result<()> {
        // SAFETY: live function handle.
        check(
            unsafe { sys::cuFuncSetAttribute(self.0, sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, bytes) },
            "cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)",
        )
    }

    /// Launches with programmatic stream serialization (Hopper and later):
    /// the kernel's blocks may start before the previous kernel in the stream
    /// has finished and must wait for it with `griddepcontrol.wait`.
    ///
    /// # Safety
    /// As [`Kernel::launch`].
    pub unsafe fn launch_dependent(&self, grid: u32, block: u32, smem: u32, stream: CUstream, params: &mut [*mut c_void]) -> Result<()> {
        // SAFETY: forwarded caller contract.
        unsafe { self.launch_dependent_2d((grid, 1), block, smem, stream, params) }
    }

    /// [`Kernel::launch_dependent`] with a 2-D grid.
    ///
    /// # Safety
    /// As [`Kernel::launch`].
    pub unsafe fn launch_dependent_2d(&self, grid: (u32, u32), block: u32, smem: u32, stream: CUstream, params: &mut [*mut c_void]) -> Result<()> {
        // SAFETY: a zeroed attribute is valid plain data; the id/value pair is set below.
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let cfg = sys::CUlaunchConfig {
            gridDimX: grid.0,
            gridDimY: grid.1,
            gridDimZ: 1,
            blockDimX: block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: smem,
            hStream: stream,
            attrs: &mut attr,
            numAttrs: 1,
        };
        // SAFETY: forwarded caller contract; cfg and attr outlive the call.
        check(
            unsafe { sys::cuLaunchKernelEx(&cfg, self.0, params.as_mut_ptr(), std::ptr::null_mut()) },
            "cuLaunchKernelEx",
        )
    }

    /// Launches with the given parameters (pointers to each argument value).
    ///
    /// # Safety
    /// `params` must match the kernel's parameter list in number, order and
    /// layout, and every device address in them must be valid for the kernel.
    pub unsafe fn launch(&self, grid: u32, block: u32, smem: u32, stream: CUstream, params: &mut [*mut c_void]) -> Result<()> {
        // SAFETY: forwarded caller contract.
        unsafe { self.launch_2d((grid, 1), block, smem, stream, params) }
    }

    /// [`Kernel::launch`] with a 2-D grid.
    ///
    /// # Safety
    /// As [`Kernel::launch`].
    pub unsafe fn launch_2d(&self, grid: (u32, u32), block: u32, smem: u32, stream: CUstream, params: &mut [*mut c_void]) -> Result<()> {
        // SAFETY: forwarded caller contract.
        check(
            unsafe { sys::cuLaunchKernel(self.0, grid.0, grid.1, 1, block, 1, 1, smem, stream, params.as_mut_ptr(), std::ptr::null_mut()) },
            "cuLaunchKernel",
        )
    }
}

/// An executable CUDA graph captured from a stream (and its graph), both
/// destroyed on drop.
pub struct Graph(sys::CUgraphExec, sys::CUgraph);

// SAFETY: graph handles may be launched from any thread (one launch of an
// executable graph at a time is the caller's to ensure, as for streams).
unsafe impl Send for Graph {}
unsafe impl Sync for Graph {}

impl Graph {
    /// Captures what `body` enqueues on `s` (global mode: a legacy-stream
    /// use or an unsafe call outside kvswap's relaxed sections makes the
    /// capture fail) and instantiates it. A call of kvswap's relaxed
    /// sections by this thread inside `body` (a wait, an allocation, a free,
    /// a module load, a pageable copy: [`relaxed_calls`]) is an error too,
    /// since relaxed mode no longer makes it fail. The capture is ended on
    /// every path; `body`'s error comes first.
    pub fn capture(s: CUstream, body: impl FnOnce() -> Result<()>) -> Result<Graph> {
        Graph::capture_allowing_waits(s, || {
            let before = relaxed_calls();
            body()?;
            match relaxed_calls() - before {
                0 => Ok(()),
                n => Err(Error::device(format!(
                    "{n} host wait(s), allocation(s) or other call(s) that a capture refuses, made inside a capture: a captured call must make none"
                ))),
            }
        })
    }

    /// [`Graph::capture`] without the relaxed-call count: for tests of
    /// kvswap's waiting calls made beside a global-mode capture.
    pub fn capture_allowing_waits(s: CUstream, body: impl FnOnce() -> Result<()>) -> Result<Graph> {
        // SAFETY: s is a live stream; the capture is ended below on every path.
        check(unsafe { sys::cuStreamBeginCapture_v2(s, sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL) }, "cuStreamBeginCapture")?;
        let r = body();
        let mut g: sys::CUgraph = std::ptr::null_mut();
        // SAFETY: ends the capture begun above.
        let e = check(unsafe { sys::cuStreamEndCapture(s, &mut g) }, "cuStreamEndCapture");
        let destroy = |g: sys::CUgraph| {
            if !g.is_null() {
                // SAFETY: a graph returned by the capture, not used after this.
                unsafe { sys::cuGraphDestroy(g) };
            }
        };
        if let Err(err) = r.and(e) {
            destroy(g);
            return Err(err);
        }
        let mut exec: sys::CUgraphExec = std::ptr::null_mut();
        // SAFETY: g is a complete graph.
        if let Err(err) = check(unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, g, 0) }, "cuGraphInstantiate") {
            destroy(g);
            return Err(err);
        }
        Ok(Graph(exec, g))
    }

    /// Launches the graph on `s`.
    pub fn launch(&self, s: CUstream) -> Result<()> {
        // SAFETY: live executable graph; s is the caller's live stream.
        check(unsafe { sys::cuGraphLaunch(self.0, s) }, "cuGraphLaunch")
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        // SAFETY: both were created in `capture` and are destroyed only here.
        unsafe {
            sys::cuGraphExecDestroy(self.0);
            sys::cuGraphDestroy(self.1);
        }
    }
}

/// Asynchronous device -> host copy (relaxed capture mode: the host side
/// may be pageable memory, which copies synchronously).
///
/// # Safety
/// `dst` must be writable for `bytes` until the stream reaches the copy.
pub unsafe fn copy_dtoh_async(dst: *mut u8, src: CUdeviceptr, bytes: usize, s: CUstream) -> Result<()> {
    let _relaxed = RelaxedCapture::enter();
    // SAFETY: forwarded caller contract.
    check(unsafe { sys::cuMemcpyDtoHAsync_v2(dst as *mut c_void, src, bytes, s) }, "cuMemcpyDtoHAsync")
}

/// Asynchronous host -> device copy (relaxed capture mode, as
/// [`copy_dtoh_async`]).
///
/// # Safety
/// `src` must stay readable for `bytes` until the stream reaches the copy.
pub unsafe fn copy_htod_async(dst: CUdeviceptr, src: *const u8, bytes: usize, s: CUstream) -> Result<()> {
    let _relaxed = RelaxedCapture::enter();
    // SAFETY: forwarded caller contract.
    check(unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src as *const c_void, bytes, s) }, "cuMemcpyHtoDAsync")
}

/// Asynchronous fill of `n` bytes.
///
/// # Safety
/// `dst` must address `n` writable bytes of device memory.
pub unsafe fn memset_d8_async(dst: CUdeviceptr, value: u8, n: usize, s: CUstream) -> Result<()> {
    // SAFETY: forwarded caller contract.
    check(unsafe { sys::cuMemsetD8Async(dst, value, n, s) }, "cuMemsetD8Async")
}

/// Asynchronous device-to-device copy.
///
/// # Safety
/// `src` and `dst` must address `bytes` bytes of device memory.
pub unsafe fn copy_dtod_async(dst: CUdeviceptr, src: CUdeviceptr, bytes: usize, s: CUstream) -> Result<()> {
    // SAFETY: forwarded caller contract.
    check(unsafe { sys::cuMemcpyDtoDAsync_v2(dst, src, bytes, s) }, "cuMemcpyDtoDAsync")
}

/// Makes `s` wait for `e` (device-side; the host does not wait). While `s`
/// is being captured the wait becomes an external event-wait node of the
/// graph (`CU_EVENT_WAIT_EXTERNAL`): each launch of the graph then waits for
/// the event's last record, made outside the capture.
pub fn stream_wait_event(s: CUstream, e: &Event, capturing: bool) -> Result<()> {
    let flags = if capturing { sys::CUevent_wait_flags::CU_EVENT_WAIT_EXTERNAL as u32 } else { 0 };
    // SAFETY: live stream and event.
    check(unsafe { sys::cuStreamWaitEvent(s, e.0, flags) }, "cuStreamWaitEvent")
}

/// Asynchronous fill of `n` 32-bit words.
///
/// # Safety
/// `dst` must address `n` writable words of device memory.
pub unsafe fn memset_d32_async(dst: CUdeviceptr, value: u32, n: usize, s: CUstream) -> Result<()> {
    // SAFETY: forwarded caller contract.
    check(unsafe { sys::cuMemsetD32Async(dst, value, n, s) }, "cuMemsetD32Async")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn driver_version_checks() {
        // Below the oldest supported driver: UNSUPPORTED, naming both versions.
        let e = check_min_driver(12020, MIN_DRIVER_VERSION, "the CUDA backend").unwrap_err();
        assert_eq!(e.status, KvswapStatus::Unsupported);
        assert!(e.message.contains("CUDA 12.2") && e.message.contains("12.3 or newer"), "{}", e.message);
        check_min_driver(MIN_DRIVER_VERSION, MIN_DRIVER_VERSION, "x").unwrap();
        // Event timing's own minimum (12.8).
        let e = check_min_driver(12060, 12080, "event timing").unwrap_err();
        assert!(e.message.contains("CUDA 12.6") && e.message.contains("12.8 or newer"), "{}", e.message);
        // NVRTC of a newer major than the driver: its CUBINs would not load.
        let e = check_nvrtc_major((13, 0), 12080, "the CUDA scorer").unwrap_err();
        assert_eq!(e.status, KvswapStatus::Unsupported);
        assert!(e.message.contains("NVRTC 13.0") && e.message.contains("CUDA 12.8"), "{}", e.message);
        // Same major (any minor, either way) or an older NVRTC: accepted.
        check_nvrtc_major((13, 0), 13000, "x").unwrap();
        check_nvrtc_major((13, 2), 13000, "x").unwrap();
        check_nvrtc_major((12, 9), 13000, "x").unwrap();
    }
}
