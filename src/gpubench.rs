//! `kvswap bench --backend cuda`: swap-in on the GPU beside the physical
//! ceiling (one bulk pinned H2D copy) and the original engine's way (one
//! `cuMemcpyHtoDAsync` per missed chunk), in one run.
//!
//! Timing is by CUDA events around many steps (median of rounds). Steps in
//! the asynchronous mode run from a captured CUDA graph: capture succeeds only
//! if the step never waits for the host, and replay removes launch gaps.
//! Each captured step first restores its index buffer from a pristine copy
//! (a swap-in rewrites it in place); the same graph without the swap-ins is
//! timed too and subtracted, and both figures are reported.

use crate::backend::cuda::driver::{self, Device, DeviceBuffer, Event, OwnedStream, PinnedBuffer};
use crate::{BackendChoice, Config, Context, KvswapLayerSpec, Result};
use cudarc::driver::sys;
use serde::Serialize;

/// One measured configuration.
#[derive(Clone, Debug, Serialize)]
pub struct SwapRow {
    pub chunk_bytes: usize,
    pub misses: usize,
    /// One cuMemcpyHtoDAsync per chunk, per step (us).
    pub per_chunk_memcpy_us: f64,
    /// kvswap, KVSWAP_SYNC=1, wall time per call including the host wait (us).
    pub kvswap_sync_us: f64,
    /// kvswap, KVSWAP_SYNC=0, device time per step from graph replay (us).
    pub kvswap_async_us: f64,
    /// The same with the index-buffer restore included (us).
    pub kvswap_async_with_restore_us: f64,
    /// Bytes moved per second by the async step (GB/s).
    pub async_gbps: f64,
    /// Async bandwidth over the bulk H2D ceiling.
    pub fraction_of_bulk: f64,
    /// Per-chunk baseline time over async time.
    pub speedup_vs_per_chunk: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct StepRow {
    pub name: String,
    pub layers: usize,
    pub selected: usize,
    pub hit_rate: f64,
    pub sync_us: f64,
    pub async_us: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub device: String,
    pub bulk_h2d_gbps: f64,
    pub bulk_bytes: usize,
    pub swap: Vec<SwapRow>,
    pub steps: Vec<StepRow>,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// Median over `rounds` of the device time of `body` (ms), timed by events.
fn time_ms(s: sys::CUstream, rounds: usize, mut body: impl FnMut() -> Result<()>) -> Result<f64> {
    let (a, b) = (Event::new(true)?, Event::new(true)?);
    body()?; // warm-up
    driver::stream_sync(s)?;
    let mut v = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        a.record(s)?;
        body()?;
        b.record(s)?;
        b.sync()?;
        v.push(a.elapsed_ms(&b)? as f64);
    }
    Ok(median(v))
}

struct Graph(sys::CUgraphExec, sys::CUgraph);

impl Graph {
    /// Captures what `body` enqueues on `s` (global mode: any host wait or
    /// legacy-stream use inside it makes capture fail).
    fn capture(s: sys::CUstream, body: impl FnOnce() -> Result<()>) -> Result<Graph> {
        // SAFETY: s is a live stream; capture is ended below on every path.
        driver::check(unsafe { sys::cuStreamBeginCapture_v2(s, sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL) }, "cuStreamBeginCapture")?;
        let r = body();
        let mut g: sys::CUgraph = std::ptr::null_mut();
        // SAFETY: ends the capture begun above.
        let e = driver::check(unsafe { sys::cuStreamEndCapture(s, &mut g) }, "cuStreamEndCapture");
        r?;
        e?;
        let mut exec: sys::CUgraphExec = std::ptr::null_mut();
        // SAFETY: g is a complete graph.
        driver::check(unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, g, 0) }, "cuGraphInstantiate")?;
        Ok(Graph(exec, g))
    }
    fn launch(&self, s: sys::CUstream) -> Result<()> {
        // SAFETY: live executable graph and stream.
        driver::check(unsafe { sys::cuGraphLaunch(self.0, s) }, "cuGraphLaunch")
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        // SAFETY: created in capture.
        unsafe {
            sys::cuGraphExecDestroy(self.0);
            sys::cuGraphDestroy(self.1);
        }
    }
}

/// Device copy of `bytes` (restoring an index buffer).
fn dtod(dst: u64, src: u64, bytes: usize, s: sys::CUstream) -> Result<()> {
    // SAFETY: both are live device buffers of at least `bytes`.
    driver::check(unsafe { sys::cuMemcpyDtoDAsync_v2(dst, src, bytes, s) }, "cuMemcpyDtoDAsync")
}

fn upload(buf: &DeviceBuffer, data: &[i32], s: sys::CUstream) -> Result<()> {
    // SAFETY: buf holds data.len() ints; synced before `data` is released.
    unsafe { driver::copy_htod_async(buf.ptr, data.as_ptr() as *const u8, data.len() * 4, s)? };
    driver::stream_sync(s)
}

fn spec(cap: usize, chunk: usize) -> KvswapLayerSpec {
    KvswapLayerSpec { compressed_cap: cap as u64, chunk_bytes: chunk as u64, staging: std::ptr::null_mut(), staging_stride: 0 }
}

fn context(device: i32, slots: usize, sync: bool, specs: &[KvswapLayerSpec]) -> Result<Context> {
    let cfg = Config {
        enable: true,
        gpu_chunks: slots as u32,
        index_topk: slots as u32,
        sync,
        backend: BackendChoice::Cuda,
        device,
        pinned_mib: 1 << 20,
        ..Config::default()
    };
    Context::new(cfg, specs)
}

/// Stores every chunk of `layer` with a pattern, from device memory.
fn prefill(ctx: &Context, layer: usize, cap: usize, chunk: usize, s: sys::CUstream) -> Result<()> {
    let batch = 1024.min(cap);
    let rows: Vec<u8> = (0..batch * chunk).map(|i| (i * 131 + layer * 7) as u8).collect();
    let src = DeviceBuffer::alloc(rows.len(), "prefill rows")?;
    // SAFETY: src holds rows.len() bytes; synced below.
    unsafe { driver::copy_htod_async(src.ptr, rows.as_ptr(), rows.len(), s)? };
    let mut first = 0;
    while first < cap {
        let ids: Vec<i32> = (first..cap.min(first + batch)).map(|i| i as i32).collect();
        // SAFETY: src holds ids.len() rows of chunk bytes on the context's device.
        unsafe { ctx.store_raw(layer, &ids, src.ptr, chunk, s as u64)? };
        first += batch;
    }
    driver::stream_sync(s)
}

/// Index buffers (window of junk, then `sel`) for each step, on the device.
fn index_buffers(steps: &[Vec<i32>], window: usize, s: sys::CUstream) -> Result<Vec<DeviceBuffer>> {
    steps
        .iter()
        .map(|sel| {
            let mut v = vec![-7i32; window];
            v.extend(sel);
            let b = DeviceBuffer::alloc(v.len() * 4, "index buffer")?;
            upload(&b, &v, s)?;
            Ok(b)
        })
        .collect()
}

const WINDOW: usize = 128;

/// Swap-in of `misses` chunks of `chunk` bytes: per-chunk memcpy, kvswap
/// sync, kvswap async (graph).
fn swap_row(dev: &Device, s: sys::CUstream, chunk: usize, misses: usize, bulk_gbps: f64, rounds: usize) -> Result<SwapRow> {
    let slots = misses.max(512);
    let cap = 2 * slots + 2 * misses;
    let period = cap / misses; // steps before an id comes back (all misses)
    let steps: Vec<Vec<i32>> =
        (0..period).map(|j| (0..misses).map(|i| ((j * misses + i) % cap) as i32).collect()).collect();
    let n_idx = WINDOW + misses;

    // The original engine's way: one cuMemcpyHtoDAsync per missed chunk.
    let host = PinnedBuffer::alloc(cap * chunk)?;
    let slots_buf = DeviceBuffer::alloc(slots * chunk, "baseline slots")?;
    let per_chunk_ms = time_ms(s, rounds, || {
        for i in 0..misses {
            // SAFETY: both rows are in bounds of their buffers.
            unsafe { driver::copy_htod_async(slots_buf.ptr + (i * chunk) as u64, host.host.add((i * 7 % cap) * chunk), chunk, s)? };
        }
        Ok(())
    })?;
    drop((host, slots_buf));

    let mut out = [0f64; 3];
    for sync in [true, false] {
        let ctx = context(dev.ordinal, slots, sync, &[spec(cap, chunk)])?;
        prefill(&ctx, 0, cap, chunk, s)?;
        let pristine = index_buffers(&steps, WINDOW, s)?;
        let work: Vec<DeviceBuffer> =
            (0..period).map(|_| DeviceBuffer::alloc(n_idx * 4, "work index")).collect::<Result<_>>()?;
        if sync {
            // Wall time per call: the call waits for the device itself.
            let mut v = Vec::new();
            for _ in 0..rounds {
                for j in 0..period {
                    dtod(work[j].ptr, pristine[j].ptr, n_idx * 4, s)?;
                }
                driver::stream_sync(s)?;
                let t = std::time::Instant::now();
                for w in &work {
                    // SAFETY: w holds WINDOW + misses ints on this device.
                    unsafe { ctx.swap_in_raw(0, w.ptr, WINDOW as u32, misses as u32, s as u64)? };
                }
                v.push(t.elapsed().as_secs_f64() * 1e6 / period as f64);
            }
            out[0] = median(v);
        } else {
            let restore_only = Graph::capture(s, || {
                for j in 0..period {
                    dtod(work[j].ptr, pristine[j].ptr, n_idx * 4, s)?;
                }
                Ok(())
            })?;
            let full = Graph::capture(s, || {
                for j in 0..period {
                    dtod(work[j].ptr, pristine[j].ptr, n_idx * 4, s)?;
                    // SAFETY: as above.
                    unsafe { ctx.swap_in_raw(0, work[j].ptr, WINDOW as u32, misses as u32, s as u64)? };
                }
                Ok(())
            })?;
            let t_full = time_ms(s, rounds, || full.launch(s))? * 1e3 / period as f64;
            let t_restore = time_ms(s, rounds, || restore_only.launch(s))? * 1e3 / period as f64;
            driver::stream_sync(s)?;
            let st = ctx.stats(0)?;
            assert_eq!(st.hits, 0, "benchmark steps must be all misses");
            out[1] = (t_full - t_restore).max(0.0);
            out[2] = t_full;
        }
    }
    let per_chunk_us = per_chunk_ms * 1e3;
    let gbps = (misses * chunk) as f64 / (out[1] * 1e-6) / 1e9;
    Ok(SwapRow {
        chunk_bytes: chunk,
        misses,
        per_chunk_memcpy_us: per_chunk_us,
        kvswap_sync_us: out[0],
        kvswap_async_us: out[1],
        kvswap_async_with_restore_us: out[2],
        async_gbps: gbps,
        fraction_of_bulk: gbps / bulk_gbps,
        speedup_vs_per_chunk: per_chunk_us / out[1],
    })
}

/// Decode steps over `layers` layers sharing one selection of `selected`
/// chunks that keeps `keep` of the previous one; each step also stores one
/// new chunk per layer. Returns (hit rate, sync us/step, async us/step).
#[allow(clippy::too_many_arguments)]
fn decode_steps(dev: &Device, s: sys::CUstream, name: &str, layers: usize, cap: usize, selected: usize, keep: f64, store: bool, rounds: usize) -> Result<StepRow> {
    let chunk = 2048;
    let n_steps = 64;
    let mut rng = 0x2545F4914F6CDD1Du64;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let mut steps: Vec<Vec<i32>> = Vec::new();
    let mut prev: Vec<i32> = (0..selected as i32).collect();
    for _ in 0..n_steps {
        let mut seen = std::collections::HashSet::new();
        let mut sel: Vec<i32> = prev.iter().copied().filter(|_| (next() % 10_000) as f64 / 10_000.0 < keep).collect();
        sel.iter().for_each(|&x| {
            seen.insert(x);
        });
        while sel.len() < selected {
            let id = (next() % cap as u64) as i32;
            if seen.insert(id) {
                sel.push(id);
            }
        }
        prev = sel.clone();
        steps.push(sel);
    }
    let n_idx = WINDOW + selected;
    let src = DeviceBuffer::alloc(chunk, "new chunk")?;
    let mut res = [0f64; 2];
    let mut hit_rate = 0.0;
    for (k, sync) in [true, false].into_iter().enumerate() {
        let specs: Vec<_> = (0..layers).map(|_| spec(cap, chunk)).collect();
        let ctx = context(dev.ordinal, 512.max(selected), sync, &specs)?;
        for l in 0..layers {
            prefill(&ctx, l, cap, chunk, s)?;
        }
        let pristine = index_buffers(&steps, WINDOW, s)?;
        let work: Vec<Vec<DeviceBuffer>> = (0..n_steps)
            .map(|_| (0..layers).map(|_| DeviceBuffer::alloc(n_idx * 4, "work")).collect::<Result<Vec<_>>>())
            .collect::<Result<_>>()?;
        let restore = |j: usize| -> Result<()> {
            for w in &work[j] {
                dtod(w.ptr, pristine[j].ptr, n_idx * 4, s)?;
            }
            Ok(())
        };
        let step = |j: usize| -> Result<()> {
            for (l, w) in work[j].iter().enumerate() {
                // SAFETY: src and w are device buffers of the right sizes.
                unsafe {
                    if store {
                        ctx.store_raw(l, &[(cap - 1 - j) as i32], src.ptr, 0, s as u64)?;
                    }
                    ctx.swap_in_raw(l, w.ptr, WINDOW as u32, selected as u32, s as u64)?;
                }
            }
            Ok(())
        };
        let before = ctx.stats(0)?;
        if sync {
            let mut v = Vec::new();
            for _ in 0..rounds {
                for j in 0..n_steps {
                    restore(j)?;
                }
                driver::stream_sync(s)?;
                let t = std::time::Instant::now();
                for j in 0..n_steps {
                    step(j)?;
                }
                v.push(t.elapsed().as_secs_f64() * 1e6 / n_steps as f64);
            }
            res[k] = median(v);
        } else {
            let g_restore = Graph::capture(s, || (0..n_steps).try_for_each(restore))?;
            let g_full = Graph::capture(s, || (0..n_steps).try_for_each(|j| restore(j).and_then(|_| step(j))))?;
            let a = time_ms(s, rounds, || g_full.launch(s))?;
            let b = time_ms(s, rounds, || g_restore.launch(s))?;
            driver::stream_sync(s)?;
            res[k] = (a - b).max(0.0) * 1e3 / n_steps as f64;
            let after = ctx.stats(0)?;
            let (h, m) = (after.hits - before.hits, after.misses - before.misses);
            hit_rate = h as f64 / (h + m).max(1) as f64;
        }
    }
    Ok(StepRow { name: name.to_string(), layers, selected, hit_rate, sync_us: res[0], async_us: res[1] })
}

/// Runs the whole benchmark on device `device`. `quick` shrinks it.
pub fn run(device: i32, quick: bool) -> Result<Report> {
    let dev = Device::open(device)?;
    let _g = dev.bind()?;
    let stream = OwnedStream::new()?;
    let s = stream.0;
    let rounds = if quick { 3 } else { 9 };

    // Physical ceiling: one large pinned -> device copy.
    let bulk_bytes = if quick { 256 << 20 } else { 1 << 30 };
    let host = PinnedBuffer::alloc(bulk_bytes)?;
    let dst = DeviceBuffer::alloc(bulk_bytes, "bulk")?;
    // SAFETY: host buffer of bulk_bytes, written before the copy reads it.
    unsafe { std::ptr::write_bytes(host.host, 0x5a, bulk_bytes) };
    let bulk_ms = time_ms(s, rounds, || unsafe { driver::copy_htod_async(dst.ptr, host.host, bulk_bytes, s) })?;
    let bulk_gbps = bulk_bytes as f64 / (bulk_ms * 1e-3) / 1e9;
    drop((host, dst));

    let mut swap = Vec::new();
    let chunks: &[usize] = if quick { &[2048] } else { &[512, 2048, 8192, 32768] };
    for &chunk in chunks {
        for misses in [64usize, 512, 4096] {
            swap.push(swap_row(&dev, s, chunk, misses, bulk_gbps, rounds)?);
        }
    }
    let mut steps = vec![decode_steps(&dev, s, "all-hit swap-in, 1 layer", 1, 65_536, 512, 1.0, false, rounds)?];
    steps.push(decode_steps(&dev, s, "decode step (store+swap), 21 layers", 21, if quick { 16_384 } else { 65_536 }, 512, 0.9, true, rounds)?);
    Ok(Report { device: format!("{} (sm_{}{}, {} SMs)", dev.name, dev.cc.0, dev.cc.1, dev.sm_count), bulk_h2d_gbps: bulk_gbps, bulk_bytes, swap, steps })
}

/// The report as the table printed by `kvswap bench`.
pub fn render(r: &Report) -> String {
    let mut s = format!("# kvswap swap-in benchmark on {}\n", r.device);
    s += &format!("bulk pinned H2D copy ({} MiB): {:.1} GB/s (the physical ceiling)\n\n", r.bulk_bytes >> 20, r.bulk_h2d_gbps);
    s += &format!(
        "{:>7} {:>7} {:>16} {:>12} {:>13} {:>16} {:>9} {:>8} {:>10}\n",
        "chunk_B", "misses", "per_chunk_cpy_us", "kvswap_sync", "kvswap_async", "async+restore_us", "async_GB/s", "of_bulk", "speedup"
    );
    for w in &r.swap {
        s += &format!(
            "{:>7} {:>7} {:>16.1} {:>12.1} {:>13.1} {:>16.1} {:>9.1} {:>7.0}% {:>9.1}x\n",
            w.chunk_bytes, w.misses, w.per_chunk_memcpy_us, w.kvswap_sync_us, w.kvswap_async_us,
            w.kvswap_async_with_restore_us, w.async_gbps, 100.0 * w.fraction_of_bulk, w.speedup_vs_per_chunk
        );
    }
    s += &format!("\n{:<36} {:>6} {:>8} {:>8} {:>12} {:>13}\n", "step", "layers", "selected", "hit_rate", "sync_us", "async_us");
    for t in &r.steps {
        s += &format!("{:<36} {:>6} {:>8} {:>7.1}% {:>12.1} {:>13.1}\n", t.name, t.layers, t.selected, 100.0 * t.hit_rate, t.sync_us, t.async_us);
    }
    s += "\nasync_us: device time per step from CUDA-graph replay (capture in global mode proves no host wait), \
          minus the graph that only restores index buffers; sync_us: wall time per call with KVSWAP_SYNC=1.\n";
    s
}
