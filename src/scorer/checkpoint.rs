//! The `flashmemory-v1` checkpoint: a safetensors file whose metadata holds
//! `format = flashmemory-v1`, `n_scorers`, `hidden`, `n_heads`, `head_dim`
//! and `ensemble` (`max` or `mean`), with two tensors per scorer i:
//!
//! - `scorers.{i}.wq`, shape `[n_heads*head_dim, hidden]`;
//! - `scorers.{i}.ww`, shape `[n_heads, hidden]`;
//!
//! each F32, F16 or BF16 (tensors may differ), every element finite.
//! Tensors whose names do not start with `scorers.` are ignored (a training
//! script may leave its own); any other `scorers.*` name is an error, as it
//! means the file and `n_scorers` disagree.
//!
//! The file is read into memory and parsed by the `safetensors` crate (no
//! mmap: the file may change on disk later without affecting a loaded
//! scorer). The raw bytes and dtype of every tensor stay available, so a
//! device backend uploads bf16 weights as they are.

use super::dtype::WeightDtype;
use crate::config::Ensemble;
use crate::error::{Error, KvswapStatus, Result};
use safetensors::tensor::{Metadata, TensorInfo};
use safetensors::SafeTensors;
use std::collections::HashMap;
use std::ops::Range;
use std::path::Path;

/// The value of the `format` metadata field.
pub const FM_CHECKPOINT_FORMAT: &str = "flashmemory-v1";

// Limits on the checkpoint's dimensions: generous for real models, and small
// enough that no size computation can overflow and no finite f32 input can
// make an f64 score overflow.
const MAX_SCORERS: u64 = 64;
const MAX_HIDDEN: u64 = 1 << 20;
const MAX_HEADS: u64 = 4096;
const MAX_HEAD_DIM: u64 = 4096;

/// The shape and settings of a checkpoint (its metadata).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Meta {
    /// Scorer heads (3 in the reference engine: layers 10, 12, 20).
    pub n_scorers: u32,
    /// Width of each scorer's hidden input.
    pub hidden: u32,
    /// Heads per scorer.
    pub n_heads: u32,
    /// Elements per head, and per indexer key.
    pub head_dim: u32,
    /// How the scorers are combined unless overridden.
    pub ensemble: Ensemble,
}

impl Meta {
    /// Rows of each `wq`: `n_heads * head_dim`.
    pub fn q_rows(&self) -> usize {
        self.n_heads as usize * self.head_dim as usize
    }

    /// Expected shape of `scorers.{i}.wq`.
    pub fn wq_shape(&self) -> [usize; 2] {
        [self.q_rows(), self.hidden as usize]
    }

    /// Expected shape of `scorers.{i}.ww`.
    pub fn ww_shape(&self) -> [usize; 2] {
        [self.n_heads as usize, self.hidden as usize]
    }

    /// f32 values of one call's hidden input: `n_scorers * hidden`.
    pub fn hidden_len(&self) -> usize {
        self.n_scorers as usize * self.hidden as usize
    }

    /// Checks every dimension against the limits.
    pub fn validate(&self) -> Result<()> {
        check_dim("n_scorers", self.n_scorers as u64, MAX_SCORERS)?;
        check_dim("hidden", self.hidden as u64, MAX_HIDDEN)?;
        check_dim("n_heads", self.n_heads as u64, MAX_HEADS)?;
        check_dim("head_dim", self.head_dim as u64, MAX_HEAD_DIM)
    }

    /// The metadata map written to a checkpoint.
    pub fn to_metadata(&self) -> HashMap<String, String> {
        [
            ("format", FM_CHECKPOINT_FORMAT.to_string()),
            ("n_scorers", self.n_scorers.to_string()),
            ("hidden", self.hidden.to_string()),
            ("n_heads", self.n_heads.to_string()),
            ("head_dim", self.head_dim.to_string()),
            ("ensemble", super::ensemble_name(self.ensemble).to_string()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
    }
}

fn check_dim(field: &str, v: u64, max: u64) -> Result<()> {
    if v == 0 || v > max {
        return Err(bad(format!("metadata `{field}` = {v}: expected an integer in 1..={max}")));
    }
    Ok(())
}

fn bad(message: String) -> Error {
    Error::new(KvswapStatus::BadCheckpoint, message)
}

/// The name of scorer `i`'s query projection.
pub fn wq_name(i: usize) -> String {
    format!("scorers.{i}.wq")
}

/// The name of scorer `i`'s head-weight projection.
pub fn ww_name(i: usize) -> String {
    format!("scorers.{i}.ww")
}

/// One weight tensor of a loaded checkpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorEntry {
    /// `scorers.{i}.wq` or `scorers.{i}.ww`.
    pub name: String,
    /// Element type as stored.
    pub dtype: WeightDtype,
    /// `[rows, cols]`, row-major.
    pub shape: [usize; 2],
    /// Where its bytes are in the file image.
    range: Range<usize>,
}

/// A row-major matrix view over raw little-endian bytes.
#[derive(Clone, Copy, Debug)]
pub struct Matrix<'a> {
    /// `rows * cols * dtype.size()` bytes.
    pub bytes: &'a [u8],
    pub dtype: WeightDtype,
    pub rows: usize,
    pub cols: usize,
}

impl Matrix<'_> {
    /// Element `(r, c)`, widened exactly.
    pub fn get(&self, r: usize, c: usize) -> f32 {
        self.dtype.get(self.bytes, r * self.cols + c)
    }

    /// Row `r` widened exactly into `out` (`cols` values).
    pub fn row_into(&self, r: usize, out: &mut [f64]) {
        let row = &self.bytes[r * self.cols * self.dtype.size()..(r + 1) * self.cols * self.dtype.size()];
        for (c, o) in out.iter_mut().enumerate().take(self.cols) {
            *o = self.dtype.get(row, c) as f64;
        }
    }
}

/// A validated checkpoint held in memory.
#[derive(Debug)]
pub struct Checkpoint {
    meta: Meta,
    /// The whole file.
    image: Vec<u8>,
    wq: Vec<TensorEntry>,
    ww: Vec<TensorEntry>,
    /// Every tensor of the file (also ignored ones), by offset, for `fm info`.
    all: Vec<(String, String, Vec<usize>)>,
}

impl Checkpoint {
    /// Reads and validates the file at `path`. A missing or unreadable file is
    /// `KVSWAP_STATUS_IO`; anything wrong inside is `KVSWAP_STATUS_BAD_CHECKPOINT`,
    /// with a message naming the field or tensor, what was expected and what
    /// was found.
    pub fn load(path: &Path) -> Result<Checkpoint> {
        use std::io::{Read, Seek, SeekFrom};
        let io = |e: std::io::Error| Error::new(KvswapStatus::Io, format!("cannot read checkpoint {}: {e}", path.display()));
        let named = |e: Error| Error::new(e.status, format!("checkpoint {}: {}", path.display(), e.message));
        let mut file = std::fs::File::open(path).map_err(io)?;
        let meta = file.metadata().map_err(io)?;
        if !meta.is_file() {
            // A device or pipe (/dev/zero) would be read without end.
            return Err(Error::new(KvswapStatus::Io, format!("cannot read checkpoint {}: not a regular file", path.display())));
        }
        let len = meta.len();
        // The header first: a file of another format, or one whose size is
        // not what its header describes, is refused before its data
        // (possibly gigabytes) is read or memory is reserved for it.
        check_header(&mut file, len).map_err(|e| match e {
            HeaderError::Io(e) => io(e),
            HeaderError::Bad(e) => named(e),
        })?;
        file.seek(SeekFrom::Start(0)).map_err(io)?;
        let size = usize::try_from(len).map_err(|_| named(bad(format!("{len} bytes do not fit this machine's address space"))))?;
        let mut image = crate::error::try_vec(size, "the checkpoint's bytes").map_err(named)?;
        file.read_to_end(&mut image).map_err(io)?;
        Checkpoint::from_bytes(image).map_err(named)
    }

    /// Validates a checkpoint held in memory (the whole file).
    pub fn from_bytes(image: Vec<u8>) -> Result<Checkpoint> {
        let (header_len, st_meta) = SafeTensors::read_metadata(&image).map_err(|e| {
            bad(format!("not a valid safetensors file ({} bytes; truncated or corrupt?): {e}", image.len()))
        })?;
        let data_start = 8 + header_len;
        let meta = parse_meta(&st_meta)?;
        check_no_stray_scorers(&st_meta, &meta)?;
        let mut wq = Vec::with_capacity(meta.n_scorers as usize);
        let mut ww = Vec::with_capacity(meta.n_scorers as usize);
        for i in 0..meta.n_scorers as usize {
            wq.push(entry(&st_meta, &image, data_start, &wq_name(i), meta.wq_shape(), "[n_heads*head_dim, hidden]")?);
            ww.push(entry(&st_meta, &image, data_start, &ww_name(i), meta.ww_shape(), "[n_heads, hidden]")?);
        }
        let all = st_meta
            .offset_keys()
            .into_iter()
            .filter_map(|n| st_meta.info(&n).map(|t| (n.clone(), format!("{:?}", t.dtype), t.shape.clone())))
            .collect();
        Ok(Checkpoint { meta, image, wq, ww, all })
    }

    /// Shape and settings.
    pub fn meta(&self) -> &Meta {
        &self.meta
    }

    /// Size of the file in bytes.
    pub fn file_bytes(&self) -> u64 {
        self.image.len() as u64
    }

    /// Bytes of all weight tensors as stored (what a device backend uploads).
    pub fn weight_bytes(&self) -> u64 {
        self.wq.iter().chain(&self.ww).map(|t| t.range.len() as u64).sum()
    }

    /// The `wq` and `ww` tensors of scorer `i` (`i < n_scorers`).
    pub fn tensors(&self, i: usize) -> (&TensorEntry, &TensorEntry) {
        (&self.wq[i], &self.ww[i])
    }

    /// Every weight tensor, scorer by scorer (`wq` then `ww`).
    pub fn weight_tensors(&self) -> impl Iterator<Item = &TensorEntry> {
        self.wq.iter().zip(&self.ww).flat_map(|(q, w)| [q, w])
    }

    /// Every tensor of the file, ignored ones included: name, dtype, shape.
    pub fn file_tensors(&self) -> &[(String, String, Vec<usize>)] {
        &self.all
    }

    /// The stored little-endian bytes of `t` (a tensor of this checkpoint).
    pub fn raw(&self, t: &TensorEntry) -> &[u8] {
        &self.image[t.range.clone()]
    }

    /// `t` as a matrix view.
    pub fn matrix(&self, t: &TensorEntry) -> Matrix<'_> {
        Matrix { bytes: self.raw(t), dtype: t.dtype, rows: t.shape[0], cols: t.shape[1] }
    }

    /// Scorer `i`'s `wq` as a matrix.
    pub fn wq(&self, i: usize) -> Matrix<'_> {
        self.matrix(&self.wq[i])
    }

    /// Scorer `i`'s `ww` as a matrix.
    pub fn ww(&self, i: usize) -> Matrix<'_> {
        self.matrix(&self.ww[i])
    }
}

enum HeaderError {
    Io(std::io::Error),
    Bad(Error),
}

/// Checks the file of `len` bytes from its first 8 + n bytes (n: the
/// header's length field) as `from_bytes` would check the whole of it: a
/// plausible header length, a JSON header with the `flashmemory-v1` format
/// tag, and tensors whose data ends exactly at the end of the file.
fn check_header(file: &mut std::fs::File, len: u64) -> std::result::Result<(), HeaderError> {
    use std::io::Read;
    let not_st = |why: String| HeaderError::Bad(bad(format!("not a valid safetensors file ({len} bytes; truncated or corrupt?): {why}")));
    if len < 8 {
        return Err(not_st("shorter than the 8-byte header length".into()));
    }
    let mut n = [0u8; 8];
    file.read_exact(&mut n).map_err(HeaderError::Io)?;
    let n = u64::from_le_bytes(n);
    if n > HEADER_MAX {
        return Err(not_st(format!("its header length field says {n} bytes, over the {HEADER_MAX}-byte limit")));
    }
    if 8 + n > len {
        return Err(not_st(format!("its header length field says {n} bytes, past the end of the file")));
    }
    let mut header = vec![0u8; n as usize];
    file.read_exact(&mut header).map_err(HeaderError::Io)?;
    let json: serde_json::Value = serde_json::from_slice(&header).map_err(|e| not_st(format!("its header is not JSON: {e}")))?;
    format_check(json.get("__metadata__").and_then(|m| m.get("format")).map(|f| f.as_str().unwrap_or("(not a string)")))
        .map_err(HeaderError::Bad)?;
    // Where the tensors' data ends (safetensors: the offsets tile the data
    // section, which ends the file). A malformed entry is left to
    // `from_bytes`, which names it; the file is then read whole, as its
    // size is what the header's other entries allow.
    let mut data_end = 0u64;
    if let Some(tensors) = json.as_object() {
        for (name, t) in tensors {
            if name == "__metadata__" {
                continue;
            }
            match t.get("data_offsets").and_then(|o| o.as_array()).and_then(|o| o.get(1)).and_then(|e| e.as_u64()) {
                Some(end) => data_end = data_end.max(end),
                None => return Ok(()),
            }
        }
    }
    // n <= HEADER_MAX; data_end comes from the file and may be anything.
    match data_end.checked_add(8 + n) {
        Some(described) if described == len => {}
        Some(described) => return Err(not_st(format!("its header describes {described} bytes"))),
        None => return Err(not_st(format!("a tensor's data_offsets end at byte {data_end}, past any file"))),
    }
    Ok(())
}
/// The safetensors crate's limit on a header's size.
const HEADER_MAX: u64 = 100_000_000;

fn format_check(found: Option<&str>) -> Result<()> {
    match found {
        Some(f) if f == FM_CHECKPOINT_FORMAT => Ok(()),
        Some(f) => Err(bad(format!("metadata `format` = {f:?}: expected {FM_CHECKPOINT_FORMAT:?}"))),
        None => Err(bad(format!("metadata has no `format` field ({})", expected_field("format")))),
    }
}

fn parse_meta(st: &Metadata) -> Result<Meta> {
    let empty = HashMap::new();
    let m = st.metadata().as_ref().unwrap_or(&empty);
    let field = |name: &str| -> Result<&String> {
        m.get(name).ok_or_else(|| bad(format!("metadata has no `{name}` field ({})", expected_field(name))))
    };
    format_check(m.get("format").map(String::as_str))?;
    let meta = Meta {
        n_scorers: int_field("n_scorers", field("n_scorers")?)?,
        hidden: int_field("hidden", field("hidden")?)?,
        n_heads: int_field("n_heads", field("n_heads")?)?,
        head_dim: int_field("head_dim", field("head_dim")?)?,
        ensemble: ensemble_field(field("ensemble")?)?,
    };
    meta.validate()?;
    Ok(meta)
}

fn expected_field(name: &str) -> String {
    match name {
        "format" => format!("expected format = {FM_CHECKPOINT_FORMAT}"),
        "ensemble" => "expected max or mean".to_string(),
        _ => "expected a positive integer".to_string(),
    }
}

/// A metadata number: decimal digits only (no sign, no spaces).
fn int_field(name: &str, v: &str) -> Result<u32> {
    let digits = !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit());
    digits
        .then(|| v.parse::<u32>().ok())
        .flatten()
        .ok_or_else(|| bad(format!("metadata `{name}` = {v:?}: expected a positive integer")))
}

fn ensemble_field(v: &str) -> Result<Ensemble> {
    match v.trim() {
        "max" => Ok(Ensemble::Max),
        "mean" => Ok(Ensemble::Mean),
        _ => Err(bad(format!("metadata `ensemble` = {v:?}: expected \"max\" or \"mean\""))),
    }
}

/// A `scorers.*` tensor that is not one of the expected names.
fn check_no_stray_scorers(st: &Metadata, meta: &Meta) -> Result<()> {
    let expected: Vec<String> = (0..meta.n_scorers as usize).flat_map(|i| [wq_name(i), ww_name(i)]).collect();
    let mut stray: Vec<String> =
        st.offset_keys().into_iter().filter(|n| n.starts_with("scorers.") && !expected.contains(n)).collect();
    stray.sort();
    match stray.first() {
        None => Ok(()),
        Some(n) => Err(bad(format!(
            "tensor `{n}` is not expected: with n_scorers = {} the scorer tensors are scorers.{{0..{}}}.wq and .ww",
            meta.n_scorers,
            meta.n_scorers - 1
        ))),
    }
}

fn entry(st: &Metadata, image: &[u8], data_start: usize, name: &str, shape: [usize; 2], what: &str) -> Result<TensorEntry> {
    let info: &TensorInfo = st
        .info(name)
        .ok_or_else(|| bad(format!("tensor `{name}` is missing: expected shape {shape:?} = {what}, dtype F32, F16 or BF16")))?;
    let dtype = WeightDtype::from_safetensors(info.dtype)
        .ok_or_else(|| bad(format!("tensor `{name}` has dtype {:?}: expected F32, F16 or BF16", info.dtype)))?;
    if info.shape != shape {
        return Err(bad(format!("tensor `{name}` has shape {:?}: expected {shape:?} = {what}", info.shape)));
    }
    // read_metadata checked that the offsets tile the data section exactly.
    let range = data_start + info.data_offsets.0..data_start + info.data_offsets.1;
    let t = TensorEntry { name: name.to_string(), dtype, shape, range };
    check_finite(&t, &image[t.range.clone()])?;
    Ok(t)
}

fn check_finite(t: &TensorEntry, bytes: &[u8]) -> Result<()> {
    let n = t.shape[0] * t.shape[1];
    match (0..n).find(|&i| !t.dtype.get(bytes, i).is_finite()) {
        None => Ok(()),
        Some(i) => Err(bad(format!(
            "tensor `{}` element [{}, {}] is {}: every weight must be finite",
            t.name,
            i / t.shape[1],
            i % t.shape[1],
            t.dtype.get(bytes, i)
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scorer::write;

    fn meta() -> Meta {
        Meta { n_scorers: 2, hidden: 5, n_heads: 3, head_dim: 2, ensemble: Ensemble::Mean }
    }

    #[test]
    fn round_trip_in_memory() {
        let m = meta();
        let tensors = write::random(&m, WeightDtype::Bf16, 9).unwrap();
        let c = Checkpoint::from_bytes(write::to_bytes(&m, &tensors).unwrap()).unwrap();
        assert_eq!(*c.meta(), m);
        assert_eq!(c.weight_bytes(), 2 * (6 + 3) * 5 * 2);
        let (wq, ww) = c.tensors(1);
        assert_eq!((wq.name.as_str(), wq.shape, ww.shape), ("scorers.1.wq", [6, 5], [3, 5]));
        assert_eq!(c.raw(wq), &tensors[2].data[..]);
        assert_eq!(c.wq(1).get(4, 3), WeightDtype::Bf16.get(&tensors[2].data, 4 * 5 + 3));
    }

    #[test]
    fn metadata_errors_name_the_field() {
        let mut st_meta = meta().to_metadata();
        st_meta.remove("ensemble");
        let tensors = write::random(&meta(), WeightDtype::F32, 1).unwrap();
        let bytes = safetensors::serialize(tensors.iter().map(|t| (t.name.clone(), t)), Some(st_meta)).unwrap();
        let e = Checkpoint::from_bytes(bytes).unwrap_err();
        assert_eq!(e.status, KvswapStatus::BadCheckpoint);
        assert!(e.message.contains("no `ensemble` field") && e.message.contains("max or mean"), "{}", e.message);
        // Numbers are plain decimal digits: a sign or spaces are refused.
        for v in [" 2", "+2", "2 ", "", "0x2", "-1"] {
            let mut st_meta = meta().to_metadata();
            st_meta.insert("n_scorers".into(), v.into());
            let bytes = safetensors::serialize(tensors.iter().map(|t| (t.name.clone(), t)), Some(st_meta)).unwrap();
            let e = Checkpoint::from_bytes(bytes).unwrap_err();
            assert_eq!(e.status, KvswapStatus::BadCheckpoint, "{v:?}");
            assert!(e.message.contains("`n_scorers`") && e.message.contains("positive integer"), "{v:?}: {}", e.message);
        }
        let big = Meta { head_dim: 5000, ..meta() };
        assert!(big.validate().unwrap_err().message.contains("`head_dim` = 5000: expected an integer in 1..=4096"));
    }

    #[test]
    fn data_offsets_past_any_file_are_refused() {
        // A header whose tensor ends at byte 2^64 - 1: refused as a bad
        // checkpoint from the header (the size sum used to overflow).
        let header = br#"{"__metadata__":{"format":"flashmemory-v1"},"scorers.0.wq":{"dtype":"F32","shape":[1],"data_offsets":[0,18446744073709551615]}}"#;
        let mut file = (header.len() as u64).to_le_bytes().to_vec();
        file.extend_from_slice(header);
        file.extend_from_slice(&[0u8; 4]);
        let path = std::env::temp_dir().join(format!("kvswap-offsets-{}.safetensors", std::process::id()));
        std::fs::write(&path, &file).unwrap();
        let e = Checkpoint::load(&path).unwrap_err();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(e.status, KvswapStatus::BadCheckpoint, "{e}");
        assert!(e.message.contains("past any file"), "{e}");
    }
}
