//! Errors and the status codes they map to at the C boundary.

use std::fmt;

/// Status code returned by every `kvswap_*` / `fm_*` function of the C ABI.
///
/// `KVSWAP_STATUS_OK` (0) is success; every other value is a failure whose
/// text is available from `kvswap_last_error()` on the same thread.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KvswapStatus {
    /// Success.
    Ok = 0,
    /// An argument has a value the call cannot use (zero size, bad setting, ...).
    InvalidArgument = 1,
    /// A required pointer argument was NULL.
    NullPointer = 2,
    /// A layer index, logical chunk id or count is outside its range.
    OutOfRange = 3,
    /// A selected chunk was never stored; nothing was changed (returned by
    /// the call with `sync = 1`; with `sync = 0` it comes later, from
    /// `kvswap_sync` or `kvswap_layer_stats`, and the call went ahead with
    /// that entry written as -1).
    NotStored = 4,
    /// The pinned host tier would exceed `KVSWAP_PINNED_MIB`.
    PinnedCap = 5,
    /// `gpu_chunks < index_topk` without `KVSWAP_TEST_ALLOW_TOPK_REDUCTION=1`.
    TopkGuard = 6,
    /// The CUDA backend was asked for but no driver or device is usable.
    NoDevice = 7,
    /// A CUDA driver or NVRTC call failed.
    DeviceError = 8,
    /// Host or device memory could not be allocated.
    OutOfMemory = 9,
    /// `KVSWAP_VALIDATE=1` found a staged chunk that differs from its host copy.
    ValidationFailed = 10,
    /// A pointer or stream belongs to another device than the context's.
    WrongDevice = 11,
    /// A file could not be read or written.
    Io = 12,
    /// A scorer checkpoint is malformed (format tag, tensors, shapes, dtype, NaN/Inf).
    BadCheckpoint = 13,
    /// The operation is not supported by this backend or build.
    Unsupported = 14,
    /// A Rust panic was caught at the C boundary; the handle may be unusable.
    Panic = 99,
}

impl KvswapStatus {
    /// The constant's name as it appears in the C header.
    pub fn name(self) -> &'static str {
        match self {
            KvswapStatus::Ok => "KVSWAP_STATUS_OK",
            KvswapStatus::InvalidArgument => "KVSWAP_STATUS_INVALID_ARGUMENT",
            KvswapStatus::NullPointer => "KVSWAP_STATUS_NULL_POINTER",
            KvswapStatus::OutOfRange => "KVSWAP_STATUS_OUT_OF_RANGE",
            KvswapStatus::NotStored => "KVSWAP_STATUS_NOT_STORED",
            KvswapStatus::PinnedCap => "KVSWAP_STATUS_PINNED_CAP",
            KvswapStatus::TopkGuard => "KVSWAP_STATUS_TOPK_GUARD",
            KvswapStatus::NoDevice => "KVSWAP_STATUS_NO_DEVICE",
            KvswapStatus::DeviceError => "KVSWAP_STATUS_DEVICE_ERROR",
            KvswapStatus::OutOfMemory => "KVSWAP_STATUS_OUT_OF_MEMORY",
            KvswapStatus::ValidationFailed => "KVSWAP_STATUS_VALIDATION_FAILED",
            KvswapStatus::WrongDevice => "KVSWAP_STATUS_WRONG_DEVICE",
            KvswapStatus::Io => "KVSWAP_STATUS_IO",
            KvswapStatus::BadCheckpoint => "KVSWAP_STATUS_BAD_CHECKPOINT",
            KvswapStatus::Unsupported => "KVSWAP_STATUS_UNSUPPORTED",
            KvswapStatus::Panic => "KVSWAP_STATUS_PANIC",
        }
    }
}

/// A failure: the status an engine branches on and the text a person reads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Error {
    pub status: KvswapStatus,
    pub message: String,
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn new(status: KvswapStatus, message: impl Into<String>) -> Self {
        Error { status, message: message.into() }
    }
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(KvswapStatus::InvalidArgument, message)
    }
    pub fn null(arg: &str) -> Self {
        Self::new(KvswapStatus::NullPointer, format!("argument `{arg}` is NULL"))
    }
    pub fn out_of_range(message: impl Into<String>) -> Self {
        Self::new(KvswapStatus::OutOfRange, message)
    }
    pub fn device(message: impl Into<String>) -> Self {
        Self::new(KvswapStatus::DeviceError, message)
    }
}

/// An empty vector with room for `n` items, or `KVSWAP_STATUS_OUT_OF_MEMORY`
/// naming `what` instead of the process abort an infallible allocation
/// gives (sizes that come from the engine's arguments or files).
pub fn try_vec<T>(n: usize, what: &str) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n)
        .map_err(|_| Error::new(KvswapStatus::OutOfMemory, format!("cannot allocate {what} ({n} entries of {} bytes)", std::mem::size_of::<T>())))?;
    Ok(v)
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.status.name(), self.message)
    }
}

impl std::error::Error for Error {}

/// Shorthand for `Err(Error::new(status, format!(...)))`.
#[macro_export]
#[doc(hidden)]
macro_rules! bail {
    ($status:ident, $($arg:tt)*) => {
        return Err($crate::error::Error::new($crate::error::KvswapStatus::$status, format!($($arg)*)))
    };
}
