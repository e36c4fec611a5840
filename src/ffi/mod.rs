//! The C ABI. Every function returns a [`KvswapStatus`] (or is infallible),
//! checks every pointer, writes out-parameters only on success, never lets a
//! panic cross the boundary, and records the text of a failure for
//! `kvswap_last_error()` on the calling thread.

// Entry points take raw pointers without being `unsafe fn`: C callers cannot
// see the difference, and each one checks its pointers (NULL, alignment)
// before it reads them.
#![allow(clippy::not_unsafe_ptr_arg_deref)]

use crate::backend::BackendKind;
use crate::config::{Config, KvswapBackendKind, KvswapConfig, KVSWAP_BACKEND_CPU, KVSWAP_BACKEND_CUDA};
use crate::context::Context;
use crate::error::{Error, KvswapStatus, Result};
use crate::layer::{KvswapLayerSpec, KvswapLayerStats, KvswapSwapIn};
use crate::logging::KvswapLogCallback;
use std::cell::RefCell;
use std::ffi::{c_char, c_void, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

mod scorer;
pub use scorer::*;

/// An engine stream: a `CUstream` on the CUDA backend (NULL is refused there:
/// kvswap never uses the legacy default stream; `kvswap_sync` and
/// `kvswap_layer_sync` alone take NULL, waiting for no stream, see there;
/// `CU_STREAM_LEGACY` is refused too); ignored on the CPU
/// backend. Swap-ins can be captured into a CUDA graph only with
/// `KVSWAP_SYNC=0` (a synchronous one waits for the device: refused with
/// KVSWAP_STATUS_INVALID_ARGUMENT while its stream is captured); stores and
/// forgets can be captured with either setting.
///
/// Ordering on CUDA: a layer's eager call on another stream handle than its
/// previous eager call (or on `CU_STREAM_PER_THREAD`, a different stream in
/// every thread) first waits on the device for that call; no host wait.
/// Calls of a layer captured into a CUDA graph start with an external
/// event-wait node: every launch of the graph waits for the layer's eager
/// calls issued before that launch. Eager calls are not ordered after a
/// graph launch: issue them on the launch stream, or call `kvswap_sync`
/// with it first. Launches of graphs that use the same layer are not ordered
/// with each other either: launch them on one stream (or order them
/// yourself), and within one capture keep a layer's calls on one stream.
/// Streams are told apart by handle: before destroying a stream with kvswap
/// work still pending on it, call `kvswap_sync(ctx, stream)`, since a new
/// stream created at the same address is taken for the same stream.
///
/// Calls that wait for the device (`KVSWAP_SYNC=1` calls, `kvswap_sync`,
/// `kvswap_layer_sync`, `kvswap_layer_stats`, `kvswap_layer_stats_peek`,
/// `fm_scorer_sync`, `fm_bounds_sync`) or allocate or free memory
/// (`kvswap_create`, `kvswap_destroy`, `fm_scorer_load`, `fm_scorer_free`,
/// the reservations, a scorer's or the bounds scorer's first call on a
/// stream or on a device, a call that grows a stream's workspace) may run
/// while this or another thread captures another stream in
/// `cudaStreamCaptureModeGlobal` (`torch.cuda.graph`'s default): kvswap
/// makes its own waits, allocations and frees in relaxed capture mode
/// (`cuThreadExchangeStreamCaptureMode`, as PyTorch's allocator does), so
/// they do not invalidate that capture. Some wait for the stream they are
/// given (`kvswap_sync`, `fm_scorer_sync`, `fm_bounds_sync`, `KVSWAP_SYNC=1`
/// calls, a scorer call that allocates), never for a stream being captured:
/// such a call is refused (`KVSWAP_STATUS_INVALID_ARGUMENT`, see each call).
pub type KvswapStream = *mut c_void;

/// Opaque handle to a kvswap context. Create with `kvswap_create`, free with
/// `kvswap_destroy`. Different layers may be used from different threads at
/// the same time; calls on one layer are serialised.
pub struct KvswapContext {
    pub(crate) inner: Context,
}

/// What a context is running on, from `kvswap_context_info`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct KvswapContextInfo {
    /// `KVSWAP_BACKEND_CPU` or `KVSWAP_BACKEND_CUDA` (never auto).
    pub backend: KvswapBackendKind,
    /// CUDA device ordinal, or -1 on the CPU backend.
    pub device: i32,
    /// Layers in the context.
    pub n_layers: u32,
    /// Layers with swap on (`compressed_cap > gpu_chunks`; 0 when swapping
    /// is disabled, `KVSWAP_ENABLE=0`).
    pub swap_layers: u32,
    /// Bytes of host tier (pinned on CUDA) of all layers.
    pub host_tier_bytes: u64,
    /// Bytes of library-owned staging of all layers (device memory on CUDA).
    pub staging_bytes: u64,
}

/// The most layers `kvswap_create` takes.
pub const KVSWAP_MAX_LAYERS: usize = 1 << 20;

/// `n` of `kvswap_layer_forget`: every chunk from `first_id` to the end of
/// the layer (`compressed_cap`), so an engine can forget a whole layer, or
/// its tail, without its capacity at hand.
pub const KVSWAP_FORGET_TO_END: u32 = u32::MAX;

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn set_last_error(text: &str) {
    let c = CString::new(text.replace('\0', " ")).unwrap_or_default();
    // (Gone while the thread's locals are torn down, e.g. for a call from a
    // thread-exit destructor: the text is dropped then, never a panic.)
    let _ = LAST_ERROR.try_with(|e| *e.borrow_mut() = c);
}

fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic payload".to_string()
    }
}

/// Runs `f` behind the panic boundary, turning its result into a status.
pub(crate) fn boundary(name: &str, f: impl FnOnce() -> Result<()>) -> KvswapStatus {
    // Every entry point, not only kvswap_create, turns the logger on (an
    // engine may load a scorer first); after the first call a cheap check.
    crate::logging::init();
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => KvswapStatus::Ok,
        Ok(Err(e)) => {
            set_last_error(&format!("{name}: {}", e.message));
            e.status
        }
        Err(p) => {
            set_last_error(&format!("{name}: internal panic: {}", panic_text(&*p)));
            KvswapStatus::Panic
        }
    }
}

/// Writes `v` through a checked out-pointer.
pub(crate) fn write_out<T>(out: *mut T, v: T) {
    // SAFETY: every caller checked `out` for NULL first; the engine promises
    // it points to writable storage for a T.
    unsafe { out.write(v) }
}

pub(crate) fn ctx_ref<'a>(ctx: *const KvswapContext) -> Result<&'a Context> {
    if ctx.is_null() {
        return Err(Error::null("ctx"));
    }
    // SAFETY: non-null handles come from kvswap_create and are valid until
    // kvswap_destroy, per the API contract.
    Ok(unsafe { &(*ctx).inner })
}

/// `p` is not NULL and aligned for T (an engine's misaligned int buffer
/// would be undefined behaviour in a Rust slice and a fault on the device).
pub(crate) fn check_aligned<T>(p: *const T, name: &str) -> Result<()> {
    crate::scorer::args::check_ptr(p as u64, std::mem::align_of::<T>() as u64, name)
}

/// Fills `*out` with the defaults (the Settings table of README.md).
/// Errors: `KVSWAP_STATUS_NULL_POINTER` (NULL `out`),
/// `KVSWAP_STATUS_INVALID_ARGUMENT` (misaligned `out`).
#[no_mangle]
pub extern "C" fn kvswap_config_default(out: *mut KvswapConfig) -> KvswapStatus {
    boundary("kvswap_config_default", || {
        check_aligned(out, "out")?;
        write_out(out, Config::default().to_c());
        Ok(())
    })
}

/// Fills `*out` with the defaults overridden by the `KVSWAP_*` environment
/// variables (and their `POCKETLLM_GGUF_*` aliases; the `KVSWAP_` name wins, with a warning
/// when both are set to different values).
/// A bad value returns `KVSWAP_STATUS_INVALID_ARGUMENT` naming the variable
/// (`*out` unchanged), as does a misaligned `out`; a NULL `out` is
/// `KVSWAP_STATUS_NULL_POINTER`.
#[no_mangle]
pub extern "C" fn kvswap_config_from_env(out: *mut KvswapConfig) -> KvswapStatus {
    boundary("kvswap_config_from_env", || {
        check_aligned(out, "out")?;
        let c = Config::from_env()?;
        write_out(out, c.to_c());
        Ok(())
    })
}

/// Creates a context for `n_layers` layers described by `layers`, and
/// writes its handle to `*out`. Applies the guards: `gpu_chunks < index_topk`
/// (`KVSWAP_STATUS_TOPK_GUARD`), pinned host tier over `pinned_mib`
/// (`KVSWAP_STATUS_PINNED_CAP`), zero sizes (`KVSWAP_STATUS_INVALID_ARGUMENT`),
/// more than KVSWAP_MAX_LAYERS layers (`KVSWAP_STATUS_OUT_OF_RANGE`), and
/// no CUDA device for an explicit
/// CUDA backend (`KVSWAP_STATUS_NO_DEVICE`). `auto` falls back to the CPU
/// only where there is no CUDA driver or the driver reports no device; on a
/// machine with devices it returns the CUDA backend's error instead (the
/// device asked for is missing: `KVSWAP_STATUS_NO_DEVICE`, as is NVRTC
/// missing; a driver too old: `KVSWAP_STATUS_UNSUPPORTED`), since a CPU
/// context would read the engine's device pointers as host memory; set
/// the backend to cpu for the CPU there. Engine-owned staging buffers
/// (`KvswapLayerSpec.staging`) of different layers must not overlap: each
/// layer takes its rows for its own slots (not checked).
/// Limits: `compressed_cap` below 2^30 - 1 and `chunk_bytes` at most 1 GiB
/// (`KVSWAP_STATUS_OUT_OF_RANGE`); `gpu_chunks` and `window` at most
/// 2^30 - 1 (`KVSWAP_STATUS_INVALID_ARGUMENT`); `window` + a layer's slots
/// below 2^30, so that physical ids fit an int32 (`KVSWAP_STATUS_OUT_OF_RANGE`).
/// `KVSWAP_STATUS_TOPK_GUARD` applies only with `enable = 1`. On CUDA the
/// residency kernel keeps 20 bytes per slot in shared memory, so a swapping
/// layer's `gpu_chunks` is also bounded by the device (about 11,500 on
/// H100/H200, 8,200 on A100, 5,000 on sm_86/89): above it
/// `KVSWAP_STATUS_UNSUPPORTED`, naming the device's limit.
/// `config` and `layers` are read during the call only (they may be freed
/// when it returns); engine-owned staging buffers must stay valid until
/// `kvswap_destroy`.
/// Other errors: `KVSWAP_STATUS_NULL_POINTER` (NULL `config`, `layers` or
/// `out`); `KVSWAP_STATUS_INVALID_ARGUMENT` (a misaligned pointer, a bad
/// config field or layer spec, each named); `KVSWAP_STATUS_OUT_OF_MEMORY`
/// (host tier or staging); on CUDA `KVSWAP_STATUS_UNSUPPORTED` (a driver
/// older than CUDA 12.3, or one of an older CUDA major version than NVRTC)
/// and `KVSWAP_STATUS_DEVICE_ERROR`.
#[no_mangle]
pub extern "C" fn kvswap_create(
    config: *const KvswapConfig,
    layers: *const KvswapLayerSpec,
    n_layers: usize,
    out: *mut *mut KvswapContext,
) -> KvswapStatus {
    boundary("kvswap_create", || {
        check_aligned(config, "config")?;
        check_aligned(layers, "layers")?;
        check_aligned(out, "out")?;
        if n_layers == 0 {
            return Err(Error::invalid("n_layers is 0"));
        }
        if n_layers > KVSWAP_MAX_LAYERS {
            return Err(Error::out_of_range(format!("n_layers={n_layers} is above KVSWAP_MAX_LAYERS ({KVSWAP_MAX_LAYERS})")));
        }
        // SAFETY: non-null, and the engine promises a valid config and
        // `n_layers` specs.
        let (cfg, specs) = unsafe { (&*config, std::slice::from_raw_parts(layers, n_layers)) };
        let cfg = Config::from_c(cfg)?;
        let ctx = Context::new(cfg, specs)?;
        write_out(out, Box::into_raw(Box::new(KvswapContext { inner: ctx })));
        Ok(())
    })
}

/// Frees a context and everything it allocated. NULL is a no-op. The engine
/// must make sure no other thread uses `ctx` during or after this call, and
/// that no device work using it is still pending; CUDA graphs that captured
/// calls on it must not be launched afterwards (they name its memory).
#[no_mangle]
pub extern "C" fn kvswap_destroy(ctx: *mut KvswapContext) {
    boundary("kvswap_destroy", || {
        if !ctx.is_null() {
            // SAFETY: created by Box::into_raw in kvswap_create.
            drop(unsafe { Box::from_raw(ctx) });
        }
        Ok(())
    });
}

/// Stores the chunk `logical_id` of `layer` from `src` (`chunk_bytes` bytes:
/// device memory on CUDA, host memory on the CPU backend) into the host tier
/// and marks it ready. A resident slot holding it is refreshed too.
/// Errors: as `kvswap_store_batch` with `n = 1`.
#[no_mangle]
pub extern "C" fn kvswap_store(
    ctx: *mut KvswapContext,
    layer: u32,
    logical_id: i32,
    src: *const c_void,
    stream: KvswapStream,
) -> KvswapStatus {
    boundary("kvswap_store", || {
        let c = ctx_ref(ctx)?;
        check_aligned(src, "src")?;
        // SAFETY: the engine promises `src` holds chunk_bytes readable bytes.
        unsafe { c.store_raw(layer as usize, &[logical_id], src as u64, 0, stream as u64) }
    })
}

/// Stores `n` chunks: chunk `ids[i]` from `src + i * src_stride` bytes
/// (`src_stride` 0 means `chunk_bytes`; with `n > 1` a stride must be at
/// least `chunk_bytes`). `ids` is host memory. When an id repeats, its last
/// row is stored. Every id is checked before anything is stored.
/// Errors (nothing stored, except as said for a device error):
/// `KVSWAP_STATUS_NULL_POINTER` (NULL `ctx`, `ids`
/// or `src`); `KVSWAP_STATUS_INVALID_ARGUMENT` (`n` 0, a misaligned pointer,
/// a stride below `chunk_bytes`, on CUDA the NULL stream or pageable host
/// memory where device memory is expected: pinned, device-mapped host memory
/// is accepted); `KVSWAP_STATUS_OUT_OF_RANGE` (a bad
/// layer or id, `n` above 2^32 - 1, rows running past the end of the
/// address space or, on CUDA, of `src`'s allocation);
/// `KVSWAP_STATUS_OUT_OF_MEMORY` (the batch's id table);
/// `KVSWAP_STATUS_WRONG_DEVICE` (CUDA: memory or stream of another device);
/// `KVSWAP_STATUS_DEVICE_ERROR` (CUDA: a batch of more than 256 distinct
/// ids is stored by several launches, and those before a failed one have
/// stored their rows); `KVSWAP_STATUS_PANIC` (a layer left unusable by an
/// earlier panic).
#[no_mangle]
pub extern "C" fn kvswap_store_batch(
    ctx: *mut KvswapContext,
    layer: u32,
    ids: *const i32,
    n: usize,
    src: *const c_void,
    src_stride: usize,
    stream: KvswapStream,
) -> KvswapStatus {
    boundary("kvswap_store_batch", || {
        let c = ctx_ref(ctx)?;
        check_aligned(ids, "ids")?;
        check_aligned(src, "src")?;
        if n == 0 {
            return Err(Error::invalid("n is 0"));
        }
        if n > isize::MAX as usize / std::mem::size_of::<i32>() {
            return Err(Error::out_of_range(format!("n={n} ids do not fit the address space")));
        }
        // SAFETY: the engine promises `n` ids and readable source rows.
        let ids = unsafe { std::slice::from_raw_parts(ids, n) };
        unsafe { c.store_raw(layer as usize, ids, src as u64, src_stride, stream as u64) }
    })
}

/// Makes the selected chunks of `layer` resident. `indices[window_len ..
/// window_len + count)` hold logical ids (device memory on CUDA); on return
/// they hold physical ids `window_len + slot`. -1 entries are padding and stay
/// -1; a duplicate id maps to the same slot; `count <= gpu_chunks`.
/// A chunk never stored gives `KVSWAP_STATUS_NOT_STORED` and changes nothing
/// (with `sync = 0` the entry becomes -1 and the error is returned by the next
/// `kvswap_sync` or `kvswap_layer_stats`; an id below -1 or at or above
/// `compressed_cap` likewise, as `KVSWAP_STATUS_OUT_OF_RANGE`: on CUDA the
/// ids are in device memory, which this mode does not wait for).
/// With `KVSWAP_VALIDATE=1` every staged chunk is compared with its host
/// copy after the call's work (on CUDA on the device); a mismatch is
/// `KVSWAP_STATUS_VALIDATION_FAILED`, returned by this call (`sync = 1`) or
/// later as above, naming the lowest mismatching position. Unlike
/// `NOT_STORED` the call's work is then done: the entries hold physical
/// ids, residency and counters are updated, and the mismatching slot keeps
/// its bytes until its chunk is stored again (`kvswap_store` refreshes a
/// resident slot).
/// Other errors: `KVSWAP_STATUS_NULL_POINTER` (NULL `ctx` or `indices`);
/// `KVSWAP_STATUS_INVALID_ARGUMENT` (misaligned `indices`, on CUDA the NULL
/// stream or pageable host memory); `KVSWAP_STATUS_OUT_OF_RANGE` (a bad layer, an
/// id below -1 or at or above `compressed_cap` (with `sync = 0` reported
/// later, as above), `count` above
/// `gpu_chunks` (on a layer without swap: above the larger of `gpu_chunks`
/// and `compressed_cap`), `window_len` + slots at or above 2^30, on CUDA `indices` past the
/// end of its allocation); `KVSWAP_STATUS_WRONG_DEVICE` and
/// `KVSWAP_STATUS_DEVICE_ERROR` (CUDA); `KVSWAP_STATUS_PANIC` (a layer left
/// unusable by an earlier panic). `count` 0 is a call that selects nothing.
/// On CUDA, if the copy kernel of an eager call cannot be launched (twice)
/// after the residency kernel was queued, the layer's slots no longer match
/// their chunks: that call, every later swap-in of the layer and
/// `kvswap_sync` return `KVSWAP_STATUS_DEVICE_ERROR` saying so, until a
/// `kvswap_layer_forget` of all its chunks (or a new context).
/// kvswap's kernels allow programmatic dependent launch: an engine kernel
/// launched as a programmatic dependent of this call must wait
/// (`cudaGridDependencySynchronize`) before it reads the indices or the
/// staging rows, as that launch mode requires.
#[no_mangle]
pub extern "C" fn kvswap_swap_in_selected(
    ctx: *mut KvswapContext,
    layer: u32,
    indices: *mut i32,
    window_len: u32,
    count: u32,
    stream: KvswapStream,
) -> KvswapStatus {
    boundary("kvswap_swap_in_selected", || {
        let c = ctx_ref(ctx)?;
        check_aligned(indices as *const i32, "indices")?;
        // SAFETY: the engine promises window_len + count ints, not used
        // concurrently.
        unsafe { c.swap_in_raw(layer as usize, indices as u64, window_len, count, stream as u64) }
    })
}

/// The swap-ins of several layers in one call: for each of the `n`
/// requests (host memory), what `kvswap_swap_in_selected(ctx,
/// requests[i].layer, requests[i].indices, requests[i].window_len,
/// requests[i].count, stream)` does, with the same results, counters and
/// errors for that layer. For engines whose layers share one global top-k
/// (as the original engine's do): with `topk` not NULL, `topk[0 ..
/// requests[i].count)` (device memory on CUDA) is first copied into each
/// request's selected entries, so the scorer's output needs no copy per
/// layer; with `topk` NULL the entries already hold the selection.
///
/// On the CUDA backend with `sync = 0` the call is one launch pair on
/// `stream` for up to 64 requests (more: one pair per 64, in order): a
/// residency kernel with one block per layer (copying `topk` in first),
/// then one copy kernel for all their misses. It may be captured in a CUDA
/// graph. If that copy kernel cannot be launched (twice) after the residency
/// kernel was queued, an eager call leaves every swapping layer of the pair
/// that had entries unusable, as `kvswap_swap_in_selected` leaves its layer,
/// and names them; a captured call returns the error, and that capture must
/// be discarded (its graph would update residency without copying). When a
/// launch of a later pair fails, the pairs before it were issued and the
/// ones after it are unchanged. With `KVSWAP_VALIDATE=1`, with `sync = 1`, and on the CPU
/// backend, the layers run one after another in the requests' order. With
/// `sync = 1`, on both backends, every request's ids (`topk`, or its
/// entries) are checked first: an id out of range or never stored refuses
/// the call before any layer or entry changes, with the error
/// `kvswap_swap_in_selected` gives for it, naming the first such request
/// (on CUDA by one small check kernel per request on `stream`, whose
/// results are read back before any swap-in runs). Any other failure of a
/// request's swap-in with
/// `sync = 1` (on CUDA a device error, or with `KVSWAP_VALIDATE=1` a slot
/// that differs from its host copy) stops the call, which returns its
/// error (naming the request and layer); the requests before it were done,
/// the ones after it are unchanged, and its own layer is left as
/// `kvswap_swap_in_selected` leaves it on that error, with `topk` possibly
/// already copied into its entries.
/// With `sync = 0` errors in the entries are deferred per layer, as
/// `kvswap_swap_in_selected` defers them, and every request runs.
///
/// Every argument of every request is checked before any layer changes:
/// `KVSWAP_STATUS_NULL_POINTER` (NULL `ctx`, `requests` or a request's
/// `indices`); `KVSWAP_STATUS_INVALID_ARGUMENT` (`n` 0, a layer named twice,
/// selected entries that overlap another request's or `topk`, a nonzero
/// `reserved`, a misaligned pointer, on CUDA the NULL stream or pageable
/// host memory);
/// `KVSWAP_STATUS_OUT_OF_RANGE` (as `kvswap_swap_in_selected`, per request;
/// on CUDA `topk` past the end of its allocation);
/// `KVSWAP_STATUS_WRONG_DEVICE`; `KVSWAP_STATUS_DEVICE_ERROR`;
/// `KVSWAP_STATUS_PANIC`; `n` above the context's layer count is
/// `KVSWAP_STATUS_INVALID_ARGUMENT`.
#[no_mangle]
pub extern "C" fn kvswap_swap_in_layers(
    ctx: *mut KvswapContext,
    requests: *const KvswapSwapIn,
    n: usize,
    topk: *const i32,
    stream: KvswapStream,
) -> KvswapStatus {
    boundary("kvswap_swap_in_layers", || {
        let c = ctx_ref(ctx)?;
        check_aligned(requests, "requests")?;
        // Before the slice is made: n at most the layer count keeps it
        // within the engine's array of a valid call.
        c.check_request_count(n)?;
        // SAFETY: the engine promises `n` requests in host memory (n is at
        // most the layer count, so the slice's size fits isize).
        let requests = unsafe { std::slice::from_raw_parts(requests, n) };
        // SAFETY: the engine promises each request's index buffer and topk's
        // ids, not used concurrently.
        unsafe { c.swap_in_layers_raw(requests, topk as u64, stream as u64) }
    })
}

/// Forgets the chunks `first_id .. first_id + n` of `layer`, for an engine
/// that reuses a context for another sequence (`first_id` 0, `n` =
/// `compressed_cap`: every chunk) or drops the tail of one (a llama.cpp
/// `seq_rm`). Each of them is as if never stored: a swap-in of it is
/// `KVSWAP_STATUS_NOT_STORED` until it is stored again. A slot holding one
/// is emptied, and every empty slot becomes least recently used, in
/// ascending slot index, ahead of the slots that hold chunks (whose order
/// is kept), so the next misses fill them first; forgetting every chunk
/// leaves the layer's residency as `kvswap_create` made it. Without this
/// call, a chunk id that the new sequence has not stored yet would still
/// select the old sequence's bytes.
/// The bytes in the host tier and in the staging rows are not cleared: no
/// chunk can be selected before it is stored again, and a swap-in copies a
/// chunk into an empty slot before it returns that slot. The counters
/// (`kvswap_layer_stats`) are kept, and an error an earlier call deferred is
/// still returned by the next `kvswap_sync` or `kvswap_layer_stats`.
/// On CUDA the call is one small kernel on `stream`, queued after the
/// layer's earlier calls (no host wait, with either sync setting); it may be
/// captured in a CUDA graph, and then forgets at every launch of it. Calls
/// made after it see the chunks forgotten. A call that forgets every chunk,
/// not captured, makes a layer that a failed copy launch left unusable (see
/// `kvswap_swap_in_selected`) usable again: no slot holds a chunk then.
/// `n` 0 changes nothing; `n` = `KVSWAP_FORGET_TO_END` forgets every chunk
/// from `first_id` on (`kvswap_layer_forget(ctx, l, 0, KVSWAP_FORGET_TO_END,
/// stream)`: the whole layer). Errors (nothing changed, except as said for
/// the last one):
/// `KVSWAP_STATUS_NULL_POINTER` (NULL `ctx`); `KVSWAP_STATUS_OUT_OF_RANGE`
/// (a bad layer, a negative `first_id`, `first_id` above `compressed_cap`,
/// `first_id + n` above it for any other `n`); `KVSWAP_STATUS_INVALID_ARGUMENT` (on CUDA the NULL
/// stream or `CU_STREAM_LEGACY`); `KVSWAP_STATUS_WRONG_DEVICE` (a stream of
/// another device); `KVSWAP_STATUS_PANIC` (a layer left unusable by an
/// earlier panic); `KVSWAP_STATUS_DEVICE_ERROR`: the launch failed (nothing
/// changed), or the launch was queued but the event that orders the layer's
/// later calls after it could not be recorded: the call then waits for the
/// stream on the host before it returns this, and the chunks are forgotten.
#[no_mangle]
pub extern "C" fn kvswap_layer_forget(
    ctx: *mut KvswapContext,
    layer: u32,
    first_id: i32,
    n: u32,
    stream: KvswapStream,
) -> KvswapStatus {
    boundary("kvswap_layer_forget", || {
        let c = ctx_ref(ctx)?;
        c.forget(layer as usize, first_id, n, stream as u64)
    })
}

/// Writes the counters of `layer` to `*out`. Waits for the layer's last
/// eager call (after a graph launch, call `kvswap_sync` with the launch
/// stream first) and returns a deferred error of an earlier asynchronous
/// call instead of the counters, if there is one (clearing it;
/// `kvswap_layer_stats_peek` leaves it).
/// Other errors: `KVSWAP_STATUS_NULL_POINTER`, `KVSWAP_STATUS_INVALID_ARGUMENT`
/// (misaligned `out`), `KVSWAP_STATUS_OUT_OF_RANGE` (a bad layer),
/// `KVSWAP_STATUS_PANIC` (a layer left unusable by an earlier panic).
#[no_mangle]
pub extern "C" fn kvswap_layer_stats(ctx: *mut KvswapContext, layer: u32, out: *mut KvswapLayerStats) -> KvswapStatus {
    layer_stats_into("kvswap_layer_stats", ctx, layer, out, Context::stats)
}

/// The body of both stats functions: `read` (taking a deferred error or
/// not) into `*out`, written only on success.
fn layer_stats_into(
    name: &str,
    ctx: *mut KvswapContext,
    layer: u32,
    out: *mut KvswapLayerStats,
    read: fn(&Context, usize) -> Result<KvswapLayerStats>,
) -> KvswapStatus {
    boundary(name, || {
        let c = ctx_ref(ctx)?;
        check_aligned(out, "out")?;
        let s = read(c, layer as usize)?;
        write_out(out, s);
        Ok(())
    })
}

/// `kvswap_layer_stats` that never takes a deferred error: writes the
/// counters of `layer` to `*out` and leaves an error an earlier
/// asynchronous call deferred for `kvswap_layer_sync`, `kvswap_sync` or
/// `kvswap_layer_stats`. For a thread that polls counters (metrics, logs)
/// beside the threads that drive the layers: `kvswap_layer_stats` would
/// take their errors. Waits for the layer's last eager call, as
/// `kvswap_layer_stats` does (after a graph launch, synchronise the launch
/// stream first).
/// Errors: `KVSWAP_STATUS_NULL_POINTER`, `KVSWAP_STATUS_INVALID_ARGUMENT`
/// (misaligned `out`), `KVSWAP_STATUS_OUT_OF_RANGE` (a bad layer),
/// `KVSWAP_STATUS_PANIC` (a layer left unusable by an earlier panic), on
/// CUDA `KVSWAP_STATUS_DEVICE_ERROR` (the wait or the read-back failed).
#[no_mangle]
pub extern "C" fn kvswap_layer_stats_peek(ctx: *mut KvswapContext, layer: u32, out: *mut KvswapLayerStats) -> KvswapStatus {
    layer_stats_into("kvswap_layer_stats_peek", ctx, layer, out, Context::stats_peek)
}

/// Writes where the staging rows of `layer` are: `*out_ptr` is slot 0 (the
/// attention kernel's row `window_len`), `*out_stride` the bytes between
/// rows, `*out_rows` the number of slots (`gpu_chunks`, or `compressed_cap`
/// when swap is off for the layer). Device memory on CUDA.
/// Errors: `KVSWAP_STATUS_NULL_POINTER`, `KVSWAP_STATUS_INVALID_ARGUMENT`
/// (a misaligned out-pointer), `KVSWAP_STATUS_OUT_OF_RANGE` (a bad layer),
/// `KVSWAP_STATUS_PANIC` (a layer left unusable by an earlier panic).
#[no_mangle]
pub extern "C" fn kvswap_layer_staging(
    ctx: *mut KvswapContext,
    layer: u32,
    out_ptr: *mut *mut c_void,
    out_stride: *mut usize,
    out_rows: *mut u32,
) -> KvswapStatus {
    boundary("kvswap_layer_staging", || {
        let c = ctx_ref(ctx)?;
        check_aligned(out_ptr, "out_ptr")?;
        check_aligned(out_stride, "out_stride")?;
        check_aligned(out_rows, "out_rows")?;
        let v = c.staging(layer as usize)?;
        write_out(out_ptr, v.ptr as *mut c_void);
        write_out(out_stride, v.stride as usize);
        write_out(out_rows, v.rows);
        Ok(())
    })
}

/// Waits for the context's outstanding device work and returns the first
/// error an asynchronous call recorded since the last synchronising call
/// (that of the lowest-numbered layer with one; the errors of every layer
/// are cleared). `stream` (ignored on the CPU
/// backend) is waited for as a whole first: pass the stream a graph was
/// launched on. NULL waits for each layer's last eager call only, not for
/// other work the engine queued (graph launches included). A stream being
/// captured is refused (`KVSWAP_STATUS_INVALID_ARGUMENT`): the wait would end
/// the capture. The deferred errors are those the calls would have returned
/// with `sync = 1` (`KVSWAP_STATUS_NOT_STORED`, `KVSWAP_STATUS_OUT_OF_RANGE`,
/// `KVSWAP_STATUS_VALIDATION_FAILED`, `KVSWAP_STATUS_DEVICE_ERROR`); one
/// call returns one and clears every layer's, so with several threads the
/// one that syncs receives the others' errors too (`kvswap_layer_sync`
/// returns and clears one layer's only). Other errors:
/// `KVSWAP_STATUS_NULL_POINTER` (NULL `ctx`); on CUDA
/// `KVSWAP_STATUS_WRONG_DEVICE` for a stream of another device,
/// `KVSWAP_STATUS_INVALID_ARGUMENT` for `CU_STREAM_LEGACY` (1) and
/// `KVSWAP_STATUS_DEVICE_ERROR` when the wait fails;
/// `KVSWAP_STATUS_PANIC` for a layer an earlier call panicked in (the other
/// layers are still cleared).
#[no_mangle]
pub extern "C" fn kvswap_sync(ctx: *mut KvswapContext, stream: KvswapStream) -> KvswapStatus {
    boundary("kvswap_sync", || ctx_ref(ctx)?.sync_stream(stream as u64))
}

/// `kvswap_sync` for one layer, for engines that drive layers from several
/// threads: waits for `stream` as a whole (as `kvswap_sync`; NULL: nothing),
/// then for the layer's last eager call, and returns the first error an
/// asynchronous call of this layer recorded since its last synchronising
/// call, clearing it. The other layers' errors are left for their own
/// syncs, `kvswap_layer_stats` or `kvswap_sync`.
/// Errors: the deferred ones of `kvswap_sync`; `KVSWAP_STATUS_NULL_POINTER`
/// (NULL `ctx`); `KVSWAP_STATUS_OUT_OF_RANGE` (a bad layer, before any
/// wait); on CUDA the stream errors of `kvswap_sync` (a capturing stream,
/// `CU_STREAM_LEGACY`, another device's stream) and
/// `KVSWAP_STATUS_DEVICE_ERROR` when a wait fails; `KVSWAP_STATUS_PANIC` (a
/// layer left unusable by an earlier panic).
#[no_mangle]
pub extern "C" fn kvswap_layer_sync(ctx: *mut KvswapContext, layer: u32, stream: KvswapStream) -> KvswapStatus {
    boundary("kvswap_layer_sync", || ctx_ref(ctx)?.sync_layer(layer as usize, stream as u64))
}

/// Writes what the context runs on to `*out`.
/// Errors: `KVSWAP_STATUS_NULL_POINTER`, `KVSWAP_STATUS_INVALID_ARGUMENT`
/// (misaligned `out`).
#[no_mangle]
pub extern "C" fn kvswap_context_info(ctx: *mut KvswapContext, out: *mut KvswapContextInfo) -> KvswapStatus {
    boundary("kvswap_context_info", || {
        let c = ctx_ref(ctx)?;
        check_aligned(out, "out")?;
        let mut staging = 0u64;
        let mut swap_layers = 0u32;
        for l in 0..c.n_layers() {
            let p = c.plan(l)?;
            if p.staging.is_none() {
                staging += p.slots as u64 * p.chunk_bytes as u64;
            }
            swap_layers += p.swap as u32;
        }
        write_out(
            out,
            KvswapContextInfo {
                backend: match c.backend_kind() {
                    BackendKind::Cpu => KVSWAP_BACKEND_CPU,
                    BackendKind::Cuda => KVSWAP_BACKEND_CUDA,
                },
                device: if c.backend_kind() == BackendKind::Cpu { -1 } else { c.config().device },
                n_layers: c.n_layers() as u32,
                swap_layers,
                host_tier_bytes: c.host_bytes(),
                staging_bytes: staging,
            },
        );
        Ok(())
    })
}

/// The text of the last failure on this thread ("" if none). Valid until the
/// next kvswap call on this thread fails; never NULL.
#[no_mangle]
pub extern "C" fn kvswap_last_error() -> *const c_char {
    match catch_unwind(|| LAST_ERROR.try_with(|e| e.borrow().as_ptr()).unwrap_or(c"".as_ptr())) {
        Ok(p) => p,
        Err(_) => c"kvswap_last_error: internal panic".as_ptr(),
    }
}

/// The library version, e.g. "0.1.0". Static storage, never NULL.
#[no_mangle]
pub extern "C" fn kvswap_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr() as *const c_char
}

/// The name of a status constant, e.g. "KVSWAP_STATUS_NOT_STORED"
/// ("KVSWAP_STATUS_UNKNOWN" for other values). Static storage.
#[no_mangle]
pub extern "C" fn kvswap_status_name(status: i32) -> *const c_char {
    catch_unwind(|| status_name(status)).unwrap_or(c"KVSWAP_STATUS_UNKNOWN".as_ptr())
}

fn status_name(status: i32) -> *const c_char {
    use KvswapStatus::*;
    let all = [
        Ok, InvalidArgument, NullPointer, OutOfRange, NotStored, PinnedCap, TopkGuard, NoDevice,
        DeviceError, OutOfMemory, ValidationFailed, WrongDevice, Io, BadCheckpoint, Unsupported, Panic,
    ];
    static NAMES: std::sync::OnceLock<Vec<(i32, CString)>> = std::sync::OnceLock::new();
    let names = NAMES.get_or_init(|| all.iter().map(|s| (*s as i32, CString::new(s.name()).unwrap())).collect());
    names
        .iter()
        .find(|(v, _)| *v == status)
        .map(|(_, n)| n.as_ptr())
        .unwrap_or(c"KVSWAP_STATUS_UNKNOWN".as_ptr())
}

/// Routes kvswap's log lines to `callback` (NULL: back to stderr). Lines keep
/// the shapes documented in README.md (`kvswap_stats layer=...`). The
/// callback may be called from any thread that is inside a kvswap call, from
/// several at once, and may itself call kvswap. This function returns once
/// no other thread is inside a previous callback, which is never called
/// again: the previous `user_data` may then be freed. Called from inside a
/// callback it does not wait (that callback is still running), and it does
/// nothing when another thread has replaced the callback since that
/// callback was called (the later replacement stands). It waits
/// without a time limit, so do not call it while holding a lock a running
/// callback may wait for, and a callback must not wait for another thread
/// that calls it. `line` is valid only during the call (copy it to keep
/// it). The callback must return normally: a C++ exception or other unwind
/// out of it aborts the process.
#[no_mangle]
pub extern "C" fn kvswap_set_log_callback(callback: KvswapLogCallback, user_data: *mut c_void) -> KvswapStatus {
    boundary("kvswap_set_log_callback", || {
        crate::logging::set_callback(callback, user_data);
        Ok(())
    })
}

/// Sets the log level: 0 off, 1 error, 2 warn, 3 info, 4 debug, 5 trace
/// (the default is info, or the level `KVSWAP_LOG` names). Another value is
/// `KVSWAP_STATUS_INVALID_ARGUMENT` (the level unchanged).
#[no_mangle]
pub extern "C" fn kvswap_set_log_level(level: u32) -> KvswapStatus {
    boundary("kvswap_set_log_level", || {
        if crate::logging::set_level(level) {
            Ok(())
        } else {
            Err(Error::invalid(format!("log level {level} is not 0..5")))
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CStr;

    fn last() -> String {
        unsafe { CStr::from_ptr(kvswap_last_error()) }.to_string_lossy().into_owned()
    }

    #[test]
    fn panic_becomes_status_and_text() {
        let s = boundary("t", || panic!("boom {}", 7));
        assert_eq!(s, KvswapStatus::Panic);
        assert!(last().contains("boom 7"), "{}", last());
        let s = boundary("t", || -> Result<()> { std::panic::panic_any(42u8) });
        assert_eq!(s, KvswapStatus::Panic);
    }

    #[test]
    fn status_names() {
        let n = unsafe { CStr::from_ptr(kvswap_status_name(4)) };
        assert_eq!(n.to_str().unwrap(), "KVSWAP_STATUS_NOT_STORED");
        let n = unsafe { CStr::from_ptr(kvswap_status_name(12345)) };
        assert_eq!(n.to_str().unwrap(), "KVSWAP_STATUS_UNKNOWN");
    }
}
