//! The simulated decode loop behind `kvswap demo`: a context of `layers`
//! sparse layers on a kvswap [`Context`], prefilled with every compressed
//! chunk of the prompt, then `steps` decode steps that each append a token
//! (a new chunk every `ratio` tokens, stored into every layer) and swap the
//! step's selection into every layer.
//!
//! # The selection pattern
//! One global top-k shared by all layers, as in the reference engine. Step
//! `t` keeps `round(locality x k)` chunks of step `t-1`'s selection (a random
//! subset) and draws the rest fresh, without duplicates: each fresh chunk is,
//! with probability `recent_frac`, one of the `recent_chunks` newest chunks,
//! and otherwise uniform over the whole stored history. `locality` models how
//! stable attention is from token to token; `recent_frac` how much of it goes
//! to the recent past. Everything is driven by a seeded [`SplitMix64`], so a
//! run is reproducible and a sweep compares slot counts on the same sequence.
//!
//! What is timed: the library calls of a step (store of the new chunk and the
//! swap-in of every layer), not the drawing of the selection, which stands in
//! for the scorer.

use crate::config::{BackendChoice, Config};
use crate::context::Context;
use crate::error::{Error, Result};
use crate::layer::{KvswapLayerSpec, KvswapLayerStats};
use crate::plan::{self, Dtype, LayerClass, Model, PlanError};
use crate::BackendKind;
use serde::Serialize;
use std::time::{Duration, Instant};

/// Settings of one demo run (the `kvswap demo` flags).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct DemoParams {
    /// Tokens of context at the start of decode (the prompt).
    pub context: u64,
    /// Tokens per compressed chunk.
    pub ratio: u32,
    /// Sparse layers, all at `ratio`.
    pub layers: u32,
    /// f32 elements per chunk.
    pub kv_dim: u32,
    /// Staging slots per layer.
    pub gpu_chunks: u32,
    /// Chunks selected per step (the global top-k).
    pub topk: u32,
    /// Decode steps.
    pub steps: u64,
    /// Fraction of the previous step's selection kept, in `[0, 1]`.
    pub locality: f64,
    /// Fraction of fresh picks taken from the newest chunks, in `[0, 1]`.
    pub recent_frac: f64,
    /// How many of the newest chunks count as "recent".
    pub recent_chunks: u32,
    pub seed: u64,
    /// Sliding-window tokens (the physical id of slot s is `window + s`).
    pub window: u32,
    #[serde(serialize_with = "ser_backend")]
    pub backend: BackendChoice,
}

fn ser_backend<S: serde::Serializer>(b: &BackendChoice, s: S) -> std::result::Result<S::Ok, S::Error> {
    s.serialize_str(backend_name(*b))
}

/// `auto`, `cpu` or `cuda`.
pub fn backend_name(b: BackendChoice) -> &'static str {
    match b {
        BackendChoice::Auto => "auto",
        BackendChoice::Cpu => "cpu",
        BackendChoice::Cuda => "cuda",
    }
}

impl Default for DemoParams {
    fn default() -> DemoParams {
        DemoParams {
            context: 256 << 10,
            ratio: 4,
            layers: 4,
            kv_dim: 512,
            gpu_chunks: 512,
            topk: 512,
            steps: 2000,
            locality: 0.8,
            recent_frac: 0.25,
            recent_chunks: 1024,
            seed: 1,
            window: 128,
            backend: BackendChoice::Auto,
        }
    }
}

/// Limits of a demo run (each is far above a real model or a useful run;
/// they keep a typo from asking for terabytes).
const MAX_STEPS: u64 = 1 << 24;
const MAX_LAYERS: u64 = 4096;
const MAX_WINDOW: u64 = 1 << 20;

impl DemoParams {
    /// Checks the settings; errors name the flag.
    pub fn validate(&self) -> std::result::Result<(), PlanError> {
        let min1 = |what: &str, v: u64| if v == 0 { Err(PlanError::new(what, v, "must be >= 1")) } else { Ok(()) };
        min1("--ratio", self.ratio as u64)?;
        min1("--layers", self.layers as u64)?;
        min1("--kv-dim", self.kv_dim as u64)?;
        min1("--gpu-chunks", self.gpu_chunks as u64)?;
        min1("--topk", self.topk as u64)?;
        min1("--recent-chunks", self.recent_chunks as u64)?;
        if self.context < self.ratio as u64 {
            return Err(PlanError::new(
                "--context",
                self.context,
                format!("needs at least --ratio={} tokens so that one chunk is stored", self.ratio),
            ));
        }
        if self.gpu_chunks < self.topk {
            return Err(PlanError::new(
                "--gpu-chunks",
                self.gpu_chunks,
                format!("every selected chunk needs a slot: must be >= --topk={}", self.topk),
            ));
        }
        for (what, v) in [("--locality", self.locality), ("--recent-frac", self.recent_frac)] {
            if !(0.0..=1.0).contains(&v) {
                return Err(PlanError::new(what, v, "must be in [0, 1]"));
            }
        }
        if self.steps > MAX_STEPS {
            return Err(PlanError::new("--steps", self.steps, format!("at most {MAX_STEPS} decode steps")));
        }
        if self.layers as u64 > MAX_LAYERS {
            return Err(PlanError::new("--layers", self.layers, format!("at most {MAX_LAYERS} layers")));
        }
        if self.window as u64 > MAX_WINDOW {
            return Err(PlanError::new("--window", self.window, format!("at most {MAX_WINDOW} tokens")));
        }
        if self.gpu_chunks as u64 + self.window as u64 >= crate::layer::PHYS_ID_BOUND {
            return Err(PlanError::new("--gpu-chunks", self.gpu_chunks, "--window + --gpu-chunks must stay below 2^30 (int32 physical ids)"));
        }
        if self.context.checked_add(self.steps).is_none() || self.capacity() >= crate::layer::ID_COUNT_MAX {
            return Err(PlanError::new("--context", self.context, "context + steps is too long for int32 chunk ids"));
        }
        if self.kv_dim as u64 * 4 > crate::layer::CHUNK_BYTES_MAX {
            return Err(PlanError::new("--kv-dim", self.kv_dim, "a chunk of 4 x kv_dim bytes must fit in 1 GiB"));
        }
        Ok(())
    }

    /// Chunks stored per layer when decode starts.
    pub fn initial_chunks(&self) -> u64 {
        self.context / self.ratio as u64
    }

    /// `compressed_cap` of every layer: room for the prompt and every decode step.
    pub fn capacity(&self) -> u64 {
        (self.context + self.steps).div_ceil(self.ratio as u64).max(1)
    }

    /// Host tier of all layers, in bytes (saturating).
    pub fn host_bytes(&self) -> u64 {
        self.capacity().saturating_mul(self.chunk_bytes() as u64).saturating_mul(self.layers as u64)
    }

    /// The planner's model of this demo (f32 chunks).
    pub fn model(&self) -> Model {
        Model {
            layers: vec![LayerClass { count: self.layers, ratio: self.ratio }],
            kv_dim: self.kv_dim,
            dtype: Dtype::F32,
            window: self.window,
            gpu_chunks: self.gpu_chunks,
            ..Model::default()
        }
    }

    fn chunk_bytes(&self) -> usize {
        self.kv_dim as usize * 4
    }

    fn config(&self, backend: BackendChoice) -> Config {
        let pinned = self.host_bytes();
        Config {
            backend,
            enable: true,
            gpu_chunks: self.gpu_chunks,
            index_topk: self.topk,
            window: self.window,
            pinned_mib: plan::suggested_pinned_mib(pinned),
            ..Config::default()
        }
    }
}

/// What one run measured.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct DemoReport {
    pub gpu_chunks: u32,
    /// The backend the context ran on (`cpu` or `cuda`).
    pub backend: String,
    pub backend_description: String,
    /// Set when the backend differs from the one asked for, and why.
    pub note: Option<String>,
    pub steps: u64,
    pub prefill_chunks: u64,
    pub prefill_s: f64,
    pub step_us_mean: f64,
    pub step_us_p50: f64,
    pub step_us_p99: f64,
    /// `1 / mean step time` (library work only).
    pub steps_per_s: f64,
    pub hits: u64,
    pub misses: u64,
    pub evictions: u64,
    /// `hits / (hits + misses)` over all layers and decode steps.
    pub hit_rate: f64,
    /// Host tier -> staging bytes per decode step, all layers.
    pub h2d_bytes_per_step: f64,
    /// Engine -> host tier bytes per decode step, all layers (new chunks).
    pub d2h_bytes_per_step: f64,
    /// GPU KV of the demo's layers at `context`, from the planner.
    pub gpu_bytes_no_swap: u64,
    pub gpu_bytes_swap: u64,
    /// Pinned host tier at `context`, from the planner.
    pub pinned_bytes: u64,
}

/// A small, fast, seeded PRNG (SplitMix64, Steele et al. 2014). Not for
/// cryptography; enough to draw selections reproducibly.
#[derive(Clone, Debug)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    pub fn new(seed: u64) -> SplitMix64 {
        SplitMix64(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in `0..n` (`n >= 1`), by multiply-shift.
    pub fn below(&mut self, n: u64) -> u64 {
        ((self.next_u64() as u128 * n as u128) >> 64) as u64
    }
    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

/// Draws each step's global selection (see the module docs).
pub struct Selector {
    rng: SplitMix64,
    topk: u32,
    locality: f64,
    recent_frac: f64,
    recent_chunks: u32,
    selection: Vec<i32>,
    /// `mark[id] == stamp` when `id` is in the selection being built.
    mark: Vec<u32>,
    stamp: u32,
}

impl Selector {
    /// A selector over ids `0..capacity`.
    pub fn new(p: &DemoParams, capacity: u64) -> Selector {
        Selector {
            rng: SplitMix64::new(p.seed),
            topk: p.topk,
            locality: p.locality,
            recent_frac: p.recent_frac,
            recent_chunks: p.recent_chunks.max(1),
            selection: Vec::with_capacity(p.topk as usize),
            mark: vec![0; capacity as usize],
            stamp: 0,
        }
    }

    /// The next selection over the `stored` chunks `0..stored`: distinct ids,
    /// `min(topk, stored)` of them.
    pub fn next(&mut self, stored: u32) -> &[i32] {
        let k = self.topk.min(stored) as usize;
        self.new_stamp();
        let keep = ((self.locality * k as f64).round() as usize).min(self.selection.len());
        self.keep_random_subset(keep);
        for i in 0..self.selection.len() {
            self.mark[self.selection[i] as usize] = self.stamp;
        }
        while self.selection.len() < k {
            let id = self.fresh(stored);
            self.mark[id as usize] = self.stamp;
            self.selection.push(id as i32);
        }
        &self.selection
    }

    fn new_stamp(&mut self) {
        self.stamp = self.stamp.wrapping_add(1);
        if self.stamp == 0 {
            self.mark.fill(0);
            self.stamp = 1;
        }
    }

    /// Keeps a uniformly random subset of `keep` ids of the last selection.
    fn keep_random_subset(&mut self, keep: usize) {
        let n = self.selection.len();
        for i in 0..keep {
            let j = i + self.rng.below((n - i) as u64) as usize;
            self.selection.swap(i, j);
        }
        self.selection.truncate(keep);
    }

    /// A chunk not yet in the selection (`stored` > selection length).
    fn fresh(&mut self, stored: u32) -> u32 {
        for _ in 0..32 {
            let id = self.draw(stored);
            if self.mark[id as usize] != self.stamp {
                return id;
            }
        }
        // Dense selection: walk from a random start to the next free id.
        let start = self.rng.below(stored as u64) as u32;
        (0..stored).map(|d| (start + d) % stored).find(|&id| self.mark[id as usize] != self.stamp).unwrap_or(start)
    }

    fn draw(&mut self, stored: u32) -> u32 {
        if self.rng.unit() < self.recent_frac {
            let span = self.recent_chunks.min(stored);
            stored - 1 - self.rng.below(span as u64) as u32
        } else {
            self.rng.below(stored as u64) as u32
        }
    }
}

/// Mean, p50 and p99 of step times, in microseconds.
fn percentiles(times: &mut [Duration]) -> (f64, f64, f64) {
    if times.is_empty() {
        return (0.0, 0.0, 0.0);
    }
    times.sort_unstable();
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    let mean = times.iter().map(|&d| us(d)).sum::<f64>() / times.len() as f64;
    let at = |q: f64| us(times[((q * times.len() as f64).ceil() as usize).clamp(1, times.len()) - 1]);
    (mean, at(0.50), at(0.99))
}

/// Sum of the counters of every layer.
fn total_stats(ctx: &Context) -> Result<KvswapLayerStats> {
    let mut t = KvswapLayerStats::default();
    for l in 0..ctx.n_layers() {
        let s = ctx.stats(l)?;
        t.hits += s.hits;
        t.misses += s.misses;
        t.evictions += s.evictions;
        t.h2d_bytes += s.h2d_bytes;
        t.d2h_bytes += s.d2h_bytes;
    }
    Ok(t)
}

/// Writes chunk `id` of `layer` into `buf`: recognisable bytes, cheap to make
/// (as many of the 8 as a chunk holds: --kv-dim 1 is 4 bytes).
fn fill_chunk(buf: &mut [u8], layer: usize, id: u32) {
    for (d, s) in buf.iter_mut().zip(id.to_le_bytes().into_iter().chain((layer as u32).to_le_bytes())) {
        *d = s;
    }
}

/// Stores chunk `id` into every layer.
fn store_everywhere(ctx: &Context, buf: &mut [u8], id: u32) -> Result<()> {
    for layer in 0..ctx.n_layers() {
        fill_chunk(buf, layer, id);
        ctx.store(layer, id as i32, buf)?;
    }
    Ok(())
}

fn create_context(p: &DemoParams, backend: BackendChoice) -> Result<Context> {
    let spec = KvswapLayerSpec {
        compressed_cap: p.capacity(),
        chunk_bytes: p.chunk_bytes() as u64,
        staging: std::ptr::null_mut(),
        staging_stride: 0,
    };
    Context::new(p.config(backend), &vec![spec; p.layers as usize])
}

/// Stores every chunk of the prompt into every layer, in batches (one call
/// per batch, as an engine's prefill would).
fn prefill(ctx: &Context, p: &DemoParams) -> Result<()> {
    const BATCH: usize = 1024;
    let n = p.chunk_bytes();
    let total = p.initial_chunks() as u32;
    // One batch of rows (no more than the prompt's chunks), or
    // OUT_OF_MEMORY rather than an abort (chunks may be up to 1 GiB).
    let batch_rows = BATCH.min(total as usize).max(1);
    let mut rows = crate::error::try_vec(n * batch_rows, "the prefill rows")?;
    rows.resize(n * batch_rows, 0);
    for layer in 0..ctx.n_layers() {
        let mut first = 0u32;
        while first < total {
            let ids: Vec<i32> = (first..total.min(first + batch_rows as u32)).map(|i| i as i32).collect();
            for (k, &id) in ids.iter().enumerate() {
                fill_chunk(&mut rows[k * n..(k + 1) * n], layer, id as u32);
            }
            ctx.store_rows(layer, &ids, &rows[..ids.len() * n])?;
            first += batch_rows as u32;
        }
    }
    Ok(())
}

/// Creates the context and prefills it; notes when `auto` fell back to the CPU.
fn open_prefilled(p: &DemoParams) -> Result<(Context, Option<String>)> {
    let ctx = create_context(p, p.backend)?;
    let auto_note = (p.backend == BackendChoice::Auto && ctx.backend_kind() == BackendKind::Cpu).then(|| {
        "backend auto found no CUDA build, driver or device; running on the CPU backend (--verbose shows why)"
            .to_string()
    });
    prefill(&ctx, p)?;
    Ok((ctx, auto_note))
}

/// Runs one demo. `progress(done_steps)` is called after every decode step.
pub fn run(p: &DemoParams, progress: &mut dyn FnMut(u64)) -> Result<DemoReport> {
    p.validate().map_err(|e| Error::invalid(e.to_string()))?;
    let t0 = Instant::now();
    let (ctx, note) = open_prefilled(p)?;
    let prefill_s = t0.elapsed().as_secs_f64();
    let before = total_stats(&ctx)?;
    let times = decode(&ctx, p, progress)?;
    let after = total_stats(&ctx)?;
    Ok(report(p, &ctx, note, prefill_s, times, before, after))
}

/// The decode loop; returns the time of every step.
fn decode(ctx: &Context, p: &DemoParams, progress: &mut dyn FnMut(u64)) -> Result<Vec<Duration>> {
    let mut selector = Selector::new(p, p.capacity());
    let mut buf = vec![0u8; p.chunk_bytes()];
    let mut idx: Vec<i32> = Vec::with_capacity(p.window as usize + p.topk as usize);
    let mut stored = p.initial_chunks() as u32;
    let mut tokens = p.context;
    let mut times = Vec::with_capacity(p.steps as usize);
    for step in 0..p.steps {
        tokens += 1;
        let t_store = Instant::now();
        if tokens.is_multiple_of(p.ratio as u64) {
            store_everywhere(ctx, &mut buf, stored)?;
            stored += 1;
        }
        let mut took = t_store.elapsed();
        let selection = selector.next(stored);
        let t_swap = Instant::now();
        for layer in 0..ctx.n_layers() {
            idx.clear();
            idx.extend(0..p.window as i32);
            idx.extend_from_slice(selection);
            ctx.swap_in(layer, &mut idx, p.window)?;
        }
        took += t_swap.elapsed();
        times.push(took);
        progress(step + 1);
    }
    Ok(times)
}

fn report(
    p: &DemoParams,
    ctx: &Context,
    note: Option<String>,
    prefill_s: f64,
    mut times: Vec<Duration>,
    before: KvswapLayerStats,
    after: KvswapLayerStats,
) -> DemoReport {
    let (mean, p50, p99) = percentiles(&mut times);
    let (hits, misses) = (after.hits - before.hits, after.misses - before.misses);
    let steps = p.steps.max(1) as f64;
    let mem = plan::plan(&p.model(), p.context).ok();
    DemoReport {
        gpu_chunks: p.gpu_chunks,
        backend: ctx.backend_kind().name().to_string(),
        backend_description: ctx.backend_description(),
        note,
        steps: p.steps,
        prefill_chunks: p.initial_chunks() * p.layers as u64,
        prefill_s,
        step_us_mean: mean,
        step_us_p50: p50,
        step_us_p99: p99,
        steps_per_s: if mean > 0.0 { 1e6 / mean } else { 0.0 },
        hits,
        misses,
        evictions: after.evictions - before.evictions,
        hit_rate: if hits + misses > 0 { hits as f64 / (hits + misses) as f64 } else { 0.0 },
        h2d_bytes_per_step: (after.h2d_bytes - before.h2d_bytes) as f64 / steps,
        d2h_bytes_per_step: (after.d2h_bytes - before.d2h_bytes) as f64 / steps,
        gpu_bytes_no_swap: mem.as_ref().map_or(0, |m| m.gpu_bytes_no_swap_total),
        gpu_bytes_swap: mem.as_ref().map_or(0, |m| m.gpu_bytes_swap_total),
        pinned_bytes: mem.as_ref().map_or(0, |m| m.pinned_bytes_total),
    }
}

/// Runs the demo once per slot count, on the same selection sequence.
/// `progress(run_index, done_steps)` is called after every step.
pub fn sweep(p: &DemoParams, gpu_chunks: &[u32], progress: &mut dyn FnMut(usize, u64)) -> Result<Vec<DemoReport>> {
    gpu_chunks
        .iter()
        .enumerate()
        .map(|(i, &c)| run(&DemoParams { gpu_chunks: c, ..p.clone() }, &mut |s| progress(i, s)))
        .collect()
}

/// The sweep plot: hit rate, steps/s and host-to-device bytes per step
/// against `gpu_chunks` (log2 axis), one panel each.
pub fn sweep_chart(p: &DemoParams, reports: &[DemoReport]) -> crate::svg::Chart {
    use crate::svg::{Chart, Panel, Series};
    let series = |label: &str, f: fn(&DemoReport) -> f64| Series {
        label: label.to_string(),
        points: reports.iter().map(|r| (r.gpu_chunks as f64, f(r))).collect(),
    };
    let panel = |title: &str, y: &str, s: Series| Panel {
        title: title.into(),
        y_label: y.into(),
        series: vec![s],
        y_from_zero: true,
    };
    Chart {
        title: "kvswap demo --sweep: hit rate, speed and traffic vs staging slots".into(),
        subtitle: format!(
            "{} layers at ratio {}, context {} tokens, top-k {}, locality {}, recent-frac {}, {} steps per run, seed {}, {} backend",
            p.layers,
            p.ratio,
            plan::tokens_short(p.context),
            p.topk,
            p.locality,
            p.recent_frac,
            p.steps,
            p.seed,
            reports.first().map_or("?", |r| r.backend.as_str())
        ),
        x_label: "gpu_chunks (staging slots per layer)".into(),
        x_log2: true,
        panels: vec![
            panel("hit rate vs gpu_chunks", "hit rate (%)", series("hit rate %", |r| r.hit_rate * 100.0)),
            panel("decode steps per second vs gpu_chunks", "steps/s", series("steps/s", |r| r.steps_per_s)),
            panel(
                "bytes moved host -> staging per step vs gpu_chunks",
                "h2d bytes / step",
                series("h2d bytes/step", |r| r.h2d_bytes_per_step),
            ),
        ],
    }
}

/// One row of the CPU swap-in benchmark (`kvswap bench --backend cpu`).
#[derive(Clone, Debug, Serialize)]
pub struct CpuSwapRow {
    pub chunk_bytes: usize,
    pub misses: usize,
    /// Wall time of one swap_in_selected call that misses every chunk (us).
    pub us_per_call: f64,
    /// Bytes copied into slots per second (GB/s).
    pub gbps: f64,
}

/// Swap-in cost on the CPU backend (bookkeeping and copies) for the chunk
/// sizes and miss counts of the CUDA benchmark.
pub fn cpu_swap_bench(quick: bool) -> Result<Vec<CpuSwapRow>> {
    let chunks: &[usize] = if quick { &[2048] } else { &[512, 2048, 8192, 32768] };
    let mut rows = Vec::new();
    for &chunk in chunks {
        for misses in [64usize, 512, 4096] {
            let slots = misses.max(512);
            let cap = 2 * slots + 2 * misses;
            let period = cap / misses;
            let cfg = Config {
                enable: true,
                gpu_chunks: slots as u32,
                index_topk: slots.min(crate::scorer::FM_MAX_TOPK as usize) as u32, // the scorers' most (above it the config warns)
                backend: BackendChoice::Cpu,
                ..Config::default()
            };
            let spec = KvswapLayerSpec { compressed_cap: cap as u64, chunk_bytes: chunk as u64, staging: std::ptr::null_mut(), staging_stride: 0 };
            let ctx = Context::new(cfg, &[spec])?;
            let ids: Vec<i32> = (0..cap as i32).collect();
            let data: Vec<u8> = (0..cap * chunk).map(|i| (i * 31) as u8).collect();
            ctx.store_rows(0, &ids, &data)?;
            let calls = if quick { 2 * period } else { (8 * period).max(64) };
            let mut idx = vec![0i32; 128 + misses];
            let mut total = Duration::ZERO;
            for c in 0..calls {
                let j = c % period;
                for (i, v) in idx[128..].iter_mut().enumerate() {
                    *v = ((j * misses + i) % cap) as i32;
                }
                let t = Instant::now();
                ctx.swap_in(0, &mut idx, 128)?;
                if c >= period {
                    total += t.elapsed();
                }
            }
            let us = total.as_secs_f64() * 1e6 / (calls - period) as f64;
            rows.push(CpuSwapRow { chunk_bytes: chunk, misses, us_per_call: us, gbps: (misses * chunk) as f64 / (us * 1e-6) / 1e9 });
        }
    }
    Ok(rows)
}

/// The CPU benchmark as a table.
pub fn render_cpu_swap_bench(rows: &[CpuSwapRow]) -> String {
    let mut s = String::from("# kvswap swap-in on the CPU backend (host memory plays the device; every selected chunk misses)\n");
    s += &format!("{:>8} {:>7} {:>12} {:>8}\n", "chunk_B", "misses", "us_per_call", "GB/s");
    for r in rows {
        s += &format!("{:>8} {:>7} {:>12.1} {:>8.2}\n", r.chunk_bytes, r.misses, r.us_per_call, r.gbps);
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small() -> DemoParams {
        DemoParams { context: 16 << 10, steps: 64, layers: 2, backend: BackendChoice::Cpu, ..DemoParams::default() }
    }

    #[test]
    fn prng_is_deterministic_and_in_range() {
        let (mut a, mut b) = (SplitMix64::new(7), SplitMix64::new(7));
        for _ in 0..1000 {
            assert_eq!(a.next_u64(), b.next_u64());
            assert!(a.below(10) < 10);
            let u = a.unit();
            assert!((0.0..1.0).contains(&u));
            b.below(10);
            b.unit();
        }
        assert_ne!(SplitMix64::new(1).next_u64(), SplitMix64::new(2).next_u64());
    }

    #[test]
    fn selections_are_distinct_stored_and_keep_locality() {
        let p = DemoParams { topk: 64, locality: 0.75, ..small() };
        let mut s = Selector::new(&p, 4096);
        let first: Vec<i32> = s.next(1000).to_vec();
        let second: Vec<i32> = s.next(1000).to_vec();
        for sel in [&first, &second] {
            assert_eq!(sel.len(), 64);
            let mut d = sel.clone();
            d.sort();
            d.dedup();
            assert_eq!(d.len(), 64, "distinct ids");
            assert!(sel.iter().all(|&id| (0..1000).contains(&id)));
        }
        let kept = second.iter().filter(|id| first.contains(id)).count();
        assert!(kept >= 48, "75% of 64 kept, got {kept}");
        // Fewer stored chunks than k: all of them, once each.
        let mut s = Selector::new(&p, 4096);
        let mut all = s.next(10).to_vec();
        all.sort();
        assert_eq!(all, (0..10).collect::<Vec<_>>());
    }

    #[test]
    fn validation_names_flags() {
        let e = DemoParams { gpu_chunks: 256, ..small() }.validate().unwrap_err();
        assert_eq!(e.what, "--gpu-chunks");
        let e = DemoParams { locality: 1.5, ..small() }.validate().unwrap_err();
        assert_eq!(e.what, "--locality");
        let e = DemoParams { context: 2, ..small() }.validate().unwrap_err();
        assert_eq!(e.what, "--context");
    }

    #[test]
    fn runs_on_cpu_and_counts_bytes() {
        let p = small();
        let r = run(&p, &mut |_| {}).unwrap();
        assert_eq!(r.backend, "cpu");
        assert_eq!(r.steps, 64);
        assert_eq!(r.hits + r.misses, 64 * 2 * 512, "every selected chunk is a hit or a miss");
        assert_eq!(r.h2d_bytes_per_step, r.misses as f64 * 2048.0 / 64.0);
        // 64 tokens at ratio 4 make 16 new chunks in each of 2 layers.
        assert_eq!(r.d2h_bytes_per_step, 16.0 * 2.0 * 2048.0 / 64.0);
        assert!(r.hit_rate > 0.5 && r.hit_rate < 1.0, "{}", r.hit_rate);
        assert!(r.step_us_p50 <= r.step_us_p99);
        assert_eq!(r.gpu_bytes_swap, 2 * (128 + 512) * 2048);
    }

    #[test]
    fn more_slots_hit_more() {
        let rs = sweep(&small(), &[512, 4096], &mut |_, _| {}).unwrap();
        assert!(rs[1].hit_rate > rs[0].hit_rate, "{} vs {}", rs[1].hit_rate, rs[0].hit_rate);
        assert!(rs[1].h2d_bytes_per_step < rs[0].h2d_bytes_per_step);
        let svg = sweep_chart(&small(), &rs).to_svg();
        assert!(svg.starts_with("<svg") && svg.contains("</svg>"));
        assert_eq!(svg.matches("<polyline").count(), 3, "three panels, one line each");
    }

    #[test]
    fn explicit_cuda_runs_on_cuda_or_fails_with_no_device() {
        // Never falls back to the CPU: a GPU machine runs it on CUDA, any
        // other machine gets NO_DEVICE.
        match run(&DemoParams { backend: BackendChoice::Cuda, ..small() }, &mut |_| {}) {
            Ok(r) => assert_eq!(r.backend, "cuda"),
            Err(e) => assert_eq!(e.status, crate::KvswapStatus::NoDevice, "{e}"),
        }
    }
}
