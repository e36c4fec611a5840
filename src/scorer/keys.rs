//! Indexer keys: one row of `head_dim` elements per chunk, in f32, bf16, or
//! fp8 e4m3 with one f32 scale per row (value = fp8 * scale). Rows may be
//! strided. This is the host view the CPU reference reads.

use super::args;
use super::dtype::KeyDtype;
use crate::error::{Error, Result};

/// The `dtype` of `FmKeys`: one of the `FM_KEYS_*` constants.
pub type FmKeyDtype = u32;
/// Keys are f32.
pub const FM_KEYS_F32: FmKeyDtype = 0;
/// Keys are bf16 (the upper half of an f32).
pub const FM_KEYS_BF16: FmKeyDtype = 1;
/// Keys are OCP fp8 e4m3 (bias 7, no infinities, S.1111.111 = NaN); each
/// row is multiplied by its f32 scale from `FmKeys.scales`.
pub const FM_KEYS_FP8_E4M3: FmKeyDtype = 2;

impl KeyDtype {
    /// The dtype of an `FM_KEYS_*` constant.
    pub fn from_code(code: FmKeyDtype) -> Result<KeyDtype> {
        match code {
            FM_KEYS_F32 => Ok(KeyDtype::F32),
            FM_KEYS_BF16 => Ok(KeyDtype::Bf16),
            FM_KEYS_FP8_E4M3 => Ok(KeyDtype::Fp8E4m3),
            other => Err(Error::invalid(format!(
                "keys.dtype = {other}: expected FM_KEYS_F32 (0), FM_KEYS_BF16 (1) or FM_KEYS_FP8_E4M3 (2)"
            ))),
        }
    }

    /// The `FM_KEYS_*` constant of this dtype.
    pub fn code(self) -> FmKeyDtype {
        match self {
            KeyDtype::F32 => FM_KEYS_F32,
            KeyDtype::Bf16 => FM_KEYS_BF16,
            KeyDtype::Fp8E4m3 => FM_KEYS_FP8_E4M3,
        }
    }
}

/// A host view of `n_rows` key rows of `dim` elements.
#[derive(Clone, Copy, Debug)]
pub struct Keys<'a> {
    data: &'a [u8],
    dtype: KeyDtype,
    scales: Option<&'a [f32]>,
    stride: usize,
    dim: usize,
    n_rows: usize,
    label: &'static str,
}

impl<'a> Keys<'a> {
    /// A view over `data` (little-endian rows, `row_stride_bytes` apart; 0
    /// means dense). `scales` holds one value per row for fp8 and must be
    /// `None` otherwise. Checks that the buffers are large enough.
    pub fn new(
        data: &'a [u8],
        dtype: KeyDtype,
        scales: Option<&'a [f32]>,
        row_stride_bytes: usize,
        dim: usize,
        n_rows: usize,
    ) -> Result<Keys<'a>> {
        let stride = args::key_stride(dtype, row_stride_bytes, dim)?;
        let need = args::key_bytes(stride, dtype, dim, n_rows)?;
        if data.len() < need {
            return Err(Error::invalid(format!("keys: {} bytes for {n_rows} rows need {need}", data.len())));
        }
        match (dtype, scales) {
            (KeyDtype::Fp8E4m3, Some(s)) if s.len() >= n_rows => {}
            (KeyDtype::Fp8E4m3, _) => return Err(Error::invalid(format!("keys: fp8 keys need {n_rows} scales"))),
            (_, Some(_)) => return Err(Error::invalid(format!("keys: scales are for fp8 keys only, not {}", dtype.name()))),
            (_, None) => {}
        }
        Ok(Keys { data, dtype, scales, stride, dim, n_rows, label: "chunk" })
    }

    /// Dense f32 keys, `keys.len() / dim` rows.
    pub fn f32(keys: &'a [f32], dim: usize) -> Result<Keys<'a>> {
        Keys::new(as_bytes(keys), KeyDtype::F32, None, 0, dim, rows(keys.len(), dim)?)
    }

    /// Dense bf16 keys, `keys.len() / dim` rows.
    pub fn bf16(keys: &'a [half::bf16], dim: usize) -> Result<Keys<'a>> {
        Keys::new(as_bytes(keys), KeyDtype::Bf16, None, 0, dim, rows(keys.len(), dim)?)
    }

    /// Dense fp8 e4m3 keys with one scale per row, `keys.len() / dim` rows.
    pub fn fp8(keys: &'a [u8], scales: &'a [f32], dim: usize) -> Result<Keys<'a>> {
        Keys::new(keys, KeyDtype::Fp8E4m3, Some(scales), 0, dim, rows(keys.len(), dim)?)
    }

    /// Names rows `label` in error messages ("chunk" unless changed).
    pub fn labelled(mut self, label: &'static str) -> Keys<'a> {
        self.label = label;
        self
    }

    /// Rows in the view.
    pub fn n_rows(&self) -> usize {
        self.n_rows
    }

    /// Elements per row.
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// Element type.
    pub fn dtype(&self) -> KeyDtype {
        self.dtype
    }

    /// Row `r` decoded exactly into `out` (`dim` values; fp8 times its
    /// scale, exact in f64). A NaN or infinite value, or scale, is
    /// `KVSWAP_STATUS_INVALID_ARGUMENT` naming the row and element.
    pub fn row_into(&self, r: usize, out: &mut [f64]) -> Result<()> {
        let row = &self.data[r * self.stride..r * self.stride + self.dim * self.dtype.size()];
        let scale = self.scale(r)?;
        for (d, o) in out.iter_mut().enumerate().take(self.dim) {
            let v = self.dtype.get(row, d);
            if !v.is_finite() {
                return Err(Error::invalid(format!(
                    "keys: {} {r}, element {d} is {v} ({} key): keys must be finite",
                    self.label,
                    self.dtype.name()
                )));
            }
            *o = v as f64 * scale;
        }
        Ok(())
    }

    fn scale(&self, r: usize) -> Result<f64> {
        let Some(scales) = self.scales else { return Ok(1.0) };
        let s = scales[r];
        if !s.is_finite() {
            return Err(Error::invalid(format!("keys: scale of {} {r} is {s}: scales must be finite", self.label)));
        }
        Ok(s as f64)
    }
}

fn rows(len: usize, dim: usize) -> Result<usize> {
    if dim == 0 || !len.is_multiple_of(dim) {
        return Err(Error::invalid(format!("keys: {len} values are not a whole number of rows of {dim}")));
    }
    Ok(len / dim)
}

/// The bytes of a slice of plain numbers.
fn as_bytes<T: Copy>(v: &[T]) -> &[u8] {
    // SAFETY: T is f32 or bf16 here: plain data without padding, so every
    // byte is initialised; u8 has alignment 1 and the length is the same
    // memory region's.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
}
