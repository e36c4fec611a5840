//! Element types of scorer weights and indexer keys, and their exact
//! decoding. Every format here widens exactly to f32 (and so to f64): the
//! reference never rounds an input.

use half::{bf16, f16};

/// Element type of a checkpoint weight tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WeightDtype {
    F32,
    F16,
    Bf16,
}

impl WeightDtype {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            WeightDtype::F32 => 4,
            WeightDtype::F16 | WeightDtype::Bf16 => 2,
        }
    }

    /// The safetensors spelling (`F32`, `F16`, `BF16`).
    pub fn name(self) -> &'static str {
        match self {
            WeightDtype::F32 => "F32",
            WeightDtype::F16 => "F16",
            WeightDtype::Bf16 => "BF16",
        }
    }

    /// Parses the CLI spelling (`f32`, `f16`, `bf16`, any case).
    pub fn parse(s: &str) -> Option<WeightDtype> {
        match s.to_ascii_lowercase().as_str() {
            "f32" => Some(WeightDtype::F32),
            "f16" => Some(WeightDtype::F16),
            "bf16" => Some(WeightDtype::Bf16),
            _ => None,
        }
    }

    /// The safetensors dtype, or `None` for one a checkpoint may not use.
    pub fn from_safetensors(d: safetensors::Dtype) -> Option<WeightDtype> {
        match d {
            safetensors::Dtype::F32 => Some(WeightDtype::F32),
            safetensors::Dtype::F16 => Some(WeightDtype::F16),
            safetensors::Dtype::BF16 => Some(WeightDtype::Bf16),
            _ => None,
        }
    }

    /// The safetensors dtype.
    pub fn to_safetensors(self) -> safetensors::Dtype {
        match self {
            WeightDtype::F32 => safetensors::Dtype::F32,
            WeightDtype::F16 => safetensors::Dtype::F16,
            WeightDtype::Bf16 => safetensors::Dtype::BF16,
        }
    }

    /// Element `i` of little-endian `bytes`, widened exactly.
    /// `bytes` must hold at least `(i + 1) * size()` bytes.
    pub fn get(self, bytes: &[u8], i: usize) -> f32 {
        let at = i * self.size();
        match self {
            WeightDtype::F32 => f32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]]),
            WeightDtype::F16 => f16::from_le_bytes([bytes[at], bytes[at + 1]]).to_f32(),
            WeightDtype::Bf16 => bf16::from_le_bytes([bytes[at], bytes[at + 1]]).to_f32(),
        }
    }

    /// `v` rounded to nearest-even in this type, as little-endian bytes.
    pub fn encode(self, v: f64, out: &mut Vec<u8>) {
        match self {
            WeightDtype::F32 => out.extend_from_slice(&(v as f32).to_le_bytes()),
            WeightDtype::F16 => out.extend_from_slice(&f16::from_f64(v).to_le_bytes()),
            WeightDtype::Bf16 => out.extend_from_slice(&bf16::from_f64(v).to_le_bytes()),
        }
    }
}

/// Element type of indexer keys (the `dtype` field of `FmKeys`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KeyDtype {
    F32,
    Bf16,
    /// OCP fp8 e4m3 ("E4M3FN"), each row multiplied by its f32 scale.
    Fp8E4m3,
}

impl KeyDtype {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            KeyDtype::F32 => 4,
            KeyDtype::Bf16 => 2,
            KeyDtype::Fp8E4m3 => 1,
        }
    }

    /// A short name for messages.
    pub fn name(self) -> &'static str {
        match self {
            KeyDtype::F32 => "f32",
            KeyDtype::Bf16 => "bf16",
            KeyDtype::Fp8E4m3 => "fp8_e4m3",
        }
    }

    /// Element `i` of little-endian `bytes`, widened exactly (fp8 unscaled).
    /// `bytes` must hold at least `(i + 1) * size()` bytes.
    pub fn get(self, bytes: &[u8], i: usize) -> f32 {
        let at = i * self.size();
        match self {
            KeyDtype::F32 => f32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]]),
            KeyDtype::Bf16 => bf16::from_le_bytes([bytes[at], bytes[at + 1]]).to_f32(),
            KeyDtype::Fp8E4m3 => fp8_e4m3_to_f32(bytes[at]),
        }
    }
}

/// Decodes one OCP fp8 e4m3 value exactly: 1 sign bit, 4 exponent bits with
/// bias 7, 3 mantissa bits; exponent 0 is subnormal (`m/8 * 2^-6`); there
/// are no infinities, and `S.1111.111` is NaN. The largest value is 448.
pub fn fp8_e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0f32 } else { 1.0 };
    let exp = ((b >> 3) & 0x0f) as i32;
    let man = (b & 0x07) as f32;
    if exp == 0x0f && b & 0x07 == 0x07 {
        return f32::NAN;
    }
    let magnitude = if exp == 0 {
        man / 8.0 * 2f32.powi(-6)
    } else {
        (1.0 + man / 8.0) * 2f32.powi(exp - 7)
    };
    sign * magnitude
}

/// Encodes `v` as fp8 e4m3 when it is exactly representable (tests and
/// tools build keys with it); `None` otherwise.
pub fn fp8_e4m3_exact(v: f32) -> Option<u8> {
    (0u8..=255).find(|&b| {
        let d = fp8_e4m3_to_f32(b);
        d == v && d.is_sign_negative() == v.is_sign_negative()
    })
}

/// The largest f32 that is <= `v` (`v` finite and within f32 range).
pub fn f32_at_most(v: f64) -> f32 {
    let f = v as f32;
    if (f as f64) > v {
        next_f32_down(f)
    } else {
        f
    }
}

/// The smallest f32 that is >= `v` (`v` finite and within f32 range).
pub fn f32_at_least(v: f64) -> f32 {
    let f = v as f32;
    if (f as f64) < v {
        -next_f32_down(-f)
    } else {
        f
    }
}

/// The f32 just below finite `f`.
fn next_f32_down(f: f32) -> f32 {
    if f == 0.0 {
        return -f32::from_bits(1);
    }
    let bits = f.to_bits();
    if f > 0.0 {
        f32::from_bits(bits - 1)
    } else {
        f32::from_bits(bits + 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fp8_e4m3_table() {
        assert_eq!(fp8_e4m3_to_f32(0x00), 0.0);
        assert!(fp8_e4m3_to_f32(0x80).is_sign_negative());
        assert_eq!(fp8_e4m3_to_f32(0x38), 1.0);
        assert_eq!(fp8_e4m3_to_f32(0xb8), -1.0);
        assert_eq!(fp8_e4m3_to_f32(0x7e), 448.0);
        assert_eq!(fp8_e4m3_to_f32(0xfe), -448.0);
        assert_eq!(fp8_e4m3_to_f32(0x01), 2f32.powi(-9)); // smallest subnormal
        assert_eq!(fp8_e4m3_to_f32(0x07), 7.0 / 8.0 * 2f32.powi(-6)); // largest subnormal
        assert_eq!(fp8_e4m3_to_f32(0x08), 2f32.powi(-6)); // smallest normal
        assert_eq!(fp8_e4m3_to_f32(0x78), 256.0); // S.1111.000 is a number, not inf
        assert_eq!(fp8_e4m3_to_f32(0x3c), 1.5);
        assert!(fp8_e4m3_to_f32(0x7f).is_nan());
        assert!(fp8_e4m3_to_f32(0xff).is_nan());
        let nans = (0u8..=255).filter(|&b| fp8_e4m3_to_f32(b).is_nan()).count();
        assert_eq!(nans, 2);
        assert!((0u8..=255).all(|b| !fp8_e4m3_to_f32(b).is_infinite()));
    }

    #[test]
    fn fp8_values_are_monotone() {
        let pos: Vec<f32> = (0u8..0x7f).map(fp8_e4m3_to_f32).collect();
        assert!(pos.windows(2).all(|w| w[0] < w[1]));
        assert_eq!(fp8_e4m3_exact(1.5), Some(0x3c));
        assert_eq!(fp8_e4m3_exact(1.3), None);
    }

    #[test]
    fn weight_decoding_is_exact() {
        let mut b = Vec::new();
        WeightDtype::Bf16.encode(1.0 + 1.0 / 128.0, &mut b);
        assert_eq!(WeightDtype::Bf16.get(&b, 0), 1.0 + 1.0 / 128.0);
        b.clear();
        WeightDtype::F16.encode(-2.0f64.powi(-24), &mut b); // smallest f16 subnormal
        assert_eq!(WeightDtype::F16.get(&b, 0), -(2f32.powi(-24)));
        b.clear();
        WeightDtype::F32.encode(0.1, &mut b);
        assert_eq!(WeightDtype::F32.get(&b, 0), 0.1f32);
        assert_eq!(KeyDtype::Bf16.get(&bf16::from_f32(-3.5).to_le_bytes(), 0), -3.5);
    }

    #[test]
    fn directed_rounding() {
        let v = 0.1f64; // not an f32
        assert!((f32_at_most(v) as f64) < v && (f32_at_least(v) as f64) > v);
        assert_eq!(f32_at_least(v), next_up(f32_at_most(v)));
        assert_eq!(f32_at_most(-v), -f32_at_least(v));
        assert_eq!(f32_at_most(1.5), 1.5);
        assert_eq!(f32_at_least(1.5), 1.5);
        assert_eq!(f32_at_most(1e-50), 0.0);
        assert_eq!(f32_at_least(1e-50), f32::from_bits(1));
        assert_eq!(f32_at_most(-1e-50), -f32::from_bits(1));
    }

    fn next_up(f: f32) -> f32 {
        f32::from_bits(f.to_bits() + 1)
    }
}
