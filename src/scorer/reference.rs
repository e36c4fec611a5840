//! The CPU reference of the FlashMemory score. It defines the result: every
//! input is widened exactly and every sum is accumulated in f64, in index
//! order.
//!
//! For scorer i with hidden input h_i (f32, `hidden` wide):
//! `q = Wq h_i` viewed as `[n_heads, head_dim]`, `w = Ww h_i`, and for chunk
//! c with key k_c: `s_i(c) = sum_h w[h] * relu(q[h] . k_c)`. The ensemble
//! score is the max or the mean of `s_i(c)` over the scorers.
//!
//! With finite f32 inputs and the checkpoint's dimension limits no step can
//! overflow f64 (|s| stays below about 1e210), so scores are never NaN.

use super::checkpoint::{Checkpoint, Meta};
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
/// reference the top-k (of every backend) is defined by.
pub fn chunk_scores(ckpt: &Checkpoint, e: Ensemble, hidden: &[f32], keys: &Keys) -> Result<Vec<f64>> {
    check_hidden(ckpt.meta(), hidden)?;
    check_keys(ckpt.meta(), keys)?;
    let projs = project_batch(ckpt, &[hidden]).pop().unwrap_or_default();
    ensemble_scores(&projs, keys, e)
}

/// The top-k of one sequence on host memory (k entries, -1 padded).
pub fn score_topk(ckpt: &Checkpoint, e: Ensemble, hidden: &[f32], keys: &Keys, k: u32) -> Result<Vec<i32>> {
    args::check_k(k)?;
    Ok(topk(&chunk_scores(ckpt, e, hidden, keys)?, k as usize))
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
    fn hidden_checks_name_scorer_and_position() {
        let c = ckpt();
        let mut h = vec![0.5f32; 12];
        h[7] = f32::NAN;
        let e = check_hidden(c.meta(), &h).unwrap_err();
        assert!(e.message.contains("scorer 1, position 1 is NaN"), "{}", e.message);
        assert!(check_hidden(c.meta(), &h[..11]).unwrap_err().message.contains("expected n_scorers x hidden = 2 x 6"));
    }
}
