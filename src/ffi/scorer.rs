//! The C ABI of the FlashMemory scorer (`fm_*`): loading a checkpoint,
//! scoring chunks and writing the top-k, batched scoring, and the
//! training-free key-bounds scorer. Same rules as the rest of the ABI:
//! status codes, checked pointers, out-parameters written only on success,
//! no panic across the boundary, `kvswap_last_error()` for the text.
//!
//! The functions take raw pointers from C and are not `unsafe fn`: what a
//! pointer must point to is the C caller's contract, documented on each one.
#![allow(clippy::not_unsafe_ptr_arg_deref)]

use super::{boundary, check_aligned, write_out, KvswapStream};
use crate::config::{KvswapEnsemble, KVSWAP_ENSEMBLE_MAX, KVSWAP_ENSEMBLE_MEAN};
use crate::config::Ensemble;
use crate::error::{Error, KvswapStatus, Result};
use crate::scorer::backend::{BoundsRef, KeysRef, SeqRef};
use crate::scorer::keys::FmKeyDtype;
use crate::scorer::{self, args, KeyDtype, KvswapFmQuery, Query, Scorer, KVSWAP_FM_QUERY_AUTO, KVSWAP_FM_QUERY_WIDE};
use std::ffi::{c_char, c_void, CStr};
use std::path::PathBuf;

/// Opaque handle to a loaded FlashMemory scorer. Create with
/// `fm_scorer_load`, free with `fm_scorer_free`. Scoring calls may run on
/// several threads at once with the same handle.
pub struct FmScorer {
    inner: Scorer,
}

/// Indexer keys: one row per chunk (per token for `fm_bounds_build`), each
/// of `head_dim` elements (`dim` for `fm_bounds_build`). On the CUDA backend
/// `data` and `scales` are device pointers; on the CPU, host pointers.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct FmKeys {
    /// Row 0 of the keys, aligned to the element size. The CUDA scorer
    /// (`fm_score_topk`, `fm_score_topk_batch`) reads rows 16 bytes at a
    /// time: there `data` and a non-zero `row_stride_bytes` must be
    /// multiples of 16.
    pub data: *const c_void,
    /// `FM_KEYS_FP8_E4M3` only: one f32 scale per row (key = fp8 x scale).
    /// Ignored for the other types (may be NULL).
    pub scales: *const f32,
    /// Bytes from one row to the next: 0 means dense (row size); otherwise a
    /// multiple of the element size, at least the row size.
    pub row_stride_bytes: usize,
    /// `FM_KEYS_F32`, `FM_KEYS_BF16` or `FM_KEYS_FP8_E4M3`.
    pub dtype: FmKeyDtype,
}

/// One sequence of `fm_score_topk_batch`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct FmSeq {
    /// `n_scorers x hidden` f32 (see `FmScorerInfo`): scorer i's input starts
    /// at element `i * hidden`.
    pub hidden: *const f32,
    /// The sequence's chunk keys.
    pub keys: FmKeys,
    /// Chunks to score, 1 to FM_MAX_CHUNKS.
    pub n_chunks: usize,
    /// Room for k int32: the top-k chunk ids (-1 padded).
    pub out_indices: *mut i32,
}

/// What a loaded scorer holds, from `fm_scorer_info`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct FmScorerInfo {
    /// Scorer heads; the hidden input of a call holds n_scorers x hidden f32.
    pub n_scorers: u32,
    /// Width of each scorer's hidden input.
    pub hidden: u32,
    /// Heads per scorer.
    pub n_heads: u32,
    /// Elements per key (and per head).
    pub head_dim: u32,
    /// `KVSWAP_ENSEMBLE_MAX` or `KVSWAP_ENSEMBLE_MEAN`, as now in force.
    pub ensemble: KvswapEnsemble,
    /// -1 for the CPU backend, else the CUDA device ordinal.
    pub device: i32,
    /// Bytes of the weight tensors as stored in the checkpoint.
    pub weight_bytes: u64,
    /// `KVSWAP_FM_QUERY_AUTO` or `KVSWAP_FM_QUERY_WIDE`, as now in force.
    pub query: KvswapFmQuery,
    /// Zero.
    pub reserved: u32,
}

fn scorer_ref<'a>(s: *const FmScorer) -> Result<&'a Scorer> {
    check_aligned(s, "scorer")?;
    // SAFETY: non-NULL handles come from fm_scorer_load and stay valid until
    // fm_scorer_free, per the API contract.
    Ok(unsafe { &(*s).inner })
}

fn keys_ref(k: &FmKeys) -> Result<KeysRef> {
    Ok(KeysRef {
        data: k.data as u64,
        scales: k.scales as u64,
        row_stride: k.row_stride_bytes,
        dtype: KeyDtype::from_code(k.dtype)?,
    })
}

fn path_arg(path: *const c_char) -> Result<PathBuf> {
    check_aligned(path, "path")?;
    // SAFETY: non-NULL; the engine promises a NUL-terminated string.
    let bytes = unsafe { CStr::from_ptr(path) }.to_bytes();
    if bytes.is_empty() {
        return Err(Error::invalid("path is empty"));
    }
    #[cfg(unix)]
    let p = PathBuf::from(<std::ffi::OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(bytes));
    #[cfg(not(unix))]
    let p = PathBuf::from(std::str::from_utf8(bytes).map_err(|_| Error::invalid("path is not valid UTF-8"))?);
    Ok(p)
}

/// Loads a FlashMemory checkpoint (safetensors, format `flashmemory-v1`)
/// and writes a scorer handle to `*out`. `device` -1 scores on the CPU
/// (the reference); a CUDA ordinal >= 0 uploads the weights to that GPU (as
/// stored: bf16 stays bf16; a checkpoint whose tensors differ in dtype is
/// uploaded as f32) and compiles the kernels for it
/// (`KVSWAP_STATUS_NO_DEVICE` without a driver, device or NVRTC;
/// `KVSWAP_STATUS_UNSUPPORTED` for a shape the CUDA kernels do not take:
/// head_dim 64/128/192/256, n_heads a multiple of 8 (of 64 above 64), hidden
/// a multiple of 8). On CUDA, `KVSWAP_SYNC` (default 1), read from the
/// environment here (the `fm_*` functions take no `KvswapConfig`; pass
/// `cfg.fm_ckpt` yourself), decides whether scoring calls wait for their
/// own errors (see `fm_scorer_sync`; `fm_scorer_set_sync` changes it
/// later, without the environment). On every backend `KVSWAP_FM_QUERY`
/// (`auto`, the default, or `wide`; see `fm_scorer_set_query`), also read
/// here, sets the query of fp8 keys, and `KVSWAP_FM_ENSEMBLE` (or
/// `POCKETLLM_GGUF_FLASHMEMORY_ENSEMBLE`), when set, the ensemble (`max` or
/// `mean`; unset or blank: the checkpoint's; `fm_scorer_set_ensemble`
/// changes it later).
/// Errors: `KVSWAP_STATUS_IO` for a missing or unreadable file;
/// `KVSWAP_STATUS_BAD_CHECKPOINT` for a wrong format tag, a missing or
/// malformed metadata field, a missing or mis-shaped tensor, an unsupported
/// dtype (F32, F16 and BF16 are accepted), a NaN/Inf weight, a file
/// whose size is not what its header describes, a header over 1 MiB or one
/// that repeats a key (all refused from the header, before the data is
/// read), the message naming the field or tensor, what
/// was expected and what was found; `KVSWAP_STATUS_NULL_POINTER` for a NULL
/// `path` or `out`; `KVSWAP_STATUS_INVALID_ARGUMENT` for an empty path,
/// `device < -1`, a misaligned `out`, a bad `KVSWAP_FM_QUERY`,
/// `KVSWAP_FM_ENSEMBLE`, `KVSWAP_MEM_PROFILE` or `KVSWAP_SYNC` (or their
/// aliases; `KVSWAP_SYNC` is checked on the CPU too, where it changes
/// nothing);
/// `KVSWAP_STATUS_NO_DEVICE` for `device >= 0` without that CUDA device,
/// driver or NVRTC (libnvrtc.so.13) (or in a build without CUDA);
/// `KVSWAP_STATUS_UNSUPPORTED` for a
/// shape the CUDA kernels do not cover, a driver older than CUDA 12.3, or
/// an NVRTC of a newer CUDA major version than the driver;
/// `KVSWAP_STATUS_OUT_OF_MEMORY` when
/// the host cannot hold the file or the device its weights;
/// `KVSWAP_STATUS_DEVICE_ERROR` when NVRTC or the driver fails.
#[no_mangle]
pub extern "C" fn fm_scorer_load(path: *const c_char, device: i32, out: *mut *mut FmScorer) -> KvswapStatus {
    boundary("fm_scorer_load", || {
        check_aligned(out, "out")?;
        let scorer = Scorer::load(&path_arg(path)?, device)?;
        write_out(out, Box::into_raw(Box::new(FmScorer { inner: scorer })));
        Ok(())
    })
}

/// Frees a scorer. NULL is a no-op. No other call may use `scorer` during
/// or after this one, and no device work using it may still be pending; a
/// CUDA graph with calls of this scorer captured in it addresses its
/// weights and workspaces, so must not be launched after this.
#[no_mangle]
pub extern "C" fn fm_scorer_free(scorer: *mut FmScorer) {
    boundary("fm_scorer_free", || {
        if !scorer.is_null() {
            // SAFETY: created by Box::into_raw in fm_scorer_load.
            drop(unsafe { Box::from_raw(scorer) });
        }
        Ok(())
    });
}

/// Writes the shape and settings of a loaded scorer to `*out`.
/// Errors: `KVSWAP_STATUS_NULL_POINTER` (NULL `scorer` or `out`),
/// `KVSWAP_STATUS_INVALID_ARGUMENT` (misaligned `scorer` or `out`).
#[no_mangle]
pub extern "C" fn fm_scorer_info(scorer: *const FmScorer, out: *mut FmScorerInfo) -> KvswapStatus {
    boundary("fm_scorer_info", || {
        let s = scorer_ref(scorer)?;
        check_aligned(out, "out")?;
        let m = s.meta();
        write_out(
            out,
            FmScorerInfo {
                n_scorers: m.n_scorers,
                hidden: m.hidden,
                n_heads: m.n_heads,
                head_dim: m.head_dim,
                ensemble: scorer::ensemble_code(s.ensemble()),
                device: s.device(),
                weight_bytes: s.checkpoint().weight_bytes(),
                query: scorer::query_code(s.query()),
                reserved: 0,
            },
        );
        Ok(())
    })
}

/// Waits for `stream` and returns the error an earlier call on it recorded
/// on the device, clearing it. With sync 0 (`KVSWAP_SYNC=0` at load or
/// `fm_scorer_set_sync(scorer, 0)`) on the CUDA backend a call does not
/// wait: a NaN or infinite hidden value, key or scale then
/// writes the top-k as -1 and is reported here (also when it was recorded by
/// a CUDA graph's replay). A graph's calls use the workspace of the stream
/// they were captured on, whatever stream the graph is launched on (so two
/// launches of graphs captured on one stream, or such a launch and an eager
/// call on that stream, must not run at the same time), and record their
/// errors there. One error is returned per call: one recorded by calls on
/// `stream`; when there is none, one recorded for a stream that calls were
/// captured on, so the sync of the stream a graph was launched on reports
/// the graph's error (as does the capture stream's). Such an error goes to
/// whichever sync finds it first (with several threads, perhaps another
/// thread's); an error is cleared only when returned, so a later sync
/// returns the next. This function waits for `stream` only: while other
/// work that records into a workspace it reads is still running (a launch,
/// on a stream other than `stream`, of a graph captured on `stream` or on
/// another capture stream, or a call on another capture stream), it may
/// take an error that work records before the work has written its -1s;
/// that work may then write a top-k computed from the non-finite values
/// and record a further error. For the -1 guarantee, call it when no such
/// work runs. Keep the capture stream alive while the graph is in use. On
/// the CPU backend errors are returned at once and
/// this returns KVSWAP_STATUS_OK. A stream being captured is refused
/// (KVSWAP_STATUS_INVALID_ARGUMENT): the wait would end the capture.
/// Errors besides the recorded one: `KVSWAP_STATUS_NULL_POINTER` (NULL
/// `scorer`), `KVSWAP_STATUS_INVALID_ARGUMENT` (misaligned `scorer`); on
/// CUDA `KVSWAP_STATUS_INVALID_ARGUMENT` for the NULL (legacy) stream, `KVSWAP_STATUS_WRONG_DEVICE` for a stream of another device,
/// `KVSWAP_STATUS_DEVICE_ERROR` when the wait fails.
#[no_mangle]
pub extern "C" fn fm_scorer_sync(scorer: *const FmScorer, stream: KvswapStream) -> KvswapStatus {
    boundary("fm_scorer_sync", || scorer_ref(scorer)?.sync(stream as u64))
}

/// Overrides the checkpoint's ensemble: `KVSWAP_ENSEMBLE_MAX` or
/// `KVSWAP_ENSEMBLE_MEAN`. Applies to calls that start after it returns;
/// a CUDA graph keeps the setting of its capture (capture again).
/// Errors: `KVSWAP_STATUS_NULL_POINTER` (NULL `scorer`),
/// `KVSWAP_STATUS_INVALID_ARGUMENT` (misaligned `scorer`, any other value).
#[no_mangle]
pub extern "C" fn fm_scorer_set_ensemble(scorer: *mut FmScorer, ensemble: KvswapEnsemble) -> KvswapStatus {
    let choices = [(KVSWAP_ENSEMBLE_MAX, Ensemble::Max), (KVSWAP_ENSEMBLE_MEAN, Ensemble::Mean)];
    set_choice("fm_scorer_set_ensemble", scorer, "ensemble", ensemble, &choices, "KVSWAP_ENSEMBLE_MAX (0) or KVSWAP_ENSEMBLE_MEAN (1)", Scorer::set_ensemble)
}

/// A scorer setting given by its C constant: `value` must be one of
/// `choices` (else INVALID_ARGUMENT naming `what` and the `expected`
/// constants, the setting unchanged), then `apply` sets it.
fn set_choice<T: Copy>(
    function: &'static str,
    scorer: *mut FmScorer,
    what: &str,
    value: u32,
    choices: &[(u32, T)],
    expected: &str,
    apply: impl FnOnce(&Scorer, T),
) -> KvswapStatus {
    boundary(function, || {
        let s = scorer_ref(scorer)?;
        let v = choices
            .iter()
            .find(|(code, _)| *code == value)
            .ok_or_else(|| Error::invalid(format!("{what} = {value}: expected {expected}")))?
            .1;
        apply(s, v);
        Ok(())
    })
}

/// Sets the query fp8 keys are scored with: `KVSWAP_FM_QUERY_AUTO` (the
/// fp8 query, the default) or `KVSWAP_FM_QUERY_WIDE` (q never quantized to
/// fp8). The default is `KVSWAP_FM_QUERY` (`auto` or `wide`), read by
/// `fm_scorer_load`. Applies to calls that start after it returns; a CUDA
/// graph keeps the setting of its capture (capture again).
/// Errors: `KVSWAP_STATUS_NULL_POINTER` (NULL `scorer`),
/// `KVSWAP_STATUS_INVALID_ARGUMENT` (misaligned `scorer`, any other value).
#[no_mangle]
pub extern "C" fn fm_scorer_set_query(scorer: *mut FmScorer, query: KvswapFmQuery) -> KvswapStatus {
    let choices = [(KVSWAP_FM_QUERY_AUTO, Query::Auto), (KVSWAP_FM_QUERY_WIDE, Query::Wide)];
    set_choice("fm_scorer_set_query", scorer, "query", query, &choices, "KVSWAP_FM_QUERY_AUTO (0) or KVSWAP_FM_QUERY_WIDE (1)", Scorer::set_query)
}

/// Sets whether later calls of `scorer` wait for the device and return
/// their own errors: 1 (`KVSWAP_SYNC=1`, the default) waits; 0 returns once
/// the work is queued (needed for capture in a CUDA graph), device errors
/// then reported by `fm_scorer_sync`. The default is `KVSWAP_SYNC`, read by
/// `fm_scorer_load`; this function lets an engine choose without setting
/// the environment. On the CPU backend, which always reports errors at
/// once, it changes nothing. Applies to calls that start after it returns;
/// a CUDA graph keeps the setting of its capture. Switching to 1 with an
/// error pending on a stream: the next call there that gets past its
/// argument checks returns it, if an earlier call on that stream recorded
/// it in the stream's present workspace; an error recorded by a graph
/// (captured on another stream, or before the stream's workspace grew) is
/// returned by `fm_scorer_sync` only.
/// Errors: `KVSWAP_STATUS_NULL_POINTER` (NULL `scorer`),
/// `KVSWAP_STATUS_INVALID_ARGUMENT` (misaligned `scorer`, a value other
/// than 0 or 1; the setting unchanged).
#[no_mangle]
pub extern "C" fn fm_scorer_set_sync(scorer: *mut FmScorer, sync: u32) -> KvswapStatus {
    set_choice("fm_scorer_set_sync", scorer, "sync", sync, &[(0, false), (1, true)], "0 or 1", Scorer::set_sync)
}

/// Allocates `stream`'s workspace (CUDA) for every call of up to `n_seqs`
/// sequences of up to `n_chunks` chunks each (`fm_score_topk` is one
/// sequence), so that those calls on `stream` need no allocation, nor the
/// wait for the stream that comes with one: call it before capturing the
/// stream into a CUDA graph, instead of a warm-up call with real inputs. A
/// later call with more chunks or sequences grows the workspace again
/// (and waits). This call waits for the stream when it allocates (a
/// workspace already as large changes nothing and waits for nothing); it
/// may run while another stream is captured in any mode (see
/// `KvswapStream`). On the CPU backend there is no workspace: the
/// arguments are checked and `stream` is ignored.
/// Errors (no workspace allocated): `KVSWAP_STATUS_NULL_POINTER` (NULL
/// `scorer`); `KVSWAP_STATUS_INVALID_ARGUMENT` (misaligned `scorer`,
/// `n_seqs` or `n_chunks` 0; on CUDA the NULL (legacy) stream, a stream
/// being captured); `KVSWAP_STATUS_OUT_OF_RANGE` (`n_seqs` above
/// FM_MAX_SEQS, `n_chunks` above FM_MAX_CHUNKS);
/// `KVSWAP_STATUS_WRONG_DEVICE` (a stream of another device);
/// `KVSWAP_STATUS_OUT_OF_MEMORY` (the workspace: about 12 bytes per chunk
/// of up to 64 sequences, plus about 33 KB and the projections per
/// sequence); `KVSWAP_STATUS_DEVICE_ERROR` (an allocation, clear or wait
/// the driver refuses).
#[no_mangle]
pub extern "C" fn fm_scorer_reserve(scorer: *const FmScorer, n_seqs: usize, n_chunks: usize, stream: KvswapStream) -> KvswapStatus {
    boundary("fm_scorer_reserve", || scorer_ref(scorer)?.reserve(n_seqs, n_chunks, stream as u64))
}

/// Scores `n_chunks` chunks and writes the top-k chunk ids to
/// `out_indices[0 .. k)`: descending score, ties to the lower id, padded
/// with -1 when `n_chunks < k`.
///
/// `hidden` holds `n_scorers x hidden` f32 (sizes from `fm_scorer_info`):
/// scorer i reads the hidden state taken at its own layer, starting at
/// element `i * hidden`. `keys` describes
/// one key of `head_dim` elements per chunk, shared by all scorers. For
/// scorer i: `q = Wq h_i` as `[n_heads][head_dim]`, `w = Ww h_i`,
/// `s_i(c) = sum over heads h of w[h] * relu(q[h] . key_c)`; the chunk score
/// is the max or mean of `s_i(c)` over the scorers (`fm_scorer_set_ensemble`).
/// fp8 keys are scored with the fp8 query by default (`fm_scorer_set_query`):
/// each head's q is rounded to bf16, then scaled by 2^-e (e the smallest
/// integer with max |q| <= 448 * 2^e) and rounded to fp8 e4m3, and stands
/// for `e4m3 * 2^e` (DeepSeek-V3.2's fp8 indexer scores so); on a Hopper
/// GPU with head_dim 128 (and a wgmma shape) the tensor cores then multiply
/// fp8 by fp8 (half the tensor work of the wide query; figures in
/// README.md); elsewhere the quantized q is scored by the 16-bit kernels.
///
/// Limits: `n_chunks` from 1 to FM_MAX_CHUNKS (4,194,304), `k` from 1 to
/// FM_MAX_TOPK (2048); 0 is KVSWAP_STATUS_INVALID_ARGUMENT and a value above
/// the limit KVSWAP_STATUS_OUT_OF_RANGE. A NaN or Inf in `hidden`, the keys or the scales is
/// `KVSWAP_STATUS_INVALID_ARGUMENT` naming the scorer/chunk and position.
/// On the CUDA backend the values are checked on the device: the top-k is
/// then written as -1 and the error is returned by this call with sync 1
/// (`KVSWAP_SYNC=1`, the default, or `fm_scorer_set_sync`), or by
/// `fm_scorer_sync` with sync 0 (until then later calls on that stream
/// also write -1).
///
/// `out_indices` may point into the index buffer of
/// `kvswap_swap_in_selected`: with `out_indices = indices + window_len` and
/// `count = k`, that call then turns the selected logical ids into physical
/// ids (the -1 padding stays -1).
///
/// On the CPU backend every pointer is a host pointer (device memory is
/// refused where a CUDA driver identifies it) and `stream` is
/// ignored; on CUDA `hidden`, `keys->data`, `keys->scales` and
/// `out_indices` are device pointers (`keys` itself is host memory) and the
/// work is ordered on `stream`. The first call on a stream, and a call with more chunks than
/// any before on it, allocates the stream's workspace: make that call, or
/// `fm_scorer_reserve` for the shapes you will capture, before capturing
/// the stream (another stream's capture, in any mode, does not mind it:
/// see `KvswapStream`). Such a call also waits for the stream, with either
/// `KVSWAP_SYNC` (the new workspace is cleared and an old one's pending
/// error moved over before the old one is freed). A workspace (about 12 bytes per chunk, plus the projections of
/// up to 64 sequences) stays until the scorer is freed, one per stream (and
/// per thread using `CU_STREAM_PER_THREAD`); it is keyed by the stream's
/// handle, so destroy a stream only once its scorer work has completed (a
/// stream created later may get the same handle). On CUDA `hidden` must be
/// 16-byte aligned.
///
/// On CUDA the time also depends on how the scores are spread. The
/// selection sorts scores into 4,096 bins (each a band 6-12% wide); when
/// the k-th score's bin and the bins above it hold more than 4,096 chunks
/// (scores crowded together), it narrows them in a slower path. On an H200
/// at 262,144 chunks and k = 512 that path added 32-40 us to the 34.1 us of
/// a scoring pass with q and w given (`kvswap bench --backend cuda
/// --scorer`, its "scores" table; README.md).
///
/// Errors (nothing is written unless said otherwise):
/// - `KVSWAP_STATUS_NULL_POINTER`: `scorer`, `hidden`, `keys`, its `data`,
///   the scales of fp8 keys or `out_indices` NULL;
/// - `KVSWAP_STATUS_INVALID_ARGUMENT`: a zero size (above), a misaligned
///   pointer, an unknown key dtype or a bad `row_stride_bytes`, a NaN/Inf
///   value (above); on CUDA also pageable host memory where device memory
///   is expected, the NULL (legacy) stream, sync 1 on a stream being
///   captured, a workspace that would have to grow during a capture, and a
///   score that overflows f32 (the CPU's f64 reference does not);
/// - `KVSWAP_STATUS_OUT_OF_RANGE`: a size above its limit (above); on CUDA a
///   buffer that runs past the end of its allocation;
/// - `KVSWAP_STATUS_WRONG_DEVICE` (CUDA): a pointer or stream of another
///   device;
/// - `KVSWAP_STATUS_OUT_OF_MEMORY` (CUDA): the stream's workspace;
/// - `KVSWAP_STATUS_DEVICE_ERROR` (CUDA): a failed launch or wait; the
///   output is then unspecified.
#[no_mangle]
pub extern "C" fn fm_score_topk(
    scorer: *const FmScorer,
    hidden: *const f32,
    keys: *const FmKeys,
    n_chunks: usize,
    k: u32,
    out_indices: *mut i32,
    stream: KvswapStream,
) -> KvswapStatus {
    boundary("fm_score_topk", || {
        let s = scorer_ref(scorer)?;
        check_aligned(keys, "keys")?;
        // SAFETY: non-NULL; the engine promises a valid FmKeys.
        let keys = keys_ref(unsafe { &*keys })?;
        let seq = SeqRef { hidden: hidden as u64, keys, n_chunks, out: out_indices as u64 };
        // SAFETY: the engine promises the sizes documented above; `score_topk`
        // checks NULL pointers, alignment, limits and strides first.
        unsafe { s.score_topk(&seq, k, stream as u64) }
    })
}

/// Scores `n_seqs` sequences in one call, each as `fm_score_topk` does,
/// with the same `k` (1 to FM_MAX_TOPK) and `n_seqs` from 1 to FM_MAX_SEQS
/// (4096).
/// Every sequence is checked before any is scored, and on failure no
/// `out_indices` is written; the message names the sequence (`seqs[i]`).
/// The `out_indices` of different sequences must not overlap each other
/// (KVSWAP_STATUS_INVALID_ARGUMENT) nor, on CUDA, any sequence's hidden
/// state or keys (not checked).
/// On the CUDA backend NaN/Inf values are found on the device instead: a
/// call runs in launch groups (up to 64 sequences of one key dtype; f32,
/// then bf16, then fp8 keys, each in call order), and the outputs of the
/// group that finds one and of the call's later groups are written as -1;
/// the error names the sequence (its index in `seqs`) and the chunk or
/// hidden position, as for `fm_score_topk`.
/// The weights are read for a whole launch group, not once per sequence (on
/// CUDA a launch group's projections are one launch whose blocks for 8
/// sequences at a time read each weight row at the same time, so L2 can
/// serve one block's reads to the others: measured on an H200 with bf16
/// weights, 64 sequences read them from DRAM once), so a batch is cheaper
/// than `n_seqs` single calls. `seqs` itself is host memory on every
/// backend.
/// Errors: those of `fm_score_topk`, per sequence, plus
/// `KVSWAP_STATUS_NULL_POINTER` (NULL `seqs`) and for `n_seqs` 0
/// (`KVSWAP_STATUS_INVALID_ARGUMENT`) or above FM_MAX_SEQS
/// (`KVSWAP_STATUS_OUT_OF_RANGE`). `KVSWAP_STATUS_DEVICE_ERROR` (a failed
/// launch, CUDA) can come after earlier launch groups were queued: their
/// sequences' outputs are then written, the others' unspecified.
#[no_mangle]
pub extern "C" fn fm_score_topk_batch(
    scorer: *const FmScorer,
    n_seqs: usize,
    seqs: *const FmSeq,
    k: u32,
    stream: KvswapStream,
) -> KvswapStatus {
    boundary("fm_score_topk_batch", || {
        let s = scorer_ref(scorer)?;
        args::check_batch(n_seqs)?;
        check_aligned(seqs, "seqs")?;
        // SAFETY: non-NULL, count checked; the engine promises `n_seqs`
        // readable FmSeq in host memory.
        let seqs = unsafe { std::slice::from_raw_parts(seqs, n_seqs) };
        let refs = seqs
            .iter()
            .enumerate()
            .map(|(i, q)| {
                let keys = keys_ref(&q.keys).map_err(|e| Error::new(e.status, format!("seqs[{i}].{}", e.message)))?;
                Ok(SeqRef { hidden: q.hidden as u64, keys, n_chunks: q.n_chunks, out: q.out_indices as u64 })
            })
            .collect::<Result<Vec<_>>>()?;
        // SAFETY: as fm_score_topk, for every sequence.
        unsafe { s.score_topk_batch(&refs, k, stream as u64) }
    })
}

/// The training-free scorer (Quest-style): scores chunk c by
/// `sum over d of max(query[d] * bounds_min[c][d], query[d] * bounds_max[c][d])`
/// (an upper bound of `query . key` over the chunk's keys) and writes the
/// top-k ids to `out_indices` by the rules of `fm_score_topk` (the same
/// limits on `n_chunks` and `k`).
/// `query` holds `dim` f32 (`dim` from 1 to FM_MAX_BOUNDS_DIM = 65536); `bounds_min` and `bounds_max` hold
/// `n_chunks x dim` f32 each (see `fm_bounds_build`). Bounds are f32 only:
/// a narrower type would have to be rounded outwards to stay a bound.
/// NaN/Inf values, or a minimum above its maximum, are
/// `KVSWAP_STATUS_INVALID_ARGUMENT`. `device` -1 runs on the CPU (host
/// pointers, `stream` ignored); a CUDA ordinal runs on that GPU (device
/// pointers, the engine's stream; values are checked on the device as for
/// `fm_score_topk`: with sync 0 the call does not wait, writes the top-k as
/// -1 and `fm_bounds_sync` returns the error). On CUDA each stream
/// gets a workspace (about 12 bytes per chunk of its largest call) for the
/// life of the process; it is allocated or grown by a call, not while the
/// stream is captured: call `fm_bounds_reserve` with the largest `n_chunks`
/// (or make a call of that size) first; that call waits for the stream. On CUDA the device's sync setting is the one
/// `fm_bounds_set_sync` gave it, else each call reads `KVSWAP_SYNC` from
/// the environment; calls with either value share the device's error
/// records, so an error a sync 0 call left on a stream makes the later
/// calls there write -1 until it is returned, by `fm_bounds_sync` or by the
/// next sync 1 call there that gets past its argument checks (an
/// error recorded by a graph captured before the stream's workspace grew
/// is returned by `fm_bounds_sync` only).
/// Errors: as `fm_score_topk` (NULL pointers, sizes, values, and on CUDA
/// memory, streams, capture and devices), plus `KVSWAP_STATUS_INVALID_ARGUMENT`
/// for `device < -1`, a `dim` outside its range or (CUDA, with no
/// `fm_bounds_set_sync` setting for the device) a bad `KVSWAP_SYNC`, and `KVSWAP_STATUS_NO_DEVICE` for a CUDA ordinal without
/// that device, driver or NVRTC (or in a build without CUDA). The first call
/// on a device compiles the kernels for it: `KVSWAP_STATUS_UNSUPPORTED` for
/// a driver older than CUDA 12.3 or an NVRTC of a newer CUDA major version
/// than the driver, `KVSWAP_STATUS_DEVICE_ERROR` when NVRTC or the driver
/// fails.
#[no_mangle]
pub extern "C" fn fm_bounds_topk(
    device: i32,
    query: *const f32,
    bounds_min: *const f32,
    bounds_max: *const f32,
    dim: u32,
    n_chunks: usize,
    k: u32,
    out_indices: *mut i32,
    stream: KvswapStream,
) -> KvswapStatus {
    boundary("fm_bounds_topk", || {
        args::check_device(device)?;
        let b = BoundsRef {
            query: query as u64,
            min: bounds_min as u64,
            max: bounds_max as u64,
            dim: dim as usize,
            n_chunks,
            out: out_indices as u64,
        };
        // SAFETY: the engine promises the sizes documented above; the
        // arguments are checked first.
        unsafe { scorer::bounds_topk(device, &b, k, stream as u64) }
    })
}

/// Sets whether later `fm_bounds_topk` calls on CUDA `device` wait for the
/// device and return their own errors: 1 waits, 0 returns once the work is
/// queued (capturable; errors then reported by `fm_bounds_sync`), 2 returns
/// the device to `KVSWAP_SYNC` (default 1), which each call there reads
/// while the device has no setting, so an engine need not set the
/// environment. The setting is the process's, for every stream and thread,
/// until changed; a CUDA graph keeps the setting of its capture. The device
/// is not opened here (its first bounds call does so and reports a missing
/// device); `device` -1 (the CPU, which reports errors at once) is accepted
/// and changes nothing.
/// Errors: `KVSWAP_STATUS_INVALID_ARGUMENT` for `sync` other than 0, 1 or
/// 2, or `device < -1`; `KVSWAP_STATUS_NO_DEVICE` for a CUDA ordinal in a
/// build without CUDA.
#[no_mangle]
pub extern "C" fn fm_bounds_set_sync(device: i32, sync: u32) -> KvswapStatus {
    boundary("fm_bounds_set_sync", || {
        let s = match sync {
            0 => Some(false),
            1 => Some(true),
            2 => None,
            _ => return Err(Error::invalid(format!("sync = {sync}: expected 0, 1 or 2 (KVSWAP_SYNC)"))),
        };
        scorer::set_bounds_sync(device, s)
    })
}

/// Waits for `stream` and returns the error an earlier `fm_bounds_topk` on
/// `device` recorded on it with sync 0 (`KVSWAP_SYNC=0` or
/// `fm_bounds_set_sync`; clearing it; until then
/// later calls on that stream also write -1). `device` -1 (the CPU, which
/// reports errors at once) returns KVSWAP_STATUS_OK. A stream being captured
/// is refused (KVSWAP_STATUS_INVALID_ARGUMENT): the wait would end the
/// capture. Before any such call the device and the stream are still
/// checked and the stream waited for. As for `fm_scorer_sync` (one error
/// per call, cleared only when returned, and the same condition for the -1
/// guarantee), an error recorded for a stream that bounds calls were
/// captured on is returned by the sync of the stream its graph was launched
/// on (or captured on), or by whichever sync on `device` finds it first.
/// Errors besides the recorded one:
/// `KVSWAP_STATUS_INVALID_ARGUMENT` for `device < -1` or (CUDA) the NULL
/// (legacy) stream, `KVSWAP_STATUS_NO_DEVICE` for a CUDA ordinal without
/// that device or driver, `KVSWAP_STATUS_WRONG_DEVICE` for a stream of
/// another device, `KVSWAP_STATUS_UNSUPPORTED` (before any bounds call on
/// `device`: the driver and NVRTC versions are checked then) as for
/// `fm_bounds_topk`,
/// `KVSWAP_STATUS_DEVICE_ERROR` when the wait fails.
#[no_mangle]
pub extern "C" fn fm_bounds_sync(device: i32, stream: KvswapStream) -> KvswapStatus {
    boundary("fm_bounds_sync", || {
        args::check_device(device)?;
        scorer::bounds_sync(device, stream as u64)
    })
}

/// `fm_scorer_reserve` for the bounds scorer of `device`: allocates
/// `stream`'s workspace for every `fm_bounds_topk` call of up to `n_chunks`
/// chunks there, so those calls need no allocation (call it before
/// capturing the stream). The first call on a device also compiles the kernels (kept
/// for the process, also when the call then fails). The sync setting plays
/// no part. On the CPU (`device` -1) the arguments are checked and nothing
/// else happens.
/// Errors (no workspace allocated): `KVSWAP_STATUS_INVALID_ARGUMENT`
/// (`device < -1`, `n_chunks` 0, on CUDA the NULL stream or a stream being
/// captured); `KVSWAP_STATUS_OUT_OF_RANGE` (`n_chunks` above
/// FM_MAX_CHUNKS); `KVSWAP_STATUS_NO_DEVICE`, `KVSWAP_STATUS_UNSUPPORTED`
/// and `KVSWAP_STATUS_DEVICE_ERROR` as for `fm_bounds_topk`'s first call on
/// a device; `KVSWAP_STATUS_WRONG_DEVICE` (a stream of another device);
/// `KVSWAP_STATUS_OUT_OF_MEMORY` (the workspace); `KVSWAP_STATUS_DEVICE_ERROR`
/// (an allocation, clear or wait the driver refuses).
#[no_mangle]
pub extern "C" fn fm_bounds_reserve(device: i32, n_chunks: usize, stream: KvswapStream) -> KvswapStatus {
    boundary("fm_bounds_reserve", || scorer::bounds_reserve(device, n_chunks, stream as u64))
}

/// Builds per-chunk key bounds on the CPU (host pointers) for
/// `fm_bounds_topk`: `keys` holds `n_tokens` rows of `dim` elements (f32,
/// bf16, or fp8 e4m3 with one scale per token row); chunk c covers tokens
/// `c * chunk_tokens` up to `chunk_tokens` of them (the last chunk may be
/// shorter). Writes the element-wise minimum to `out_min` and maximum to
/// `out_max`, each `ceil(n_tokens / chunk_tokens) x dim` f32. f32 and bf16
/// keys give exact bounds; fp8 x scale is rounded outwards to f32. NaN/Inf
/// keys, and fp8 x scale products beyond the f32 range, are
/// `KVSWAP_STATUS_INVALID_ARGUMENT` naming the token and element. Other
/// errors: `KVSWAP_STATUS_NULL_POINTER` (NULL `keys`, its data or fp8
/// scales, `out_min`, `out_max`); `KVSWAP_STATUS_INVALID_ARGUMENT` for
/// `n_tokens` or `chunk_tokens` 0, `dim` outside 1..=FM_MAX_BOUNDS_DIM, a
/// misaligned pointer, a bad dtype or stride, outputs that overlap, or
/// device memory the CUDA driver identifies (it reads host memory);
/// `KVSWAP_STATUS_OUT_OF_RANGE` for more than FM_MAX_CHUNKS chunks;
/// `KVSWAP_STATUS_OUT_OF_MEMORY` when the host cannot hold the bounds.
/// Nothing is written on failure.
#[no_mangle]
pub extern "C" fn fm_bounds_build(
    keys: *const FmKeys,
    n_tokens: usize,
    dim: u32,
    chunk_tokens: u32,
    out_min: *mut f32,
    out_max: *mut f32,
) -> KvswapStatus {
    boundary("fm_bounds_build", || {
        check_aligned(keys, "keys")?;
        check_aligned(out_min, "out_min")?;
        check_aligned(out_max, "out_max")?;
        // SAFETY: non-NULL; the engine promises a valid FmKeys.
        let k = keys_ref(unsafe { &*keys })?;
        scorer::bounds::check_dim(dim as usize)?;
        if n_tokens == 0 || chunk_tokens == 0 {
            return Err(Error::invalid(format!("n_tokens = {n_tokens}, chunk_tokens = {chunk_tokens}: both must be >= 1")));
        }
        args::check_keys(&k, dim as usize, n_tokens, "")?;
        let chunks = scorer::bounds::n_chunks(n_tokens, chunk_tokens as usize);
        args::check_n_chunks(chunks).map_err(|e| Error::new(e.status, format!("{} (n_tokens / chunk_tokens, rounded up)", e.message)))?;
        // The two outputs must not overlap (chunks * dim * 4 bytes each; at
        // most 2^22 * 2^16 * 4 = 2^40, far below a 64-bit address space).
        let bytes = (chunks * dim as usize * 4) as u64;
        let (a, b) = (out_min as u64, out_max as u64);
        if args::overlap(a, b, bytes) {
            return Err(Error::invalid(format!(
                "out_min ({a:#x}) and out_max ({b:#x}) overlap: each holds {chunks} x {dim} f32 ({bytes} bytes)"
            )));
        }
        for (ptr, name) in [(k.data, "keys->data"), (k.scales, "keys->scales"), (out_min as u64, "out_min"), (out_max as u64, "out_max")] {
            crate::backend::refuse_device_memory(ptr, name)?;
        }
        let (min, max) = {
            // SAFETY: checked above; the engine promises `n_tokens` readable
            // key rows (and scales) in host memory.
            let view = unsafe { scorer::cpu::host_keys(&k, dim as usize, n_tokens)? }.labelled("token");
            scorer::bounds::build(&view, chunk_tokens as usize)?
        };
        // SAFETY: the engine promises room for ceil(n_tokens / chunk_tokens)
        // x dim f32 at each output, not overlapping the keys or each other.
        unsafe {
            std::ptr::copy_nonoverlapping(min.as_ptr(), out_min, min.len());
            std::ptr::copy_nonoverlapping(max.as_ptr(), out_max, max.len());
        }
        Ok(())
    })
}
