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
//! means the file and `n_scorers` disagree. The header is at most 1 MiB,
//! names each key once, and has string metadata values; it is checked by
//! streaming it before the data is read (`scan_header`).
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
        // Opened without blocking (a FIFO would wait for a writer), then
        // refused unless it is a regular file (reads ignore the flag there).
        let mut file = {
            use std::os::unix::fs::OpenOptionsExt;
            std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open(path).map_err(io)?
        };
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
        // The header scan of `load` (which checked the file's header before
        // reading it), for images made in memory too.
        let len = image.len() as u64;
        let n = match image.get(..8) {
            Some(b) => header_len(u64::from_le_bytes(b.try_into().unwrap()), len)?,
            None => return Err(not_safetensors(len, "shorter than the 8-byte header length".into())),
        };
        scan_header(&image[8..8 + n as usize], len)?;
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
    if len < 8 {
        return Err(HeaderError::Bad(not_safetensors(len, "shorter than the 8-byte header length".into())));
    }
    let mut n = [0u8; 8];
    file.read_exact(&mut n).map_err(HeaderError::Io)?;
    let n = header_len(u64::from_le_bytes(n), len).map_err(HeaderError::Bad)?;
    let mut header = vec![0u8; n as usize];
    file.read_exact(&mut header).map_err(HeaderError::Io)?;
    scan_header(&header, len).map_err(HeaderError::Bad)
}

/// "not a valid safetensors file" for a file of `len` bytes, and why.
fn not_safetensors(len: u64, why: String) -> Error {
    bad(format!("not a valid safetensors file ({len} bytes; truncated or corrupt?): {why}"))
}

/// The header length field `n` of a file of `len` bytes, checked against
/// HEADER_MAX and the file's size.
fn header_len(n: u64, len: u64) -> Result<u64> {
    if n > HEADER_MAX {
        return Err(not_safetensors(len, format!("its header length field says {n} bytes, over kvswap's {HEADER_MAX}-byte limit")));
    }
    if 8 + n > len {
        return Err(not_safetensors(len, format!("its header length field says {n} bytes, past the end of the file")));
    }
    Ok(n)
}

/// The checks of `check_header` on the header's bytes (of a file of `len`
/// bytes): JSON whose top-level keys and metadata keys are unique, metadata
/// values that are strings, the `flashmemory-v1` format tag, and tensors
/// whose data ends exactly at the end of the file. It streams the JSON (no
/// tree of it is built: a header of a million tiny objects would take ~100x
/// its size as a `serde_json::Value`), so its memory is about the header's
/// size; the `safetensors` crate parses the header afterwards.
fn scan_header(header: &[u8], len: u64) -> Result<()> {
    let n = header.len() as u64;
    let Scan(scan): Scan<HeaderScan> = serde_json::from_slice(header).map_err(|e| match e.classify() {
        // Our own refusals (duplicates, non-string metadata) come as custom errors.
        serde_json::error::Category::Data if e.to_string().starts_with(SCAN_MARK) => {
            bad(e.to_string().trim_start_matches(SCAN_MARK).split(" at line ").next().unwrap_or_default().to_string())
        }
        serde_json::error::Category::Data => not_safetensors(len, format!("its header is JSON but not a safetensors header: {e}")),
        _ => not_safetensors(len, format!("its header is not JSON: {e}")),
    })?;
    format_check(match &scan.format {
        None => None,
        Some(Scanned::Str(f)) => Some(f.as_str()),
        Some(other) => return Err(bad(format!("metadata `format` is {}, not a string: expected {FM_CHECKPOINT_FORMAT:?}", other.kind()))),
    })?;
    // Where the tensors' data ends (safetensors: the offsets tile the data
    // section, which ends the file). A malformed entry is left to
    // `from_bytes`, which names it; the file is then read whole, as its
    // size is what the header's other entries allow.
    if scan.incomplete {
        return Ok(());
    }
    let data_end = scan.data_end;
    // n <= HEADER_MAX; data_end comes from the file and may be anything.
    match data_end.checked_add(8 + n) {
        Some(described) if described == len => Ok(()),
        Some(described) => Err(not_safetensors(len, format!("its header describes {described} bytes"))),
        None => Err(not_safetensors(len, format!("a tensor's data_offsets end at byte {data_end}, past any file"))),
    }
}

/// kvswap's limit on a checkpoint's header: a `flashmemory-v1` header is
/// about 20 KB at 64 scorers, and the `safetensors` crate's own limit (100
/// MB) lets a header of tiny JSON objects take gigabytes while parsed.
const HEADER_MAX: u64 = 1 << 20;

/// A JSON name or string in an error message: escaped (no terminal control
/// characters) and cut to 80 characters.
pub(crate) fn shown(name: &str) -> String {
    let mut out: String = name.chars().take(80).flat_map(char::escape_debug).collect();
    if name.chars().nth(80).is_some() {
        out.push_str("...");
    }
    out
}

/// What `scan_header` needs from the header, read by streaming it.
#[derive(Default)]
struct HeaderScan {
    /// `__metadata__.format`, as read (None: no such field or no metadata).
    format: Option<Scanned>,
    /// The largest data_offsets end.
    data_end: u64,
    /// An entry has no data_offsets that are a pair of integers (left to
    /// `from_bytes`, which names the entry): `data_end` says nothing.
    incomplete: bool,
}

/// Prefix of the scan's own refusals among serde_json's errors.
const SCAN_MARK: &str = "kvswap-header: ";

/// A JSON value read by streaming: a string's text, an unsigned integer,
/// the second of an array of two unsigned integers, or only its kind
/// (nothing else is kept, so no tree of the value is built).
enum Scanned {
    Str(String),
    Uint(u64),
    Pair(u64, u64),
    Other(&'static str),
}

impl Scanned {
    fn kind(&self) -> &'static str {
        match self {
            Scanned::Str(_) => "a string",
            Scanned::Uint(_) => "a number",
            Scanned::Pair(..) => "an array",
            Scanned::Other(k) => k,
        }
    }
}

/// The visits of a scalar value, as `Scanned` values (`$to` turns one into
/// the visitor's result).
macro_rules! visit_scalars {
    ($value:ty, $to:expr) => {
        fn visit_str<E: serde::de::Error>(self, v: &str) -> std::result::Result<$value, E> {
            $to(Scanned::Str(v.to_string()))
        }
        fn visit_bool<E: serde::de::Error>(self, _: bool) -> std::result::Result<$value, E> {
            $to(Scanned::Other("a boolean"))
        }
        fn visit_u64<E: serde::de::Error>(self, v: u64) -> std::result::Result<$value, E> {
            $to(Scanned::Uint(v))
        }
        fn visit_i64<E: serde::de::Error>(self, v: i64) -> std::result::Result<$value, E> {
            $to(u64::try_from(v).map_or(Scanned::Other("a number"), Scanned::Uint))
        }
        fn visit_f64<E: serde::de::Error>(self, _: f64) -> std::result::Result<$value, E> {
            $to(Scanned::Other("a number"))
        }
        fn visit_unit<E: serde::de::Error>(self) -> std::result::Result<$value, E> {
            $to(Scanned::Other("null"))
        }
    };
}

/// `visit_scalars` and the visit of an array: [u64, u64] is a `Pair`, any
/// other array only its kind.
macro_rules! visit_non_objects {
    ($value:ty, $to:expr) => {
        visit_scalars!($value, $to);
        fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut s: A) -> std::result::Result<$value, A::Error> {
            let (mut count, mut pair, mut all_uint) = (0u64, [0u64; 2], true);
            while let Some(e) = s.next_element::<Scanned>()? {
                match e {
                    Scanned::Uint(v) if count < 2 => pair[count as usize] = v,
                    Scanned::Uint(_) => {}
                    _ => all_uint = false,
                }
                count += 1;
            }
            $to(if count == 2 && all_uint { Scanned::Pair(pair[0], pair[1]) } else { Scanned::Other("an array") })
        }
    };
}

impl<'de> serde::Deserialize<'de> for Scanned {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        use serde::de::{IgnoredAny, MapAccess, Visitor};
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Scanned;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON value")
            }
            visit_non_objects!(Scanned, Ok);
            fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> std::result::Result<Scanned, A::Error> {
                while m.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(Scanned::Other("an object"))
            }
        }
        d.deserialize_any(V)
    }
}

/// An object of the header read by streaming, entry by entry (the header
/// itself, its metadata, a tensor entry), through `Scan<T>`: each key once
/// (a repeated key is refused), its value read by `entry`.
trait ObjectScan: Default {
    /// What it is, in serde's messages.
    const WHAT: &'static str;
    /// Whose keys, in the repeated-key message.
    const KEYS: &'static str;
    /// Reads the value of `key` from `m`.
    fn entry<'de, A: serde::de::MapAccess<'de>>(&mut self, key: &str, m: &mut A) -> std::result::Result<(), A::Error>;
    /// Accepts a value that is not an object, of that kind (a tensor entry:
    /// left to the crate), or refuses it (None).
    fn not_object(_kind: &'static str) -> Option<Self> {
        None
    }
}

/// `T` read by streaming.
struct Scan<T>(T);

/// `Scan<T>` for a value that is not an object: `T::not_object`, or an error.
fn not_object<T: ObjectScan, E: serde::de::Error>(v: Scanned) -> std::result::Result<Scan<T>, E> {
    T::not_object(v.kind()).map(Scan).ok_or_else(|| E::custom(format!("expected {}, found {}", T::WHAT, v.kind())))
}

impl<'de, T: ObjectScan> serde::Deserialize<'de> for Scan<T> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        use serde::de::{Error as _, MapAccess, Visitor};
        struct V<T>(std::marker::PhantomData<T>);
        impl<'de, T: ObjectScan> Visitor<'de> for V<T> {
            type Value = Scan<T>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str(T::WHAT)
            }
            visit_non_objects!(Scan<T>, not_object::<T, _>);
            fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> std::result::Result<Scan<T>, A::Error> {
                let (mut t, mut seen) = (T::default(), std::collections::HashSet::new());
                while let Some(key) = m.next_key::<String>()? {
                    if !seen.insert(key.clone()) {
                        return Err(A::Error::custom(format!("{SCAN_MARK}{} `{}` appears twice in the header", T::KEYS, shown(&key))));
                    }
                    t.entry(&key, &mut m)?;
                }
                Ok(Scan(t))
            }
        }
        d.deserialize_any(V(std::marker::PhantomData))
    }
}

/// The `__metadata__` object: string values; its `format`.
#[derive(Default)]
struct MetaScan {
    format: Option<Scanned>,
}

impl ObjectScan for MetaScan {
    const WHAT: &'static str = "`__metadata__` as an object of strings";
    const KEYS: &'static str = "metadata key";
    fn entry<'de, A: serde::de::MapAccess<'de>>(&mut self, key: &str, m: &mut A) -> std::result::Result<(), A::Error> {
        use serde::de::Error as _;
        match m.next_value::<Scanned>()? {
            v if key == "format" => self.format = Some(v),
            Scanned::Str(_) => {}
            other => {
                return Err(A::Error::custom(format!(
                    "{SCAN_MARK}metadata `{}` is {}: safetensors metadata values are strings (e.g. \"2\")",
                    shown(key),
                    other.kind()
                )))
            }
        }
        Ok(())
    }
}

/// A tensor entry: its data_offsets, dtype and shape as far as they are
/// well-formed (anything else is left to the `safetensors` crate).
#[derive(Default)]
struct TensorScan {
    offsets: Option<(u64, u64)>,
    /// data_offsets given, but not a pair of integers.
    bad_offsets: bool,
    dtype: Option<String>,
    shape: Option<ShapeScan>,
}

/// Bytes per element of a safetensors dtype (None: sub-byte or unknown
/// dtypes, left to the crate).
fn dtype_bytes(dtype: &str) -> Option<u64> {
    Some(match dtype {
        "BOOL" | "U8" | "I8" | "F8_E5M2" | "F8_E4M3" | "F8_E8M0" => 1,
        "U16" | "I16" | "F16" | "BF16" => 2,
        "U32" | "I32" | "F32" => 4,
        "U64" | "I64" | "F64" => 8,
        _ => return None,
    })
}

/// A tensor's shape read by streaming: its dimensions (the first 8 kept,
/// for messages) and their product (None past u64). The default (no
/// product) stands for anything but an array of integers.
#[derive(Default)]
struct ShapeScan {
    dims: Vec<u64>,
    rank: usize,
    elements: Option<u64>,
}

impl<'de> serde::Deserialize<'de> for ShapeScan {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        use serde::de::{IgnoredAny, MapAccess, SeqAccess, Visitor};
        // Anything but an array of integers: no shape (left to the crate),
        // the value consumed whole so that the scan goes on.
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = ShapeScan;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a shape")
            }
            visit_scalars!(ShapeScan, |_| Ok(ShapeScan::default()));
            fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> std::result::Result<ShapeScan, A::Error> {
                while m.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(ShapeScan::default())
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut s: A) -> std::result::Result<ShapeScan, A::Error> {
                let (mut shape, mut valid) = (ShapeScan { dims: Vec::new(), rank: 0, elements: Some(1) }, true);
                while let Some(d) = s.next_element::<Scanned>()? {
                    let Scanned::Uint(d) = d else {
                        valid = false;
                        continue;
                    };
                    shape.rank += 1;
                    if shape.dims.len() < 8 {
                        shape.dims.push(d);
                    }
                    shape.elements = shape.elements.and_then(|e| e.checked_mul(d));
                }
                Ok(if valid { shape } else { ShapeScan::default() })
            }
        }
        d.deserialize_any(V)
    }
}

impl ObjectScan for TensorScan {
    const WHAT: &'static str = "a tensor entry";
    const KEYS: &'static str = "tensor field";
    fn entry<'de, A: serde::de::MapAccess<'de>>(&mut self, key: &str, m: &mut A) -> std::result::Result<(), A::Error> {
        match key {
            "data_offsets" => match m.next_value::<Scanned>()? {
                Scanned::Pair(a, e) => self.offsets = Some((a, e)),
                _ => self.bad_offsets = true,
            },
            "dtype" => {
                if let Scanned::Str(t) = m.next_value::<Scanned>()? {
                    self.dtype = Some(t);
                }
            }
            // A malformed shape is left to the crate.
            "shape" => self.shape = Some(m.next_value::<ShapeScan>()?).filter(|s| s.rank > 0 || s.elements == Some(1)),
            _ => {
                m.next_value::<serde::de::IgnoredAny>()?;
            }
        }
        Ok(())
    }
    fn not_object(_kind: &'static str) -> Option<Self> {
        Some(TensorScan::default())
    }
}

impl TensorScan {
    /// Its data_offsets when they are a pair of integers (None: left to the
    /// crate), or why its shape and dtype do not fill them exactly (the
    /// crate checks that too, but its message names no tensor).
    fn offsets(&self) -> std::result::Result<Option<(u64, u64)>, String> {
        let offsets = self.offsets.filter(|_| !self.bad_offsets);
        if let (Some(size), Some(shape), Some(t)) = (self.dtype.as_deref().and_then(dtype_bytes), &self.shape, &self.dtype) {
            let bytes = shape.elements.and_then(|e| e.checked_mul(size));
            let dims = format!("{:?}{}", shape.dims, if shape.rank > shape.dims.len() { " (first 8)" } else { "" });
            match (bytes, offsets) {
                (None, _) => return Err(format!("shape {dims} of dtype {t} is more bytes than any file")),
                (Some(b), Some((a, e))) if e >= a && e - a != b => {
                    return Err(format!("shape {dims} of dtype {t} is {b} bytes, but its data_offsets [{a}, {e}] hold {}", e - a))
                }
                _ => {}
            }
        }
        Ok(offsets)
    }
}

impl ObjectScan for HeaderScan {
    const WHAT: &'static str = "a JSON object";
    const KEYS: &'static str = "key";
    fn entry<'de, A: serde::de::MapAccess<'de>>(&mut self, key: &str, m: &mut A) -> std::result::Result<(), A::Error> {
        use serde::de::Error as _;
        if key == "__metadata__" {
            self.format = m.next_value::<Scan<MetaScan>>()?.0.format;
            return Ok(());
        }
        match m.next_value::<Scan<TensorScan>>()?.0.offsets() {
            Err(why) => return Err(A::Error::custom(format!("{SCAN_MARK}tensor `{}`: {why}", shown(key)))),
            Ok(Some((_, end))) => self.data_end = self.data_end.max(end),
            Ok(None) => self.incomplete = true,
        }
        Ok(())
    }
}

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

/// `max` or `mean`, exactly (as numbers, no spaces).
fn ensemble_field(v: &str) -> Result<Ensemble> {
    match v {
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
            "tensor `{}` is not expected: with n_scorers = {} the scorer tensors are scorers.{{0..{}}}.wq and .ww",
            shown(n),
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
        // The scan names the tensor whose shape does not fill its offsets
        // (before the data's end is summed).
        assert!(e.message.contains("tensor `scorers.0.wq`") && e.message.contains("18446744073709551615"), "{e}");
    }

    /// A valid checkpoint's header text and data, and the file they make
    /// once `edit` has changed the header.
    fn edited(edit: impl Fn(&str) -> String) -> Vec<u8> {
        let bytes = write::to_bytes(&meta(), &write::random(&meta(), WeightDtype::F32, 3).unwrap()).unwrap();
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let header = edit(std::str::from_utf8(&bytes[8..8 + n]).unwrap());
        let mut out = (header.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(header.as_bytes());
        out.extend_from_slice(&bytes[8 + n..]);
        out
    }

    fn refused(file: Vec<u8>) -> String {
        let e = Checkpoint::from_bytes(file).unwrap_err();
        assert_eq!(e.status, KvswapStatus::BadCheckpoint, "{e}");
        e.message
    }

    #[test]
    fn header_keys_are_unique_and_metadata_values_strings() {
        assert!(Checkpoint::from_bytes(edited(|h| h.to_string())).is_ok(), "the unedited file loads");
        // A repeated key: the JSON parser would keep the last one.
        let e = refused(edited(|h| h.replacen("\"format\":\"flashmemory-v1\"", "\"format\":\"other\",\"format\":\"flashmemory-v1\"", 1)));
        assert!(e.contains("metadata key `format` appears twice"), "{e}");
        let e = refused(edited(|h| h.replacen("{\"__metadata__\"", "{\"scorers.0.wq\":{},\"__metadata__\"", 1)));
        assert!(e.contains("key `scorers.0.wq` appears twice"), "{e}");
        // Metadata values are strings; the message names the field.
        let e = refused(edited(|h| h.replacen("\"n_scorers\":\"2\"", "\"n_scorers\":2", 1)));
        assert!(e.contains("metadata `n_scorers` is a number") && e.contains("strings"), "{e}");
        let e = refused(edited(|h| h.replacen("\"format\":\"flashmemory-v1\"", "\"format\":1", 1)));
        assert!(e.contains("metadata `format` is a number, not a string"), "{e}");
        // Not an object where the metadata is: JSON, but not a safetensors header.
        let e = refused(edited(|h| h.replacen("\"__metadata__\":{", "\"__metadata__\":\"x\",\"m\":{", 1)));
        assert!(e.contains("not a safetensors header"), "{e}");
    }

    #[test]
    fn headers_over_a_mebibyte_are_refused_before_parsing() {
        let mut file = ((1u64 << 20) + 1).to_le_bytes().to_vec();
        file.resize(8 + (1 << 20) + 64, b' ');
        let e = refused(file);
        assert!(e.contains("over kvswap's 1048576-byte limit"), "{e}");
        // Within the limit, a header of many small objects (~100x its size
        // as a serde_json tree) is read by streaming and refused by kind.
        let junk = format!("\"__metadata__\":{{\"junk\":[{}],", vec!["{\"\":0}"; 100_000].join(","));
        let e = refused(edited(|h| h.replacen("\"__metadata__\":{", &junk, 1)));
        assert!(e.contains("metadata `junk` is an array"), "{e}");
    }

    #[test]
    fn names_in_messages_are_escaped_and_cut() {
        let e = refused(edited(|h| h.replacen("\"scorers.1.ww\"", "\"scorers.\\u001b[2J\"", 1)));
        assert!(e.contains("scorers.\\u{1b}[2J") && !e.contains('\u{1b}'), "{e}");
        let long = "x".repeat(1000);
        assert_eq!(shown(&long).len(), 83, "80 characters and an ellipsis");
        assert_eq!(shown("a\tb\u{7}"), "a\\tb\\u{7}");
    }

    #[test]
    fn shape_and_dtype_that_do_not_fill_the_offsets_name_the_tensor() {
        let e = refused(edited(|h| h.replacen("\"shape\":[6,5]", "\"shape\":[12,5]", 1)));
        assert!(e.contains("tensor `scorers.0.wq`: shape [12, 5] of dtype F32 is 240 bytes, but its data_offsets"), "{e}");
        let e = refused(edited(|h| h.replacen("\"shape\":[6,5]", "\"shape\":[4294967296,4294967296]", 1)));
        assert!(e.contains("tensor `scorers.0.wq`") && e.contains("more bytes than any file"), "{e}");
        // A shape that is not integers: still refused (by the crate), and the
        // scan reads past it (not "not JSON").
        let e = refused(edited(|h| h.replacen("\"shape\":[6,5]", "\"shape\":[6,\"x\"]", 1)));
        assert!(!e.contains("not JSON"), "{e}");
    }
}
