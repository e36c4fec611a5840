//! The CUDA backend: a pinned, device-mapped host tier (one pool per
//! context), staging slots in device memory, and kernels (kernels/swap.cu)
//! that take the residency decision on the GPU and gather every miss in one
//! launch, reading the mapped host tier directly. With `KVSWAP_SYNC=0` a
//! swap-in never waits for the host and can be captured in a CUDA graph.

mod checks;
pub mod driver;
pub mod nvrtc;
pub mod scorer;

pub(crate) use checks::{check_device_range, check_stream_device, check_waitable};
use checks::copy_width;

use super::{Backend, BackendKind, LayerOps, StreamHandle};
use crate::config::Config;
use crate::error::{Error, KvswapStatus, Result};
use crate::layer::{dedup_last, KvswapLayerStats, KvswapSwapIn, LayerPlan, StagingView};
use crate::residency::EntryError;
use driver::{kernel_params, CUstream, Device, DeviceBuffer, Event, Kernel, Module, OwnedStream, PinnedBuffer};
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, OnceLock};

/// Test hook: the next `n` launch attempts of the swap-in gather fail as if
/// the driver had refused them (tests/gpu.rs; every attempt takes one).
#[doc(hidden)]
pub fn fail_gather_launches(n: u32) {
    GATHER_FAULTS.store(n, Ordering::Relaxed);
}
static GATHER_FAULTS: AtomicU32 = AtomicU32::new(0);

/// Whether the test hook refuses this gather launch attempt (single and
/// multi-layer gathers alike).
fn gather_fault_injected() -> bool {
    GATHER_FAULTS.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1)).is_ok()
}

/// Ids per store launch (`KV_STORE_MAX` in kernels/swap.cu).
const STORE_MAX: usize = 256;
const ERR_OUT_OF_RANGE: u32 = 1;
const ERR_NOT_STORED: u32 = 2;
const ERR_VALIDATION: u32 = 3;

/// Kernel-side view of a layer (`LayerDev` in kernels/swap.cu), passed by value.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct LayerDev {
    chunk_slot: u64,
    slot_chunk: u64,
    lru: u64,
    parity: u64,
    stored: u64,
    selected: u64,
    miss_list: u64,
    n_miss: u64,
    stats: u64,
    err: u64,
    host_tier: u64,
    staging: u64,
    stride: u64,
    chunk_bytes: u64,
    cap: u32,
    slots: u32,
    identity: u32,
    pad: u32,
}

/// `StoreIds` in kernels/swap.cu.
#[repr(C)]
struct StoreIds {
    n: u32,
    ids: [u32; STORE_MAX],
    rows: [u32; STORE_MAX],
}

struct Kernels {
    init: Kernel,
    forget: Kernel,
    swap_in: Kernel,
    gather: Kernel,
    store: Kernel,
    validate: Kernel,
    swap_in_multi: Kernel,
    gather_multi: Kernel,
    check_entries: Kernel,
}

/// What every layer of a context shares. Field order is drop order: the
/// module and stream go before the device's context is released.
struct Shared {
    kernels: Kernels,
    /// Dynamic shared memory kvswap_swap_in may use per block.
    swap_smem_max: u32,
    /// Programmatic dependent launch of the gather (compute capability >=
    /// 9.0); turned off for the context when such a launch is refused.
    pdl: AtomicBool,
    _module: Module,
    internal: OwnedStream,
    device: Device,
}

impl Shared {
    /// Launches a gather (`gather` or `gather_multi`) on `s` after the
    /// residency kernel queued there: as its programmatic dependent while the
    /// context allows (it waits with griddepcontrol.wait), retried once as a
    /// plain launch (after it by stream order; captured, the retry becomes the
    /// graph's node). A test hook can refuse attempts. A dependent launch
    /// refused and a plain one accepted turns programmatic dependent launch
    /// of the gather off for the context (no retry, no log per call after
    /// that). Both refused: the two errors, for the caller to say what the
    /// residency kernel left (`what` names the layers in the log).
    ///
    /// # Safety
    /// `params` match `kernel`'s parameters, as `Kernel::launch` requires.
    unsafe fn launch_gather(&self, kernel: &Kernel, grid: (u32, u32), s: CUstream, params: &mut [*mut c_void], what: impl Fn() -> String) -> std::result::Result<(), (Error, Error)> {
        let attempt = |dependent: bool, params: &mut [*mut c_void]| -> Result<()> {
            if gather_fault_injected() {
                return Err(Error::device("gather launch refused (injected by a test)"));
            }
            // SAFETY: forwarded caller contract.
            unsafe {
                if dependent {
                    kernel.launch_dependent_2d(grid, 256, 0, s, params)
                } else {
                    kernel.launch_2d(grid, 256, 0, s, params)
                }
            }
        };
        let pdl = self.pdl.load(Ordering::Relaxed);
        let Err(e1) = attempt(pdl, params) else { return Ok(()) };
        if let Err(e2) = attempt(false, params) {
            return Err((e1, e2));
        }
        log::warn!("kvswap: {}: gather launch failed ({}); retried as a plain launch", what(), e1.message);
        if pdl {
            self.pdl.store(false, Ordering::Relaxed);
            log::warn!("kvswap: programmatic dependent launch of the gather turned off for this context");
        }
        Ok(())
    }
}

pub struct CudaBackend {
    /// Every layer's `LayerDev`, in layer order, for the multi-layer
    /// kernels (written once the layers exist; before `shared`: freed
    /// before the device's context is released).
    table: OnceLock<DeviceBuffer>,
    shared: Arc<Shared>,
}

/// Requests per `kvswap_swap_in_multi` launch (`KV_MULTI_MAX` in
/// kernels/swap.cu); a call with more launches them in groups, in order.
const MULTI_MAX: usize = 64;

/// `MultiReq` in kernels/swap.cu.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct MultiReq {
    indices: u64,
    layer: u32,
    window: u32,
    count: u32,
    width: u32,
}

/// `MultiReqs` in kernels/swap.cu (by value: a captured graph holds it).
#[repr(C)]
struct MultiReqs {
    src: u64,
    n: u32,
    pad: u32,
    r: [MultiReq; MULTI_MAX],
}

impl CudaBackend {
    /// Opens device `cfg.device` and compiles the kernels for it (cached per
    /// process and architecture).
    pub fn new(cfg: &Config) -> Result<CudaBackend> {
        let device = Device::open(cfg.device)?;
        driver::check_driver_version("the CUDA backend")?;
        let _g = device.bind()?;
        let cubin = nvrtc::compile_cached("swap.cu", crate::kernels::SWAP_CU, device.cc)?;
        let module = Module::load(&cubin)?;
        let kernels = Kernels {
            init: module.function(c"kvswap_init_layer")?,
            forget: module.function(c"kvswap_forget")?,
            swap_in: module.function(c"kvswap_swap_in")?,
            gather: module.function(c"kvswap_gather")?,
            store: module.function(c"kvswap_store")?,
            validate: module.function(c"kvswap_validate")?,
            swap_in_multi: module.function(c"kvswap_swap_in_multi")?,
            gather_multi: module.function(c"kvswap_gather_multi")?,
            check_entries: module.function(c"kvswap_check_entries")?,
        };
        // Leave room for the kernel's static shared memory.
        let swap_smem_max = (device.smem_optin - 1024).max(0) as u32;
        kernels.swap_in.set_max_dynamic_smem(swap_smem_max as i32)?;
        kernels.swap_in_multi.set_max_dynamic_smem(swap_smem_max as i32)?;
        let internal = OwnedStream::new()?;
        let pdl = device.cc.0 >= 9;
        drop(_g);
        Ok(CudaBackend {
            table: OnceLock::new(),
            shared: Arc::new(Shared { kernels, swap_smem_max, pdl: AtomicBool::new(pdl), _module: module, internal, device }),
        })
    }

    pub fn device(&self) -> &Device {
        &self.shared.device
    }

    /// One launch pair for `group` (requests `first ..` of the call): each
    /// layer's ordering after its earlier eager work, the residency kernel
    /// (one block per request, the top-k copied in first), the gather as its
    /// programmatic dependent (retried as a plain launch), then each layer's
    /// `done` record. If the gather cannot be launched at all after the
    /// residency kernel was queued, an eager call leaves every layer of the
    /// group that had entries with slots mapped to bytes never copied: the
    /// swapping ones are marked unusable, as one layer's call does; a
    /// captured call returns the error (the capture must be discarded).
    ///
    /// # Safety
    /// As `LayerOps::swap_in`, for every request (checked by the context).
    #[allow(clippy::too_many_arguments)]
    unsafe fn launch_multi(
        &self,
        table: &DeviceBuffer,
        group: &mut [(&mut CudaLayer, KvswapSwapIn)],
        first: usize,
        src_ids: u64,
        s: CUstream,
        stream: StreamHandle,
        capture: Option<u64>,
    ) -> Result<()> {
        let sh = &self.shared;
        let k = &sh.kernels;
        let capturing = capture.is_some();
        for (i, (l, r)) in group.iter_mut().enumerate() {
            l.order(s, stream, capture).map_err(|e| r.error(first + i, e))?;
        }
        let mut q = MultiReqs { src: src_ids, n: group.len() as u32, pad: 0, r: [MultiReq::default(); MULTI_MAX] };
        let (mut threads, mut smem, mut pieces) = (64u32, 0u32, 0u64);
        for (i, (l, r)) in group.iter().enumerate() {
            let (t, m) = l.swap_shape(r.count);
            threads = threads.max(t);
            smem = smem.max(m);
            if l.dev.identity == 0 {
                pieces = pieces.max(r.count as u64 * (l.plan.chunk_bytes as u64).div_ceil(2048));
            }
            q.r[i] = MultiReq { indices: r.indices as u64, layer: l.plan.index as u32, window: r.window_len, count: r.count, width: l.copy_width(&[]) };
        }
        let n = group.len() as u32;
        let mut tbl = table.ptr;
        let mut params = kernel_params![tbl, q];
        // SAFETY: parameters match kvswap_swap_in_multi(const LayerDev*,
        // MultiReqs); the table holds every layer's LayerDev; indices (and
        // src_ids) were range-checked by each layer's check_swap_in; smem is
        // the largest any request needs, within the limit checked at creation.
        let mut launched = unsafe { k.swap_in_multi.launch(n, threads, smem, s, &mut params) };
        if launched.is_ok() && pieces > 0 {
            let gx = pieces.div_ceil(8).clamp(1, (sh.device.sm_count as u64 * 16 / n as u64).max(1)) as u32;
            // The layers' names only for the log line of a retried launch.
            let what = || format!("layers {}", group.iter().map(|(l, _)| l.plan.index.to_string()).collect::<Vec<_>>().join(", "));
            // SAFETY: parameters match kvswap_gather_multi(const LayerDev*, MultiReqs).
            if let Err((e1, e2)) = unsafe { sh.launch_gather(&k.gather_multi, (gx, n), s, &mut params, what) } {
                let both = format!("{} (retried as a plain launch: {})", e1.message, e2.message);
                launched = Err(if capturing {
                    Error::new(e1.status, both)
                } else {
                    let mut named = Vec::new();
                    for (l, _) in group.iter_mut().filter(|(l, r)| l.dev.identity == 0 && r.count > 0) {
                        l.broken = Some(format!(
                            "layer {}: the copy kernel of a kvswap_swap_in_layers call could not be launched after its \
                             residency update ({both}), so some slots are mapped to chunks whose bytes were never copied; \
                             forget all its chunks (kvswap_layer_forget) or destroy the context",
                            l.plan.index
                        ));
                        named.push(l.plan.index.to_string());
                    }
                    Error::device(format!(
                        "layers {}: the copy kernel could not be launched after the residency update ({both}), so some \
                         of their slots are mapped to chunks whose bytes were never copied; forget all their chunks \
                         (kvswap_layer_forget) or destroy the context",
                        named.join(", ")
                    ))
                });
            }
        }
        // Each layer's `done` covers what was queued, also after a failure.
        let mut recorded = Ok(());
        for (l, _) in group.iter_mut() {
            if let Err(e) = l.after_launch(s, capturing, Ok(())) {
                recorded = recorded.and(Err(e));
            }
        }
        launched.and(recorded)
    }
}

impl Backend for CudaBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Cuda
    }

    fn describe(&self) -> String {
        let d = &self.shared.device;
        format!(
            "cuda device={} name=\"{}\" sm_{}{} sms={} memory_mib={}",
            d.ordinal, d.name, d.cc.0, d.cc.1, d.sm_count, d.total_mem >> 20
        )
    }

    fn create_layers(&self, plans: &[LayerPlan], cfg: &Config) -> Result<Vec<Box<dyn LayerOps>>> {
        let sh = &self.shared;
        let _g = sh.device.bind()?;
        // Each layer's host tier starts 256-byte aligned, so a layer whose
        // chunk size is a multiple of 16 keeps the 16-byte copies whatever
        // the sizes of the layers before it (the pinned cap counts the
        // unpadded bytes: at most 255 more per layer).
        const ALIGN: u64 = 256;
        let total = plans
            .iter()
            .try_fold(0u64, |a, p| p.host_bytes().checked_next_multiple_of(ALIGN).and_then(|b| a.checked_add(b)))
            .filter(|&t| usize::try_from(t).is_ok())
            .ok_or_else(|| Error::new(KvswapStatus::OutOfMemory, "the host tiers of all layers exceed the address space"))?;
        let pool = Arc::new(PinnedBuffer::alloc(total as usize)?);
        let mut layers: Vec<Box<dyn LayerOps>> = Vec::with_capacity(plans.len());
        let mut built = Ok(());
        let mut offset = 0u64;
        let mut table: Vec<LayerDev> = Vec::with_capacity(plans.len());
        for p in plans {
            match CudaLayer::new(sh.clone(), p, cfg, pool.clone(), offset) {
                Ok(l) => {
                    table.push(l.dev);
                    layers.push(Box::new(l));
                }
                Err(e) => {
                    built = Err(e);
                    break;
                }
            }
            offset += p.host_bytes().next_multiple_of(ALIGN);
        }
        // The layers' initialisation is queued on `internal`: wait for it
        // before they are used, and on failure before `layers` is dropped
        // (which frees the memory those kernels write).
        let synced = sh.internal.sync();
        built?;
        synced?;
        // The LayerDev table of the multi-layer kernels.
        let bytes = table.len() * std::mem::size_of::<LayerDev>();
        let buf = DeviceBuffer::alloc(bytes, "the layer table")?;
        // SAFETY: buf holds `bytes`; `table` lives until the sync below.
        unsafe { driver::copy_htod_async(buf.ptr, table.as_ptr() as *const u8, bytes, sh.internal.0)? };
        sh.internal.sync()?;
        let _ = self.table.set(buf);
        Ok(layers)
    }

    /// The layers in one launch pair (`kvswap_swap_in_multi`, then
    /// `kvswap_gather_multi` as its programmatic dependent), up to MULTI_MAX
    /// requests per pair, on `stream`. With KVSWAP_VALIDATE=1 (a per-layer
    /// check after each swap-in) one call per layer instead.
    unsafe fn swap_in_layers(&self, layers: &mut [(&mut Box<dyn LayerOps>, KvswapSwapIn)], src_ids: u64, stream: StreamHandle) -> Result<()> {
        let Some(table) = self.table.get() else {
            return Err(Error::device("the context's layer table is missing (its creation failed)"));
        };
        let dev = &self.shared.device;
        let _g = dev.bind()?;
        let s = stream as CUstream;
        check_stream_device(dev, s)?;
        let capture = driver::capture_id(s)?;
        let mut cuda: Vec<(&mut CudaLayer, KvswapSwapIn)> = layers
            .iter_mut()
            .map(|(l, r)| (l.as_any_mut().downcast_mut::<CudaLayer>().expect("a CUDA context's layers are CudaLayer"), *r))
            .collect();
        if cuda.iter().any(|(l, _)| l.validate) {
            drop(cuda);
            super::check_each(layers, src_ids, stream)?;
            // SAFETY: forwarded caller contract.
            return unsafe { super::swap_in_each(layers, src_ids, stream) };
        }
        // The checks of check_swap_in, the stream's made once above (this
        // path runs with KVSWAP_SYNC=0 only, so capture is allowed) and the
        // top-k's once for the largest count.
        for (i, (l, r)) in cuda.iter().enumerate() {
            l.check_buffers(r.indices as u64, r.window_len, r.count, 0).map_err(|e| r.error(i, e))?;
        }
        if src_ids != 0 {
            let most = cuda.iter().map(|(_, r)| r.count).max().unwrap_or(0);
            check_device_range(dev, src_ids, 4 * most as u64, "topk")?;
        }
        for (g, group) in cuda.chunks_mut(MULTI_MAX).enumerate() {
            // SAFETY: forwarded caller contract (checked by the context).
            unsafe { self.launch_multi(table, group, g * MULTI_MAX, src_ids, s, stream, capture)? };
        }
        Ok(())
    }

    fn sync_stream(&self, stream: StreamHandle) -> Result<()> {
        if stream == 0 {
            return Ok(());
        }
        let _g = self.shared.device.bind()?;
        check_waitable(&self.shared.device, stream as CUstream, "call kvswap_sync with it")?;
        driver::stream_sync(stream as CUstream)
    }
}

/// The handle of CUDA's per-thread default stream (`CU_STREAM_PER_THREAD`).
pub(crate) const CU_STREAM_PER_THREAD: usize = 2;

/// Dynamic shared memory of kvswap_swap_in for a swapping layer (u64: with
/// gpu_chunks near 2^30 the u32 product would wrap past the limit check).
fn swap_smem(count: u32, slots: u32) -> u64 {
    4 * (3 * count as u64 + 2 * slots as u64)
}

/// Little-endian 32-bit words of `bytes` (a whole number of them).
fn le_words(bytes: &[u8]) -> Vec<u32> {
    bytes.chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().unwrap())).collect()
}

/// Offsets (in 4-byte words) of a layer's metadata arrays in one allocation.
struct MetaLayout {
    chunk_slot: usize,
    slot_chunk: usize,
    lru: usize,
    parity: usize,
    stored: usize,
    selected: usize,
    miss_list: usize,
    n_miss: usize,
    err: usize,
    stats: usize,
    words: usize,
}

impl MetaLayout {
    /// A fully resident layer (`swap` false, `slots` = `cap`) keeps only the
    /// stored bits and the per-slot selected flags: the chunk <-> slot
    /// tables, the LRU order and the miss list of a swapping layer (about 24
    /// bytes per chunk) are not used by its kernels and get no room.
    fn new(cap: usize, slots: usize, swap: bool) -> MetaLayout {
        let (table_cap, table_slots) = if swap { (cap, slots) } else { (0, 0) };
        let chunk_slot = 0;
        let slot_chunk = chunk_slot + table_cap;
        let lru = slot_chunk + table_slots;
        let parity = lru + 2 * table_slots;
        let stored = parity + 1;
        let selected = stored + cap.div_ceil(32);
        let miss_list = selected + slots;
        let n_miss = miss_list + 2 * table_slots;
        // err: the 4-word error record, then kvswap_validate's arrival count,
        // a spare word and its u64 lowest mismatch (8-byte aligned).
        let err = (n_miss + 1).next_multiple_of(2);
        let stats = err + 8;
        let words = stats + 16;
        MetaLayout { chunk_slot, slot_chunk, lru, parity, stored, selected, miss_list, n_miss, err, stats, words }
    }
}

/// Field order is drop order: every driver resource of the layer goes before
/// `sh`, which may hold the last reference to the device's context.
struct CudaLayer {
    plan: LayerPlan,
    dev: LayerDev,
    meta: MetaLayout,
    _meta_buf: DeviceBuffer,
    _staging_buf: Option<DeviceBuffer>,
    _pool: Arc<PinnedBuffer>,
    /// Pinned scratch for reading counters and the error record back.
    readback: PinnedBuffer,
    /// Device scratch for the host-slice helpers (grown on demand).
    scratch: Option<DeviceBuffer>,
    strict: bool,
    validate: bool,
    /// Recorded after each call on its stream (not while capturing: a
    /// captured call runs when the engine launches the graph).
    done: Event,
    /// `done` holds the layer's last eager call; it stays set across
    /// captured calls, which do not replace that record.
    recorded: bool,
    /// The stream handle of the layer's last eager call (`usize::MAX`: none,
    /// or kvswap's own stream). Captured calls leave it: they run later.
    last_stream: usize,
    /// The capture id and stream handle of the layer's last captured call.
    last_capture: Option<(u64, usize)>,
    /// Set when a swap-in's gather could not be launched after its residency
    /// kernel had run: slots are mapped to chunks whose bytes were never
    /// copied, so every later swap-in is refused with this text.
    broken: Option<String>,
    /// A kvswap_check_entries is queued whose error record
    /// `entries_checked` has not read yet.
    entries_pending: bool,
    /// The error record's copy into `readback` is queued with the last
    /// recorded call (`queue_error_read`), so `wait` also waits for it.
    error_queued: bool,
    sh: Arc<Shared>,
}

// SAFETY: all handles are driver objects usable from any thread with the
// context bound (every method binds it); the context serialises access.
unsafe impl Send for CudaLayer {}

impl CudaLayer {
    fn new(sh: Arc<Shared>, p: &LayerPlan, cfg: &Config, pool: Arc<PinnedBuffer>, offset: u64) -> Result<CudaLayer> {
        let cap = p.compressed_cap as usize;
        let slots = p.slots as usize;
        if p.swap && swap_smem(slots as u32, slots as u32) > sh.swap_smem_max as u64 {
            return Err(Error::new(
                KvswapStatus::Unsupported,
                format!(
                    "gpu_chunks={slots} is above what the CUDA backend supports on this device ({}): \
                     the residency kernel keeps 20 bytes per slot in shared memory",
                    sh.swap_smem_max / 20
                ),
            ));
        }
        let meta = MetaLayout::new(cap, slots, p.swap);
        let meta_buf = DeviceBuffer::alloc(meta.words * 4, "layer metadata")?;
        let (staging_ptr, stride, staging_buf) = match p.staging {
            Some((ptr, stride)) => {
                check_device_range(&sh.device, ptr, stride * (slots as u64 - 1) + p.chunk_bytes as u64, &format!("layer {} staging", p.index))?;
                (ptr, stride, None)
            }
            None => {
                let b = DeviceBuffer::alloc(slots * p.chunk_bytes, "staging slots")?;
                (b.ptr, p.chunk_bytes as u64, Some(b))
            }
        };
        let w = |off: usize| meta_buf.ptr + 4 * off as u64;
        let dev = LayerDev {
            chunk_slot: w(meta.chunk_slot),
            slot_chunk: w(meta.slot_chunk),
            lru: w(meta.lru),
            parity: w(meta.parity),
            stored: w(meta.stored),
            selected: w(meta.selected),
            miss_list: w(meta.miss_list),
            n_miss: w(meta.n_miss),
            stats: w(meta.stats),
            err: w(meta.err),
            host_tier: pool.dev + offset,
            staging: staging_ptr,
            stride,
            chunk_bytes: p.chunk_bytes as u64,
            cap: p.compressed_cap,
            slots: p.slots,
            identity: (!p.swap) as u32,
            pad: 0,
        };
        // Reads back: slot -> chunk (swapping layers), the stored bits, the
        // counters and error record (a staged row is read without it: a
        // buffer of chunk_bytes per layer would pin that much more).
        let words = (meta.lru - meta.slot_chunk).max(meta.selected - meta.stored).max(64);
        let layer = CudaLayer {
            readback: PinnedBuffer::alloc(4 * words)?,
            done: Event::new(false)?,
            sh,
            plan: *p,
            dev,
            meta,
            _meta_buf: meta_buf,
            _staging_buf: staging_buf,
            _pool: pool,
            scratch: None,
            strict: cfg.sync,
            validate: cfg.validate,
            recorded: false,
            last_stream: usize::MAX,
            last_capture: None,
            broken: None,
            entries_pending: false,
            error_queued: false,
        };
        let s = layer.sh.internal.0;
        let mut d = layer.dev;
        let grid = (cap.max(slots).div_ceil(256)).clamp(1, 1024) as u32;
        let queued = (|| {
            // SAFETY: the single parameter matches kvswap_init_layer(LayerDev).
            unsafe { layer.sh.kernels.init.launch(grid, 256, 0, s, &mut [&mut d as *mut LayerDev as *mut c_void])? };
            if let Some(b) = &layer._staging_buf {
                // Zero the library-owned staging so no slot holds garbage.
                // SAFETY: b holds b.bytes bytes.
                unsafe { driver::memset_d8_async(b.ptr, 0, b.bytes, s)? };
            }
            Ok(())
        })();
        if let Err(e) = queued {
            // The init kernel may be queued: wait before `layer` frees its memory.
            let _ = layer.sh.internal.sync();
            return Err(e);
        }
        Ok(layer)
    }

    /// The copy kernels' word size for this layer's copies (the layer's
    /// addresses and sizes and `extra`): [`copy_width`].
    fn copy_width(&self, extra: &[u64]) -> u32 {
        let d = &self.dev;
        copy_width([d.chunk_bytes, d.stride, d.staging, d.host_tier].into_iter().chain(extra.iter().copied()))
    }

    /// Checks the engine's stream on every call (never the legacy one; of
    /// this device: a handle may have been destroyed and created again in
    /// another context). Returns it and its capture id (None: not being
    /// captured). Changes nothing.
    fn stream(&self, stream: StreamHandle) -> Result<(CUstream, Option<u64>)> {
        let s = stream as CUstream;
        check_stream_device(&self.sh.device, s)?;
        Ok((s, driver::capture_id(s)?))
    }

    /// Orders a call on `s` (already checked, about to launch) after the
    /// layer's eager work, on the device (cuStreamWaitEvent: no host wait):
    /// - eager, on another stream than the last eager call (another handle,
    ///   or `CU_STREAM_PER_THREAD`: one handle, a different stream in every
    ///   thread): waits for that call;
    /// - captured: the first call of the layer in each capture and stream
    ///   adds an external event-wait node, so every launch of the graph waits
    ///   for the layer's last eager call made before that launch (also when
    ///   none is recorded yet: the node then waits for whatever `done`
    ///   holds at launch).
    fn order(&mut self, s: CUstream, stream: StreamHandle, capture: Option<u64>) -> Result<()> {
        let handle = stream as usize;
        match capture {
            Some(id) => {
                if self.last_capture != Some((id, handle)) {
                    driver::stream_wait_event(s, &self.done, true)?;
                    self.last_capture = Some((id, handle));
                }
            }
            None => {
                if (handle != self.last_stream || handle == CU_STREAM_PER_THREAD) && self.recorded {
                    driver::stream_wait_event(s, &self.done, false)?;
                }
                self.last_stream = handle;
            }
        }
        Ok(())
    }

    /// Checks a device range on every call: a range freed and allocated
    /// again may now be smaller or another device's, so nothing is cached.
    fn check_range(&self, ptr: u64, bytes: u64, what: &str) -> Result<()> {
        check_device_range(&self.sh.device, ptr, bytes, what).map(|_| ())
    }

    /// Records `done` after a call's launches on `s`, also when one of them
    /// failed (`launched`): the kernels queued before it still run and a
    /// later wait must cover them. Captured calls are not recorded (they run
    /// when the graph is launched); the last eager record stays.
    fn after_launch(&mut self, s: CUstream, capturing: bool, launched: Result<()>) -> Result<()> {
        if capturing {
            return launched;
        }
        let recorded = match self.done.record(s) {
            Ok(()) => {
                self.recorded = true;
                Ok(())
            }
            Err(e) => {
                // `done` still holds an older call: wait for this one here,
                // so no later call depends on a record that was not made.
                // A queued error-record copy is not trusted then (the wait
                // may have failed): the record is read again.
                self.error_queued = false;
                let _ = driver::stream_sync(s);
                self.last_stream = usize::MAX;
                Err(e)
            }
        };
        launched.and(recorded)
    }

    /// Waits for this layer's last recorded call.
    fn wait(&mut self) -> Result<()> {
        if self.recorded {
            self.done.sync()?;
        }
        Ok(())
    }

    /// Copies `bytes` from device address `src` through the pinned readback
    /// buffer (sized at creation for the largest read) and waits for it.
    fn read_device(&mut self, src: u64, bytes: usize, s: CUstream) -> Result<Vec<u8>> {
        assert!(bytes <= self.readback.bytes, "readback buffer too small");
        // Every caller waited for the layer's last call first, so a queued
        // error-record copy has landed; this read replaces it.
        self.error_queued = false;
        // SAFETY: readback holds at least `bytes`; synced before reading.
        unsafe { driver::copy_dtoh_async(self.readback.host, src, bytes, s)? };
        driver::stream_sync(s)?;
        // SAFETY: the copy completed.
        Ok(unsafe { std::slice::from_raw_parts(self.readback.host, bytes) }.to_vec())
    }

    /// Reads `words` 32-bit words at word offset `off` of the metadata.
    fn read_meta(&mut self, off: usize, words: usize, s: CUstream) -> Result<Vec<u32>> {
        Ok(le_words(&self.read_device(self.dev.chunk_slot + 4 * off as u64, 4 * words, s)?))
    }

    /// Returns and clears the device error record (after `wait`).
    fn take_error(&mut self, s: CUstream) -> Result<()> {
        let e = self.read_meta(self.meta.err, 3, s)?;
        self.error_from_record(&e, s)
    }

    /// Calls that wait (`queue`: strict and not captured): queues the error
    /// record's copy into `readback` on `s` after the call's kernels and
    /// before `after_launch` records `done`, so the call's one host wait
    /// (`wait`) also covers the copy (`take_queued_error` then reads it
    /// without a second wait). Other calls clear the mark of an older copy.
    fn queue_error_read(&mut self, s: CUstream, queue: bool) {
        let src = self.dev.chunk_slot + 4 * self.meta.err as u64;
        // SAFETY: readback holds at least the 3 words of the error record
        // (it is sized for the metadata); it is read only after `wait`.
        self.error_queued = queue && unsafe { driver::copy_dtoh_async(self.readback.host, src, 12, s) }.is_ok();
    }

    /// [`Self::take_error`] after `wait`, from the copy `queue_error_read` queued
    /// when it could (else read now).
    fn take_queued_error(&mut self, s: CUstream) -> Result<()> {
        if !std::mem::take(&mut self.error_queued) {
            return self.take_error(s);
        }
        // SAFETY: the copy was queued before `done` was recorded and `wait`
        // returned: its 3 words are in place.
        let e = le_words(unsafe { std::slice::from_raw_parts(self.readback.host, 12) });
        self.error_from_record(&e, s)
    }

    /// The error record `e` (code, position, id) as a result; a set record
    /// is cleared on the device first.
    fn error_from_record(&mut self, e: &[u32], s: CUstream) -> Result<()> {
        if e[0] == 0 {
            return Ok(());
        }
        // SAFETY: the err record is 4 words of this layer's metadata.
        unsafe { driver::memset_d32_async(self.dev.err, 0, 4, s)? };
        driver::stream_sync(s)?;
        let (code, pos, id) = (e[0], e[1], e[2] as i32);
        let layer = self.plan.index;
        let pos = pos as usize;
        Err(match code {
            ERR_OUT_OF_RANGE => self.plan.entry_error(EntryError::OutOfRange { pos, id }),
            ERR_NOT_STORED => self.plan.entry_error(EntryError::NotStored { pos, id }),
            ERR_VALIDATION => Error::new(
                KvswapStatus::ValidationFailed,
                format!("layer {layer}: the slot of chunk {id} (position {pos}) differs from its host copy"),
            ),
            c => Error::device(format!("layer {layer}: unknown device error code {c}")),
        })
    }

    fn scratch(&mut self, bytes: usize) -> Result<u64> {
        if self.scratch.as_ref().is_none_or(|b| b.bytes < bytes) {
            self.scratch = Some(DeviceBuffer::alloc(bytes.next_power_of_two(), "host-slice scratch")?);
        }
        Ok(self.scratch.as_ref().unwrap().ptr)
    }

    /// Launches the store kernel for distinct `(id, row)` pairs.
    fn launch_store(&mut self, pairs: &[(u32, u32)], src: u64, src_stride: u64, s: CUstream) -> Result<()> {
        let width = self.copy_width(&[src, src_stride]);
        let pieces = (self.plan.chunk_bytes as u64).div_ceil(2048);
        for batch in pairs.chunks(STORE_MAX) {
            let mut ids = StoreIds { n: batch.len() as u32, ids: [0; STORE_MAX], rows: [0; STORE_MAX] };
            for (k, &(id, row)) in batch.iter().enumerate() {
                ids.ids[k] = id;
                ids.rows[k] = row;
            }
            let warps = batch.len() as u64 * pieces;
            let grid = warps.div_ceil(8).clamp(1, self.sh.device.sm_count as u64 * 16) as u32;
            let (mut d, mut src, mut stride, mut width) = (self.dev, src, src_stride, width);
            let mut params = kernel_params![d, src, stride, ids, width];
            // SAFETY: parameters match kvswap_store(LayerDev, const u8*, u64, StoreIds, u32);
            // src rows were range-checked by the caller.
            unsafe { self.sh.kernels.store.launch(grid, 256, 0, s, &mut params)? };
        }
        Ok(())
    }

    /// Threads and dynamic shared memory of the residency kernel for a call
    /// of `count` entries (count <= slots, checked at creation, so the
    /// shared memory fits u32 and the device's limit).
    fn swap_shape(&self, count: u32) -> (u32, u32) {
        let n = if self.dev.identity != 0 { count } else { count.max(self.dev.slots) };
        let threads = n.next_multiple_of(32).clamp(64, 1024);
        let smem = if self.dev.identity != 0 { 0 } else { swap_smem(count, self.dev.slots) as u32 };
        (threads, smem)
    }

    /// Launches the residency kernel, the gather and (optionally) validation.
    /// `capturing`: `s` is being captured (a failed launch is returned, and
    /// the capture must be discarded, rather than the layer marked unusable).
    fn launch_swap(&mut self, indices: u64, window_len: u32, count: u32, strict: bool, s: CUstream, capturing: bool) -> Result<()> {
        let k = &self.sh.kernels;
        let (threads, smem) = self.swap_shape(count);
        let (mut d, mut idx, mut win, mut cnt, mut st) = (self.dev, indices, window_len, count, strict as u32);
        let mut params = kernel_params![d, idx, win, cnt, st];
        // SAFETY: parameters match kvswap_swap_in(LayerDev, i32*, u32, u32, u32);
        // indices were range-checked for window_len + count ints; smem is
        // within the limit checked at creation (count <= slots).
        unsafe { k.swap_in.launch(1, threads, smem, s, &mut params)? };
        if self.dev.identity == 0 && count > 0 {
            let pieces = (self.plan.chunk_bytes as u64).div_ceil(2048);
            let grid = (count as u64 * pieces).div_ceil(8).clamp(1, self.sh.device.sm_count as u64 * 16) as u32;
            let mut width = self.copy_width(&[]);
            let mut params = kernel_params![d, width];
            // The residency kernel is queued and will map the misses to
            // slots: without the gather those slots would hold stale bytes.
            // If it cannot be launched at all, an eager call leaves the layer
            // unusable, and a captured one returns the error (the capture
            // must be discarded): its error names the first cause.
            let index = self.plan.index;
            // SAFETY: parameters match kvswap_gather(LayerDev, u32).
            if let Err((e1, e2)) = unsafe { self.sh.launch_gather(&k.gather, (grid, 1), s, &mut params, || format!("layer {index}")) } {
                if capturing {
                    return Err(Error::new(e1.status, format!("{} (retried as a plain launch: {})", e1.message, e2.message)));
                }
                let text = format!(
                    "layer {}: a swap-in's copy kernel could not be launched after its residency update \
                     ({}; retried: {}), so some slots are mapped to chunks whose bytes were never copied; \
                     forget all its chunks (kvswap_layer_forget) or destroy the context",
                    self.plan.index, e1.message, e2.message
                );
                self.broken = Some(text.clone());
                return Err(Error::device(text));
            }
        }
        if self.validate && count > 0 {
            let grid = (count as u64).div_ceil(8).clamp(1, self.sh.device.sm_count as u64 * 8) as u32;
            let mut params = kernel_params![d, idx, win, cnt];
            // SAFETY: parameters match kvswap_validate(LayerDev, const i32*, u32, u32).
            unsafe { k.validate.launch(grid, 256, 0, s, &mut params)? };
        }
        Ok(())
    }
}

impl Drop for CudaLayer {
    fn drop(&mut self) {
        // Frees need the context only for bookkeeping; bind it so the
        // engine's current context is untouched.
        if let Ok(_g) = self.sh.device.bind() {
            let _ = self.wait();
            self.scratch = None;
        }
    }
}

impl LayerOps for CudaLayer {
    unsafe fn store(&mut self, ids: &[u32], src: u64, src_stride: usize, stream: StreamHandle) -> Result<()> {
        let _g = self.sh.device.bind()?;
        let (s, capture) = self.stream(stream)?;
        let n = self.plan.chunk_bytes as u64;
        self.check_range(src, (ids.len() as u64 - 1) * src_stride as u64 + n, "src")?;
        let pairs = dedup_last(ids, self.plan.compressed_cap)?;
        self.order(s, stream, capture)?;
        let launched = self.launch_store(&pairs, src, src_stride as u64, s);
        self.after_launch(s, capture.is_some(), launched)
    }

    unsafe fn swap_in(&mut self, indices: u64, window_len: u32, count: u32, src_ids: u64, stream: StreamHandle) -> Result<()> {
        let _g = self.sh.device.bind()?;
        let (s, capture) = self.checked_swap_in(indices, window_len, count, src_ids, stream)?;
        self.order(s, stream, capture)?;
        let launched = if src_ids != 0 && count > 0 {
            // SAFETY: both ranges checked above (device memory of this
            // device); the caller guarantees they do not overlap.
            unsafe { driver::copy_dtod_async(indices + 4 * window_len as u64, src_ids, 4 * count as usize, s) }
        } else {
            Ok(())
        };
        let launched = launched.and_then(|()| self.launch_swap(indices, window_len, count, self.strict, s, capture.is_some()));
        self.queue_error_read(s, self.strict && capture.is_none());
        let launched = self.after_launch(s, capture.is_some(), launched);
        if self.strict {
            // Waited for and read also when a launch failed: a kernel queued
            // before it may have recorded a refusal, which a later call would
            // otherwise report as its own. The launch's error comes first.
            let recorded = self.wait().and_then(|()| self.take_queued_error(s));
            return launched.and(recorded);
        }
        launched
    }

    fn forget(&mut self, first: u32, n: u32, stream: StreamHandle) -> Result<()> {
        let _g = self.sh.device.bind()?;
        let (s, capture) = self.stream(stream)?;
        if n == 0 {
            return Ok(());
        }
        self.order(s, stream, capture)?;
        // Stored-bit words to clear, about 1024 per block (grid-stride, at
        // most 4 blocks per SM); block 0 also reorders the slots, so a
        // swapping layer's blocks take up to 1024 threads.
        let words = ((first + n - 1) / 32 - first / 32 + 1) as u64;
        let grid = words.div_ceil(1024).clamp(1, self.sh.device.sm_count as u64 * 4) as u32;
        let threads = if self.dev.identity != 0 { 256 } else { self.plan.slots.next_multiple_of(32).clamp(256, 1024) };
        let (mut d, mut f, mut cnt) = (self.dev, first, n);
        let mut params = kernel_params![d, f, cnt];
        // SAFETY: parameters match kvswap_forget(LayerDev, u32, u32); the
        // context checked first + n <= compressed_cap.
        let launched = unsafe { self.sh.kernels.forget.launch(grid, threads, 0, s, &mut params) };
        let ok = launched.is_ok();
        let recorded = self.after_launch(s, capture.is_some(), launched);
        // Every slot is empty once this runs, and every later call of the
        // layer is ordered after it: the slots match their chunks again.
        if ok && capture.is_none() && first == 0 && n == self.plan.compressed_cap {
            self.broken = None;
        }
        recorded
    }

    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }

    fn check_swap_in(&self, indices: u64, window_len: u32, count: u32, src_ids: u64, stream: StreamHandle) -> Result<()> {
        let _g = self.sh.device.bind()?;
        self.checked_swap_in(indices, window_len, count, src_ids, stream).map(|_| ())
    }

    /// Queues kvswap_check_entries on `stream` (strict layers only: others
    /// turn refused ids into -1 with a deferred error); `entries_checked`
    /// waits for it and reads the layer's error record.
    unsafe fn check_entries(&mut self, indices: u64, window_len: u32, count: u32, src_ids: u64, stream: StreamHandle) -> Result<()> {
        if !self.strict || count == 0 {
            return Ok(());
        }
        let _g = self.sh.device.bind()?;
        // The buffers, the stream and the capture rule were checked by
        // check_swap_in (the caller's contract); only the stream is needed.
        let (s, capture) = self.stream(stream)?;
        self.order(s, stream, capture)?;
        let (mut d, mut ids, mut cnt) = (self.dev, crate::backend::ids_addr(indices, window_len, src_ids), count);
        let mut params = kernel_params![d, ids, cnt];
        let threads = count.next_multiple_of(32).min(1024);
        // SAFETY: parameters match kvswap_check_entries(LayerDev, const i32*, u32);
        // `count` ids there (check_swap_in checked both ranges).
        let launched = unsafe { self.sh.kernels.check_entries.launch(1, threads, 0, s, &mut params) };
        // Pending also when the launch failed: `done` may cover earlier work.
        self.entries_pending = true;
        self.queue_error_read(s, capture.is_none());
        self.after_launch(s, capture.is_some(), launched)
    }

    fn entries_checked(&mut self) -> Result<()> {
        if !self.entries_pending {
            return Ok(());
        }
        let _g = self.sh.device.bind()?;
        self.wait()?; // still pending if the wait fails: the next call collects it
        self.entries_pending = false;
        self.take_queued_error(self.sh.internal.0)
    }

    fn stats(&mut self, take_error: bool) -> Result<KvswapLayerStats> {
        let _g = self.sh.device.bind()?;
        self.wait()?;
        let s = self.sh.internal.0;
        if take_error {
            self.take_error(s)?;
        }
        let w = self.read_meta(self.meta.stats, 16, s)?;
        let c = |i: usize| w[2 * i] as u64 | (w[2 * i + 1] as u64) << 32;
        let resident = self.residency_pairs(s)?.len() as u32;
        Ok(KvswapLayerStats {
            hits: c(0),
            misses: c(1),
            evictions: c(2),
            stores: c(3),
            refreshes: c(4),
            h2d_bytes: c(5),
            d2h_bytes: c(6),
            swap_in_calls: c(7),
            compressed_cap: self.plan.compressed_cap as u64,
            chunk_bytes: self.plan.chunk_bytes as u64,
            slots: self.plan.slots,
            resident,
            swap_enabled: self.plan.swap as u32,
            reserved: 0,
        })
    }

    fn sync(&mut self) -> Result<()> {
        let _g = self.sh.device.bind()?;
        self.wait()?;
        let s = self.sh.internal.0;
        self.take_error(s)?;
        self.check_usable()
    }

    fn staging(&self) -> StagingView {
        StagingView { ptr: self.dev.staging, stride: self.dev.stride, rows: self.plan.slots }
    }

    fn residency(&mut self) -> Result<Vec<(u32, u32)>> {
        let _g = self.sh.device.bind()?;
        self.wait()?;
        let s = self.sh.internal.0;
        self.residency_pairs(s)
    }

    fn read_slot(&mut self, slot: u32) -> Result<Vec<u8>> {
        let _g = self.sh.device.bind()?;
        self.wait()?;
        let s = self.sh.internal.0;
        let src = self.dev.staging + slot as u64 * self.dev.stride;
        let mut row = vec![0u8; self.plan.chunk_bytes];
        // SAFETY: `row` holds chunk_bytes and outlives the copy (synced below).
        unsafe { driver::copy_dtoh_async(row.as_mut_ptr(), src, row.len(), s)? };
        driver::stream_sync(s)?;
        Ok(row)
    }

    fn store_host(&mut self, ids: &[u32], rows: &[u8]) -> Result<()> {
        let _g = self.sh.device.bind()?;
        self.wait()?;
        self.last_stream = usize::MAX;
        let s = self.sh.internal.0;
        let pairs = dedup_last(ids, self.plan.compressed_cap)?;
        let dst = self.scratch(rows.len())?;
        // SAFETY: scratch holds rows.len() bytes; synced before `rows` is released.
        unsafe { driver::copy_htod_async(dst, rows.as_ptr(), rows.len(), s)? };
        // Waited for also when a launch failed: earlier ones may be queued.
        let launched = self.launch_store(&pairs, dst, self.plan.chunk_bytes as u64, s);
        driver::stream_sync(s)?;
        self.recorded = false;
        launched
    }

    fn swap_in_host(&mut self, indices: &mut [i32], window_len: u32) -> Result<()> {
        self.check_usable()?;
        let _g = self.sh.device.bind()?;
        self.wait()?;
        self.last_stream = usize::MAX;
        let s = self.sh.internal.0;
        let bytes = indices.len() * 4;
        let count = (indices.len() - window_len as usize) as u32;
        let dst = self.scratch(bytes)?;
        // SAFETY: scratch holds `bytes`; every copy is synced before returning.
        unsafe { driver::copy_htod_async(dst, indices.as_ptr() as *const u8, bytes, s)? };
        // SAFETY (copy back): as above. Waited for also when a launch failed:
        // earlier ones may be queued.
        let launched = self
            .launch_swap(dst, window_len, count, self.strict, s, false)
            .and_then(|()| unsafe { driver::copy_dtoh_async(indices.as_mut_ptr() as *mut u8, dst, bytes, s) });
        self.queue_error_read(s, self.strict); // covered by the wait below
        driver::stream_sync(s)?;
        self.recorded = false;
        launched?;
        if self.strict {
            self.take_queued_error(s)?;
        }
        Ok(())
    }
}

impl CudaLayer {
    /// The checks of `swap_in` (device bound): the layer is usable, the
    /// stream is this device's (and not captured with KVSWAP_SYNC=1), the
    /// index buffer and `src_ids` are device memory of their length.
    /// Returns the stream and its capture id.
    fn checked_swap_in(&self, indices: u64, window_len: u32, count: u32, src_ids: u64, stream: StreamHandle) -> Result<(CUstream, Option<u64>)> {
        self.check_usable()?; // first: an unusable layer says so whatever else is wrong
        let (s, capture) = self.stream(stream)?;
        if self.strict && capture.is_some() {
            return Err(Error::invalid(
                "KVSWAP_SYNC=1 waits for the device and cannot be captured in a CUDA graph; use KVSWAP_SYNC=0",
            ));
        }
        self.check_buffers(indices, window_len, count, src_ids)?;
        Ok((s, capture))
    }

    /// The layer is usable, and the index buffer and `src_ids` (when not 0)
    /// are device memory of this device, of their length.
    fn check_buffers(&self, indices: u64, window_len: u32, count: u32, src_ids: u64) -> Result<()> {
        self.check_usable()?;
        self.check_range(indices, 4 * (window_len as u64 + count as u64), "indices")?;
        if src_ids != 0 {
            self.check_range(src_ids, 4 * count as u64, "topk")?;
        }
        Ok(())
    }

    /// Refuses work on a layer whose slots no longer match their chunks.
    fn check_usable(&self) -> Result<()> {
        match &self.broken {
            Some(text) => Err(Error::device(text.clone())),
            None => Ok(()),
        }
    }

    fn residency_pairs(&mut self, s: CUstream) -> Result<Vec<(u32, u32)>> {
        if self.dev.identity != 0 {
            let bits = self.read_meta(self.meta.stored, (self.plan.compressed_cap as usize).div_ceil(32), s)?;
            return Ok((0..self.plan.compressed_cap).filter(|&i| bits[(i / 32) as usize] >> (i % 32) & 1 == 1).map(|i| (i, i)).collect());
        }
        let chunks = self.read_meta(self.meta.slot_chunk, self.plan.slots as usize, s)?;
        Ok(chunks.iter().enumerate().filter(|(_, &c)| c != u32::MAX).map(|(sl, &c)| (sl as u32, c)).collect())
    }
}
