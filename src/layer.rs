//! Per-layer description (what the engine passes), the resolved plan of a
//! layer (what the context decided) and its statistics.

use crate::config::Config;
use crate::error::{Error, KvswapStatus, Result};
use std::ffi::c_void;

/// One layer's swap-in in a `kvswap_swap_in_layers` call: the arguments of
/// `kvswap_swap_in_selected` for that layer.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct KvswapSwapIn {
    /// The layer (each layer at most once per call).
    pub layer: u32,
    /// Entries before the selection, left untouched.
    pub window_len: u32,
    /// Selected entries: `indices[window_len .. window_len + count)`.
    pub count: u32,
    /// Must be 0.
    pub reserved: u32,
    /// The layer's index buffer (device memory on CUDA): on return its
    /// selected entries hold physical ids `window_len + slot`.
    pub indices: *mut i32,
}

impl KvswapSwapIn {
    /// `e` of request `i` (this one) of a `kvswap_swap_in_layers` call,
    /// naming the request and its layer.
    pub fn error(&self, i: usize, e: Error) -> Error {
        Error::new(e.status, format!("requests[{i}] (layer {}): {}", self.layer, e.message))
    }
}

/// One layer as the engine describes it to `kvswap_create`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct KvswapLayerSpec {
    /// Chunks this layer can hold: logical ids are `0 .. compressed_cap`.
    pub compressed_cap: u64,
    /// Bytes of one chunk (for example kv_dim 512 x f32 = 2048).
    pub chunk_bytes: u64,
    /// Optional engine-owned staging buffer: the row of slot 0 (the attention
    /// kernel's row `window_len`). Device memory on CUDA, host memory on the
    /// CPU backend. NULL: the library allocates it. It holds one row per slot:
    /// `gpu_chunks` rows when swap is on for the layer, `compressed_cap` rows
    /// when it is off (`enable = 0`, or `compressed_cap <= gpu_chunks`), each
    /// `staging_stride` bytes apart, and must stay valid until
    /// `kvswap_destroy`.
    pub staging: *mut c_void,
    /// Bytes between consecutive slot rows of `staging`; 0 means `chunk_bytes`.
    /// At least `chunk_bytes`, and only with an engine `staging` buffer: a
    /// smaller stride, or a nonzero one with `staging` NULL (the library's
    /// own rows are `chunk_bytes` apart), is `KVSWAP_STATUS_INVALID_ARGUMENT`.
    pub staging_stride: u64,
}

/// Counters of one layer since the context was created.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KvswapLayerStats {
    /// Selected chunks that were already in a slot (distinct per call).
    pub hits: u64,
    /// Selected chunks that had to be copied in (distinct per call).
    pub misses: u64,
    /// Misses whose victim slot held another chunk.
    pub evictions: u64,
    /// Chunks stored (copied to the host tier).
    pub stores: u64,
    /// Stores that also refreshed a resident slot.
    pub refreshes: u64,
    /// Bytes copied host tier -> staging slots by swap-ins (a layer with swap
    /// off copies each store into its slot too; those copies are not counted).
    pub h2d_bytes: u64,
    /// Bytes copied engine -> host tier.
    pub d2h_bytes: u64,
    /// Swap-ins: `kvswap_swap_in_selected` calls, plus one per request of
    /// `kvswap_swap_in_layers` naming this layer.
    pub swap_in_calls: u64,
    /// The layer's `compressed_cap`.
    pub compressed_cap: u64,
    /// The layer's `chunk_bytes`.
    pub chunk_bytes: u64,
    /// Staging slots of this layer (`compressed_cap` when swap is off for it).
    pub slots: u32,
    /// Chunks currently resident in a slot. On a layer with swap off (every
    /// chunk in the slot of its own id), the chunks stored (and not
    /// forgotten since).
    pub resident: u32,
    /// 1 when swap is on for this layer, 0 when every chunk stays resident.
    pub swap_enabled: u32,
    /// Always 0.
    pub reserved: u32,
}

/// Where a layer's staging rows are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StagingView {
    /// Address of slot 0 (device address on CUDA, host address on CPU).
    pub ptr: u64,
    /// Bytes between slot rows.
    pub stride: u64,
    /// Number of slot rows.
    pub rows: u32,
}

/// Ids (logical and physical, `window + slot`) are int32 with headroom:
/// every count that becomes one (compressed_cap, gpu_chunks, window) is at
/// most ID_COUNT_MAX, and `window + slots` stays below PHYS_ID_BOUND
/// (internal: the header states these limits in its docs).
/// cbindgen:ignore
pub const ID_COUNT_MAX: u64 = i32::MAX as u64 / 2;
/// cbindgen:ignore
pub const PHYS_ID_BOUND: u64 = 1 << 30;
/// The largest chunk a layer holds.
/// cbindgen:ignore
pub const CHUNK_BYTES_MAX: u64 = 1 << 30;

/// A layer as the context resolved it.
#[derive(Clone, Copy, Debug)]
pub struct LayerPlan {
    pub index: usize,
    pub compressed_cap: u32,
    pub chunk_bytes: usize,
    /// Swap on for this layer (`enable && compressed_cap > gpu_chunks`).
    pub swap: bool,
    /// Staging rows: `gpu_chunks`, or `compressed_cap` when swap is off.
    pub slots: u32,
    /// Engine-provided staging (address, stride), if any.
    pub staging: Option<(u64, u64)>,
}

impl LayerPlan {
    pub fn host_bytes(&self) -> u64 {
        self.compressed_cap as u64 * self.chunk_bytes as u64
    }
    pub fn staging_stride(&self) -> u64 {
        self.staging.map(|(_, s)| s).unwrap_or(self.chunk_bytes as u64)
    }

    /// The error of a refused selected entry, as both backends report it.
    pub fn entry_error(&self, e: crate::residency::EntryError) -> Error {
        use crate::residency::EntryError;
        let layer = self.index;
        match e {
            EntryError::OutOfRange { pos, id } => Error::out_of_range(format!(
                "layer {layer}: selected id {id} at selection position {pos} (indices[window_len + {pos}]) is outside 0..{} (compressed_cap)",
                self.compressed_cap
            )),
            EntryError::NotStored { pos, id } => Error::new(
                KvswapStatus::NotStored,
                format!("layer {layer}: selected chunk {id} at selection position {pos} (indices[window_len + {pos}]) was never stored"),
            ),
        }
    }

    /// Validates an engine spec and decides swap and slots.
    pub fn resolve(index: usize, spec: &KvswapLayerSpec, cfg: &Config) -> Result<LayerPlan> {
        if spec.compressed_cap == 0 {
            return Err(Error::invalid(format!("layer {index}: compressed_cap is 0")));
        }
        if spec.compressed_cap >= ID_COUNT_MAX {
            return Err(Error::out_of_range(format!(
                "layer {index}: compressed_cap={} is too large (ids are int32)",
                spec.compressed_cap
            )));
        }
        if spec.chunk_bytes == 0 {
            return Err(Error::invalid(format!("layer {index}: chunk_bytes is 0")));
        }
        if spec.chunk_bytes > CHUNK_BYTES_MAX {
            return Err(Error::out_of_range(format!(
                "layer {index}: chunk_bytes={} is above 1 GiB",
                spec.chunk_bytes
            )));
        }
        let cap = spec.compressed_cap as u32;
        let swap = cfg.enable && cap > cfg.gpu_chunks;
        let slots = if swap { cfg.gpu_chunks } else { cap };
        let staging = if spec.staging.is_null() {
            if spec.staging_stride != 0 {
                return Err(Error::invalid(format!(
                    "layer {index}: staging_stride={} given without a staging pointer",
                    spec.staging_stride
                )));
            }
            None
        } else {
            let stride = if spec.staging_stride == 0 { spec.chunk_bytes } else { spec.staging_stride };
            if stride < spec.chunk_bytes {
                return Err(Error::invalid(format!(
                    "layer {index}: staging_stride={stride} is smaller than chunk_bytes={}",
                    spec.chunk_bytes
                )));
            }
            if crate::context::rows_span(slots as u64, stride, spec.chunk_bytes).is_none_or(|b| (spec.staging as u64).checked_add(b).is_none()) {
                return Err(Error::out_of_range(format!(
                    "layer {index}: staging_stride={stride}: the slot rows from staging {:p} run past the end of the address space",
                    spec.staging
                )));
            }
            Some((spec.staging as u64, stride))
        };
        if (cfg.window as u64) + (slots as u64) >= PHYS_ID_BOUND {
            return Err(Error::out_of_range(format!(
                "layer {index}: window + slots does not fit in an int32 physical id"
            )));
        }
        Ok(LayerPlan { index, compressed_cap: cap, chunk_bytes: spec.chunk_bytes as usize, swap, slots, staging })
    }
}

/// Checks `required` bytes of pinned host tier against the cap in MiB.
/// Host tier bytes of all `plans`: u64::MAX when the sum overflows (each
/// layer's fits u64, their sum need not; an overflow is above every cap).
pub fn total_host_bytes(plans: &[LayerPlan]) -> u64 {
    plans.iter().try_fold(0u64, |a, p| a.checked_add(p.host_bytes())).unwrap_or(u64::MAX)
}

pub fn check_pinned_cap(required: u64, cap_mib: u64) -> Result<()> {
    let cap = cap_mib.saturating_mul(1 << 20);
    if required > cap {
        return Err(Error::new(
            KvswapStatus::PinnedCap,
            format!(
                "pinned host tier needs required_mib={} but cap_mib={} (KVSWAP_PINNED_MIB); \
                 raise KVSWAP_PINNED_MIB or shorten the context",
                required.div_ceil(1 << 20),
                cap_mib
            ),
        ));
    }
    Ok(())
}

/// The distinct ids of a store batch with the row each is read from: when an
/// id repeats, its last row wins (as if the rows were stored in order).
/// Ordered by row. `cap` bounds the distinct ids (the layer's
/// `compressed_cap`), so the table is sized by what can differ, not by the
/// batch (a batch may repeat ids without limit); its memory is reserved
/// fallibly (`KVSWAP_STATUS_OUT_OF_MEMORY`, never an abort). Rows are u32:
/// the caller refuses batches of more than u32::MAX rows.
pub fn dedup_last(ids: &[u32], cap: u32) -> Result<Vec<(u32, u32)>> {
    debug_assert!(ids.len() <= u32::MAX as usize);
    if ids.len() == 1 {
        return Ok(vec![(ids[0], 0)]);
    }
    let distinct = ids.len().min(cap as usize);
    let mut last = std::collections::HashMap::new();
    last.try_reserve(distinct).map_err(|_| {
        Error::new(KvswapStatus::OutOfMemory, format!("cannot allocate the id table of a store batch ({distinct} entries)"))
    })?;
    for (row, &id) in ids.iter().enumerate() {
        last.insert(id, row as u32);
    }
    let mut pairs = crate::error::try_vec(last.len(), "the row list of a store batch")?;
    pairs.extend(last);
    pairs.sort_unstable_by_key(|&(_, row)| row);
    Ok(pairs)
}

#[cfg(test)]
mod tests {
    use super::dedup_last;

    #[test]
    fn dedup_keeps_the_last_row_of_each_id_in_row_order() {
        assert_eq!(dedup_last(&[7], 16).unwrap(), vec![(7, 0)]);
        assert_eq!(dedup_last(&[3, 1, 3, 2, 1], 16).unwrap(), vec![(3, 2), (2, 3), (1, 4)]);
        // A batch that repeats few ids many times: the table is sized by the
        // layer's capacity (16 ids), not by the batch's 1,000,000 rows.
        let ids: Vec<u32> = (0..1_000_000u32).map(|r| r % 4).collect();
        assert_eq!(dedup_last(&ids, 16).unwrap(), vec![(0, 999_996), (1, 999_997), (2, 999_998), (3, 999_999)]);
    }
}
