//! Checks of an engine's arguments against the driver, before any launch:
//! its streams (device, legacy stream, capture) and its memory ranges
//! (device, extent, virtual-memory pieces), and the copy kernels' word size.

use super::driver::{self, CUstream, Device};
use crate::error::{Error, KvswapStatus, Result};

/// The engine's stream `s` (of `device`, bound) checked for a host wait:
/// refused while it is being captured into a CUDA graph, as the wait would
/// end the capture. `what`: what to do after the capture ends.
pub(crate) fn check_waitable(device: &Device, s: CUstream, what: &str) -> Result<()> {
    check_stream_device(device, s)?;
    if driver::is_capturing(s)? {
        return Err(Error::invalid(format!("the stream is being captured into a CUDA graph: {what} after the capture ends")));
    }
    Ok(())
}

/// Refuses the legacy default stream and streams of other devices.
pub(crate) fn check_stream_device(device: &Device, s: CUstream) -> Result<()> {
    if s.is_null() || s as usize == 1 {
        let which = if s.is_null() { "NULL" } else { "CU_STREAM_LEGACY" };
        return Err(Error::invalid(format!(
            "stream is the legacy default stream ({which}): pass the engine's CUstream \
             (CU_STREAM_PER_THREAD is accepted); kvswap never uses the legacy stream"
        )));
    }
    let ctx = driver::stream_context(s)?;
    if ctx != device.ctx {
        return Err(Error::new(
            KvswapStatus::WrongDevice,
            format!("stream belongs to another CUDA context than device {}'s primary context", device.ordinal),
        ));
    }
    Ok(())
}

/// Checks that `[ptr, ptr + bytes)` is device memory of `device` (or pinned
/// host memory the device can address); returns the range of the memory
/// that holds it.
///
/// The driver's range of an ordinary allocation is that allocation. For a
/// virtual-memory allocator's memory (PyTorch's `expandable_segments`,
/// ggml's VMM pool: physical allocations `cuMemMap`ped side by side into one
/// reserved range) it is the whole reservation, mapped or not, so the
/// check then holds to the physical mapping that contains `ptr` and walks
/// on, mapping by mapping, while the next one starts where the last ended,
/// lies in the same reservation, is mapped read-write for this device, and
/// is memory of the same kind and device (at most `MAX_PIECES`). A buffer
/// running into unmapped or other memory is refused (OUT_OF_RANGE), and so
/// is one starting in a piece not mapped read-write for this device
/// (INVALID_ARGUMENT): a kernel touching it would fault.
pub(crate) fn check_device_range(device: &Device, ptr: u64, bytes: u64, what: &str) -> Result<(u64, u64)> {
    const HOST: u32 = 1;
    // One driver call for `ptr` (the walk asks again only past its mapping).
    let first = driver::describe(ptr)?.ok_or_else(|| {
        Error::invalid(format!("{what} ({ptr:#x}) is not CUDA memory: on the CUDA backend it must be a device pointer"))
    })?;
    let info = first.info;
    if info.memory_type != HOST && info.device_ordinal != device.ordinal {
        return Err(Error::new(
            KvswapStatus::WrongDevice,
            format!("{what} ({ptr:#x}) is memory of device {}, but this kvswap object is bound to device {}", info.device_ordinal, device.ordinal),
        ));
    }
    let past_end = |limit: u64| {
        Error::out_of_range(format!(
            "{what} ({ptr:#x}, {bytes} bytes) runs past the end of its allocation ({} bytes from {:#x})",
            limit.saturating_sub(info.range_start),
            info.range_start
        ))
    };
    let end = ptr.checked_add(bytes).ok_or_else(|| past_end(info.range_start.saturating_add(info.range_size)))?;
    match mapped_extent(&info, ptr, end, |p| if p == ptr { Some(first) } else { driver::mapping(p) }) {
        Ok(limit) => Ok((info.range_start, limit)),
        Err(RangeFault::PastEnd(limit)) => Err(past_end(limit)),
        Err(RangeFault::Undescribed) => Err(Error::device(format!("{what} ({ptr:#x}): the driver did not describe its mapping"))),
        Err(RangeFault::NoAccess) => Err(Error::invalid(format!(
            "{what} ({ptr:#x}) lies in a virtual-memory piece that is not mapped read-write for device {} \
             (cuMemSetAccess with CU_MEM_ACCESS_FLAGS_PROT_READWRITE for it)",
            device.ordinal
        ))),
    }
}

/// The copy kernels' word size (kernels/swap.cu's `warp_copy`): the largest
/// of 16, 8 and 4 bytes that divides every one of `values` (addresses and
/// sizes), else 1.
pub(super) fn copy_width(values: impl IntoIterator<Item = u64>) -> u32 {
    let all = values.into_iter().fold(0u64, |a, v| a | v);
    [16u32, 8, 4].into_iter().find(|&w| all % w as u64 == 0).unwrap_or(1)
}

/// Why [`mapped_extent`] refused a buffer.
#[derive(Debug, PartialEq, Eq)]
enum RangeFault {
    /// The memory known to be there ends at this address, before the buffer.
    PastEnd(u64),
    /// The driver described the pointer but not its mapping.
    Undescribed,
    /// The pointer lies in a piece of a virtual-memory reservation that is
    /// not mapped read-write for this device (`cuMemSetAccess` not called
    /// for it, or read-only, or opened only to another device).
    NoAccess,
}

/// The end of the memory that holds `[ptr, end)` (>= `end`), as
/// `describe` (the driver's pointer attributes, [`driver::mapping`])
/// reports it; `info` is `ptr`'s own description. The rules of
/// [`check_device_range`]: pinned host memory is its range (unless it is a
/// piece of a host-backed reservation); otherwise the range cut to the
/// physical mapping that holds `ptr`, then the next mappings while each
/// starts where the last ended, lies in the same reservation (same range
/// start), is mapped read-write, and is memory of the same kind and device
/// (at most `MAX_PIECES` in all). The mapping that holds `ptr` must not be
/// mapped without read-write access (the driver reports every other kind
/// read-write: ordinary, pool and managed memory on the H200), and a piece
/// of a reservation (a mapping that does not cover the range; an ordinary,
/// pool or managed allocation's mapping covers it) must be mapped. Fails
/// closed: a pointer whose mapping is not described is refused, since for a
/// virtual-memory reservation nothing else bounds it but the whole
/// reservation. Pure (the driver is `describe`), so it is unit-tested.
fn mapped_extent(info: &driver::PtrInfo, ptr: u64, end: u64, describe: impl Fn(u64) -> Option<driver::Mapping>) -> std::result::Result<u64, RangeFault> {
    const HOST: u32 = 1;
    const MAX_PIECES: usize = 1 << 16;
    let range_end = info.range_start.saturating_add(info.range_size);
    let described = describe(ptr);
    let sized = described.filter(|m| m.mapping_size > 0);
    let mapping_end = sized.map_or(0, |m| m.mapping_base.saturating_add(m.mapping_size));
    let holds_ptr = sized.is_some_and(|m| m.mapping_base <= ptr && mapping_end > ptr);
    // A piece of a virtual-memory reservation: its mapping holds the
    // pointer but not the whole range (an ordinary, pool or managed
    // allocation's mapping covers its range).
    let a_piece = holds_ptr && sized.is_some_and(|m| m.mapping_base > info.range_start || mapping_end < range_end);
    if info.memory_type == HOST && !a_piece {
        // Pinned host memory: one allocation, its range.
        return if end <= range_end { Ok(range_end) } else { Err(RangeFault::PastEnd(range_end)) };
    }
    let m = described.ok_or(RangeFault::Undescribed)?;
    // Mapped but not read-write for this device (a reservation's memory
    // without cuMemSetAccess, read-only, or opened only to a peer; every
    // other kind the driver reports read-write), or a piece not mapped.
    if holds_ptr && ((m.mapped && !m.read_write) || (a_piece && !m.mapped)) {
        return Err(RangeFault::NoAccess);
    }
    let mut limit = if holds_ptr { mapping_end.min(range_end) } else { range_end };
    let mut pieces = 1;
    while end > limit {
        let next = match describe(limit) {
            Some(n)
                if n.mapped
                    && n.read_write
                    && n.mapping_base == limit
                    && n.mapping_size > 0
                    && n.info.range_start == info.range_start
                    && n.info.memory_type == info.memory_type
                    && n.info.device_ordinal == info.device_ordinal =>
            {
                n
            }
            _ => return Err(RangeFault::PastEnd(limit)),
        };
        pieces += 1;
        let next_end = next.mapping_base.saturating_add(next.mapping_size).min(range_end);
        if pieces > MAX_PIECES || next_end <= limit {
            return Err(RangeFault::PastEnd(limit));
        }
        limit = next_end;
    }
    Ok(limit)
}

#[cfg(test)]
mod tests {
    //! `mapped_extent` against a made-up driver: the memory kinds the H200
    //! reported (tests/gpu.rs's `driver_reports_what_the_range_check_relies_on`
    //! asserts them there) and the edges around them; and `copy_width`.
    use super::{copy_width, mapped_extent, RangeFault};
    use crate::backend::cuda::driver::{Mapping, PtrInfo};

    const DEVICE: u32 = 2;
    const HOST: u32 = 1;
    const MIB: u64 = 1 << 20;

    /// One described region: its range, its physical mapping, mapped and
    /// read-write flags.
    #[derive(Clone, Copy)]
    struct Region {
        range: (u64, u64),
        mapping: (u64, u64),
        kind: u32,
        device: i32,
        mapped: bool,
        rw: bool,
    }

    fn region(range: (u64, u64), mapping: (u64, u64)) -> Region {
        Region { range, mapping, kind: DEVICE, device: 0, mapped: true, rw: true }
    }

    /// The driver of `regions`: the first region whose mapping holds `p`.
    fn driver(regions: &[Region]) -> impl Fn(u64) -> Option<Mapping> + '_ {
        move |p| {
            regions.iter().find(|r| r.mapping.0 <= p && p < r.mapping.0 + r.mapping.1).map(|r| Mapping {
                info: PtrInfo { memory_type: r.kind, device_ordinal: r.device, range_start: r.range.0, range_size: r.range.1 },
                mapped: r.mapped,
                read_write: r.rw,
                mapping_base: r.mapping.0,
                mapping_size: r.mapping.1,
            })
        }
    }

    fn extent(regions: &[Region], ptr: u64, bytes: u64) -> Result<u64, RangeFault> {
        let d = driver(regions);
        let info = d(ptr).expect("the pointer is described").info;
        mapped_extent(&info, ptr, ptr + bytes, d)
    }

    #[test]
    fn ordinary_and_pool_allocations_end_at_their_range() {
        // A 100-byte allocation in a 2 MiB mapping shared with a neighbour.
        let a = 0x7f00_0000_0000;
        let regions = [region((a, 100), (a, 2 * MIB)), region((a + 512, 4096), (a, 2 * MIB))];
        assert_eq!(extent(&regions, a, 100), Ok(a + 100));
        assert_eq!(extent(&regions, a + 40, 60), Ok(a + 100), "exact fit from inside");
        assert_eq!(extent(&regions, a, 101), Err(RangeFault::PastEnd(a + 100)), "one byte over, into the shared mapping");
        // A 3 MiB pool allocation in a 32 MiB pool mapping.
        let p = 0x3_0200_0000;
        let pool = [region((p, 3 * MIB), (p, 32 * MIB))];
        assert_eq!(extent(&pool, p + MIB, 2 * MIB), Ok(p + 3 * MIB));
        assert_eq!(extent(&pool, p + MIB, 2 * MIB + 1), Err(RangeFault::PastEnd(p + 3 * MIB)));
        // Two large allocations side by side, each its own mapping: an
        // overrun into the second is refused (another range start).
        let l = 0x7f10_0000_0000;
        let two = [region((l, 64 * MIB), (l, 64 * MIB)), region((l + 64 * MIB, 64 * MIB), (l + 64 * MIB, 64 * MIB))];
        assert_eq!(extent(&two, l, 64 * MIB), Ok(l + 64 * MIB));
        assert_eq!(extent(&two, l + MIB, 64 * MIB), Err(RangeFault::PastEnd(l + 64 * MIB)));
    }

    #[test]
    fn pinned_host_memory_is_its_range() {
        let h = 0x7f20_0000_0000;
        let regions = [Region { kind: HOST, ..region((h, MIB), (h, 2 * MIB)) }];
        assert_eq!(extent(&regions, h, MIB), Ok(h + MIB));
        assert_eq!(extent(&regions, h, MIB + 1), Err(RangeFault::PastEnd(h + MIB)));
    }

    /// A reservation of four 2 MiB pieces whose range is the whole
    /// reservation (as the H200 reports it): pieces 0-2 mapped, 3 not.
    fn reservation(v: u64) -> Vec<Region> {
        (0..3).map(|i| region((v, 8 * MIB), (v + 2 * i * MIB, 2 * MIB))).collect()
    }

    #[test]
    fn a_reservation_walks_its_mapped_pieces() {
        let v = 0x7f30_0000_0000;
        let r = reservation(v);
        assert_eq!(extent(&r, v + 2 * MIB - 8, 72), Ok(v + 4 * MIB), "across a seam");
        assert_eq!(extent(&r, v + 2 * MIB, 2 * MIB), Ok(v + 4 * MIB), "a whole piece from its seam");
        assert_eq!(extent(&r, v, 6 * MIB), Ok(v + 6 * MIB), "every mapped piece, exact fit");
        assert_eq!(extent(&r, v + 6 * MIB - 8, 8), Ok(v + 6 * MIB), "exact fit at the mapped end");
        assert_eq!(extent(&r, v + 6 * MIB - 8, 9), Err(RangeFault::PastEnd(v + 6 * MIB)), "into the unmapped piece");
        assert_eq!(extent(&r, v + MIB, 6 * MIB), Err(RangeFault::PastEnd(v + 6 * MIB)));
    }

    #[test]
    fn the_walk_stops_at_pieces_it_must_not_enter() {
        let v = 0x7f40_0000_0000;
        for (what, change) in [
            ("not read-write for this device", (|r: &mut Region| r.rw = false) as fn(&mut Region)),
            ("not mapped", |r| r.mapped = false),
            ("another device's", |r| r.device = 1),
            ("host memory", |r| r.kind = HOST),
            ("another reservation's", |r| r.range = (r.mapping.0, 2 * MIB)),
        ] {
            let mut r = reservation(v);
            change(&mut r[1]);
            assert_eq!(extent(&r, v + 2 * MIB - 8, 16), Err(RangeFault::PastEnd(v + 2 * MIB)), "{what}");
            assert_eq!(extent(&r, v, 2 * MIB), Ok(v + 2 * MIB), "{what}: the first piece alone is fine");
        }
    }

    #[test]
    fn a_piece_without_read_write_access_is_refused_from_its_start() {
        let v = 0x7f50_0000_0000;
        for (what, change) in [
            ("no access set for this device", (|r: &mut Region| r.rw = false) as fn(&mut Region)),
            ("not mapped", |r| r.mapped = false),
        ] {
            let mut r = reservation(v);
            change(&mut r[1]);
            assert_eq!(extent(&r, v + 2 * MIB, 16), Err(RangeFault::NoAccess), "{what}");
            assert_eq!(extent(&r, v + 3 * MIB, 2 * MIB), Err(RangeFault::NoAccess), "{what}: into a good piece");
            assert_eq!(extent(&r, v + 4 * MIB, 16), Ok(v + 6 * MIB), "{what}: the next piece is fine");
        }
        // A reservation of one piece (its mapping is its range) mapped
        // without access: refused too.
        let one = 0x7f60_0000_0000;
        let single = [Region { rw: false, ..region((one, 2 * MIB), (one, 2 * MIB)) }];
        assert_eq!(extent(&single, one + 64, 16), Err(RangeFault::NoAccess));
        // A mapping the driver reports as not mapped but which covers its
        // range (no kind measured does this) keeps the range as its bound.
        let other = [Region { mapped: false, ..region((one, 100), (one, 2 * MIB)) }];
        assert_eq!(extent(&other, one, 100), Ok(one + 100));
    }

    #[test]
    fn host_memory_pieces_are_walked_as_device_pieces() {
        // A reservation backed by host memory (cuMemCreate with a host
        // location) reports the whole reservation as its range: its pieces
        // bound it, not the range.
        let v = 0x7f70_0000_0000;
        let mut r = reservation(v);
        for p in &mut r {
            p.kind = HOST;
        }
        assert_eq!(extent(&r, v + 2 * MIB - 8, 16), Ok(v + 4 * MIB), "across a seam");
        assert_eq!(extent(&r, v + 6 * MIB - 8, 9), Err(RangeFault::PastEnd(v + 6 * MIB)), "into the unmapped piece");
        r[1].rw = false;
        assert_eq!(extent(&r, v + 2 * MIB, 16), Err(RangeFault::NoAccess), "a piece without access");
    }

    #[test]
    fn an_undescribed_mapping_is_refused() {
        let info = PtrInfo { memory_type: DEVICE, device_ordinal: 0, range_start: 0x1000, range_size: 1 << 30 };
        assert_eq!(mapped_extent(&info, 0x1000, 0x2000, |_| None), Err(RangeFault::Undescribed));
    }

    #[test]
    fn copy_width_divides_every_address_and_size() {
        assert_eq!(copy_width([2048, 2048, 0x7f00_0000_0000, 0x7f10_0000_0000]), 16);
        assert_eq!(copy_width([2056, 2056, 0x7f00_0000_0000, 0x7f10_0000_0000]), 8);
        assert_eq!(copy_width([2052, 2052, 0x7f00_0000_0000, 0x7f10_0000_0000]), 4);
        assert_eq!(copy_width([2049, 2049, 0x7f00_0000_0000, 0x7f10_0000_0000]), 1);
        assert_eq!(copy_width([2048, 1040, 0x7f00_0000_0000, 0x7f10_0000_0000]), 16, "1040 = 16 x 65");
        assert_eq!(copy_width([2048, 2048, 0x7f00_0000_0008, 0x7f10_0000_0000]), 8, "an address decides too");
        assert_eq!(copy_width([2048, 2048, 0x7f00_0000_0000, 0x7f10_0000_0000, 0x1002, 2048]), 1, "a store's src, 2-byte aligned");
        assert_eq!(copy_width([]), 16, "nothing to divide");
    }
}
