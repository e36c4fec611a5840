//! The CPU backends: host pointers, the reference math, `stream` ignored.

use super::args;
use super::backend::{BoundsBackend, BoundsRef, KeysRef, ScoreMode, ScorerBackend, SeqRef};
use super::bounds;
use super::checkpoint::Checkpoint;
use super::dtype::KeyDtype;
use super::keys::Keys;
use super::reference::{check_hidden, ensemble_scores, project_batch, query_for_keys};
use super::topk::topk;
use crate::backend::{BackendKind, StreamHandle};
use crate::error::{Error, Result};
use std::sync::Arc;

/// The reference scorer on the host.
pub struct CpuScorer {
    ckpt: Arc<Checkpoint>,
}

impl CpuScorer {
    /// A CPU scorer reading the weights of `ckpt` as stored (no copy).
    pub fn new(ckpt: Arc<Checkpoint>) -> CpuScorer {
        CpuScorer { ckpt }
    }

    /// Reads every sequence, scores it, and returns the top-k of each; writes
    /// nothing. `batch` names sequences `seqs[i]` in errors.
    ///
    /// # Safety
    /// The addresses of every sequence are valid host memory for their sizes.
    unsafe fn results(&self, seqs: &[SeqRef], k: usize, mode: ScoreMode, batch: bool) -> Result<Vec<Vec<i32>>> {
        let meta = self.ckpt.meta();
        let named = |i: usize, r: Result<()>| r.map_err(|err| in_seq(batch, i, err));
        let mut hiddens = Vec::with_capacity(seqs.len());
        let mut keys = Vec::with_capacity(seqs.len());
        for (i, s) in seqs.iter().enumerate() {
            // SAFETY: the caller promises `n_scorers * hidden` readable f32
            // at `s.hidden` (checked non-NULL and aligned by `args`).
            let h = unsafe { std::slice::from_raw_parts(s.hidden as *const f32, meta.hidden_len()) };
            named(i, check_hidden(meta, h))?;
            hiddens.push(h);
            // SAFETY: the caller promises `n_chunks` key rows at `s.keys`.
            keys.push(unsafe { host_keys(&s.keys, meta.head_dim as usize, s.n_chunks) }.map_err(|err| in_seq(batch, i, err))?);
        }
        let projections = project_batch(&self.ckpt, &hiddens);
        let mut out = Vec::with_capacity(seqs.len());
        for (i, ((p, keys), s)) in projections.iter().zip(&keys).zip(seqs).enumerate() {
            let p = query_for_keys(p, meta.head_dim as usize, s.keys.dtype == KeyDtype::Fp8E4m3, mode.fp8_query);
            let scores = ensemble_scores(&p, keys, mode.ensemble).map_err(|err| in_seq(batch, i, err))?;
            out.push(topk(&scores, k));
        }
        Ok(out)
    }
}

impl ScorerBackend for CpuScorer {
    fn kind(&self) -> BackendKind {
        BackendKind::Cpu
    }

    fn device(&self) -> i32 {
        -1
    }

    fn describe(&self) -> String {
        "cpu reference scorer (f64 accumulation)".to_string()
    }

    unsafe fn score_topk(&self, seq: &SeqRef, k: usize, mode: ScoreMode, _stream: StreamHandle) -> Result<()> {
        // SAFETY: the caller's promise, passed on.
        let r = unsafe { self.results(std::slice::from_ref(seq), k, mode, false)? };
        // SAFETY: every read of the inputs is finished; `out` has room for k
        // int32 (the caller's promise).
        unsafe { write_indices(seq.out, &r[0]) };
        Ok(())
    }

    unsafe fn score_topk_batch(&self, seqs: &[SeqRef], k: usize, mode: ScoreMode, _stream: StreamHandle) -> Result<()> {
        // SAFETY: the caller's promise, passed on.
        let results = unsafe { self.results(seqs, k, mode, true)? };
        for (s, r) in seqs.iter().zip(&results) {
            // SAFETY: as in score_topk; every sequence succeeded before any
            // output is written.
            unsafe { write_indices(s.out, r) };
        }
        Ok(())
    }
}

fn in_seq(batch: bool, i: usize, e: Error) -> Error {
    if batch {
        Error::new(e.status, format!("seqs[{i}]: {}", e.message))
    } else {
        e
    }
}

/// A host view of raw keys.
///
/// # Safety
/// `k.data` holds `n_rows` rows of `dim` elements at the stride `k` gives,
/// and for fp8 `k.scales` holds `n_rows` f32; both stay unchanged while the
/// view lives.
pub unsafe fn host_keys<'a>(k: &KeysRef, dim: usize, n_rows: usize) -> Result<Keys<'a>> {
    let stride = args::key_stride(k.dtype, k.row_stride, dim)?;
    let len = args::key_bytes(stride, k.dtype, dim, n_rows)?;
    // SAFETY: the caller promises `len` readable bytes at `k.data` (non-NULL).
    let data = unsafe { std::slice::from_raw_parts(k.data as *const u8, len) };
    let scales = match k.dtype {
        // SAFETY: the caller promises `n_rows` aligned f32 at `k.scales`.
        KeyDtype::Fp8E4m3 => Some(unsafe { std::slice::from_raw_parts(k.scales as *const f32, n_rows) }),
        _ => None,
    };
    Keys::new(data, k.dtype, scales, k.row_stride, dim, n_rows)
}

/// Copies `ids` to `out`.
///
/// # Safety
/// `out` is aligned, writable for `ids.len()` int32, and overlaps no live
/// Rust reference.
unsafe fn write_indices(out: u64, ids: &[i32]) {
    // SAFETY: the caller's promise; `ids` is our own buffer, so the two
    // regions do not overlap.
    unsafe { std::ptr::copy_nonoverlapping(ids.as_ptr(), out as *mut i32, ids.len()) }
}

/// The bounds scorer on the host.
pub struct CpuBounds;

impl BoundsBackend for CpuBounds {
    fn kind(&self) -> BackendKind {
        BackendKind::Cpu
    }

    unsafe fn bounds_topk(&self, b: &BoundsRef, k: usize, _stream: StreamHandle) -> Result<()> {
        let ids = {
            // SAFETY: the caller promises `dim` f32 at `query` and
            // `n_chunks * dim` f32 at `min` and `max` (sizes checked for
            // overflow by `args`), all aligned and non-NULL.
            let (q, lo, hi) = unsafe {
                (
                    std::slice::from_raw_parts(b.query as *const f32, b.dim),
                    std::slice::from_raw_parts(b.min as *const f32, b.n_chunks * b.dim),
                    std::slice::from_raw_parts(b.max as *const f32, b.n_chunks * b.dim),
                )
            };
            topk(&bounds::scores(q, lo, hi)?, k)
        };
        // SAFETY: the input views are gone; `out` has room for k int32.
        unsafe { write_indices(b.out, &ids) };
        Ok(())
    }
}
