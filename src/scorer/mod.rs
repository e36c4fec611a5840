//! FlashMemory: the learned chunk scorer of DESIGN.md ("FlashMemory scorer"),
//! its checkpoint, the CPU reference, top-k, and the training-free
//! (Quest-style) key-bounds scorer.
//!
//! - [`checkpoint`]: the `flashmemory-v1` safetensors file, read and validated
//!   (raw tensor bytes and dtypes are kept for a device backend to upload).
//! - [`write`](mod@write): writes checkpoints, including the seeded random ones of
//!   `kvswap fm init`; [`info`]: what `kvswap fm info` prints.
//! - [`keys`]: indexer keys (f32, bf16, fp8 e4m3 with per-chunk scales).
//! - [`reference`](mod@reference): the CPU reference math, f64 accumulation; it *defines*
//!   the result. [`topk`]: the total order (score desc, id asc).
//! - [`bounds`]: per-chunk key bounds, their score and their construction.
//! - [`backend`]: the `ScorerBackend` and `BoundsBackend` traits and the
//!   constructor hooks where the CUDA implementation plugs in; [`cpu`]: the
//!   CPU implementations.
//! - [`args`]: argument checks shared by every backend (limits, strides,
//!   alignment).
//!
//! Limits: `n_chunks` in `1..=`[`FM_MAX_CHUNKS`] (4,194,304), `k` in
//! `1..=`[`FM_MAX_TOPK`] (2048), a batch of `1..=`[`FM_MAX_SEQS`] (4096)
//! sequences.

pub mod args;
pub mod backend;
pub mod bounds;
pub mod checkpoint;
pub mod cpu;
pub mod dtype;
pub mod info;
pub mod keys;
pub mod reference;
pub mod topk;
pub mod write;

pub use backend::{BoundsBackend, BoundsRef, KeysRef, ScoreMode, ScorerBackend, SeqRef};
pub use checkpoint::{Checkpoint, Meta, TensorEntry};
pub use dtype::{KeyDtype, WeightDtype};
pub use keys::Keys;

use crate::backend::{BackendKind, StreamHandle};
use crate::config::Ensemble;
use crate::error::Result;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;

/// Most chunks one scoring call accepts (4M = 2^22).
pub const FM_MAX_CHUNKS: usize = 4_194_304;
/// Largest k of a top-k call.
pub const FM_MAX_TOPK: u32 = 2048;
/// Most sequences one batched call accepts.
pub const FM_MAX_SEQS: usize = 4096;

/// A loaded scorer bound to a backend: the checkpoint, the backend that
/// scores with it, and the ensemble in force (`KVSWAP_FM_ENSEMBLE`'s when
/// set at load, else the checkpoint's, until changed).
///
/// Scoring takes `&self`, so one scorer may be used from several threads at
/// once; changing the ensemble affects calls that start afterwards.
pub struct Scorer {
    checkpoint: Arc<Checkpoint>,
    backend: Box<dyn ScorerBackend>,
    ensemble: AtomicU32,
    /// fp8 keys get the fp8 query (`KVSWAP_FM_QUERY=auto`, the default).
    fp8_query: AtomicBool,
    /// `KVSWAP_MEM_PROFILE` at load: log the weights at load and free.
    mem_profile: bool,
}

impl Drop for Scorer {
    fn drop(&mut self) {
        if self.mem_profile {
            self.log_mem("scorer_free");
        }
    }
}

impl Scorer {
    /// Loads the checkpoint at `path` and binds it to `device` (-1: CPU,
    /// >= 0: CUDA ordinal).
    pub fn load(path: &Path, device: i32) -> Result<Scorer> {
        args::check_device(device)?;
        let ckpt = Arc::new(Checkpoint::load(path)?);
        Scorer::new(ckpt, device)
    }

    /// Binds an already loaded checkpoint to `device`; on CUDA,
    /// `KVSWAP_SYNC` decides whether calls wait for their result.
    pub fn new(checkpoint: Arc<Checkpoint>, device: i32) -> Result<Scorer> {
        Scorer::open(checkpoint, device, None)
    }

    /// As [`Scorer::new`], with the sync setting given instead of read from
    /// `KVSWAP_SYNC`: `false` makes CUDA calls return once queued (capturable
    /// in a CUDA graph), their device errors reported by [`Scorer::sync`].
    /// The CPU always reports at once.
    pub fn with_sync(checkpoint: Arc<Checkpoint>, device: i32, sync: bool) -> Result<Scorer> {
        Scorer::open(checkpoint, device, Some(sync))
    }

    fn open(checkpoint: Arc<Checkpoint>, device: i32, sync: Option<bool>) -> Result<Scorer> {
        // A bad KVSWAP_FM_QUERY or KVSWAP_FM_ENSEMBLE is refused before any
        // device work; the ensemble is the variable's where it is set, else
        // the checkpoint's.
        let fp8_query = AtomicBool::new(query_setting()? == Query::Auto);
        let ensemble = crate::config::Config::fm_ensemble_from_env()?.unwrap_or(checkpoint.meta().ensemble);
        let mem_profile = crate::config::Config::mem_profile_from_env()?;
        let backend = backend::open_scorer(checkpoint.clone(), device, sync)?;
        let ensemble = AtomicU32::new(ensemble_code(ensemble));
        let scorer = Scorer { checkpoint, backend, ensemble, fp8_query, mem_profile };
        if mem_profile {
            scorer.log_mem("scorer_load");
        }
        Ok(scorer)
    }

    /// The `KVSWAP_MEM_PROFILE` line of `stage`: the weights the scorer
    /// holds (scorer_load) or frees (scorer_free), where.
    fn log_mem(&self, stage: &str) {
        log::info!(
            "kvswap_mem stage={stage} device={} weights_mib={:.2} scorers={} hidden={} heads={} head_dim={}",
            self.device(),
            self.checkpoint.weight_bytes() as f64 / (1 << 20) as f64,
            self.checkpoint.meta().n_scorers,
            self.checkpoint.meta().hidden,
            self.checkpoint.meta().n_heads,
            self.checkpoint.meta().head_dim
        );
    }

    /// The checkpoint this scorer scores with.
    pub fn checkpoint(&self) -> &Arc<Checkpoint> {
        &self.checkpoint
    }

    /// Shape and settings of the checkpoint.
    pub fn meta(&self) -> &Meta {
        self.checkpoint.meta()
    }

    /// CPU or CUDA.
    pub fn backend_kind(&self) -> BackendKind {
        self.backend.kind()
    }

    /// -1 on the CPU, else the CUDA ordinal.
    pub fn device(&self) -> i32 {
        self.backend.device()
    }

    /// The ensemble used by the next call.
    pub fn ensemble(&self) -> Ensemble {
        ensemble_from_code(self.ensemble.load(Ordering::Relaxed))
    }

    /// Overrides the checkpoint's ensemble for later calls.
    pub fn set_ensemble(&self, e: Ensemble) {
        self.ensemble.store(ensemble_code(e), Ordering::Relaxed);
    }

    /// The query of the next call.
    pub fn query(&self) -> Query {
        if self.fp8_query.load(Ordering::Relaxed) {
            Query::Auto
        } else {
            Query::Wide
        }
    }

    /// Sets the query of later calls (the default is `KVSWAP_FM_QUERY`'s,
    /// read when the scorer is opened).
    pub fn set_query(&self, q: Query) {
        self.fp8_query.store(q == Query::Auto, Ordering::Relaxed);
    }

    /// Whether later CUDA calls wait for the device and return their own
    /// errors (the default is `KVSWAP_SYNC`'s, read when the scorer is
    /// opened, or [`Scorer::with_sync`]'s); the CPU always reports at once.
    pub fn set_sync(&self, sync: bool) {
        self.backend.set_sync(sync);
    }

    /// The ensemble and query of the next call.
    pub fn mode(&self) -> ScoreMode {
        ScoreMode { ensemble: self.ensemble(), fp8_query: self.fp8_query.load(Ordering::Relaxed) }
    }

    /// Waits for `stream` and returns (clearing it) an error an earlier
    /// asynchronous call recorded on the device (CUDA with `KVSWAP_SYNC=0`
    /// or [`Scorer::with_sync`]`(.., false)`).
    pub fn sync(&self, stream: StreamHandle) -> Result<()> {
        self.backend.sync_errors(stream)
    }

    /// Makes `stream`'s workspace (CUDA) large enough for every call of up
    /// to `seqs` sequences of up to `chunks` chunks each, so that those
    /// calls neither allocate nor wait: what to do before capturing the
    /// stream. Nothing on the CPU, past the argument checks.
    pub fn reserve(&self, seqs: usize, chunks: usize, stream: StreamHandle) -> Result<()> {
        args::check_batch(seqs)?;
        args::check_n_chunks(chunks)?;
        self.backend.reserve(seqs, chunks, stream)
    }

    /// On the CPU backend, device memory among a sequence's addresses
    /// ([`crate::backend::refuse_device_memory`]); nothing on CUDA.
    fn refuse_device_memory(&self, s: &SeqRef, batch: Option<usize>) -> Result<()> {
        if self.backend_kind() != BackendKind::Cpu {
            return Ok(());
        }
        let name = |field: &str| batch.map_or(field.to_string(), |i| format!("seqs[{i}].{field}"));
        for (ptr, field) in [(s.hidden, "hidden"), (s.keys.data, "keys.data"), (s.keys.scales, "keys.scales"), (s.out, "out_indices")] {
            crate::backend::refuse_device_memory(ptr, &name(field))?;
        }
        Ok(())
    }

    /// One sequence: checks the arguments, then scores and writes the top-k.
    ///
    /// # Safety
    /// The addresses of `seq` must be valid in the backend's memory space for
    /// the sizes they describe (`n_scorers * hidden` f32 for the hidden
    /// input, `n_chunks` key rows, `k` int32 outputs), and the output must
    /// not be accessed by anyone else during the call.
    pub unsafe fn score_topk(&self, seq: &SeqRef, k: u32, stream: StreamHandle) -> Result<()> {
        args::check_k(k)?;
        args::check_seq(seq, self.meta().head_dim as usize, None)?;
        self.refuse_device_memory(seq, None)?;
        // SAFETY: arguments checked above; validity of memory is the caller's
        // promise, passed on.
        unsafe { self.backend.score_topk(seq, k as usize, self.mode(), stream) }
    }

    /// A batch of sequences in one call: all are checked before any is
    /// scored. On the CPU, outputs are written only when every sequence
    /// succeeded; on CUDA, values are checked on the device, and the group
    /// that finds a non-finite value (launch groups of up to 64 sequences
    /// of one key dtype) and the later groups write -1 while earlier groups
    /// keep their results (as `fm_score_topk_batch` states).
    ///
    /// # Safety
    /// As for `score_topk`, for every sequence; output ranges must not overlap.
    pub unsafe fn score_topk_batch(&self, seqs: &[SeqRef], k: u32, stream: StreamHandle) -> Result<()> {
        args::check_k(k)?;
        args::check_batch(seqs.len())?;
        for (i, s) in seqs.iter().enumerate() {
            args::check_seq(s, self.meta().head_dim as usize, Some(i))?;
            self.refuse_device_memory(s, Some(i))?;
        }
        args::check_outputs_disjoint(seqs, k as usize)?;
        // SAFETY: as above.
        unsafe { self.backend.score_topk_batch(seqs, k as usize, self.mode(), stream) }
    }
}

/// The training-free bounds scorer on `device` (-1: CPU): checks the
/// arguments, scores and writes the top-k.
///
/// # Safety
/// The addresses of `b` are valid in that device's memory space for the
/// sizes they describe; `b.out` is not accessed by anyone else meanwhile.
pub unsafe fn bounds_topk(device: i32, b: &BoundsRef, k: u32, stream: StreamHandle) -> Result<()> {
    args::check_k(k)?;
    args::check_bounds(b)?;
    if device == -1 {
        for (ptr, what) in [(b.query, "query"), (b.min, "bounds_min"), (b.max, "bounds_max"), (b.out, "out_indices")] {
            crate::backend::refuse_device_memory(ptr, what)?;
        }
    }
    let backend = backend::open_bounds(device)?;
    // SAFETY: arguments checked above; memory validity is the caller's promise.
    unsafe { backend.bounds_topk(b, k as usize, stream) }
}

/// As [`Scorer::reserve`] for the bounds scorer of `device` (-1: the CPU,
/// nothing past the checks): calls of up to `chunks` chunks on `stream`.
pub fn bounds_reserve(device: i32, chunks: usize, stream: StreamHandle) -> Result<()> {
    args::check_device(device)?;
    args::check_n_chunks(chunks)?;
    backend::reserve_bounds(device, chunks, stream)
}

/// Sets (Some) or clears (None: back to `KVSWAP_SYNC`, read per call)
/// whether the bounds calls on CUDA `device` wait and return their own
/// errors; -1 (the CPU, which reports at once) is accepted and changes
/// nothing.
pub fn set_bounds_sync(device: i32, sync: Option<bool>) -> Result<()> {
    backend::set_bounds_sync(device, sync)
}

/// Waits for `stream` and returns the error an earlier asynchronous
/// `bounds_topk` on `device` recorded there (`KVSWAP_SYNC=0` on CUDA).
pub fn bounds_sync(device: i32, stream: StreamHandle) -> Result<()> {
    args::check_device(device)?;
    if device == -1 {
        return Ok(());
    }
    #[cfg(feature = "cuda")]
    return crate::backend::cuda::scorer::CudaBounds::sync_errors(device, stream);
    #[cfg(not(feature = "cuda"))]
    {
        let _ = stream;
        backend::open_bounds(device).map(|_| ())
    }
}

/// The query fp8 keys are scored with (`KVSWAP_FM_QUERY`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Query {
    /// fp8 keys get the fp8 query ([`reference::fp8_query`]); other keys
    /// keep q wide. The default.
    Auto,
    /// q is never quantized to fp8: bf16 on CUDA, f64 on the CPU.
    Wide,
}

/// `KVSWAP_FM_QUERY`: `auto` (the default, also when unset or empty) or
/// `wide`; anything else is `KVSWAP_STATUS_INVALID_ARGUMENT`.
pub fn query_setting() -> Result<Query> {
    match std::env::var("KVSWAP_FM_QUERY") {
        Err(std::env::VarError::NotPresent) => Ok(Query::Auto),
        Ok(v) => match v.trim().to_ascii_lowercase().as_str() {
            "" | "auto" => Ok(Query::Auto),
            "wide" => Ok(Query::Wide),
            _ => Err(crate::error::Error::invalid(format!("KVSWAP_FM_QUERY={v}: expected auto or wide"))),
        },
        Err(e) => Err(crate::error::Error::invalid(format!("KVSWAP_FM_QUERY: {e}"))),
    }
}

/// The C constant of a query (`KVSWAP_FM_QUERY_AUTO`, `KVSWAP_FM_QUERY_WIDE`).
pub fn query_code(q: Query) -> KvswapFmQuery {
    match q {
        Query::Auto => KVSWAP_FM_QUERY_AUTO,
        Query::Wide => KVSWAP_FM_QUERY_WIDE,
    }
}

/// The query a scorer scores fp8 keys with (`KVSWAP_FM_QUERY`,
/// `fm_scorer_set_query`): one of the `KVSWAP_FM_QUERY_*` constants.
pub type KvswapFmQuery = u32;
/// fp8 keys are scored with the fp8 query: each head's q rounded to bf16,
/// then to fp8 e4m3 under a power-of-two scale (as DeepSeek-V3.2's fp8
/// indexer scores); f32 and bf16 keys keep q wide. The default.
pub const KVSWAP_FM_QUERY_AUTO: KvswapFmQuery = 0;
/// q is never quantized to fp8: bf16 on CUDA, f64 on the CPU.
pub const KVSWAP_FM_QUERY_WIDE: KvswapFmQuery = 1;

/// The C constant of an ensemble.
pub fn ensemble_code(e: Ensemble) -> u32 {
    match e {
        Ensemble::Max => crate::config::KVSWAP_ENSEMBLE_MAX,
        Ensemble::Mean => crate::config::KVSWAP_ENSEMBLE_MEAN,
    }
}

fn ensemble_from_code(c: u32) -> Ensemble {
    if c == crate::config::KVSWAP_ENSEMBLE_MEAN {
        Ensemble::Mean
    } else {
        Ensemble::Max
    }
}

/// The checkpoint's spelling of an ensemble (`max` or `mean`).
pub fn ensemble_name(e: Ensemble) -> &'static str {
    match e {
        Ensemble::Max => "max",
        Ensemble::Mean => "mean",
    }
}
