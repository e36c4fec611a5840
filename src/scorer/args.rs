//! Checks of call arguments shared by every backend: limits, NULL pointers,
//! alignment and strides. Values behind the pointers (NaN/Inf) are checked by
//! the backend that reads them.

use super::backend::{BoundsRef, KeysRef, SeqRef};
use super::dtype::KeyDtype;
use super::{FM_MAX_CHUNKS, FM_MAX_SEQS, FM_MAX_TOPK};
use crate::error::{Error, Result};

/// `device` is -1 (CPU) or a CUDA ordinal.
pub fn check_device(device: i32) -> Result<()> {
    if device < -1 {
        return Err(Error::invalid(format!("device = {device}: expected -1 (CPU) or a CUDA ordinal >= 0")));
    }
    Ok(())
}

/// `k` in `1..=FM_MAX_TOPK`.
pub fn check_k(k: u32) -> Result<()> {
    if k == 0 {
        return Err(Error::invalid("k is 0: expected 1..=2048"));
    }
    if k > FM_MAX_TOPK {
        return Err(Error::out_of_range(format!("k = {k} is above the limit FM_MAX_TOPK = {FM_MAX_TOPK}")));
    }
    Ok(())
}

/// `n_chunks` in `1..=FM_MAX_CHUNKS`.
pub fn check_n_chunks(n_chunks: usize) -> Result<()> {
    if n_chunks == 0 {
        return Err(Error::invalid("n_chunks is 0: expected 1..=4194304"));
    }
    if n_chunks > FM_MAX_CHUNKS {
        return Err(Error::out_of_range(format!(
            "n_chunks = {n_chunks} is above the limit FM_MAX_CHUNKS = {FM_MAX_CHUNKS}"
        )));
    }
    Ok(())
}

/// A batch of `1..=FM_MAX_SEQS` sequences.
pub fn check_batch(n_seqs: usize) -> Result<()> {
    if n_seqs == 0 {
        return Err(Error::invalid("n_seqs is 0: expected 1..=4096"));
    }
    if n_seqs > FM_MAX_SEQS {
        return Err(Error::out_of_range(format!("n_seqs = {n_seqs} is above the limit FM_MAX_SEQS = {FM_MAX_SEQS}")));
    }
    Ok(())
}

/// The byte stride between key rows: `row_stride_bytes`, or the dense row
/// size when it is 0. A stride must hold a row and keep every row aligned to
/// the element size.
pub fn key_stride(dtype: KeyDtype, row_stride_bytes: usize, dim: usize) -> Result<usize> {
    let row = dim
        .checked_mul(dtype.size())
        .filter(|&r| r > 0)
        .ok_or_else(|| Error::invalid(format!("key dimension {dim} is not usable")))?;
    if row_stride_bytes == 0 {
        return Ok(row);
    }
    if row_stride_bytes < row || !row_stride_bytes.is_multiple_of(dtype.size()) {
        return Err(Error::invalid(format!(
            "keys.row_stride_bytes = {row_stride_bytes}: expected 0 (dense) or a multiple of {} that is >= {row} \
             ({dim} {} elements)",
            dtype.size(),
            dtype.name()
        )));
    }
    Ok(row_stride_bytes)
}

/// Bytes spanned by `n_rows` key rows.
pub fn key_bytes(stride: usize, dtype: KeyDtype, dim: usize, n_rows: usize) -> Result<usize> {
    n_rows
        .checked_sub(1)
        .map_or(Some(0), |last| last.checked_mul(stride).and_then(|b| b.checked_add(dim * dtype.size())))
        .filter(|&b| b <= isize::MAX as usize) // the largest object an address space holds
        .ok_or_else(|| Error::invalid(format!("keys: {n_rows} rows of stride {stride} overflow the address space")))
}

/// Checks a non-NULL pointer aligned to `align` bytes.
pub fn check_ptr(addr: u64, align: u64, name: &str) -> Result<()> {
    if addr == 0 {
        return Err(Error::null(name));
    }
    if !addr.is_multiple_of(align) {
        return Err(Error::invalid(format!("`{name}` = {addr:#x} is not {align}-byte aligned")));
    }
    Ok(())
}

/// Checks the pointers and sizes of keys of `n_rows` rows of `dim`.
pub fn check_keys(keys: &KeysRef, dim: usize, n_rows: usize, prefix: &str) -> Result<()> {
    check_ptr(keys.data, keys.dtype.size() as u64, &format!("{prefix}keys.data"))?;
    if keys.dtype == KeyDtype::Fp8E4m3 {
        check_ptr(keys.scales, 4, &format!("{prefix}keys.scales"))?;
    }
    let stride = key_stride(keys.dtype, keys.row_stride, dim).map_err(|e| prefixed(prefix, e))?;
    key_bytes(stride, keys.dtype, dim, n_rows).map_err(|e| prefixed(prefix, e))?;
    Ok(())
}

/// Checks one sequence of a scoring call; `index` names it in a batch.
pub fn check_seq(seq: &SeqRef, head_dim: usize, index: Option<usize>) -> Result<()> {
    let prefix = index.map(|i| format!("seqs[{i}].")).unwrap_or_default();
    check_ptr(seq.hidden, 4, &format!("{prefix}hidden"))?;
    check_ptr(seq.out, 4, &format!("{prefix}out_indices"))?;
    check_n_chunks(seq.n_chunks).map_err(|e| prefixed(&prefix, e))?;
    check_keys(&seq.keys, head_dim, seq.n_chunks, &prefix)
}

/// Checks a bounds call: pointers, `dim`, `n_chunks` and the array sizes.
pub fn check_bounds(b: &BoundsRef) -> Result<()> {
    check_ptr(b.query, 4, "query")?;
    check_ptr(b.min, 4, "bounds_min")?;
    check_ptr(b.max, 4, "bounds_max")?;
    check_ptr(b.out, 4, "out_indices")?;
    super::bounds::check_dim(b.dim)?;
    check_n_chunks(b.n_chunks)?;
    // Both limits keep n_chunks * dim * 4 far below the address space.
    Ok(())
}

fn prefixed(prefix: &str, e: Error) -> Error {
    Error::new(e.status, format!("{prefix}{}", e.message))
}

/// Whether two output buffers of `bytes` bytes each, at `a` and `b`, share
/// a byte.
pub fn overlap(a: u64, b: u64, bytes: u64) -> bool {
    a < b.saturating_add(bytes) && b < a.saturating_add(bytes)
}

/// The `out_indices` ranges of a batch (`k` i32 each) do not overlap: two
/// sequences writing one buffer would race on a device and silently lose
/// one result on the CPU.
pub fn check_outputs_disjoint(seqs: &[super::backend::SeqRef], k: usize) -> Result<()> {
    if seqs.len() < 2 {
        return Ok(());
    }
    let bytes = 4 * k as u64;
    let mut order: Vec<usize> = (0..seqs.len()).collect();
    order.sort_unstable_by_key(|&i| seqs[i].out);
    for w in order.windows(2) {
        if overlap(seqs[w[0]].out, seqs[w[1]].out, bytes) {
            return Err(Error::invalid(format!(
                "seqs[{}].out_indices ({:#x}) and seqs[{}].out_indices ({:#x}) overlap: each holds k = {k} i32",
                w[0].min(w[1]),
                seqs[w[0].min(w[1])].out,
                w[0].max(w[1]),
                seqs[w[0].max(w[1])].out
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::KvswapStatus;

    #[test]
    fn limits() {
        assert_eq!(check_k(0).unwrap_err().status, KvswapStatus::InvalidArgument);
        assert!(check_k(1).is_ok() && check_k(2048).is_ok());
        assert_eq!(check_k(2049).unwrap_err().status, KvswapStatus::OutOfRange);
        assert_eq!(check_n_chunks(0).unwrap_err().status, KvswapStatus::InvalidArgument);
        assert!(check_n_chunks(1).is_ok() && check_n_chunks(4_194_304).is_ok());
        assert_eq!(check_n_chunks(4_194_305).unwrap_err().status, KvswapStatus::OutOfRange);
        assert!(check_device(-1).is_ok() && check_device(3).is_ok());
        assert_eq!(check_device(-2).unwrap_err().status, KvswapStatus::InvalidArgument);
    }

    #[test]
    fn strides() {
        assert_eq!(key_stride(KeyDtype::Bf16, 0, 128).unwrap(), 256);
        assert_eq!(key_stride(KeyDtype::Bf16, 512, 128).unwrap(), 512);
        assert!(key_stride(KeyDtype::Bf16, 254, 128).is_err());
        assert!(key_stride(KeyDtype::F32, 514, 128).is_err());
        assert_eq!(key_stride(KeyDtype::Fp8E4m3, 129, 128).unwrap(), 129);
        assert_eq!(key_bytes(512, KeyDtype::Bf16, 128, 3).unwrap(), 2 * 512 + 256);
        assert!(key_bytes(usize::MAX / 2, KeyDtype::F32, 4, 4).is_err());
    }
}
