//! Host bookkeeping of `swap_in_selected`: 512 selected of 65,536 chunks at
//! 0%, 50%, 90% and 100% hits, kvswap's `Residency` beside a faithful C++
//! re-implementation of the original engine's `std::list` +
//! `std::unordered_map` LRU (benches/original-lru), in the same run, on the
//! same pre-generated selections. Bookkeeping only: no chunk bytes move.
//!
//!   cargo bench --bench bookkeeping [-- --json PATH] [-- --calls N]

use kvswap::residency::Residency;
use original_lru::OriginalLru;
use std::time::Instant;

const CAP: u32 = 65_536;
const SLOTS: u32 = 512;
const COUNT: usize = 512;
const WINDOW: usize = 128;

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// `calls` selections of COUNT distinct ids in which `hits` ids were selected
/// by the previous call. Since COUNT == SLOTS and ids are distinct, the
/// resident set after a call is exactly its selection, for any LRU.
fn selections(calls: usize, hits: usize, rng: &mut Rng) -> Vec<Vec<i32>> {
    let mut in_prev = vec![false; CAP as usize];
    let mut prev: Vec<u32> = Vec::new();
    let mut out = Vec::with_capacity(calls + 1);
    for call in 0..=calls {
        let h = if call == 0 { 0 } else { hits };
        let mut sel: Vec<u32> = Vec::with_capacity(COUNT);
        let mut taken = vec![false; CAP as usize];
        // h ids from the previous selection (partial Fisher-Yates).
        let mut pool = prev.clone();
        for i in 0..h {
            let j = i + rng.below((pool.len() - i) as u64) as usize;
            pool.swap(i, j);
            sel.push(pool[i]);
            taken[pool[i] as usize] = true;
        }
        while sel.len() < COUNT {
            let id = rng.below(CAP as u64) as u32;
            if !in_prev[id as usize] && !taken[id as usize] {
                taken[id as usize] = true;
                sel.push(id);
            }
        }
        for i in (1..sel.len()).rev() {
            let j = rng.below(i as u64 + 1) as usize;
            sel.swap(i, j);
        }
        for &p in &prev {
            in_prev[p as usize] = false;
        }
        for &s in &sel {
            in_prev[s as usize] = true;
        }
        prev = sel.clone();
        out.push(sel.iter().map(|&x| x as i32).collect());
    }
    out
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// ns per selected chunk for one pass over `sels` (the first call warms the
/// slots and is not timed), and the misses counted.
fn time_kvswap(sels: &[Vec<i32>]) -> (f64, u64) {
    let mut r = Residency::new(CAP, SLOTS, true).expect("residency tables");
    for id in 0..CAP {
        r.mark_stored(id);
    }
    let mut buf = vec![0i32; WINDOW + COUNT];
    buf[WINDOW..].copy_from_slice(&sels[0]);
    r.swap_in(&mut buf[WINDOW..], WINDOW as i32, true).unwrap();
    let mut misses = 0u64;
    let t = Instant::now();
    for s in &sels[1..] {
        buf[WINDOW..].copy_from_slice(s);
        let o = r.swap_in(&mut buf[WINDOW..], WINDOW as i32, true).unwrap();
        misses += o.misses as u64;
    }
    let ns = t.elapsed().as_nanos() as f64 / ((sels.len() - 1) * COUNT) as f64;
    std::hint::black_box(&buf);
    (ns, misses)
}

fn time_original(sels: &[Vec<i32>]) -> (f64, u64) {
    let mut r = OriginalLru::new(SLOTS as i32, CAP as i32);
    for id in 0..CAP {
        r.mark_stored(id as i32);
    }
    let mut buf = vec![0i32; WINDOW + COUNT];
    buf[WINDOW..].copy_from_slice(&sels[0]);
    r.swap_in(&mut buf, WINDOW).unwrap();
    let mut misses = 0u64;
    let t = Instant::now();
    for s in &sels[1..] {
        buf[WINDOW..].copy_from_slice(s);
        misses += r.swap_in(&mut buf, WINDOW).unwrap() as u64;
    }
    let ns = t.elapsed().as_nanos() as f64 / ((sels.len() - 1) * COUNT) as f64;
    std::hint::black_box(&buf);
    (ns, misses)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned();
    let calls: usize = arg("--calls").and_then(|s| s.parse().ok()).unwrap_or(2000);
    let reps = 7;
    let mut rng = Rng(0x5eed_0000_0000_0001 ^ std::process::id() as u64);
    println!("# swap_in_selected host bookkeeping: {COUNT} selected of {CAP} chunks, {SLOTS} slots, {calls} calls x {reps} reps (median)");
    println!("{:>8} {:>16} {:>22} {:>9}", "hit_rate", "kvswap_ns/chunk", "std::list+map_ns/chunk", "speedup");
    let mut rows = Vec::new();
    for rate in [0.0, 0.5, 0.9, 1.0] {
        let hits = (rate * COUNT as f64).round() as usize;
        let sels = selections(calls, hits, &mut rng);
        let expect_misses = ((COUNT - hits) * calls) as u64;
        let (mut k, mut o) = (Vec::new(), Vec::new());
        for _ in 0..reps {
            let (ns, m) = time_kvswap(&sels);
            assert_eq!(m, expect_misses, "kvswap misses");
            k.push(ns);
            let (ns, m) = time_original(&sels);
            assert_eq!(m, expect_misses, "baseline misses");
            o.push(ns);
        }
        let (k, o) = (median(k), median(o));
        println!("{:>7.0}% {:>16.2} {:>22.2} {:>8.1}x", rate * 100.0, k, o, o / k);
        rows.push(format!(
            "{{\"hit_rate\":{rate},\"kvswap_ns_per_chunk\":{k:.3},\"original_ns_per_chunk\":{o:.3},\"speedup\":{:.3}}}",
            o / k
        ));
    }
    if let Some(path) = arg("--json") {
        std::fs::write(&path, format!("{{\"rows\":[{}]}}\n", rows.join(","))).expect("write json");
        println!("wrote {path}");
    }
}
