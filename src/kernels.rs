//! CUDA C sources of `kernels/`, embedded in the library and compiled by
//! NVRTC for the device's compute capability on first use.

/// Swap kernels: residency decision, one-launch gather, store, validate, init
/// (with kernels/common.cuh prepended: NVRTC gets one self-contained source).
pub const SWAP_CU: &str = concat!(include_str!("../kernels/common.cuh"), "\n", include_str!("../kernels/swap.cu"));

/// FlashMemory scorer: projections, tensor-core scoring, bounds scorer, top-k
/// (kernels/scorer/, one file per concern, concatenated in dependency order).
/// Compiled per scorer shape with `-DFM_SCORERS=.. -DFM_HEADS=.. -DFM_HEAD_DIM=..`.
pub const SCORER_CU: &str = concat!(
    include_str!("../kernels/common.cuh"),
    "\n",
    include_str!("../kernels/scorer/helpers.cuh"),
    "\n",
    include_str!("../kernels/scorer/project.cu"),
    "\n",
    include_str!("../kernels/scorer/score_mma.cu"),
    "\n",
    include_str!("../kernels/scorer/score_wgmma.cu"),
    "\n",
    include_str!("../kernels/scorer/score_wgmma_fp8.cu"),
    "\n",
    include_str!("../kernels/scorer/bounds.cu"),
    "\n",
    include_str!("../kernels/scorer/topk.cu"),
);

/// Benchmark probes of `kvswap bench` (the device's read rate).
pub const BENCH_CU: &str = concat!(include_str!("../kernels/common.cuh"), "\n", include_str!("../kernels/bench.cu"));

/// Every kernel source, by file name (CI compiles each with NVRTC; the scorer
/// with its default shape, 3 scorers x 64 heads x 128 dims).
pub const ALL: &[(&str, &str)] = &[("swap.cu", SWAP_CU), ("scorer.cu", SCORER_CU), ("bench.cu", BENCH_CU)];
