//! GPU tests: the CUDA backend against the CPU backend (the reference).
//! They need a CUDA device and are run by `.ci/gpu-run.sh` on the GPU
//! machine (`cargo test -- --ignored` there); CI has no GPU.
#![cfg(feature = "cuda")]

mod common;

use common::{scaled, Rng};
use kvswap::backend::cuda::driver::{self, CtxGuard, Device, DeviceBuffer, Graph, OwnedStream};
use kvswap::{BackendChoice, Config, Context, KvswapLayerSpec};

fn spec(cap: u32, chunk: u32) -> KvswapLayerSpec {
    KvswapLayerSpec { compressed_cap: cap as u64, chunk_bytes: chunk as u64, staging: std::ptr::null_mut(), staging_stride: 0 }
}

/// Device 0 bound to this thread and N streams on it. Bind the result as
/// `let (_dev, _g, [s]) = gpu0();`: locals drop in reverse order, so the
/// streams are destroyed before the context is unbound and released.
fn gpu0<const N: usize>() -> (Device, CtxGuard, [OwnedStream; N]) {
    let dev = Device::open(0).unwrap();
    let g = dev.bind().unwrap();
    let streams = std::array::from_fn(|_| OwnedStream::new().unwrap());
    (dev, g, streams)
}

/// One device buffer of `n` i32 indices per layer (the swap-ins' index buffers).
fn index_buffers(layers: usize, n: usize) -> Vec<DeviceBuffer> {
    (0..layers).map(|_| DeviceBuffer::alloc(4 * n, "idx").unwrap()).collect()
}

fn config(backend: BackendChoice, slots: u32, sync: bool) -> Config {
    Config { enable: true, gpu_chunks: slots, index_topk: slots, backend, sync, ..Config::default() }
}

/// A random selection: mostly drawn from a drifting "hot" range, some
/// uniform, some padding and duplicates.
fn selection(rng: &mut Rng, cap: u32, count: usize, hot: u32) -> Vec<i32> {
    (0..count)
        .map(|_| match rng.below(20) {
            0 => -1,
            1..=4 => rng.below(cap as u64) as i32,
            _ => ((hot + rng.below(cap as u64 / 4 + 1) as u32) % cap) as i32,
        })
        .collect()
}

/// A CPU and a CUDA context of `specs` (gpu_chunks `slots`), with chunks
/// `0 .. stored(l)` of every layer l stored in both (random bytes).
fn twins(rng: &mut Rng, specs: &[KvswapLayerSpec], slots: u32, sync: bool, stored: impl Fn(usize) -> u32) -> (Context, Context) {
    let cpu = Context::new(config(BackendChoice::Cpu, slots, sync), specs).unwrap();
    let gpu = Context::new(config(BackendChoice::Cuda, slots, sync), specs).unwrap();
    for (l, sp) in specs.iter().enumerate() {
        let ids: Vec<i32> = (0..stored(l) as i32).collect();
        let mut rows = vec![0u8; ids.len() * sp.chunk_bytes as usize];
        rng.fill(&mut rows);
        cpu.store_rows(l, &ids, &rows).unwrap();
        gpu.store_rows(l, &ids, &rows).unwrap();
    }
    (cpu, gpu)
}

/// 10,000 random steps (stores, swap-ins, and now and then
/// `kvswap_layer_forget` of a random range or of every chunk): the CUDA
/// slots and staged bytes equal the CPU
/// backend's, in both the synchronous and the asynchronous mode (indices,
/// errors and the staged bytes of the selected slots every swap-in, the
/// statistics of the step's layer every step, its residency every 10th
/// step, and every layer's residency and statistics at the end).
fn random_steps_match_cpu(sync: bool) {
    let mut rng = Rng::fresh(if sync { "gpu random sync" } else { "gpu random async" });
    let (slots, window) = (64u32, 5u32);
    let caps = [1000u32, 3000, 48, 700, 500]; // the third one is fully resident
    // The copy kernels' word sizes: 16 bytes (2048, 64), 8 (520), 4 (300)
    // and 1 (2061: odd, and past one 2,048-byte piece).
    let chunks = [2048u32, 520, 64, 300, 2061];
    let specs: Vec<_> = caps.iter().zip(chunks).map(|(&c, b)| spec(c, b)).collect();
    let cpu = Context::new(config(BackendChoice::Cpu, slots, sync), &specs).unwrap();
    let gpu = Context::new(config(BackendChoice::Cuda, slots, sync), &specs).unwrap();
    let (_dev, _g, [stream]) = gpu0();
    let mut hot = 0u32;
    for step in 0..scaled(10_000) {
        let layer = rng.below(caps.len() as u64) as usize;
        let (cap, chunk) = (caps[layer], chunks[layer] as usize);
        if rng.below(40) == 0 {
            // Forget a random range (every 8th time every chunk) on the
            // engine's stream; the host helpers after it wait for it.
            let (first, n) = if rng.below(8) == 0 {
                (0, cap)
            } else {
                let first = rng.below(cap as u64) as u32;
                (first, rng.below((cap - first) as u64 + 1) as u32)
            };
            cpu.forget(layer, first as i32, n, 0).unwrap();
            gpu.forget(layer, first as i32, n, stream.0 as u64).unwrap();
            // Mostly stored again at once (new bytes), so that swap-ins go
            // on refilling the emptied slots (strict ones refuse any
            // selection with a forgotten chunk, and change nothing).
            if rng.below(3) != 0 && n > 0 {
                let ids: Vec<i32> = (first as i32..(first + n) as i32).collect();
                let mut rows = vec![0u8; ids.len() * chunk];
                rng.fill(&mut rows);
                cpu.store_rows(layer, &ids, &rows).unwrap();
                gpu.store_rows(layer, &ids, &rows).unwrap();
            }
        } else if rng.below(3) == 0 {
            let n = 1 + rng.below(8) as usize;
            let ids: Vec<i32> = (0..n).map(|_| rng.below(cap as u64) as i32).collect();
            let mut rows = vec![0u8; n * chunk];
            rng.fill(&mut rows);
            cpu.store_rows(layer, &ids, &rows).unwrap();
            gpu.store_rows(layer, &ids, &rows).unwrap();
        } else {
            hot = hot.wrapping_add(rng.below(7) as u32);
            let count = rng.below(slots as u64 + 1) as usize;
            let mut a: Vec<i32> = (0..window as i32).map(|i| 1000 + i).collect();
            a.extend(selection(&mut rng, cap, count, hot));
            if rng.below(50) == 0 && count > 0 {
                let pos = window as usize + rng.below(count as u64) as usize;
                a[pos] = cap as i32 + 3; // out of range
            }
            let mut b = a.clone();
            let (ra, rb) = (cpu.swap_in(layer, &mut a, window), gpu.swap_in(layer, &mut b, window));
            let (ra, rb) = if sync { (ra, rb) } else { (ra.and(cpu.sync()), rb.and(gpu.sync())) };
            let refused = match (&ra, &rb) {
                (Ok(()), Ok(())) => false,
                (Err(x), Err(y)) => {
                    assert_eq!((x.status, &x.message), (y.status, &y.message), "step {step}");
                    sync // a refused synchronous call leaves the logical ids
                }
                _ => panic!("step {step}: cpu {ra:?} vs cuda {rb:?}"),
            };
            assert_eq!(a, b, "step {step} layer {layer}: indices");
            for &p in a[window as usize..].iter().filter(|&&p| p >= 0 && !refused) {
                let slot = (p - window as i32) as u32;
                assert_eq!(cpu.slot_bytes(layer, slot).unwrap(), gpu.slot_bytes(layer, slot).unwrap(), "step {step} slot {slot}");
            }
        }
        assert_eq!(cpu.stats(layer).unwrap(), gpu.stats(layer).unwrap(), "step {step}: stats");
        if step % 10 == 0 {
            assert_eq!(cpu.residency(layer).unwrap(), gpu.residency(layer).unwrap(), "step {step}: residency");
        }
    }
    for layer in 0..caps.len() {
        assert_eq!(cpu.residency(layer).unwrap(), gpu.residency(layer).unwrap(), "layer {layer}: final residency");
        assert_eq!(cpu.stats(layer).unwrap(), gpu.stats(layer).unwrap(), "layer {layer}: final stats");
    }
}

#[test]
#[ignore = "needs a CUDA device: run .ci/gpu-run.sh on the GPU machine"]
fn cuda_matches_cpu_sync() {
    random_steps_match_cpu(true);
}

#[test]
#[ignore = "needs a CUDA device: run .ci/gpu-run.sh on the GPU machine"]
fn cuda_matches_cpu_async() {
    random_steps_match_cpu(false);
}

/// A decode step over 21 layers (store the new chunk, swap in the global
/// top-k) captured once in a CUDA graph and replayed 1,000 times with new
/// selections written into the captured index buffer; equal to the CPU
/// backend at every step (index buffers and statistics; the staged bytes of
/// every selected slot of one layer every 10th step, of all layers every
/// 100th).
#[test]
#[ignore = "needs a CUDA device: run .ci/gpu-run.sh on the GPU machine"]
fn graph_replay_21_layers_matches_cpu() {
    let mut rng = Rng::fresh("gpu graph");
    let (layers, cap, chunk, slots, window) = (21usize, 4096u32, 2048usize, 512u32, 128u32);
    let specs: Vec<_> = (0..layers).map(|_| spec(cap, chunk as u32)).collect();
    // Every chunk of every layer stored on both.
    let (cpu, gpu) = twins(&mut rng, &specs, slots, false, |_| cap);
    let (_dev, _g, [stream]) = gpu0();
    let s = stream.0;
    let n_idx = (window + slots) as usize;
    // Per layer: an index buffer (captured) and a source chunk (captured).
    let idx = index_buffers(layers, n_idx);
    let src: Vec<DeviceBuffer> = (0..layers).map(|_| DeviceBuffer::alloc(chunk, "src").unwrap()).collect();
    let new_id = |l: usize| (cap - 1 - l as u32) as i32;
    // Capture one step.
    let graph = Graph::capture(s, || {
        // kvswap_sync on the stream being captured is refused (its wait would
        // end the capture), and the capture goes on.
        let e = gpu.sync_stream(s as u64).expect_err("a sync on a capturing stream must be refused");
        assert_eq!(e.status, kvswap::KvswapStatus::InvalidArgument, "{e}");
        (0..layers).try_for_each(|l| unsafe {
            gpu.store_raw(l, &[new_id(l)], src[l].ptr, 0, s as u64)?;
            gpu.swap_in_raw(l, idx[l].ptr, window, slots, s as u64)
        })
    })
    .unwrap();
    let mut hot = 0u32;
    let mut prev: Vec<i32> = Vec::new();
    for step in 0..scaled(1000) {
        // New selection: ~90% of the previous one kept, the rest drifting.
        hot = (hot + 3) % cap;
        let mut sel: Vec<i32> = Vec::with_capacity(slots as usize);
        let mut seen = std::collections::HashSet::new();
        for &p in &prev {
            if rng.below(10) != 0 && seen.insert(p) {
                sel.push(p);
            }
        }
        while sel.len() < slots as usize {
            let id = ((hot + rng.below(2 * slots as u64) as u32) % cap) as i32;
            if seen.insert(id) {
                sel.push(id);
            }
        }
        prev = sel.clone();
        let mut host_idx = vec![-9i32; window as usize];
        host_idx.extend(&sel);
        let mut new_chunk = vec![0u8; chunk];
        let mut expect = Vec::with_capacity(layers);
        for l in 0..layers {
            rng.fill(&mut new_chunk);
            cpu.store(l, new_id(l), &new_chunk).unwrap();
            let mut e = host_idx.clone();
            cpu.swap_in(l, &mut e, window).unwrap();
            expect.push(e);
            unsafe {
                driver::copy_htod_async(src[l].ptr, new_chunk.as_ptr(), chunk, s).unwrap();
                driver::copy_htod_async(idx[l].ptr, host_idx.as_ptr() as *const u8, 4 * n_idx, s).unwrap();
            }
            stream.sync().unwrap(); // the host buffers are reused next layer
        }
        graph.launch(s).unwrap();
        stream.sync().unwrap();
        gpu.sync_stream(s as u64).unwrap();
        for l in 0..layers {
            let mut got = vec![0i32; n_idx];
            unsafe { driver::copy_dtoh_async(got.as_mut_ptr() as *mut u8, idx[l].ptr, 4 * n_idx, s).unwrap() };
            stream.sync().unwrap();
            assert_eq!(got, expect[l], "step {step} layer {l}: physical ids");
            assert_eq!(cpu.stats(l).unwrap(), gpu.stats(l).unwrap(), "step {step} layer {l}: stats");
            // The staged bytes of every selected slot: one layer in turn every
            // 10th step, every layer every 100th (each slot is a read-back).
            if (step % 10 == 0 && l == (step / 10) % layers) || step % 100 == 0 {
                for &p in &got[window as usize..] {
                    let slot = (p - window as i32) as u32;
                    assert_eq!(cpu.slot_bytes(l, slot).unwrap(), gpu.slot_bytes(l, slot).unwrap(), "step {step} layer {l} slot {slot}");
                }
            }
        }
    }
    for l in 0..layers {
        assert_eq!(cpu.stats(l).unwrap(), gpu.stats(l).unwrap(), "layer {l}: stats after replays");
    }
}

/// `kvswap_layer_forget` captured in a CUDA graph (a swapping layer and a
/// fully resident one), launched between eager stores, swap-ins and
/// forgets: every launch forgets again, and the slots, staged bytes,
/// counters and deferred errors equal the CPU backend's doing the same
/// calls in the same order. Two shapes: 32 slots, and 2,000 slots over
/// 70,001 chunks (the forget kernel's block of 1,024 threads with two slots
/// each, and a grid of several blocks for the stored bits).
fn forget_in_a_graph(slots: u32, caps: [u32; 2], forgets: [(usize, i32, u32); 3], steps: usize) {
    let mut rng = Rng::fresh("gpu forget graph");
    let window = 3u32;
    let chunk = 264usize;
    let specs: Vec<_> = caps.iter().map(|&c| spec(c, chunk as u32)).collect();
    let (cpu, gpu) = twins(&mut rng, &specs, slots, false, |l| caps[l]);
    let (_dev, _g, [stream]) = gpu0();
    let s = stream.0 as u64;
    let graph = Graph::capture(stream.0, || forgets.iter().try_for_each(|&(l, f, n)| gpu.forget(l, f, n, s))).unwrap();
    let mut launches = 0;
    for step in 0..steps {
        let layer = rng.below(2) as usize;
        let cap = caps[layer];
        // At least one launch however few steps KVSWAP_TEST_SCALE leaves.
        match if step == steps / 2 { 0 } else { rng.below(10) } {
            0 => {
                graph.launch(stream.0).unwrap();
                launches += 1;
                for &(l, f, n) in &forgets {
                    cpu.forget(l, f, n, 0).unwrap();
                }
            }
            1 => {
                let first = rng.below(cap as u64) as u32;
                let n = rng.below((cap - first) as u64 + 1) as u32;
                cpu.forget(layer, first as i32, n, 0).unwrap();
                gpu.forget(layer, first as i32, n, s).unwrap();
            }
            2..=4 => {
                let ids: Vec<i32> = (0..1 + rng.below(slots as u64 + 8)).map(|_| rng.below(cap as u64) as i32).collect();
                let mut rows = vec![0u8; ids.len() * chunk];
                rng.fill(&mut rows);
                cpu.store_rows(layer, &ids, &rows).unwrap();
                gpu.store_rows(layer, &ids, &rows).unwrap();
            }
            _ => {
                let count = rng.below(slots.min(cap) as u64 + 1) as usize;
                let mut a: Vec<i32> = (0..window as i32).collect();
                let hot = rng.below(cap as u64) as u32;
                a.extend(selection(&mut rng, cap, count, hot));
                let mut b = a.clone();
                // A graph launch is waited for on its stream before the
                // host helper's swap-in (which runs on kvswap's own stream).
                stream.sync().unwrap();
                let ra = cpu.swap_in(layer, &mut a, window).and(cpu.sync());
                let rb = gpu.swap_in(layer, &mut b, window).and(gpu.sync());
                match (&ra, &rb) {
                    (Ok(()), Ok(())) => {}
                    (Err(x), Err(y)) => assert_eq!((x.status, &x.message), (y.status, &y.message), "step {step}"),
                    _ => panic!("step {step}: cpu {ra:?} vs cuda {rb:?}"),
                }
                assert_eq!(a, b, "step {step} layer {layer}: indices");
                // The staged bytes of up to 32 selected slots (each a read-back).
                for &p in a[window as usize..].iter().filter(|&&p| p >= 0).take(32) {
                    let slot = (p - window as i32) as u32;
                    assert_eq!(cpu.slot_bytes(layer, slot).unwrap(), gpu.slot_bytes(layer, slot).unwrap(), "step {step} slot {slot}");
                }
            }
        }
        stream.sync().unwrap();
        assert_eq!(cpu.residency(layer).unwrap(), gpu.residency(layer).unwrap(), "step {step} layer {layer}: residency");
        assert_eq!(cpu.stats(layer).unwrap(), gpu.stats(layer).unwrap(), "step {step} layer {layer}: stats");
    }
    assert!(launches > 0, "the graph was never launched");
}

#[test]
#[ignore = "needs a CUDA device: run .ci/gpu-run.sh on the GPU machine"]
fn forget_in_a_graph_matches_cpu() {
    forget_in_a_graph(32, [700, 20], [(0, 100, 250), (0, 690, 10), (1, 5, 6)], scaled(600));
    forget_in_a_graph(2000, [70_001, 1500], [(0, 31, 40_000), (0, 69_990, 11), (1, 0, 1500)], scaled(150));
}

/// A CUDA context with KVSWAP_VALIDATE on: one layer of 64 chunks of 256
/// random bytes, all stored; returns it and the bytes.
fn validating_context(rng: &mut Rng, slots: u32, sync: bool) -> (Context, Vec<u8>) {
    let (cap, chunk) = (64u32, 256usize);
    let gpu = Context::new(Config { validate: true, ..config(BackendChoice::Cuda, slots, sync) }, &[spec(cap, chunk as u32)]).unwrap();
    let mut rows = vec![0u8; cap as usize * chunk];
    rng.fill(&mut rows);
    let ids: Vec<i32> = (0..cap as i32).collect();
    gpu.store_rows(0, &ids, &rows).unwrap();
    (gpu, rows)
}

/// A swap-in of `sel` (window 0) whose error, with sync = 0, comes from the
/// `sync` after it (the call itself must succeed).
fn swap_reporting(gpu: &Context, sel: &[i32], sync: bool) -> kvswap::Result<Vec<i32>> {
    let mut a = sel.to_vec();
    let r = gpu.swap_in(0, &mut a, 0);
    if sync {
        r.map(|_| a)
    } else {
        r.expect("with sync = 0 the call itself succeeds");
        gpu.sync().map(|_| a)
    }
}

/// Overwrites staged bytes of layer 0 on the device, behind kvswap's back:
/// (slot, byte offset, new value) each.
fn corrupt_staged(gpu: &Context, bytes: &[(u32, usize, u8)]) {
    let view = gpu.staging(0).unwrap();
    let (_dev, _g, [s]) = gpu0();
    for &(slot, at, v) in bytes {
        let b = [v];
        unsafe { driver::copy_htod_async(view.ptr + slot as u64 * view.stride + at as u64, b.as_ptr(), 1, s.0).unwrap() };
        s.sync().unwrap(); // b lives on this iteration's stack
    }
}

/// KVSWAP_VALIDATE on CUDA: a staged slot overwritten behind kvswap's back
/// (the chunk stays resident, so the next swap-in is a hit and copies
/// nothing) is reported as VALIDATION_FAILED naming the chunk: by the call
/// itself with sync = 1, by `sync` with sync = 0 (the call returns OK). The
/// error is reported once; swap-ins of intact slots report nothing.
fn validate_reports_a_corrupted_slot(sync: bool) {
    let mut rng = Rng::fresh(if sync { "gpu validate sync" } else { "gpu validate async" });
    let chunk = 256usize;
    let (gpu, rows) = validating_context(&mut rng, 8, sync);
    let victim = 5 + rng.below(50) as i32;
    let swap = |sel: &[i32]| swap_reporting(&gpu, sel, sync);
    let staged = swap(&[3, victim, 60]).unwrap();
    let slot = staged[1] as u32;
    assert_eq!(gpu.slot_bytes(0, slot).unwrap(), rows[victim as usize * chunk..][..chunk], "the victim's slot holds its bytes");
    // Overwrite one byte of the victim's slot on the device.
    corrupt_staged(&gpu, &[(slot, 77, rows[victim as usize * chunk + 77] ^ 0x40)]);
    let e = swap(&[3, victim, 60]).unwrap_err();
    assert_eq!(e.status, kvswap::KvswapStatus::ValidationFailed, "{e}");
    assert!(e.message.contains(&format!("chunk {victim} (position 1)")), "{e}");
    gpu.sync().unwrap(); // reported once
    assert_eq!(swap(&[3, 60]).unwrap(), staged.iter().copied().filter(|&p| p != slot as i32).collect::<Vec<_>>(), "intact slots: no error, same slots");
}

/// Several corrupted slots: the error names the lowest position, as the CPU
/// backend does (each position is checked by its own warp, in any order).
fn validate_names_the_lowest_mismatch(sync: bool) {
    let mut rng = Rng::fresh(if sync { "gpu validate lowest sync" } else { "gpu validate lowest async" });
    let (cap, chunk) = (64u32, 256usize);
    let (gpu, rows) = validating_context(&mut rng, 16, sync);
    let mut sel: Vec<i32> = Vec::new();
    while sel.len() < 12 {
        let id = rng.below(cap as u64) as i32;
        if !sel.contains(&id) {
            sel.push(id);
        }
    }
    let swap = |sel: &[i32]| swap_reporting(&gpu, sel, sync);
    let staged = swap(&sel).unwrap();
    // Corrupt the slots of positions first .. 12 (first drawn from 1 .. 8).
    let first = 1 + rng.below(8) as usize;
    let flips: Vec<(u32, usize, u8)> = (first..sel.len())
        .map(|p| {
            let at = rng.below(chunk as u64) as usize;
            (staged[p] as u32, at, rows[sel[p] as usize * chunk + at] ^ 0x01)
        })
        .collect();
    corrupt_staged(&gpu, &flips);
    for round in 0..3 {
        let e = swap(&sel).unwrap_err();
        assert_eq!(e.status, kvswap::KvswapStatus::ValidationFailed, "{e}");
        assert!(e.message.contains(&format!("chunk {} (position {first})", sel[first])), "round {round}: the lowest mismatch is position {first}: {e}");
        gpu.sync().unwrap(); // reported once
    }
    assert_eq!(swap(&sel[..first]).unwrap(), staged[..first].to_vec(), "the intact slots before it: no error");
}

#[test]
#[ignore = "needs a CUDA device: run .ci/gpu-run.sh on the GPU machine"]
fn cuda_validate_names_the_lowest_mismatch_sync() {
    validate_names_the_lowest_mismatch(true);
}

#[test]
#[ignore = "needs a CUDA device: run .ci/gpu-run.sh on the GPU machine"]
fn cuda_validate_names_the_lowest_mismatch_async() {
    validate_names_the_lowest_mismatch(false);
}

#[test]
#[ignore = "needs a CUDA device: run .ci/gpu-run.sh on the GPU machine"]
fn cuda_validate_reports_a_corrupted_slot_sync() {
    validate_reports_a_corrupted_slot(true);
}

#[test]
#[ignore = "needs a CUDA device: run .ci/gpu-run.sh on the GPU machine"]
fn cuda_validate_reports_a_corrupted_slot_async() {
    validate_reports_a_corrupted_slot(false);
}

/// Explicit CUDA with a bad device ordinal is NO_DEVICE, never a crash.
#[test]
#[ignore = "needs a CUDA device: run .ci/gpu-run.sh on the GPU machine"]
fn bad_device_ordinal_is_no_device() {
    let cfg = Config { device: 999, ..config(BackendChoice::Cuda, 512, true) };
    let e = Context::new(cfg, &[spec(1024, 2048)]).err().expect("device 999 must be refused");
    assert_eq!(e.status, kvswap::KvswapStatus::NoDevice, "{e}");
    // The auto backend too: GPUs are present, so a missing ordinal is a
    // configuration error, not a fall back to the CPU (whose context would
    // read device pointers as host memory).
    let cfg = Config { device: 999, ..config(BackendChoice::Auto, 512, true) };
    let e = Context::new(cfg, &[spec(1024, 2048)]).err().expect("auto with device 999 must be refused");
    assert_eq!(e.status, kvswap::KvswapStatus::NoDevice, "{e}");
}

/// A swap-in whose gather kernel cannot be launched after the residency
/// kernel ran: one refused attempt is retried as a plain launch (the bytes
/// arrive, equal to the CPU backend's); two leave the layer refusing every
/// later swap-in and sync with DEVICE_ERROR (its slots are mapped to chunks
/// never copied), while the other layers go on. The faults are injected
/// through a test hook (`fail_gather_launches`); tests run one at a time.
#[test]
#[ignore = "needs a CUDA device: run .ci/gpu-run.sh on the GPU machine"]
fn gather_launch_failure_is_retried_then_breaks_the_layer() {
    kvswap::backend::cuda::fail_gather_launches(0);
    let mut rng = Rng::fresh("gpu gather launch failure");
    let specs = [spec(64, 512), spec(64, 512)];
    let cpu = Context::new(config(BackendChoice::Cpu, 16, true), &specs).unwrap();
    let gpu = Context::new(config(BackendChoice::Cuda, 16, true), &specs).unwrap();
    let ids: Vec<i32> = (0..32).collect();
    let mut rows = vec![0u8; 32 * 512];
    rng.fill(&mut rows);
    for layer in 0..2 {
        cpu.store_rows(layer, &ids, &rows).unwrap();
        gpu.store_rows(layer, &ids, &rows).unwrap();
    }
    let check = |layer: usize, sel: &[i32]| {
        let (mut a, mut b) = (sel.to_vec(), sel.to_vec());
        cpu.swap_in(layer, &mut a, 0).unwrap();
        gpu.swap_in(layer, &mut b, 0).unwrap();
        assert_eq!(a, b, "layer {layer}: indices");
        for &p in &a {
            assert_eq!(cpu.slot_bytes(layer, p as u32).unwrap(), gpu.slot_bytes(layer, p as u32).unwrap(), "layer {layer} slot {p}");
        }
    };
    check(0, &[0, 1, 2, 3]);
    // One refused attempt: the retry copies the misses.
    kvswap::backend::cuda::fail_gather_launches(1);
    check(0, &[4, 5, 6, 7]);
    // Both attempts refused: this call and every later swap-in fail.
    kvswap::backend::cuda::fail_gather_launches(2);
    let mut sel = vec![8, 9, 10, 11];
    let e = gpu.swap_in(0, &mut sel, 0).unwrap_err();
    assert_eq!(e.status, kvswap::KvswapStatus::DeviceError, "{e}");
    assert!(e.message.contains("layer 0") && e.message.contains("never copied"), "{e}");
    let mut sel = vec![0, 1];
    let e = gpu.swap_in(0, &mut sel, 0).unwrap_err();
    assert!(e.message.contains("never copied"), "a later swap-in: {e}");
    assert_eq!(sel, vec![0, 1], "a refused call leaves the indices");
    assert!(gpu.sync().unwrap_err().message.contains("never copied"), "sync reports it");
    // Layer 1 is untouched by layer 0's failure.
    check(1, &[8, 9, 10, 11]);

    // The same on the engine's stream with KVSWAP_SYNC=0 (indices in device
    // memory, nothing waited for): the failing call returns the error, the
    // residency kernel it queued is waited for by the next sync, and the
    // layer stays refused.
    let gpu = Context::new(config(BackendChoice::Cuda, 16, false), &specs[..1]).unwrap();
    gpu.store_rows(0, &ids, &rows).unwrap();
    let (_dev, _g, [stream]) = gpu0();
    let idx = DeviceBuffer::alloc(16, "idx").unwrap();
    let upload = |sel: &[i32; 4]| unsafe {
        driver::copy_htod_async(idx.ptr, sel.as_ptr() as *const u8, 16, stream.0).unwrap();
        stream.sync().unwrap();
    };
    upload(&[0, 1, 2, 3]);
    unsafe { gpu.swap_in_raw(0, idx.ptr, 0, 4, stream.0 as u64) }.unwrap();
    gpu.sync_stream(stream.0 as u64).unwrap();
    kvswap::backend::cuda::fail_gather_launches(2);
    upload(&[4, 5, 6, 7]);
    let e = unsafe { gpu.swap_in_raw(0, idx.ptr, 0, 4, stream.0 as u64) }.unwrap_err();
    assert_eq!(e.status, kvswap::KvswapStatus::DeviceError, "{e}");
    assert!(e.message.contains("never copied"), "{e}");
    assert!(gpu.sync_stream(stream.0 as u64).unwrap_err().message.contains("never copied"), "sync reports it");
    upload(&[0, 1, 2, 3]);
    let e = unsafe { gpu.swap_in_raw(0, idx.ptr, 0, 4, stream.0 as u64) }.unwrap_err();
    assert!(e.message.contains("never copied"), "a later swap-in on the stream: {e}");
    assert!(e.message.contains("kvswap_layer_forget"), "the error names the way out: {e}");

    // Forgetting a part of the chunks leaves the layer refused; forgetting
    // all of them empties every slot, and the layer works again as a new
    // one: the chunks stored again fill slots 0, 1, 2, 3 with their bytes.
    gpu.forget(0, 0, 32, stream.0 as u64).unwrap();
    let e = unsafe { gpu.swap_in_raw(0, idx.ptr, 0, 4, stream.0 as u64) }.unwrap_err();
    assert!(e.message.contains("never copied"), "after forgetting half the chunks: {e}");
    gpu.forget(0, 0, 64, stream.0 as u64).unwrap();
    upload(&[0, 1, 2, 3]);
    unsafe { gpu.swap_in_raw(0, idx.ptr, 0, 4, stream.0 as u64) }.unwrap();
    let e = gpu.sync_stream(stream.0 as u64).unwrap_err();
    assert_eq!(e.status, kvswap::KvswapStatus::NotStored, "forgotten chunks are not stored: {e}");
    gpu.store_rows(0, &ids, &rows).unwrap();
    upload(&[9, 3, 17, 3]);
    unsafe { gpu.swap_in_raw(0, idx.ptr, 0, 4, stream.0 as u64) }.unwrap();
    gpu.sync_stream(stream.0 as u64).unwrap();
    let mut got = [0i32; 4];
    unsafe { driver::copy_dtoh_async(got.as_mut_ptr() as *mut u8, idx.ptr, 16, stream.0).unwrap() };
    stream.sync().unwrap();
    assert_eq!(got, [0, 1, 2, 1], "a forgotten layer fills its slots in order");
    for (slot, id) in [(0u32, 9usize), (1, 3), (2, 17)] {
        assert_eq!(gpu.slot_bytes(0, slot).unwrap(), rows[id * 512..(id + 1) * 512], "slot {slot}");
    }
}

/// `auto` on a machine with a GPU where the CUDA backend cannot start (here:
/// NVRTC cannot be loaded) is an error, not a CPU context (which would read
/// the engine's device pointers as host memory); an explicit `cpu` still
/// works. The test runs itself again as a child process whose
/// LD_LIBRARY_PATH starts with a folder of files that are not libraries,
/// one under every name cudarc tries for NVRTC (the loader stops at the
/// first file of a name, so the real NVRTC is never reached).
#[test]
#[ignore = "needs a CUDA device: run .ci/gpu-run.sh on the GPU machine"]
fn auto_with_a_gpu_but_no_nvrtc_is_refused() {
    const CHILD: &str = "KVSWAP_TEST_AUTO_NO_NVRTC_CHILD";
    if std::env::var_os(CHILD).is_some() {
        assert!(!kvswap::backend::cuda::nvrtc::available(), "the child still loads NVRTC");
        let e = Context::new(config(BackendChoice::Auto, 512, true), &[spec(1024, 2048)]).err().expect("auto must be refused");
        assert_eq!(e.status, kvswap::KvswapStatus::NoDevice, "{e}");
        assert!(e.message.contains("NVRTC not found") && e.message.contains("KVSWAP_BACKEND=auto"), "{e}");
        let e = Context::new(config(BackendChoice::Cuda, 512, true), &[spec(1024, 2048)]).err().expect("cuda must be refused");
        assert_eq!(e.status, kvswap::KvswapStatus::NoDevice, "{e}");
        Context::new(config(BackendChoice::Cpu, 512, true), &[spec(1024, 2048)]).expect("the CPU backend needs no NVRTC");
        return;
    }
    let fake = std::env::temp_dir().join(format!("kvswap-no-nvrtc-{}", std::process::id()));
    std::fs::create_dir_all(&fake).unwrap();
    for name in cudarc::get_lib_name_candidates("nvrtc") {
        std::fs::write(fake.join(name), b"not a library").unwrap();
    }
    let path = match std::env::var("LD_LIBRARY_PATH") {
        Ok(p) if !p.is_empty() => format!("{}:{p}", fake.display()),
        _ => fake.display().to_string(),
    };
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "auto_with_a_gpu_but_no_nvrtc_is_refused", "--test-threads=1", "--nocapture"])
        .env(CHILD, "1")
        .env("LD_LIBRARY_PATH", path)
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&fake);
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && text.contains("1 passed"), "the child failed:\n{text}");
}

/// A stream of another CUDA context is refused with WRONG_DEVICE and changes
/// nothing (on one GPU, a second context on the same device stands in for
/// another device; `multi_gpu_pointers_of_another_device_are_refused` covers
/// real devices).
#[test]
#[ignore = "needs a CUDA device: run .ci/gpu-run.sh on the GPU machine"]
fn stream_of_another_context_is_wrong_device() {
    use cudarc::driver::sys;
    let gpu = Context::new(config(BackendChoice::Cuda, 16, true), &[spec(64, 256)]).unwrap();
    let dev = Device::open(0).unwrap();
    let (mut other, mut stream): (sys::CUcontext, sys::CUstream) = (std::ptr::null_mut(), std::ptr::null_mut());
    unsafe {
        driver::check(sys::cuCtxCreate_v4(&mut other, std::ptr::null_mut(), 0, dev.dev), "cuCtxCreate").unwrap();
        driver::check(sys::cuStreamCreate(&mut stream, 1), "cuStreamCreate").unwrap();
        let mut popped = std::ptr::null_mut();
        driver::check(sys::cuCtxPopCurrent_v2(&mut popped), "pop").unwrap();
    }
    let _g = dev.bind().unwrap();
    let src = DeviceBuffer::alloc(256, "src").unwrap();
    let idx = DeviceBuffer::alloc(64, "idx").unwrap();
    let e = unsafe { gpu.store_raw(0, &[1], src.ptr, 0, stream as u64) }.unwrap_err();
    assert_eq!(e.status, kvswap::KvswapStatus::WrongDevice, "{e}");
    let e = unsafe { gpu.swap_in_raw(0, idx.ptr, 0, 4, stream as u64) }.unwrap_err();
    assert_eq!(e.status, kvswap::KvswapStatus::WrongDevice, "{e}");
    assert_eq!(gpu.stats(0).unwrap().stores, 0, "nothing changed");
    // A host pointer is not device memory.
    let host = vec![0u8; 256];
    let s = OwnedStream::new().unwrap();
    let e = unsafe { gpu.store_raw(0, &[1], host.as_ptr() as u64, 0, s.0 as u64) }.unwrap_err();
    assert_eq!(e.status, kvswap::KvswapStatus::InvalidArgument, "{e}");
    unsafe {
        sys::cuStreamDestroy_v2(stream);
        sys::cuCtxDestroy_v2(other);
    }
}

/// With two or more GPUs: a device pointer and a stream of device 1 passed to
/// a context of device 0 are refused with WRONG_DEVICE.
#[test]
#[ignore = "needs two CUDA devices: run .ci/gpu-run.sh on a multi-GPU machine"]
fn multi_gpu_pointers_of_another_device_are_refused() {
    let n = driver::device_count().unwrap();
    assert!(n >= 2, "this test needs 2 GPUs, found {n}");
    let ctx0 = Context::new(config(BackendChoice::Cuda, 16, true), &[spec(64, 256)]).unwrap();
    let dev1 = Device::open(1).unwrap();
    let _g = dev1.bind().unwrap();
    let src1 = DeviceBuffer::alloc(256, "src on device 1").unwrap();
    let s1 = OwnedStream::new().unwrap();
    let e = unsafe { ctx0.store_raw(0, &[1], src1.ptr, 0, s1.0 as u64) }.unwrap_err();
    assert_eq!(e.status, kvswap::KvswapStatus::WrongDevice, "{e}");
    drop(_g);
    let dev0 = Device::open(0).unwrap();
    let _g0 = dev0.bind().unwrap();
    let s0 = OwnedStream::new().unwrap();
    let e = unsafe { ctx0.store_raw(0, &[1], src1.ptr, 0, s0.0 as u64) }.unwrap_err();
    assert_eq!(e.status, kvswap::KvswapStatus::WrongDevice, "pointer of device 1: {e}");
    assert!(e.message.contains("device 1"), "{e}");
}

/// Holds back a stream's later work until `open`: `cuStreamWaitValue32` on
/// a pinned, device-mapped word the host writes.
struct Gate {
    flag: driver::PinnedBuffer,
}

impl Gate {
    fn new() -> Gate {
        let flag = driver::PinnedBuffer::alloc(64).unwrap();
        // SAFETY: 64 bytes of pinned host memory.
        unsafe { std::ptr::write_volatile(flag.host as *mut u32, 0) };
        Gate { flag }
    }
    /// Work queued on `s` after this waits until `open(v)`.
    fn close(&self, s: &OwnedStream, v: u32) {
        use cudarc::driver::sys;
        let geq = sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32;
        // SAFETY: flag.dev is the device address of a live pinned word.
        driver::check(unsafe { sys::cuStreamWaitValue32_v2(s.0, self.flag.dev, v, geq) }, "cuStreamWaitValue32").unwrap();
    }
    fn open(&self, v: u32) {
        // SAFETY: as in new.
        unsafe { std::ptr::write_volatile(self.flag.host as *mut u32, v) };
    }
}

/// Whether `s` still has work queued, after giving it 50 ms.
fn still_waiting(s: &OwnedStream) -> bool {
    std::thread::sleep(std::time::Duration::from_millis(50));
    // SAFETY: live stream.
    let r = unsafe { cudarc::driver::sys::cuStreamQuery(s.0) };
    r == cudarc::driver::sys::CUresult::CUDA_ERROR_NOT_READY
}


/// A layer's calls on two streams, eager and captured, are ordered on the
/// device; a gate holds stream A's eager work back, so the order is
/// observed, not assumed:
/// 1. an eager call on B after a capture on B waits for an eager call on A
///    made before the capture (the capture does not count as B's last call);
/// 2. a graph captured on the stream of the last eager call still waits, at
///    each launch, for eager calls on A issued before that launch.
///
/// Every index and staged chunk equals the CPU backend's, which runs the
/// calls in that order.
#[test]
#[ignore = "needs a CUDA device: run .ci/gpu-run.sh on the GPU machine"]
fn eager_and_captured_calls_on_two_streams_are_ordered() {
    let mut rng = Rng::fresh("gpu two streams");
    let (cap, chunk, slots, window) = (256u32, 2048usize, 32u32, 4u32);
    let specs = [spec(cap, chunk as u32)];
    let cpu = Context::new(config(BackendChoice::Cpu, slots, false), &specs).unwrap();
    let gpu = Context::new(config(BackendChoice::Cuda, slots, false), &specs).unwrap();
    let mut rows = vec![0u8; cap as usize * chunk];
    rng.fill(&mut rows);
    let ids: Vec<i32> = (0..cap as i32).collect();
    cpu.store_rows(0, &ids, &rows).unwrap();
    gpu.store_rows(0, &ids, &rows).unwrap();
    let (_dev, _g, [a, b]) = gpu0();
    let gate = Gate::new();
    let n_idx = (window + slots) as usize;
    // Index buffers (host selection, device copy) and new chunks (host, device).
    let sel = |rng: &mut Rng| {
        let mut v: Vec<i32> = (0..window as i32).map(|i| -7 - i).collect();
        let hot = rng.below(cap as u64) as u32;
        v.extend(selection(rng, cap, slots as usize, hot));
        let d = DeviceBuffer::alloc(4 * n_idx, "idx").unwrap();
        unsafe { driver::copy_htod_async(d.ptr, v.as_ptr() as *const u8, 4 * n_idx, b.0).unwrap() };
        (v, d)
    };
    let idx: Vec<(Vec<i32>, DeviceBuffer)> = (0..5).map(|_| sel(&mut rng)).collect();
    let new_chunk = |rng: &mut Rng| {
        let mut h = vec![0u8; chunk];
        rng.fill(&mut h);
        let d = DeviceBuffer::alloc(chunk, "src").unwrap();
        unsafe { driver::copy_htod_async(d.ptr, h.as_ptr(), chunk, b.0).unwrap() };
        (h, d)
    };
    let (c3, c5, c7) = (new_chunk(&mut rng), new_chunk(&mut rng), new_chunk(&mut rng));
    b.sync().unwrap();
    let swap = |i: usize, s: &OwnedStream| unsafe { gpu.swap_in_raw(0, idx[i].1.ptr, window, slots, s.0 as u64) };
    let store = |id: i32, c: &(Vec<u8>, DeviceBuffer), s: &OwnedStream| unsafe { gpu.store_raw(0, &[id], c.1.ptr, 0, s.0 as u64) };

    // 1. Warm-up on B; eager store on A, held by the gate; a capture on B;
    //    then an eager swap-in on B must wait for A.
    swap(0, &b).unwrap();
    b.sync().unwrap();
    gate.close(&a, 1);
    store(3, &c3, &a).unwrap();
    let _g1 = Graph::capture(b.0, || swap(1, &b)).unwrap(); // never launched
    swap(2, &b).unwrap();
    let waited_1 = still_waiting(&b);
    gate.open(1);
    a.sync().unwrap();
    b.sync().unwrap();

    // 2. Eager on B, then a capture on B (same stream); an eager store on A
    //    held by the gate; launching the graph on B must wait for it.
    swap(3, &b).unwrap();
    b.sync().unwrap();
    let g2 = Graph::capture(b.0, || store(5, &c5, &b).and_then(|_| swap(4, &b))).unwrap();
    gate.close(&a, 2);
    store(7, &c7, &a).unwrap();
    g2.launch(b.0).unwrap();
    let waited_2 = still_waiting(&b);
    gate.open(2);
    a.sync().unwrap();
    b.sync().unwrap();
    gpu.sync().unwrap();
    assert!(waited_1, "an eager call on B after a capture on B ran before the eager store on A");
    assert!(waited_2, "a graph captured on B ran before an eager store on A issued before its launch");

    // The CPU in the order the device was made to follow (graph 1 never ran).
    let mut expect: Vec<Vec<i32>> = idx.iter().map(|(v, _)| v.clone()).collect();
    cpu.swap_in(0, &mut expect[0], window).unwrap();
    cpu.store(0, 3, &c3.0).unwrap();
    cpu.swap_in(0, &mut expect[2], window).unwrap();
    cpu.swap_in(0, &mut expect[3], window).unwrap();
    cpu.store(0, 7, &c7.0).unwrap();
    cpu.store(0, 5, &c5.0).unwrap();
    cpu.swap_in(0, &mut expect[4], window).unwrap();
    for i in [0, 2, 3, 4] {
        let mut got = vec![0i32; n_idx];
        unsafe { driver::copy_dtoh_async(got.as_mut_ptr() as *mut u8, idx[i].1.ptr, 4 * n_idx, b.0).unwrap() };
        b.sync().unwrap();
        assert_eq!(got, expect[i], "index buffer {i}: physical ids");
    }
    for &p in expect[4][window as usize..].iter().filter(|&&p| p >= 0) {
        let slot = (p - window as i32) as u32;
        assert_eq!(cpu.slot_bytes(0, slot).unwrap(), gpu.slot_bytes(0, slot).unwrap(), "slot {slot}");
    }
    assert_eq!(cpu.stats(0).unwrap(), gpu.stats(0).unwrap(), "stats");
}

/// After a swap-in of layer 0 with `sel` (host copy) in the device index
/// buffer `idx` on `s`: the buffer holds the physical ids the CPU backend
/// gives `sel`, and every selected slot the CPU's bytes.
fn staged_as_on_cpu(cpu: &Context, gpu: &Context, sel: &[i32], idx: u64, window: u32, s: &OwnedStream, what: &str) {
    let mut got = vec![0i32; sel.len()];
    unsafe { driver::copy_dtoh_async(got.as_mut_ptr() as *mut u8, idx, 4 * sel.len(), s.0).unwrap() };
    s.sync().unwrap();
    let mut expect = sel.to_vec();
    cpu.swap_in(0, &mut expect, window).unwrap();
    assert_eq!(got, expect, "{what}: physical ids");
    for &p in expect[window as usize..].iter().filter(|&&p| p >= 0) {
        let slot = (p - window as i32) as u32;
        assert_eq!(cpu.slot_bytes(0, slot).unwrap(), gpu.slot_bytes(0, slot).unwrap(), "{what}: slot {slot}");
    }
}

/// kvswap's waiting calls made while another stream is captured in global
/// mode (an engine's `torch.cuda.graph`, say), by the capturing thread and
/// by another thread: stats (taking and peeking), the layer, stream and
/// context syncs, and a `KVSWAP_SYNC=1` context created, used on another
/// stream (waits) and destroyed (allocations, the pinned tier, a module
/// load, frees). None invalidates the capture (they run in relaxed capture
/// mode; before, the first one failed with CUDA_ERROR_STREAM_CAPTURE_
/// UNSUPPORTED and the engine's capture was lost), and the replay stages
/// what the CPU backend stages.
#[test]
#[ignore = "needs a CUDA device: run .ci/gpu-run.sh on the GPU machine"]
fn waiting_calls_leave_a_global_capture_intact() {
    let mut rng = Rng::fresh("gpu waits beside a capture");
    let (cap, chunk, slots, window) = (300u32, 256usize, 32u32, 2u32);
    let specs = [spec(cap, chunk as u32), spec(cap, chunk as u32)];
    let (cpu, gpu) = twins(&mut rng, &specs, slots, false, |_| cap);
    let (dev, _g, [a, b]) = gpu0();
    let mut sel: Vec<i32> = (0..window as i32).map(|i| -5 - i).collect();
    let hot = rng.below(cap as u64) as u32;
    sel.extend(selection(&mut rng, cap, slots as usize, hot));
    let n_idx = sel.len();
    let idx = DeviceBuffer::alloc(4 * n_idx, "idx").unwrap();
    unsafe { driver::copy_htod_async(idx.ptr, sel.as_ptr() as *const u8, 4 * n_idx, a.0).unwrap() };
    a.sync().unwrap();
    // Every waiting call kvswap has, on layer 1 and stream b (never a).
    let waiting_calls = |who: &str| -> kvswap::Result<()> {
        let _g = dev.bind()?;
        gpu.stats(1)?;
        gpu.stats_peek(1)?;
        gpu.sync_layer(1, b.0 as u64)?;
        gpu.sync_stream(b.0 as u64)?;
        gpu.sync()?;
        let strict = Context::new(config(BackendChoice::Cuda, 8, true), &[spec(16, 64)])?;
        let row = DeviceBuffer::alloc(64, "row")?;
        unsafe { driver::memset_d8_async(row.ptr, 0x5a, 64, b.0)? };
        unsafe { strict.store_raw(0, &[3], row.ptr, 0, b.0 as u64)? };
        let ids = DeviceBuffer::alloc(8, "ids")?;
        let mut host = [3i32, -1];
        unsafe { driver::copy_htod_async(ids.ptr, host.as_ptr() as *const u8, 8, b.0)? };
        unsafe { strict.swap_in_raw(0, ids.ptr, 0, 2, b.0 as u64)? };
        unsafe { driver::copy_dtoh_async(host.as_mut_ptr() as *mut u8, ids.ptr, 8, b.0)? };
        b.sync()?;
        assert_eq!(host, [0, -1], "{who}: the strict context's swap-in");
        assert_eq!(strict.slot_bytes(0, 0)?, vec![0x5a; 64], "{who}: its staged row");
        drop(strict);
        Ok(())
    };
    let graph = Graph::capture_allowing_waits(a.0, || {
        unsafe { gpu.swap_in_raw(0, idx.ptr, window, slots, a.0 as u64)? };
        waiting_calls("capturing thread")?;
        std::thread::scope(|sc| sc.spawn(|| waiting_calls("other thread")).join().unwrap())
    })
    .expect("the capture outlives the waiting calls beside it");
    graph.launch(a.0).unwrap();
    a.sync().unwrap();
    staged_as_on_cpu(&cpu, &gpu, &sel, idx.ptr, window, &a, "the replay");
    gpu.sync().unwrap();
    assert_eq!(cpu.stats(0).unwrap(), gpu.stats(0).unwrap(), "stats");
    // Graph::capture itself refuses a body that waits on the host.
    let e = Graph::capture(b.0, || gpu.stats_peek(1).map(|_| ())).err().expect("a wait inside Graph::capture is an error");
    assert!(e.message.contains("host wait"), "{e}");
}

/// A virtual-memory reservation (`cuMemAddressReserve`) of `pieces` pieces
/// of device 0's allocation granularity, the pieces named in `mapped` each
/// mapped to a physical allocation of its own and made read-write for
/// device 0, as PyTorch's expandable segments and ggml's VMM pool build
/// their buffers; everything is unmapped and released on drop.
struct Reservation {
    va: u64,
    gran: u64,
    pieces: usize,
    mapped: Vec<(u64, u64)>, // (piece address, physical handle)
}

impl Reservation {
    /// `pieces` pieces of address space; the pieces `mapped` mapped read-write
    /// for device 0, the pieces `no_access` mapped with no access set for any
    /// device (no `cuMemSetAccess`), the rest unmapped.
    fn new(pieces: usize, mapped: &[usize], no_access: &[usize]) -> Reservation {
        use cudarc::driver::sys;
        let ok = |r: sys::CUresult, what: &str| assert_eq!(r, sys::CUresult::CUDA_SUCCESS, "{what}");
        // SAFETY (test): plain C structs, every field set or zero.
        let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
        prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = 0;
        let mut gran = 0usize;
        let min = sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM;
        ok(unsafe { sys::cuMemGetAllocationGranularity(&mut gran, &prop, min) }, "granularity");
        assert!(gran >= 64 * 1024, "granularity {gran}");
        let mut va = 0u64;
        ok(unsafe { sys::cuMemAddressReserve(&mut va, pieces * gran, 0, 0, 0) }, "reserve");
        let mut access: sys::CUmemAccessDesc = unsafe { std::mem::zeroed() };
        access.location = prop.location;
        access.flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        let mut r = Reservation { va, gran: gran as u64, pieces, mapped: Vec::new() };
        for (i, open) in mapped.iter().map(|&i| (i, true)).chain(no_access.iter().map(|&i| (i, false))) {
            let (at, mut h) = (r.piece(i), 0u64);
            ok(unsafe { sys::cuMemCreate(&mut h, gran, &prop, 0) }, "create");
            ok(unsafe { sys::cuMemMap(at, gran, 0, h, 0) }, "map");
            r.mapped.push((at, h));
            if open {
                ok(unsafe { sys::cuMemSetAccess(at, gran, &access, 1) }, "access");
            }
        }
        r
    }

    /// The address of piece `i`.
    fn piece(&self, i: usize) -> u64 {
        self.va + i as u64 * self.gran
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        use cudarc::driver::sys;
        for &(at, h) in &self.mapped {
            // SAFETY (test): mapped and created in `new`, released once here.
            unsafe {
                assert_eq!(sys::cuMemUnmap(at, self.gran as usize), sys::CUresult::CUDA_SUCCESS, "unmap");
                assert_eq!(sys::cuMemRelease(h), sys::CUresult::CUDA_SUCCESS, "release");
            }
        }
        assert_eq!(unsafe { sys::cuMemAddressFree(self.va, self.pieces * self.gran as usize) }, sys::CUresult::CUDA_SUCCESS, "free");
    }
}

/// Memory of a virtual-memory allocator (PyTorch's `expandable_segments`,
/// ggml's VMM pool): physical allocations mapped side by side into one
/// reserved range, for which the driver reports each piece as its own
/// allocation. An engine staging buffer and an index buffer across seams
/// are accepted and staged as the CPU backend stages; buffers running into
/// the reserved but unmapped rest are refused (`KVSWAP_STATUS_OUT_OF_RANGE`),
/// and so are buffers in a piece mapped without read-write access for the
/// device (`KVSWAP_STATUS_INVALID_ARGUMENT`).
#[test]
#[ignore = "needs a CUDA device: run .ci/gpu-run.sh on the GPU machine"]
fn buffers_across_mapped_pieces_are_accepted() {
    let mut rng = Rng::fresh("gpu vmm pieces");
    let (cap, chunk, slots, window) = (64u32, 4096usize, 16u32, 2u32);
    let (_dev, _g, [s]) = gpu0();
    // Five pieces of address space, the first three mapped to three physical
    // allocations; the fourth stays unmapped, the fifth is mapped with no
    // access set.
    let r = Reservation::new(5, &[0, 1, 2], &[4]);
    let (seam, seam2) = (r.piece(1), r.piece(2));

    let staging = seam - (slots as u64 / 2) * chunk as u64; // half the rows on each side of the first seam
    let gpu_spec = KvswapLayerSpec { staging: staging as *mut std::ffi::c_void, ..spec(cap, chunk as u32) };
    let cpu = Context::new(config(BackendChoice::Cpu, slots, true), &[spec(cap, chunk as u32)]).unwrap();
    let gpu = Context::new(config(BackendChoice::Cuda, slots, true), &[gpu_spec]).unwrap();
    let ids: Vec<i32> = (0..cap as i32).collect();
    let mut rows = vec![0u8; cap as usize * chunk];
    rng.fill(&mut rows);
    cpu.store_rows(0, &ids, &rows).unwrap();
    gpu.store_rows(0, &ids, &rows).unwrap();
    let mut sel: Vec<i32> = (0..window as i32).map(|i| -3 - i).collect();
    sel.extend(selection(&mut rng, cap, slots as usize, 7));
    let n_idx = sel.len();
    let idx = seam2 - 8; // two entries before the second seam, the rest after it
    unsafe { driver::copy_htod_async(idx, sel.as_ptr() as *const u8, 4 * n_idx, s.0).unwrap() };
    s.sync().unwrap();
    unsafe { gpu.swap_in_raw(0, idx, window, slots, s.0 as u64) }.expect("an index buffer across the seam");
    staged_as_on_cpu(&cpu, &gpu, &sel, idx, window, &s, "across the seams");
    // Into the unmapped fourth piece: refused, nothing staged or counted.
    let before = gpu.stats(0).unwrap();
    let tail = r.piece(3) - 8;
    let e = unsafe { gpu.swap_in_raw(0, tail, window, slots, s.0 as u64) }.unwrap_err();
    assert_eq!(e.status, kvswap::KvswapStatus::OutOfRange, "{e}");
    assert!(e.message.contains("runs past the end"), "{e}");
    assert_eq!(gpu.stats(0).unwrap(), before);
    let far = KvswapLayerSpec { staging: (r.piece(3) - chunk as u64) as *mut std::ffi::c_void, ..spec(cap, chunk as u32) };
    let e = Context::new(config(BackendChoice::Cuda, slots, true), &[far]).err().expect("staging into unmapped memory");
    assert_eq!(e.status, kvswap::KvswapStatus::OutOfRange, "{e}");
    // In the piece mapped without access: refused before any launch (a
    // kernel reading it would fault and poison the context).
    let closed = r.piece(4);
    let e = unsafe { gpu.swap_in_raw(0, closed, window, slots, s.0 as u64) }.unwrap_err();
    assert_eq!(e.status, kvswap::KvswapStatus::InvalidArgument, "{e}");
    assert!(e.message.contains("not mapped read-write"), "{e}");
    assert_eq!(gpu.stats(0).unwrap(), before);
    let shut = KvswapLayerSpec { staging: closed as *mut std::ffi::c_void, ..spec(cap, chunk as u32) };
    let e = Context::new(config(BackendChoice::Cuda, slots, true), &[shut]).err().expect("staging without access");
    assert_eq!(e.status, kvswap::KvswapStatus::InvalidArgument, "{e}");
    // A reservation of one piece (its mapping is its range) without access.
    let single = Reservation::new(1, &[], &[0]);
    let e = unsafe { gpu.swap_in_raw(0, single.piece(0), window, slots, s.0 as u64) }.unwrap_err();
    assert_eq!(e.status, kvswap::KvswapStatus::InvalidArgument, "one piece: {e}");
    drop(single);
    // Pinned host memory (device-mapped) as the index buffer: accepted,
    // staged as on the CPU.
    let pinned = driver::PinnedBuffer::alloc(4 * n_idx).unwrap();
    let mut sel2: Vec<i32> = (0..window as i32).map(|i| -3 - i).collect();
    sel2.extend(selection(&mut rng, cap, slots as usize, 11));
    // SAFETY (test): the buffer holds n_idx i32; no call uses it yet.
    unsafe { std::ptr::copy_nonoverlapping(sel2.as_ptr(), pinned.host as *mut i32, n_idx) };
    unsafe { gpu.swap_in_raw(0, pinned.host as u64, window, slots, s.0 as u64) }.expect("pinned host indices");
    staged_as_on_cpu(&cpu, &gpu, &sel2, pinned.host as u64, window, &s, "pinned host indices");
    assert_eq!(gpu.stats(0).unwrap(), cpu.stats(0).unwrap(), "stats after the pinned call");
    drop(gpu); // before the reservation it stages into
    drop(r);
}

/// Device memory given to the CPU backend (an engine that created its
/// context on the CPU by mistake): refused with INVALID_ARGUMENT, nothing
/// stored or swapped, instead of the CPU reading device memory (a crash).
/// Managed memory, which the CPU can read, is accepted.
#[test]
#[ignore = "needs a CUDA device: run .ci/gpu-run.sh on the GPU machine"]
fn cpu_backend_refuses_device_memory() {
    use cudarc::driver::sys;
    let (_dev, _g, [s]) = gpu0();
    let (chunk, slots) = (64usize, 4u32);
    let cpu = Context::new(config(BackendChoice::Cpu, slots, true), &[spec(16, chunk as u32)]).unwrap();
    cpu.store_rows(0, &[0, 1, 2], &[9u8; 3 * 64]).unwrap();
    let dev_buf = DeviceBuffer::alloc(4096, "device").unwrap();
    let invalid = |r: kvswap::Result<()>, what: &str| {
        let e = r.err().unwrap_or_else(|| panic!("{what}: device memory accepted by the CPU backend"));
        assert_eq!(e.status, kvswap::KvswapStatus::InvalidArgument, "{what}: {e}");
        assert!(e.message.contains("CUDA device memory") && e.message.contains("CPU backend"), "{what}: {e}");
    };
    let before = cpu.stats(0).unwrap();
    invalid(unsafe { cpu.store_raw(0, &[3], dev_buf.ptr, 0, s.0 as u64) }, "store src");
    invalid(unsafe { cpu.swap_in_raw(0, dev_buf.ptr, 0, 2, s.0 as u64) }, "swap-in indices");
    let mut host_idx = [0i32, 1];
    let req = |indices: u64| kvswap::KvswapSwapIn { layer: 0, window_len: 0, count: 2, indices: indices as *mut i32, reserved: 0 };
    invalid(unsafe { cpu.swap_in_layers_raw(&[req(dev_buf.ptr)], 0, s.0 as u64) }, "swap_in_layers indices");
    invalid(unsafe { cpu.swap_in_layers_raw(&[req(host_idx.as_mut_ptr() as u64)], dev_buf.ptr, s.0 as u64) }, "swap_in_layers topk");
    assert_eq!(cpu.stats(0).unwrap(), before, "nothing stored or swapped");
    let staged = KvswapLayerSpec { staging: dev_buf.ptr as *mut std::ffi::c_void, ..spec(16, chunk as u32) };
    invalid(Context::new(config(BackendChoice::Cpu, slots, true), &[staged]).map(|_| ()), "engine staging");
    let q = kvswap::scorer::BoundsRef { query: dev_buf.ptr, min: dev_buf.ptr, max: dev_buf.ptr, dim: 4, n_chunks: 8, out: dev_buf.ptr };
    invalid(unsafe { kvswap::scorer::bounds_topk(-1, &q, 4, 0) }, "bounds on the CPU");
    // Managed memory is host-readable: accepted.
    let mut managed = 0u64;
    let r = unsafe { sys::cuMemAllocManaged(&mut managed, 64, sys::CUmemAttach_flags::CU_MEM_ATTACH_GLOBAL as u32) };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
    unsafe { std::ptr::copy_nonoverlapping([0i32, 2].as_ptr(), managed as *mut i32, 2) };
    unsafe { cpu.swap_in_raw(0, managed, 0, 2, s.0 as u64) }.expect("managed indices on the CPU backend");
    assert_eq!(unsafe { std::slice::from_raw_parts(managed as *const i32, 2) }, [0, 1]);
    unsafe { sys::cuMemFree_v2(managed) };
}

/// Device pointers are checked on every call: a range that passed once and
/// was then freed is refused, not read by a kernel.
#[test]
#[ignore = "needs a CUDA device: run .ci/gpu-run.sh on the GPU machine"]
fn freed_range_is_refused_after_passing_once() {
    let gpu = Context::new(config(BackendChoice::Cuda, 16, true), &[spec(64, 4096)]).unwrap();
    let (_dev, _g, [s]) = gpu0();
    let src = DeviceBuffer::alloc(4 << 20, "src").unwrap();
    let ptr = src.ptr;
    unsafe { gpu.store_raw(0, &[1, 2], ptr, 4096, s.0 as u64) }.unwrap();
    s.sync().unwrap();
    drop(src);
    let e = unsafe { gpu.store_raw(0, &[1, 2], ptr, 4096, s.0 as u64) }.unwrap_err();
    assert_eq!(e.status, kvswap::KvswapStatus::InvalidArgument, "{e}");
    assert_eq!(gpu.stats(0).unwrap().stores, 2, "the refused call stored nothing");
}

/// `kvswap_swap_in_layers` on CUDA (one launch pair for all layers) against
/// one CPU `swap_in` per request: eager calls over random subsets
/// of 21 layers in random order with the shared top-k copied in, then the
/// same call captured in a graph and replayed with new top-k values, then a
/// KVSWAP_SYNC=1 context (one layer after another, every request's ids
/// checked first: a fixed step with a middle request's id never stored, and
/// random never-stored and out-of-range ids, refuse the call before any
/// layer or entry changes, as the CPU backend's call does). Index buffers
/// (after eager calls read back on the call's stream, so the call's work
/// must be ordered on it), errors, counters and the staged bytes of the selected slots
/// equal the CPU's at every step; with KVSWAP_SYNC=0 a never-stored id is
/// deferred on the same layer as the CPU's.
#[test]
#[ignore = "needs a CUDA device: run .ci/gpu-run.sh on the GPU machine"]
fn swap_in_layers_matches_cpu() {
    use kvswap::KvswapSwapIn;
    let mut rng = Rng::fresh("gpu swap layers");
    let (layers, cap, chunk, slots, window) = (21usize, 2048u32, 256usize, 128u32, 16u32);
    let specs: Vec<_> = (0..layers).map(|_| spec(cap, chunk as u32)).collect();
    let (_dev, _g, [stream]) = gpu0();
    let s = stream.0;
    let n_idx = (window + slots) as usize;
    let idx = index_buffers(layers, n_idx);
    let topk = DeviceBuffer::alloc(4 * slots as usize, "topk").unwrap();
    let read = |l: usize| {
        let mut got = vec![0i32; n_idx];
        unsafe { driver::copy_dtoh_async(got.as_mut_ptr() as *mut u8, idx[l].ptr, 4 * n_idx, s).unwrap() };
        stream.sync().unwrap();
        got
    };
    for sync in [false, true] {
        // Every chunk stored but the last 8 of each layer.
        let (cpu, gpu) = twins(&mut rng, &specs, slots, sync, |_| cap - 8);
        let rows = vec![0x5au8; chunk];
        let mut hot = 0u32;
        let pick = |rng: &mut Rng, hot: u32| -> i32 {
            match rng.below(200) {
                // Never stored: deferred (sync = 0), or stops the call (sync = 1, rarer).
                0 if !sync || rng.below(5) == 0 => (cap - 1 - rng.below(8) as u32) as i32,
                1 => -1,
                // Out of range: refuses the call (sync = 1 only).
                2 if sync && rng.below(5) == 0 => (cap + rng.below(8) as u32) as i32,
                _ => ((hot + rng.below(3 * slots as u64) as u32) % (cap - 8)) as i32,
            }
        };
        // One step: the CPU reference for `order` (layer numbers) and `sel`,
        // then `run` makes the GPU call; compares everything after it.
        // `shared`: the selection is the shared top-k (copied in by the
        // call), else it is written into every request's entries first
        // (`run` gets the top-k pointer to pass, 0 then).
        let check = |step: usize, order: &[usize], sel: &[i32], shared: bool, rng: &mut Rng, run: &mut dyn FnMut(&[KvswapSwapIn], u64) -> kvswap::Result<()>| {
            let count = sel.len() as u32;
            let mut host = vec![-9i32; window as usize];
            if shared {
                host.extend(std::iter::repeat_n(-7, count as usize));
            } else {
                host.extend_from_slice(sel);
            }
            // The CPU reference: with sync = 0 one swap_in per request; with
            // sync = 1 the CPU backend's own kvswap_swap_in_layers (checked
            // against one call per request in tests/swap_layers.rs), which
            // refuses a call with a refused id before any layer or entry
            // changes.
            let mut expect: Vec<Vec<i32>> = order.iter().map(|_| host.clone()).collect();
            let want = if sync {
                let reqs: Vec<KvswapSwapIn> = order
                    .iter()
                    .zip(expect.iter_mut())
                    .map(|(&l, e)| KvswapSwapIn { layer: l as u32, window_len: window, count, reserved: 0, indices: e.as_mut_ptr() })
                    .collect();
                // SAFETY: host buffers of window + count ints, sel of count.
                unsafe { cpu.swap_in_layers_raw(&reqs, if shared { sel.as_ptr() as u64 } else { 0 }, 0) }
            } else {
                for (&l, e) in order.iter().zip(expect.iter_mut()) {
                    e[window as usize..].copy_from_slice(sel);
                    cpu.swap_in(l, e, window).unwrap(); // errors deferred
                }
                Ok(())
            };
            for &l in order {
                unsafe { driver::copy_htod_async(idx[l].ptr, host.as_ptr() as *const u8, 4 * host.len(), s).unwrap() };
            }
            unsafe { driver::copy_htod_async(topk.ptr, sel.as_ptr() as *const u8, 4 * sel.len(), s).unwrap() };
            // No wait here: the call must be ordered after these copies on
            // its stream (its sync = 1 id check too).
            let reqs: Vec<KvswapSwapIn> = order
                .iter()
                .map(|&l| KvswapSwapIn { layer: l as u32, window_len: window, count, reserved: 0, indices: idx[l].ptr as *mut i32 })
                .collect();
            match (run(&reqs, if shared { topk.ptr } else { 0 }), &want) {
                (Ok(()), Ok(())) => {}
                (Err(g), Err(w)) => assert!(g.status == w.status && g.message.ends_with(&w.message), "sync {sync} step {step}: {g} vs {w}"),
                (g, w) => panic!("sync {sync} step {step}: cuda {g:?} vs cpu {w:?}"),
            }
            for (&l, e) in order.iter().zip(&expect) {
                let got = read(l);
                assert_eq!(&got[..e.len()], &e[..], "sync {sync} step {step} layer {l}: physical ids");
            }
            if !sync {
                let (a, b) = (cpu.sync(), gpu.sync_stream(s as u64));
                assert_eq!(a.map_err(|e| e.message), b.map_err(|e| e.message), "sync {sync} step {step}: deferred errors");
            }
            for &l in order {
                assert_eq!(cpu.stats(l).unwrap(), gpu.stats(l).unwrap(), "sync {sync} step {step} layer {l}: stats");
            }
            if step.is_multiple_of(25) {
                let l = order[rng.below(order.len() as u64) as usize];
                for (slot, _) in cpu.residency(l).unwrap() {
                    assert_eq!(cpu.slot_bytes(l, slot).unwrap(), gpu.slot_bytes(l, slot).unwrap(), "sync {sync} step {step} layer {l} slot {slot}");
                }
            }
        };
        if sync {
            // Chunk cap - 1 stored in layers 0 and 1 only: a call over layers
            // 0..4 selecting it is refused, naming request 2 (layer 2), before
            // any layer or entry changes (the device checks every request's
            // ids first).
            for l in 0..2 {
                cpu.store(l, cap as i32 - 1, &rows[..chunk]).unwrap();
                gpu.store(l, cap as i32 - 1, &rows[..chunk]).unwrap();
            }
            let sel = [5, cap as i32 - 1, 9];
            check(0, &[0, 1, 2, 3], &sel, true, &mut rng, &mut |reqs, topk| {
                let r = unsafe { gpu.swap_in_layers_raw(reqs, topk, s as u64) };
                let e = r.as_ref().expect_err("layer 2 lacks chunk 2047");
                assert!(e.message.starts_with("requests[2] (layer 2): layer 2: selected chunk 2047"), "{e}");
                r
            });
        }
        // Eager calls: random subsets in random order, random counts.
        for step in 0..common::scaled(200) {
            hot = (hot + 5) % cap;
            let mut order: Vec<usize> = (0..layers).collect();
            for i in (1..layers).rev() {
                order.swap(i, rng.below(i as u64 + 1) as usize);
            }
            order.truncate(1 + rng.below(layers as u64) as usize);
            let count = rng.below(slots as u64 + 1) as usize;
            let sel: Vec<i32> = (0..count).map(|_| pick(&mut rng, hot)).collect();
            let shared = rng.below(3) > 0;
            check(step, &order, &sel, shared, &mut rng, &mut |reqs, topk| unsafe { gpu.swap_in_layers_raw(reqs, topk, s as u64) });
        }
        if sync {
            continue; // KVSWAP_SYNC=1 cannot be captured
        }
        // Captured: all layers, full count, replayed with new top-k values.
        let all: Vec<usize> = (0..layers).collect();
        let reqs: Vec<KvswapSwapIn> = all
            .iter()
            .map(|&l| KvswapSwapIn { layer: l as u32, window_len: window, count: slots, reserved: 0, indices: idx[l].ptr as *mut i32 })
            .collect();
        let graph = Graph::capture(s, || unsafe { gpu.swap_in_layers_raw(&reqs, topk.ptr, s as u64) }).unwrap();
        for step in 0..common::scaled(200) {
            hot = (hot + 5) % cap;
            let mut seen = std::collections::HashSet::new();
            let mut sel = Vec::with_capacity(slots as usize);
            while sel.len() < slots as usize {
                let id = pick(&mut rng, hot);
                if id < 0 || seen.insert(id) {
                    sel.push(id);
                }
            }
            check(1000 + step, &all, &sel, true, &mut rng, &mut |_, _| graph.launch(s));
        }
    }
}

/// `kvswap_swap_in_layers` around captures and failures: (1) while a capture
/// of a call is still open, an eager call of the same context on another
/// stream runs (not into that capture) and is correct; the capture then
/// ends cleanly and its graph is correct. (2) the copy kernel refused twice
/// (test hook) after the residency kernel: an eager call names the layers
/// left unusable (those with entries), which refuse later calls while the
/// others keep working; inside a capture the same failure is returned, the
/// capture still ends cleanly and no layer is harmed.
#[test]
#[ignore = "needs a CUDA device: run .ci/gpu-run.sh on the GPU machine"]
fn swap_in_layers_around_captures_and_failures() {
    use kvswap::KvswapSwapIn;
    let (layers, cap, chunk, slots) = (8usize, 256u32, 128usize, 16u32);
    let specs: Vec<_> = (0..layers).map(|_| spec(cap, chunk as u32)).collect();
    let (_dev, _g, [s1, s2]) = gpu0();
    let idx = index_buffers(layers, slots as usize);
    let topk = DeviceBuffer::alloc(4 * slots as usize, "topk").unwrap();
    let sel: Vec<i32> = (0..slots as i32).map(|i| 3 * i + 1).collect();
    let reqs = |ls: std::ops::Range<usize>| -> Vec<KvswapSwapIn> {
        ls.map(|l| KvswapSwapIn { layer: l as u32, window_len: 0, count: slots, reserved: 0, indices: idx[l].ptr as *mut i32 }).collect()
    };
    let read = |l: usize, s: &OwnedStream| {
        let mut got = vec![0i32; slots as usize];
        unsafe { driver::copy_dtoh_async(got.as_mut_ptr() as *mut u8, idx[l].ptr, 4 * slots as usize, s.0).unwrap() };
        s.sync().unwrap();
        got
    };
    let mut rng = Rng::fresh("gpu swap layers failures");
    let mut fresh = || twins(&mut rng, &specs, slots, false, |_| cap);
    let expect = |cpu: &Context, l: usize| {
        let mut e = sel.clone();
        cpu.swap_in(l, &mut e, 0).unwrap();
        e
    };
    unsafe { driver::copy_htod_async(topk.ptr, sel.as_ptr() as *const u8, 4 * sel.len(), s1.0).unwrap() };
    s1.sync().unwrap();

    // (1) Layers 0..4 captured on s1; layers 4..8 eager on s2 meanwhile.
    let (cpu, gpu) = fresh();
    let graph = Graph::capture(s1.0, || {
        unsafe { gpu.swap_in_layers_raw(&reqs(0..4), topk.ptr, s1.0 as u64)? };
        unsafe { gpu.swap_in_layers_raw(&reqs(4..8), topk.ptr, s2.0 as u64) }
    })
    .expect("the capture ends cleanly with an eager call of the same context inside it");
    for l in 4..8 {
        assert_eq!(read(l, &s2), expect(&cpu, l), "layer {l}: the eager call ran (not captured)");
    }
    graph.launch(s1.0).unwrap();
    for l in 0..4 {
        assert_eq!(read(l, &s1), expect(&cpu, l), "layer {l}: the graph's call");
    }
    gpu.sync_stream(s1.0 as u64).unwrap();
    for l in 0..layers {
        assert_eq!(cpu.stats(l).unwrap(), gpu.stats(l).unwrap(), "layer {l}: stats");
    }

    // (2a) Eager: layers 2 and 5 with entries, layer 3 with none; the
    // copy kernel refused twice.
    let (cpu, gpu) = fresh();
    let mut r = [reqs(2..3)[0], reqs(3..4)[0], reqs(5..6)[0]];
    r[1].count = 0;
    kvswap::backend::cuda::fail_gather_launches(2);
    let e = unsafe { gpu.swap_in_layers_raw(&r, topk.ptr, s1.0 as u64) }.unwrap_err();
    kvswap::backend::cuda::fail_gather_launches(0);
    assert_eq!(e.status, kvswap::KvswapStatus::DeviceError, "{e}");
    assert!(e.message.starts_with("layers 2, 5: the copy kernel could not be launched"), "{e}");
    s1.sync().unwrap();
    for l in [2usize, 5] {
        let e = unsafe { gpu.swap_in_raw(l, idx[l].ptr, 0, slots, s1.0 as u64) }.unwrap_err();
        assert!(e.message.contains(&format!("layer {l}: the copy kernel of a kvswap_swap_in_layers call")), "{e}");
    }
    unsafe { gpu.swap_in_layers_raw(&reqs(3..5), topk.ptr, s1.0 as u64) }.unwrap();
    for l in 3..5 {
        assert_eq!(read(l, &s1), expect(&cpu, l), "layer {l}: works after the failure");
    }

    // (2b) Captured: the same failure is returned; the capture (the hook
    // refuses before the driver sees the launch) ends cleanly, and the
    // layers are not harmed: the same call eagerly afterwards is correct.
    let (cpu, gpu) = fresh();
    unsafe { gpu.swap_in_layers_raw(&reqs(0..2), topk.ptr, s1.0 as u64) }.unwrap();
    let mut inner = None;
    let ended = Graph::capture(s1.0, || {
        kvswap::backend::cuda::fail_gather_launches(2);
        inner = Some(unsafe { gpu.swap_in_layers_raw(&reqs(2..8), topk.ptr, s1.0 as u64) });
        kvswap::backend::cuda::fail_gather_launches(0);
        Ok(())
    });
    let inner = inner.unwrap().unwrap_err();
    assert!(inner.message.contains("injected by a test"), "{inner}");
    let partial = ended.expect("the capture ends cleanly after the failure");
    drop(partial); // never launched: it holds the residency kernel alone
    unsafe { gpu.swap_in_layers_raw(&reqs(2..8), topk.ptr, s1.0 as u64) }.unwrap();
    gpu.sync_stream(s1.0 as u64).unwrap();
    for l in 0..layers {
        assert_eq!(read(l, &s1), expect(&cpu, l), "layer {l}: correct after the failed capture");
    }
}

/// `kvswap_swap_in_layers` on CUDA over 70 different layers (two launch
/// pairs when a call names more than 64): swapping layers and fully
/// resident ones, 256- and 100-byte chunks (16-byte and byte copies), a
/// count of its own per request, with the shared top-k and without. Index
/// buffers, deferred errors, counters and staged bytes equal one CPU
/// `swap_in` per request at every step.
#[test]
#[ignore = "needs a CUDA device: run .ci/gpu-run.sh on the GPU machine"]
fn swap_in_layers_mixed_layers_match_cpu() {
    use kvswap::KvswapSwapIn;
    let mut rng = Rng::fresh("gpu swap layers mixed");
    let (layers, slots, window) = (70usize, 64u32, 4u32);
    let cap = |l: usize| if l % 7 == 3 { 40u32 } else { 600 + 13 * l as u32 }; // 40 <= slots: fully resident
    let chunk = |l: usize| if l.is_multiple_of(2) { 256usize } else { 100 };
    let specs: Vec<_> = (0..layers).map(|l| spec(cap(l), chunk(l) as u32)).collect();
    let (cpu, gpu) = twins(&mut rng, &specs, slots, false, |l| cap(l) - 3); // the last 3 never stored
    let (_dev, _g, [stream]) = gpu0();
    let s = stream.0;
    let n_idx = (window + slots) as usize;
    let idx = index_buffers(layers, n_idx);
    let topk = DeviceBuffer::alloc(4 * slots as usize, "topk").unwrap();
    for step in 0..common::scaled(60) {
        let mut order: Vec<usize> = (0..layers).collect();
        for i in (1..layers).rev() {
            order.swap(i, rng.below(i as u64 + 1) as usize);
        }
        order.truncate(2 + rng.below(layers as u64 - 1) as usize);
        let shared = rng.below(2) == 0;
        // Shared ids lie below every cap (36..39 are never stored in the
        // resident layers: deferred errors there).
        let shared_ids: Vec<i32> = (0..slots).map(|_| if rng.below(30) == 0 { -1 } else { rng.below(40) as i32 }).collect();
        let mut reqs = Vec::new();
        let mut expect = Vec::new();
        for &l in &order {
            let count = rng.below(slots as u64 + 1) as u32;
            let mut host: Vec<i32> = (0..window as i32).map(|i| 900 + i).collect();
            if shared {
                host.extend(std::iter::repeat_n(-7, count as usize));
            } else {
                host.extend((0..count).map(|_| match rng.below(40) {
                    0 => -1,
                    1 => cap(l) as i32 - 1, // never stored
                    _ => rng.below(cap(l) as u64) as i32 % (cap(l) as i32 - 3),
                }));
            }
            unsafe { driver::copy_htod_async(idx[l].ptr, host.as_ptr() as *const u8, 4 * host.len(), s).unwrap() };
            let mut e = host.clone();
            if shared {
                e[window as usize..].copy_from_slice(&shared_ids[..count as usize]);
            }
            cpu.swap_in(l, &mut e, window).unwrap();
            expect.push(e);
            reqs.push(KvswapSwapIn { layer: l as u32, window_len: window, count, reserved: 0, indices: idx[l].ptr as *mut i32 });
        }
        unsafe { driver::copy_htod_async(topk.ptr, shared_ids.as_ptr() as *const u8, 4 * shared_ids.len(), s).unwrap() };
        stream.sync().unwrap();
        unsafe { gpu.swap_in_layers_raw(&reqs, if shared { topk.ptr } else { 0 }, s as u64) }.unwrap();
        for (&l, e) in order.iter().zip(&expect) {
            let mut got = vec![0i32; e.len()];
            unsafe { driver::copy_dtoh_async(got.as_mut_ptr() as *mut u8, idx[l].ptr, 4 * e.len(), s).unwrap() };
            stream.sync().unwrap();
            assert_eq!(&got, e, "step {step} layer {l} (shared {shared}): physical ids");
        }
        let (a, b) = (cpu.sync(), gpu.sync_stream(s as u64));
        assert_eq!(a.map_err(|e| e.message), b.map_err(|e| e.message), "step {step}: deferred errors");
        for &l in &order {
            assert_eq!(cpu.stats(l).unwrap(), gpu.stats(l).unwrap(), "step {step} layer {l}: stats");
        }
        let l = order[rng.below(order.len() as u64) as usize];
        for (slot, _) in cpu.residency(l).unwrap() {
            assert_eq!(cpu.slot_bytes(l, slot).unwrap(), gpu.slot_bytes(l, slot).unwrap(), "step {step} layer {l} slot {slot}");
        }
    }
}

/// `kvswap_swap_in_layers` with KVSWAP_SYNC=1 over more entries than a
/// block has threads (2,048 per request: the id check's loop runs twice per
/// thread), on a swapping layer and a fully resident one: a never-stored id
/// near the end of the second request's entries, or an out-of-range one in
/// the first's, refuses the call before any layer or entry changes, with
/// the CPU backend's error (its position); the same call without it then
/// equals the CPU's.
#[test]
#[ignore = "needs a CUDA device: run .ci/gpu-run.sh on the GPU machine"]
fn swap_in_layers_sync_checks_every_id_of_long_requests() {
    use kvswap::KvswapSwapIn;
    let slots = 2048u32;
    let specs = [spec(4096, 64), spec(1800, 64)]; // layer 1: compressed_cap <= gpu_chunks, fully resident
    let (_dev, _g, [stream]) = gpu0();
    let s = stream.0;
    let mut rng = Rng::fresh("gpu sync long requests");
    let (cpu, gpu) = twins(&mut rng, &specs, slots, true, |l| specs[l].compressed_cap as u32 - 1);
    let idx = index_buffers(2, slots as usize);
    let counts = [2048u32, 1700];
    // The CUDA call's result, the CPU's, the CUDA entries after it, the CPU's.
    type Outcome = (kvswap::Result<()>, kvswap::Result<()>, Vec<Vec<i32>>, Vec<Vec<i32>>);
    let run = |sel: &[Vec<i32>]| -> Outcome {
        let mut host = sel.to_vec();
        let reqs_cpu: Vec<KvswapSwapIn> = host
            .iter_mut()
            .enumerate()
            .map(|(l, e)| KvswapSwapIn { layer: l as u32, window_len: 0, count: counts[l], reserved: 0, indices: e.as_mut_ptr() })
            .collect();
        // SAFETY: host buffers of count ints each.
        let want = unsafe { cpu.swap_in_layers_raw(&reqs_cpu, 0, 0) };
        for (l, e) in sel.iter().enumerate() {
            unsafe { driver::copy_htod_async(idx[l].ptr, e.as_ptr() as *const u8, 4 * e.len(), s).unwrap() };
        }
        let reqs: Vec<KvswapSwapIn> =
            (0..2).map(|l| KvswapSwapIn { layer: l as u32, window_len: 0, count: counts[l], reserved: 0, indices: idx[l].ptr as *mut i32 }).collect();
        let got = unsafe { gpu.swap_in_layers_raw(&reqs, 0, s as u64) };
        let read: Vec<Vec<i32>> = (0..2)
            .map(|l| {
                let mut v = vec![0i32; counts[l] as usize];
                unsafe { driver::copy_dtoh_async(v.as_mut_ptr() as *mut u8, idx[l].ptr, 4 * v.len(), s).unwrap() };
                stream.sync().unwrap();
                v
            })
            .collect();
        (got, want, read, host)
    };
    let good: Vec<Vec<i32>> =
        (0..2).map(|l| (0..counts[l]).map(|_| rng.below(specs[l].compressed_cap - 1) as i32).collect()).collect();
    let before: Vec<_> = (0..2).map(|l| (gpu.stats(l).unwrap(), gpu.residency(l).unwrap())).collect();
    for (l, pos, id, status) in [(1usize, 1650usize, 1799i32, kvswap::KvswapStatus::NotStored), (0, 1900, 4096 + 5, kvswap::KvswapStatus::OutOfRange)] {
        let mut bad = good.clone();
        bad[l][pos] = id;
        let (got, want, read, host) = run(&bad);
        let (g, w) = (got.unwrap_err(), want.unwrap_err());
        assert_eq!((g.status, &g.message), (w.status, &w.message), "layer {l}: the CPU backend's error");
        assert_eq!(g.status, status, "{g}");
        assert!(g.message.starts_with(&format!("requests[{l}] (layer {l}):")) && g.message.contains(&pos.to_string()), "{g}");
        assert_eq!(read, bad, "layer {l}: no entries changed");
        assert_eq!(host, bad, "the CPU's entries unchanged too");
        for (k, b) in before.iter().enumerate() {
            assert_eq!(&(gpu.stats(k).unwrap(), gpu.residency(k).unwrap()), b, "layer {k} unchanged after the refusal at layer {l}");
        }
    }
    let (got, want, read, host) = run(&good);
    got.unwrap();
    want.unwrap();
    assert_eq!(read, host, "physical ids equal the CPU's");
    for l in 0..2 {
        assert_eq!(cpu.stats(l).unwrap(), gpu.stats(l).unwrap(), "layer {l}: stats");
    }
    gpu.sync_stream(s as u64).unwrap();
}

/// What `check_device_range` relies on, as the driver reports it (H200,
/// driver 580: an ordinary allocation's range is the allocation, a pool
/// allocation's too, while a virtual-memory reservation's range is the whole
/// reservation and only the mapping attributes name the physical piece; an
/// unmapped address is not described). Printed for other drivers, asserted.
#[test]
#[ignore = "needs a CUDA device: run .ci/gpu-run.sh on the GPU machine"]
fn driver_reports_what_the_range_check_relies_on() {
    use cudarc::driver::sys;
    let (_dev, _g, [s]) = gpu0();
    let show = |name: &str, p: u64| {
        let m = driver::mapping(p);
        match &m {
            Some(m) => println!(
                "{name:<28} type {} range {:#x}+{:#x} mapped {} rw {} mapping {:#x}+{:#x} (p {p:#x})",
                m.info.memory_type, m.info.range_start, m.info.range_size, m.mapped, m.read_write, m.mapping_base, m.mapping_size
            ),
            None => println!("{name:<28} not described (p {p:#x})"),
        }
        m
    };
    let ok = |r: sys::CUresult, what: &str| assert_eq!(r, sys::CUresult::CUDA_SUCCESS, "{what}");
    let small = DeviceBuffer::alloc(100, "small").unwrap();
    let m = show("cuMemAlloc 100 B", small.ptr).expect("described");
    assert_eq!((m.info.range_start, m.info.range_size, m.mapped, m.read_write), (small.ptr, 100, true, true));
    assert!(m.mapping_base <= small.ptr && m.mapping_base + m.mapping_size >= small.ptr + 100, "its mapping holds it");
    let large = DeviceBuffer::alloc(64 << 20, "large").unwrap();
    let m = show("cuMemAlloc 64 MiB, at +40 MiB", large.ptr + (40 << 20)).expect("described");
    assert_eq!((m.info.range_start, m.info.range_size, m.mapped, m.read_write), (large.ptr, 64 << 20, true, true));
    let mut managed = 0u64;
    ok(unsafe { sys::cuMemAllocManaged(&mut managed, 1 << 20, 1) }, "managed");
    let m = show("cuMemAllocManaged", managed).expect("described");
    assert_eq!((m.info.range_start, m.info.range_size), (managed, 1 << 20));
    assert!(m.mapped && m.read_write, "managed memory mapped read-write");
    let mut pooled = 0u64;
    ok(unsafe { sys::cuMemAllocAsync(&mut pooled, 3 << 20, s.0) }, "pool");
    s.sync().unwrap();
    let m = show("cuMemAllocAsync 3 MiB, +2.5", pooled + (5 << 19)).expect("described");
    assert_eq!((m.info.range_start, m.info.range_size), (pooled, 3 << 20), "a pool allocation's range is the allocation");
    assert!(m.mapped && m.read_write && m.mapping_base <= pooled && m.mapping_base + m.mapping_size >= pooled + (3 << 20), "mapped, in one mapping");
    // Pinned host memory (cuMemHostAlloc, device-mapped): printed; the
    // check takes its range unless its mapping is a piece of it, which
    // must then be mapped read-write.
    for (bytes, at) in [(100usize, 0u64), (64 << 20, 40 << 20)] {
        let h = driver::PinnedBuffer::alloc(bytes).unwrap();
        let m = show(&format!("cuMemHostAlloc {bytes} B, +{at}"), h.host as u64 + at).expect("described");
        let end = m.mapping_base + m.mapping_size;
        let piece = m.mapping_size > 0 && (m.mapping_base > m.info.range_start || end < m.info.range_start + m.info.range_size);
        assert!(!piece || (m.mapped && m.read_write), "pinned host memory reported as a piece without access");
    }
    // Managed memory over several 2 MiB mappings, its pages on the host: a
    // pointer in a later mapping is still mapped read-write.
    let mut big = 0u64;
    ok(unsafe { sys::cuMemAllocManaged(&mut big, 8 << 20, 1) }, "managed 8 MiB");
    unsafe { std::ptr::write_bytes(big as *mut u8, 7, 8 << 20) };
    let m = show("cuMemAllocManaged 8 MiB, host pages, +5 MiB", big + (5 << 20)).expect("described");
    assert!(m.mapped && m.read_write, "managed memory mapped read-write");
    ok(unsafe { sys::cuMemFree_v2(big) }, "free managed 8 MiB");
    // A reservation of one piece mapped without access: its mapping is its
    // range, and it is not read-write.
    let single = Reservation::new(1, &[], &[0]);
    let m = show("VMM 1-piece reservation, no access", single.piece(0) + 8).expect("described");
    assert!(m.mapped && !m.read_write, "mapped, not read-write");
    drop(single);
    let r = Reservation::new(4, &[1], &[3]);
    let (piece, gran) = (r.piece(1), r.gran);
    let m = show("VMM piece 1 of 4 (mapped)", piece + 8).expect("described");
    assert!(m.mapped && m.read_write, "a mapped read-write piece");
    assert_eq!((m.mapping_base, m.mapping_size), (piece, gran), "the mapping attributes name the piece");
    assert!(m.info.range_start <= piece && m.info.range_start + m.info.range_size >= piece + gran, "the range holds the piece");
    for (name, p) in [("VMM piece 0 (unmapped)", r.piece(0) + 8), ("VMM piece 2 (unmapped)", r.piece(2) + 8)] {
        assert!(show(name, p).is_none_or(|m| !m.mapped), "{name}: described as mapped");
    }
    // Mapped with no access for this device: not described as read-write
    // (the check refuses a buffer that starts there).
    let name = "VMM piece 3 (no access)";
    let m = show(name, r.piece(3) + 8).expect("described");
    assert!(m.mapped && !m.read_write, "{name}: mapped, not read-write");
    assert_eq!((m.mapping_base, m.mapping_size), (r.piece(3), gran), "{name}: the mapping attributes name the piece");
    drop(r);
    unsafe {
        ok(sys::cuMemFreeAsync(pooled, s.0), "free async");
        ok(sys::cuMemFree_v2(managed), "free managed");
    }
    s.sync().unwrap();
}
