//! What a checkpoint holds, for `kvswap fm info`: metadata, every tensor
//! with its dtype and shape, sizes, and statistics of the weights.

use super::checkpoint::{Checkpoint, Matrix, FM_CHECKPOINT_FORMAT};
use super::dtype::WeightDtype;
use serde::Serialize;

/// Statistics of one weight tensor (over its widened values).
#[derive(Clone, Debug, Serialize)]
pub struct TensorStats {
    pub name: String,
    /// `F32`, `F16` or `BF16`.
    pub dtype: String,
    pub shape: [usize; 2],
    pub bytes: u64,
    pub min: f64,
    pub max: f64,
    pub mean: f64,
    /// Standard deviation (population).
    pub std: f64,
    /// Elements equal to zero.
    pub zeros: u64,
}

/// Everything `fm info` prints.
#[derive(Clone, Debug, Serialize)]
pub struct CheckpointInfo {
    pub format: String,
    pub n_scorers: u32,
    pub hidden: u32,
    pub n_heads: u32,
    pub head_dim: u32,
    pub ensemble: String,
    pub file_bytes: u64,
    pub weight_bytes: u64,
    /// The weight tensors, scorer by scorer.
    pub tensors: Vec<TensorStats>,
    /// Tensors of the file the scorer does not use (name, dtype, shape).
    pub ignored: Vec<(String, String, Vec<usize>)>,
}

fn stats(name: &str, dtype: WeightDtype, m: Matrix<'_>) -> TensorStats {
    let n = (m.rows * m.cols) as f64;
    let (mut min, mut max, mut sum, mut sum_sq, mut zeros) = (f64::INFINITY, f64::NEG_INFINITY, 0.0, 0.0, 0u64);
    for r in 0..m.rows {
        for c in 0..m.cols {
            let v = m.get(r, c) as f64;
            min = min.min(v);
            max = max.max(v);
            sum += v;
            sum_sq += v * v;
            zeros += (v == 0.0) as u64;
        }
    }
    let mean = sum / n;
    TensorStats {
        name: name.to_string(),
        dtype: dtype.name().to_string(),
        shape: [m.rows, m.cols],
        bytes: m.bytes.len() as u64,
        min,
        max,
        mean,
        std: (sum_sq / n - mean * mean).max(0.0).sqrt(),
        zeros,
    }
}

/// Gathers the info of a loaded checkpoint.
pub fn info(ckpt: &Checkpoint) -> CheckpointInfo {
    let m = ckpt.meta();
    let tensors: Vec<TensorStats> =
        ckpt.weight_tensors().map(|t| stats(&t.name, t.dtype, ckpt.matrix(t))).collect();
    let ignored = ckpt.file_tensors().iter().filter(|(n, _, _)| !n.starts_with("scorers.")).cloned().collect();
    CheckpointInfo {
        format: FM_CHECKPOINT_FORMAT.to_string(),
        n_scorers: m.n_scorers,
        hidden: m.hidden,
        n_heads: m.n_heads,
        head_dim: m.head_dim,
        ensemble: super::ensemble_name(m.ensemble).to_string(),
        file_bytes: ckpt.file_bytes(),
        weight_bytes: ckpt.weight_bytes(),
        tensors,
        ignored,
    }
}

fn mib(bytes: u64) -> String {
    format!("{:.2} MiB", bytes as f64 / (1024.0 * 1024.0))
}

/// The text `kvswap fm info` prints.
pub fn render(path: &str, i: &CheckpointInfo) -> String {
    let mut s = format!("{path}: FlashMemory checkpoint ({}), {} bytes ({})\n", i.format, i.file_bytes, mib(i.file_bytes));
    s += &format!(
        "  metadata: n_scorers={} hidden={} n_heads={} head_dim={} ensemble={}\n",
        i.n_scorers, i.hidden, i.n_heads, i.head_dim, i.ensemble
    );
    s += &format!(
        "  hidden input per call: {} x {} f32; key per chunk: {} elements\n",
        i.n_scorers, i.hidden, i.head_dim
    );
    s += &format!("  weights: {} bytes ({}) in {} tensors\n\n", i.weight_bytes, mib(i.weight_bytes), i.tensors.len());
    s += &format!(
        "  {:<16} {:<5} {:>14} {:>12} {:>11} {:>11} {:>11} {:>11} {:>8}\n",
        "tensor", "dtype", "shape", "bytes", "min", "max", "mean", "std", "zeros"
    );
    for t in &i.tensors {
        s += &format!(
            "  {:<16} {:<5} {:>14} {:>12} {:>11.4e} {:>11.4e} {:>11.4e} {:>11.4e} {:>8}\n",
            t.name,
            t.dtype,
            format!("[{}, {}]", t.shape[0], t.shape[1]),
            t.bytes,
            t.min,
            t.max,
            t.mean,
            t.std,
            t.zeros
        );
    }
    for (name, dtype, shape) in &i.ignored {
        s += &format!("  ignored tensor {}: {dtype} {shape:?}\n", super::checkpoint::shown(name));
    }
    s
}
