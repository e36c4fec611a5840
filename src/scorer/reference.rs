//! The CPU reference of the FlashMemory score. It defines the result: every
//! input is widened exactly and every sum is accumulated in f64, in index
//! order.
//!
//! For scorer i with hidden input h_i (f32, `hidden` wide):
//! `q = Wq h_i` viewed as `[n_heads, head_dim]`, `w = Ww h_i`, and for chunk
//! c with key k_c: `s_i(c) = sum_h w[h] * relu(q[h] . k_c)`. The ensemble
//! score is the max or the mean of `s_i(c)` over the scorers.
//!
//! fp8 keys are scored with an fp8 query by default ([`fp8_query`]: q
//! rounded to bf16, then to fp8 e4m3 under a per-head power-of-two scale);
//! `KVSWAP_FM_QUERY=wide` (`fm_scorer_set_query`) keeps q as it is.
//!
//! With finite f32 inputs and the checkpoint's dimension limits no step can
//! overflow f64 (|s| stays below about 1e210), so scores are never NaN.

use super::checkpoint::{Checkpoint, Meta};
use super::backend::ScoreMode;
use super::dtype::KeyDtype;
use super::keys::Keys;
use super::args;
use super::topk::topk;
use crate::config::Ensemble;
use crate::error::{Error, Result};

/// One scorer's projections of one hidden input.
#[derive(Clone, Debug, PartialEq)]
pub struct Projection {
    /// `n_heads * head_dim` values, head-major.
    pub q: Vec<f64>,
    /// `n_heads` values.
    pub w: Vec<f64>,
}

/// Checks that `hidden` holds `n_scorers * hidden` finite values; a NaN or
/// infinity is `KVSWAP_STATUS_INVALID_ARGUMENT` naming the scorer and
/// position.
pub fn check_hidden(meta: &Meta, hidden: &[f32]) -> Result<()> {
    if hidden.len() != meta.hidden_len() {
        return Err(Error::invalid(format!(
            "hidden holds {} values: expected n_scorers x hidden = {} x {}",
            hidden.len(),
            meta.n_scorers,
            meta.hidden
        )));
    }
    match hidden.iter().position(|v| !v.is_finite()) {
        None => Ok(()),
        Some(p) => Err(Error::invalid(format!(
            "hidden: scorer {}, position {} is {}: the hidden state must be finite",
            p / meta.hidden as usize,
            p % meta.hidden as usize,
            hidden[p]
        ))),
    }
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// The projections of every scorer for each of `hiddens` (already checked),
/// as `[sequence][scorer]`. Each weight row is decoded once and applied to
/// every sequence, so a batch reads the weights once.
pub fn project_batch(ckpt: &Checkpoint, hiddens: &[&[f32]]) -> Vec<Vec<Projection>> {
    let meta = ckpt.meta();
    let width = meta.hidden as usize;
    let mut out: Vec<Vec<Projection>> = vec![Vec::with_capacity(meta.n_scorers as usize); hiddens.len()];
    let mut row = vec![0f64; width];
    for i in 0..meta.n_scorers as usize {
        let inputs: Vec<Vec<f64>> =
            hiddens.iter().map(|h| h[i * width..(i + 1) * width].iter().map(|&v| v as f64).collect()).collect();
        let (wq, ww) = (ckpt.wq(i), ckpt.ww(i));
        let mut q = vec![vec![0f64; wq.rows]; hiddens.len()];
        let mut w = vec![vec![0f64; ww.rows]; hiddens.len()];
        for r in 0..wq.rows {
            wq.row_into(r, &mut row);
            for (q, x) in q.iter_mut().zip(&inputs) {
                q[r] = dot(&row, x);
            }
        }
        for r in 0..ww.rows {
            ww.row_into(r, &mut row);
            for (w, x) in w.iter_mut().zip(&inputs) {
                w[r] = dot(&row, x);
            }
        }
        for (b, (q, w)) in q.into_iter().zip(w).enumerate() {
            out[b].push(Projection { q, w });
        }
    }
    out
}

/// The fp8 query (`KVSWAP_FM_QUERY=auto`, the default, with fp8 keys): each
/// head's q is rounded to bf16 (round to nearest even, saturating at the
/// largest finite bf16), then scaled by a power of two 2^-e and rounded to
/// fp8 e4m3 (round to nearest even, subnormals included), and scored as the
/// value it stands for, `e4m3 * 2^e`. e is the smallest integer with
/// `max |q_bf16| <= 448 * 2^e` (0 for an all-zero head), so the head's
/// largest element lands in (224, 448]. This is the query DeepSeek-V3.2's
/// fp8 indexer scores with (a per-head scale, here a power of two so that
/// scaling is exact); it lets the CUDA kernel multiply fp8 by fp8 on the
/// tensor cores. w is not quantized.
pub fn fp8_query(p: &Projection, head_dim: usize) -> Projection {
    let mut q = Vec::with_capacity(p.q.len());
    for head in p.q.chunks(head_dim) {
        let b: Vec<f64> = head.iter().map(|&v| bf16_round(v)).collect();
        let e = fp8_query_exponent(b.iter().fold(0.0, |m, v| m.max(v.abs())));
        let (down, up) = (2f64.powi(-e), 2f64.powi(e));
        q.extend(b.iter().map(|&v| e4m3_round(v * down) * up));
    }
    Projection { q, w: p.w.clone() }
}

/// The projections a call scores with: [`fp8_query`]'s for fp8 keys when
/// `fp8_query` is set, else `projs` as they are.
pub fn query_for_keys(projs: &[Projection], head_dim: usize, fp8_keys: bool, fp8_query: bool) -> std::borrow::Cow<'_, [Projection]> {
    if fp8_keys && fp8_query {
        std::borrow::Cow::Owned(projs.iter().map(|p| self::fp8_query(p, head_dim)).collect())
    } else {
        std::borrow::Cow::Borrowed(projs)
    }
}

/// e of [`fp8_query`] for a head whose largest |q_bf16| is `amax`: the
/// smallest e with `amax <= 448 * 2^e`. With `amax = m * 2^x`, m in [0.5, 1)
/// and `448 = 0.875 * 2^9`: x - 9 when m <= 0.875, else x - 8.
pub fn fp8_query_exponent(amax: f64) -> i32 {
    if amax == 0.0 || !amax.is_finite() {
        return 0;
    }
    let (m, x) = frexp(amax);
    if m <= 0.875 {
        x - 9
    } else {
        x - 8
    }
}

/// `v = m * 2^x` with m in [0.5, 1), for finite nonzero v (f64 subnormals
/// included).
fn frexp(v: f64) -> (f64, i32) {
    let a = v.abs();
    let bits = a.to_bits();
    let biased = ((bits >> 52) & 0x7ff) as i32;
    if biased == 0 {
        // Subnormal: scale into the normal range first (exact).
        let (m, x) = frexp(a * 2f64.powi(64));
        return (m, x - 64);
    }
    let m = f64::from_bits((bits & !(0x7ffu64 << 52)) | (1022u64 << 52));
    (m, biased - 1022)
}

/// `v` rounded to bf16 (8 significant bits, f32's exponent range with its
/// subnormals down to 2^-133), to nearest even; beyond the largest finite
/// bf16 it saturates there (the CUDA projection's f32 would be infinite
/// there and the call an error, as for a score that overflows f32).
pub fn bf16_round(v: f64) -> f64 {
    const MAX: f64 = 3.3895313892515355e38; // (2 - 2^-7) * 2^127
    round_to_grid(v, 8, -133).clamp(-MAX, MAX)
}

/// `v` (|v| <= 448) rounded to fp8 e4m3 (4 significant bits, subnormals
/// with quantum 2^-9), to nearest even, saturating at 448.
pub fn e4m3_round(v: f64) -> f64 {
    round_to_grid(v, 4, -9).clamp(-448.0, 448.0)
}

/// `v` rounded to nearest even on the grid of a binary format with `bits`
/// significant bits whose smallest quantum (subnormal spacing) is
/// 2^`min_quantum`. Powers of two scale exactly in f64 over these ranges.
fn round_to_grid(v: f64, bits: i32, min_quantum: i32) -> f64 {
    if v == 0.0 || !v.is_finite() {
        return v;
    }
    let (_, x) = frexp(v);
    // |v| in [2^(x-1), 2^x): quantum 2^(x - bits), never below the subnormal one.
    let quantum = (x - bits).max(min_quantum);
    (v * 2f64.powi(-quantum)).round_ties_even() * 2f64.powi(quantum)
}

/// `s_i(c)` for one scorer's projection and one decoded key.
pub fn scorer_score(p: &Projection, key: &[f64]) -> f64 {
    let head_dim = key.len();
    p.w.iter().enumerate().map(|(h, &w)| w * dot(&p.q[h * head_dim..(h + 1) * head_dim], key).max(0.0)).sum()
}

/// The ensemble of per-scorer scores.
pub fn combine(e: Ensemble, s: &[f64]) -> f64 {
    match e {
        Ensemble::Max => s.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        Ensemble::Mean => s.iter().sum::<f64>() / s.len() as f64,
    }
}

/// Calls `f` with `[s_0(c), s_1(c), ...]` for every chunk c in order.
fn each_chunk(projs: &[Projection], keys: &Keys, mut f: impl FnMut(&[f64])) -> Result<()> {
    let mut key = vec![0f64; keys.dim()];
    let mut s = vec![0f64; projs.len()];
    for c in 0..keys.n_rows() {
        keys.row_into(c, &mut key)?;
        for (s, p) in s.iter_mut().zip(projs) {
            *s = scorer_score(p, &key);
        }
        f(&s);
    }
    Ok(())
}

/// Per-chunk scores of each scorer, `[scorer][chunk]`, for the projections
/// of one sequence. A NaN or infinite key or scale is
/// `KVSWAP_STATUS_INVALID_ARGUMENT`.
pub fn scorer_scores(projs: &[Projection], keys: &Keys) -> Result<Vec<Vec<f64>>> {
    let mut out = vec![Vec::with_capacity(keys.n_rows()); projs.len()];
    each_chunk(projs, keys, |s| out.iter_mut().zip(s).for_each(|(o, &v)| o.push(v)))?;
    Ok(out)
}

/// Per-chunk ensemble scores for the projections of one sequence.
pub fn ensemble_scores(projs: &[Projection], keys: &Keys, e: Ensemble) -> Result<Vec<f64>> {
    let mut out = Vec::with_capacity(keys.n_rows());
    each_chunk(projs, keys, |s| out.push(combine(e, s)))?;
    Ok(out)
}

fn check_keys(meta: &Meta, keys: &Keys) -> Result<()> {
    if keys.dim() != meta.head_dim as usize {
        return Err(Error::invalid(format!("keys have {} elements per row: expected head_dim = {}", keys.dim(), meta.head_dim)));
    }
    args::check_n_chunks(keys.n_rows())
}

/// The per-chunk ensemble scores of one sequence on host memory: the
/// reference the top-k (of every backend) is defined by. `mode` is the
/// ensemble, or a [`ScoreMode`] (an `Ensemble` alone scores fp8 keys with
/// the fp8 query, the default).
pub fn chunk_scores(ckpt: &Checkpoint, mode: impl Into<ScoreMode>, hidden: &[f32], keys: &Keys) -> Result<Vec<f64>> {
    let mode = mode.into();
    check_hidden(ckpt.meta(), hidden)?;
    check_keys(ckpt.meta(), keys)?;
    let projs = project_batch(ckpt, &[hidden]).pop().unwrap_or_default();
    let projs = query_for_keys(&projs, keys.dim(), keys.dtype() == KeyDtype::Fp8E4m3, mode.fp8_query);
    ensemble_scores(&projs, keys, mode.ensemble)
}

/// The top-k of one sequence on host memory (k entries, -1 padded).
pub fn score_topk(ckpt: &Checkpoint, mode: impl Into<ScoreMode>, hidden: &[f32], keys: &Keys, k: u32) -> Result<Vec<i32>> {
    args::check_k(k)?;
    Ok(topk(&chunk_scores(ckpt, mode, hidden, keys)?, k as usize))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scorer::checkpoint::Checkpoint;
    use crate::scorer::dtype::WeightDtype;
    use crate::scorer::write;

    fn ckpt() -> Checkpoint {
        let m = Meta { n_scorers: 2, hidden: 6, n_heads: 2, head_dim: 3, ensemble: Ensemble::Max };
        Checkpoint::from_bytes(write::to_bytes(&m, &write::random(&m, WeightDtype::F16, 4).unwrap()).unwrap()).unwrap()
    }

    #[test]
    fn a_batch_projects_like_single_inputs() {
        let c = ckpt();
        let h1: Vec<f32> = (0..12).map(|i| i as f32 * 0.25 - 1.0).collect();
        let h2: Vec<f32> = (0..12).map(|i| 2.0 - i as f32 * 0.5).collect();
        let both = project_batch(&c, &[&h1, &h2]);
        assert_eq!(both[0], project_batch(&c, &[&h1]).remove(0));
        assert_eq!(both[1], project_batch(&c, &[&h2]).remove(0));
        // q[r] of scorer 1 is row r of its wq dotted with its half of h1.
        let row: f64 = (0..6).map(|j| c.wq(1).get(4, j) as f64 * h1[6 + j] as f64).sum();
        assert_eq!(both[0][1].q[4], row);
    }

    #[test]
    fn score_and_ensemble() {
        // q = [[1, 0, 2], [0, -1, 1]], w = [2, -1], key = [1, 1, -1]:
        // head 0: relu(1 - 2) = 0; head 1: relu(-1 - 1) = 0 -> 0
        let p = Projection { q: vec![1.0, 0.0, 2.0, 0.0, -1.0, 1.0], w: vec![2.0, -1.0] };
        assert_eq!(scorer_score(&p, &[1.0, 1.0, -1.0]), 0.0);
        // key = [3, -1, 0]: head 0: relu(3) = 3 -> 6; head 1: relu(1) = 1 -> -1; total 5
        assert_eq!(scorer_score(&p, &[3.0, -1.0, 0.0]), 5.0);
        assert_eq!(combine(Ensemble::Max, &[1.0, -2.0, 0.5]), 1.0);
        assert_eq!(combine(Ensemble::Mean, &[1.0, -2.0, 0.5]), -0.5 / 3.0);
    }

    #[test]
    fn rounding_grids() {
        // e4m3: 4 significant bits; subnormals step by 2^-9; ties to even.
        assert_eq!(e4m3_round(1.0625), 1.0); // 1 + 1/16: tie, to even (1.000)
        assert_eq!(e4m3_round(1.1875), 1.25); // 1 + 3/16: tie, to even (1.010)
        assert_eq!(e4m3_round(1.07), 1.125);
        assert_eq!(e4m3_round(-300.0), -288.0);
        assert_eq!(e4m3_round(447.0), 448.0);
        assert_eq!(e4m3_round(2f64.powi(-10)), 0.0); // half the smallest subnormal: tie, to 0
        assert_eq!(e4m3_round(3.0 * 2f64.powi(-10)), 2f64.powi(-8)); // 1.5 subnormal quanta: to 2
        assert_eq!(e4m3_round(0.0137), 7.0 * 2f64.powi(-9));
        // Every e4m3 value rounds to itself (the decoder's table).
        for b in 0u8..=0xfe {
            if b & 0x7f == 0x7f {
                continue; // NaN
            }
            let v = crate::scorer::dtype::fp8_e4m3_to_f32(b) as f64;
            assert_eq!(e4m3_round(v), v, "{b:#x}");
        }
        // bf16: 8 significant bits, f32's range.
        assert_eq!(bf16_round(1.0 + 2f64.powi(-8)), 1.0);
        assert_eq!(bf16_round(1.0 + 3.0 * 2f64.powi(-8)), 1.0 + 2f64.powi(-6));
        assert_eq!(bf16_round(2f64.powi(-134)), 0.0);
        assert_eq!(bf16_round(3.0 * 2f64.powi(-134)), 2f64.powi(-132));
        assert_eq!(bf16_round(1e300), 3.3895313892515355e38);
        for v in [0.1f32, -3.7, 1e-20, 6.5e37, 1.2e-39] {
            // Against the f32 -> bf16 rounding the CUDA kernels use.
            let b = v.to_bits();
            let r = b.wrapping_add(0x7fff + ((b >> 16) & 1)) & 0xffff_0000;
            assert_eq!(bf16_round(v as f64), f32::from_bits(r) as f64, "{v}");
        }
    }

    #[test]
    fn fp8_query_scales_each_head_by_a_power_of_two() {
        assert_eq!(fp8_query_exponent(448.0), 0);
        assert_eq!(fp8_query_exponent(449.0), 1);
        assert_eq!(fp8_query_exponent(224.0), -1);
        assert_eq!(fp8_query_exponent(224.5), 0);
        assert_eq!(fp8_query_exponent(1.0), -8); // 1 * 2^8 = 256 <= 448
        assert_eq!(fp8_query_exponent(1.75), -8);
        assert_eq!(fp8_query_exponent(1.76), -7);
        assert_eq!(fp8_query_exponent(2f64.powi(-140)), -148);
        assert_eq!(fp8_query_exponent(0.0), 0);
        // Two heads of 3: the first's max is 0.5 -> e = -9 (0.5 * 512 = 256);
        // -0.3 -> bf16 -0.30078125, * 512 = -154 -> -160 (quantum 16 in
        // [128, 256)) -> -0.3125. The second is zero.
        let p = Projection { q: vec![0.5, -0.3, 0.001, 0.0, 0.0, 0.0], w: vec![1.0, 2.0] };
        let f = fp8_query(&p, 3);
        assert_eq!(f.q[..2], [0.5, -0.3125]);
        assert_eq!(f.q[2], e4m3_round(bf16_round(0.001) * 512.0) / 512.0);
        assert_eq!(f.q[3..], [0.0, 0.0, 0.0]);
        assert_eq!(f.w, p.w);
        // Each head its own exponent: heads of max 0.5 (e = -9) and 112
        // (e = -2: 112 * 4 = 448). In the small head 0.3 -> bf16 0.30078125
        // * 512 = 154 -> 160 (quantum 16) -> 0.3125, and 0.0007 -> bf16
        // 0.000701904296875, * 512 = 0.359375 -> 0.375 (quantum 2^-5, a tie
        // to even); one exponent for the whole q (e = -2) would give it
        // * 4 = 0.0028 -> 2^-9 (a subnormal quantum). In
        // the large head 3 * 4 = 12 and 112 * 4 = 448 are exact, and 0.3 * 4
        // -> 1.203125 -> 1.25 (quantum 0.125) -> 0.3125.
        let p = Projection { q: vec![0.5, 0.3, 0.0007, 112.0, 3.0, 0.3], w: vec![1.0, 1.0] };
        let f = fp8_query(&p, 3);
        assert_eq!(f.q[..3], [0.5, 0.3125, e4m3_round(bf16_round(0.0007) * 512.0) / 512.0]);
        assert_eq!(f.q[2], 0.375 / 512.0);
        assert_ne!(f.q[2], e4m3_round(bf16_round(0.0007) * 4.0) / 4.0, "the small head took the large head's exponent");
        assert_eq!(f.q[3..], [112.0, 3.0, 0.3125]);
        // Every element is within 2^-4 (half an e4m3 step) of its bf16 value.
        let mut rng = 0x1234_5678u64;
        let q: Vec<f64> = (0..512)
            .map(|_| {
                rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((rng >> 11) as f64 / (1u64 << 53) as f64 - 0.5) * 1e3
            })
            .collect();
        let f = fp8_query(&Projection { q: q.clone(), w: vec![0.0; 4] }, 128);
        for (a, b) in q.iter().zip(&f.q) {
            let bb = bf16_round(*a);
            assert!((b - bb).abs() <= bb.abs() / 16.0 + 2f64.powi(-9) * 4.0, "{a} -> {b}");
        }
    }

    #[test]
    fn hidden_checks_name_scorer_and_position() {
        let c = ckpt();
        let mut h = vec![0.5f32; 12];
        h[7] = f32::NAN;
        let e = check_hidden(c.meta(), &h).unwrap_err();
        assert!(e.message.contains("scorer 1, position 1 is NaN"), "{}", e.message);
        assert!(check_hidden(c.meta(), &h[..11]).unwrap_err().message.contains("expected n_scorers x hidden = 2 x 6"));
    }
}
