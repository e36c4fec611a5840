//! Model-based test: 100,000 random steps of store / swap-in / stats on the
//! library against the plain model in tests/common. After every step the slot
//! assignment equals the model's and each selected chunk's staged bytes equal
//! the bytes last stored for it.

mod common;

use common::{Model, ModelError, Rng};
use kvswap::{Config, Context, KvswapLayerSpec, KvswapStatus};

fn spec(cap: u32, chunk_bytes: u32) -> KvswapLayerSpec {
    KvswapLayerSpec { compressed_cap: cap as u64, chunk_bytes: chunk_bytes as u64, staging: std::ptr::null_mut(), staging_stride: 0 }
}

fn run(steps: usize, strict: bool, rng: &mut Rng) {
    // Layer 0 swaps (cap > slots), layer 1 is fully resident (cap <= slots).
    let (slots, chunk) = (12u32, 24u32);
    let caps = [40u32, 9u32];
    let cfg = Config {
        enable: true,
        gpu_chunks: slots,
        index_topk: slots,
        backend: common::test_backend(),
        sync: strict,
        ..Config::default()
    };
    let ctx = Context::new(cfg, &[spec(caps[0], chunk), spec(caps[1], chunk)]).unwrap();
    let mut models: Vec<Model> = caps.iter().map(|&c| Model::new(c, slots, true)).collect();
    let window = 3u32;
    let mut bytes = vec![0u8; chunk as usize];
    for step in 0..steps {
        let layer = rng.below(2) as usize;
        let m = &mut models[layer];
        let cap = m.cap;
        match rng.below(10) {
            0..=3 => {
                let id = rng.below(cap as u64) as i32;
                rng.fill(&mut bytes);
                ctx.store(layer, id, &bytes).unwrap();
                m.store(id as u32, bytes.clone());
            }
            4..=8 => {
                let count = rng.below(slots as u64 + 1) as usize;
                let mut idx = vec![-7i32; window as usize];
                for _ in 0..count {
                    let v = match rng.below(40) {
                        0 => -1,
                        1 if rng.chance(0.3) => cap as i32 + rng.below(3) as i32,
                        2 if rng.chance(0.2) => -2 - rng.below(5) as i32,
                        _ => rng.below(cap as u64) as i32,
                    };
                    idx.push(v);
                }
                // Keep the distinct ids within the slots (count <= slots already
                // guarantees it); duplicates happen naturally.
                let before = idx.clone();
                let expect = m.swap_in(&before[window as usize..], window as i32, strict);
                let got = ctx.swap_in(layer, &mut idx, window);
                match expect {
                    Ok((rewritten, deferred)) => {
                        got.unwrap_or_else(|e| panic!("step {step}: library refused {before:?}: {e}"));
                        assert_eq!(&idx[..window as usize], &before[..window as usize], "window untouched");
                        assert_eq!(&idx[window as usize..], &rewritten[..], "step {step}: slots for {before:?}");
                        if let Some(d) = deferred {
                            let e = ctx.sync().unwrap_err();
                            assert_eq!(e.status, status_of(d), "step {step}: deferred error");
                        } else if !strict {
                            ctx.sync().unwrap_or_else(|e| panic!("step {step}: no error was deferred, sync says {e}"));
                        }
                        for &p in idx[window as usize..].iter().filter(|&&p| p != -1) {
                            let slot = (p - window as i32) as u32;
                            let chunk_id = m.chunk_in[slot as usize].unwrap();
                            assert_eq!(
                                ctx.slot_bytes(layer, slot).unwrap(),
                                *m.stored[chunk_id as usize].as_ref().unwrap(),
                                "step {step}: bytes of chunk {chunk_id} in slot {slot}"
                            );
                        }
                    }
                    Err(err) => {
                        let e = got.expect_err("library accepted what the model refused");
                        assert_eq!(e.status, status_of(err), "step {step}: {e}");
                        assert_eq!(idx, before, "refused call must not touch the indices");
                    }
                }
                assert_eq!(ctx.residency(layer).unwrap(), m.residency(), "step {step}: residency map");
            }
            _ => {
                let s = ctx.stats(layer).unwrap();
                assert_eq!((s.hits, s.misses, s.evictions), (m.hits, m.misses, m.evictions), "step {step}: stats");
                assert_eq!(s.resident as usize, m.residency().len());
            }
        }
    }
}

fn status_of(e: ModelError) -> KvswapStatus {
    match e {
        ModelError::OutOfRange => KvswapStatus::OutOfRange,
        ModelError::NotStored => KvswapStatus::NotStored,
    }
}

#[test]
fn hundred_thousand_random_steps_strict() {
    let mut rng = Rng::fresh("model strict");
    run(common::scaled(100_000), true, &mut rng);
}

#[test]
fn random_steps_deferred_errors() {
    let mut rng = Rng::fresh("model deferred");
    run(common::scaled(30_000), false, &mut rng);
}
