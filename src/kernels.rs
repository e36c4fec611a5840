//! CUDA C sources of `kernels/`, embedded in the library and compiled by
//! NVRTC for the device's compute capability on first use.

/// Swap kernels: residency decision, one-launch gather, store, validate, init
/// (with kernels/common.cuh prepended: NVRTC gets one self-contained source).
pub const SWAP_CU: &str = concat!(include_str!("../kernels/common.cuh"), "\n", include_str!("../kernels/swap.cu"));

/// FlashMemory scorer: projections, tensor-core scoring, bounds scorer, top-k.
/// Compiled per scorer shape with `-DFM_SCORERS=.. -DFM_HEADS=.. -DFM_HEAD_DIM=..`.
pub const SCORER_CU: &str = concat!(include_str!("../kernels/common.cuh"), "\n", include_str!("../kernels/scorer.cu"));

/// Every kernel source, by file name (CI compiles each with NVRTC; the scorer
/// with its default shape, 3 scorers x 64 heads x 128 dims).
pub const ALL: &[(&str, &str)] = &[("swap.cu", SWAP_CU), ("scorer.cu", SCORER_CU)];
