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

use crate::backend::cuda::driver::{self, kernel_params, Device, DeviceBuffer, Event, Graph, Kernel, Module, OwnedStream, PinnedBuffer};
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
        index_topk: slots.min(crate::scorer::FM_MAX_TOPK as usize) as u32, // the scorers' most (above it the config warns)
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

/// Runs the whole benchmark on device `device`. `quick` shrinks it;
/// `chunk_sizes` (bytes per chunk) replaces the swap-in table's sizes.
pub fn run(device: i32, quick: bool, chunk_sizes: Option<&[usize]>) -> Result<Report> {
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
    let chunks: &[usize] = chunk_sizes.unwrap_or(if quick { &[2048] } else { &[512, 2048, 8192, 32768] });
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
    s += "\nasync_us: device time per step from CUDA-graph replay (the capture counts kvswap's host waits and allocations: none), \
          minus the graph that only restores index buffers; sync_us: wall time per call with KVSWAP_SYNC=1.\n";
    s
}

/// Per-GPU figures of the multi-GPU benchmark.
#[derive(Clone, Debug, Serialize)]
pub struct GpuRow {
    pub device: i32,
    pub name: String,
    /// Bulk pinned H2D copy, this GPU alone (GB/s).
    pub bulk_alone_gbps: f64,
    /// The same while every GPU copies at once (GB/s).
    pub bulk_concurrent_gbps: f64,
    /// kvswap async swap-in of 4,096 x 2 KB misses, this GPU alone (GB/s).
    pub swap_alone_gbps: f64,
    /// The same while every GPU swaps in at once (GB/s).
    pub swap_concurrent_gbps: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct MultiReport {
    pub gpus: usize,
    pub rows: Vec<GpuRow>,
}

/// One GPU's workload for the multi-GPU benchmark: everything allocated up
/// front so that the timed phases only copy.
/// Field order is drop order: graphs and buffers go before the kvswap
/// context, and the device (its primary context) last.
struct GpuLoad {
    full: Graph,
    restore: Graph,
    _bufs: Vec<DeviceBuffer>,
    host: PinnedBuffer,
    dst: DeviceBuffer,
    stream: OwnedStream,
    period: usize,
    ctx: Context,
    dev: Device,
}

const MULTI_MISSES: usize = 4096;
const MULTI_CHUNK: usize = 2048;

impl GpuLoad {
    fn new(ordinal: i32, bulk_bytes: usize) -> Result<GpuLoad> {
        let dev = Device::open(ordinal)?;
        let _g = dev.bind()?;
        let stream = OwnedStream::new()?;
        let s = stream.0;
        let host = PinnedBuffer::alloc(bulk_bytes)?;
        // SAFETY: host buffer of bulk_bytes.
        unsafe { std::ptr::write_bytes(host.host, 0x33, bulk_bytes) };
        let dst = DeviceBuffer::alloc(bulk_bytes, "bulk")?;
        let (misses, slots) = (MULTI_MISSES, MULTI_MISSES);
        let cap = 2 * slots + 2 * misses;
        let period = cap / misses;
        let ctx = context(ordinal, slots, false, &[spec(cap, MULTI_CHUNK)])?;
        prefill(&ctx, 0, cap, MULTI_CHUNK, s)?;
        let steps: Vec<Vec<i32>> = (0..period).map(|j| (0..misses).map(|i| ((j * misses + i) % cap) as i32).collect()).collect();
        let n_idx = WINDOW + misses;
        let pristine = index_buffers(&steps, WINDOW, s)?;
        let work: Vec<DeviceBuffer> = (0..period).map(|_| DeviceBuffer::alloc(n_idx * 4, "work")).collect::<Result<_>>()?;
        let restore = Graph::capture(s, || (0..period).try_for_each(|j| dtod(work[j].ptr, pristine[j].ptr, n_idx * 4, s)))?;
        let full = Graph::capture(s, || {
            (0..period).try_for_each(|j| {
                dtod(work[j].ptr, pristine[j].ptr, n_idx * 4, s)?;
                // SAFETY: device buffers of WINDOW + misses ints.
                unsafe { ctx.swap_in_raw(0, work[j].ptr, WINDOW as u32, misses as u32, s as u64) }
            })
        })?;
        let mut bufs = pristine;
        bufs.extend(work);
        drop(_g);
        Ok(GpuLoad { full, restore, _bufs: bufs, host, dst, stream, period, ctx, dev })
    }

    fn bulk_gbps(&self, rounds: usize) -> Result<f64> {
        let _g = self.dev.bind()?;
        let s = self.stream.0;
        // SAFETY: both buffers hold host.bytes.
        let ms = time_ms(s, rounds, || unsafe { driver::copy_htod_async(self.dst.ptr, self.host.host, self.host.bytes, s) })?;
        Ok(self.host.bytes as f64 / (ms * 1e-3) / 1e9)
    }

    fn swap_gbps(&self, rounds: usize) -> Result<f64> {
        let _g = self.dev.bind()?;
        let s = self.stream.0;
        let a = time_ms(s, rounds, || self.full.launch(s))?;
        let b = time_ms(s, rounds, || self.restore.launch(s))?;
        let us = (a - b).max(1e-6) * 1e3 / self.period as f64;
        let _ = &self.ctx;
        Ok((MULTI_MISSES * MULTI_CHUNK) as f64 / (us * 1e-6) / 1e9)
    }
}

/// Runs `f` on every GPU at once (one thread each), after a common start.
fn concurrently(loads: &[GpuLoad], f: impl Fn(&GpuLoad) -> Result<f64> + Sync) -> Result<Vec<f64>> {
    let barrier = std::sync::Barrier::new(loads.len());
    std::thread::scope(|sc| {
        let hs: Vec<_> = loads
            .iter()
            .map(|l| {
                let (f, barrier) = (&f, &barrier);
                sc.spawn(move || {
                    barrier.wait();
                    f(l)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("benchmark thread panicked")).collect()
    })
}

/// Swap-in and bulk H2D bandwidth per GPU, each GPU alone and all at once
/// (shared PCIe switches and host memory are the question).
pub fn run_multi(quick: bool) -> Result<MultiReport> {
    let n = driver::device_count()? as usize;
    let rounds = if quick { 3 } else { 7 };
    let bulk = if quick { 256 << 20 } else { 1 << 30 };
    let loads: Vec<GpuLoad> = (0..n as i32).map(|d| GpuLoad::new(d, bulk)).collect::<Result<_>>()?;
    let mut rows = Vec::new();
    for l in &loads {
        rows.push(GpuRow {
            device: l.dev.ordinal,
            name: l.dev.name.clone(),
            bulk_alone_gbps: l.bulk_gbps(rounds)?,
            bulk_concurrent_gbps: 0.0,
            swap_alone_gbps: l.swap_gbps(rounds)?,
            swap_concurrent_gbps: 0.0,
        });
    }
    let bulk_all = concurrently(&loads, |l| l.bulk_gbps(rounds))?;
    let swap_all = concurrently(&loads, |l| l.swap_gbps(rounds))?;
    for (i, r) in rows.iter_mut().enumerate() {
        r.bulk_concurrent_gbps = bulk_all[i];
        r.swap_concurrent_gbps = swap_all[i];
    }
    Ok(MultiReport { gpus: n, rows })
}

pub fn render_multi(r: &MultiReport) -> String {
    let mut s = format!(
        "# kvswap multi-GPU swap-in: {} GPU(s), one context and one thread per GPU; swap-in = {} misses x {} B, async (graph)\n",
        r.gpus, MULTI_MISSES, MULTI_CHUNK
    );
    s += &format!("{:>6} {:<14} {:>14} {:>17} {:>14} {:>17}\n", "device", "name", "bulk_alone", "bulk_all_at_once", "swap_alone", "swap_all_at_once");
    for g in &r.rows {
        s += &format!(
            "{:>6} {:<14} {:>10.1} GB/s {:>12.1} GB/s {:>9.1} GB/s {:>12.1} GB/s\n",
            g.device, g.name.chars().take(14).collect::<String>(), g.bulk_alone_gbps, g.bulk_concurrent_gbps, g.swap_alone_gbps, g.swap_concurrent_gbps
        );
    }
    let sum = |f: fn(&GpuRow) -> f64| r.rows.iter().map(f).sum::<f64>();
    s += &format!(
        "total, all at once: bulk {:.1} GB/s, swap-in {:.1} GB/s\n",
        sum(|g| g.bulk_concurrent_gbps),
        sum(|g| g.swap_concurrent_gbps)
    );
    s
}

// ------------------------------------------------------------------ scorer

use crate::backend::cuda::scorer::CudaScorer;
use crate::scorer::{write as fmwrite, Checkpoint, KeyDtype, KeysRef, Meta, ScoreMode, ScorerBackend, SeqRef, WeightDtype};

/// One scorer configuration: kvswap's time beside its memory floor.
#[derive(Clone, Debug, Serialize)]
pub struct FmRow {
    pub scope: String,
    pub keys: String,
    pub chunks: usize,
    pub k: usize,
    /// One call per graph, an event pair around each replay, median: the
    /// way the PyTorch baseline times itself.
    pub kvswap_us: f64,
    /// Per call of 20 calls replayed back to back from one graph (a decode
    /// loop: launch costs amortised, consecutive calls overlap a little).
    pub back_to_back_us: f64,
    /// Bytes that must be read once (keys, plus weights in `full`).
    pub bytes: u64,
    /// bytes / measured device bandwidth (us).
    pub floor_us: f64,
    pub ratio_to_floor: f64,
    /// Scoring arithmetic (2 * scorers * heads * head_dim per chunk) per second.
    pub tflops: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct FmBatchRow {
    pub seqs: usize,
    pub chunks_per_seq: usize,
    pub batch_us: f64,
    pub per_seq_us: f64,
    pub single_call_us: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct FmStepRow {
    pub layers: usize,
    pub chunks: usize,
    pub k: usize,
    pub hit_rate: f64,
    pub scorer_us: f64,
    /// The whole step: scorer, the copy of the top-k into every layer's index
    /// buffer (a swap-in rewrites it in place), and the swap-ins.
    pub step_us: f64,
    /// The 21 top-k copies alone.
    pub copies_us: f64,
    /// step - scorer: the copies and the swap-ins.
    pub overhead_us: f64,
    /// step / scorer.
    pub ratio_to_scorer: f64,
    /// The same step with the layers' copies and swap-ins spread over
    /// several streams forked from the scorer's (each layer's swap-in
    /// depends only on the top-k, so an engine may issue them side by side).
    pub streams: Vec<FmStepStreams>,
    /// The step through one `kvswap_swap_in_layers` call (top-k copies
    /// included; on CUDA one launch pair for the 21 layers).
    pub layers_call: FmStepStreams,
    /// Host time to issue the layers' copies and swap-ins eagerly: one copy
    /// and one `swap_in_selected` call per layer, and one
    /// `kvswap_swap_in_layers` call (us, median).
    pub host_per_layer_us: f64,
    pub host_layers_call_us: f64,
}

impl FmStepStreams {
    fn new(streams: usize, step_us: f64, scorer_us: f64) -> FmStepStreams {
        FmStepStreams { streams, step_us, overhead_us: (step_us - scorer_us).max(0.0), ratio_to_scorer: step_us / scorer_us }
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct FmStepStreams {
    /// Streams the 21 layers are spread over (layer l on stream l % streams).
    pub streams: usize,
    pub step_us: f64,
    /// step - scorer.
    pub overhead_us: f64,
    /// step / scorer.
    pub ratio_to_scorer: f64,
}

/// The score scope at one size under a given score distribution: how many
/// candidates the selection's threshold bin holds decides its path.
#[derive(Clone, Debug, Serialize)]
pub struct FmSpreadRow {
    pub scores: String,
    pub chunks: usize,
    pub k: usize,
    /// Keys above the threshold bin (certainly in the top-k) and in it.
    pub sure: u32,
    pub ties: u32,
    pub kvswap_us: f64,
    pub back_to_back_us: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct FmReport {
    pub device: String,
    /// Device-to-device copy, bytes read + written per second (GB/s).
    pub copy_gbps: f64,
    /// A streaming read of the same buffer (kernels/bench.cu), bytes read per
    /// second (GB/s): what a kernel that only reads, as the projections and
    /// the scoring do, can reach. The floors use the copy rate.
    pub read_gbps: f64,
    /// One empty kernel per graph, timed as the rows are (event pair around
    /// each replay, median): the method's floor, in every row (us).
    pub launch_floor_us: f64,
    /// The same with three empty kernels (a call's launches: scoring, two
    /// for the top-k).
    pub launch_floor3_us: f64,
    pub scorers: usize,
    pub heads: usize,
    pub head_dim: usize,
    pub hidden: usize,
    pub weight_bytes: u64,
    pub rows: Vec<FmRow>,
    pub batch: Vec<FmBatchRow>,
    pub spread: Vec<FmSpreadRow>,
    pub step: Option<FmStepRow>,
}

/// Random finite bf16 bits (|x| in [2^-7, 2^4)) or fp8 e4m3 codes (never NaN).
fn random_keys(dtype: KeyDtype, n: usize, dim: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    match dtype {
        KeyDtype::Bf16 => (0..n * dim)
            .flat_map(|_| {
                let r = next();
                let bits = ((r & 1) << 15) as u16 | (((120 + (r >> 1) % 11) as u16) << 7) | ((r >> 8) & 0x7f) as u16;
                bits.to_le_bytes()
            })
            .collect(),
        _ => (0..n * dim)
            .map(|_| {
                let c = (next() & 0xff) as u8;
                if c & 0x7f == 0x7f { c & 0xf0 } else { c }
            })
            .collect(),
    }
}

/// Bf16 keys clustered around one random key: key = base + eps * noise
/// (both from random_keys), so every score lies near the base key's score.
fn clustered_keys(n: usize, dim: usize, eps: f32, seed: u64) -> Vec<u8> {
    let f = |b: &[u8]| -> Vec<f32> { b.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect() };
    let base = f(&random_keys(KeyDtype::Bf16, 1, dim, seed));
    let noise = f(&random_keys(KeyDtype::Bf16, n, dim, seed + 1));
    noise.iter().enumerate().flat_map(|(i, &x)| half::bf16::from_f32(base[i % dim] + eps * x).to_le_bytes()).collect()
}

struct FmBench<'a> {
    dev: &'a Device,
    s: sys::CUstream,
    scorer: CudaScorer,
    meta: Meta,
    rounds: usize,
}

impl FmBench<'_> {
    fn upload(&self, bytes: &[u8], what: &str) -> Result<DeviceBuffer> {
        let b = DeviceBuffer::alloc(bytes.len().max(16), what)?;
        // SAFETY: b holds bytes.len(); synced before `bytes` is released.
        unsafe { driver::copy_htod_async(b.ptr, bytes.as_ptr(), bytes.len(), self.s)? };
        driver::stream_sync(self.s)?;
        Ok(b)
    }

    /// Median us of one call captured alone in a graph, an event pair around
    /// each of `reps` replays (as torch_fm_baseline.py times PyTorch).
    fn single_graph_us(&self, body: impl Fn() -> Result<()>) -> Result<f64> {
        for _ in 0..5 {
            body()?; // warm-up, sizes the workspace outside capture
        }
        driver::stream_sync(self.s)?;
        let g = Graph::capture(self.s, &body)?;
        let reps = if self.rounds < 9 { 20 } else { 100 };
        Ok(time_ms(self.s, reps, || g.launch(self.s))? * 1e3)
    }

    /// Median us per call of `calls` calls replayed from one graph.
    fn graph_us(&self, calls: usize, body: impl Fn() -> Result<()>) -> Result<f64> {
        body()?; // warm-up, sizes the workspace outside capture
        driver::stream_sync(self.s)?;
        let g = Graph::capture(self.s, || (0..calls).try_for_each(|_| body()))?;
        Ok(time_ms(self.s, self.rounds, || g.launch(self.s))? * 1e3 / calls as f64)
    }

    /// `n` per-chunk scales of 1.0 (f32).
    fn unit_scales(&self, n: usize) -> Result<DeviceBuffer> {
        self.upload(&(0..n).flat_map(|_| 1.0f32.to_le_bytes()).collect::<Vec<u8>>(), "scales")
    }

    fn keys(&self, dtype: KeyDtype, n: usize) -> Result<(DeviceBuffer, DeviceBuffer)> {
        let d = self.meta.head_dim as usize;
        let keys = self.upload(&random_keys(dtype, n, d, 0x9e37 + n as u64), "keys")?;
        let scales = self.unit_scales(n)?;
        Ok((keys, scales))
    }
}

/// Bytes per second (GB/s) a streaming read of `bytes` of `buf` reaches
/// (kvswap_read_probe: four 16-byte loads in flight per thread, a full
/// device of threads, nothing written).
fn read_rate(dev: &Device, probe: &Kernel, buf: &DeviceBuffer, bytes: usize, s: sys::CUstream, rounds: usize) -> Result<f64> {
    let blocks = 8 * dev.sm_count as u32;
    let out = DeviceBuffer::alloc(4 * blocks as usize, "read probe out")?;
    let (mut p, mut n, mut never, mut o) = (buf.ptr, (bytes / 16) as u64, 0x9E37_79B9u32, out.ptr);
    let mut params = kernel_params![p, n, never, o];
    // SAFETY: parameters match kvswap_read_probe(const uint4*, u64, u32,
    // u32*); p holds n 16-byte items, o one u32 per block.
    let ms = time_ms(s, rounds, || unsafe { probe.launch(blocks, 256, 0, s, &mut params) })?;
    Ok(bytes as f64 / (ms * 1e-3) / 1e9)
}

/// `kernels` empty kernels (kvswap_read_probe over nothing, one block) on
/// `s`: the timing method's own floor when timed as a scorer call is.
fn empty_kernels(probe: &Kernel, kernels: usize, out: u64, s: sys::CUstream) -> Result<()> {
    (0..kernels).try_for_each(|_| {
        let (mut p, mut n, mut never, mut o) = (out, 0u64, 1u32, out);
        let mut params = kernel_params![p, n, never, o];
        // SAFETY: parameters match kvswap_read_probe(const uint4*, u64, u32,
        // u32*); n = 0 items: nothing is read, the fold stays 0, and o (one
        // u32) would be written only if the fold equalled `never` (1).
        unsafe { probe.launch(1, 32, 0, s, &mut params) }
    })
}

/// The FlashMemory scorer benchmark: `score` (q and w given) and `full`
/// (with the projections) scopes, bf16 and fp8 keys, the batched form, and a
/// whole decode step (scorer -> swap-in of 21 layers sharing the top-k).
pub fn run_fm(device: i32, quick: bool) -> Result<FmReport> {
    let dev = Device::open(device)?;
    let _g = dev.bind()?;
    let stream = OwnedStream::new()?;
    let s = stream.0;
    let rounds = if quick { 3 } else { 9 };
    // Device bandwidth: a large device-to-device copy (read + write).
    let copy_bytes = 1usize << 31;
    let (a, b) = (DeviceBuffer::alloc(copy_bytes, "copy a")?, DeviceBuffer::alloc(copy_bytes, "copy b")?);
    let copy_ms = time_ms(s, rounds, || dtod(b.ptr, a.ptr, copy_bytes, s))?;
    let copy_gbps = 2.0 * copy_bytes as f64 / (copy_ms * 1e-3) / 1e9;
    // kernels/bench.cu's read probe: the read rate, and (empty) the floor.
    let probe_module = Module::load(&crate::backend::cuda::nvrtc::compile_cached("bench.cu", crate::kernels::BENCH_CU, dev.cc)?)?;
    let probe = probe_module.function(c"kvswap_read_probe")?;
    let read_gbps = read_rate(&dev, &probe, &a, copy_bytes, s, rounds)?;
    drop((a, b));

    let meta = Meta { n_scorers: 3, hidden: 4096, n_heads: 64, head_dim: 128, ensemble: crate::config::Ensemble::Max };
    let tensors = fmwrite::random(&meta, WeightDtype::Bf16, 7)?;
    let ckpt = Checkpoint::from_bytes(fmwrite::to_bytes(&meta, &tensors)?)?;
    drop(tensors);
    let scorer = CudaScorer::new(&ckpt, device, false)?;
    let weight_bytes = scorer.weights().0;
    let bench = FmBench { dev: &dev, s, scorer, meta, rounds };
    // The timing method's own floor, timed as every row is (one graph per
    // call, event pairs around its replays): the graph launch and the events.
    let probe_out = DeviceBuffer::alloc(16, "launch floor out")?;
    let launch_floor_us = bench.single_graph_us(|| empty_kernels(&probe, 1, probe_out.ptr, s))?;
    let launch_floor3_us = bench.single_graph_us(|| empty_kernels(&probe, 3, probe_out.ptr, s))?;
    let (sc, h, d, hid) = (3usize, 64usize, 128usize, 4096usize);
    let k = 512usize;
    let e = crate::config::Ensemble::Max;
    let hidden: Vec<u8> = (0..sc * hid).flat_map(|i| (((i * 7919) % 1000) as f32 / 500.0 - 1.0).to_le_bytes()).collect();
    let hidden = bench.upload(&hidden, "hidden")?;
    let qbits: Vec<u8> = random_keys(KeyDtype::Bf16, sc * h, d, 99);
    let q = bench.upload(&qbits, "q")?;
    let wvals: Vec<u8> = (0..sc * h).flat_map(|i| (((i * 37) % 100) as f32 / 50.0 - 1.0).to_le_bytes()).collect();
    let w = bench.upload(&wvals, "w")?;
    let out = DeviceBuffer::alloc(4 * k * 64, "out")?;
    let sizes: &[usize] = if quick { &[262_144] } else { &[16_384, 65_536, 262_144, 1_048_576] };
    let mut rows = Vec::new();
    for &n in sizes {
        // fp8 keys with the default fp8 query, and with the wide (bf16) one
        // (KVSWAP_FM_QUERY=wide).
        for (dtype, fp8_query, name) in [(KeyDtype::Bf16, true, "bf16"), (KeyDtype::Fp8E4m3, true, "fp8"), (KeyDtype::Fp8E4m3, false, "fp8 wide q")] {
            let mode = ScoreMode { ensemble: e, fp8_query };
            let (keys, scales) = bench.keys(dtype, n)?;
            let seq = SeqRef {
                hidden: hidden.ptr,
                keys: KeysRef { data: keys.ptr, scales: scales.ptr, row_stride: 0, dtype },
                n_chunks: n,
                out: out.ptr,
            };
            let key_bytes = (n * d * dtype.size() + if dtype == KeyDtype::Fp8E4m3 { 4 * n } else { 0 }) as u64;
            for scope in ["score", "full"] {
                let call = || -> Result<()> {
                    // SAFETY: device buffers of the documented sizes.
                    unsafe {
                        if scope == "score" {
                            bench.scorer.score_with_qw(&[seq], &[(q.ptr, w.ptr)], k, mode, s as u64)
                        } else {
                            bench.scorer.score_topk(&seq, k, mode, s as u64)
                        }
                    }
                };
                let us = bench.single_graph_us(call)?;
                let back_to_back_us = bench.graph_us(20, call)?;
                let bytes = key_bytes + if scope == "full" { weight_bytes } else { 0 };
                let floor = bytes as f64 / (copy_gbps * 1e9) * 1e6;
                let flop = 2.0 * (sc * h * d) as f64 * n as f64;
                rows.push(FmRow {
                    scope: scope.into(),
                    keys: name.into(),
                    chunks: n,
                    k,
                    kvswap_us: us,
                    back_to_back_us,
                    bytes,
                    floor_us: floor,
                    ratio_to_floor: us / floor,
                    tflops: flop / (us * 1e-6) / 1e12,
                });
            }
        }
    }
    // Batched: B sequences of 32K chunks, each with its own hidden state and
    // keys, one call, beside B single calls.
    let mut batch = Vec::new();
    let per = 32_768usize;
    let hiddens: Vec<u8> = (0..64 * sc * hid)
        .map(|i| (((i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 40) % 1000) as f32 / 500.0 - 1.0)
        .flat_map(f32::to_le_bytes)
        .collect();
    let hiddens = bench.upload(&hiddens, "hidden states")?;
    for bsz in [1usize, 8, 64] {
        let (keys, scales) = bench.keys(KeyDtype::Bf16, per * bsz)?;
        let seqs: Vec<SeqRef> = (0..bsz)
            .map(|i| SeqRef {
                hidden: hiddens.ptr + (i * sc * hid * 4) as u64,
                keys: KeysRef { data: keys.ptr + (i * per * d * 2) as u64, scales: scales.ptr, row_stride: 0, dtype: KeyDtype::Bf16 },
                n_chunks: per,
                out: out.ptr + (4 * k * i) as u64,
            })
            .collect();
        // SAFETY: device buffers of the documented sizes.
        let batch_us = bench.graph_us(5, || unsafe { bench.scorer.score_topk_batch(&seqs, k, e.into(), s as u64) })?;
        let single_us = bench.graph_us(5, || unsafe { bench.scorer.score_topk(&seqs[0], k, e.into(), s as u64) })?;
        batch.push(FmBatchRow { seqs: bsz, chunks_per_seq: per, batch_us, per_seq_us: batch_us / bsz as f64, single_call_us: single_us });
    }
    // Score distributions (score scope, bf16 keys, 262,144 chunks): random
    // keys, q and w (a wide spread, scores of both signs); positive head
    // weights (every score a sum of relus); keys clustered around one key
    // (a trained indexer's scores can crowd into a few histogram bins).
    let mut spread = Vec::new();
    let n = 262_144usize;
    let wpos: Vec<u8> = (0..sc * h).flat_map(|i| (0.5 + ((i * 37) % 100) as f32 / 100.0).to_le_bytes()).collect();
    let wpos = bench.upload(&wpos, "w")?;
    let scales = bench.unit_scales(n)?;
    for (name, eps, weights) in [
        ("random", None, &w),
        ("positive weights", None, &wpos),
        ("clustered keys, eps 0.1", Some(0.1f32), &wpos),
        ("clustered keys, eps 0.01", Some(0.01f32), &wpos),
    ] {
        let bytes = match eps {
            None => random_keys(KeyDtype::Bf16, n, d, 0x9e37 + n as u64),
            Some(eps) => clustered_keys(n, d, eps, 0x5eed),
        };
        let keys = bench.upload(&bytes, "keys")?;
        let seq = SeqRef {
            hidden: hidden.ptr,
            keys: KeysRef { data: keys.ptr, scales: scales.ptr, row_stride: 0, dtype: KeyDtype::Bf16 },
            n_chunks: n,
            out: out.ptr,
        };
        // SAFETY: device buffers of the documented sizes.
        let call = || unsafe { bench.scorer.score_with_qw(&[seq], &[(q.ptr, weights.ptr)], k, e, s as u64) };
        let us = bench.single_graph_us(call)?;
        let back_to_back_us = bench.graph_us(20, call)?;
        let (sure, ties) = bench.scorer.last_candidates(s as u64)?.unwrap_or((0, 0));
        spread.push(FmSpreadRow { scores: name.into(), chunks: n, k, sure, ties, kvswap_us: us, back_to_back_us });
    }
    let step = Some(decode_step(&bench, &hidden, if quick { 65_536 } else { 262_144 }, k)?);
    Ok(FmReport {
        device: format!("{} (sm_{}{}, {} SMs)", dev.name, dev.cc.0, dev.cc.1, dev.sm_count),
        copy_gbps,
        read_gbps,
        launch_floor_us,
        launch_floor3_us,
        scorers: sc,
        heads: h,
        head_dim: d,
        hidden: hid,
        weight_bytes,
        rows,
        batch,
        spread,
        step,
    })
}

/// Scorer -> swap-in for 21 layers sharing the global top-k, over a slowly
/// drifting hidden state; captured as one graph of `steps` decode steps.
fn decode_step(bench: &FmBench, hidden0: &DeviceBuffer, chunks: usize, k: usize) -> Result<FmStepRow> {
    let (s, layers, steps) = (bench.s, 21usize, 32usize);
    let e = crate::config::Ensemble::Max;
    let d = bench.meta.head_dim as usize;
    let hid = (bench.meta.n_scorers * bench.meta.hidden) as usize;
    // Hidden states drifting by ~2% per step.
    let mut h = vec![0f32; hid];
    // SAFETY: hidden0 holds hid f32; synced below.
    unsafe { driver::copy_dtoh_async(h.as_mut_ptr() as *mut u8, hidden0.ptr, 4 * hid, s)? };
    driver::stream_sync(s)?;
    let mut x = 0x1234_5678u64;
    let mut hiddens = Vec::with_capacity(steps);
    for _ in 0..steps {
        for v in h.iter_mut() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *v += 0.02 * ((x % 2001) as f32 / 1000.0 - 1.0);
        }
        hiddens.push(bench.upload(&h.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>(), "hidden t")?);
    }
    let (keys, _scales) = bench.keys(KeyDtype::Bf16, chunks)?;
    let topk = DeviceBuffer::alloc(4 * k, "topk")?;
    let n_idx = WINDOW + k;
    let idx: Vec<DeviceBuffer> = (0..layers).map(|_| DeviceBuffer::alloc(4 * n_idx, "layer indices")).collect::<Result<_>>()?;
    let ctx = context(bench.dev.ordinal, 512, false, &(0..layers).map(|_| spec(chunks, 2048)).collect::<Vec<_>>())?;
    for l in 0..layers {
        prefill(&ctx, l, chunks, 2048, s)?;
    }
    let seq = |t: usize| SeqRef {
        hidden: hiddens[t].ptr,
        keys: KeysRef { data: keys.ptr, scales: 0, row_stride: 0, dtype: KeyDtype::Bf16 },
        n_chunks: chunks,
        out: topk.ptr,
    };
    let score = |t: usize| -> Result<()> { unsafe { bench.scorer.score_topk(&seq(t), k, e.into(), s as u64) } };
    let copies = || -> Result<()> { idx.iter().try_for_each(|b| dtod(b.ptr + 4 * WINDOW as u64, topk.ptr, 4 * k, s)) };
    let swaps = || -> Result<()> {
        // SAFETY: index buffers of WINDOW + k ints.
        idx.iter().enumerate().try_for_each(|(l, b)| unsafe { ctx.swap_in_raw(l, b.ptr, WINDOW as u32, k as u32, s as u64) })
    };
    // Warm-up outside capture (workspace, residency).
    score(0)?;
    copies()?;
    swaps()?;
    driver::stream_sync(s)?;
    let g_scorer = Graph::capture(s, || (0..steps).try_for_each(&score))?;
    let g_copies = Graph::capture(s, || (0..steps).try_for_each(|t| score(t).and_then(|_| copies())))?;
    let g_full = Graph::capture(s, || (0..steps).try_for_each(|t| score(t).and_then(|_| copies()).and_then(|_| swaps())))?;
    // The step with layer l's copy and swap-in on side stream l % p: the
    // side streams fork from `s` after the scorer and join it at the end of
    // each step (event record / wait inside the capture: graph edges).
    let side: Vec<OwnedStream> = (0..layers).map(|_| OwnedStream::new()).collect::<Result<_>>()?;
    let fork = Event::new(false)?;
    let joins: Vec<Event> = (0..layers).map(|_| Event::new(false)).collect::<Result<_>>()?;
    let spread_step = |p: usize, t: usize| -> Result<()> {
        score(t)?;
        fork.record(s)?;
        for st in &side[..p] {
            driver::stream_wait_event(st.0, &fork, false)?;
        }
        for (l, b) in idx.iter().enumerate() {
            let ss = side[l % p].0;
            dtod(b.ptr + 4 * WINDOW as u64, topk.ptr, 4 * k, ss)?;
            // SAFETY: index buffers of WINDOW + k ints.
            unsafe { ctx.swap_in_raw(l, b.ptr, WINDOW as u32, k as u32, ss as u64)? };
        }
        for (st, j) in side[..p].iter().zip(&joins) {
            j.record(st.0)?;
            driver::stream_wait_event(s, j, false)?;
        }
        Ok(())
    };
    let g_spread: Vec<(usize, Graph)> = [3usize, 7, 21]
        .into_iter()
        .map(|p| Graph::capture(s, || (0..steps).try_for_each(|t| spread_step(p, t))).map(|g| (p, g)))
        .collect::<Result<_>>()?;
    // The same through kvswap_swap_in_layers: one call copies the top-k into
    // every layer's entries and swaps all layers in with one launch pair.
    let requests: Vec<crate::KvswapSwapIn> = idx
        .iter()
        .enumerate()
        .map(|(l, b)| crate::KvswapSwapIn { layer: l as u32, window_len: WINDOW as u32, count: k as u32, reserved: 0, indices: b.ptr as *mut i32 })
        .collect();
    // SAFETY: index buffers of WINDOW + k ints, topk of k, none overlapping.
    let layers_call = || -> Result<()> { unsafe { ctx.swap_in_layers_raw(&requests, topk.ptr, s as u64) } };
    layers_call()?; // warm-up
    driver::stream_sync(s)?;
    let g_layers = Graph::capture(s, || (0..steps).try_for_each(|t| score(t).and_then(|_| layers_call())))?;
    let before = ctx.stats(0)?;
    let t_full = time_ms(s, bench.rounds, || g_full.launch(s))? * 1e3 / steps as f64;
    driver::stream_sync(s)?;
    let after = ctx.stats(0)?;
    let t_copies = time_ms(s, bench.rounds, || g_copies.launch(s))? * 1e3 / steps as f64;
    let t_scorer = time_ms(s, bench.rounds, || g_scorer.launch(s))? * 1e3 / steps as f64;
    let mut streams = Vec::with_capacity(g_spread.len());
    for (p, g) in &g_spread {
        let t = time_ms(s, bench.rounds, || g.launch(s))? * 1e3 / steps as f64;
        streams.push(FmStepStreams::new(*p, t, t_scorer));
    }
    let t_layers = time_ms(s, bench.rounds, || g_layers.launch(s))? * 1e3 / steps as f64;
    driver::stream_sync(s)?;
    ctx.sync_stream(s as u64)?;
    // Host time to issue the 21 layers' copies and swap-ins eagerly (no
    // graph, as an engine without graphs issues them): median over steps,
    // the device drained between steps so launches never wait for queue room.
    let host_us = |issue: &dyn Fn() -> Result<()>| -> Result<f64> {
        let mut v = Vec::with_capacity(bench.rounds.max(20));
        for _ in 0..bench.rounds.max(20) {
            let t0 = std::time::Instant::now();
            issue()?;
            v.push(t0.elapsed().as_secs_f64() * 1e6);
            driver::stream_sync(s)?;
            ctx.sync_stream(s as u64)?;
        }
        Ok(median(v))
    };
    let host_per_layer_us = host_us(&|| copies().and_then(|_| swaps()))?;
    let host_layers_call_us = host_us(&layers_call)?;
    let (hh, mm) = (after.hits - before.hits, after.misses - before.misses);
    let _ = d;
    Ok(FmStepRow {
        layers,
        chunks,
        k,
        hit_rate: hh as f64 / (hh + mm).max(1) as f64,
        scorer_us: t_scorer,
        step_us: t_full,
        copies_us: (t_copies - t_scorer).max(0.0),
        overhead_us: (t_full - t_scorer).max(0.0),
        ratio_to_scorer: t_full / t_scorer,
        streams,
        layers_call: FmStepStreams::new(layers, t_layers, t_scorer),
        host_per_layer_us,
        host_layers_call_us,
    })
}

pub fn render_fm(r: &FmReport) -> String {
    let mut s = format!(
        "# FlashMemory scorer on {}: {} scorers x {} heads x {} dims, hidden {}, bf16 weights {:.1} MB; device copy {:.0} GB/s (read+write), read {:.0} GB/s\n",
        r.device, r.scorers, r.heads, r.head_dim, r.hidden, r.weight_bytes as f64 / 1e6, r.copy_gbps, r.read_gbps
    );
    s += &format!(
        "{:>6} {:>10} {:>9} {:>5} {:>11} {:>13} {:>10} {:>9} {:>9}\n",
        "scope", "keys", "chunks", "k", "kvswap_us", "back2back_us", "floor_us", "x_floor", "TFLOP/s"
    );
    for w in &r.rows {
        s += &format!(
            "{:>6} {:>10} {:>9} {:>5} {:>11.1} {:>13.1} {:>10.1} {:>8.2}x {:>9.0}\n",
            w.scope, w.keys, w.chunks, w.k, w.kvswap_us, w.back_to_back_us, w.floor_us, w.ratio_to_floor, w.tflops
        );
    }
    s += "kvswap_us: one call per graph, median of event-timed replays (the baseline's method); \
          back2back_us: per call of 20 calls in one graph\n";
    s += &format!(
        "the method's floor (graph launch and events): {:.1} us for a graph of one empty kernel, {:.1} us for three\n",
        r.launch_floor_us, r.launch_floor3_us
    );
    s += &format!("\n{:>5} {:>14} {:>10} {:>12} {:>16}\n", "seqs", "chunks_per_seq", "batch_us", "per_seq_us", "single_call_us");
    for b in &r.batch {
        s += &format!("{:>5} {:>14} {:>10.1} {:>12.1} {:>16.1}\n", b.seqs, b.chunks_per_seq, b.batch_us, b.per_seq_us, b.single_call_us);
    }
    s += &format!("\n{:>26} {:>9} {:>5} {:>8} {:>8} {:>11} {:>13}\n", "scores (score scope, bf16)", "chunks", "k", "sure", "ties", "kvswap_us", "back2back_us");
    for w in &r.spread {
        s += &format!(
            "{:>26} {:>9} {:>5} {:>8} {:>8} {:>11.1} {:>13.1}\n",
            w.scores, w.chunks, w.k, w.sure, w.ties, w.kvswap_us, w.back_to_back_us
        );
    }
    if let Some(t) = &r.step {
        s += &format!(
            "\ndecode step: scorer ({} chunks, k={}) -> swap-in of {} layers sharing the top-k, drifting hidden state: \
             hit rate {:.1}%, scorer {:.1} us, whole step {:.1} us ({:.2}x the scorer alone): {:.1} us over the scorer, \
             of which {:.1} us copy the top-k into the layers' index buffers\n",
            t.chunks,
            t.k,
            t.layers,
            100.0 * t.hit_rate,
            t.scorer_us,
            t.step_us,
            t.ratio_to_scorer,
            t.overhead_us,
            t.copies_us
        );
        let w = &t.layers_call;
        s += &format!(
            "  one kvswap_swap_in_layers call (top-k copies included, one launch pair for all layers): whole step {:.1} us ({:.2}x the scorer alone), {:.1} us over the scorer\n",
            w.step_us, w.ratio_to_scorer, w.overhead_us
        );
        s += &format!(
            "  host time to issue them eagerly (no graph): {:.1} us as one copy and one kvswap_swap_in_selected per layer, \
             {:.1} us as one kvswap_swap_in_layers call\n",
            t.host_per_layer_us, t.host_layers_call_us
        );
        for w in &t.streams {
            s += &format!(
                "  the layers' copies and swap-ins on {:>2} streams forked from the scorer's: whole step {:.1} us ({:.2}x the scorer alone), {:.1} us over the scorer\n",
                w.streams, w.step_us, w.ratio_to_scorer, w.overhead_us
            );
        }
    }
    s
}
