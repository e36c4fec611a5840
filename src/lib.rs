//! kvswap: a drop-in KV-block manager. Every KV chunk lives in a host tier;
//! only the chunks a scorer selects for the current decode step are staged on
//! the GPU, in a fixed pool of LRU-managed slots.
//!
//! The C ABI is in [`ffi`] (header: `include/kvswap.h`); Rust users start at
//! [`Context`]. DESIGN.md is the contract.

#[macro_use]
pub mod error;
pub mod backend;
pub mod config;
pub mod context;
pub mod ffi;
#[cfg(feature = "cuda")]
pub mod gpubench;
pub mod hostmem;
pub mod kernels;
pub mod layer;
pub mod logging;
pub mod residency;
pub mod scorer;
pub mod plan;
pub mod demo;
pub mod svg;

pub use backend::BackendKind;
pub use config::{BackendChoice, Config, Ensemble, KvswapConfig};
pub use context::Context;
pub use error::{Error, KvswapStatus, Result};
pub use layer::{KvswapLayerSpec, KvswapLayerStats, KvswapSwapIn, LayerPlan, StagingView};
