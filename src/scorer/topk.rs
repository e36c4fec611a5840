//! Top-k by a total order: higher score first, and among equal scores the
//! lower chunk id first. `-0.0` and `+0.0` are equal scores. The result has
//! exactly k entries; when there are fewer than k chunks the rest are -1.

use std::cmp::Ordering;

/// `a` comes before `b`: score descending, then id ascending.
fn before(a: &(f64, u32), b: &(f64, u32)) -> Ordering {
    b.0.total_cmp(&a.0).then(a.1.cmp(&b.1))
}

/// The ids of the `k` best of `scores` (id = position), best first, padded
/// with -1 to `k` entries. Scores must not be NaN (callers check inputs, and
/// finite inputs give finite f64 scores).
pub fn topk(scores: &[f64], k: usize) -> Vec<i32> {
    debug_assert!(scores.iter().all(|s| !s.is_nan()));
    if k == 0 {
        return Vec::new();
    }
    // `s + 0.0` turns -0.0 into +0.0 (and changes nothing else), so the two
    // zeros tie as they do in a float comparison on the device.
    let mut items: Vec<(f64, u32)> = scores.iter().enumerate().map(|(i, &s)| (s + 0.0, i as u32)).collect();
    if k < items.len() {
        items.select_nth_unstable_by(k - 1, before);
        items.truncate(k);
    }
    items.sort_unstable_by(before);
    let mut out: Vec<i32> = items.iter().map(|&(_, id)| id as i32).collect();
    out.resize(k, -1);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn order_ties_and_padding() {
        assert_eq!(topk(&[1.0, 3.0, 2.0], 2), vec![1, 2]);
        assert_eq!(topk(&[1.0, 3.0, 2.0], 5), vec![1, 2, 0, -1, -1]);
        assert_eq!(topk(&[0.5; 6], 4), vec![0, 1, 2, 3]);
        assert_eq!(topk(&[1.0, 2.0, 1.0, 2.0, 1.0], 3), vec![1, 3, 0]);
        assert_eq!(topk(&[-0.0, 0.0, -0.0], 2), vec![0, 1]);
        assert_eq!(topk(&[1.0, 2.0], 0), Vec::<i32>::new());
        assert_eq!(topk(&[7.0], 1), vec![0]);
        assert_eq!(topk(&[-1e300, f64::MIN_POSITIVE, -0.0], 3), vec![1, 2, 0]);
    }

    #[test]
    fn matches_a_full_sort() {
        let scores: Vec<f64> = (0..1000u64).map(|i| ((i * 7919) % 97) as f64 - 40.0).collect();
        let mut all: Vec<(f64, u32)> = scores.iter().enumerate().map(|(i, &s)| (s, i as u32)).collect();
        all.sort_by(before);
        for k in [1, 2, 50, 97, 999, 1000] {
            let want: Vec<i32> = all[..k].iter().map(|x| x.1 as i32).collect();
            assert_eq!(topk(&scores, k), want, "k = {k}");
        }
    }
}
