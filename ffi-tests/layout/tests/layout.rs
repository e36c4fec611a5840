//! Every #[repr(C)] struct and enum of the C ABI has the same size, alignment
//! and field offsets in include/kvswap.h (as bindgen reads it) and in Rust.

use kvswap_layout_test::c;
use std::mem::{align_of, offset_of, size_of};

macro_rules! same_layout {
    ($rust:path, $c:path, [$($f:ident),* $(,)?]) => {{
        assert_eq!(size_of::<$rust>(), size_of::<$c>(), "size of {}", stringify!($rust));
        assert_eq!(align_of::<$rust>(), align_of::<$c>(), "align of {}", stringify!($rust));
        $(assert_eq!(offset_of!($rust, $f), offset_of!($c, $f), "offset of {}.{}", stringify!($rust), stringify!($f));)*
        // The list names every field of both structs: a struct pattern
        // without `..` does not compile when a field is missing from it.
        #[allow(dead_code)]
        fn every_field_listed(r: &$rust, c: &$c) {
            let $rust { $($f: _),* } = r;
            let $c { $($f: _),* } = c;
        }
    }};
}

#[test]
fn structs_match() {
    let mut n = 0;
    n += 1; same_layout!(kvswap::KvswapConfig, c::KvswapConfig, [
        enable, gpu_chunks, pinned_mib, sync, validate, test_allow_topk_reduction, index_topk,
        window, fm_ensemble, mem_profile, backend, device, fm_ckpt
    ]);
    n += 1; same_layout!(kvswap::KvswapLayerSpec, c::KvswapLayerSpec, [
        compressed_cap, chunk_bytes, staging, staging_stride
    ]);
    n += 1; same_layout!(kvswap::KvswapSwapIn, c::KvswapSwapIn, [layer, window_len, count, reserved, indices]);
    n += 1; same_layout!(kvswap::KvswapLayerStats, c::KvswapLayerStats, [
        hits, misses, evictions, stores, refreshes, h2d_bytes, d2h_bytes, swap_in_calls,
        compressed_cap, chunk_bytes, slots, resident, swap_enabled, reserved
    ]);
    n += 1; same_layout!(kvswap::ffi::KvswapContextInfo, c::KvswapContextInfo, [
        backend, device, n_layers, swap_layers, host_tier_bytes, staging_bytes
    ]);
    n += 1; same_layout!(kvswap::ffi::FmKeys, c::FmKeys, [data, scales, row_stride_bytes, dtype]);
    n += 1; same_layout!(kvswap::ffi::FmSeq, c::FmSeq, [hidden, keys, n_chunks, out_indices]);
    n += 1; same_layout!(kvswap::ffi::FmScorerInfo, c::FmScorerInfo, [
        n_scorers, hidden, n_heads, head_dim, ensemble, device, weight_bytes, query, reserved
    ]);
    // Every struct the header defines is checked above (opaque handles,
    // `typedef struct X X;`, have no layout to check).
    let header = include_str!("../../../include/kvswap.h");
    let defined = header.matches("typedef struct ").filter(|_| true).count()
        - ["KvswapContext", "FmScorer"]
            .iter()
            .map(|h| header.matches(&format!("typedef struct {h} {h};")).count())
            .sum::<usize>();
    assert_eq!(n, defined, "a struct of the header is not checked here");
}

#[test]
fn enums_and_constants_match() {
    use kvswap::KvswapStatus as S;
    assert_eq!(size_of::<S>(), size_of::<c::KvswapStatus>());
    assert_eq!(align_of::<S>(), align_of::<c::KvswapStatus>());
    let pairs = [
        (S::Ok, c::KvswapStatus_KVSWAP_STATUS_OK),
        (S::InvalidArgument, c::KvswapStatus_KVSWAP_STATUS_INVALID_ARGUMENT),
        (S::NullPointer, c::KvswapStatus_KVSWAP_STATUS_NULL_POINTER),
        (S::OutOfRange, c::KvswapStatus_KVSWAP_STATUS_OUT_OF_RANGE),
        (S::NotStored, c::KvswapStatus_KVSWAP_STATUS_NOT_STORED),
        (S::PinnedCap, c::KvswapStatus_KVSWAP_STATUS_PINNED_CAP),
        (S::TopkGuard, c::KvswapStatus_KVSWAP_STATUS_TOPK_GUARD),
        (S::NoDevice, c::KvswapStatus_KVSWAP_STATUS_NO_DEVICE),
        (S::DeviceError, c::KvswapStatus_KVSWAP_STATUS_DEVICE_ERROR),
        (S::OutOfMemory, c::KvswapStatus_KVSWAP_STATUS_OUT_OF_MEMORY),
        (S::ValidationFailed, c::KvswapStatus_KVSWAP_STATUS_VALIDATION_FAILED),
        (S::WrongDevice, c::KvswapStatus_KVSWAP_STATUS_WRONG_DEVICE),
        (S::Io, c::KvswapStatus_KVSWAP_STATUS_IO),
        (S::BadCheckpoint, c::KvswapStatus_KVSWAP_STATUS_BAD_CHECKPOINT),
        (S::Unsupported, c::KvswapStatus_KVSWAP_STATUS_UNSUPPORTED),
        (S::Panic, c::KvswapStatus_KVSWAP_STATUS_PANIC),
    ];
    for (r, cv) in pairs {
        assert_eq!(r as i64, cv as i64, "{}", r.name());
    }
    let header = include_str!("../../../include/kvswap.h");
    assert_eq!(header.matches("  KVSWAP_STATUS_").count(), pairs.len(), "a status is not checked here");
    assert_eq!(kvswap::config::KVSWAP_BACKEND_AUTO, c::KVSWAP_BACKEND_AUTO);
    assert_eq!(kvswap::config::KVSWAP_BACKEND_CPU, c::KVSWAP_BACKEND_CPU);
    assert_eq!(kvswap::config::KVSWAP_BACKEND_CUDA, c::KVSWAP_BACKEND_CUDA);
    assert_eq!(kvswap::config::KVSWAP_ENSEMBLE_MAX, c::KVSWAP_ENSEMBLE_MAX);
    assert_eq!(kvswap::config::KVSWAP_ENSEMBLE_MEAN, c::KVSWAP_ENSEMBLE_MEAN);
    assert_eq!(kvswap::config::KVSWAP_PATH_MAX as u64, c::KVSWAP_PATH_MAX as u64);
    assert_eq!(kvswap::scorer::keys::FM_KEYS_F32, c::FM_KEYS_F32);
    assert_eq!(kvswap::scorer::keys::FM_KEYS_BF16, c::FM_KEYS_BF16);
    assert_eq!(kvswap::scorer::keys::FM_KEYS_FP8_E4M3, c::FM_KEYS_FP8_E4M3);
    assert_eq!(kvswap::scorer::FM_MAX_CHUNKS as u64, c::FM_MAX_CHUNKS as u64);
    assert_eq!(kvswap::scorer::FM_MAX_TOPK as u64, c::FM_MAX_TOPK as u64);
    assert_eq!(kvswap::scorer::FM_MAX_SEQS as u64, c::FM_MAX_SEQS as u64);
    assert_eq!(kvswap::scorer::bounds::FM_MAX_BOUNDS_DIM as u64, c::FM_MAX_BOUNDS_DIM as u64);
}
