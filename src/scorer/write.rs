//! Writing `flashmemory-v1` checkpoints with the `safetensors` crate: from
//! given weights (tests, conversion tools) or seeded random ones
//! (`kvswap fm init`).

use super::checkpoint::{wq_name, ww_name, Meta};
use super::dtype::WeightDtype;
use crate::error::{Error, KvswapStatus, Result};
use safetensors::{Dtype, SafeTensorError, View};
use std::borrow::Cow;
use std::path::Path;

/// A tensor to write: name, element type, shape and little-endian bytes.
#[derive(Clone, Debug)]
pub struct NewTensor {
    pub name: String,
    pub dtype: WeightDtype,
    pub shape: Vec<usize>,
    pub data: Vec<u8>,
}

impl NewTensor {
    /// Rounds `values` (row-major, `shape` elements) to `dtype`.
    pub fn from_values(name: &str, dtype: WeightDtype, shape: &[usize], values: impl IntoIterator<Item = f64>) -> NewTensor {
        let mut data = Vec::with_capacity(shape.iter().product::<usize>() * dtype.size());
        for v in values {
            dtype.encode(v, &mut data);
        }
        NewTensor { name: name.to_string(), dtype, shape: shape.to_vec(), data }
    }
}

impl View for &NewTensor {
    fn dtype(&self) -> Dtype {
        self.dtype.to_safetensors()
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

/// The tensors of a checkpoint with the given weights: `wq[i]` holds
/// `n_heads*head_dim x hidden` values and `ww[i]` `n_heads x hidden`,
/// row-major, for scorer i.
pub fn from_weights(meta: &Meta, dtype: WeightDtype, wq: &[Vec<f32>], ww: &[Vec<f32>]) -> Result<Vec<NewTensor>> {
    meta.validate()?;
    let n = meta.n_scorers as usize;
    if wq.len() != n || ww.len() != n {
        return Err(Error::invalid(format!("{} wq and {} ww matrices for n_scorers = {n}", wq.len(), ww.len())));
    }
    let mut out = Vec::with_capacity(2 * n);
    for i in 0..n {
        out.push(matrix(&wq_name(i), dtype, meta.wq_shape(), &wq[i])?);
        out.push(matrix(&ww_name(i), dtype, meta.ww_shape(), &ww[i])?);
    }
    Ok(out)
}

fn matrix(name: &str, dtype: WeightDtype, shape: [usize; 2], values: &[f32]) -> Result<NewTensor> {
    if values.len() != shape[0] * shape[1] {
        return Err(Error::invalid(format!("{name}: {} values for shape {shape:?}", values.len())));
    }
    Ok(NewTensor::from_values(name, dtype, &shape, values.iter().map(|&v| v as f64)))
}

/// Seeded random weights, each drawn from N(0, 1/hidden) and rounded to
/// `dtype`, so that a projection of a unit-variance hidden state has unit
/// variance and scores are O(1). The same seed gives the same weights.
pub fn random(meta: &Meta, dtype: WeightDtype, seed: u64) -> Result<Vec<NewTensor>> {
    meta.validate()?;
    let std = 1.0 / (meta.hidden as f64).sqrt();
    let mut rng = Normal::new(seed);
    let mut out = Vec::with_capacity(2 * meta.n_scorers as usize);
    for i in 0..meta.n_scorers as usize {
        for (name, shape) in [(wq_name(i), meta.wq_shape()), (ww_name(i), meta.ww_shape())] {
            let n = shape[0] * shape[1];
            out.push(NewTensor::from_values(&name, dtype, &shape, (0..n).map(|_| rng.next() * std)));
        }
    }
    Ok(out)
}

/// The bytes of a safetensors file holding `meta` and `tensors`.
pub fn to_bytes(meta: &Meta, tensors: &[NewTensor]) -> Result<Vec<u8>> {
    safetensors::serialize(tensors.iter().map(|t| (t.name.clone(), t)), Some(meta.to_metadata()))
        .map_err(|e| Error::invalid(format!("cannot serialize checkpoint: {e}")))
}

/// Writes a checkpoint to `path` (through a temporary file in the same
/// directory, renamed into place).
pub fn save(path: &Path, meta: &Meta, tensors: &[NewTensor]) -> Result<()> {
    safetensors::serialize_to_file(tensors.iter().map(|t| (t.name.clone(), t)), Some(meta.to_metadata()), path)
        .map_err(|e| match e {
            SafeTensorError::IoError(io) => {
                Error::new(KvswapStatus::Io, format!("cannot write checkpoint {}: {io}", path.display()))
            }
            other => Error::invalid(format!("cannot serialize checkpoint {}: {other}", path.display())),
        })
}

/// Standard normal numbers: splitmix64 and the Box-Muller transform.
struct Normal {
    state: u64,
    spare: Option<f64>,
}

impl Normal {
    fn new(seed: u64) -> Normal {
        Normal { state: seed, spare: None }
    }

    fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in (0, 1].
    fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) + 1) as f64 / (1u64 << 53) as f64
    }

    fn next(&mut self) -> f64 {
        if let Some(v) = self.spare.take() {
            return v;
        }
        let r = (-2.0 * self.uniform().ln()).sqrt();
        let t = 2.0 * std::f64::consts::PI * self.uniform();
        self.spare = Some(r * t.sin());
        r * t.cos()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normal_has_unit_variance() {
        let mut n = Normal::new(7);
        let v: Vec<f64> = (0..200_000).map(|_| n.next()).collect();
        let mean = v.iter().sum::<f64>() / v.len() as f64;
        let var = v.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / v.len() as f64;
        assert!(mean.abs() < 0.01, "mean {mean}");
        assert!((var - 1.0).abs() < 0.02, "variance {var}");
    }
}
