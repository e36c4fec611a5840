//! A kvswap context: settings, a backend, and the swap state of every layer.
//!
//! Layers are independent: each sits behind its own mutex, so engine threads
//! working on different layers never wait for each other, and threads sharing
//! a layer are serialised.

use crate::backend::{self, Backend, BackendKind, LayerOps, StreamHandle};
use crate::config::Config;
use crate::error::{Error, KvswapStatus, Result};
use crate::layer::{check_pinned_cap, total_host_bytes, KvswapLayerSpec, KvswapLayerStats, KvswapSwapIn, LayerPlan, StagingView};
use std::sync::{Mutex, MutexGuard};

/// Field order is drop order: the layers (and their device memory) go
/// before the backend that owns the device context.
pub struct Context {
    layers: Vec<Mutex<Box<dyn LayerOps>>>,
    config: Config,
    backend: Box<dyn Backend>,
    plans: Vec<LayerPlan>,
}

impl Context {
    /// Validates `config` and `specs`, applies the guards of DESIGN.md, picks
    /// the backend and allocates every layer.
    pub fn new(config: Config, specs: &[KvswapLayerSpec]) -> Result<Context> {
        crate::logging::init();
        config.validate()?;
        config.check_topk_guard()?;
        if config.index_topk > crate::scorer::FM_MAX_TOPK {
            // An engine's own selection may take more; the scorers refuse it.
            // Said once per context (validate runs for every config read).
            log::warn!(
                "kvswap: index_topk={} (KVSWAP_INDEX_TOPK) is above {}, the most fm_score_topk and fm_bounds_topk select",
                config.index_topk,
                crate::scorer::FM_MAX_TOPK
            );
        }
        if specs.is_empty() {
            return Err(Error::invalid("n_layers is 0: a context needs at least one layer"));
        }
        let plans = specs
            .iter()
            .enumerate()
            .map(|(i, s)| LayerPlan::resolve(i, s, &config))
            .collect::<Result<Vec<_>>>()?;
        let required = total_host_bytes(&plans);
        check_pinned_cap(required, config.pinned_mib)?;
        let backend = backend::select(&config)?;
        if backend.kind() == BackendKind::Cpu {
            for p in &plans {
                if let Some((ptr, _)) = p.staging {
                    backend::refuse_device_memory(ptr, &format!("layer {} staging", p.index))?;
                }
            }
        }
        let layers = backend.create_layers(&plans, &config)?;
        let ctx = Context {
            layers: layers.into_iter().map(Mutex::new).collect(),
            config,
            backend,
            plans,
        };
        ctx.log_created(required);
        Ok(ctx)
    }

    fn log_created(&self, host_bytes: u64) {
        let c = &self.config;
        let swap_layers = self.plans.iter().filter(|p| p.swap).count();
        let max_cap = self.plans.iter().map(|p| p.compressed_cap).max().unwrap_or(0);
        if !c.enable {
            log::info!("kvswap: swap off reason=disabled_by_config (KVSWAP_ENABLE=0) layers={} all_chunks_resident=1", self.plans.len());
        } else if swap_layers == 0 {
            log::info!(
                "kvswap: swap off reason=no_layer_with_compressed_cap_gt_gpu_chunks gpu_chunks={} max_compressed_cap={} layers={}",
                c.gpu_chunks, max_cap, self.plans.len()
            );
        } else {
            log::info!(
                "kvswap: swap on backend={} layers={} swap_layers={} gpu_chunks={} index_topk={} window={} sync={} pinned_mib={:.2} cap_mib={}",
                self.backend.kind().name(), self.plans.len(), swap_layers, c.gpu_chunks, c.index_topk, c.window,
                c.sync as u8, host_bytes as f64 / (1 << 20) as f64, c.pinned_mib
            );
            for p in self.plans.iter().filter(|p| !p.swap) {
                log::info!(
                    "kvswap: layer={} swap off reason=compressed_cap_le_gpu_chunks compressed_cap={} gpu_chunks={}",
                    p.index, p.compressed_cap, c.gpu_chunks
                );
            }
        }
        if c.mem_profile {
            self.log_mem("create", host_bytes);
        }
    }

    /// The `KVSWAP_MEM_PROFILE` line of `stage`: the host tier and the
    /// library-owned staging memory the context holds (create) or frees
    /// (destroy).
    fn log_mem(&self, stage: &str, host_bytes: u64) {
        let staging: u64 = self.plans.iter().filter(|p| p.staging.is_none()).map(|p| p.slots as u64 * p.chunk_bytes as u64).sum();
        log::info!(
            "kvswap_mem stage={stage} backend={} host_tier_mib={:.2} staging_mib={:.2} layers={} device=\"{}\"",
            self.backend.kind().name(),
            host_bytes as f64 / (1 << 20) as f64,
            staging as f64 / (1 << 20) as f64,
            self.plans.len(),
            self.backend.describe()
        );
    }

    pub fn config(&self) -> &Config {
        &self.config
    }
    pub fn backend_kind(&self) -> BackendKind {
        self.backend.kind()
    }
    pub fn backend_description(&self) -> String {
        self.backend.describe()
    }
    pub fn n_layers(&self) -> usize {
        self.plans.len()
    }
    pub fn plan(&self, layer: usize) -> Result<&LayerPlan> {
        self.plans.get(layer).ok_or_else(|| self.bad_layer(layer))
    }
    /// Bytes of host tier (pinned on CUDA) held by this context.
    pub fn host_bytes(&self) -> u64 {
        self.backend.host_bytes(&self.plans)
    }

    fn bad_layer(&self, layer: usize) -> Error {
        Error::out_of_range(format!("layer {layer} is out of range: the context has {} layers", self.plans.len()))
    }

    fn layer(&self, layer: usize) -> Result<LayerGuard<'_>> {
        let m = self.layers.get(layer).ok_or_else(|| self.bad_layer(layer))?;
        // Lines logged while the layer is locked wait for its unlock (a log
        // callback may call back into this layer).
        let quiet = crate::logging::defer();
        // A panic inside a layer operation poisons its mutex, and it may have
        // left the layer half-updated (an internal invariant failed): the
        // layer refuses every later call instead of working on that state.
        let guard = m.lock().map_err(|_| {
            Error::new(
                KvswapStatus::Panic,
                format!("layer {layer} is unusable: an earlier call panicked inside it (KVSWAP_STATUS_PANIC); destroy the context"),
            )
        })?;
        Ok(LayerGuard { guard, _quiet: quiet })
    }

    /// At most `gpu_chunks` entries per call (on a fully resident layer, at
    /// most its `compressed_cap` rows if that is larger).
    fn check_count(&self, layer: usize, plan: &LayerPlan, count: usize) -> Result<()> {
        let max = plan.slots.max(self.config.gpu_chunks) as usize;
        if count > max {
            return Err(Error::out_of_range(if plan.swap {
                format!(
                    "layer {layer}: count={count} selected chunks exceeds gpu_chunks={}{}",
                    self.config.gpu_chunks,
                    if self.config.test_allow_topk_reduction {
                        " (KVSWAP_TEST_ALLOW_TOPK_REDUCTION does not cut the top-k: pass its first gpu_chunks ids)"
                    } else {
                        ""
                    }
                )
            } else {
                format!(
                    "layer {layer}: count={count} selected chunks exceeds the limit {max} of this fully resident \
                     layer (max of gpu_chunks={} and compressed_cap={})",
                    self.config.gpu_chunks, plan.compressed_cap
                )
            }));
        }
        Ok(())
    }

    fn check_id(&self, layer: usize, id: i64) -> Result<u32> {
        let cap = self.plan(layer)?.compressed_cap;
        if id < 0 || id >= cap as i64 {
            return Err(Error::out_of_range(format!(
                "layer {layer}: logical id {id} is outside 0..{cap} (compressed_cap)"
            )));
        }
        Ok(id as u32)
    }

    /// Stores `ids.len()` chunks read from `src + i * src_stride`
    /// (`src_stride == 0` means `chunk_bytes`). All ids are checked first:
    /// on error nothing is stored.
    ///
    /// # Safety
    /// `src` must address readable memory of the backend's space (host on CPU,
    /// device on CUDA) covering every row.
    pub unsafe fn store_raw(&self, layer: usize, ids: &[i32], src: u64, src_stride: usize, stream: StreamHandle) -> Result<()> {
        let plan = self.plan(layer)?;
        if ids.is_empty() {
            return Err(Error::invalid("store of 0 chunks"));
        }
        if src == 0 {
            return Err(Error::null("src"));
        }
        let stride = if src_stride == 0 { plan.chunk_bytes } else { src_stride };
        if stride < plan.chunk_bytes && ids.len() > 1 {
            return Err(Error::invalid(format!(
                "src_stride={src_stride} is smaller than chunk_bytes={}",
                plan.chunk_bytes
            )));
        }
        // The rows' span must be an address range (the backends add it to src).
        if rows_span(ids.len() as u64, stride as u64, plan.chunk_bytes as u64).is_none_or(|b| src.checked_add(b).is_none()) {
            return Err(Error::out_of_range(format!(
                "src_stride={src_stride}: {} rows of it from src {src:#x} run past the end of the address space",
                ids.len()
            )));
        }
        let checked = self.checked_ids(layer, ids)?;
        self.refuse_device_memory(src, "src")?;
        // SAFETY: forwarded caller contract.
        unsafe { self.layer(layer)?.store(&checked, src, stride, stream) }
    }

    /// The ids of a store batch, each checked against `layer`'s capacity.
    /// Rows are numbered in u32 (the backends' row lists); the ids are
    /// reserved fallibly (a huge batch is OUT_OF_MEMORY, not an abort).
    fn checked_ids(&self, layer: usize, ids: &[i32]) -> Result<Vec<u32>> {
        if ids.len() > u32::MAX as usize {
            return Err(Error::out_of_range(format!("n = {}: a store batch holds at most {} rows", ids.len(), u32::MAX)));
        }
        let mut checked = crate::error::try_vec(ids.len(), "the checked ids of a store batch")?;
        for &id in ids {
            checked.push(self.check_id(layer, id as i64)?);
        }
        Ok(checked)
    }

    /// One `swap_in_selected` call (see DESIGN.md, residency rules).
    ///
    /// # Safety
    /// `indices` must address `window_len + count` int32 values of the
    /// backend's memory space that nothing else touches during the call.
    pub unsafe fn swap_in_raw(&self, layer: usize, indices: u64, window_len: u32, count: u32, stream: StreamHandle) -> Result<()> {
        self.check_swap_in_args(layer, indices, window_len, count)?;
        self.refuse_device_memory(indices, "indices")?;
        // SAFETY: forwarded caller contract.
        unsafe { self.layer(layer)?.swap_in(indices, window_len, count, 0, stream) }
    }

    /// On the CPU backend, device memory where it reads host memory
    /// ([`backend::refuse_device_memory`]); nothing on CUDA (its own checks).
    fn refuse_device_memory(&self, ptr: u64, what: &str) -> Result<()> {
        if self.backend.kind() == BackendKind::Cpu {
            backend::refuse_device_memory(ptr, what)?;
        }
        Ok(())
    }

    /// The number of requests of a `kvswap_swap_in_layers` call: at least
    /// one, and at most one per layer (each layer is named at most once).
    pub fn check_request_count(&self, n: usize) -> Result<()> {
        if n == 0 {
            return Err(Error::invalid("n is 0: a kvswap_swap_in_layers call needs at least one request"));
        }
        if n > self.plans.len() {
            return Err(Error::invalid(format!(
                "n = {n} requests, but the context has {} layers: a call swaps each layer in at most once",
                self.plans.len()
            )));
        }
        Ok(())
    }

    /// The host-side checks of one swap-in: layer, NULL indices, count,
    /// window bound, and the entries inside the address space.
    fn check_swap_in_args(&self, layer: usize, indices: u64, window_len: u32, count: u32) -> Result<()> {
        let plan = self.plan(layer)?;
        if indices == 0 {
            return Err(Error::null("indices"));
        }
        self.check_count(layer, plan, count as usize)?;
        if window_len as u64 + plan.slots as u64 >= crate::layer::PHYS_ID_BOUND {
            return Err(Error::out_of_range(format!("window_len={window_len} + slots must stay below 2^30")));
        }
        if indices.checked_add(4 * (window_len as u64 + count as u64)).is_none() {
            return Err(Error::out_of_range("indices + window_len + count runs past the end of the address space"));
        }
        Ok(())
    }

    /// `kvswap_swap_in_layers`: the swap-ins of `requests`, as one
    /// `swap_in_raw` call each, after copying `topk` (0: none; `count` ids
    /// for each request) into the request's selected entries. Every argument
    /// is checked for every request before any layer changes. On CUDA with
    /// `KVSWAP_SYNC=0` the layers share one launch pair (up to 64 of them);
    /// otherwise one after another, in the requests' order.
    ///
    /// # Safety
    /// Each request's `indices` must address `window_len + count` int32
    /// values of the backend's memory space that nothing else touches during
    /// the call; `topk`, when not 0, the largest `count` of them.
    pub unsafe fn swap_in_layers_raw(&self, requests: &[KvswapSwapIn], topk: u64, stream: StreamHandle) -> Result<()> {
        self.check_request_count(requests.len())?;
        let at = |i: usize, r: &KvswapSwapIn, e: Error| r.error(i, e);
        // The bytes each request's selected entries span, and topk's.
        let mut spans: Vec<(u64, u64, Option<usize>)> = Vec::with_capacity(requests.len() + 1);
        let mut max_count = 0u32;
        for (i, r) in requests.iter().enumerate() {
            let indices = r.indices as u64;
            self.check_swap_in_args(r.layer as usize, indices, r.window_len, r.count).map_err(|e| at(i, r, e))?;
            if !indices.is_multiple_of(4) {
                return Err(at(i, r, Error::invalid(format!("indices ({indices:#x}) is not aligned to 4 bytes"))));
            }
            if r.reserved != 0 {
                return Err(at(i, r, Error::invalid(format!("reserved is {}: it must be 0", r.reserved))));
            }
            self.refuse_device_memory(indices, "indices").map_err(|e| at(i, r, e))?;
            let start = indices + 4 * r.window_len as u64; // in the address space: check_swap_in_args
            if r.count > 0 {
                spans.push((start, start + 4 * r.count as u64, Some(i)));
            }
            max_count = max_count.max(r.count);
        }
        let mut layers: Vec<usize> = requests.iter().map(|r| r.layer as usize).collect();
        layers.sort_unstable();
        if let Some(w) = layers.windows(2).find(|w| w[0] == w[1]) {
            let pos: Vec<usize> = requests.iter().enumerate().filter(|(_, r)| r.layer as usize == w[0]).map(|(i, _)| i).collect();
            return Err(Error::invalid(format!(
                "requests[{}] and requests[{}] both name layer {}: a call swaps each layer in at most once",
                pos[0], pos[1], w[0]
            )));
        }
        if topk != 0 {
            if !topk.is_multiple_of(4) {
                return Err(Error::invalid(format!("topk ({topk:#x}) is not aligned to 4 bytes")));
            }
            self.refuse_device_memory(topk, "topk")?;
            let end = topk.checked_add(4 * max_count as u64).ok_or_else(|| Error::out_of_range("topk + count runs past the end of the address space"))?;
            if max_count > 0 {
                spans.push((topk, end, None));
            }
        }
        // Entries written by concurrent blocks must not overlap, nor the
        // topk they are copied from.
        spans.sort_unstable();
        if let Some(w) = spans.windows(2).find(|w| w[1].0 < w[0].1) {
            let name = |x: Option<usize>| x.map_or("topk".to_string(), |i| format!("requests[{i}]'s selected entries"));
            return Err(Error::invalid(format!("{} overlap {}: each layer's entries need a buffer of their own", name(w[0].2), name(w[1].2))));
        }
        // Locked in layer order (two calls sharing layers cannot deadlock),
        // used in the requests' order.
        let mut order: Vec<usize> = (0..requests.len()).collect();
        order.sort_unstable_by_key(|&i| requests[i].layer);
        // Every layer's lines wait until the last of them is unlocked.
        let _quiet = crate::logging::defer();
        let mut guards: Vec<Option<LayerGuard<'_>>> = (0..requests.len()).map(|_| None).collect();
        for &i in &order {
            guards[i] = Some(self.layer(requests[i].layer as usize).map_err(|e| at(i, &requests[i], e))?);
        }
        let mut work: Vec<(&mut Box<dyn LayerOps>, KvswapSwapIn)> =
            guards.iter_mut().zip(requests).map(|(g, r)| (&mut **g.as_mut().expect("locked above"), *r)).collect();
        if self.config.sync {
            crate::backend::check_each(&work, topk, stream)?;
            // SAFETY: forwarded caller contract (both).
            unsafe { crate::backend::check_entries_each(&mut work, topk, stream)? };
            unsafe { crate::backend::swap_in_each(&mut work, topk, stream) }
        } else {
            // SAFETY: forwarded caller contract; checked as that method asks
            // (it checks each layer's pointers and the stream itself).
            unsafe { self.backend.swap_in_layers(&mut work, topk, stream) }
        }
    }

    /// Forgets chunks `first .. first + n` of `layer` (`kvswap_layer_forget`):
    /// each is never stored again until it is stored, a slot holding one is
    /// emptied, and the empty slots become least recently used in ascending
    /// slot index; counters and deferred errors are kept. `first` 0 and `n`
    /// = `compressed_cap` give the layer's state at creation.
    /// `n` = `KVSWAP_FORGET_TO_END` (`u32::MAX`): every chunk from `first` on.
    pub fn forget(&self, layer: usize, first: i32, n: u32, stream: StreamHandle) -> Result<()> {
        let cap = self.plan(layer)?.compressed_cap;
        let n = if n == crate::ffi::KVSWAP_FORGET_TO_END && first >= 0 && first as u64 <= cap as u64 { cap - first as u32 } else { n };
        if first < 0 || first as u64 + n as u64 > cap as u64 {
            return Err(Error::out_of_range(format!(
                "layer {layer}: first_id={first} and n={n} name chunks outside 0..{cap} (compressed_cap)"
            )));
        }
        self.layer(layer)?.forget(first as u32, n, stream)
    }

    /// Counters of `layer`; reports a deferred error first.
    pub fn stats(&self, layer: usize) -> Result<KvswapLayerStats> {
        self.layer(layer)?.stats(true)
    }

    /// Counters of `layer`, leaving a deferred error for a later sync
    /// (`kvswap_layer_stats_peek`).
    pub fn stats_peek(&self, layer: usize) -> Result<KvswapLayerStats> {
        self.layer(layer)?.stats(false)
    }

    /// Waits for outstanding device work of every layer (and for `stream`,
    /// when given: needed after replaying a captured graph) and returns the
    /// first deferred error (clearing all of them).
    pub fn sync_stream(&self, stream: StreamHandle) -> Result<()> {
        self.backend.sync_stream(stream)?;
        self.sync()
    }

    /// Waits for `stream` (when given) and for `layer`'s outstanding device
    /// work, and returns that layer's deferred error only (clearing it):
    /// the other layers' errors stay for their own syncs.
    pub fn sync_layer(&self, layer: usize, stream: StreamHandle) -> Result<()> {
        self.plan(layer)?;
        self.backend.sync_stream(stream)?;
        self.layer(layer)?.sync()
    }

    /// Waits for outstanding device work of every layer and returns the first
    /// deferred error (clearing all of them).
    pub fn sync(&self) -> Result<()> {
        let mut first = Ok(());
        for l in 0..self.layers.len() {
            // A poisoned layer is an error like any other: the later layers
            // are still synced and their deferred errors cleared.
            if let Err(e) = self.layer(l).and_then(|mut g| g.sync()) {
                if first.is_ok() {
                    first = Err(e);
                }
            }
        }
        first
    }

    pub fn staging(&self, layer: usize) -> Result<StagingView> {
        Ok(self.layer(layer)?.staging())
    }

    /// `(slot, chunk)` of every resident chunk of `layer`.
    pub fn residency(&self, layer: usize) -> Result<Vec<(u32, u32)>> {
        self.layer(layer)?.residency()
    }

    // ---- helpers over host memory, on every backend ----
    // On CUDA they copy through a device buffer and wait for the device:
    // convenient for tools and tests, not for a decode loop.

    /// Stores one chunk from a host slice.
    pub fn store(&self, layer: usize, id: i32, src: &[u8]) -> Result<()> {
        self.store_rows(layer, &[id], src)
    }

    /// Stores `ids.len()` chunks from consecutive rows of `rows`.
    pub fn store_rows(&self, layer: usize, ids: &[i32], rows: &[u8]) -> Result<()> {
        let n = self.plan(layer)?.chunk_bytes;
        if ids.is_empty() {
            return Err(Error::invalid("store of 0 chunks"));
        }
        if n.checked_mul(ids.len()) != Some(rows.len()) {
            return Err(Error::invalid(format!(
                "src has {} bytes, {} chunks of chunk_bytes={n} need {}",
                rows.len(),
                ids.len(),
                n as u128 * ids.len() as u128
            )));
        }
        let checked = self.checked_ids(layer, ids)?;
        self.layer(layer)?.store_host(&checked, rows)
    }

    /// Swap-in over a host index buffer: `indices[window_len..]` are the
    /// selected entries.
    pub fn swap_in(&self, layer: usize, indices: &mut [i32], window_len: u32) -> Result<()> {
        let plan = self.plan(layer)?;
        let count = indices
            .len()
            .checked_sub(window_len as usize)
            .ok_or_else(|| Error::invalid("window_len is larger than the index buffer"))?;
        self.check_count(layer, plan, count)?;
        if window_len as u64 + plan.slots as u64 >= crate::layer::PHYS_ID_BOUND {
            return Err(Error::out_of_range(format!("window_len={window_len} + slots must stay below 2^30")));
        }
        self.layer(layer)?.swap_in_host(indices, window_len)
    }

    /// The bytes of staging slot `slot`.
    pub fn slot_bytes(&self, layer: usize, slot: u32) -> Result<Vec<u8>> {
        let rows = self.plan(layer)?.slots;
        if slot >= rows {
            return Err(Error::out_of_range(format!("slot {slot} >= {rows}")));
        }
        self.layer(layer)?.read_slot(slot)
    }
}

/// Bytes from the first of `rows` rows `stride` apart to the end of the last
/// (`last` bytes long), if that fits an address (at most isize::MAX).
pub(crate) fn rows_span(rows: u64, stride: u64, last: u64) -> Option<u64> {
    rows.checked_sub(1)?.checked_mul(stride)?.checked_add(last).filter(|&b| b <= isize::MAX as u64)
}

/// A locked layer; the lines logged meanwhile are written once it is
/// unlocked (fields drop in order: the lock, then the held-back lines).
struct LayerGuard<'a> {
    guard: MutexGuard<'a, Box<dyn LayerOps>>,
    _quiet: crate::logging::Deferred,
}

impl std::ops::Deref for LayerGuard<'_> {
    type Target = Box<dyn LayerOps>;
    fn deref(&self) -> &Self::Target {
        &self.guard
    }
}

impl std::ops::DerefMut for LayerGuard<'_> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.guard
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        let _quiet = crate::logging::defer();
        if self.config.mem_profile {
            self.log_mem("destroy", total_host_bytes(&self.plans));
        }
        for (l, m) in self.layers.iter().enumerate() {
            let mut g = m.lock().unwrap_or_else(|p| p.into_inner());
            // A deferred error nobody collected is reported, then the stats.
            let s = g.stats(true).or_else(|e| {
                log::warn!("kvswap: layer={l} error not collected before destroy: {e}");
                g.stats(true)
            });
            if let Ok(s) = s {
                log::info!("{}", stats_line(l, self.config.gpu_chunks, &s));
            }
        }
    }
}

/// The stats log line, in the original engine's shape: `gpu_chunks` is the
/// configured slot count (the same on every line), then kvswap's own fields,
/// among them the layer's own `slots` (`compressed_cap` when swap is off
/// for it) and `swap`.
pub fn stats_line(layer: usize, gpu_chunks: u32, s: &KvswapLayerStats) -> String {
    format!(
        // The original engine's fields in its order, then kvswap's own.
        "kvswap_stats layer={layer} gpu_chunks={gpu_chunks} compressed_cap={} hits={} misses={} h2d_mib={:.3} d2h_mib={:.3} evictions={} stores={} swap_in_calls={} slots={} swap={}",
        s.compressed_cap, s.hits, s.misses,
        s.h2d_bytes as f64 / (1 << 20) as f64, s.d2h_bytes as f64 / (1 << 20) as f64, s.evictions, s.stores, s.swap_in_calls,
        s.slots, s.swap_enabled
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::BackendChoice;

    /// A layer whose lock a panic poisoned refuses every later call with
    /// KVSWAP_STATUS_PANIC; the other layers keep working.
    #[test]
    fn a_layer_poisoned_by_a_panic_is_refused() {
        let config = Config { backend: BackendChoice::Cpu, gpu_chunks: 4, index_topk: 4, ..Config::default() };
        let spec = KvswapLayerSpec { compressed_cap: 16, chunk_bytes: 32, staging: std::ptr::null_mut(), staging_stride: 0 };
        let ctx = Context::new(config, &[spec, spec]).unwrap();
        ctx.stats(0).unwrap();
        let poisoned = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _g = ctx.layers[0].lock().unwrap();
            panic!("an internal invariant failed mid-update");
        }));
        assert!(poisoned.is_err());
        let e = ctx.stats(0).unwrap_err();
        assert_eq!(e.status, KvswapStatus::Panic, "{e}");
        assert!(e.message.contains("layer 0 is unusable"), "{e}");
        assert_eq!(ctx.sync().unwrap_err().status, KvswapStatus::Panic, "sync reaches the poisoned layer");
        ctx.stats(1).unwrap();
    }

    /// KVSWAP_VALIDATE on the CPU follows the sync rule as CUDA does: with
    /// sync = 0 a mismatch is reported by the next sync, with sync = 1 by
    /// the call.
    #[test]
    fn validation_failures_follow_the_sync_setting() {
        for sync in [false, true] {
            let mut staging = vec![0u8; 4 * 32];
            let config = Config { backend: BackendChoice::Cpu, enable: true, sync, validate: true, gpu_chunks: 4, index_topk: 4, ..Config::default() };
            let spec = KvswapLayerSpec { compressed_cap: 16, chunk_bytes: 32, staging: staging.as_mut_ptr().cast(), staging_stride: 0 };
            let ctx = Context::new(config, &[spec]).unwrap();
            for id in 0..16 {
                ctx.store(0, id, &[id as u8 + 1; 32]).unwrap();
            }
            let mut sel = [4i32];
            ctx.swap_in(0, &mut sel, 0).unwrap();
            // SAFETY: the engine's own staging buffer, 4 rows of 32 bytes;
            // the context is not inside a call.
            unsafe { *staging.as_mut_ptr().add(sel[0] as usize * 32 + 7) ^= 0xff };
            let mut again = [4i32];
            let r = ctx.swap_in(0, &mut again, 0);
            if sync {
                assert_eq!(r.unwrap_err().status, KvswapStatus::ValidationFailed);
            } else {
                r.unwrap();
                assert_eq!(ctx.sync().unwrap_err().status, KvswapStatus::ValidationFailed, "reported by sync");
                ctx.sync().unwrap();
            }
        }
    }

    /// Deferred errors on several layers: sync returns the lowest-numbered
    /// layer's and clears them all (as the header says).
    #[test]
    fn sync_returns_the_lowest_layers_error_and_clears_all() {
        let config = Config { backend: BackendChoice::Cpu, enable: true, sync: false, gpu_chunks: 4, index_topk: 4, ..Config::default() };
        let spec = KvswapLayerSpec { compressed_cap: 16, chunk_bytes: 32, staging: std::ptr::null_mut(), staging_stride: 0 };
        let ctx = Context::new(config, &[spec, spec, spec]).unwrap();
        let mut never_stored = [9i32];
        ctx.swap_in(2, &mut never_stored, 0).unwrap(); // layer 2 first in time
        assert_eq!(never_stored, [-1]);
        let mut out_of_range = [99i32];
        ctx.swap_in(1, &mut out_of_range, 0).unwrap();
        let e = ctx.sync().unwrap_err();
        assert_eq!(e.status, KvswapStatus::OutOfRange, "layer 1's error (the lower layer), not layer 2's: {e}");
        assert!(e.message.contains("layer 1"), "{e}");
        ctx.sync().unwrap(); // layer 2's was cleared too
        ctx.stats(2).unwrap();
    }

    /// A layer's sync returns its own deferred error only: another
    /// layer's stays for kvswap_sync (or its own layer sync).
    #[test]
    fn a_layer_sync_returns_its_own_error_only() {
        let config = Config { backend: BackendChoice::Cpu, enable: true, sync: false, gpu_chunks: 4, index_topk: 4, ..Config::default() };
        let spec = KvswapLayerSpec { compressed_cap: 16, chunk_bytes: 32, staging: std::ptr::null_mut(), staging_stride: 0 };
        let ctx = Context::new(config, &[spec, spec, spec]).unwrap();
        let (mut a, mut b) = ([9i32], [99i32]);
        ctx.swap_in(0, &mut a, 0).unwrap();
        ctx.swap_in(2, &mut b, 0).unwrap();
        assert_eq!(ctx.sync_layer(3, 0).unwrap_err().status, KvswapStatus::OutOfRange, "bad layer");
        ctx.sync_layer(1, 0).unwrap();
        let e = ctx.sync_layer(2, 0).unwrap_err();
        assert!(e.status == KvswapStatus::OutOfRange && e.message.contains("layer 2"), "{e}");
        ctx.sync_layer(2, 0).unwrap();
        // A peek at layer 0's counters leaves its error.
        let peek = ctx.stats_peek(0).unwrap();
        assert_eq!((peek.swap_in_calls, peek.resident), (1, 0));
        assert_eq!(ctx.stats_peek(3).unwrap_err().status, KvswapStatus::OutOfRange, "bad layer");
        let e = ctx.sync().unwrap_err();
        assert!(e.status == KvswapStatus::NotStored && e.message.contains("layer 0"), "layer 0's error was kept: {e}");
        ctx.sync_layer(0, 0).unwrap();
    }

    /// sync() goes on past a poisoned layer: a later layer's deferred error
    /// is cleared too (the first error is returned).
    #[test]
    fn sync_goes_past_a_poisoned_layer() {
        let config = Config { backend: BackendChoice::Cpu, enable: true, sync: false, gpu_chunks: 4, index_topk: 4, ..Config::default() };
        let spec = KvswapLayerSpec { compressed_cap: 16, chunk_bytes: 32, staging: std::ptr::null_mut(), staging_stride: 0 };
        let ctx = Context::new(config, &[spec, spec]).unwrap();
        let mut sel = [9i32];
        ctx.swap_in(1, &mut sel, 0).unwrap(); // chunk 9 never stored: deferred NOT_STORED
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _g = ctx.layers[0].lock().unwrap();
            panic!("poison layer 0");
        }));
        assert_eq!(ctx.sync().unwrap_err().status, KvswapStatus::Panic);
        ctx.stats(1).expect("layer 1's deferred error was cleared by sync");
    }

    /// A context reused for a new sequence: forgetting every chunk of a
    /// layer refuses the old sequence's chunks until they are stored again,
    /// the next swap-ins place and stage as in a new context, and the
    /// counters and a deferred error are kept. Bad ranges change nothing.
    #[test]
    fn forget_reuses_a_layer_for_a_new_sequence() {
        let config = Config { backend: BackendChoice::Cpu, enable: true, sync: false, gpu_chunks: 4, index_topk: 4, ..Config::default() };
        let spec = KvswapLayerSpec { compressed_cap: 16, chunk_bytes: 32, staging: std::ptr::null_mut(), staging_stride: 0 };
        let ctx = Context::new(config.clone(), &[spec, spec]).unwrap();
        let fresh = Context::new(config, &[spec]).unwrap();
        for id in 0..16 {
            ctx.store(0, id, &[id as u8; 32]).unwrap();
        }
        let mut sel = [7, 3, 12, 20];
        ctx.swap_in(0, &mut sel, 0).unwrap(); // 20 is out of range: deferred
        for (first, n) in [(-1, 1), (0, 17), (16, 1), (i32::MAX, 2)] {
            let e = ctx.forget(0, first, n, 0).unwrap_err();
            assert_eq!(e.status, KvswapStatus::OutOfRange, "{first} + {n}: {e}");
        }
        assert_eq!(ctx.forget(2, 0, 1, 0).unwrap_err().status, KvswapStatus::OutOfRange, "bad layer");
        ctx.forget(0, 16, 0, 0).unwrap(); // n 0 at the end: nothing
        ctx.forget(1, 16, crate::ffi::KVSWAP_FORGET_TO_END, 0).unwrap(); // to the end from the end: nothing
        assert_eq!(ctx.forget(1, 17, crate::ffi::KVSWAP_FORGET_TO_END, 0).unwrap_err().status, KvswapStatus::OutOfRange);
        assert_eq!(ctx.residency(0).unwrap(), vec![(0, 7), (1, 3), (2, 12)]);
        ctx.forget(0, 12, crate::ffi::KVSWAP_FORGET_TO_END, 0).unwrap(); // the tail 12..16: chunk 12 leaves slot 2
        assert_eq!(ctx.residency(0).unwrap(), vec![(0, 7), (1, 3)]);
        ctx.forget(0, 0, crate::ffi::KVSWAP_FORGET_TO_END, 0).unwrap();
        assert!(ctx.residency(0).unwrap().is_empty());
        let e = ctx.stats(0).unwrap_err();
        assert_eq!(e.status, KvswapStatus::OutOfRange, "the deferred error survives the forget: {e}");
        let stats = ctx.stats(0).unwrap();
        assert_eq!((stats.misses, stats.stores, stats.swap_in_calls, stats.resident), (3, 16, 1, 0), "counters kept");
        // The old chunks are refused; the new sequence's stage as in a new context.
        let mut old = [7];
        ctx.swap_in(0, &mut old, 0).unwrap();
        assert_eq!(old, [-1]);
        assert_eq!(ctx.sync().unwrap_err().status, KvswapStatus::NotStored);
        for (c, id) in [(&ctx, 5), (&ctx, 3), (&fresh, 5), (&fresh, 3)] {
            c.store(0, id, &[100 + id as u8; 32]).unwrap();
        }
        let (mut a, mut b) = ([9, 9, 3, 5, 3], [9, 9, 3, 5, 3]);
        ctx.swap_in(0, &mut a, 2).unwrap();
        fresh.swap_in(0, &mut b, 2).unwrap();
        assert_eq!(a, [9, 9, 2, 3, 2]);
        assert_eq!(a, b);
        assert_eq!(ctx.residency(0).unwrap(), fresh.residency(0).unwrap());
        for slot in 0..2 {
            assert_eq!(ctx.slot_bytes(0, slot).unwrap(), fresh.slot_bytes(0, slot).unwrap());
        }
        assert_eq!(ctx.slot_bytes(0, 0).unwrap(), [103; 32]);
    }

    /// Layers whose host tiers each fit u64 but whose sum does not: refused
    /// by the pinned cap (the sum used to wrap to a small number and pass).
    #[test]
    fn a_host_tier_sum_past_u64_is_refused() {
        let config = Config { backend: BackendChoice::Cpu, enable: false, pinned_mib: 1, ..Config::default() };
        let small = KvswapLayerSpec { compressed_cap: 16, chunk_bytes: 64, staging: std::ptr::null_mut(), staging_stride: 0 };
        let huge = KvswapLayerSpec { compressed_cap: 1 << 28, chunk_bytes: 1 << 30, staging: 0x1000 as *mut std::ffi::c_void, staging_stride: 0 };
        let mut specs = vec![small];
        specs.extend(std::iter::repeat_n(huge, 64));
        let e = Context::new(config, &specs).err().expect("refused");
        assert_eq!(e.status, KvswapStatus::PinnedCap, "{e}");
    }

    #[test]
    fn stats_line_keeps_the_original_fields_first() {
        let s = KvswapLayerStats { slots: 512, compressed_cap: 65536, hits: 3, misses: 2, evictions: 1, stores: 4, swap_in_calls: 5, h2d_bytes: 1 << 20, swap_enabled: 1, ..Default::default() };
        assert_eq!(
            stats_line(3, 512, &s),
            "kvswap_stats layer=3 gpu_chunks=512 compressed_cap=65536 hits=3 misses=2 h2d_mib=1.000 d2h_mib=0.000 evictions=1 stores=4 swap_in_calls=5 slots=512 swap=1"
        );
        // A layer without swap: gpu_chunks stays the configured value; its
        // own slot count follows.
        let off = KvswapLayerStats { slots: 64, compressed_cap: 64, ..Default::default() };
        assert!(stats_line(7, 512, &off).starts_with("kvswap_stats layer=7 gpu_chunks=512 compressed_cap=64 "));
        assert!(stats_line(7, 512, &off).ends_with(" slots=64 swap=0"));
    }

    /// A batch store naming an id twice stores its last row (the header's
    /// rule), once, as one store; a resident chunk's slot is refreshed.
    #[test]
    fn a_repeated_id_in_a_store_batch_keeps_its_last_row() {
        let config = Config { backend: BackendChoice::Cpu, enable: true, gpu_chunks: 4, index_topk: 4, ..Config::default() };
        let spec = KvswapLayerSpec { compressed_cap: 16, chunk_bytes: 8, staging: std::ptr::null_mut(), staging_stride: 0 };
        let ctx = Context::new(config, &[spec]).unwrap();
        let rows: Vec<u8> = [[1u8; 8], [2; 8], [3; 8]].concat();
        ctx.store_rows(0, &[3, 5, 3], &rows).unwrap();
        assert_eq!(ctx.stats(0).unwrap().stores, 2, "3 and 5, each once");
        let mut idx = [3, 5];
        ctx.swap_in(0, &mut idx, 0).unwrap();
        assert_eq!(ctx.slot_bytes(0, idx[0] as u32).unwrap(), [3u8; 8], "chunk 3 holds the batch's last row for it");
        assert_eq!(ctx.slot_bytes(0, idx[1] as u32).unwrap(), [2u8; 8]);
        // Resident now: a repeated id refreshes the slot with its last row.
        let rows: Vec<u8> = [[7u8; 8], [9; 8]].concat();
        ctx.store_rows(0, &[3, 3], &rows).unwrap();
        assert_eq!(ctx.slot_bytes(0, idx[0] as u32).unwrap(), [9u8; 8]);
        let mut again = [3];
        ctx.swap_in(0, &mut again, 0).unwrap();
        assert_eq!(again[0], idx[0], "a hit: same slot");
        assert_eq!(ctx.slot_bytes(0, again[0] as u32).unwrap(), [9u8; 8]);
    }

    /// Strides whose rows would run past the end of the address space are
    /// refused before any pointer arithmetic (the backends add them to the
    /// engine's pointers; the device kernels in wrapping u64).
    #[test]
    fn strides_past_the_address_space_are_refused() {
        let config = Config { backend: BackendChoice::Cpu, enable: true, gpu_chunks: 4, index_topk: 4, ..Config::default() };
        let spec = KvswapLayerSpec { compressed_cap: 16, chunk_bytes: 32, staging: std::ptr::null_mut(), staging_stride: 0 };
        let ctx = Context::new(config.clone(), &[spec]).unwrap();
        let e = unsafe { ctx.store_raw(0, &[1, 2, 3], 0x1000, 1 << 63, 0) }.unwrap_err();
        assert_eq!(e.status, KvswapStatus::OutOfRange, "{e}");
        assert!(e.message.contains("src_stride=9223372036854775808"), "{e}");
        let e = unsafe { ctx.store_raw(0, &[1, 2], u64::MAX - 40, 32, 0) }.unwrap_err();
        assert_eq!(e.status, KvswapStatus::OutOfRange, "{e}");
        let engine = KvswapLayerSpec { staging: 0x1000 as *mut std::ffi::c_void, staging_stride: 1 << 62, ..spec };
        let e = Context::new(config, &[engine]).err().expect("refused");
        assert_eq!(e.status, KvswapStatus::OutOfRange, "{e}");
        assert!(e.message.contains("staging_stride=4611686018427387904"), "{e}");
    }
}
