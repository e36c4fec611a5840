//! The CUDA scorer against the CPU reference (f64), on fresh random inputs
//! and adversarial ones. Needs a GPU: run by `.ci/gpu-run.sh`.
//!
//! Tolerance. The tensor cores take q (and f32 keys) rounded to bf16 (unit
//! roundoff u = 2^-8; bf16 and fp8 keys are exact in bf16) and accumulate in
//! f32. For chunk c and scorer i the score error is therefore bounded by
//!   tol_i(c) = 2u * sum_h |w_ih| * |scale_c| * sum_d |q_ihd| |k_cd|
//! (the factor 2 covers the rounding of both operands and the f32 GEMV and
//! accumulation, each far smaller). relu is 1-Lipschitz, max and mean are
//! 1-Lipschitz in the max norm, so the ensemble error is at most max_i tol_i.
//! The GPU top-k must then equal the reference top-k except for chunks whose
//! reference score lies within tol of the k-th reference score.
//!
//! fp8 keys with the fp8 query (the default): the reference rounds its f64
//! q to bf16 and then to e4m3 (reference::fp8_query), the GPU its f32 q.
//! Where the two q lie on either side of a rounding point the quantized
//! values differ by a step, so each element gets an envelope [lo, hi] of
//! every value it can take for an f32 q within beta = 2^-15 sum_j |W_j h_j|
//! of the f64 one (8x the f32 GEMV's random-walk error sqrt(n) 2^-24 sum
//! |W h| at hidden 4096; the worst-case n 2^-24 bound would let most
//! elements move a step), every head exponent that range allows included,
//! and the tolerance adds sum_h |w_ih| sum_d (hi - lo) |scale_c k_cd|. The
//! fp8 products are exact, so 2u above covers the rest. With up to 4
//! scorers, fm_score_wg_fp8q sums the heads on the tensor cores: relu of
//! each head's dot product rounded to bf16 (<= u relative per term) times
//! the head's weight split into bf16 hi + lo parts (<= 2^-15 relative),
//! summed in f32. The dot products use q rounded to e4m3 (each |q| grows by
//! at most 2^-4), so this adds at most (2^-8 + 2^-15)(1 + 2^-4) = 0.53 x 2u
//! of the bound, the rest covering the f32 accumulation. (The 2^-15 holds
//! while w * 2^(e - E) >= 2^-119, i.e. unless a scorer's head exponents
//! spread over about 2^120; past that the lo part is a bf16 subnormal, an
//! absolute error of about 2^-134 |w| per term, which the tests do not
//! reach.)
#![cfg(feature = "cuda")]

mod common;

use common::{scaled, Rng};
use kvswap::backend::cuda::driver::{self, Device, DeviceBuffer, Graph, OwnedStream};
use kvswap::backend::cuda::scorer::CudaScorer;
use kvswap::scorer::ScorerBackend;
use kvswap::config::Ensemble;
use kvswap::scorer::reference::{self, Projection};
use kvswap::scorer::{write, Checkpoint, KeyDtype, Keys, KeysRef, Meta, Query, ScoreMode, Scorer, SeqRef, WeightDtype};
use std::sync::Arc;

const U: f64 = 1.0 / 256.0;

fn checkpoint(rng: &mut Rng, scorers: u32, heads: u32, head_dim: u32, hidden: u32, dtype: WeightDtype) -> Arc<Checkpoint> {
    let meta = Meta { n_scorers: scorers, hidden, n_heads: heads, head_dim, ensemble: Ensemble::Max };
    let tensors = write::random(&meta, dtype, rng.next_u64()).unwrap();
    Arc::new(Checkpoint::from_bytes(write::to_bytes(&meta, &tensors).unwrap()).unwrap())
}

fn gauss(rng: &mut Rng) -> f32 {
    // Box-Muller
    let u1 = ((rng.next_u64() >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
    let u2 = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
    ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
}

/// Host keys in one dtype, with their decoded f64 rows.
struct HostKeys {
    dtype: KeyDtype,
    bytes: Vec<u8>,
    scales: Vec<f32>,
    n: usize,
    dim: usize,
}

impl HostKeys {
    fn random(rng: &mut Rng, dtype: KeyDtype, n: usize, dim: usize, magnitude: f32) -> HostKeys {
        let vals: Vec<f32> = (0..n * dim).map(|_| gauss(rng) * magnitude).collect();
        Self::from_values(rng, dtype, &vals, n, dim)
    }
    fn from_values(rng: &mut Rng, dtype: KeyDtype, vals: &[f32], n: usize, dim: usize) -> HostKeys {
        let (bytes, scales) = match dtype {
            KeyDtype::F32 => (vals.iter().flat_map(|v| v.to_le_bytes()).collect(), vec![]),
            KeyDtype::Bf16 => (vals.iter().flat_map(|&v| half::bf16::from_f32(v).to_le_bytes()).collect(), vec![]),
            KeyDtype::Fp8E4m3 => {
                // Random fp8 codes (never NaN: 0x7f / 0xff) and positive scales.
                let codes: Vec<u8> = (0..n * dim)
                    .map(|_| loop {
                        let c = rng.below(256) as u8;
                        if c & 0x7f != 0x7f {
                            break c;
                        }
                    })
                    .collect();
                let scales = (0..n).map(|_| 0.01 + (rng.below(1000) as f32) / 1000.0).collect();
                (codes, scales)
            }
        };
        HostKeys { dtype, bytes, scales, n, dim }
    }
    fn keys(&self) -> Keys<'_> {
        Keys::new(&self.bytes, self.dtype, if self.scales.is_empty() { None } else { Some(&self.scales) }, 0, self.dim, self.n).unwrap()
    }
}

/// Field order is drop order: the stream before the device's context.
struct Dev {
    stream: OwnedStream,
    dev: Device,
}

impl Dev {
    fn new() -> Dev {
        // The library's log lines (KVSWAP_LOG) go to stderr: which kernels
        // and load paths a run used.
        kvswap::logging::init();
        let dev = Device::open(0).unwrap();
        let g = dev.bind().unwrap();
        let stream = OwnedStream::new().unwrap();
        drop(g);
        Dev { stream, dev }
    }
    fn upload(&self, bytes: &[u8]) -> DeviceBuffer {
        let _g = self.dev.bind().unwrap();
        let b = DeviceBuffer::alloc(bytes.len().max(16), "test").unwrap();
        unsafe { driver::copy_htod_async(b.ptr, bytes.as_ptr(), bytes.len(), self.stream.0).unwrap() };
        self.stream.sync().unwrap();
        b
    }
    /// Overwrites the start of `b` with `bytes`.
    fn upload_into(&self, b: &DeviceBuffer, bytes: &[u8]) {
        assert!(bytes.len() <= b.bytes);
        let _g = self.dev.bind().unwrap();
        unsafe { driver::copy_htod_async(b.ptr, bytes.as_ptr(), bytes.len(), self.stream.0).unwrap() };
        self.stream.sync().unwrap();
    }
    fn download_i32(&self, b: &DeviceBuffer, n: usize) -> Vec<i32> {
        let _g = self.dev.bind().unwrap();
        let mut v = vec![0i32; n];
        unsafe { driver::copy_dtoh_async(v.as_mut_ptr() as *mut u8, b.ptr, 4 * n, self.stream.0).unwrap() };
        self.stream.sync().unwrap();
        v
    }
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Where the keys of a call sit on the device: the row stride (0: dense)
/// and the byte offsets of row 0 and of the scales from the start of their
/// (256-byte aligned) buffers.
#[derive(Clone, Copy, Default, Debug)]
struct Layout {
    row_stride: usize,
    data_offset: usize,
    scales_offset: usize,
    hidden_offset: usize,
}

/// A checkpoint with bf16 weights, its CUDA scorer on device 0, and a
/// random hidden state for it.
fn bf16_scorer(rng: &mut Rng, scorers: u32, heads: u32, head_dim: u32, hidden: u32) -> (Arc<Checkpoint>, Scorer, Vec<f32>) {
    let ckpt = checkpoint(rng, scorers, heads, head_dim, hidden, WeightDtype::Bf16);
    let scorer = Scorer::new(ckpt.clone(), 0).unwrap();
    (ckpt, scorer, random_hidden(rng, scorers, hidden))
}

fn random_hidden(rng: &mut Rng, scorers: u32, hidden: u32) -> Vec<f32> {
    (0..(scorers * hidden) as usize).map(|_| gauss(rng)).collect()
}

/// Runs the CUDA scorer on one sequence; returns its k outputs (or the error).
fn gpu_topk(d: &Dev, scorer: &Scorer, hidden: &[f32], keys: &HostKeys, k: u32) -> kvswap::Result<Vec<i32>> {
    gpu_topk_in(d, scorer, hidden, keys, k, Layout::default())
}

/// `gpu_topk` with the keys laid out as `lay` says; the bytes between rows
/// are 0xff (NaN in fp8), so a kernel reading the wrong stride shows.
fn gpu_topk_in(d: &Dev, scorer: &Scorer, hidden: &[f32], keys: &HostKeys, k: u32, lay: Layout) -> kvswap::Result<Vec<i32>> {
    let row = keys.dim * keys.dtype.size();
    let stride = if lay.row_stride == 0 { row } else { lay.row_stride };
    let mut rows = vec![0xffu8; lay.data_offset + keys.n.saturating_sub(1) * stride + row];
    for r in 0..keys.n {
        let at = lay.data_offset + r * stride;
        rows[at..at + row].copy_from_slice(&keys.bytes[r * row..(r + 1) * row]);
    }
    let mut scales = vec![0u8; lay.scales_offset];
    scales.extend(f32_bytes(&keys.scales));
    let mut hb = vec![0u8; lay.hidden_offset];
    hb.extend(f32_bytes(hidden));
    let h = d.upload(&hb);
    let kb = d.upload(&rows);
    let sc = d.upload(&scales);
    let out = d.upload(&vec![0x5au8; 4 * k as usize]); // poisoned
    let seq = SeqRef {
        hidden: h.ptr + lay.hidden_offset as u64,
        keys: KeysRef {
            data: kb.ptr + lay.data_offset as u64,
            scales: if keys.scales.is_empty() { 0 } else { sc.ptr + lay.scales_offset as u64 },
            row_stride: lay.row_stride,
            dtype: keys.dtype,
        },
        n_chunks: keys.n,
        out: out.ptr,
    };
    let r = unsafe { scorer.score_topk(&seq, k, d.stream.0 as u64) };
    let got = d.download_i32(&out, k as usize);
    r.map(|_| got)
}

/// A sequence's device copies (hidden state, keys, scales, a poisoned
/// output of k ids), kept alive while its `SeqRef` is used.
struct SeqBufs {
    hidden: DeviceBuffer,
    _keys: DeviceBuffer,
    _scales: DeviceBuffer,
    out: DeviceBuffer,
}

/// Uploads one sequence of a batch.
fn upload_seq(d: &Dev, hidden: &[f32], keys: &HostKeys, k: u32) -> (SeqRef, SeqBufs) {
    let (hb, kb, sc) = (d.upload(&f32_bytes(hidden)), d.upload(&keys.bytes), d.upload(&f32_bytes(&keys.scales)));
    let out = d.upload(&vec![0x11u8; 4 * k as usize]);
    let seq = SeqRef {
        hidden: hb.ptr,
        keys: KeysRef { data: kb.ptr, scales: if keys.scales.is_empty() { 0 } else { sc.ptr }, row_stride: 0, dtype: keys.dtype },
        n_chunks: keys.n,
        out: out.ptr,
    };
    (seq, SeqBufs { hidden: hb, _keys: kb, _scales: sc, out })
}

/// The benchmark's scorer shape (scorers, heads, head_dim, hidden), small
/// hidden size: the wgmma kernels on Hopper.
const BENCH_SHAPE: (u32, u32, u32, u32) = (3, 64, 128, 512);

/// A random batch of `b` sequences for `scorer`: sequence i has keys of
/// `dtypes[i % len]` and `chunks.0 + [0, chunks.1)` chunks; each is scored
/// alone first (`singles`), then `poison(i, hidden)` may change its hidden
/// state before it is uploaded for the batch call.
struct RandomBatch {
    seqs: Vec<SeqRef>,
    bufs: Vec<SeqBufs>,
    singles: Vec<Vec<i32>>,
    inputs: Vec<(Vec<f32>, HostKeys)>,
}

#[allow(clippy::too_many_arguments)]
fn random_batch(
    d: &Dev,
    rng: &mut Rng,
    scorer: &Scorer,
    b: usize,
    k: u32,
    dtypes: &[KeyDtype],
    chunks: (usize, u64),
    poison: impl Fn(usize, &mut [f32]),
) -> RandomBatch {
    let m = scorer.meta();
    let mut batch = RandomBatch { seqs: Vec::new(), bufs: Vec::new(), singles: Vec::new(), inputs: Vec::new() };
    for i in 0..b {
        let mut hidden = random_hidden(rng, m.n_scorers, m.hidden);
        let n = chunks.0 + rng.below(chunks.1) as usize;
        let keys = HostKeys::random(rng, dtypes[i % dtypes.len()], n, m.head_dim as usize, 1.0);
        batch.singles.push(gpu_topk(d, scorer, &hidden, &keys, k).unwrap());
        poison(i, &mut hidden);
        let (seq, bufs) = upload_seq(d, &hidden, &keys, k);
        batch.seqs.push(seq);
        batch.bufs.push(bufs);
        batch.inputs.push((hidden, keys));
    }
    batch
}

/// Reference scores and per-chunk tolerance (see the file comment), with
/// the default query (the fp8 one for fp8 keys).
fn reference_with_tolerance(ckpt: &Checkpoint, e: Ensemble, hidden: &[f32], keys: &HostKeys) -> (Vec<f64>, Vec<f64>) {
    reference_with_tolerance_q(ckpt, e.into(), hidden, keys)
}

/// For each scorer, the step width (hi - lo) of every q element under the
/// fp8 query: 0 where every f32 q within beta of the f64 one quantizes alike
/// (see the file comment).
fn fp8_query_envelope(ckpt: &Checkpoint, hidden: &[f32], projs: &[Projection]) -> Vec<Vec<f64>> {
    let width = ckpt.meta().hidden as usize;
    let dim = ckpt.meta().head_dim as usize;
    let mut row = vec![0f64; width];
    projs
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let h = &hidden[i * width..(i + 1) * width];
            let wq = ckpt.wq(i);
            let mut steps = Vec::with_capacity(p.q.len());
            for (head, q) in p.q.chunks(dim).enumerate() {
                let (mut blo, mut bhi) = (Vec::with_capacity(dim), Vec::with_capacity(dim));
                let (mut amax_lo, mut amax_hi) = (0f64, 0f64);
                for (d, &v) in q.iter().enumerate() {
                    wq.row_into(head * dim + d, &mut row);
                    let beta = 2f64.powi(-15) * row.iter().zip(h).map(|(a, b)| (a * *b as f64).abs()).sum::<f64>();
                    let (lo, hi) = (reference::bf16_round(v - beta), reference::bf16_round(v + beta));
                    amax_lo = amax_lo.max(if lo <= 0.0 && hi >= 0.0 { 0.0 } else { lo.abs().min(hi.abs()) });
                    amax_hi = amax_hi.max(lo.abs().max(hi.abs()));
                    blo.push(lo);
                    bhi.push(hi);
                }
                let exps = reference::fp8_query_exponent(amax_lo)..=reference::fp8_query_exponent(amax_hi);
                let deq = |x: f64, e: i32| reference::e4m3_round(x * 2f64.powi(-e)) * 2f64.powi(e);
                for d in 0..dim {
                    let lo = exps.clone().map(|e| deq(blo[d], e)).fold(f64::INFINITY, f64::min);
                    let hi = exps.clone().map(|e| deq(bhi[d], e)).fold(f64::NEG_INFINITY, f64::max);
                    steps.push(hi - lo);
                }
            }
            steps
        })
        .collect()
}

/// Reference scores and per-chunk tolerance for `mode` (see the file comment).
fn reference_with_tolerance_q(ckpt: &Checkpoint, mode: ScoreMode, hidden: &[f32], keys: &HostKeys) -> (Vec<f64>, Vec<f64>) {
    let wide: Vec<Projection> = reference::project_batch(ckpt, &[hidden]).pop().unwrap();
    let dim = keys.dim;
    let fp8q = keys.dtype == KeyDtype::Fp8E4m3 && mode.fp8_query;
    let projs = reference::query_for_keys(&wide, dim, keys.dtype == KeyDtype::Fp8E4m3, mode.fp8_query);
    let steps = if fp8q { fp8_query_envelope(ckpt, hidden, &wide) } else { vec![vec![0.0; wide[0].q.len()]; wide.len()] };
    let k = keys.keys();
    let scores = reference::ensemble_scores(&projs, &k, mode.ensemble).unwrap();
    let mut row = vec![0f64; dim];
    let mut tol = Vec::with_capacity(keys.n);
    for c in 0..keys.n {
        k.row_into(c, &mut row).unwrap();
        let t = projs
            .iter()
            .zip(&steps)
            .map(|(p, st)| {
                p.w.iter()
                    .enumerate()
                    .map(|(h, w)| {
                        let r = h * dim..(h + 1) * dim;
                        w.abs() * p.q[r.clone()].iter().zip(&st[r]).zip(&row).map(|((q, s), x)| (2.0 * U * q.abs() + s) * x.abs()).sum::<f64>()
                    })
                    .sum::<f64>()
            })
            .fold(0.0, f64::max);
        tol.push(t + 1e-30);
    }
    (scores, tol)
}

/// The GPU top-k equals the reference one up to ties within tolerance.
fn check_topk(got: &[i32], scores: &[f64], tol: &[f64], k: usize, what: &str) {
    let n = scores.len();
    let want = k.min(n);
    let exact = kvswap::scorer::topk::topk(scores, k);
    assert!(got[want..].iter().all(|&x| x == -1), "{what}: padding");
    let mut seen = vec![false; n];
    for &c in &got[..want] {
        assert!(c >= 0 && (c as usize) < n, "{what}: id {c} out of range");
        assert!(!seen[c as usize], "{what}: id {c} twice");
        seen[c as usize] = true;
    }
    let kth = scores[exact[want - 1] as usize];
    let kth_tol = tol[exact[want - 1] as usize];
    let mut differing = 0;
    for c in 0..n {
        let in_ref = exact[..want].contains(&(c as i32));
        if seen[c] != in_ref {
            differing += 1;
            assert!(
                (scores[c] - kth).abs() <= tol[c] + kth_tol,
                "{what}: chunk {c} (score {}, tol {}) {} the GPU top-k but the k-th reference score is {kth}",
                scores[c],
                tol[c],
                if seen[c] { "is in" } else { "is missing from" }
            );
        }
    }
    // Order: descending up to tolerance.
    for w in got[..want].windows(2) {
        let (a, b) = (w[0] as usize, w[1] as usize);
        assert!(scores[a] + tol[a] + tol[b] >= scores[b], "{what}: {a} ({}) before {b} ({})", scores[a], scores[b]);
    }
    eprintln!("{what}: {want} selected, {} differ from the reference inside the tolerance", differing / 2);
}

#[test]
#[ignore = "needs a CUDA device: run .ci/gpu-run.sh on the GPU machine"]
fn cuda_scorer_matches_reference_on_random_inputs() {
    let mut rng = Rng::fresh("scorer gpu random");
    let d = Dev::new();
    // Shapes: the benchmark's (Hopper wgmma kernels), a wgmma one with 64-dim
    // heads whose Q is not a whole number of passes of the fp8 kernel's
    // threads, two more for fm_score_wg_fp8q (128-dim heads: 64 Q rows, a
    // partial pass of its quarter-warp rows; 4 scorers, 256 rows, its
    // register-limited build; 4 x 48, 192 rows: its wgmma head sums at 3
    // k-steps per scorer, not the benchmark's 4), and two that take the
    // mma.sync kernel everywhere.
    let shapes = [
        (BENCH_SHAPE, WeightDtype::Bf16),
        ((2, 64, 64, 256), WeightDtype::Bf16),
        ((1, 64, 128, 128), WeightDtype::Bf16),
        ((4, 64, 128, 128), WeightDtype::F16),
        ((4, 48, 128, 128), WeightDtype::Bf16),
        ((2, 16, 64, 256), WeightDtype::F32),
        ((1, 8, 128, 64), WeightDtype::F16),
    ];
    for (shape, wdt) in shapes {
        let ckpt = checkpoint(&mut rng, shape.0, shape.1, shape.2, shape.3, wdt);
        let scorer = Scorer::new(ckpt.clone(), 0).unwrap();
        for (dtype, query) in [(KeyDtype::Bf16, Query::Auto), (KeyDtype::Fp8E4m3, Query::Auto), (KeyDtype::Fp8E4m3, Query::Wide), (KeyDtype::F32, Query::Auto)] {
            scorer.set_query(query);
            for e in [Ensemble::Max, Ensemble::Mean] {
                scorer.set_ensemble(e);
                let n = 1000 + rng.below(scaled(20_000) as u64) as usize;
                let k = [1u32, 64, 512, 2048][rng.below(4) as usize];
                let hidden: Vec<f32> = (0..(shape.0 * shape.3) as usize).map(|_| gauss(&mut rng)).collect();
                let keys = HostKeys::random(&mut rng, dtype, n, shape.2 as usize, 1.0);
                let got = gpu_topk(&d, &scorer, &hidden, &keys, k).unwrap();
                let (scores, tol) = reference_with_tolerance_q(&ckpt, scorer.mode(), &hidden, &keys);
                check_topk(&got, &scores, &tol, k as usize, &format!("{shape:?} {wdt:?} {dtype:?} {query:?} {e:?} n={n} k={k}"));
            }
        }
        scorer.set_query(Query::Auto);
    }
}

/// One call long enough that every warpgroup of the wgmma kernels streams
/// several tiles through its ring (a slot is refilled while the tile before
/// it is still being multiplied), for 128- and 64-dim heads, each key dtype
/// and both ensembles, against the reference. fp8 keys get some zero and
/// negative scales, so the split of such scales (wg8_split_rows) also runs
/// across tiles. Not
/// scaled by KVSWAP_TEST_SCALE: the length is what it tests.
#[test]
#[ignore = "needs a CUDA device: run .ci/gpu-run.sh on the GPU machine"]
fn cuda_scorer_long_call_matches_reference() {
    let mut rng = Rng::fresh("scorer gpu long call");
    let d = Dev::new();
    for (s, h, dim, hid) in [BENCH_SHAPE, (2, 64, 64, 256)] {
        let ckpt = checkpoint(&mut rng, s, h, dim, hid, WeightDtype::Bf16);
        let scorer = Scorer::new(ckpt.clone(), 0).unwrap();
        for (dtype, e, query) in [
            (KeyDtype::Fp8E4m3, Ensemble::Max, Query::Auto),
            (KeyDtype::Fp8E4m3, Ensemble::Mean, Query::Auto),
            (KeyDtype::Fp8E4m3, Ensemble::Max, Query::Wide),
            (KeyDtype::Bf16, Ensemble::Mean, Query::Auto),
            (KeyDtype::F32, Ensemble::Max, Query::Auto),
        ] {
            scorer.set_ensemble(e);
            scorer.set_query(query);
            // 132 SMs x 3 warpgroups x 64 rows = 25,344 chunks per round: 4 to 6 rounds.
            let n = 110_000 + rng.below(40_000) as usize;
            let k = 512u32;
            let hidden = random_hidden(&mut rng, s, hid);
            let mut keys = HostKeys::random(&mut rng, dtype, n, dim as usize, 1.0);
            for sc in keys.scales.iter_mut() {
                match rng.below(20) {
                    0 => *sc = 0.0,
                    1 => *sc = -*sc,
                    _ => {}
                }
            }
            let got = gpu_topk(&d, &scorer, &hidden, &keys, k).unwrap();
            let (scores, tol) = reference_with_tolerance_q(&ckpt, scorer.mode(), &hidden, &keys);
            check_topk(&got, &scores, &tol, k as usize, &format!("long call {s}x{h}x{dim} {dtype:?} {query:?} {e:?} n={n} k={k}"));
        }
    }
}

/// fp8 keys whose scale times 2^E (E: a scorer's largest head exponent of
/// its fp8 query) lies above the float range while every score stays
/// finite: a checkpoint whose q weights are scaled by 2^20 (E about 13)
/// and head-weight weights by 2^-30, chunks with one or two e4m3 codes of
/// +-2^-6, each chunk's scale the power of two (at most 2^127) that brings
/// its largest scorer score near 2^122. fm_score_wg_fp8q must not form
/// c = scale * 2^E there, nor scale a head's dot product (in units of
/// 2^e) before its weight shrinks it: for many chunks that product alone
/// is above the float range (NOTES s33's review case: scale 2^110, E 20,
/// scored inf on the per-element path it had then). Every seventh chunk has the
/// negative scale and flipped codes of the same scores, so that warps
/// mixing signs split their scales (wg8_split_rows) and the portable and
/// converting kernels (which scored every row so, NOTES s35) see both
/// signs; none may form that product. Returns the checkpoint, hidden
/// state, keys, how many chunks have scale * 2^E >= 2^129 for every
/// scorer, and how many have a head with |dot| * scale >= 2^128.
fn scale_beyond_float_range_case(rng: &mut Rng) -> (Arc<Checkpoint>, Vec<f32>, HostKeys, usize, usize) {
    let (s, h, dim, hid) = BENCH_SHAPE;
    let meta = Meta { n_scorers: s, hidden: hid, n_heads: h, head_dim: dim, ensemble: Ensemble::Max };
    let std = 1.0 / (hid as f32).sqrt();
    let mut matrix = |shape: [usize; 2], scale: f32| -> Vec<f32> { (0..shape[0] * shape[1]).map(|_| gauss(rng) * std * scale).collect() };
    let (wq, ww): (Vec<_>, Vec<_>) = (0..s).map(|_| (matrix(meta.wq_shape(), 2f32.powi(20)), matrix(meta.ww_shape(), 2f32.powi(-30)))).unzip();
    let tensors = write::from_weights(&meta, WeightDtype::Bf16, &wq, &ww).unwrap();
    let ckpt = Arc::new(Checkpoint::from_bytes(write::to_bytes(&meta, &tensors).unwrap()).unwrap());
    let hidden = random_hidden(rng, s, hid);
    let dim = dim as usize;
    let wide = reference::project_batch(&ckpt, &[&hidden]).pop().unwrap();
    // Each head's exponent e (its q in units of 2^e is at most 448), and E.
    let head_e: Vec<Vec<i32>> =
        wide.iter().map(|p| p.q.chunks(dim).map(|r| reference::fp8_query_exponent(r.iter().fold(0f64, |m, x| m.max(x.abs())))).collect()).collect();
    let e_min = head_e.iter().map(|e| *e.iter().max().unwrap()).min().unwrap();
    let n = 4096;
    let mut bytes = vec![0u8; n * dim];
    for c in 0..n {
        for _ in 0..1 + rng.below(2) {
            bytes[c * dim + rng.below(dim as u64) as usize] = if rng.below(2) == 0 { 0x08 } else { 0x88 };
        }
    }
    let mut keys = HostKeys { dtype: KeyDtype::Fp8E4m3, bytes, scales: vec![1.0; n], n, dim };
    let projs = reference::query_for_keys(&wide, dim, true, true);
    let per_scorer = reference::scorer_scores(&projs, &keys.keys()).unwrap();
    let (mut beyond, mut dot_beyond) = (0, 0);
    let mut row = vec![0f64; dim];
    for c in 0..n {
        let m = per_scorer.iter().map(|v| v[c].abs()).fold(0f64, f64::max);
        let k = if m > 0.0 { (122.0 - m.log2()).round().clamp(-126.0, 127.0) as i32 } else { 127 };
        keys.keys().row_into(c, &mut row).unwrap(); // the codes: chunk c's scale is still 1
        let dot_max = projs
            .iter()
            .zip(&head_e)
            .flat_map(|(p, es)| p.q.chunks(dim).zip(es).map(|(q, &e)| q.iter().zip(&row).map(|(a, b)| a * b).sum::<f64>().abs() * 2f64.powi(-e)))
            .fold(0f64, f64::max);
        dot_beyond += usize::from(dot_max * 2f64.powi(k) >= 2f64.powi(128));
        beyond += usize::from(k + e_min >= 129);
        keys.scales[c] = 2f32.powi(k);
        if c % 7 == 3 {
            // The same scores from a negative scale and every code's sign
            // flipped (relu(-s * -x) = relu(s * x)): warps whose rows mix
            // signs split their scales into the accumulators.
            keys.scales[c] = -keys.scales[c];
            for b in &mut keys.bytes[c * dim..(c + 1) * dim] {
                if *b != 0 {
                    *b ^= 0x80;
                }
            }
        }
    }
    (ckpt, hidden, keys, beyond, dot_beyond)
}

/// scale_beyond_float_range_case with its premise asserted: enough chunks
/// beyond the float range both ways, and every reference score (fp8 and
/// wide query, both ensembles) finite and below 2^126.
fn scale_beyond_float_range_checked(rng: &mut Rng) -> (Arc<Checkpoint>, Vec<f32>, HostKeys) {
    let (ckpt, hidden, keys, beyond, dot_beyond) = scale_beyond_float_range_case(rng);
    assert!(beyond >= 1000, "the case must put scale * 2^E above the float range: {beyond} of {} chunks do", keys.n);
    assert!(dot_beyond >= 100, "the case must put some head's dot product times scale above the float range: {dot_beyond} chunks do");
    for fp8_query in [true, false] {
        for ensemble in [Ensemble::Max, Ensemble::Mean] {
            let (scores, _) = reference_with_tolerance_q(&ckpt, ScoreMode { ensemble, fp8_query }, &hidden, &keys);
            assert!(scores.iter().all(|v| v.is_finite() && v.abs() < 2f64.powi(126)), "every reference score finite ({ensemble:?}, fp8 query {fp8_query})");
        }
    }
    (ckpt, hidden, keys)
}

/// The premise of cuda_scorer_scale_beyond_float_range, on the CPU (CI).
#[test]
fn scale_beyond_float_range_premise_holds() {
    let mut rng = Rng::fresh("scale beyond float range premise");
    scale_beyond_float_range_checked(&mut rng);
}

#[test]
#[ignore = "needs a CUDA device: run .ci/gpu-run.sh on the GPU machine"]
fn cuda_scorer_scale_beyond_float_range() {
    let mut rng = Rng::fresh("scorer gpu scale beyond float range");
    let d = Dev::new();
    let (ckpt, hidden, keys) = scale_beyond_float_range_checked(&mut rng);
    let scorer = Scorer::new(ckpt.clone(), 0).unwrap();
    for query in [Query::Auto, Query::Wide] {
        scorer.set_query(query);
        for e in [Ensemble::Max, Ensemble::Mean] {
            scorer.set_ensemble(e);
            let (scores, tol) = reference_with_tolerance_q(&ckpt, scorer.mode(), &hidden, &keys);
            let got = gpu_topk(&d, &scorer, &hidden, &keys, 512).unwrap();
            check_topk(&got, &scores, &tol, 512, &format!("scale * 2^E above the float range, {query:?} {e:?}"));
        }
    }
}

#[test]
#[ignore = "needs a CUDA device: run .ci/gpu-run.sh on the GPU machine"]
fn cuda_scorer_adversarial_inputs() {
    let mut rng = Rng::fresh("scorer gpu adversarial");
    let d = Dev::new();
    let (s, h, dim, hid) = BENCH_SHAPE;
    let (ckpt, scorer, hidden) = bf16_scorer(&mut rng, s, h, dim, hid);
    // All keys equal: every score equal, the top-k is ids 0..k-1 exactly.
    let row: Vec<f32> = (0..dim).map(|_| gauss(&mut rng)).collect();
    let vals: Vec<f32> = (0..5000).flat_map(|_| row.clone()).collect();
    let keys = HostKeys::from_values(&mut rng, KeyDtype::Bf16, &vals, 5000, dim as usize);
    let got = gpu_topk(&d, &scorer, &hidden, &keys, 512).unwrap();
    assert_eq!(got, (0..512).collect::<Vec<i32>>(), "all scores equal: ids 0..k-1");
    // The same with more tied candidates than the selection keeps in shared
    // memory (6,144): they are narrowed in global memory.
    let vals: Vec<f32> = (0..20_000).flat_map(|_| row.clone()).collect();
    let keys = HostKeys::from_values(&mut rng, KeyDtype::Bf16, &vals, 20_000, dim as usize);
    let got = gpu_topk(&d, &scorer, &hidden, &keys, 2048).unwrap();
    assert_eq!(got, (0..2048).collect::<Vec<i32>>(), "20,000 equal scores: ids 0..k-1");
    // 3,000 equal scores: one tie group below FM_ORDER_MAX (4,096), ranked
    // in shared memory by fm_order's blocks, not narrowed.
    let vals: Vec<f32> = (0..3000).flat_map(|_| row.clone()).collect();
    let keys = HostKeys::from_values(&mut rng, KeyDtype::Bf16, &vals, 3000, dim as usize);
    let got = gpu_topk(&d, &scorer, &hidden, &keys, 512).unwrap();
    assert_eq!(got, (0..512).collect::<Vec<i32>>(), "3,000 equal scores: ids 0..k-1");
    // Many exact ties: 40 distinct keys repeated; ties resolve to lower ids.
    let rows: Vec<Vec<f32>> = (0..40).map(|_| (0..dim).map(|_| gauss(&mut rng)).collect()).collect();
    let pick: Vec<usize> = (0..20_000).map(|_| rng.below(40) as usize).collect();
    let vals: Vec<f32> = pick.iter().flat_map(|&p| rows[p].clone()).collect();
    let keys = HostKeys::from_values(&mut rng, KeyDtype::Bf16, &vals, 20_000, dim as usize);
    let got = gpu_topk(&d, &scorer, &hidden, &keys, 700).unwrap();
    let (scores, tol) = reference_with_tolerance(&ckpt, Ensemble::Max, &hidden, &keys);
    check_topk(&got, &scores, &tol, 700, "many ties");
    // Within a group of identical keys (identical GPU scores), lower ids first.
    for w in got.windows(2) {
        let (a, b) = (w[0] as usize, w[1] as usize);
        if pick[a] == pick[b] {
            assert!(a < b, "identical keys {a} and {b}: the lower id comes first");
        }
    }
    // k > n_chunks: -1 padding; n_chunks = 1.
    let keys = HostKeys::random(&mut rng, KeyDtype::Fp8E4m3, 300, dim as usize, 1.0);
    let got = gpu_topk(&d, &scorer, &hidden, &keys, 512).unwrap();
    let (scores, tol) = reference_with_tolerance(&ckpt, Ensemble::Max, &hidden, &keys);
    check_topk(&got, &scores, &tol, 512, "k > n");
    // fp8 scales of any sign and size: 64-chunk tiles alternate between
    // positive scales (3e-39 .. 2e30: the kernel's positive-scale path, both
    // of its rescaling branches) and mixed ones (negative, zero: split into
    // the accumulators first), so both meet in one ranking.
    let mut keys = HostKeys::random(&mut rng, KeyDtype::Fp8E4m3, 6000, dim as usize, 1.0);
    for c in 0..keys.n {
        let mag = [3e-39f32, 1e-30, 0.01, 0.5, 1.0, 7.0, 1e30][rng.below(7) as usize] * (1.0 + rng.below(100) as f32 / 100.0);
        keys.scales[c] = if (c / 64) % 2 == 0 {
            mag
        } else {
            [mag, -mag, 0.0][rng.below(3) as usize]
        };
    }
    let got = gpu_topk(&d, &scorer, &hidden, &keys, 512).unwrap();
    let (scores, tol) = reference_with_tolerance(&ckpt, Ensemble::Max, &hidden, &keys);
    check_topk(&got, &scores, &tol, 512, "fp8 scales of any sign and size");
    scorer.set_ensemble(Ensemble::Mean);
    let got = gpu_topk(&d, &scorer, &hidden, &keys, 512).unwrap();
    let (scores, tol) = reference_with_tolerance(&ckpt, Ensemble::Mean, &hidden, &keys);
    check_topk(&got, &scores, &tol, 512, "fp8 scales of any sign and size, mean");
    scorer.set_ensemble(Ensemble::Max);
    let keys = HostKeys::random(&mut rng, KeyDtype::Bf16, 1, dim as usize, 1.0);
    let got = gpu_topk(&d, &scorer, &hidden, &keys, 4).unwrap();
    assert_eq!(got, vec![0, -1, -1, -1]);
    // Huge and tiny magnitudes (within f32 range of every product).
    for mag in [1e15f32, 1e-15] {
        let keys = HostKeys::random(&mut rng, KeyDtype::F32, 4000, dim as usize, mag);
        let got = gpu_topk(&d, &scorer, &hidden, &keys, 256).unwrap();
        let (scores, tol) = reference_with_tolerance(&ckpt, Ensemble::Max, &hidden, &keys);
        check_topk(&got, &scores, &tol, 256, &format!("magnitude {mag}"));
    }
    // A non-finite fp8 scale (in a warp whose other rows are fine): an
    // error naming its chunk, with the fp8 and the wide query.
    for (bad_scale, query) in [(f32::NAN, Query::Auto), (f32::INFINITY, Query::Auto), (f32::NEG_INFINITY, Query::Wide), (f32::NAN, Query::Wide)] {
        let mut keys = HostKeys::random(&mut rng, KeyDtype::Fp8E4m3, 3000, dim as usize, 1.0);
        let at = rng.below(3000) as usize;
        keys.scales[at] = bad_scale;
        scorer.set_query(query);
        let e = gpu_topk(&d, &scorer, &hidden, &keys, 64).unwrap_err();
        assert_eq!(e.status, kvswap::KvswapStatus::InvalidArgument, "{e}");
        assert!(e.message.contains(&format!("chunk {at} ")), "scale {bad_scale} at chunk {at}, {query:?}: {e}");
    }
    scorer.set_query(Query::Auto);
    // NaN in the hidden state: an error naming it, and no garbage (-1s).
    let mut bad = hidden.clone();
    bad[hid as usize + 17] = f32::NAN;
    let keys = HostKeys::random(&mut rng, KeyDtype::Bf16, 1000, dim as usize, 1.0);
    let e = gpu_topk(&d, &scorer, &bad, &keys, 64).unwrap_err();
    assert_eq!(e.status, kvswap::KvswapStatus::InvalidArgument, "{e}");
    assert!(e.message.contains("scorer 1") && e.message.contains("17"), "{e}");
    // The next good call works again.
    let got = gpu_topk(&d, &scorer, &hidden, &keys, 64).unwrap();
    let (scores, tol) = reference_with_tolerance(&ckpt, Ensemble::Max, &hidden, &keys);
    check_topk(&got, &scores, &tol, 64, "after an error");
}

/// Scores crowded into the selection's threshold bin, computed exactly.
/// q (bf16, -2 ..= 2), the head weights (1 or 2) and the keys (bf16: one
/// base key of -8 ..= 8, plus or minus 1 on `flips` random dims per chunk,
/// so within -24 ..= 24) are small integers: every product and partial sum
/// is an integer below 2^24 (at most 64 heads x 2 x 128 dims x 2 x 24), so
/// the tensor cores' f32
/// scores are exact and the GPU's top-k must equal the f64 reference's
/// exactly, ties to the lower id included. (With real-valued inputs the
/// test's tolerance is wider than such a cluster: it could not tell a right
/// selection from a wrong one.) Scored with q and w given (score_with_qw).
struct ExactCluster {
    q: DeviceBuffer,
    w: DeviceBuffer,
    seq: SeqRef,
    bufs: SeqBufs,
    projs: Vec<Projection>,
    keys: HostKeys,
    /// The reference top-k (filled once the cluster is kept).
    want: Vec<i32>,
}

/// The host side of an exact cluster: q, w, the keys and the reference's projections.
fn exact_cluster_data(rng: &mut Rng, n: usize, flips: usize) -> (Vec<f32>, Vec<f32>, HostKeys, Vec<Projection>) {
    let (s, h, dim, _) = BENCH_SHAPE;
    let (s, h, dim) = (s as usize, h as usize, dim as usize);
    let small = |rng: &mut Rng, m: u64| rng.below(2 * m + 1) as f32 - m as f32;
    let q: Vec<f32> = (0..s * h * dim).map(|_| small(rng, 2)).collect();
    let w: Vec<f32> = (0..s * h).map(|_| 1.0 + rng.below(2) as f32).collect();
    let base: Vec<f32> = (0..dim).map(|_| small(rng, 8)).collect();
    let mut vals = Vec::with_capacity(n * dim);
    for _ in 0..n {
        let mut key = base.clone();
        for _ in 0..flips {
            key[rng.below(dim as u64) as usize] += if rng.below(2) == 0 { 1.0 } else { -1.0 };
        }
        vals.extend_from_slice(&key);
    }
    let keys = HostKeys::from_values(rng, KeyDtype::Bf16, &vals, n, dim);
    let projs: Vec<Projection> = (0..s)
        .map(|i| Projection {
            q: q[i * h * dim..(i + 1) * h * dim].iter().map(|&x| x as f64).collect(),
            w: w[i * h..(i + 1) * h].iter().map(|&x| x as f64).collect(),
        })
        .collect();
    (q, w, keys, projs)
}

fn exact_cluster(d: &Dev, rng: &mut Rng, n: usize, flips: usize, k: u32) -> ExactCluster {
    let (q, w, keys, projs) = exact_cluster_data(rng, n, flips);
    let q_bits: Vec<u8> = q.iter().flat_map(|&x| half::bf16::from_f32(x).to_le_bytes()).collect();
    let (seq, bufs) = upload_seq(d, &[0.0; 4], &keys, k);
    ExactCluster { q: d.upload(&q_bits), w: d.upload(&f32_bytes(&w)), seq, bufs, projs, keys, want: Vec::new() }
}

/// Scores `c` on `cs` (poisoned output first) and returns the top-k and the
/// selection's candidate counts (sure keys, ties).
fn run_exact(d: &Dev, cs: &CudaScorer, c: &ExactCluster, k: u32) -> (Vec<i32>, (u32, u32)) {
    d.upload_into(&c.bufs.out, &vec![0x5au8; 4 * k as usize]);
    let st = d.stream.0 as u64;
    unsafe { cs.score_with_qw(&[c.seq], &[(c.q.ptr, c.w.ptr)], k as usize, Ensemble::Max, st).unwrap() };
    cs.sync_errors(st).unwrap();
    (d.download_i32(&c.bufs.out, k as usize), cs.last_candidates(st).unwrap().unwrap())
}

/// An exact cluster whose candidates (sure keys plus ties) exceed the 4,096
/// fm_order ranks in parallel, so the selection narrows them (redrawn until
/// the GPU reports so; a cluster can straddle a bin edge).
fn narrowed_cluster(d: &Dev, cs: &CudaScorer, rng: &mut Rng, n: usize, flips: usize, k: u32) -> (ExactCluster, Vec<i32>, (u32, u32)) {
    for _ in 0..20 {
        let mut c = exact_cluster(d, rng, n, flips, k);
        let (got, counts) = run_exact(d, cs, &c, k);
        if counts.0 + counts.1 > 4096 {
            let scores = reference::ensemble_scores(&c.projs, &c.keys.keys(), Ensemble::Max).unwrap();
            c.want = kvswap::scorer::topk::topk(&scores, k as usize);
            return (c, got, counts);
        }
    }
    panic!("n={n} flips={flips}: no draw in 20 put more than 4,096 candidates in the selection");
}

/// A random checkpoint of the benchmark shape and its CUDA scorer (the exact
/// cluster tests call it directly: score_with_qw, last_candidates).
/// A fresh generator named `name`, the device and a random bf16 checkpoint
/// of BENCH_SHAPE.
fn bench_setup(name: &str) -> (Rng, Dev, Arc<Checkpoint>) {
    let mut rng = Rng::fresh(name);
    let d = Dev::new();
    let (s, h, dim, hid) = BENCH_SHAPE;
    let ckpt = checkpoint(&mut rng, s, h, dim, hid, WeightDtype::Bf16);
    (rng, d, ckpt)
}

fn exact_setup(name: &str, sync: bool) -> (Rng, Dev, Arc<Checkpoint>, CudaScorer) {
    let (rng, d, ckpt) = bench_setup(name);
    let cs = CudaScorer::new(&ckpt, 0, sync).unwrap();
    (rng, d, ckpt, cs)
}

#[test]
#[ignore = "needs a CUDA device: run .ci/gpu-run.sh on the GPU machine"]
fn cuda_scorer_clustered_scores() {
    // Many distinct scores (16 flipped dims per key) and many exact ties
    // (one flipped dim), with k = 64 .. 2,048: the merge-tree narrowing
    // must give exactly the reference top-k.
    let (mut rng, d, _ckpt, cs) = exact_setup("scorer gpu clustered exact", true);
    for (n, flips, k) in [(30_000usize, 16usize, 1000u32), (60_000, 16, 2048), (9_000, 16, 64), (40_000, 1, 512), (100_000, 16, 512)] {
        let (c, got, (sure, ties)) = narrowed_cluster(&d, &cs, &mut rng, n, flips, k);
        assert_eq!(got, c.want, "n={n} flips={flips} k={k}: {sure} sure keys + {ties} ties");
        eprintln!("clustered n={n} flips={flips} k={k}: {sure} sure keys + {ties} ties, exact");
    }
}

#[test]
#[ignore = "needs a CUDA device: run .ci/gpu-run.sh on the GPU machine"]
fn cuda_scorer_clustered_graph_replay() {
    // The many-candidate narrowing leaves its arrival counts at zero for
    // the next call: replays of a captured call, with eager calls on the
    // same stream (same workspace: every call here fits the first one's)
    // in between, of random keys and of another cluster of another size,
    // all give the exact top-k.
    let (mut rng, d, ckpt, cs) = exact_setup("scorer gpu clustered replay", false);
    let (s, _, dim, hid) = BENCH_SHAPE;
    let k = 512u32;
    let (c, got, _) = narrowed_cluster(&d, &cs, &mut rng, 20_000, 16, k);
    assert_eq!(got, c.want, "eager");
    let (other, got, _) = narrowed_cluster(&d, &cs, &mut rng, 9_000, 1, k);
    assert_eq!(got, other.want, "eager, the other cluster");
    let hidden = random_hidden(&mut rng, s, hid);
    let random = HostKeys::random(&mut rng, KeyDtype::Bf16, 12_000, dim as usize, 1.0);
    let (random_seq, random_bufs) = upload_seq(&d, &hidden, &random, k);
    let (scores, tol) = reference_with_tolerance(&ckpt, Ensemble::Max, &hidden, &random);
    let st = d.stream.0;
    let _g = d.dev.bind().unwrap();
    let graph = Graph::capture(st, || unsafe { cs.score_with_qw(&[c.seq], &[(c.q.ptr, c.w.ptr)], k as usize, Ensemble::Max, st as u64) }).unwrap();
    for round in 0..6 {
        d.upload_into(&c.bufs.out, &vec![0x5au8; 4 * k as usize]);
        graph.launch(st).unwrap();
        d.stream.sync().unwrap();
        cs.sync_errors(st as u64).unwrap();
        assert_eq!(d.download_i32(&c.bufs.out, k as usize), c.want, "replay {round}");
        match round % 3 {
            0 => assert_eq!(run_exact(&d, &cs, &other, k).0, other.want, "the other cluster after replay {round}"),
            1 => {
                d.upload_into(&random_bufs.out, &vec![0x5au8; 4 * k as usize]);
                unsafe { cs.score_topk(&random_seq, k as usize, Ensemble::Max.into(), st as u64).unwrap() };
                cs.sync_errors(st as u64).unwrap();
                check_topk(&d.download_i32(&random_bufs.out, k as usize), &scores, &tol, k as usize, "random keys between replays");
            }
            _ => assert_eq!(run_exact(&d, &cs, &c, k).0, c.want, "eager after replay {round}"),
        }
    }
}

#[test]
#[ignore = "needs a CUDA device: run .ci/gpu-run.sh on the GPU machine"]
fn cuda_scorer_refuses_keys_not_16_byte_aligned() {
    // The kernels copy key rows 16 bytes at a time, fp8 rows included: keys
    // 8 bytes off (data or row stride) are refused before any launch, and
    // the scorer keeps working.
    let mut rng = Rng::fresh("scorer gpu alignment");
    let d = Dev::new();
    let (ckpt, scorer, hidden) = bf16_scorer(&mut rng, 2, 64, 64, 256);
    for dtype in [KeyDtype::Fp8E4m3, KeyDtype::Bf16] {
        let keys = HostKeys::random(&mut rng, dtype, 300, 64, 1.0);
        let row = 64 * dtype.size();
        for lay in [Layout { data_offset: 8, ..Layout::default() }, Layout { row_stride: row + 8, ..Layout::default() }] {
            let e = gpu_topk_in(&d, &scorer, &hidden, &keys, 16, lay).unwrap_err();
            assert_eq!(e.status, kvswap::KvswapStatus::InvalidArgument, "{e}");
            assert!(e.message.contains("16-byte aligned"), "{dtype:?} {lay:?}: {e}");
        }
        // The hidden state is read 16 bytes at a time too: 4 bytes off is
        // refused (it used to be a misaligned-address fault that poisoned
        // the context).
        let e = gpu_topk_in(&d, &scorer, &hidden, &keys, 16, Layout { hidden_offset: 4, ..Layout::default() }).unwrap_err();
        assert_eq!(e.status, kvswap::KvswapStatus::InvalidArgument, "{e}");
        assert!(e.message.contains("hidden") && e.message.contains("16-byte aligned"), "{e}");
        let (scores, tol) = reference_with_tolerance(&ckpt, Ensemble::Max, &hidden, &keys);
        let got = gpu_topk(&d, &scorer, &hidden, &keys, 16).unwrap();
        check_topk(&got, &scores, &tol, 16, "aligned keys after the refusals");
        // A row stride 16 bytes past the row, and (fp8) scales 4 bytes off a
        // 16-byte boundary: both allowed, and scored as the reference does.
        for lay in [Layout { row_stride: row + 16, scales_offset: 4, ..Layout::default() }, Layout { scales_offset: 4, ..Layout::default() }] {
            let got = gpu_topk_in(&d, &scorer, &hidden, &keys, 64, lay).unwrap();
            check_topk(&got, &scores, &tol, 64, &format!("{dtype:?}: {lay:?}"));
        }
    }
}

#[test]
#[ignore = "needs a CUDA device: run .ci/gpu-run.sh on the GPU machine"]
fn cuda_scorer_fp8_layouts_and_replays() {
    // fp8 keys with 128-dim heads on Hopper take fm_score_wg_fp8q, by TMA
    // (tensor maps of the keys' rows and of their scales) when the scales
    // are 16-byte aligned, by the cp.async ring otherwise: strided and
    // offset rows (the bytes between rows NaN in fp8), row counts around a
    // 64-row tile (1, 63, 65) and scales either way all score as the
    // reference does.
    let (mut rng, d, ckpt) = bench_setup("scorer gpu fp8 layouts");
    let scorer = Scorer::new(ckpt.clone(), 0).unwrap();
    let m = scorer.meta();
    let k = 64u32;
    for n in [1usize, 63, 65, 1_000] {
        let hidden = random_hidden(&mut rng, m.n_scorers, m.hidden);
        let keys = HostKeys::random(&mut rng, KeyDtype::Fp8E4m3, n, 128, 1.0);
        let (scores, tol) = reference_with_tolerance(&ckpt, Ensemble::Max, &hidden, &keys);
        for lay in [
            Layout::default(),
            Layout { row_stride: 256, data_offset: 16, ..Layout::default() },
            Layout { row_stride: 144, scales_offset: 16, ..Layout::default() },
            Layout { row_stride: 176, data_offset: 48, scales_offset: 4, ..Layout::default() },
        ] {
            let got = gpu_topk_in(&d, &scorer, &hidden, &keys, k, lay).unwrap();
            check_topk(&got, &scores, &tol, k as usize, &format!("n = {n}, {lay:?}"));
        }
    }
    // A captured fp8 call replays on the keys its buffers hold at each
    // replay (the tensor maps hold addresses, not contents).
    let cs = CudaScorer::new(&ckpt, 0, false).unwrap();
    let hidden = random_hidden(&mut rng, m.n_scorers, m.hidden);
    let first = HostKeys::random(&mut rng, KeyDtype::Fp8E4m3, 5_000, 128, 1.0);
    let (seq, bufs) = upload_seq(&d, &hidden, &first, k);
    let st = d.stream.0;
    // Once eagerly (the stream's workspace grows outside a capture), then
    // captured.
    unsafe { cs.score_topk(&seq, k as usize, Ensemble::Max.into(), st as u64).unwrap() };
    d.stream.sync().unwrap();
    cs.sync_errors(st as u64).unwrap();
    let graph = {
        let _g = d.dev.bind().unwrap();
        Graph::capture(st, || unsafe { cs.score_topk(&seq, k as usize, Ensemble::Max.into(), st as u64) }).unwrap()
    };
    let mut keys = first;
    for round in 0..3 {
        if round > 0 {
            keys = HostKeys::random(&mut rng, KeyDtype::Fp8E4m3, 5_000, 128, 1.0);
        }
        d.upload_into(&bufs._keys, &keys.bytes);
        d.upload_into(&bufs._scales, &f32_bytes(&keys.scales));
        d.upload_into(&bufs.out, &vec![0x5au8; 4 * k as usize]);
        {
            let _g = d.dev.bind().unwrap();
            graph.launch(st).unwrap();
        }
        d.stream.sync().unwrap();
        cs.sync_errors(st as u64).unwrap();
        let (scores, tol) = reference_with_tolerance(&ckpt, Ensemble::Max, &hidden, &keys);
        check_topk(&d.download_i32(&bufs.out, k as usize), &scores, &tol, k as usize, &format!("replay {round}"));
    }
}

#[test]
#[ignore = "needs a CUDA device: run .ci/gpu-run.sh on the GPU machine"]
fn cuda_batch_equals_single_calls() {
    let (mut rng, d, ckpt) = bench_setup("scorer gpu batch");
    batch_equals_single_calls(&mut rng, &d, &ckpt, &[1, 8, 64, 70]);
    // The batched projection's staged passes with a hidden size that is not
    // a multiple of their pass length (1024 + 264, the last 256-group read
    // by lane 0 alone; two passes of the one staging buffer), groups of 8 sequences with
    // a partial last one (each key dtype's launch group of a 64-batch holds
    // about 21), 520 rows per scorer (the last block's warps partly idle),
    // and f32 and f16 weights.
    for dtype in [WeightDtype::F32, WeightDtype::F16] {
        let odd = checkpoint(&mut rng, 1, 8, 64, 1288, dtype);
        batch_equals_single_calls(&mut rng, &d, &odd, &[8, 64]);
    }
}

/// Batches of each size in `sizes` equal their single calls bit for bit
/// (and the reference, for the batches of 8 and 70).
fn batch_equals_single_calls(rng: &mut Rng, d: &Dev, ckpt: &Arc<Checkpoint>, sizes: &[usize]) {
    let scorer = Scorer::new(ckpt.clone(), 0).unwrap();
    for &b in sizes {
        let k = 128u32;
        let dtypes = [KeyDtype::Bf16, KeyDtype::Fp8E4m3, KeyDtype::F32];
        let batch = random_batch(d, rng, &scorer, b, k, &dtypes, (500, 3000), |_, _| {});
        unsafe { scorer.score_topk_batch(&batch.seqs, k, d.stream.0 as u64).unwrap() };
        for (i, bufs) in batch.bufs.iter().enumerate() {
            let got = d.download_i32(&bufs.out, k as usize);
            assert_eq!(got, batch.singles[i], "batch {b}: sequence {i} differs from its single call");
            // And the reference itself (the batch of 8 and the one split into
            // two launches; every key dtype, including f32 keys).
            if b == 8 || b == 70 {
                let (hidden, keys) = &batch.inputs[i];
                let (scores, tol) = reference_with_tolerance(ckpt, Ensemble::Max, hidden, keys);
                check_topk(&got, &scores, &tol, k as usize, &format!("batch {b}: sequence {i} ({:?})", keys.dtype));
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA device: run .ci/gpu-run.sh on the GPU machine"]
fn cuda_bounds_scorer_matches_reference() {
    let mut rng = Rng::fresh("bounds gpu");
    let d = Dev::new();
    for _ in 0..6 {
        let dim = [32usize, 128, 576][rng.below(3) as usize];
        let n = 1 + rng.below(50_000) as usize;
        let k = [1u32, 100, 512][rng.below(3) as usize];
        let q: Vec<f32> = (0..dim).map(|_| gauss(&mut rng)).collect();
        let lo: Vec<f32> = (0..n * dim).map(|_| gauss(&mut rng)).collect();
        let hi: Vec<f32> = lo.iter().map(|v| v + (rng.below(1000) as f32) / 500.0).collect();
        let (qb, lb, hb) = (d.upload(&f32_bytes(&q)), d.upload(&f32_bytes(&lo)), d.upload(&f32_bytes(&hi)));
        let out = d.upload(&vec![0x22u8; 4 * k as usize]);
        let b = kvswap::scorer::BoundsRef { query: qb.ptr, min: lb.ptr, max: hb.ptr, dim, n_chunks: n, out: out.ptr };
        unsafe { kvswap::scorer::bounds_topk(0, &b, k, d.stream.0 as u64).unwrap() };
        let got = d.download_i32(&out, k as usize);
        let scores = kvswap::scorer::bounds::scores(&q, &lo, &hi).unwrap();
        check_topk(&got, &scores, &bounds_tolerance(&q, &lo, &hi), k as usize, &format!("bounds dim={dim} n={n} k={k}"));
    }
}

/// The bounds scores' tolerance per chunk: f32 sums of `dim` products in
/// another order, |error| <= dim * 2^-23 * sum |terms|.
fn bounds_tolerance(q: &[f32], lo: &[f32], hi: &[f32]) -> Vec<f64> {
    let dim = q.len();
    (0..lo.len() / dim)
        .map(|c| {
            let t: f64 = (0..dim).map(|j| (q[j] as f64 * lo[c * dim + j] as f64).abs().max((q[j] as f64 * hi[c * dim + j] as f64).abs())).sum();
            dim as f64 * f32::EPSILON as f64 * t + 1e-30
        })
        .collect()
}

/// fm_bounds_topk reads KVSWAP_SYNC on every call, and calls of both
/// settings share the device's error records: an error a KVSWAP_SYNC=0
/// call left on a stream makes the next KVSWAP_SYNC=1 call there write -1
/// and return it (once); the call after that is good, and nothing is left
/// for `bounds_sync`.
#[test]
#[ignore = "needs a CUDA device: run .ci/gpu-run.sh on the GPU machine"]
fn cuda_bounds_error_reaches_calls_of_either_sync_setting() {
    let mut rng = Rng::fresh("bounds sync settings");
    let d = Dev::new();
    let (dim, n, k) = (64usize, 3000usize, 16u32);
    let q: Vec<f32> = (0..dim).map(|_| gauss(&mut rng)).collect();
    let lo: Vec<f32> = (0..n * dim).map(|_| gauss(&mut rng)).collect();
    let hi: Vec<f32> = lo.iter().map(|v| v + (rng.below(1000) as f32) / 500.0).collect();
    let mut bad = lo.clone();
    bad[5 * dim + 7] = hi[5 * dim + 7] + 1.0; // chunk 5: a minimum above its maximum
    let (qb, lb, hb, badb) = (d.upload(&f32_bytes(&q)), d.upload(&f32_bytes(&lo)), d.upload(&f32_bytes(&hi)), d.upload(&f32_bytes(&bad)));
    let out = d.upload(&vec![0x22u8; 4 * k as usize]);
    let st = d.stream.0 as u64;
    let call = |min: u64| {
        let b = kvswap::scorer::BoundsRef { query: qb.ptr, min, max: hb.ptr, dim, n_chunks: n, out: out.ptr };
        unsafe { kvswap::scorer::bounds_topk(0, &b, k, st) }
    };
    let saved = std::env::var_os("KVSWAP_SYNC");
    std::env::set_var("KVSWAP_SYNC", "0");
    call(badb.ptr).expect("KVSWAP_SYNC=0: the call does not wait");
    std::env::set_var("KVSWAP_SYNC", "1");
    let e = call(lb.ptr).expect_err("KVSWAP_SYNC=1 returns the pending error");
    let got_after_error = d.download_i32(&out, k as usize);
    call(lb.ptr).expect("the error was returned once");
    let got = d.download_i32(&out, k as usize);
    let sync_after = kvswap::scorer::bounds_sync(0, st);
    match saved {
        Some(v) => std::env::set_var("KVSWAP_SYNC", v),
        None => std::env::remove_var("KVSWAP_SYNC"),
    }
    assert_eq!(e.status, kvswap::KvswapStatus::InvalidArgument, "{e}");
    assert!(e.message.contains("chunk 5"), "{e}");
    assert!(got_after_error.iter().all(|&x| x == -1), "a call before the error is returned writes -1: {got_after_error:?}");
    sync_after.expect("nothing left for bounds_sync");
    let scores = kvswap::scorer::bounds::scores(&q, &lo, &hi).unwrap();
    check_topk(&got, &scores, &bounds_tolerance(&q, &lo, &hi), k as usize, "bounds after the returned error");
}

/// Device-found errors of a batch name the sequence (its index in the call,
/// across launch groups and key-dtype splits): a NaN hidden state in one fp8
/// sequence of a 70-sequence bf16/fp8 batch makes the fp8 group's outputs -1
/// and leaves the bf16 group (launched first) equal to its single calls.
/// With KVSWAP_SYNC=0, an error pending when the stream's workspace grows is
/// still reported by `sync` (once), and later calls are good again. An Inf
/// in a later staged pass of a later group of 8 is named too.
#[test]
#[ignore = "needs a CUDA device: run .ci/gpu-run.sh on the GPU machine"]
fn cuda_batch_errors_name_the_sequence_and_survive_growth() {
    let (mut rng, d, ckpt) = bench_setup("scorer gpu batch errors");
    let (s, _, dim, hid) = BENCH_SHAPE;
    let scorer = Scorer::new(ckpt.clone(), 0).unwrap();
    let k = 64u32;
    let bad_at = 67usize; // odd: an fp8 sequence
    let poison = |i: usize, hidden: &mut [f32]| {
        if i == bad_at {
            hidden[hid as usize + 9] = f32::NAN;
        }
    };
    let batch = random_batch(&d, &mut rng, &scorer, 70, k, &[KeyDtype::Bf16, KeyDtype::Fp8E4m3], (300, 700), poison);
    let (keep, singles) = (&batch.bufs, &batch.singles);
    let e = unsafe { scorer.score_topk_batch(&batch.seqs, k, d.stream.0 as u64) }.unwrap_err();
    assert_eq!(e.status, kvswap::KvswapStatus::InvalidArgument, "{e}");
    assert!(e.message.contains(&format!("sequence {bad_at}")) && e.message.contains("scorer 1") && e.message.contains("position 9"), "{e}");
    for (i, bufs) in keep.iter().enumerate() {
        let got = d.download_i32(&bufs.out, k as usize);
        if i % 2 == 0 {
            assert_eq!(got, singles[i], "bf16 sequence {i} (group before the error) differs from its single call");
        } else {
            assert!(got.iter().all(|&x| x == -1), "fp8 sequence {i} (the failing group): {got:?}");
        }
    }
    scorer.sync(d.stream.0 as u64).unwrap();

    // KVSWAP_SYNC=0: an error, then a call that grows the workspace.
    let lazy = Scorer::with_sync(ckpt.clone(), 0, false).unwrap();
    let mut hidden = random_hidden(&mut rng, s, hid);
    let small = HostKeys::random(&mut rng, KeyDtype::Bf16, 1000, dim as usize, 1.0);
    let big = HostKeys::random(&mut rng, KeyDtype::Bf16, 5000, dim as usize, 1.0);
    let good = gpu_topk(&d, &lazy, &hidden, &small, k).unwrap(); // workspace for 1,024 chunks
    let saved = hidden[3];
    hidden[3] = f32::INFINITY;
    let got = gpu_topk(&d, &lazy, &hidden, &small, k).unwrap();
    assert!(got.iter().all(|&x| x == -1), "the failing call writes -1: {got:?}");
    hidden[3] = saved;
    let got = gpu_topk(&d, &lazy, &hidden, &big, k).unwrap(); // grows the workspace
    assert!(got.iter().all(|&x| x == -1), "a later call before sync writes -1 too: {got:?}");
    let e = lazy.sync(d.stream.0 as u64).unwrap_err();
    assert!(e.message.contains("scorer 0") && e.message.contains("position 3"), "the pending error survives the growth: {e}");
    lazy.sync(d.stream.0 as u64).unwrap();
    let (scores, tol) = reference_with_tolerance(&ckpt, Ensemble::Max, &hidden, &big);
    let got = gpu_topk(&d, &lazy, &hidden, &big, k).unwrap();
    check_topk(&got, &scores, &tol, k as usize, "after the reported error");
    assert_ne!(good, got, "two inputs, two results");

    // fm_scorer_set_sync: the same scorer switched to waiting returns the
    // error from the call, and back to not waiting defers it to sync.
    lazy.set_sync(true);
    hidden[3] = f32::NAN;
    let e = gpu_topk(&d, &lazy, &hidden, &big, k).unwrap_err();
    assert!(e.message.contains("scorer 0") && e.message.contains("position 3"), "set_sync(true): the call reports: {e}");
    lazy.set_sync(false);
    let got = gpu_topk(&d, &lazy, &hidden, &big, k).unwrap();
    assert!(got.iter().all(|&x| x == -1), "set_sync(false): the failing call writes -1: {got:?}");
    let e = lazy.sync(d.stream.0 as u64).unwrap_err();
    assert!(e.message.contains("position 3"), "set_sync(false): sync reports: {e}");
    lazy.sync(d.stream.0 as u64).expect("reported once");
    hidden[3] = saved;

    // The batched projection's check past its first staged pass, in a later
    // group of 8: 20 sequences (groups at 0, 8, 16), a hidden size of 1,288
    // (passes of 1,024 + 264), Inf at sequence 17, scorer 1, position 1,100.
    let wide = checkpoint(&mut rng, 2, 8, 64, 1288, WeightDtype::Bf16);
    let scorer = Scorer::new(wide.clone(), 0).unwrap();
    let poison = |i: usize, hidden: &mut [f32]| {
        if i == 17 {
            hidden[1288 + 1100] = f32::INFINITY;
        }
    };
    let batch = random_batch(&d, &mut rng, &scorer, 20, k, &[KeyDtype::Bf16], (300, 700), poison);
    let e = unsafe { scorer.score_topk_batch(&batch.seqs, k, d.stream.0 as u64) }.unwrap_err();
    assert!(e.message.contains("sequence 17") && e.message.contains("scorer 1") && e.message.contains("position 1100"), "{e}");
    for (i, bufs) in batch.bufs.iter().enumerate() {
        let got = d.download_i32(&bufs.out, k as usize);
        assert!(got.iter().all(|&x| x == -1), "sequence {i} (the failing launch group): {got:?}");
    }
    scorer.sync(d.stream.0 as u64).unwrap();
}

/// Shapes the CUDA kernels do not cover are refused with UNSUPPORTED (naming
/// the limit and the CPU scorer as the way out), while the CPU scorer takes
/// the same checkpoint.
#[test]
#[ignore = "needs a CUDA device: run .ci/gpu-run.sh on the GPU machine"]
fn cuda_scorer_refuses_unsupported_shapes() {
    let mut rng = Rng::fresh("scorer gpu unsupported");
    // (scorers, heads, head_dim, hidden), and what the message names.
    let shapes = [
        ((1u32, 8u32, 96u32, 64u32), "head_dim=96"),
        ((1, 12, 64, 64), "n_heads=12"),
        ((1, 96, 64, 64), "n_heads=96"),
        ((1, 8, 64, 100), "hidden=100"),
        ((3, 128, 256, 64), "shared memory"),
    ];
    for (shape, names) in shapes {
        let ckpt = checkpoint(&mut rng, shape.0, shape.1, shape.2, shape.3, WeightDtype::Bf16);
        let e = Scorer::new(ckpt.clone(), 0).err().unwrap_or_else(|| panic!("{shape:?}: the CUDA scorer accepted it"));
        assert_eq!(e.status, kvswap::KvswapStatus::Unsupported, "{shape:?}: {e}");
        assert!(e.message.contains(names) && e.message.contains("device -1"), "{shape:?}: {e}");
        Scorer::new(ckpt, -1).unwrap_or_else(|e| panic!("{shape:?}: the CPU scorer refused it: {e}"));
    }
}

/// A call captured in a CUDA graph (sync = 0) and replayed: equal to the
/// reference; after a NaN is written into the captured hidden state a replay
/// writes -1 everywhere and `sync` reports the error once; with the hidden
/// state restored the next replay is right again.
#[test]
#[ignore = "needs a CUDA device: run .ci/gpu-run.sh on the GPU machine"]
fn cuda_scorer_graph_replay_reports_nan_through_sync() {
    let (mut rng, d, ckpt) = bench_setup("scorer gpu graph nan");
    let (s, _, dim, hid) = BENCH_SHAPE;
    let scorer = Scorer::with_sync(ckpt.clone(), 0, false).unwrap();
    let k = 256u32;
    let mut hidden = random_hidden(&mut rng, s, hid);
    let keys = HostKeys::random(&mut rng, KeyDtype::Bf16, 20_000, dim as usize, 1.0);
    let (seq, bufs) = upload_seq(&d, &hidden, &keys, k);
    let st = d.stream.0;
    // One eager call sizes the stream's workspace (it cannot grow in a capture).
    unsafe { scorer.score_topk(&seq, k, st as u64).unwrap() };
    scorer.sync(st as u64).unwrap();
    let _g = d.dev.bind().unwrap();
    let graph = Graph::capture(st, || unsafe { scorer.score_topk(&seq, k, st as u64) }).unwrap();
    let replay = || {
        d.upload_into(&bufs.out, &vec![0x5au8; 4 * k as usize]); // poisoned
        graph.launch(st).unwrap();
        d.stream.sync().unwrap();
        d.download_i32(&bufs.out, k as usize)
    };
    let (scores, tol) = reference_with_tolerance(&ckpt, Ensemble::Max, &hidden, &keys);
    check_topk(&replay(), &scores, &tol, k as usize, "first replay");
    scorer.sync(st as u64).unwrap();
    let saved = hidden[2 * hid as usize + 17];
    hidden[2 * hid as usize + 17] = f32::NAN;
    d.upload_into(&bufs.hidden, &f32_bytes(&hidden));
    let got = replay();
    assert!(got.iter().all(|&x| x == -1), "a NaN replay writes -1: {got:?}");
    let e = scorer.sync(st as u64).unwrap_err();
    assert_eq!(e.status, kvswap::KvswapStatus::InvalidArgument, "{e}");
    assert!(e.message.contains("scorer 2") && e.message.contains("position 17"), "{e}");
    scorer.sync(st as u64).unwrap();
    // Launched on another stream than it was captured on (as PyTorch does):
    // that stream's sync reports the error, once, and the capture stream's
    // sync has nothing left to report.
    let other = OwnedStream::new().unwrap();
    d.upload_into(&bufs.out, &vec![0x5au8; 4 * k as usize]);
    graph.launch(other.0).unwrap();
    let e = scorer.sync(other.0 as u64).unwrap_err();
    assert_eq!(e.status, kvswap::KvswapStatus::InvalidArgument, "replay on another stream: {e}");
    assert!(e.message.contains("scorer 2") && e.message.contains("position 17"), "{e}");
    assert!(d.download_i32(&bufs.out, k as usize).iter().all(|&x| x == -1), "a NaN replay on another stream writes -1");
    scorer.sync(other.0 as u64).unwrap();
    scorer.sync(st as u64).unwrap();
    // Two errors at once, the graph's (recorded for the capture stream) and
    // an eager call's on the launch stream: each sync returns one, and
    // neither is cleared without being returned.
    graph.launch(other.0).unwrap();
    unsafe { scorer.score_topk(&seq, k, other.0 as u64).unwrap() };
    for round in 0..2 {
        let e = scorer.sync(other.0 as u64).expect_err(&format!("error {round} of 2"));
        assert!(e.message.contains("position 17"), "{e}");
    }
    scorer.sync(other.0 as u64).unwrap();
    scorer.sync(st as u64).unwrap();
    hidden[2 * hid as usize + 17] = saved;
    d.upload_into(&bufs.hidden, &f32_bytes(&hidden));
    check_topk(&replay(), &scores, &tol, k as usize, "replay after the error");
    scorer.sync(st as u64).unwrap();
}

/// `fm_scorer_reserve` / `fm_bounds_reserve`: a stream on which nothing was
/// called yet is captured into a CUDA graph after a reservation, for one
/// sequence and for a batch, and its replays equal the calls made on
/// another stream. Without the reservation the same capture is refused (the
/// workspace would have to be allocated inside it), and a reservation on a
/// stream being captured is refused.
#[test]
#[ignore = "needs a CUDA device: run .ci/gpu-run.sh on the GPU machine"]
fn cuda_reserve_lets_a_new_stream_be_captured() {
    let (mut rng, d, ckpt) = bench_setup("scorer gpu reserve");
    let scorer = Scorer::with_sync(ckpt.clone(), 0, false).unwrap();
    let k = 128u32;
    let dtypes = [KeyDtype::Bf16, KeyDtype::Fp8E4m3, KeyDtype::F32];
    // Each sequence is scored alone on d.stream first (`singles`).
    let batch = random_batch(&d, &mut rng, &scorer, 5, k, &dtypes, (500, 3000), |_, _| {});
    let _g = d.dev.bind().unwrap();
    let fresh = OwnedStream::new().unwrap();
    let fs = fresh.0;
    let capture = || {
        Graph::capture(fs, || unsafe {
            scorer.score_topk_batch(&batch.seqs[1..], k, fs as u64)?;
            scorer.score_topk(&batch.seqs[0], k, fs as u64)
        })
    };
    let e = capture().err().expect("a first call captured on a new stream must be refused");
    assert_eq!(e.status, kvswap::KvswapStatus::InvalidArgument, "{e}");
    assert!(e.message.contains("cannot grow while the stream is captured"), "{e}");
    let e = Graph::capture(fs, || scorer.reserve(4, 3500, fs as u64)).err().expect("a reservation in a capture");
    assert_eq!(e.status, kvswap::KvswapStatus::InvalidArgument, "{e}");
    assert!(e.message.contains("being captured"), "{e}");
    for (seqs, chunks) in [(0, 10), (1, 0), (4097, 10), (1, (4 << 20) + 1)] {
        assert!(scorer.reserve(seqs, chunks, fs as u64).is_err(), "reserve({seqs}, {chunks})");
    }
    scorer.reserve(4, 3500, fs as u64).unwrap();
    scorer.reserve(1, 100, fs as u64).unwrap(); // already as large: nothing
    // A launch of `graph` on `st` with `b`'s outputs poisoned first: every
    // output equals its single call.
    let replay_matches = |graph: &Graph, st: &OwnedStream, b: &RandomBatch, what: &str| {
        for x in &b.bufs {
            d.upload_into(&x.out, &vec![0x5au8; 4 * k as usize]);
        }
        graph.launch(st.0).unwrap();
        st.sync().unwrap();
        scorer.sync(st.0 as u64).unwrap();
        for (i, x) in b.bufs.iter().enumerate() {
            assert_eq!(d.download_i32(&x.out, k as usize), b.singles[i], "{what}: sequence {i}");
        }
    };
    let graph = capture().unwrap();
    replay_matches(&graph, &fresh, &batch, "replay 1");
    replay_matches(&graph, &fresh, &batch, "replay 2");

    // A reservation of exactly the captured shape, where each part of its
    // sizing counts: 70 sequences of 1-5 chunks take a launch group of 64
    // sequences of 32 chunks each (rows start at multiples of 32): 2,048
    // chunks, not 64 x 5 = 320 rounded up to 512.
    let tight = random_batch(&d, &mut rng, &scorer, 70, k, &[KeyDtype::Bf16], (1, 5), |_, _| {});
    let fresh2 = OwnedStream::new().unwrap();
    let f2 = fresh2.0;
    scorer.reserve(70, 5, f2 as u64).unwrap();
    let graph = Graph::capture(f2, || unsafe { scorer.score_topk_batch(&tight.seqs, k, f2 as u64) }).unwrap();
    replay_matches(&graph, &fresh2, &tight, "70 short sequences");

    // The bounds scorer (sync 0 set for device 0, so that it can be
    // captured; the setting is cleared again at the end).
    let (dim, n) = (128usize, 20_000usize);
    let q: Vec<f32> = (0..dim).map(|_| gauss(&mut rng)).collect();
    let lo: Vec<f32> = (0..n * dim).map(|_| gauss(&mut rng)).collect();
    let hi: Vec<f32> = lo.iter().map(|v| v + (rng.below(1000) as f32) / 500.0).collect();
    let (qb, lb, hb) = (d.upload(&f32_bytes(&q)), d.upload(&f32_bytes(&lo)), d.upload(&f32_bytes(&hi)));
    let (eager, graphed) = (d.upload(&vec![0x22u8; 4 * k as usize]), d.upload(&vec![0x33u8; 4 * k as usize]));
    let bref = |out: u64| kvswap::scorer::BoundsRef { query: qb.ptr, min: lb.ptr, max: hb.ptr, dim, n_chunks: n, out };
    struct ResetBoundsSync;
    impl Drop for ResetBoundsSync {
        fn drop(&mut self) {
            let _ = kvswap::scorer::set_bounds_sync(0, None);
        }
    }
    kvswap::scorer::set_bounds_sync(0, Some(false)).unwrap();
    let _reset = ResetBoundsSync;
    let result = (|| {
        unsafe { kvswap::scorer::bounds_topk(0, &bref(eager.ptr), k, d.stream.0 as u64)? };
        let bs = OwnedStream::new()?;
        let bcap = || Graph::capture(bs.0, || unsafe { kvswap::scorer::bounds_topk(0, &bref(graphed.ptr), k, bs.0 as u64) });
        let e = bcap().err().expect("a first bounds call captured on a new stream must be refused");
        assert_eq!(e.status, kvswap::KvswapStatus::InvalidArgument, "{e}");
        assert!(e.message.contains("cannot grow while the stream is captured"), "{e}");
        kvswap::scorer::bounds_reserve(0, n, bs.0 as u64)?;
        let g = bcap()?;
        g.launch(bs.0)?;
        bs.sync()?;
        kvswap::scorer::bounds_sync(0, bs.0 as u64)?;
        kvswap::scorer::bounds_sync(0, d.stream.0 as u64)
    })();
    result.unwrap();
    assert_eq!(d.download_i32(&graphed, k as usize), d.download_i32(&eager, k as usize), "bounds: graph replay vs eager call");
}

/// The scorers' waiting calls made while another stream is captured in
/// global mode, by the capturing thread and by another thread: loading a
/// scorer (allocations, the weights' upload, a module), its first call on
/// a stream with `KVSWAP_SYNC=1` (a workspace allocated, waits), a
/// reservation, `fm_scorer_sync` of either scorer, freeing one, the bounds
/// scorer's reservation and sync. None invalidates the capture (relaxed
/// capture mode), and its replay equals the single call.
#[test]
#[ignore = "needs a CUDA device: run .ci/gpu-run.sh on the GPU machine"]
fn cuda_scorer_waits_leave_a_global_capture_intact() {
    let (mut rng, d, ckpt) = bench_setup("scorer gpu waits beside a capture");
    let scorer = Scorer::with_sync(ckpt.clone(), 0, false).unwrap();
    let k = 64u32;
    let batch = random_batch(&d, &mut rng, &scorer, 2, k, &[KeyDtype::Fp8E4m3, KeyDtype::Bf16], (300, 700), |_, _| {});
    let _g = d.dev.bind().unwrap();
    let fresh = OwnedStream::new().unwrap();
    scorer.reserve(1, 1000, fresh.0 as u64).unwrap();
    let (hidden, keys) = &batch.inputs[1];
    let waiting_calls = |who: &str| -> kvswap::Result<()> {
        let _g = d.dev.bind()?;
        let other = OwnedStream::new()?;
        let strict = Scorer::with_sync(ckpt.clone(), 0, true)?;
        assert_eq!(gpu_topk(&d, &strict, hidden, keys, k)?, batch.singles[1], "{who}: a strict scorer's first call");
        strict.reserve(3, 2000, other.0 as u64)?;
        strict.sync(other.0 as u64)?;
        scorer.sync(d.stream.0 as u64)?;
        drop(strict);
        kvswap::scorer::bounds_reserve(0, 5000, other.0 as u64)?;
        kvswap::scorer::bounds_sync(0, other.0 as u64)
    };
    let graph = Graph::capture_allowing_waits(fresh.0, || {
        unsafe { scorer.score_topk(&batch.seqs[0], k, fresh.0 as u64)? };
        waiting_calls("capturing thread")?;
        std::thread::scope(|sc| sc.spawn(|| waiting_calls("other thread")).join().unwrap())
    })
    .expect("the capture outlives the waiting calls beside it");
    d.upload_into(&batch.bufs[0].out, &vec![0x5au8; 4 * k as usize]);
    graph.launch(fresh.0).unwrap();
    fresh.sync().unwrap();
    scorer.sync(fresh.0 as u64).unwrap();
    assert_eq!(d.download_i32(&batch.bufs[0].out, k as usize), batch.singles[0], "the replay");
}

/// A CPU scorer given device memory (a scorer loaded with device -1 in a
/// CUDA engine): refused with INVALID_ARGUMENT naming the argument, the
/// output untouched, instead of the CPU reading device memory (a crash).
#[test]
#[ignore = "needs a CUDA device: run .ci/gpu-run.sh on the GPU machine"]
fn cpu_scorer_refuses_device_memory() {
    let mut rng = Rng::fresh("cpu scorer device memory");
    let d = Dev::new();
    let ckpt = checkpoint(&mut rng, 1, 64, 128, 256, WeightDtype::Bf16);
    let scorer = Scorer::with_sync(ckpt, -1, true).unwrap();
    let n = 32usize;
    let keys = HostKeys::random(&mut rng, KeyDtype::Bf16, n, 128, 1.0);
    let hidden = random_hidden(&mut rng, 1, 256);
    let on_dev = d.upload(&keys.bytes);
    let mut out = vec![-7i32; 8];
    let seq = |hidden_at: u64, keys_at: u64, out_at: u64| SeqRef {
        hidden: hidden_at,
        keys: KeysRef { data: keys_at, scales: 0, row_stride: 0, dtype: KeyDtype::Bf16 },
        n_chunks: n,
        out: out_at,
    };
    let (h, k, o) = (hidden.as_ptr() as u64, keys.bytes.as_ptr() as u64, out.as_mut_ptr() as u64);
    for (s, field) in [(seq(h, on_dev.ptr, o), "keys.data"), (seq(on_dev.ptr, k, o), "hidden"), (seq(h, k, on_dev.ptr), "out_indices")] {
        let e = unsafe { scorer.score_topk(&s, 8, 0) }.err().unwrap_or_else(|| panic!("{field}: device memory accepted"));
        assert_eq!(e.status, kvswap::KvswapStatus::InvalidArgument, "{field}: {e}");
        assert!(e.message.contains(field) && e.message.contains("CUDA device memory"), "{field}: {e}");
        let e = unsafe { scorer.score_topk_batch(&[seq(h, k, o), s], 8, 0) }.expect_err("batch");
        assert!(e.message.contains(&format!("seqs[1].{field}")), "{field}: {e}");
    }
    assert_eq!(out, vec![-7; 8], "nothing written");
    unsafe { scorer.score_topk(&seq(h, k, o), 8, 0) }.expect("host memory on the CPU scorer");
}
