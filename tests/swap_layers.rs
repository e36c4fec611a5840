//! `kvswap_swap_in_layers` (`Context::swap_in_layers_raw`) on the CPU
//! backend: equal to one `swap_in_selected` call per request (after the
//! top-k copy), in both sync modes, and every argument checked for every
//! request before any layer changes. tests/gpu.rs runs the CUDA form against
//! this backend.

mod common;

use common::Rng;
use kvswap::{BackendChoice, Config, Context, KvswapLayerSpec, KvswapStatus, KvswapSwapIn};

const LAYERS: usize = 6;
const CAP: u32 = 200;
const SLOTS: u32 = 16;
const CHUNK: usize = 64;

fn context(sync: bool) -> Context {
    let config = Config { backend: BackendChoice::Cpu, enable: true, sync, gpu_chunks: SLOTS, index_topk: SLOTS, ..Config::default() };
    let spec = KvswapLayerSpec { compressed_cap: CAP as u64, chunk_bytes: CHUNK as u64, staging: std::ptr::null_mut(), staging_stride: 0 };
    Context::new(config, &[spec; LAYERS]).unwrap()
}

/// Two contexts with the same chunks stored: all but the last 10 ids of
/// every layer (those stay never stored).
fn twins(rng: &mut Rng, sync: bool) -> (Context, Context) {
    let (a, b) = (context(sync), context(sync));
    let ids: Vec<i32> = (0..CAP as i32 - 10).collect();
    let mut rows = vec![0u8; ids.len() * CHUNK];
    for l in 0..LAYERS {
        rng.fill(&mut rows);
        a.store_rows(l, &ids, &rows).unwrap();
        b.store_rows(l, &ids, &rows).unwrap();
    }
    (a, b)
}

fn req(layer: usize, buf: &mut [i32], window: u32, count: u32) -> KvswapSwapIn {
    KvswapSwapIn { layer: layer as u32, window_len: window, count, reserved: 0, indices: buf.as_mut_ptr() }
}

/// Random steps: a random subset of the layers in random order, with and
/// without the shared top-k, sometimes a never-stored id; the index buffers,
/// errors, counters, residency and staged bytes equal those of one call per
/// layer on a twin context.
fn matches_one_call_per_layer(sync: bool) {
    let mut rng = Rng::fresh(if sync { "swap layers sync" } else { "swap layers async" });
    let (multi, single) = twins(&mut rng, sync);
    let window = 3u32;
    for step in 0..400 {
        let mut layers: Vec<usize> = (0..LAYERS).collect();
        for i in (1..LAYERS).rev() {
            layers.swap(i, rng.below(i as u64 + 1) as usize);
        }
        layers.truncate(1 + rng.below(LAYERS as u64) as usize);
        let count = rng.below(SLOTS as u64 + 1) as u32;
        let pick = |rng: &mut Rng| match rng.below(40) {
            0 => -1,
            1 => CAP as i32 - 1 - rng.below(10) as i32, // never stored
            _ => rng.below(CAP as u64 / 3) as i32 + (step % (2 * CAP as i32 / 3)),
        };
        let shared = rng.below(2) == 0;
        let topk: Vec<i32> = (0..count).map(|_| pick(&mut rng)).collect();
        let mut bufs: Vec<Vec<i32>> = layers
            .iter()
            .map(|_| {
                let mut b: Vec<i32> = (0..window as i32).map(|i| 7000 + i).collect();
                b.extend((0..count).map(|_| if shared { -5 } else { pick(&mut rng) }));
                b.push(4242); // past the entries: untouched
                b
            })
            .collect();
        let mut expect = bufs.clone();
        let requests: Vec<KvswapSwapIn> = layers.iter().zip(bufs.iter_mut()).map(|(&l, b)| req(l, b, window, count)).collect();
        let topk_ptr = if shared { topk.as_ptr() as u64 } else { 0 };
        let calls_before: Vec<u64> = layers.iter().map(|&l| multi.stats(l).unwrap().swap_in_calls).collect();
        // SAFETY: host buffers of window + count + 1 ints and count ids.
        let got = unsafe { multi.swap_in_layers_raw(&requests, topk_ptr, 0) };
        let mut want = Ok(());
        // sync = 1: a request with an id its layer refuses (out of range or
        // never stored: the twins' last 10 ids) refuses the call before any
        // layer changes, with the error one call on that layer gives.
        let refuses = |e: &[i32]| {
            let ids = if shared { &topk[..] } else { &e[window as usize..(window + count) as usize] };
            ids.iter().any(|&id| id != -1 && (id < 0 || id >= CAP as i32 - 10))
        };
        match layers.iter().zip(&expect).position(|(_, e)| sync && refuses(e)) {
            Some(i) => {
                let mut e = expect[i].clone();
                if shared {
                    e[window as usize..(window + count) as usize].copy_from_slice(&topk);
                }
                want = Err(single.swap_in(layers[i], &mut e[..(window + count) as usize], window).unwrap_err());
            }
            None => {
                for (&l, e) in layers.iter().zip(expect.iter_mut()) {
                    if shared {
                        e[window as usize..(window + count) as usize].copy_from_slice(&topk);
                    }
                    single.swap_in(l, &mut e[..(window + count) as usize], window).unwrap();
                }
            }
        }
        match (&got, &want) {
            (Ok(()), Ok(())) => {}
            (Err(g), Err(w)) => {
                assert_eq!(g.status, w.status, "step {step}");
                assert!(g.message.ends_with(&w.message) && g.message.starts_with("requests["), "step {step}: {g} vs {w}");
            }
            _ => panic!("step {step}: {got:?} vs {want:?}"),
        }
        if got.is_err() {
            // No request ran: every layer's call count is as before the call.
            for (j, &l) in layers.iter().enumerate() {
                assert_eq!(multi.stats(l).unwrap().swap_in_calls, calls_before[j], "step {step}: request {j} (layer {l})");
            }
        }
        assert_eq!(bufs, expect, "step {step}: index buffers");
        if !sync {
            let (a, b) = (multi.sync(), single.sync());
            assert_eq!(a.map_err(|e| e.message), b.map_err(|e| e.message), "step {step}: deferred errors");
        }
        for l in 0..LAYERS {
            assert_eq!(multi.stats(l).unwrap(), single.stats(l).unwrap(), "step {step} layer {l}: stats");
        }
        if step % 20 == 0 {
            for l in 0..LAYERS {
                let r = multi.residency(l).unwrap();
                assert_eq!(r, single.residency(l).unwrap(), "step {step} layer {l}: residency");
                for (slot, _) in r {
                    assert_eq!(multi.slot_bytes(l, slot).unwrap(), single.slot_bytes(l, slot).unwrap());
                }
            }
        }
    }
}

#[test]
fn swap_in_layers_equals_one_call_per_layer_sync() {
    matches_one_call_per_layer(true);
}

#[test]
fn swap_in_layers_equals_one_call_per_layer_async() {
    matches_one_call_per_layer(false);
}

/// Each refused call names its request and changes nothing (counters,
/// residency, index buffers), whichever request is bad.
#[test]
fn swap_in_layers_refuses_bad_requests_before_any_layer_changes() {
    let mut rng = Rng::fresh("swap layers refused");
    let (ctx, _) = twins(&mut rng, true);
    let before: Vec<_> = (0..LAYERS).map(|l| (ctx.stats(l).unwrap(), ctx.residency(l).unwrap())).collect();
    let mut bufs: Vec<Vec<i32>> = (0..4).map(|i| vec![i, 1, 2, 3, 4, 5]).collect();
    let pristine = bufs.clone();
    let topk = [10i32, 11, 12];
    type Case = (&'static str, KvswapStatus, &'static str);
    let cases: [Case; 10] = [
        ("no requests", KvswapStatus::InvalidArgument, "n is 0"),
        ("layer twice", KvswapStatus::InvalidArgument, "requests[0] and requests[2] both name layer 1"),
        ("bad layer last", KvswapStatus::OutOfRange, "requests[2] (layer 99): layer 99 is out of range"),
        ("null indices", KvswapStatus::NullPointer, "requests[1] (layer 2)"),
        ("reserved", KvswapStatus::InvalidArgument, "requests[2] (layer 3): reserved is 7"),
        ("count too large", KvswapStatus::OutOfRange, "requests[1] (layer 2): layer 2: count=17"),
        ("entries overlap", KvswapStatus::InvalidArgument, "requests[0]'s selected entries overlap requests[1]'s selected entries"),
        ("topk overlaps", KvswapStatus::InvalidArgument, "overlap"),
        ("misaligned", KvswapStatus::InvalidArgument, "requests[1] (layer 2): indices"),
        ("window too large", KvswapStatus::OutOfRange, "requests[2] (layer 3): window_len=1073741823"),
    ];
    for (name, status, text) in cases {
        let p: Vec<*mut i32> = bufs.iter_mut().map(|b| b.as_mut_ptr()).collect();
        let ok = |layer: u32, i: usize| KvswapSwapIn { layer, window_len: 2, count: 3, reserved: 0, indices: p[i] };
        let mut r = vec![ok(1, 0), ok(2, 1), ok(3, 2)];
        let mut topk_ptr = topk.as_ptr() as u64;
        match name {
            "no requests" => r.clear(),
            "layer twice" => r[2].layer = 1,
            "bad layer last" => r[2].layer = 99,
            "null indices" => r[1].indices = std::ptr::null_mut(),
            "reserved" => r[2].reserved = 7,
            "count too large" => {
                r[1].count = SLOTS + 1;
                topk_ptr = 0;
            }
            // Request 1's entries start one int into request 0's.
            "entries overlap" => r[1].indices = p[0].wrapping_add(1),
            // The top-k read from request 2's entries.
            "topk overlaps" => topk_ptr = p[2] as u64 + 8,
            "misaligned" => r[1].indices = (p[1] as usize + 2) as *mut i32,
            "window too large" => r[2].window_len = (1 << 30) - 1,
            _ => unreachable!(),
        }
        // SAFETY: every buffer holds 6 ints (window 2 + count 3 + 1); the
        // refused requests are never dereferenced (that is what is tested).
        let e = unsafe { ctx.swap_in_layers_raw(&r, topk_ptr, 0) }.expect_err(name);
        assert_eq!(e.status, status, "{name}: {e}");
        assert!(e.message.contains(text), "{name}: {e}");
        assert_eq!(bufs, pristine, "{name}: index buffers untouched");
        for (l, b) in before.iter().enumerate() {
            assert_eq!(&(ctx.stats(l).unwrap(), ctx.residency(l).unwrap()), b, "{name}: layer {l} unchanged");
        }
    }
    // The same requests, fixed, are accepted.
    let p: Vec<*mut i32> = bufs.iter_mut().map(|b| b.as_mut_ptr()).collect();
    let r: Vec<KvswapSwapIn> = (0..3).map(|i| KvswapSwapIn { layer: i as u32 + 1, window_len: 2, count: 3, reserved: 0, indices: p[i] }).collect();
    // SAFETY: as above.
    unsafe { ctx.swap_in_layers_raw(&r, topk.as_ptr() as u64, 0) }.unwrap();
    for (b, was) in bufs[..3].iter().zip(&pristine) {
        assert_eq!(b[..2], was[..2], "window kept");
        assert!(b[2..5].iter().all(|&v| (2..2 + SLOTS as i32).contains(&v)), "physical ids: {b:?}");
        assert_eq!(b[5], 5, "past the entries: untouched");
    }
}

/// With sync = 1 an id a layer refuses (never stored, out of range) refuses
/// the call before any layer changes: no layer runs, no entries change (the
/// top-k is not copied), and the error names the first refused request.
#[test]
fn swap_in_layers_sync_refuses_a_bad_id_before_any_layer_changes() {
    let mut rng = Rng::fresh("swap layers refuse");
    let (ctx, _) = twins(&mut rng, true);
    let topk = [0i32, 1, CAP as i32 - 1]; // the last id was never stored
    // Layer 4 has that id stored; layers 0 and 5 do not.
    ctx.store(4, CAP as i32 - 1, &[1u8; CHUNK]).unwrap();
    for (shared, bad) in [(true, CAP as i32 - 1), (false, CAP as i32 - 1), (false, CAP as i32 + 7)] {
        let mut bufs = vec![vec![0i32; 3]; 3];
        if !shared {
            for b in &mut bufs {
                b.copy_from_slice(&[0, 1, bad]);
            }
        }
        let pristine = bufs.clone();
        let before: Vec<_> = [4usize, 0, 5].iter().map(|&l| (ctx.stats(l).unwrap(), ctx.residency(l).unwrap())).collect();
        let p: Vec<*mut i32> = bufs.iter_mut().map(|b| b.as_mut_ptr()).collect();
        let r = [4u32, 0, 5].iter().zip(&p).map(|(&l, &q)| KvswapSwapIn { layer: l, window_len: 0, count: 3, reserved: 0, indices: q }).collect::<Vec<_>>();
        let topk_ptr = if shared { topk.as_ptr() as u64 } else { 0 };
        // SAFETY: three host buffers of 3 ints, topk of 3.
        let e = unsafe { ctx.swap_in_layers_raw(&r, topk_ptr, 0) }.unwrap_err();
        // Never stored: layer 4 has it, so request 1 (layer 0) is the first
        // refused; out of range: every layer refuses it, request 0 first.
        let (status, what, first) =
            if bad < CAP as i32 { (KvswapStatus::NotStored, "was never stored", "requests[1] (layer 0): layer 0:") } else { (KvswapStatus::OutOfRange, "is outside", "requests[0] (layer 4): layer 4:") };
        assert_eq!(e.status, status, "{e}");
        assert!(e.message.starts_with(first) && e.message.contains(what), "{e}");
        assert_eq!(bufs, pristine, "shared {shared}: no entries changed");
        for (j, &l) in [4usize, 0, 5].iter().enumerate() {
            assert_eq!((ctx.stats(l).unwrap(), ctx.residency(l).unwrap()), before[j], "shared {shared}: layer {l} unchanged");
        }
    }
}

/// Entries that would run past the end of the address space are refused
/// before anything reads them, by one call (`kvswap_swap_in_selected`) as
/// by several (`kvswap_swap_in_layers`).
#[test]
fn entries_past_the_end_of_the_address_space_are_refused() {
    let ctx = context(true);
    let near_end = u64::MAX - 7; // 4-byte aligned; 3 entries would wrap
    // SAFETY: refused before any access (the point of the test).
    let e = unsafe { ctx.swap_in_raw(0, near_end, 0, 3, 0) }.unwrap_err();
    assert_eq!(e.status, KvswapStatus::OutOfRange, "{e}");
    assert!(e.message.contains("past the end of the address space"), "{e}");
    let r = [KvswapSwapIn { layer: 0, window_len: 0, count: 3, reserved: 0, indices: near_end as *mut i32 }];
    // SAFETY: as above.
    let e = unsafe { ctx.swap_in_layers_raw(&r, 0, 0) }.unwrap_err();
    assert_eq!(e.status, KvswapStatus::OutOfRange, "{e}");
    assert_eq!(ctx.stats(0).unwrap().swap_in_calls, 0, "nothing ran");
}
