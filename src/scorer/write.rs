//! Writing `flashmemory-v1` checkpoints with the `safetensors` crate: from
//! given weights (tests, conversion tools) or seeded random ones
//! (`kvswap fm init`).

use super::checkpoint::{wq_name, ww_name, Meta};
use super::dtype::WeightDtype;
use crate::error::{Error, KvswapStatus, Result};
use safetensors::{Dtype, View};
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
    let t = NewTensor::from_values(name, dtype, &shape, values.iter().map(|&v| v as f64));
    // What the loader refuses is refused here: NaN, Inf, and values that
    // overflow the dtype (1e5 in f16 is Inf).
    for (i, &v) in values.iter().enumerate() {
        let stored = dtype.get(&t.data, i);
        if !stored.is_finite() {
            return Err(Error::invalid(format!(
                "{name} element [{}, {}] is {} ({} stored as {stored} in {}): every weight must be finite",
                i / shape[1],
                i % shape[1],
                v,
                v,
                dtype.name()
            )));
        }
    }
    Ok(t)
}

/// The largest checkpoint `random` makes (its weights are held in memory).
/// cbindgen:ignore
pub const RANDOM_MAX_BYTES: u64 = 4 << 30;

/// Seeded random weights, each drawn from N(0, 1/hidden) and rounded to
/// `dtype`, so that a projection of a unit-variance hidden state has unit
/// variance and scores are O(1). The same seed gives the same weights.
pub fn random(meta: &Meta, dtype: WeightDtype, seed: u64) -> Result<Vec<NewTensor>> {
    meta.validate()?;
    // Every dimension is in range, but not necessarily their product: the
    // weights are built in memory, so test and demo checkpoints stop at 4 GiB.
    let bytes = [meta.n_heads as u64 * meta.head_dim as u64 + meta.n_heads as u64, meta.hidden as u64, meta.n_scorers as u64, dtype.size() as u64]
        .into_iter()
        .try_fold(1u64, |acc, x| acc.checked_mul(x));
    if bytes.is_none_or(|b| b > RANDOM_MAX_BYTES) {
        return Err(Error::invalid(format!(
            "{} scorers x ({} heads x {} dims + {} heads) x hidden {} in {} is {}: random checkpoints are at most {} GiB",
            meta.n_scorers,
            meta.n_heads,
            meta.head_dim,
            meta.n_heads,
            meta.hidden,
            dtype.name(),
            bytes.map_or("more than 2^64 bytes".to_string(), |b| format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64)),
            RANDOM_MAX_BYTES >> 30
        )));
    }
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

/// The bytes of a safetensors file holding `meta` and `tensors`. The same
/// inputs give the same bytes: the metadata keys are written sorted (the
/// safetensors crate takes them as a HashMap, in no fixed order).
pub fn to_bytes(meta: &Meta, tensors: &[NewTensor]) -> Result<Vec<u8>> {
    let image = safetensors::serialize(tensors.iter().map(|t| (t.name.clone(), t)), Some(meta.to_metadata()))
        .map_err(|e| Error::invalid(format!("cannot serialize checkpoint: {e}")))?;
    sort_metadata(image)
}

/// `image` with its header's `__metadata__` keys in sorted order. A
/// safetensors file is an 8-byte little-endian header length, the JSON
/// header (padded with spaces to 8 bytes) and the tensor bytes, which the
/// header addresses relative to their start: reordering JSON keys leaves
/// them in place.
fn sort_metadata(image: Vec<u8>) -> Result<Vec<u8>> {
    let len = u64::from_le_bytes(image.get(..8).ok_or_else(|| broken("no header"))?.try_into().unwrap()) as usize;
    let header = image.get(8..8 + len).ok_or_else(|| broken("a short header"))?;
    let mut text = sorted_header(header)?;
    text.resize(text.len().div_ceil(8) * 8, b' ');
    let mut out = Vec::with_capacity(8 + text.len() + image.len() - 8 - len);
    out.extend_from_slice(&(text.len() as u64).to_le_bytes());
    out.extend_from_slice(&text);
    out.extend_from_slice(&image[8 + len..]);
    Ok(out)
}

fn broken(what: &str) -> Error {
    Error::invalid(format!("cannot serialize checkpoint: the safetensors crate wrote {what}"))
}

/// A safetensors JSON header with its `__metadata__` keys sorted (no padding).
/// Reordering keys keeps the compact JSON's length.
fn sorted_header(header: &[u8]) -> Result<Vec<u8>> {
    // BTreeMaps at both levels: sorted whatever serde_json's map keeps.
    use std::collections::BTreeMap;
    let mut json: BTreeMap<String, serde_json::Value> = serde_json::from_slice(header).map_err(|_| broken("a header that is not JSON"))?;
    if let Some(m) = json.get_mut("__metadata__") {
        let sorted: BTreeMap<String, serde_json::Value> = serde_json::from_value(m.take()).map_err(|_| broken("metadata that is not a map"))?;
        *m = serde_json::to_value(sorted).map_err(|_| broken("metadata that cannot be rewritten"))?;
    }
    serde_json::to_vec(&json).map_err(|_| broken("a header that cannot be rewritten"))
}

/// Writes a checkpoint to `path` (the bytes `to_bytes` gives, without holding
/// a second copy of the weights in memory: the crate streams the tensors to
/// the file and the header is sorted in place): through a temporary file in
/// the same directory, renamed into place, created with the process's usual
/// file permissions (0666 less the umask) so that an engine running as
/// another user can read it.
pub fn save(path: &Path, meta: &Meta, tensors: &[NewTensor]) -> Result<()> {
    let name = path.file_name().ok_or_else(|| Error::invalid(format!("checkpoint path {} names no file", path.display())))?;
    // The file is written beside the path and renamed over it: a device,
    // FIFO, directory or symbolic link there would be replaced, not
    // written to. A regular file is replaced (an older checkpoint).
    if let Ok(m) = std::fs::symlink_metadata(path) {
        if !m.file_type().is_file() {
            return Err(Error::new(
                KvswapStatus::Io,
                format!(
                    "cannot write checkpoint {}: it exists and is not a regular file (a directory, device, FIFO or \
                     symbolic link, which the write would replace); give a new path or a regular file's",
                    path.display()
                ),
            ));
        }
    }
    let tmp = path.with_file_name(format!(".{}.tmp{}", name.to_string_lossy(), std::process::id()));
    let written = (|| -> Result<()> {
        use std::io::{Read, Seek, SeekFrom, Write};
        let io = |e: std::io::Error| Error::new(KvswapStatus::Io, format!("cannot write checkpoint {}: {e}", path.display()));
        // The crate writes through a 0600 temporary file: the permissions a
        // plain create gives here (0666 less the umask) are put back after.
        let perms = {
            let probe = std::fs::File::create(&tmp).map_err(io)?;
            let perms = probe.metadata().map_err(io)?.permissions();
            drop(probe);
            std::fs::remove_file(&tmp).map_err(io)?;
            perms
        };
        safetensors::serialize_to_file(tensors.iter().map(|t| (t.name.clone(), t)), Some(meta.to_metadata()), &tmp).map_err(|e| match e {
            safetensors::SafeTensorError::IoError(e) => io(e),
            e => Error::invalid(format!("cannot serialize checkpoint: {e}")),
        })?;
        let mut f = std::fs::OpenOptions::new().read(true).write(true).open(&tmp).map_err(io)?;
        let mut len = [0u8; 8];
        f.read_exact(&mut len).map_err(io)?;
        let len = u64::from_le_bytes(len) as usize;
        if len > 100 << 20 {
            return Err(broken("a header above 100 MiB"));
        }
        let mut header = vec![0u8; len];
        f.read_exact(&mut header).map_err(io)?;
        let mut text = sorted_header(&header)?;
        if text.len() > len {
            return Err(broken("a header that grew when sorted"));
        }
        text.resize(len, b' ');
        f.seek(SeekFrom::Start(8)).map_err(io)?;
        f.write_all(&text).map_err(io)?;
        f.sync_all().map_err(io)?;
        std::fs::set_permissions(&tmp, perms).map_err(io)?;
        std::fs::rename(&tmp, path).map_err(io)
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
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
