//! Backends: one trait, a CPU implementation (host memory plays the device;
//! the reference) and a CUDA implementation.

use crate::config::{BackendChoice, Config};
use crate::error::{Error, Result};
use crate::layer::{KvswapLayerStats, KvswapSwapIn, LayerPlan, StagingView};

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;

/// An engine stream (`CUstream` on CUDA; ignored on the CPU backend).
pub type StreamHandle = u64;

/// Refuses device memory given to a CPU-backend call, where the CUDA driver
/// can tell: the CPU backend reads every pointer as host memory, and the
/// CPU reading device memory is a crash, not an error. Needs a CUDA build
/// and a CUDA driver on the machine (the check asks the driver about
/// `ptr`); without them nothing is checked (nor could device memory exist).
/// It never initialises CUDA (`cuInit` is slow on large hosts, and a process
/// that forks GPU workers must not have run it): in a process where nothing
/// has, the driver answers "not initialised", and no device memory exists.
/// `what` names the argument.
pub(crate) fn refuse_device_memory(ptr: u64, what: &str) -> Result<()> {
    #[cfg(feature = "cuda")]
    if ptr != 0 && cuda::driver::culib_present() && cuda::driver::is_device_only(ptr) {
        return Err(Error::invalid(format!(
            "{what} ({ptr:#x}) is CUDA device memory, but this is the CPU backend, which reads host memory: \
             create the context or scorer on the CUDA backend (KVSWAP_BACKEND=cuda, or a device >= 0)"
        )));
    }
    #[cfg(not(feature = "cuda"))]
    let _ = (ptr, what);
    Ok(())
}

/// What backend a context ended up on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendKind {
    Cpu,
    Cuda,
}

impl BackendKind {
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Cpu => "cpu",
            BackendKind::Cuda => "cuda",
        }
    }
}

/// The operations of one layer. Pointers are addresses in the backend's
/// memory space: host addresses on the CPU backend, device addresses on CUDA.
/// The context has validated layer index, null pointers and counts.
pub trait LayerOps: Send {
    /// Copies `ids.len()` chunks from `src + i * src_stride` into the host
    /// tier, marks them stored, and refreshes any resident slot.
    ///
    /// # Safety
    /// `src` must be readable for `(ids.len() - 1) * src_stride + chunk_bytes` bytes
    /// in the backend's memory space; ids are already range-checked.
    unsafe fn store(&mut self, ids: &[u32], src: u64, src_stride: usize, stream: StreamHandle) -> Result<()>;

    /// One `swap_in_selected` call over `count` entries at `indices + window_len`.
    /// `src_ids` (0: none): `count` ids copied into those entries first,
    /// after the layer's earlier work (`kvswap_swap_in_layers`' shared top-k).
    ///
    /// # Safety
    /// `indices` must point to at least `window_len + count` int32 values in
    /// the backend's memory space, not accessed by anyone else during the call;
    /// `src_ids`, when not 0, to `count` int32 values not overlapping them.
    unsafe fn swap_in(&mut self, indices: u64, window_len: u32, count: u32, src_ids: u64, stream: StreamHandle) -> Result<()>;

    /// Forgets chunks `first .. first + n` (`kvswap_layer_forget`, the rules
    /// of `Residency::forget`), keeping the counters and any deferred
    /// error. `n` may be 0 (the stream is still checked). On CUDA queued
    /// on `stream` after the layer's earlier calls; an eager call that
    /// forgets every chunk makes a layer a failed copy launch left unusable
    /// usable again (no slot then holds a chunk).
    /// The context has checked `first + n <= compressed_cap`.
    fn forget(&mut self, first: u32, n: u32, stream: StreamHandle) -> Result<()>;

    /// The concrete layer (a backend's own calls over several layers).
    fn as_any_mut(&mut self) -> &mut dyn std::any::Any;

    /// What `swap_in` checks before it changes anything (the layer is
    /// usable, the stream and pointers are the device's), so that a call
    /// over several layers refuses them all before any runs.
    fn check_swap_in(&self, _indices: u64, _window_len: u32, _count: u32, _src_ids: u64, _stream: StreamHandle) -> Result<()> {
        Ok(())
    }

    /// The ids `swap_in` would read (`src_ids` when not 0, else the
    /// entries) checked as it checks them, changing nothing but a pending
    /// result: the error it would return for the first one it refuses. For
    /// a call over several layers that must refuse a bad id before any
    /// layer changes (`check_entries_each`). A backend that checks on the
    /// host returns that error here; one that checks on the device queues
    /// the check on `stream` (after the work before it there) and returns
    /// its result from `entries_checked`, which must be called after every
    /// `check_entries` call (also one that failed: its launch may have been
    /// queued).
    ///
    /// # Safety
    /// As `swap_in`, and `check_swap_in` has accepted the same arguments
    /// (`check_entries_each` runs after `check_each`).
    unsafe fn check_entries(&mut self, _indices: u64, _window_len: u32, _count: u32, _src_ids: u64, _stream: StreamHandle) -> Result<()> {
        Ok(())
    }

    /// The result of the check `check_entries` queued, once it has run
    /// (Ok when none is pending). Clears it.
    fn entries_checked(&mut self) -> Result<()> {
        Ok(())
    }

    /// Counters (synchronises with the device). With `take_error`, returns
    /// (and clears) a deferred error of an earlier asynchronous call
    /// instead, if there is one; without, leaves it for a later sync.
    fn stats(&mut self, take_error: bool) -> Result<KvswapLayerStats>;

    /// Returns and clears a deferred error, after waiting for the device.
    fn sync(&mut self) -> Result<()>;

    /// Where the staging rows are.
    fn staging(&self) -> StagingView;

    /// `(slot, chunk)` of every resident chunk, for tests and tools
    /// (synchronises with the device).
    fn residency(&mut self) -> Result<Vec<(u32, u32)>>;

    /// The bytes of staging slot `slot` (synchronises with the device).
    fn read_slot(&mut self, slot: u32) -> Result<Vec<u8>>;

    /// Stores chunks from host memory: `rows` holds `ids.len()` rows of
    /// `chunk_bytes` (on CUDA, through a device copy; synchronous).
    fn store_host(&mut self, ids: &[u32], rows: &[u8]) -> Result<()>;

    /// A swap-in over a host index buffer (on CUDA, through a device copy;
    /// synchronous).
    fn swap_in_host(&mut self, indices: &mut [i32], window_len: u32) -> Result<()>;
}

/// A backend instance, bound to one device (or to the host).
pub trait Backend: Send + Sync {
    fn kind(&self) -> BackendKind;
    /// A line for the logs: device name, memory, capability.
    fn describe(&self) -> String;
    /// Allocates every layer's host tier (one pool) and staging.
    fn create_layers(&self, plans: &[LayerPlan], cfg: &Config) -> Result<Vec<Box<dyn LayerOps>>>;
    /// Waits for `stream` (0: nothing to wait for).
    fn sync_stream(&self, _stream: StreamHandle) -> Result<()> {
        Ok(())
    }
    /// Bytes of host tier this backend would pin for `plans`.
    fn host_bytes(&self, plans: &[LayerPlan]) -> u64 {
        crate::layer::total_host_bytes(plans)
    }
    /// The swap-ins of `kvswap_swap_in_layers` with `KVSWAP_SYNC=0` (the
    /// context checked distinct layers and entries that overlap neither each
    /// other nor `src_ids`). Checks every request as `LayerOps::check_swap_in`
    /// does before any layer changes. This default then runs them one after
    /// another on `stream`, stopping at the first error (each request's
    /// error names it: `KvswapSwapIn::error`).
    ///
    /// # Safety
    /// As `LayerOps::swap_in`, for every request.
    unsafe fn swap_in_layers(&self, layers: &mut [(&mut Box<dyn LayerOps>, KvswapSwapIn)], src_ids: u64, stream: StreamHandle) -> Result<()> {
        check_each(layers, src_ids, stream)?;
        // SAFETY: forwarded caller contract.
        unsafe { swap_in_each(layers, src_ids, stream) }
    }
}

/// Where a swap-in reads its ids: the shared top-k `src_ids` when not 0,
/// else the entries after the window.
pub(crate) fn ids_addr(indices: u64, window_len: u32, src_ids: u64) -> u64 {
    if src_ids != 0 {
        src_ids
    } else {
        indices + 4 * window_len as u64
    }
}

/// Every request's `check_swap_in`, before any layer changes.
pub(crate) fn check_each(layers: &[(&mut Box<dyn LayerOps>, KvswapSwapIn)], src_ids: u64, stream: StreamHandle) -> Result<()> {
    for (i, (l, r)) in layers.iter().enumerate() {
        l.check_swap_in(r.indices as u64, r.window_len, r.count, src_ids, stream).map_err(|e| r.error(i, e))?;
    }
    Ok(())
}

/// Every request's `check_entries`, before any layer changes: all of them
/// queued (or done, on the host), then every queued result collected (on
/// CUDA the first collection waits for the checks, each reads its layer's
/// error record back). Returns the error
/// of the first request (in the requests' order) that one of them refused;
/// every queued result is collected either way, so none is left pending.
///
/// # Safety
/// As `LayerOps::swap_in`, for every request.
pub(crate) unsafe fn check_entries_each(layers: &mut [(&mut Box<dyn LayerOps>, KvswapSwapIn)], src_ids: u64, stream: StreamHandle) -> Result<()> {
    let mut first: Option<(usize, Error)> = None;
    let mut queued = 0;
    for (i, (l, r)) in layers.iter_mut().enumerate() {
        // SAFETY: forwarded caller contract.
        match unsafe { l.check_entries(r.indices as u64, r.window_len, r.count, src_ids, stream) } {
            Ok(()) => queued = i + 1,
            Err(e) => {
                first = Some((i, r.error(i, e)));
                queued = i + 1; // collected below too: a launch that failed may leave one pending
                break;
            }
        }
    }
    for (i, (l, r)) in layers.iter_mut().enumerate().take(queued) {
        if let Err(e) = l.entries_checked() {
            if first.as_ref().is_none_or(|(j, _)| i < *j) {
                first = Some((i, r.error(i, e)));
            }
        }
    }
    first.map_or(Ok(()), |(_, e)| Err(e))
}

/// The requests' swap-ins one after another on `stream`, stopping at the
/// first error (named by its request: `KvswapSwapIn::error`).
///
/// # Safety
/// As `LayerOps::swap_in`, for every request.
pub(crate) unsafe fn swap_in_each(layers: &mut [(&mut Box<dyn LayerOps>, KvswapSwapIn)], src_ids: u64, stream: StreamHandle) -> Result<()> {
    for (i, (l, r)) in layers.iter_mut().enumerate() {
        // SAFETY: forwarded caller contract.
        unsafe { l.swap_in(r.indices as u64, r.window_len, r.count, src_ids, stream) }.map_err(|e| r.error(i, e))?;
    }
    Ok(())
}

/// Picks the backend for `cfg`: `auto` prefers CUDA and falls back to the
/// CPU, with one log line saying why, only where the driver reports no
/// CUDA device (or there is no driver). With devices present, a CUDA
/// backend that cannot start (the device asked for is missing, the driver is
/// too old, NVRTC is missing) is an error: a CPU context would read the
/// engine's device pointers as host memory.
pub fn select(cfg: &Config) -> Result<Box<dyn Backend>> {
    match cfg.backend {
        BackendChoice::Cpu => Ok(Box::new(cpu::CpuBackend)),
        BackendChoice::Cuda => cuda_backend(cfg),
        BackendChoice::Auto => match cuda_backend(cfg) {
            Ok(b) => Ok(b),
            Err(e) => match cuda_device_count() {
                Some(n) => Err(Error::new(
                    e.status,
                    format!(
                        "{} (KVSWAP_BACKEND=auto: the driver reports {n} CUDA device(s), so there is no fall back to the \
                         CPU backend, which would read device pointers as host memory; set KVSWAP_BACKEND=cpu, or \
                         --backend cpu for the kvswap command, to use it)",
                        e.message
                    ),
                )),
                None => {
                    log::info!("kvswap: backend=cpu reason={:?}", e.message);
                    Ok(Box::new(cpu::CpuBackend))
                }
            },
        },
    }
}

/// The number of CUDA devices the driver reports, None where there is no
/// driver or no device (where `auto` falls back to the CPU).
#[cfg(feature = "cuda")]
pub fn cuda_device_count() -> Option<i32> {
    match cuda::driver::device_count() {
        Ok(n) if n > 0 => Some(n),
        _ => None,
    }
}

#[cfg(not(feature = "cuda"))]
pub fn cuda_device_count() -> Option<i32> {
    None
}

#[cfg(feature = "cuda")]
fn cuda_backend(cfg: &Config) -> Result<Box<dyn Backend>> {
    Ok(Box::new(cuda::CudaBackend::new(cfg)?))
}

#[cfg(not(feature = "cuda"))]
fn cuda_backend(_cfg: &Config) -> Result<Box<dyn Backend>> {
    Err(crate::error::Error::new(
        crate::error::KvswapStatus::NoDevice,
        "this build of kvswap has no CUDA backend (built without the `cuda` feature)",
    ))
}
