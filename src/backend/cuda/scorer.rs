//! The FlashMemory scorer on CUDA (kernels/scorer/): projections (one GEMV
//! over all scorers; a batch's launch group of up to 64 sequences is one
//! launch whose blocks for 8 sequences at a time read each weight row
//! together),
//! tensor-core scoring with the ensemble fused in, and an exact top-k (filed
//! by fm_select, ranked by fm_order). Four or five launches per launch group
//! (up to 64 sequences of one key dtype), chained by programmatic dependent
//! launch on Hopper. No host synchronisation unless `sync` is set, except
//! when a stream's workspace is made or grown and after a failed launch (both
//! refused or skipped while the stream is captured), so a decode step can be
//! captured in a CUDA graph (scorer -> swap-in -> attention).
//!
//! Errors found on the device (non-finite hidden values, non-finite scores)
//! turn the output into -1 padding and are recorded; with `sync` the call
//! waits and returns them, otherwise `sync_errors` (fm_scorer_sync) does.

use super::driver::{self, kernel_params, CUstream, Device, DeviceBuffer, Kernel, Module, PinnedBuffer, TensorMap};
use crate::backend::{BackendKind, StreamHandle};
use crate::config::Ensemble;
use crate::error::{Error, KvswapStatus, Result};
use crate::scorer::backend::{BoundsBackend, BoundsRef, KeysRef, ScoreMode, ScorerBackend, SeqRef};
use crate::scorer::{args, Checkpoint, KeyDtype, WeightDtype};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

/// Sequences per launch (`FM_MAX_BATCH` in kernels/scorer/project.cu);
/// internal: a batch call splits longer batches.
/// cbindgen:ignore
pub const MAX_BATCH: usize = 64;
const HIST: usize = 4096;
/// fm_score_wg: warpgroups per block and tiles in flight per warpgroup
/// (WG_GROUPS, WG_STAGES in kernels/scorer/score_wgmma.cu).
const WG_GROUPS: usize = 3;
const WG_STAGES: usize = 3;
/// Words of a sequence's global histogram: HIST fine + 64 coarse bins (FM_HIST_WORDS).
const HIST_WORDS: usize = HIST + 64;
const TOPK_MAX: usize = 2048;
/// fm_select: threads per block and keys per thread (FM_SEL_THREADS,
/// FM_SEL_ITEMS).
const SEL_THREADS: u32 = 512;
const SEL_ITEMS: u32 = 4;
/// fm_order: candidates it ranks in parallel, per block, and threads per
/// block (FM_ORDER_MAX, FM_ORDER_CANDS, FM_ORDER_THREADS).
const ORDER_MAX: u32 = 4096;
const ORDER_CANDS: u32 = 64;
const ORDER_THREADS: u32 = 512;
// The selection state packs a sequence's tie count in 24 bits (FM_MAX_CHUNKS in kernels/scorer/topk.cu).
const _: () = assert!(crate::scorer::FM_MAX_CHUNKS < 1 << 24);
// Sequence indices travel as u16 (ProjBatch / ScoreBatch `id`).
const _: () = assert!(crate::scorer::FM_MAX_SEQS <= 1 << 16);
/// The batched projection (fm_project_*_b8) works on groups of PROJECT_GROUP
/// sequences, staging PROJECT_KT hidden elements of each per pass
/// (`FM_PROJ_GROUP`, `FM_PROJ_KT`).
const PROJECT_GROUP: u32 = 8;
const PROJECT_KT: u32 = 1024;
/// Dynamic shared memory of fm_project_*_b1 (none: it reads the hidden state
/// through L1) and fm_project_*_b8 (PROJECT_GROUP x PROJECT_KT floats).
const PROJECT_SMEM: [u32; 2] = [0, PROJECT_GROUP * PROJECT_KT * 4];
/// Warps per block of fm_project_*_b1 and _b8 (`FM_PROJ_ROWS1`,
/// `FM_PROJ_ROWS`), each owning PROJECT_RPW rows.
const PROJECT_WARPS: [u32; 2] = [4, 16];
/// Weight rows per warp of fm_project_*_b1 and _b8 (`FM_PROJ_RPW8`).
const PROJECT_RPW: [u32; 2] = [1, 2];
const ERR_HIDDEN: u32 = 1;
const ERR_SCORE: u32 = 2;
const ERR_BOUNDS: u32 = 3;

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct ProjSeq {
    hidden: u64,
    q: u64,
    w: u64,
}

#[repr(C)]
struct ProjBatch {
    n: u32,
    seq: [ProjSeq; MAX_BATCH],
    /// Each sequence's index in the caller's batch (named by error records).
    id: [u16; MAX_BATCH],
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct ScoreSeq {
    keys: u64,
    scales: u64,
    q: u64,
    w: u64,
    skey: u64,
    hist: u64,
    stride: u32,
    n: u32,
}

/// Whether fm_score_wg_fp8q_tma has been launched (its first launch is logged).
static TMA_SEEN: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// What a `TmaMaps` describes: keys, scales, chunks, row stride.
type TmaKey = (u64, u64, usize, u32);

/// fm_score_wg_fp8q_tma's tensor maps (kernels/scorer/score_wgmma_fp8.cu
/// TmaMaps): the keys (128-byte rows of `head_dim` fp8 codes, `stride`
/// apart, boxes of 64 rows with the 128-byte swizzle) and their f32 scales
/// (boxes of 64), for one sequence.
#[repr(C)]
#[derive(Clone, Copy)]
struct TmaMaps {
    map: [TensorMap; 2],
}

impl TmaMaps {
    fn new(keys: u64, scales: u64, n: usize, stride: u32, head_dim: usize) -> Result<TmaMaps> {
        Ok(TmaMaps {
            map: [
                TensorMap::rows_u8_swizzle128(keys, head_dim as u32, n as u64, stride as u64, 64)?,
                TensorMap::f32_vector(scales, n as u64, 64)?,
            ],
        })
    }
}

#[repr(C)]
struct ScoreBatch {
    n_seqs: u32,
    dtype: u32,
    mean: u32,
    pad: u32,
    seq: [ScoreSeq; MAX_BATCH],
    /// Each sequence's index in the caller's batch (named by error records).
    id: [u16; MAX_BATCH],
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct SelectSeq {
    skey: u64,
    hist: u64,
    st: u64,
    sure: u64,
    tie: u64,
    out: u64,
    n: u32,
    pad: u32,
}

/// Bit position of the tie count in the selection state's `filed` word
/// (FM_ST_TIE_SHIFT), which sits at byte 8 of the state.
const ST_TIE_SHIFT: u32 = 20;
/// Bytes of a sequence's selection state (SelectState in topk.cu): append
/// cursors, the published counts, and fm_order's merge-tree lengths and
/// arrival counts.
const SELECT_STATE_BYTES: usize = 384;

#[repr(C)]
struct SelectBatch {
    n_seqs: u32,
    k: u32,
    seq: [SelectSeq; MAX_BATCH],
}

/// The workspace of stream `s`: its handle, except CU_STREAM_PER_THREAD, one
/// handle that names a different stream in every thread: there, this
/// thread's (calls of two threads must not share buffers).
fn workspace_key(s: CUstream) -> u64 {
    if s as usize != super::CU_STREAM_PER_THREAD {
        return s as u64;
    }
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    thread_local!(static ID: u64 = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
    (1 << 63) | ID.with(|id| *id)
}

/// Per-stream scratch: a stream orders its own calls, so eager calls on
/// different streams never share buffers (a graph uses the workspace of the
/// stream it was captured on, wherever it is launched: the header states
/// the condition). The per-chunk buffers (`skey`, `tie`) hold the chunks of
/// one launch group back to back: `chunks` is their total.
struct Workspace {
    seqs: usize,
    chunks: usize,
    q: DeviceBuffer,
    w: DeviceBuffer,
    skey: DeviceBuffer,
    hist: DeviceBuffer,
    state: DeviceBuffer,
    sure: DeviceBuffer,
    tie: DeviceBuffer,
    err: DeviceBuffer,
    readback: PinnedBuffer,
    /// A call was captured on this stream: a graph holding it records its
    /// errors here wherever it is launched (see `Workspaces::sync_errors`).
    captured: AtomicBool,
    /// The TMA kernel's last tensor maps and what they describe (keys,
    /// scales, chunks, stride): a decode loop's calls on one stream reuse
    /// them instead of encoding two maps on the host every call.
    tma_maps: std::cell::Cell<Option<(TmaKey, TmaMaps)>>,
}

impl Workspace {
    fn new(seqs: usize, chunks: usize, q_elems: usize, w_elems: usize) -> Result<Workspace> {
        let ws = Workspace {
            seqs,
            chunks,
            q: DeviceBuffer::alloc(seqs * q_elems * 2, "scorer q")?,
            w: DeviceBuffer::alloc(seqs * w_elems * 4, "scorer w")?,
            skey: DeviceBuffer::alloc(chunks * 4, "scorer keys")?,
            hist: DeviceBuffer::alloc(seqs * HIST_WORDS * 4, "scorer histograms")?,
            state: DeviceBuffer::alloc(seqs * SELECT_STATE_BYTES, "scorer select state")?,
            sure: DeviceBuffer::alloc(seqs * TOPK_MAX * 8, "scorer candidates")?,
            tie: DeviceBuffer::alloc(chunks * 8, "scorer candidates")?,
            err: DeviceBuffer::alloc(16, "scorer error")?,
            readback: PinnedBuffer::alloc(16)?,
            captured: AtomicBool::new(false),
            tma_maps: std::cell::Cell::new(None),
        };
        Ok(ws)
    }

    /// Zeroes the histogram, selection state and error record (the kernels
    /// keep them zeroed afterwards) and waits.
    fn clear(&self, s: CUstream) -> Result<()> {
        // SAFETY: the error record is 4 words.
        unsafe { driver::memset_d32_async(self.err.ptr, 0, 4, s)? };
        self.reset_selection(s)
    }

    /// Zeroes the histograms and selection state (fm_order leaves them so;
    /// a call whose later launch failed may not have) and waits.
    fn reset_selection(&self, s: CUstream) -> Result<()> {
        // SAFETY: each buffer holds the number of words cleared.
        unsafe {
            driver::memset_d32_async(self.hist.ptr, 0, self.seqs * HIST_WORDS, s)?;
            driver::memset_d32_async(self.state.ptr, 0, self.seqs * SELECT_STATE_BYTES / 4, s)?;
        }
        driver::stream_sync(s)
    }

    /// Reads and clears the error record; the caller has waited for the stream.
    fn take_error(&self, s: CUstream) -> Result<()> {
        // SAFETY: readback holds 16 bytes; synced before reading.
        unsafe { driver::copy_dtoh_async(self.readback.host, self.err.ptr, 16, s)? };
        driver::stream_sync(s)?;
        // SAFETY: the copy completed; 4 aligned words.
        let e = unsafe { std::slice::from_raw_parts(self.readback.host as *const u32, 4) }.to_vec();
        if e[0] == 0 {
            return Ok(());
        }
        // SAFETY: 4 words of err.
        unsafe { driver::memset_d32_async(self.err.ptr, 0, 4, s)? };
        driver::stream_sync(s)?;
        Err(match e[0] {
            ERR_HIDDEN => Error::invalid(format!(
                "hidden: non-finite value (NaN or infinity) in scorer {}'s input at position {} (sequence {}); the top-k was written as -1",
                e[1], e[2], e[3]
            )),
            ERR_SCORE => Error::invalid(format!(
                "chunk {} (sequence {}): non-finite score (a NaN or infinite key or scale, or an f32 overflow); \
                 the top-k was written as -1",
                e[1], e[2]
            )),
            ERR_BOUNDS => Error::invalid(format!(
                "bounds of chunk {}: a minimum above its maximum, or a NaN or infinite bound; the top-k was written as -1",
                e[1]
            )),
            c => Error::device(format!("scorer: unknown device error code {c}")),
        })
    }
}

struct Launch {
    device: Device,
    pdl: bool,
}

impl Launch {
    /// Launches `k`, as a programmatic dependent of the previous kernel on
    /// Hopper (the kernel waits with griddepcontrol.wait).
    ///
    /// # Safety
    /// As `Kernel::launch`.
    unsafe fn dependent(&self, k: &Kernel, grid: (u32, u32), block: u32, smem: u32, s: CUstream, params: &mut [*mut c_void]) -> Result<()> {
        // SAFETY: forwarded.
        unsafe {
            if self.pdl {
                k.launch_dependent_2d(grid, block, smem, s, params)
            } else {
                k.launch_2d(grid, block, smem, s, params)
            }
        }
    }
}

/// Opens `device` for a scorer; a failure says that device -1 scores on the CPU.
fn open_device(device: i32) -> Result<Device> {
    let d = Device::open(device)
        .map_err(|e| Error::new(e.status, format!("CUDA scorer on device {device}: {}; device -1 scores on the CPU", e.message)))?;
    driver::check_driver_version("the CUDA scorer")?;
    Ok(d)
}

/// The engine's stream, checked (not the legacy stream; of this device).
fn check_stream(device: &Device, stream: StreamHandle) -> Result<CUstream> {
    let s = stream as CUstream;
    super::check_stream_device(device, s)?;
    Ok(s)
}

fn check_device_ptr(device: &Device, ptr: u64, bytes: u64, what: &str) -> Result<()> {
    super::check_device_range(device, ptr, bytes, what).map(|_| ())
}

/// One stream's workspace, locked for the length of a call on that stream
/// (calls on other streams take their own).
type Slot = Arc<Mutex<Option<Workspace>>>;

/// The shape (sequences, chunks) a workspace of shape `old` grows to for a
/// call of `seqs` sequences and `chunks` chunks in all, both rounded up to a
/// power of two (sequences up to MAX_BATCH, a launch group's most): a batch
/// that grows one sequence at a time regrows log2(64) + 1 times at most, not
/// 64 times.
fn grown_shape(old: Option<(usize, usize)>, seqs: usize, chunks: usize) -> (usize, usize) {
    let (old_s, old_c) = old.unwrap_or((0, 0));
    (seqs.max(old_s).next_power_of_two().min(MAX_BATCH.max(seqs)), chunks.max(old_c).next_power_of_two())
}

/// The workspaces of a scorer, one per stream, and the ones replaced by
/// larger ones that a call was captured into, kept until the scorer is
/// freed: a CUDA graph captured before the growth still addresses them (and
/// their error records). Replaced workspaces without a capture are freed.
#[derive(Default)]
struct Workspaces {
    slots: Mutex<HashMap<u64, Slot>>,
    retired: Mutex<Vec<(u64, Workspace)>>,
}

impl Workspaces {
    /// The slot of stream `s` (made empty on first use).
    fn slot(&self, s: CUstream) -> Slot {
        self.slots.lock().unwrap_or_else(|p| p.into_inner()).entry(workspace_key(s)).or_default().clone()
    }

    /// `ws` (stream `s`'s) made or grown to `seqs` sequences of `chunks`
    /// chunks in all (q and w sized for `q_elems` / `w_elems` per sequence). Neither can happen while `s`
    /// is captured: the graph would address a buffer allocated inside its
    /// capture. A grown workspace takes over the old one's error record, so
    /// a pending error is still reported; the old one is freed, or retired
    /// if a call was captured into it.
    /// `capturing`: `s` is being captured (the caller asked once per call).
    #[allow(clippy::too_many_arguments)]
    fn ensure<'a>(
        &self,
        ws: &'a mut Option<Workspace>,
        s: CUstream,
        capturing: bool,
        seqs: usize,
        chunks: usize,
        q_elems: usize,
        w_elems: usize,
    ) -> Result<&'a Workspace> {
        if !ws.as_ref().is_some_and(|w| w.seqs >= seqs && w.chunks >= chunks) {
            if capturing {
                return Err(Error::invalid(format!(
                    "the scorer's workspace for this stream is smaller than this call ({seqs} sequences, {chunks} chunks) \
                     and cannot grow while the stream is captured: reserve it before capturing \
                     (fm_scorer_reserve, fm_bounds_reserve) or make a call of this size first"
                )));
            }
            let (new_s, new_c) = grown_shape(ws.as_ref().map(|w| (w.seqs, w.chunks)), seqs, chunks);
            let new = Workspace::new(new_s, new_c, q_elems, w_elems)?;
            new.clear(s)?;
            if let Some(old) = ws.as_ref() {
                // The pending error moves to the new record (one record holds
                // it, so it is returned once). A graph captured into the old
                // one may still report there: the flag that lets other
                // streams' syncs read these records is copied along.
                // SAFETY: both error records are 16 bytes; synced below.
                unsafe {
                    driver::copy_dtod_async(new.err.ptr, old.err.ptr, 16, s)?;
                    driver::memset_d32_async(old.err.ptr, 0, 4, s)?;
                }
                driver::stream_sync(s)?;
                new.captured.store(old.captured.load(Ordering::Relaxed), Ordering::Relaxed);
            }
            // A workspace no call was captured into is freed at once: this
            // stream's calls are done with it (waited for above) and no
            // graph addresses it. A captured one stays for the graphs.
            if let Some(old) = ws.replace(new).filter(|old| old.captured.load(Ordering::Relaxed)) {
                self.retired.lock().unwrap_or_else(|p| p.into_inner()).push((workspace_key(s), old));
            }
        } else if capturing {
            ws.as_ref().unwrap().captured.store(true, Ordering::Relaxed);
        }
        Ok(ws.as_ref().unwrap())
    }

    /// `ensure` on `stream` (checked, of `device`) outside any call:
    /// `fm_scorer_reserve` and `fm_bounds_reserve`. Refused while the
    /// stream is captured (nothing can be allocated inside a capture).
    fn reserve(&self, device: &Device, stream: StreamHandle, seqs: usize, chunks: usize, q_elems: usize, w_elems: usize) -> Result<()> {
        let _g = device.bind()?;
        let s = check_stream(device, stream)?;
        if driver::is_capturing(s)? {
            return Err(Error::invalid(
                "the stream is being captured: its scorer workspace cannot be allocated inside a capture; reserve before capturing",
            ));
        }
        // As in CudaScorer::run: lines logged under the lock wait for it.
        let _quiet = crate::logging::defer();
        let slot = self.slot(s);
        let mut held = slot.lock().unwrap_or_else(|p| p.into_inner());
        self.ensure(&mut held, s, false, seqs, chunks, q_elems, w_elems).map(|_| ())
    }

    /// Waits for `stream` (checked, of `device`, not being captured: the
    /// wait would end the capture) and returns (clearing it) the first error
    /// its calls recorded: in its workspace, or in one it outgrew (a graph
    /// captured before the growth records there). When there is none, the
    /// first error recorded for a stream that calls were captured on: a
    /// graph records where it was captured, and may have been launched on
    /// `stream` (PyTorch captures on a side stream and replays on the current
    /// one). Only the record returned is cleared, so every error is returned
    /// once, by some sync. Every record is read after this stream's wait
    /// only: a launch elsewhere of a graph captured on this stream or on
    /// another capture stream, or a call on another capture stream, may
    /// still write one meanwhile (the header states the condition).
    fn sync_errors(&self, device: &Device, stream: StreamHandle) -> Result<()> {
        let _g = device.bind()?;
        let s = stream as CUstream;
        super::check_waitable(device, s, "wait for it")?;
        driver::stream_sync(s)?;
        let key = workspace_key(s);
        let slots: Vec<(u64, Slot)> =
            self.slots.lock().unwrap_or_else(|p| p.into_inner()).iter().map(|(k, v)| (*k, v.clone())).collect();
        self.take_first_error(&slots, key, s, |_| true)?;
        for &(k, _) in slots.iter().filter(|(k, _)| *k != key) {
            self.take_first_error(&slots, k, s, |ws| ws.captured.load(Ordering::Relaxed))?;
        }
        Ok(())
    }

    /// Returns (clearing it, on `s`, already waited for) the first error
    /// recorded in stream `key`'s workspace or in one it outgrew, among those
    /// that pass `take`; the other records stay for a later sync. The slot
    /// is locked meanwhile (a call holds it while it grows the workspace and
    /// launches, and with KVSWAP_SYNC=1 while it waits), then the retired
    /// list (the order `ensure` takes them in).
    fn take_first_error(&self, slots: &[(u64, Slot)], key: u64, s: CUstream, take: impl Fn(&Workspace) -> bool) -> Result<()> {
        let slot = slots.iter().find(|(k, _)| *k == key).map(|(_, v)| v);
        let held = slot.map(|v| v.lock().unwrap_or_else(|p| p.into_inner()));
        if let Some(ws) = held.as_ref().and_then(|h| h.as_ref()) {
            if take(ws) {
                ws.take_error(s)?;
            }
        }
        for (_, ws) in self.retired.lock().unwrap_or_else(|p| p.into_inner()).iter().filter(|(k, _)| *k == key) {
            if take(ws) {
                ws.take_error(s)?;
            }
        }
        Ok(())
    }

    fn clear(&self) {
        self.slots.lock().unwrap_or_else(|p| p.into_inner()).clear();
        self.retired.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }
}

/// The learned scorer on one GPU.
pub struct CudaScorer {
    n_scorers: usize,
    heads: usize,
    head_dim: usize,
    hidden: usize,
    weight_dtype: WeightDtype,
    weights: DeviceBuffer,
    project: [Kernel; 2],
    score: Kernel,
    /// fm_score_wg_bf16 (fm_score_wg with the key dtype fixed to bf16), with
    /// wgmma; None without, or when a KVSWAP_FM_SOURCE lacks it (bf16 keys
    /// then take `score`).
    score_bf16: Option<Kernel>,
    /// fm_score_wg_fp8 (fp8 keys as f16 register operands), when the shape has it.
    score_fp8: Option<Kernel>,
    /// fm_score_wg_fp8q (fp8 keys x the fp8 query, both operands e4m3) and
    /// its dynamic shared memory, with wgmma and head_dim 128.
    score_fp8q: Option<(Kernel, u32)>,
    /// fm_score_wg_fp8q_tma (unless KVSWAP_FM_LOAD=cp.async), for one
    /// sequence per launch whose scales are 16-byte aligned: the kernel, its
    /// dynamic shared memory and threads per block.
    score_fp8q_tma: Option<(Kernel, u32, u32)>,
    /// fm_fp8_query: the fp8 query in place in the bf16 q, for fp8 keys on
    /// the other kernels (None only for a KVSWAP_FM_SOURCE without it).
    fp8_query: Option<Kernel>,
    /// fm_select and fm_order.
    select: Selection,
    score_smem: u32,
    /// Chunks per block tile and threads per block of the scoring kernel.
    score_tile: u32,
    score_threads: u32,
    /// The Hopper wgmma kernels (fm_score_wg, fm_score_wg_bf16,
    /// fm_score_wg_fp8) rather than fm_score (mma.sync).
    wgmma: bool,
    /// Calls wait for the device and return their own errors
    /// (`KVSWAP_SYNC` at load, then `set_sync`); read once per call.
    sync: AtomicBool,
    workspaces: Workspaces,
    _module: Module,
    launch: Launch,
}

// SAFETY: driver handles are usable from any thread with the context bound
// (every method binds it); the workspaces are behind a mutex.
unsafe impl Send for CudaScorer {}
unsafe impl Sync for CudaScorer {}

impl CudaScorer {
    /// Uploads the checkpoint's weights to `device` (as stored: bf16 stays
    /// bf16) and compiles the kernels for its shape.
    pub fn new(ckpt: &Checkpoint, device: i32, sync: bool) -> Result<CudaScorer> {
        let m = ckpt.meta();
        let (s, h, d, hidden) = (m.n_scorers as usize, m.n_heads as usize, m.head_dim as usize, m.hidden as usize);
        // No driver or device is NO_DEVICE before any question of shape.
        let dev = open_device(device)?;
        let _g = dev.bind()?;
        let unsupported = |why: String| Error::new(KvswapStatus::Unsupported, format!("CUDA scorer: {why}; use device -1 (the CPU scorer)"));
        if d % 64 != 0 || d > 256 {
            return Err(unsupported(format!("head_dim={d} must be 64, 128, 192 or 256")));
        }
        if h % 8 != 0 || (h > 64 && h % 64 != 0) {
            return Err(unsupported(format!("n_heads={h} must be a multiple of 8, and of 64 above 64")));
        }
        if hidden % 8 != 0 {
            return Err(unsupported(format!("hidden={hidden} must be a multiple of 8")));
        }
        let score_smem = (s * h * d * 2 + 2 * 64 * d * 2 + s * (h / h.min(64)) * 64 * 4 + HIST * 4) as u32;
        if score_smem as i32 > dev.smem_optin - 1024 {
            return Err(unsupported(format!(
                "{s} scorers x {h} heads x {d} dims need {score_smem} bytes of shared memory, the device has {}",
                dev.smem_optin
            )));
        }
        let mut defines = vec![format!("-DFM_SCORERS={s}"), format!("-DFM_HEADS={h}"), format!("-DFM_HEAD_DIM={d}")];
        // Hopper's warpgroup MMA when the shape fits one m64nNk16 row
        // (KVSWAP_FM_KERNEL=mma forces the portable mma.sync kernel).
        let forced = std::env::var("KVSWAP_FM_KERNEL").unwrap_or_default();
        // fm_score_wg: Q + per warpgroup a ring of WG_STAGES 64-row tiles
        // (bf16) or WG_STAGES raw fp8 tiles and one bf16 compute tile, + 1024
        // alignment slack; its histogram is static.
        let wg_ring = WG_GROUPS * (WG_STAGES * 64 * d * 2).max(WG_STAGES * 64 * d + 64 * d * 2);
        let wg_smem = (s * h * d * 2 + wg_ring + 1024) as u32;
        let wg_smem_total = wg_smem as usize + HIST * 4;
        let wgmma = dev.cc == (9, 0)
            && [64, 128, 192, 256].contains(&(s * h))
            && wg_smem_total as i32 <= dev.smem_optin
            && forced != "mma";
        if wgmma {
            defines.push("-DFM_WGMMA".into());
            defines.push("--gpu-architecture=sm_90a".into());
        }

        // Development only: extra NVRTC options, e.g. "-DFM_TRACE" (a
        // timeline of fm_score_wg_fp8, printed by the device).
        if let Ok(extra) = std::env::var("KVSWAP_FM_DEFINES") {
            defines.extend(extra.split_whitespace().map(String::from));
        }
        let cubin = super::nvrtc::compile_cached_with("scorer.cu", &scorer_source()?, dev.cc, &defines)?;
        let module = Module::load(&cubin)?;
        // All tensors in one dtype (the stored one when they agree, else f32).
        let tensors: Vec<_> = ckpt.weight_tensors().collect();
        let dtype = if tensors.iter().all(|t| t.dtype == tensors[0].dtype) { tensors[0].dtype } else { WeightDtype::F32 };
        // The upload's host image, exactly sized (16-bit tensors of a mixed
        // checkpoint widened to f32), or OUT_OF_MEMORY rather than an abort.
        let image_bytes = tensors.iter().map(|t| t.shape[0] * t.shape[1] * dtype.size()).sum();
        let mut image: Vec<u8> = crate::error::try_vec(image_bytes, "the scorer weights' upload image")?;
        for i in 0..s {
            let (wq, ww) = ckpt.tensors(i);
            for t in [wq, ww] {
                if t.dtype == dtype {
                    image.extend_from_slice(ckpt.raw(t));
                } else {
                    let mat = ckpt.matrix(t);
                    for r in 0..mat.rows {
                        for c in 0..mat.cols {
                            image.extend_from_slice(&mat.get(r, c).to_le_bytes());
                        }
                    }
                }
            }
        }
        let weights = DeviceBuffer::alloc(image.len(), "scorer weights")?;
        let stream = driver::OwnedStream::new()?;
        // SAFETY: weights holds image.len() bytes; synced before `image` drops.
        unsafe { driver::copy_htod_async(weights.ptr, image.as_ptr(), image.len(), stream.0)? };
        stream.sync()?;
        let tag = match dtype {
            WeightDtype::F32 => "f32",
            WeightDtype::Bf16 => "bf16",
            WeightDtype::F16 => "f16",
        };
        let f = |name: String| -> Result<Kernel> {
            let c = std::ffi::CString::new(name).unwrap();
            module.function(&c)
        };
        let project = [f(format!("fm_project_{tag}_b1"))?, f(format!("fm_project_{tag}_b8"))?];
        for (kernel, &bytes) in project.iter().zip(&PROJECT_SMEM) {
            kernel.set_max_dynamic_smem(bytes as i32)?;
        }
        let (score, score_smem, score_tile, score_threads) = if wgmma {
            let k = f("fm_score_wg".into())?;
            k.set_max_dynamic_smem(wg_smem as i32)?;
            (k, wg_smem, 64 * WG_GROUPS as u32, 128 * WG_GROUPS as u32)
        } else {
            let k = f("fm_score".into())?;
            k.set_max_dynamic_smem(score_smem as i32)?;
            (k, score_smem, 64u32, 32 * score_warps(s, h))
        };
        // A kernel that a KVSWAP_FM_SOURCE from before it (a development
        // baseline) may lack: None with a warning saying what is used
        // instead; any other failure is an error.
        let optional = |name: &str, instead: &str| -> Result<Option<Kernel>> {
            match f(name.into()) {
                Ok(k) => Ok(Some(k)),
                Err(e) if std::env::var_os("KVSWAP_FM_SOURCE").is_some_and(|p| !p.is_empty()) => {
                    log::warn!("kvswap: KVSWAP_FM_SOURCE has no {name} ({}): {instead}", e.message);
                    Ok(None)
                }
                Err(e) => Err(e),
            }
        };
        // bf16 keys: fm_score_wg's body with the dtype a constant (without
        // it, fm_score_wg, as a baseline source had it).
        let score_bf16 = if wgmma { optional("fm_score_wg_bf16", "bf16 keys use fm_score_wg")? } else { None };
        if let Some(k) = &score_bf16 {
            k.set_max_dynamic_smem(wg_smem as i32)?;
        }
        // fm_score_wg_fp8 exists for head_dim 64 and 128; its static shared
        // memory adds the head weights and a reduction scratch
        // (KVSWAP_FM_KERNEL=wgmma-convert keeps fp8 keys on fm_score_wg).
        let score_fp8 = if wgmma && (d == 64 || d == 128) && forced != "wgmma-convert" && (wg_smem_total + s * h * 4 + 64) as i32 <= dev.smem_optin {
            let k = f("fm_score_wg_fp8".into())?;
            k.set_max_dynamic_smem(wg_smem as i32)?;
            Some(k)
        } else {
            None
        };
        let wide = "fp8 keys keep the wide query";
        let fp8_query = optional("fm_fp8_query", wide)?;
        // fm_score_wg_fp8q: Q in e4m3 + per warpgroup WG_STAGES raw tiles and
        // a KiB of their scales, + 1024 alignment slack; its histogram, head
        // weights, exponents, 2^E and (up to 4 scorers) the head-sum MMA's
        // B fragments are static.
        let fp8q_smem_of = |groups: usize| (s * h * d + groups * (WG_STAGES * 64 * d + 1024) + 1024) as u32;
        let fp8q_static = HIST * 4 + s * h * 8 + s * 8 + s * h * 16;
        let fp8q_smem = fp8q_smem_of(WG_GROUPS);
        let score_fp8q = if wgmma
            && d == 128
            && forced != "wgmma-convert"
            && forced != "wgmma-f16"
            && (fp8q_smem as usize + fp8q_static) as i32 <= dev.smem_optin
        {
            match optional("fm_score_wg_fp8q", wide)? {
                Some(k) => {
                    k.set_max_dynamic_smem(fp8q_smem as i32)?;
                    Some((k, fp8q_smem))
                }
                None => None,
            }
        } else {
            None
        };
        // fm_score_wg_fp8q's TMA load path, the default for one sequence per
        // launch (session 37: 27.6 us against 28.2 for the cp.async ring,
        // score fp8 at 262,144 chunks, benches/NOTES.md s37);
        // KVSWAP_FM_LOAD=cp.async keeps every call on the ring.
        let loads = std::env::var("KVSWAP_FM_LOAD").unwrap_or_default();
        let ring_only = match loads.as_str() {
            "" | "tma" => false,
            "cp.async" => true,
            other => {
                log::warn!("kvswap: KVSWAP_FM_LOAD={other:?} is neither tma nor cp.async: tma (the default)");
                false
            }
        };
        let score_fp8q_tma = match &score_fp8q {
            Some(_) if !ring_only => match optional("fm_score_wg_fp8q_tma", "fp8 keys use the cp.async ring")? {
                Some(k) => {
                    // Its warpgroups: its launch bound / 128 (FM_TMA_G). ptxas
                    // fits the registers to the bound (a build that cannot is
                    // a compile error), so the attribute is the bound itself.
                    // Where it does not fit, the ring does the work.
                    let fits = k.max_threads_per_block().and_then(|threads| {
                        let smem = fp8q_smem_of(threads as usize / 128);
                        let barriers = 8 * WG_STAGES * threads as usize / 128; // its slots' mbarriers
                        if threads == 0 || threads % 128 != 0 || (smem as usize + fp8q_static + barriers) as i32 > dev.smem_optin {
                            return Err(Error::device(format!("{threads} threads ({smem} bytes of shared memory) do not fit this device")));
                        }
                        k.set_max_dynamic_smem(smem as i32)?;
                        Ok((k, smem, threads))
                    });
                    match fits {
                        Ok(t) => Some(t),
                        Err(e) => {
                            log::warn!("kvswap: fm_score_wg_fp8q_tma: {}: fp8 keys use the cp.async ring", e.message);
                            None
                        }
                    }
                }
                None => None,
            },
            _ => None,
        };
        let select = Selection::new(&module)?;
        let pdl = dev.cc.0 >= 9;
        drop(_g);
        log::info!(
            "kvswap: fm scorer on cuda device={} scorers={s} heads={h} head_dim={d} hidden={hidden} weights={} ({:.1} MB) kernel={} sync={} fp8_loads={}",
            dev.ordinal,
            tag,
            image.len() as f64 / 1e6,
            if wgmma { "wgmma" } else { "mma.sync" },
            sync as u8,
            if score_fp8q_tma.is_some() { "tma (single sequences, 16-byte aligned scales)" } else { "cp.async" }
        );
        Ok(CudaScorer {
            n_scorers: s,
            heads: h,
            head_dim: d,
            hidden,
            weight_dtype: dtype,
            weights,
            project,
            score,
            score_bf16,
            score_fp8,
            score_fp8q,
            score_fp8q_tma,
            fp8_query,
            select,
            score_smem,
            score_tile,
            score_threads,
            wgmma,
            sync: AtomicBool::new(sync),
            workspaces: Workspaces::default(),
            _module: module,
            launch: Launch { device: dev, pdl },
        })
    }

    fn device(&self) -> &Device {
        &self.launch.device
    }

    fn q_elems(&self) -> usize {
        self.n_scorers * self.heads * self.head_dim
    }

    fn w_elems(&self) -> usize {
        self.n_scorers * self.heads
    }


    fn check_keys(&self, k: &KeysRef, n: usize, what: &str) -> Result<u32> {
        let stride = args::key_stride(k.dtype, k.row_stride, self.head_dim)?;
        // Every scoring kernel copies key rows in 16-byte pieces (cp.async),
        // fp8 ones included: a misaligned address would be a device fault
        // that poisons the context, so it is refused here.
        if !k.data.is_multiple_of(16) || stride % 16 != 0 {
            return Err(Error::invalid(format!(
                "{what}keys: the CUDA scorer reads {} key rows 16 bytes at a time: data and row stride must be \
                 16-byte aligned (data {:#x}, stride {stride})",
                k.dtype.name(),
                k.data
            )));
        }
        let stride32 = u32::try_from(stride).map_err(|_| Error::invalid(format!("{what}: key row stride {stride} is above 4 GiB")))?;
        check_device_ptr(self.device(), k.data, args::key_bytes(stride, k.dtype, self.head_dim, n)? as u64, &format!("{what}keys.data"))?;
        if k.dtype == KeyDtype::Fp8E4m3 {
            check_device_ptr(self.device(), k.scales, 4 * n as u64, &format!("{what}keys.scales"))?;
        }
        Ok(stride32)
    }

    /// The TMA kernel's tensor maps for `seq` (fp8 keys, rows `stride`
    /// apart): the workspace's last ones while they describe the same keys,
    /// scales, chunks and stride, else encoded on the host (no device work)
    /// and kept. None sends the call to the cp.async ring: scales not
    /// 16-byte aligned, or maps the driver refuses (logged).
    fn tma_maps(&self, ws: &Workspace, seq: &SeqRef, stride: u32) -> Option<TmaMaps> {
        let key = (seq.keys.data, seq.keys.scales, seq.n_chunks, stride);
        match ws.tma_maps.get() {
            Some((k, m)) if k == key => Some(m),
            _ if seq.keys.scales.is_multiple_of(16) => TmaMaps::new(key.0, key.1, key.2, key.3, self.head_dim)
                .inspect(|m| ws.tma_maps.set(Some((key, *m))))
                .inspect_err(|e| log::warn!("kvswap: fm_score_wg_fp8q_tma: {}: this call uses the cp.async ring", e.message))
                .ok(),
            _ => None,
        }
    }

    /// Scores a batch whose q and w are either projected from `hidden` (the
    /// ABI) or given (`qw`: per sequence the bf16 q and f32 w, for the
    /// benchmark's "score" scope). Every sequence is checked before anything
    /// is launched; then one launch group per key dtype and 64 sequences.
    unsafe fn run(&self, seqs: &[SeqRef], qw: Option<&[(u64, u64)]>, k: usize, mode: ScoreMode, stream: StreamHandle) -> Result<()> {
        let dev = self.device();
        let _g = dev.bind()?;
        let s = check_stream(dev, stream)?;
        let capturing = driver::is_capturing(s)?;
        let sync = self.sync.load(Ordering::Relaxed);
        if sync && capturing {
            return Err(Error::invalid(
                "KVSWAP_SYNC=1 waits for the device and cannot be captured in a CUDA graph; use KVSWAP_SYNC=0 or fm_scorer_set_sync(scorer, 0)",
            ));
        }
        let mut strides = Vec::with_capacity(seqs.len());
        for (i, q) in seqs.iter().enumerate() {
            let what = if seqs.len() > 1 { format!("seqs[{i}].") } else { String::new() };
            strides.push(self.check_keys(&q.keys, q.n_chunks, &what)?);
            check_device_ptr(dev, q.out, 4 * k as u64, &format!("{what}out_indices"))?;
            if qw.is_none() {
                // Both projection forms read the hidden state 16 bytes at a
                // time: a misaligned address would be a device fault that
                // poisons the context.
                if q.hidden % 16 != 0 {
                    return Err(Error::invalid(format!(
                        "{what}hidden ({:#x}): the CUDA scorer reads the hidden state 16 bytes at a time: it must be 16-byte aligned",
                        q.hidden
                    )));
                }
                check_device_ptr(dev, q.hidden, 4 * (self.n_scorers * self.hidden) as u64, &format!("{what}hidden"))?;
            }
        }
        // Launch groups: the sequences of one key dtype (in call order), 64
        // at a time.
        let mut groups: Vec<Vec<usize>> = Vec::new();
        for dt in [KeyDtype::F32, KeyDtype::Bf16, KeyDtype::Fp8E4m3] {
            let idx: Vec<usize> = (0..seqs.len()).filter(|&i| seqs[i].keys.dtype == dt).collect();
            groups.extend(idx.chunks(MAX_BATCH).map(|c| c.to_vec()));
        }
        // The largest group's chunks in all: each sequence's chunks lie back
        // to back in the workspace, each run starting at a multiple of 32
        // (128-byte lines).
        let group_total = |g: &Vec<usize>| g.iter().map(|&i| seqs[i].n_chunks.next_multiple_of(32)).sum::<usize>();
        let max_chunks = groups.iter().map(group_total).max().unwrap_or(1);
        let max_group = groups.iter().map(Vec::len).max().unwrap_or(1);
        // Lines logged while the workspace is locked wait for its unlock (a
        // log callback may call the scorer on this stream): declared before
        // the lock, so dropped after it.
        let _quiet = crate::logging::defer();
        let slot = self.workspaces.slot(s);
        let mut held = slot.lock().unwrap_or_else(|p| p.into_inner());
        let ws = self.workspaces.ensure(&mut held, s, capturing, max_group, max_chunks, self.q_elems(), self.w_elems())?;
        let sm = dev.sm_count as u32;
        let mut err = ws.err.ptr;
        let launched = (|| -> Result<()> {
            for group in &groups {
                let b = group.len();
                let dtype = seqs[group[0]].keys.dtype;
                let mut id = [0u16; MAX_BATCH];
                for (i, &orig) in group.iter().enumerate() {
                    id[i] = orig as u16;
                }
                // fp8 keys with the fp8 query: fm_score_wg_fp8q quantizes q
                // itself; the other kernels get it from fm_fp8_query, in
                // place in the workspace's q (a given q is copied there first).
                let fp8q = dtype == KeyDtype::Fp8E4m3 && mode.fp8_query;
                let in_place = if fp8q && self.score_fp8q.is_none() { self.fp8_query.as_ref() } else { None };
                let ws_q = |i: usize| ws.q.ptr + (i * self.q_elems() * 2) as u64;
                let q_at = |i: usize| match qw {
                    Some(v) if in_place.is_none() => v[group[i]].0,
                    _ => ws_q(i),
                };
                let w_at = |i: usize| qw.map(|v| v[group[i]].1).unwrap_or(ws.w.ptr + (i * self.w_elems() * 4) as u64);
                if qw.is_none() {
                    let mut pb = ProjBatch { n: b as u32, seq: [ProjSeq::default(); MAX_BATCH], id };
                    for (i, &orig) in group.iter().enumerate() {
                        pb.seq[i] = ProjSeq { hidden: seqs[orig].hidden, q: q_at(i), w: w_at(i) };
                    }
                    // One sequence: b1. Several: b8, one block per row block
                    // and group of PROJECT_GROUP sequences, a row block's
                    // groups adjacent (x = row block * n_groups + group), so
                    // they read its weights at the same time and L2 can serve
                    // one group's reads to the others (H200, bf16 weights,
                    // B = 64: 206 MB read from DRAM for 203 MB of weights,
                    // ncu).
                    let (which, n_groups) = if b == 1 { (0, 1) } else { (1, (b as u32).div_ceil(PROJECT_GROUP)) };
                    let kernel = &self.project[which];
                    let rows = (self.heads * self.head_dim + self.heads) as u32;
                    let (mut wptr, mut hid) = (self.weights.ptr, self.hidden as u32);
                    let mut params = kernel_params![wptr, hid, pb, err];
                    let grid = (rows.div_ceil(PROJECT_WARPS[which] * PROJECT_RPW[which]) * n_groups, self.n_scorers as u32);
                    // SAFETY: parameters match fm_project_*(const T*, u32, ProjBatch, u32*);
                    // hidden and q/w buffers were checked / sized above.
                    unsafe { kernel.launch_2d(grid, 32 * PROJECT_WARPS[which], PROJECT_SMEM[which], s, &mut params)? };
                }
                if let Some(kernel) = in_place {
                    if let Some(v) = qw {
                        for (i, &orig) in group.iter().enumerate() {
                            // SAFETY: both hold q_elems bf16 (the given q by
                            // score_with_qw's contract); ordered on `s`.
                            unsafe { driver::copy_dtod_async(ws_q(i), v[orig].0, self.q_elems() * 2, s)? };
                        }
                    }
                    let mut q = ws_q(0);
                    let mut params = kernel_params![q];
                    // SAFETY: fm_fp8_query(u16*): b sequences' q back to back
                    // in the workspace, FM_QROWS rows of head_dim each.
                    unsafe {
                        self.launch.dependent(kernel, ((self.n_scorers * self.heads).div_ceil(8) as u32, b as u32), 256, 0, s, &mut params)?
                    };
                }
                let mut sb = ScoreBatch {
                    n_seqs: b as u32,
                    dtype: dtype.code(),
                    mean: (mode.ensemble == Ensemble::Mean) as u32,
                    pad: 0,
                    seq: [ScoreSeq::default(); MAX_BATCH],
                    id,
                };
                let mut sel = SelectBatch { n_seqs: b as u32, k: k as u32, seq: [SelectSeq::default(); MAX_BATCH] };
                let mut first_chunk = 0usize;
                for (i, &orig) in group.iter().enumerate() {
                    let q = &seqs[orig];
                    let at = first_chunk;
                    first_chunk += q.n_chunks.next_multiple_of(32);
                    let skey = ws.skey.ptr + (at * 4) as u64;
                    let hist = ws.hist.ptr + (i * HIST_WORDS * 4) as u64;
                    sb.seq[i] = ScoreSeq {
                        keys: q.keys.data,
                        scales: q.keys.scales,
                        q: q_at(i),
                        w: w_at(i),
                        skey,
                        hist,
                        stride: strides[orig],
                        n: q.n_chunks as u32,
                    };
                    sel.seq[i] = SelectSeq {
                        skey,
                        hist,
                        st: ws.state.ptr + (i * SELECT_STATE_BYTES) as u64,
                        sure: ws.sure.ptr + (i * TOPK_MAX * 8) as u64,
                        tie: ws.tie.ptr + (at * 8) as u64,
                        out: q.out,
                        n: q.n_chunks as u32,
                        pad: 0,
                    };
                }
                let group_chunks = group.iter().map(|&i| seqs[i].n_chunks).max().unwrap_or(1);
                let tiles = group_chunks.div_ceil(self.score_tile as usize) as u32;
                let resident = if self.wgmma { sm } else { 2 * sm };  // blocks per SM: 1 (wgmma) or 2
                let per_seq = tiles.min((resident / b as u32).max(1));
                // The TMA path: one sequence, keys, stride and scales 16-byte
                // aligned (the tensor maps' rule; keys and stride are checked
                // above).
                let tma = match (&self.score_fp8q_tma, fp8q && dtype == KeyDtype::Fp8E4m3, group.as_slice()) {
                    (Some(t), true, &[only]) => self.tma_maps(ws, &seqs[only], strides[only]).map(|maps| (t, maps)),
                    _ => None,
                };
                if let Some((&(tma, smem, threads), mut maps)) = tma {
                    let mut params = kernel_params![sb, err, maps];
                    // SAFETY: parameters match fm_score_wg_fp8q_tma(ScoreBatch,
                    // u32*, const __grid_constant__ TmaMaps); the maps
                    // describe the checked key and scale buffers.
                    unsafe { self.launch.dependent(&tma, (per_seq, 1), threads, smem, s, &mut params)? };
                    if !TMA_SEEN.swap(true, std::sync::atomic::Ordering::Relaxed) {
                        log::info!("kvswap: fm_score_wg_fp8q_tma launched (the TMA load path is in use)");
                    }
                } else {
                    let mut params = kernel_params![sb, err];
                    // SAFETY: parameters match fm_score(ScoreBatch, u32*); keys checked above.
                    let (kernel, smem) = match (dtype, &self.score_bf16, &self.score_fp8, &self.score_fp8q) {
                        (KeyDtype::Fp8E4m3, _, _, Some((k, smem))) if fp8q => (k, *smem),
                        (KeyDtype::Bf16, Some(k), _, _) | (KeyDtype::Fp8E4m3, _, Some(k), _) => (k, self.score_smem),
                        _ => (&self.score, self.score_smem),
                    };
                    unsafe { self.launch.dependent(kernel, (per_seq, b as u32), self.score_threads, smem, s, &mut params)? };
                }
                let sel_blocks = (group_chunks as u32).div_ceil(SEL_THREADS * SEL_ITEMS);
                self.select.launch(&self.launch, sel, sel_blocks, err, s)?;
            }
            Ok(())
        })();
        if let Err(e) = launched {
            // A launch failed after earlier kernels of the call were queued:
            // a scoring kernel may have filled histograms that no fm_order
            // will zero, and the next call would select from stale counts.
            if !capturing {
                let _ = ws.reset_selection(s);
            }
            return Err(e);
        }
        if sync {
            driver::stream_sync(s)?;
            ws.take_error(s)?;
        }
        Ok(())
    }

    /// Scores with q (bf16, `[scorers*heads][head_dim]`) and w (f32,
    /// `[scorers*heads]`) given, skipping the projections: the part that
    /// grows with context (benchmarks).
    ///
    /// # Safety
    /// As `score_topk`; `qw[i]` are device buffers of those sizes, q
    /// 16-byte aligned (the kernels load it in 16-byte pieces; allocations
    /// are).
    pub unsafe fn score_with_qw(&self, seqs: &[SeqRef], qw: &[(u64, u64)], k: usize, mode: impl Into<ScoreMode>, stream: StreamHandle) -> Result<()> {
        // The limits the kernels are sized for, which the ABI's path checks
        // before `run`: k within FM_RANK_MAX (fm_select's `sure` list,
        // fm_order's shared keys), the batch size, a q/w pair per sequence,
        // outputs apart.
        args::check_k(u32::try_from(k).unwrap_or(u32::MAX))?;
        args::check_batch(seqs.len())?;
        if qw.len() != seqs.len() {
            return Err(Error::invalid(format!("{} q/w pairs for {} sequences", qw.len(), seqs.len())));
        }
        args::check_outputs_disjoint(seqs, k)?;
        for q in seqs {
            args::check_n_chunks(q.n_chunks)?;
        }
        if let Some(&(q, _)) = qw.iter().find(|&&(q, _)| q % 16 != 0) {
            return Err(Error::new(KvswapStatus::InvalidArgument, format!("score_with_qw: q at {q:#x} is not 16-byte aligned")));
        }
        // SAFETY: forwarded.
        unsafe { self.run(seqs, Some(qw), k, mode.into(), stream) }
    }

    /// Waits for `stream` and returns (and clears) an error an earlier
    /// asynchronous call recorded on it.
    pub fn sync_errors(&self, stream: StreamHandle) -> Result<()> {
        self.workspaces.sync_errors(self.device(), stream)
    }

    /// The selection's candidate counts of the first sequence of the last
    /// launch group on `stream` (benchmarks and tests; a call runs in launch
    /// groups of up to 64 sequences of one key dtype, and a call that failed
    /// before launching leaves the counts of the one before): keys certainly
    /// in the top-k, and keys in the threshold bin of the 12-bit histogram
    /// (ties). Sure + ties above 4,096 takes fm_order's merge-tree narrowing
    /// (order_narrowed). Waits for the stream (refused while it is being
    /// captured); None before any call on it.
    pub fn last_candidates(&self, stream: StreamHandle) -> Result<Option<(u32, u32)>> {
        let dev = self.device();
        let _g = dev.bind()?;
        let s = stream as CUstream;
        super::check_waitable(dev, s, "read the counts")?;
        let slot = self.workspaces.slot(s);
        let held = slot.lock().unwrap_or_else(|p| p.into_inner());
        let Some(ws) = held.as_ref() else { return Ok(None) };
        // SAFETY: readback holds 16 bytes, state at least 16 (one sequence);
        // synced before reading.
        unsafe { driver::copy_dtoh_async(ws.readback.host, ws.state.ptr, 16, s)? };
        driver::stream_sync(s)?;
        // SAFETY: the copy completed; two aligned u64 (appended, filed).
        let filed = unsafe { *(ws.readback.host as *const u64).add(1) };
        Ok(Some(((filed & ((1 << ST_TIE_SHIFT) - 1)) as u32, (filed >> ST_TIE_SHIFT) as u32)))
    }

    /// Bytes of the weights on the device and their dtype.
    pub fn weights(&self) -> (u64, WeightDtype) {
        (self.weights.bytes as u64, self.weight_dtype)
    }
}

/// The global top-k (kernels/scorer/topk.cu): fm_select files the candidates,
/// fm_order ranks them and writes the result; each a programmatic dependent
/// of the kernel before it.
struct Selection {
    select: Kernel,
    order: Kernel,
}

impl Selection {
    fn new(module: &Module) -> Result<Selection> {
        Ok(Selection { select: module.function(c"fm_select")?, order: module.function(c"fm_order")? })
    }

    fn launch(&self, launch: &Launch, mut sel: SelectBatch, blocks: u32, mut err: u64, s: CUstream) -> Result<()> {
        let n_seqs = sel.n_seqs;
        let mut params = kernel_params![sel, err];
        // SAFETY: parameters match fm_select(SelectBatch, const u32*) and
        // fm_order(SelectBatch, const u32*); buffers sized by the workspace.
        unsafe {
            launch.dependent(&self.select, (blocks, n_seqs), SEL_THREADS, 0, s, &mut params)?;
            launch.dependent(&self.order, (ORDER_MAX / ORDER_CANDS, n_seqs), ORDER_THREADS, 0, s, &mut params)
        }
    }
}

fn score_warps(scorers: usize, heads: usize) -> u32 {
    (2 * scorers * (heads / heads.min(64))) as u32
}

impl Drop for CudaScorer {
    fn drop(&mut self) {
        if let Ok(_g) = self.launch.device.bind() {
            self.workspaces.clear();
        }
    }
}

impl ScorerBackend for CudaScorer {
    fn kind(&self) -> BackendKind {
        BackendKind::Cuda
    }
    fn device(&self) -> i32 {
        self.launch.device.ordinal
    }
    fn describe(&self) -> String {
        let d = self.device();
        format!(
            "cuda device={} name=\"{}\" sm_{}{} scorer kernel={}",
            d.ordinal,
            d.name,
            d.cc.0,
            d.cc.1,
            if self.wgmma { "wgmma" } else { "mma.sync" }
        )
    }
    unsafe fn score_topk(&self, seq: &SeqRef, k: usize, mode: ScoreMode, stream: StreamHandle) -> Result<()> {
        // SAFETY: forwarded caller contract.
        unsafe { self.run(std::slice::from_ref(seq), None, k, mode, stream) }
    }
    unsafe fn score_topk_batch(&self, seqs: &[SeqRef], k: usize, mode: ScoreMode, stream: StreamHandle) -> Result<()> {
        // SAFETY: forwarded caller contract.
        unsafe { self.run(seqs, None, k, mode, stream) }
    }
    fn sync_errors(&self, stream: StreamHandle) -> Result<()> {
        CudaScorer::sync_errors(self, stream)
    }
    fn set_sync(&self, sync: bool) {
        self.sync.store(sync, Ordering::Relaxed);
    }

    fn reserve(&self, seqs: usize, chunks: usize, stream: StreamHandle) -> Result<()> {
        // A call's largest launch group: up to MAX_BATCH sequences, each
        // run of chunks starting at a multiple of 32 (as `run` sizes it).
        let group = seqs.min(MAX_BATCH);
        self.workspaces.reserve(self.device(), stream, group, group * chunks.next_multiple_of(32), self.q_elems(), self.w_elems())
    }
}

/// The key-bounds scorer on one GPU (shared by every call on that device).
pub struct CudaBounds {
    bounds: Kernel,
    select: Selection,
    workspaces: Workspaces,
    _module: Module,
    launch: Launch,
}

// SAFETY: as CudaScorer.
unsafe impl Send for CudaBounds {}
unsafe impl Sync for CudaBounds {}

/// The scorer's CUDA source: the embedded one, or (development only, to
/// compare kernel variants with one build) the whole concatenated source read
/// from the file `KVSWAP_FM_SOURCE` names (unset or empty: the embedded
/// one). It is read once per process.
fn scorer_source() -> Result<std::borrow::Cow<'static, str>> {
    static OVERRIDE: OnceLock<std::result::Result<Option<String>, String>> = OnceLock::new();
    let read = OVERRIDE.get_or_init(|| match std::env::var_os("KVSWAP_FM_SOURCE").filter(|p| !p.is_empty()) {
        None => Ok(None),
        Some(path) => std::fs::read_to_string(&path)
            .map(|s| {
                log::warn!("kvswap: scorer kernels from KVSWAP_FM_SOURCE={} (development override)", path.to_string_lossy());
                Some(s)
            })
            .map_err(|e| format!("KVSWAP_FM_SOURCE={}: {e}", path.to_string_lossy())),
    });
    match read {
        Ok(Some(s)) => Ok(std::borrow::Cow::Borrowed(s.as_str())),
        Ok(None) => Ok(std::borrow::Cow::Borrowed(crate::kernels::SCORER_CU)),
        Err(e) => Err(Error::invalid(e.clone())),
    }
}

/// The bounds scorers of the process, by device. Calls with either
/// `KVSWAP_SYNC` share one, so an error a `KVSWAP_SYNC=0` call recorded on a
/// stream is seen by every later call there (written as -1, returned by a
/// `KVSWAP_SYNC=1` call) until it is returned.
type BoundsByDevice = Mutex<HashMap<i32, Arc<CudaBounds>>>;

static ALL_BOUNDS: OnceLock<BoundsByDevice> = OnceLock::new();

impl CudaBounds {
    /// Waits for `stream` and returns (clearing it) an error an asynchronous
    /// bounds call on `device` recorded there (only calls made with
    /// `KVSWAP_SYNC=0` leave one). Before any such call nothing is recorded,
    /// but the device and the stream are checked and the stream waited for
    /// all the same.
    pub fn sync_errors(device: i32, stream: StreamHandle) -> Result<()> {
        let me = ALL_BOUNDS.get().and_then(|all| all.lock().unwrap_or_else(|p| p.into_inner()).get(&device).cloned());
        if let Some(me) = me {
            return me.workspaces.sync_errors(&me.launch.device, stream);
        }
        let dev = open_device(device)?;
        let _g = dev.bind()?;
        super::check_waitable(&dev, stream as CUstream, "wait for it")?;
        driver::stream_sync(stream as CUstream)
    }

    /// The bounds scorer of `device`, created once per process.
    pub fn get(device: i32) -> Result<Arc<CudaBounds>> {
        let all = ALL_BOUNDS.get_or_init(Default::default);
        let mut map = all.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(b) = map.get(&device) {
            return Ok(b.clone());
        }
        let dev = open_device(device)?;
        let _g = dev.bind()?;
        let cubin = super::nvrtc::compile_cached("scorer.cu", &scorer_source()?, dev.cc)?;
        let module = Module::load(&cubin)?;
        let bounds = module.function(c"fm_bounds_score")?;
        let select = Selection::new(&module)?;
        let pdl = dev.cc.0 >= 9;
        drop(_g);
        let b = Arc::new(CudaBounds { bounds, select, workspaces: Workspaces::default(), _module: module, launch: Launch { device: dev, pdl } });
        map.insert(device, b.clone());
        Ok(b)
    }
}

/// Forwards to the shared per-device instance, with the `KVSWAP_SYNC` of
/// the call (true: wait and return the stream's recorded error).
pub struct CudaBoundsHandle(pub Arc<CudaBounds>, pub bool);

impl BoundsBackend for CudaBoundsHandle {
    fn kind(&self) -> BackendKind {
        BackendKind::Cuda
    }
    fn reserve(&self, chunks: usize, stream: StreamHandle) -> Result<()> {
        self.0.workspaces.reserve(&self.0.launch.device, stream, 1, chunks, 0, 0)
    }
    unsafe fn bounds_topk(&self, b: &BoundsRef, k: usize, stream: StreamHandle) -> Result<()> {
        let (me, sync) = (&*self.0, self.1);
        let dev = &me.launch.device;
        let _g = dev.bind()?;
        let s = check_stream(dev, stream)?;
        let capturing = driver::is_capturing(s)?;
        if sync && capturing {
            return Err(Error::invalid(
                "KVSWAP_SYNC=1 cannot be captured in a CUDA graph; use KVSWAP_SYNC=0 or fm_bounds_set_sync(device, 0)",
            ));
        }
        let bytes = (b.n_chunks * b.dim * 4) as u64;
        check_device_ptr(dev, b.query, 4 * b.dim as u64, "query")?;
        check_device_ptr(dev, b.min, bytes, "bounds_min")?;
        check_device_ptr(dev, b.max, bytes, "bounds_max")?;
        check_device_ptr(dev, b.out, 4 * k as u64, "out_indices")?;
        // As in CudaScorer::run: lines logged under the lock wait for it.
        let _quiet = crate::logging::defer();
        let slot = me.workspaces.slot(s);
        let mut held = slot.lock().unwrap_or_else(|p| p.into_inner());
        let ws = me.workspaces.ensure(&mut held, s, capturing, 1, b.n_chunks, 0, 0)?;
        let sm = dev.sm_count as u32;
        let (mut q, mut lo, mut hi, mut dim, mut n) = (b.query, b.min, b.max, b.dim as u32, b.n_chunks as u32);
        let (mut skey, mut hist, mut err) = (ws.skey.ptr, ws.hist.ptr, ws.err.ptr);
        let mut params = kernel_params![q, lo, hi, dim, n, skey, hist, err];
        let grid = (b.n_chunks as u32).div_ceil(8).clamp(1, 8 * sm);
        // SAFETY: parameters match fm_bounds_score(const float*, const float*,
        // const float*, u32, u32, u32*, u32*, u32*); buffers checked above.
        unsafe { me.bounds.launch_2d((grid, 1), 256, 0, s, &mut params)? };
        let mut sel = SelectBatch { n_seqs: 1, k: k as u32, seq: [SelectSeq::default(); MAX_BATCH] };
        sel.seq[0] = SelectSeq {
            skey: ws.skey.ptr,
            hist: ws.hist.ptr,
            st: ws.state.ptr,
            sure: ws.sure.ptr,
            tie: ws.tie.ptr,
            out: b.out,
            n: b.n_chunks as u32,
            pad: 0,
        };
        let blocks = (b.n_chunks as u32).div_ceil(SEL_THREADS * SEL_ITEMS);
        if let Err(e) = me.select.launch(&me.launch, sel, blocks, err, s) {
            // As in CudaScorer::run: the scoring kernel (or fm_select) may
            // have filled counts that no fm_order will zero.
            if !capturing {
                let _ = ws.reset_selection(s);
            }
            return Err(e);
        }
        if sync {
            driver::stream_sync(s)?;
            ws.take_error(s)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The value of `#define NAME value` in the scorer's CUDA source.
    fn define(name: &str) -> u64 {
        let src = crate::kernels::SCORER_CU;
        let line = src
            .lines()
            .find(|l| l.split_whitespace().take(2).eq(["#define", name]))
            .unwrap_or_else(|| panic!("#define {name} not in the scorer source"));
        let value = line.split_whitespace().nth(2).unwrap();
        value.trim_end_matches('u').parse().unwrap_or_else(|_| panic!("#define {name} {value}: not a number"))
    }

    /// A stream's workspace regrows a few times at most as its calls grow,
    /// and always holds the call.
    #[test]
    fn workspace_growth_is_bounded() {
        let mut shape = None;
        let mut grown = 0;
        for seqs in 1..=MAX_BATCH {
            for chunks in [seqs * 1000, seqs * 262_144] {
                let fits = shape.is_some_and(|(s, c)| s >= seqs && c >= chunks);
                if !fits {
                    let (s, c) = grown_shape(shape, seqs, chunks);
                    assert!(s >= seqs && c >= chunks && s <= MAX_BATCH, "{s} x {c} for {seqs} x {chunks}");
                    shape = Some((s, c));
                    grown += 1;
                }
            }
        }
        // 1, 2, 4, ..., 64 sequences; chunks double with them.
        assert!(grown <= 2 * (MAX_BATCH.trailing_zeros() as usize + 1), "{grown} growths");
        assert_eq!(grown_shape(None, 3, 5), (4, 8));
        assert_eq!(grown_shape(Some((64, 1 << 20)), 1, 10), (64, 1 << 20));
    }

    /// The launch shapes and buffer layouts the host assumes are the ones the
    /// kernels were written for (a mismatch would index past an array on the
    /// device, or leave an arrival count short).
    #[test]
    fn host_constants_match_the_kernels() {
        assert_eq!(define("FM_SEL_THREADS"), SEL_THREADS as u64);
        assert_eq!(define("FM_SEL_ITEMS"), SEL_ITEMS as u64);
        assert_eq!(define("FM_ORDER_MAX"), ORDER_MAX as u64);
        assert_eq!(define("FM_ORDER_CANDS"), ORDER_CANDS as u64);
        assert_eq!(define("FM_ORDER_CANDS") * define("FM_ORDER_SLICES"), ORDER_THREADS as u64);
        assert_eq!(define("FM_ORDER_BLOCKS"), (ORDER_MAX / ORDER_CANDS) as u64);
        assert_eq!(define("FM_RANK_MAX"), TOPK_MAX as u64);
        assert_eq!(define("FM_PROJ_ROWS1"), PROJECT_WARPS[0] as u64);
        assert_eq!(define("FM_PROJ_ROWS"), PROJECT_WARPS[1] as u64);
        assert_eq!(define("FM_PROJ_RPW8"), PROJECT_RPW[1] as u64);
        assert_eq!(define("FM_PROJ_GROUP"), PROJECT_GROUP as u64);
        assert_eq!(define("FM_PROJ_KT"), PROJECT_KT as u64);
        assert_eq!(define("FM_MAX_BATCH"), MAX_BATCH as u64);
        assert_eq!(define("WG_GROUPS"), WG_GROUPS as u64);
        assert_eq!(define("WG_STAGES"), WG_STAGES as u64);
        assert_eq!(1u64 << define("FM_HIST_BITS"), HIST as u64);
        assert_eq!(HIST as u64 + (1u64 << define("FM_COARSE_BITS")), HIST_WORDS as u64);
        assert_eq!(define("FM_ST_TIE_SHIFT"), ST_TIE_SHIFT as u64);
        assert!(crate::kernels::SCORER_CU.contains(&format!("sizeof(SelectState) == {SELECT_STATE_BYTES}")));
        assert!(crate::kernels::SCORER_CU.contains("struct SelectState {\n    u64 appended;\n    u64 filed;"));
    }
}
