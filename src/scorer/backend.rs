//! Scoring backends: the `ScorerBackend` and `BoundsBackend` traits, the
//! argument records they take, and the constructor hooks that pick an
//! implementation for a device (-1: the CPU reference in `cpu`; >= 0: CUDA).
//!
//! # Plugging in the CUDA scorer
//!
//! 1. Implement [`ScorerBackend`] for a CUDA type, e.g. in
//!    `src/backend/cuda/scorer.rs`. Its constructor gets the
//!    [`Checkpoint`]: upload each tensor with `Checkpoint::raw` and its
//!    `TensorEntry::dtype` as stored (bf16 stays bf16), once.
//! 2. Return it from [`cuda_scorer`] (and a bounds backend from
//!    [`cuda_bounds`]) under `#[cfg(feature = "cuda")]`. Nothing else
//!    changes: the C ABI, the argument checks (`args`) and the tests go
//!    through [`open_scorer`].
//!
//! Contract for every implementation (the CPU one is the reference):
//! - The addresses in [`SeqRef`] / [`BoundsRef`] are in the backend's memory
//!   space (device pointers on CUDA), already checked for NULL, alignment,
//!   limits and strides by `args`.
//! - The result for each sequence is the top-k of the reference scores
//!   (`reference::chunk_scores`) by score descending, id ascending, padded
//!   with -1; a device may differ only where reference scores tie within
//!   rounding.
//! - A NaN or infinite value in the hidden input, keys, scales, query or
//!   bounds is `KVSWAP_STATUS_INVALID_ARGUMENT`, never a result (a device
//!   kernel can raise a flag that the call reads back).
//! - A batch reads the weights once per launch group, not per sequence: on
//!   CUDA the projections of up to 64 hidden states of one key dtype are
//!   one launch over `[B, hidden]`.
//! - The work is ordered on `stream` (ignored on the CPU).

use super::checkpoint::Checkpoint;
use super::cpu::{CpuBounds, CpuScorer};
use super::dtype::KeyDtype;
use crate::backend::{BackendKind, StreamHandle};
use crate::config::Ensemble;
#[cfg(not(feature = "cuda"))]
use crate::error::{Error, KvswapStatus};
use crate::error::Result;
use std::sync::Arc;

/// What a scoring call computes besides its inputs: the ensemble, and
/// whether fp8 keys are scored with an fp8 query
/// ([`super::reference::fp8_query`]; `KVSWAP_FM_QUERY`,
/// `fm_scorer_set_query`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScoreMode {
    pub ensemble: Ensemble,
    /// fp8 keys get the fp8 query (the default); false keeps q wide (bf16
    /// on CUDA, f64 on the CPU) for every key dtype.
    pub fp8_query: bool,
}

impl From<Ensemble> for ScoreMode {
    /// The ensemble with the default query (fp8 for fp8 keys).
    fn from(ensemble: Ensemble) -> ScoreMode {
        ScoreMode { ensemble, fp8_query: true }
    }
}

/// Indexer keys of one call, by address in the backend's memory space.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KeysRef {
    /// First byte of row 0.
    pub data: u64,
    /// fp8 only: one f32 scale per row (0 otherwise).
    pub scales: u64,
    /// Bytes between rows; 0 means dense.
    pub row_stride: usize,
    pub dtype: KeyDtype,
}

/// One sequence of a scoring call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SeqRef {
    /// `n_scorers * hidden` f32: scorer i's input at `i * hidden`.
    pub hidden: u64,
    /// One key of `head_dim` per chunk.
    pub keys: KeysRef,
    /// Chunks to score.
    pub n_chunks: usize,
    /// `k` int32 outputs.
    pub out: u64,
}

/// One key-bounds (Quest-style) call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BoundsRef {
    /// `dim` f32.
    pub query: u64,
    /// `n_chunks * dim` f32, the per-chunk element-wise minimum of the keys.
    pub min: u64,
    /// `n_chunks * dim` f32, the per-chunk element-wise maximum of the keys.
    pub max: u64,
    pub dim: usize,
    pub n_chunks: usize,
    /// `k` int32 outputs.
    pub out: u64,
}

/// Scores chunks with a loaded checkpoint and writes the top-k.
pub trait ScorerBackend: Send + Sync {
    /// CPU or CUDA.
    fn kind(&self) -> BackendKind;

    /// -1 on the CPU, else the CUDA ordinal.
    fn device(&self) -> i32;

    /// One line for logs and `fm info`.
    fn describe(&self) -> String;

    /// Scores one sequence and writes its top-k (`k` entries) to `seq.out`.
    ///
    /// # Safety
    /// Every address of `seq` is valid in the backend's memory space for the
    /// sizes it describes, and `seq.out` is not accessed by anyone else
    /// until the work on `stream` is done. The arguments passed `args`'
    /// checks (k, n_chunks, the keys), as `Scorer` checks them: a device
    /// backend's buffers are sized for those limits.
    unsafe fn score_topk(&self, seq: &SeqRef, k: usize, mode: ScoreMode, stream: StreamHandle) -> Result<()>;

    /// Scores every sequence of a batch, reading the weights once. On
    /// failure no output is written (on the CPU; a device backend documents
    /// its own rule).
    ///
    /// # Safety
    /// As `score_topk` for each sequence; the batch size within
    /// `args::check_batch`'s limit; outputs do not overlap.
    unsafe fn score_topk_batch(&self, seqs: &[SeqRef], k: usize, mode: ScoreMode, stream: StreamHandle)
        -> Result<()>;

    /// Waits for `stream` and returns (clearing it) an error that an earlier
    /// asynchronous call recorded on the device. The CPU reports errors at
    /// once, so there is never one pending.
    fn sync_errors(&self, _stream: StreamHandle) -> Result<()> {
        Ok(())
    }

    /// Whether later calls wait for the device and return their own errors
    /// (a device backend; the CPU always reports at once).
    fn set_sync(&self, _sync: bool) {}

    /// Makes `stream`'s workspace large enough for every call of up to
    /// `seqs` sequences of up to `chunks` chunks each (arguments already
    /// checked), so those calls neither allocate nor wait. The CPU keeps no
    /// workspace.
    fn reserve(&self, _seqs: usize, _chunks: usize, _stream: StreamHandle) -> Result<()> {
        Ok(())
    }
}

/// Scores chunks by their key bounds (training-free) and writes the top-k.
pub trait BoundsBackend: Send + Sync {
    /// CPU or CUDA.
    fn kind(&self) -> BackendKind;

    /// Scores `b.n_chunks` chunks and writes the top-k to `b.out`.
    ///
    /// # Safety
    /// Every address of `b` is valid in the backend's memory space for the
    /// sizes it describes; `b.out` is not accessed by anyone else meanwhile.
    unsafe fn bounds_topk(&self, b: &BoundsRef, k: usize, stream: StreamHandle) -> Result<()>;

    /// As [`ScorerBackend::reserve`], for calls of up to `chunks` chunks.
    fn reserve(&self, _chunks: usize, _stream: StreamHandle) -> Result<()> {
        Ok(())
    }
}

/// The scoring backend for `device`: -1 is the CPU reference, >= 0 a CUDA
/// ordinal (see [`cuda_scorer`]).
/// `sync`: whether a device call waits and returns its own errors (None:
/// `KVSWAP_SYNC` decides; the CPU always reports at once).
pub fn open_scorer(ckpt: Arc<Checkpoint>, device: i32, sync: Option<bool>) -> Result<Box<dyn ScorerBackend>> {
    super::args::check_device(device)?;
    if device == -1 {
        // The CPU reports every error at once, but a bad KVSWAP_SYNC is
        // refused here too, as on CUDA: it would pass CPU tests and fail
        // on a GPU machine only.
        if sync.is_none() {
            crate::config::Config::sync_from_env()?;
        }
        return Ok(Box::new(CpuScorer::new(ckpt)));
    }
    cuda_scorer(ckpt, device, sync)
}

/// The bounds backend for `device` (-1: CPU, >= 0: CUDA, see [`cuda_bounds`]).
pub fn open_bounds(device: i32) -> Result<Box<dyn BoundsBackend>> {
    super::args::check_device(device)?;
    if device == -1 {
        return Ok(Box::new(CpuBounds));
    }
    cuda_bounds(device)
}

/// `KVSWAP_SYNC` (or its alias) from the environment: whether a device call
/// waits and returns its own errors (default 1, as in DESIGN.md).
#[cfg(feature = "cuda")]
fn sync_setting() -> Result<bool> {
    crate::config::Config::sync_from_env()
}

/// The CUDA scorer bound to `device` (tensor-core kernels, weights uploaded
/// as stored). `sync` (None: `KVSWAP_SYNC`) decides whether calls wait for
/// their result.
#[cfg(feature = "cuda")]
pub fn cuda_scorer(ckpt: Arc<Checkpoint>, device: i32, sync: Option<bool>) -> Result<Box<dyn ScorerBackend>> {
    let sync = match sync {
        Some(s) => s,
        None => sync_setting()?,
    };
    Ok(Box::new(crate::backend::cuda::scorer::CudaScorer::new(&ckpt, device, sync)?))
}

/// The sync setting of each CUDA device's bounds calls set by
/// [`set_bounds_sync`]; a device without one takes `KVSWAP_SYNC` per call.
#[cfg(feature = "cuda")]
static BOUNDS_SYNC: std::sync::Mutex<Vec<(i32, bool)>> = std::sync::Mutex::new(Vec::new());

/// Sets (Some) or clears (None: back to `KVSWAP_SYNC`, read per call)
/// whether the bounds calls on CUDA `device` wait and return their own
/// errors. The device is not opened here.
#[cfg(feature = "cuda")]
pub fn set_bounds_sync(device: i32, sync: Option<bool>) -> Result<()> {
    super::args::check_device(device)?;
    if device >= 0 {
        let mut all = BOUNDS_SYNC.lock().unwrap_or_else(|p| p.into_inner());
        all.retain(|&(d, _)| d != device);
        if let Some(s) = sync {
            all.push((device, s));
        }
    }
    Ok(())
}

/// Without the `cuda` feature a device ordinal is `KVSWAP_STATUS_NO_DEVICE`.
#[cfg(not(feature = "cuda"))]
pub fn set_bounds_sync(device: i32, _sync: Option<bool>) -> Result<()> {
    super::args::check_device(device)?;
    if device >= 0 {
        return Err(no_cuda_scorer(device));
    }
    Ok(())
}

/// The CUDA bounds scorer of `device` (one per device and process).
#[cfg(feature = "cuda")]
pub fn cuda_bounds(device: i32) -> Result<Box<dyn BoundsBackend>> {
    let set = BOUNDS_SYNC.lock().unwrap_or_else(|p| p.into_inner()).iter().find(|&&(d, _)| d == device).map(|&(_, s)| s);
    let sync = match set {
        Some(s) => s,
        None => sync_setting()?,
    };
    let b = crate::backend::cuda::scorer::CudaBounds::get(device)?;
    Ok(Box::new(crate::backend::cuda::scorer::CudaBoundsHandle(b, sync)))
}

/// Reserves `stream`'s bounds workspace on `device` (-1: the CPU, nothing
/// to do) for calls of up to `chunks` chunks. The sync setting plays no
/// part, so `KVSWAP_SYNC` is not read.
pub fn reserve_bounds(device: i32, chunks: usize, stream: StreamHandle) -> Result<()> {
    super::args::check_device(device)?;
    if device == -1 {
        return Ok(());
    }
    #[cfg(feature = "cuda")]
    {
        let b = crate::backend::cuda::scorer::CudaBounds::get(device)?;
        crate::backend::cuda::scorer::CudaBoundsHandle(b, true).reserve(chunks, stream)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (chunks, stream);
        Err(no_cuda_scorer(device))
    }
}

/// Without the `cuda` feature a device ordinal is `KVSWAP_STATUS_NO_DEVICE`.
#[cfg(not(feature = "cuda"))]
pub fn cuda_scorer(_ckpt: Arc<Checkpoint>, device: i32, _sync: Option<bool>) -> Result<Box<dyn ScorerBackend>> {
    Err(no_cuda_scorer(device))
}

/// Without the `cuda` feature a device ordinal is `KVSWAP_STATUS_NO_DEVICE`.
#[cfg(not(feature = "cuda"))]
pub fn cuda_bounds(device: i32) -> Result<Box<dyn BoundsBackend>> {
    Err(no_cuda_scorer(device))
}

#[cfg(not(feature = "cuda"))]
fn no_cuda_scorer(device: i32) -> Error {
    Error::new(
        KvswapStatus::NoDevice,
        format!("device {device}: no CUDA scorer backend is available in this build; use device -1 (the CPU scorer)"),
    )
}
