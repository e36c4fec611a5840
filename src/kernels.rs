//! CUDA C sources of `kernels/`, embedded in the library and compiled by
//! NVRTC for the device's compute capability on first use.

/// Swap kernels: residency decision, one-launch gather, store, validate, init.
pub const SWAP_CU: &str = include_str!("../kernels/swap.cu");

/// Every kernel source, by file name (CI compiles each with NVRTC).
pub const ALL: &[(&str, &str)] = &[("swap.cu", SWAP_CU)];
