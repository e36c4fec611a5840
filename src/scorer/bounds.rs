//! The training-free scorer (Quest-style): each chunk keeps the element-wise
//! minimum and maximum of its keys, and a query q scores chunk c with the
//! upper bound of `q . k` over every key k inside those bounds:
//!
//! `score(c) = sum over d of max(q[d] * min[c][d], q[d] * max[c][d])`
//!
//! accumulated in f64. Bounds are f32: a narrower type would need rounding
//! towards -inf / +inf to stay an upper bound, and f32 holds f32 and bf16
//! keys exactly. Top-k rules are those of the learned scorer.

use super::args;
use super::dtype::{f32_at_least, f32_at_most};
use super::keys::Keys;
use super::topk::topk;
use crate::error::{try_vec, Error, Result};

/// Largest `dim` of a bounds call.
pub const FM_MAX_BOUNDS_DIM: usize = 65536;

/// `dim` in `1..=FM_MAX_BOUNDS_DIM`.
pub fn check_dim(dim: usize) -> Result<()> {
    if dim == 0 || dim > FM_MAX_BOUNDS_DIM {
        return Err(Error::invalid(format!("dim = {dim}: expected 1..={FM_MAX_BOUNDS_DIM}")));
    }
    Ok(())
}

/// Checks sizes and values: the query and every bound finite, and
/// `min <= max` element-wise. Failures name the array, chunk and element.
pub fn check(query: &[f32], min: &[f32], max: &[f32]) -> Result<()> {
    let dim = query.len();
    check_dim(dim)?;
    if min.len() != max.len() || !min.len().is_multiple_of(dim) {
        return Err(Error::invalid(format!(
            "bounds hold {} and {} values: expected the same whole number of rows of dim = {dim}",
            min.len(),
            max.len()
        )));
    }
    if let Some(d) = query.iter().position(|v| !v.is_finite()) {
        return Err(Error::invalid(format!("query: element {d} is {}: the query must be finite", query[d])));
    }
    for (i, (&lo, &hi)) in min.iter().zip(max).enumerate() {
        let (c, d) = (i / dim, i % dim);
        for (name, v) in [("bounds_min", lo), ("bounds_max", hi)] {
            if !v.is_finite() {
                return Err(Error::invalid(format!("{name}: chunk {c}, element {d} is {v}: bounds must be finite")));
            }
        }
        if lo > hi {
            return Err(Error::invalid(format!("chunk {c}, element {d}: bounds_min {lo} > bounds_max {hi}")));
        }
    }
    Ok(())
}

/// The bound score of every chunk (after `check`).
pub fn scores(query: &[f32], min: &[f32], max: &[f32]) -> Result<Vec<f64>> {
    check(query, min, max)?;
    let dim = query.len();
    let score = |lo: &[f32], hi: &[f32]| -> f64 {
        (0..dim).map(|d| (query[d] as f64 * lo[d] as f64).max(query[d] as f64 * hi[d] as f64)).sum()
    };
    Ok(min.chunks_exact(dim).zip(max.chunks_exact(dim)).map(|(lo, hi)| score(lo, hi)).collect())
}

/// The top-k chunks by bound score (k entries, -1 padded).
pub fn bounds_topk(query: &[f32], min: &[f32], max: &[f32], k: u32) -> Result<Vec<i32>> {
    args::check_k(k)?;
    check_dim(query.len())?;
    args::check_n_chunks(min.len() / query.len())?;
    Ok(topk(&scores(query, min, max)?, k as usize))
}

/// Chunks that `n_tokens` tokens make, `chunk_tokens` per chunk (the last
/// one may be partial).
pub fn n_chunks(n_tokens: usize, chunk_tokens: usize) -> usize {
    n_tokens.div_ceil(chunk_tokens.max(1))
}

/// Builds the bounds of the chunks of `keys` (one row per token; chunk c
/// covers tokens `c*chunk_tokens ..` up to `chunk_tokens` of them): returns
/// `(min, max)`, each `n_chunks x dim`. Values are exact for f32 and bf16
/// keys; for fp8 keys the f64 product with the scale is rounded down for
/// the minimum and up for the maximum, so the bounds always hold every key
/// (a product outside the f32 range is an error naming its token).
pub fn build(keys: &Keys, chunk_tokens: usize) -> Result<(Vec<f32>, Vec<f32>)> {
    let dim = keys.dim();
    check_dim(dim)?;
    if chunk_tokens == 0 {
        return Err(Error::invalid("chunk_tokens is 0"));
    }
    if keys.n_rows() == 0 {
        return Err(Error::invalid("n_tokens is 0"));
    }
    let chunks = n_chunks(keys.n_rows(), chunk_tokens);
    let (mut min, mut max) = (try_vec(chunks * dim, "the bounds")?, try_vec(chunks * dim, "the bounds")?);
    let mut row = vec![0f64; dim];
    let (mut lo, mut hi) = (vec![0f64; dim], vec![0f64; dim]);
    for c in 0..chunks {
        lo.fill(f64::INFINITY);
        hi.fill(f64::NEG_INFINITY);
        for t in c * chunk_tokens..((c + 1) * chunk_tokens).min(keys.n_rows()) {
            keys.row_into(t, &mut row)?;
            for d in 0..dim {
                // fp8 x scale can pass f32's range (448 x 1e37): no finite
                // f32 bound would hold it.
                if row[d].abs() > f32::MAX as f64 {
                    return Err(Error::invalid(format!(
                        "keys token {t} element {d}: key x scale = {:e} is outside the f32 range of the bounds",
                        row[d]
                    )));
                }
                lo[d] = lo[d].min(row[d]);
                hi[d] = hi[d].max(row[d]);
            }
        }
        min.extend(lo.iter().map(|&v| f32_at_most(v)));
        max.extend(hi.iter().map(|&v| f32_at_least(v)));
    }
    Ok((min, max))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hand_computed_scores() {
        // q = [1, -2]; chunk 0: min [0, -1] max [3, 1]; chunk 1: min [-1, 0] max [0, 0.5]
        let q = [1.0, -2.0];
        let min = [0.0, -1.0, -1.0, 0.0];
        let max = [3.0, 1.0, 0.0, 0.5];
        // chunk 0: max(0, 3) + max(2, -2) = 5; chunk 1: max(-1, 0) + max(0, -1) = 0
        assert_eq!(scores(&q, &min, &max).unwrap(), vec![5.0, 0.0]);
        assert_eq!(bounds_topk(&q, &min, &max, 3).unwrap(), vec![0, 1, -1]);
    }

    #[test]
    fn bad_values_are_named() {
        let e = check(&[1.0, f32::NAN], &[0.0; 2], &[0.0; 2]).unwrap_err();
        assert!(e.message.contains("query: element 1 is NaN"), "{}", e.message);
        let e = check(&[1.0, 1.0], &[0.0, 0.0, 0.0, 2.0], &[0.0, 0.0, 0.0, 1.0]).unwrap_err();
        assert!(e.message.contains("chunk 1, element 1"), "{}", e.message);
        let e = check(&[1.0], &[f32::NEG_INFINITY], &[0.0]).unwrap_err();
        assert!(e.message.contains("bounds_min: chunk 0, element 0 is -inf"), "{}", e.message);
    }

    #[test]
    fn build_partial_last_chunk() {
        let keys = [1.0f32, -1.0, 3.0, 0.5, -2.0, 4.0];
        let (min, max) = build(&Keys::f32(&keys, 2).unwrap(), 2).unwrap();
        assert_eq!(min, vec![1.0, -1.0, -2.0, 4.0]);
        assert_eq!(max, vec![3.0, 0.5, -2.0, 4.0]);
    }

    #[test]
    fn fp8_bounds_are_conservative() {
        let fp8 = [0x39u8, 0xbb]; // 1.125, -1.375
        let scales = [0.1f32]; // products are not f32 values
        let (min, max) = build(&Keys::fp8(&fp8, &scales, 2).unwrap(), 1).unwrap();
        assert!((min[0] as f64) <= 1.125 * 0.1f32 as f64 && (max[0] as f64) >= 1.125 * 0.1f32 as f64);
        assert!((min[1] as f64) <= -1.375 * 0.1f32 as f64 && (max[1] as f64) >= -1.375 * 0.1f32 as f64);
        assert!(min[0] < max[0]);
    }
}
