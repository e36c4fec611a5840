//! One context used from 8 threads at once: six threads own one layer each
//! (checked exactly against the model), two threads share a layer (stores
//! race with swap-ins; invariants checked). Engines drive layers from several
//! threads, so this is the contract, not a stress curiosity.

mod common;

use common::{Model, Rng};
use kvswap::{Config, Context, KvswapLayerSpec};
use std::sync::{Arc, Mutex};

const CHUNK: usize = 64;
const SLOTS: u32 = 16;
const CAP: u32 = 96;
const WINDOW: u32 = 8;

/// Chunk contents name their layer, id and version, so a staged row can be
/// traced back to the store that wrote it.
fn content(layer: usize, id: u32, version: u32) -> Vec<u8> {
    let mut r = Rng::new(((layer as u64) << 40) ^ ((id as u64) << 20) ^ version as u64);
    let mut b = vec![0u8; CHUNK];
    r.fill(&mut b);
    b[0..4].copy_from_slice(&(layer as u32).to_le_bytes());
    b[4..8].copy_from_slice(&id.to_le_bytes());
    b[8..12].copy_from_slice(&version.to_le_bytes());
    b
}

fn decode(b: &[u8]) -> (usize, u32, u32) {
    let f = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().unwrap());
    (f(0) as usize, f(4), f(8))
}

fn selection(rng: &mut Rng, stored: &[bool]) -> Vec<i32> {
    let ids: Vec<u32> = (0..CAP).filter(|&i| stored[i as usize]).collect();
    let n = rng.below(SLOTS as u64 + 1) as usize;
    let mut idx = vec![0i32; WINDOW as usize];
    for _ in 0..n {
        if ids.is_empty() || rng.below(16) == 0 {
            idx.push(-1);
        } else {
            idx.push(ids[rng.below(ids.len() as u64) as usize] as i32);
        }
    }
    idx
}

#[test]
fn eight_threads_disjoint_and_shared_layers() {
    let cfg = Config { enable: true, gpu_chunks: SLOTS, index_topk: SLOTS, backend: common::test_backend(), ..Config::default() };
    let specs: Vec<KvswapLayerSpec> = (0..7)
        .map(|_| KvswapLayerSpec { compressed_cap: CAP as u64, chunk_bytes: CHUNK as u64, staging: std::ptr::null_mut(), staging_stride: 0 })
        .collect();
    let ctx = Arc::new(Context::new(cfg, &specs).unwrap());
    let shared_lock = Arc::new(Mutex::new(()));
    let mut seed = Rng::fresh("threads");
    let handles: Vec<_> = (0..8)
        .map(|t| {
            let ctx = ctx.clone();
            let shared_lock = shared_lock.clone();
            let mut rng = Rng::new(seed.next_u64());
            std::thread::spawn(move || {
                if t < 6 {
                    exclusive_layer(&ctx, t, &mut rng)
                } else {
                    shared_layer(&ctx, 6, t as u32, &shared_lock, &mut rng)
                }
            })
        })
        .collect();
    for h in handles {
        h.join().expect("a worker thread failed");
    }
    // The shared layer's map is a bijection and its counters add up.
    let res = ctx.residency(6).unwrap();
    let mut chunks: Vec<u32> = res.iter().map(|&(_, c)| c).collect();
    chunks.sort();
    chunks.dedup();
    assert_eq!(chunks.len(), res.len(), "a chunk sits in two slots");
    let s = ctx.stats(6).unwrap();
    assert_eq!(s.misses, s.h2d_bytes / CHUNK as u64);
    assert_eq!(s.stores, 2 * 2000);
}

fn exclusive_layer(ctx: &Context, layer: usize, rng: &mut Rng) {
    let mut m = Model::new(CAP, SLOTS, true);
    let mut stored = vec![false; CAP as usize];
    let mut version = vec![0u32; CAP as usize];
    for step in 0..3000 {
        if rng.below(3) == 0 {
            let id = rng.below(CAP as u64) as u32;
            version[id as usize] += 1;
            let b = content(layer, id, version[id as usize]);
            ctx.store(layer, id as i32, &b).unwrap();
            m.store(id, b);
            stored[id as usize] = true;
        } else {
            let mut idx = selection(rng, &stored);
            let (expect, _) = m.swap_in(&idx[WINDOW as usize..], WINDOW as i32, true).unwrap();
            ctx.swap_in(layer, &mut idx, WINDOW).unwrap();
            assert_eq!(&idx[WINDOW as usize..], &expect[..], "layer {layer} step {step}");
            for &p in expect.iter().filter(|&&p| p != -1) {
                let slot = (p - WINDOW as i32) as u32;
                let id = m.chunk_in[slot as usize].unwrap();
                let got = ctx.slot_bytes(layer, slot).unwrap();
                assert_eq!(got, content(layer, id, version[id as usize]), "layer {layer} step {step} slot {slot}");
            }
        }
    }
    let s = ctx.stats(layer).unwrap();
    assert_eq!((s.hits, s.misses, s.evictions), (m.hits, m.misses, m.evictions));
}

fn shared_layer(ctx: &Context, layer: usize, thread: u32, lock: &Mutex<()>, rng: &mut Rng) {
    // Both threads store every id once up front so selections are valid; ids
    // are then stored again with versions tagged by thread.
    let mut stored = vec![true; CAP as usize];
    for id in 0..CAP {
        ctx.store(layer, id as i32, &content(layer, id, 0)).unwrap();
    }
    stored.fill(true);
    let mut stores = CAP as u64;
    let mut n = 0u32;
    while stores < 2000 {
        if rng.below(2) == 0 {
            n += 1;
            let id = rng.below(CAP as u64) as u32;
            ctx.store(layer, id as i32, &content(layer, id, thread << 24 | n)).unwrap();
            stores += 1;
        } else {
            let _g = lock.lock().unwrap();
            let mut idx = selection(rng, &stored);
            let sel: Vec<i32> = idx[WINDOW as usize..].to_vec();
            ctx.swap_in(layer, &mut idx, WINDOW).unwrap();
            for (i, &p) in idx[WINDOW as usize..].iter().enumerate() {
                if sel[i] == -1 {
                    assert_eq!(p, -1);
                    continue;
                }
                assert!(p >= WINDOW as i32 && p < (WINDOW + SLOTS) as i32, "physical id {p} out of range");
                let (l, id, _) = decode(&ctx.slot_bytes(layer, (p - WINDOW as i32) as u32).unwrap());
                assert_eq!((l, id), (layer, sel[i] as u32), "slot holds another chunk");
            }
        }
    }
}
