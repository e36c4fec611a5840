//! The CPU backend: host memory plays the device. It is the reference the
//! CUDA backend is tested against, and what CI runs.

use super::{Backend, BackendKind, LayerOps, StreamHandle};
use crate::config::Config;
use crate::error::{Error, KvswapStatus, Result};
use crate::hostmem::HostBuf;
use crate::layer::{dedup_last, KvswapLayerStats, LayerPlan, StagingView};
use crate::residency::Residency;
use std::sync::Arc;

pub struct CpuBackend;

impl Backend for CpuBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Cpu
    }
    fn describe(&self) -> String {
        "cpu (host memory plays the device)".to_string()
    }
    fn create_layers(&self, plans: &[LayerPlan], cfg: &Config) -> Result<Vec<Box<dyn LayerOps>>> {
        let total: u64 = self.host_bytes(plans);
        let pool = Arc::new(HostBuf::zeroed(usize::try_from(total).map_err(|_| {
            Error::new(KvswapStatus::OutOfMemory, "host tier larger than the address space")
        })?)?);
        let mut offset = 0usize;
        let mut layers: Vec<Box<dyn LayerOps>> = Vec::with_capacity(plans.len());
        for p in plans {
            let staging = match p.staging {
                Some((ptr, stride)) => Staging::Engine { ptr: ptr as *mut u8, stride: stride as usize },
                None => Staging::Owned(HostBuf::zeroed(p.slots as usize * p.chunk_bytes)?),
            };
            layers.push(Box::new(CpuLayer {
                plan: *p,
                pool: pool.clone(),
                host_offset: offset,
                staging,
                residency: Residency::new(p.compressed_cap, p.slots, p.swap)?,
                stats: KvswapLayerStats::default(),
                strict: cfg.sync,
                validate: cfg.validate,
                deferred: None,
            }));
            offset += p.host_bytes() as usize;
        }
        Ok(layers)
    }
}

enum Staging {
    Owned(HostBuf),
    Engine { ptr: *mut u8, stride: usize },
}

struct CpuLayer {
    plan: LayerPlan,
    /// The context's host tier; this layer owns bytes
    /// `host_offset .. host_offset + compressed_cap * chunk_bytes` of it.
    pool: Arc<HostBuf>,
    host_offset: usize,
    staging: Staging,
    residency: Residency,
    stats: KvswapLayerStats,
    strict: bool,
    validate: bool,
    deferred: Option<Error>,
}

// SAFETY: the raw pointers are the engine's staging buffer (which the engine
// promises stays valid and unused by others while kvswap runs) and this
// layer's own region of the pool; the context serialises access to a layer.
unsafe impl Send for CpuLayer {}

impl CpuLayer {
    fn host_row(&self, id: u32) -> *mut u8 {
        debug_assert!(id < self.plan.compressed_cap);
        // SAFETY: in bounds of this layer's region of the pool (id < cap).
        unsafe { self.pool.as_ptr().add(self.host_offset + id as usize * self.plan.chunk_bytes) }
    }

    fn slot_row(&self, slot: u32) -> *mut u8 {
        debug_assert!(slot < self.plan.slots);
        match &self.staging {
            // SAFETY: slot < slots, and the buffer holds slots * chunk_bytes.
            Staging::Owned(b) => unsafe { b.as_ptr().add(slot as usize * self.plan.chunk_bytes) },
            // SAFETY: the engine provided `slots` rows of `stride` bytes.
            Staging::Engine { ptr, stride } => unsafe { ptr.add(slot as usize * stride) },
        }
    }
}

impl LayerOps for CpuLayer {
    unsafe fn store(&mut self, ids: &[u32], src: u64, src_stride: usize, _stream: StreamHandle) -> Result<()> {
        let n = self.plan.chunk_bytes;
        for (id, row) in dedup_last(ids, self.plan.compressed_cap)? {
            // SAFETY: the caller guarantees the source rows are readable.
            let from = unsafe { (src as *const u8).add(row as usize * src_stride) };
            // SAFETY: host row and source are `n` bytes; they do not overlap
            // unless the engine passed our own memory, which copy handles.
            unsafe { std::ptr::copy(from, self.host_row(id), n) };
            if let Some((slot, refresh)) = self.residency.mark_stored(id) {
                // SAFETY: both rows are `n` bytes, distinct allocations.
                unsafe { std::ptr::copy(self.host_row(id), self.slot_row(slot), n) };
                self.stats.refreshes += refresh as u64;
            }
            self.stats.stores += 1;
            self.stats.d2h_bytes += n as u64;
        }
        Ok(())
    }

    fn forget(&mut self, first: u32, n: u32, _stream: StreamHandle) -> Result<()> {
        self.residency.forget(first, n);
        Ok(())
    }

    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }

    unsafe fn check_entries(&mut self, indices: u64, window_len: u32, count: u32, src_ids: u64, _stream: StreamHandle) -> Result<()> {
        if !self.strict {
            return Ok(()); // refused ids become -1 with a deferred error: nothing fails
        }
        // SAFETY: the caller guarantees `count` int32 values there (the
        // shared top-k, or the entries after the window).
        let ids = unsafe { std::slice::from_raw_parts(super::ids_addr(indices, window_len, src_ids) as *const i32, count as usize) };
        for (pos, &id) in ids.iter().enumerate().filter(|(_, &id)| id != -1) {
            self.residency.check(pos, id).map_err(|e| self.plan.entry_error(e))?;
        }
        Ok(())
    }

    unsafe fn swap_in(&mut self, indices: u64, window_len: u32, count: u32, src_ids: u64, _stream: StreamHandle) -> Result<()> {
        if src_ids != 0 {
            // SAFETY: the caller guarantees `count` ids at src_ids and
            // `window_len + count` at indices, not overlapping.
            unsafe { std::ptr::copy_nonoverlapping(src_ids as *const i32, (indices as *mut i32).add(window_len as usize), count as usize) };
        }
        // SAFETY: the caller guarantees `window_len + count` int32 values.
        let entries = unsafe {
            std::slice::from_raw_parts_mut((indices as *mut i32).add(window_len as usize), count as usize)
        };
        let outcome = self
            .residency
            .swap_in(entries, window_len as i32, self.strict)
            .map_err(|e| self.plan.entry_error(e))?;
        let n = self.plan.chunk_bytes;
        for &(slot, id) in self.residency.last_misses() {
            // SAFETY: distinct rows of `n` bytes in different allocations.
            unsafe { std::ptr::copy_nonoverlapping(self.host_row(id), self.slot_row(slot), n) };
        }
        self.stats.swap_in_calls += 1;
        self.stats.hits += outcome.hits as u64;
        self.stats.misses += outcome.misses as u64;
        self.stats.evictions += outcome.evictions as u64;
        self.stats.h2d_bytes += outcome.misses as u64 * n as u64;
        if let Some(e) = outcome.deferred {
            let err = self.plan.entry_error(e);
            self.deferred.get_or_insert(err);
        }
        if self.validate {
            for (pos, &e) in entries.iter().enumerate().filter(|&(_, &e)| e != -1) {
                let slot = (e - window_len as i32) as u32;
                let id = self.residency.chunk_in(slot).expect("selected slot holds a chunk");
                // SAFETY: both rows are `n` readable bytes.
                let (a, b) = unsafe {
                    (std::slice::from_raw_parts(self.slot_row(slot), n), std::slice::from_raw_parts(self.host_row(id), n))
                };
                if a != b {
                    let e = Error::new(
                        KvswapStatus::ValidationFailed,
                        // The CUDA backend's words (it names one mismatch; this the first).
                        format!("layer {}: the slot of chunk {id} (position {pos}) differs from its host copy", self.plan.index),
                    );
                    // As on CUDA: with sync = 0 reported by the next sync or stats.
                    if self.strict {
                        return Err(e);
                    }
                    self.deferred.get_or_insert(e);
                    break;
                }
            }
        }
        Ok(())
    }

    fn stats(&mut self, take_error: bool) -> Result<KvswapLayerStats> {
        if take_error {
            self.sync()?;
        }
        let mut s = self.stats;
        s.compressed_cap = self.plan.compressed_cap as u64;
        s.chunk_bytes = self.plan.chunk_bytes as u64;
        s.slots = self.plan.slots;
        s.resident = self.residency.resident();
        s.swap_enabled = self.plan.swap as u32;
        Ok(s)
    }

    fn sync(&mut self) -> Result<()> {
        match self.deferred.take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    fn staging(&self) -> StagingView {
        StagingView {
            ptr: self.slot_row(0) as u64,
            stride: match &self.staging {
                Staging::Owned(_) => self.plan.chunk_bytes as u64,
                Staging::Engine { stride, .. } => *stride as u64,
            },
            rows: self.plan.slots,
        }
    }

    fn residency(&mut self) -> Result<Vec<(u32, u32)>> {
        Ok((0..self.plan.slots).filter_map(|s| self.residency.chunk_in(s).map(|c| (s, c))).collect())
    }

    fn read_slot(&mut self, slot: u32) -> Result<Vec<u8>> {
        // SAFETY: slot < slots (checked by the context); rows are chunk_bytes long.
        Ok(unsafe { std::slice::from_raw_parts(self.slot_row(slot), self.plan.chunk_bytes) }.to_vec())
    }

    fn store_host(&mut self, ids: &[u32], rows: &[u8]) -> Result<()> {
        let n = self.plan.chunk_bytes;
        // SAFETY: `rows` is a live slice of ids.len() rows of chunk_bytes.
        unsafe { self.store(ids, rows.as_ptr() as u64, n, 0) }
    }

    fn swap_in_host(&mut self, indices: &mut [i32], window_len: u32) -> Result<()> {
        let count = (indices.len() - window_len as usize) as u32;
        // SAFETY: a live, exclusively borrowed slice of window_len + count ints.
        unsafe { self.swap_in(indices.as_mut_ptr() as u64, window_len, count, 0, 0) }
    }
}
