//! Several contexts in one process, one thread each, as a tensor-parallel
//! engine uses kvswap (one context per rank / GPU). Each context's residency
//! and statistics are independent and exact against its own model; destroying
//! one leaves the others working. Runs on the CPU backend (CI) and, with
//! `KVSWAP_TEST_BACKEND=cuda`, with one context per GPU (several per GPU when
//! there are fewer GPUs than contexts).

mod common;

use common::{scaled, Model, Rng};
use kvswap::{BackendChoice, Config, Context, KvswapLayerSpec};
use std::sync::{Arc, Barrier};

const CONTEXTS: usize = 4;

fn device_count() -> usize {
    #[cfg(feature = "cuda")]
    if common::test_backend() == BackendChoice::Cuda {
        return kvswap::backend::cuda::driver::device_count().expect("CUDA device count") as usize;
    }
    1
}

fn make(device: usize, slots: u32, caps: &[u32], chunk: u32) -> Context {
    let cfg = Config {
        enable: true,
        gpu_chunks: slots,
        index_topk: slots,
        backend: common::test_backend(),
        device: device as i32,
        ..Config::default()
    };
    let specs: Vec<_> = caps
        .iter()
        .map(|&c| KvswapLayerSpec { compressed_cap: c as u64, chunk_bytes: chunk as u64, staging: std::ptr::null_mut(), staging_stride: 0 })
        .collect();
    Context::new(cfg, &specs).unwrap()
}

/// Random stores and swap-ins on every layer of `ctx`, checked exactly
/// against the per-layer models.
fn drive(ctx: &Context, models: &mut [Model], slots: u32, chunk: usize, steps: usize, rng: &mut Rng, tag: u8) {
    let caps: Vec<u32> = models.iter().map(|m| m.cap).collect();
    let mut bytes = vec![0u8; chunk];
    for step in 0..steps {
        let l = rng.below(caps.len() as u64) as usize;
        let m = &mut models[l];
        if rng.below(3) == 0 {
            let id = rng.below(m.cap as u64) as u32;
            rng.fill(&mut bytes);
            bytes[0] = tag; // whose context wrote it
            ctx.store(l, id as i32, &bytes).unwrap();
            m.store(id, bytes.clone());
        } else {
            let stored: Vec<u32> = (0..m.cap).filter(|&i| m.stored[i as usize].is_some()).collect();
            if stored.is_empty() {
                continue;
            }
            let n = rng.below(slots as u64 + 1) as usize;
            let mut idx = vec![0i32; 4];
            idx.extend((0..n).map(|_| stored[rng.below(stored.len() as u64) as usize] as i32));
            let (expect, _) = m.swap_in(&idx[4..], 4, true).unwrap();
            ctx.swap_in(l, &mut idx, 4).unwrap();
            assert_eq!(&idx[4..], &expect[..], "context {tag} step {step} layer {l}");
            if let Some(&p) = expect.iter().find(|&&p| p >= 0) {
                let slot = (p - 4) as u32;
                let id = m.chunk_in[slot as usize].unwrap();
                let got = ctx.slot_bytes(l, slot).unwrap();
                assert_eq!(got[0], tag, "context {tag}: a slot holds another context's bytes");
                assert_eq!(&got, m.stored[id as usize].as_ref().unwrap(), "context {tag} step {step}");
            }
        }
    }
}

#[test]
fn contexts_on_threads_are_independent_and_survive_a_destroy() {
    let devices = device_count();
    let mut seeds = Rng::fresh("multi");
    let (slots, chunk) = (16u32, 96usize);
    let caps = [200u32, 64, 12];
    let ctxs: Vec<Arc<Context>> = (0..CONTEXTS).map(|i| Arc::new(make(i % devices, slots, &caps, chunk as u32))).collect();
    let barrier = Arc::new(Barrier::new(CONTEXTS));
    let handles: Vec<_> = ctxs
        .iter()
        .enumerate()
        .map(|(i, ctx)| {
            let ctx = ctx.clone();
            let barrier = barrier.clone();
            let mut rng = Rng::new(seeds.next_u64());
            std::thread::spawn(move || {
                let mut models: Vec<Model> = caps.iter().map(|&c| Model::new(c, slots, true)).collect();
                drive(&ctx, &mut models, slots, chunk, scaled(1500), &mut rng, i as u8 + 1);
                for (l, m) in models.iter().enumerate() {
                    let s = ctx.stats(l).unwrap();
                    assert_eq!((s.hits, s.misses, s.evictions), (m.hits, m.misses, m.evictions), "context {i} layer {l}");
                }
                barrier.wait();
                // Context 0 is destroyed by the main thread's drop of its Arc
                // below once this thread returns; the others run on.
                if i == 0 {
                    return (ctx, false);
                }
                drive(&ctx, &mut models, slots, chunk, scaled(1500), &mut rng, i as u8 + 1);
                (ctx, true)
            })
        })
        .collect();
    drop(ctxs);
    let mut survivors = Vec::new();
    for (i, h) in handles.into_iter().enumerate() {
        let (ctx, second) = h.join().unwrap_or_else(|_| panic!("context {i} thread failed"));
        if i == 0 {
            drop(ctx); // destroyed while nothing else references it
        } else {
            assert!(second);
            survivors.push(ctx);
        }
    }
    // The survivors still work after context 0 is gone.
    for (k, ctx) in survivors.iter().enumerate() {
        let bytes = vec![0xabu8; chunk];
        ctx.store(0, 7, &bytes).unwrap();
        let mut idx = [0i32, 0, 0, 0, 7];
        ctx.swap_in(0, &mut idx[..], 4).unwrap_or_else(|e| panic!("survivor {k}: {e}"));
        let slot = (idx[4] - 4) as u32;
        assert_eq!(ctx.slot_bytes(0, slot).unwrap(), bytes, "survivor {k}: staged bytes");
    }
}

#[test]
fn pinned_pools_are_per_context() {
    let devices = device_count();
    let a = make(0, 16, &[100, 50], 64);
    let b = make((1 % devices).min(devices - 1), 16, &[300], 128);
    assert_eq!(a.host_bytes(), 150 * 64);
    assert_eq!(b.host_bytes(), 300 * 128);
    // Storing into one context leaves the other's chunks unstored.
    a.store(0, 5, &[1u8; 64]).unwrap();
    let mut idx = vec![5i32];
    let e = b.swap_in(0, &mut idx, 0).unwrap_err();
    assert_eq!(e.status, kvswap::KvswapStatus::NotStored);
}
