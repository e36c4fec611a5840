//! Plain host allocations for the CPU backend: zeroed, 64-byte aligned, freed
//! on drop. (The CUDA backend's pinned host tier lives in `backend::cuda`.)

use crate::error::{Error, KvswapStatus, Result};
use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ptr::NonNull;

/// An owned, zero-initialised byte buffer with a stable address.
pub struct HostBuf {
    ptr: NonNull<u8>,
    layout: Layout,
}

// SAFETY: HostBuf owns its bytes exclusively, like a Box<[u8]>; sharing it
// between threads is as safe as sharing a Box<[u8]>. Users that hand out raw
// pointers into it (the per-layer regions of one pool) keep the regions disjoint.
unsafe impl Send for HostBuf {}
unsafe impl Sync for HostBuf {}

impl HostBuf {
    /// `len` zero bytes (at least one byte is allocated so the pointer is valid).
    pub fn zeroed(len: usize) -> Result<HostBuf> {
        let layout = Layout::from_size_align(len.max(1), 64)
            .map_err(|_| Error::new(KvswapStatus::OutOfMemory, format!("{len} bytes is too large")))?;
        // SAFETY: layout has non-zero size.
        let p = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(p).ok_or_else(|| {
            Error::new(
                KvswapStatus::OutOfMemory,
                format!("could not allocate {} MiB of host memory", len.div_ceil(1 << 20)),
            )
        })?;
        Ok(HostBuf { ptr, layout })
    }

    pub fn len(&self) -> usize {
        self.layout.size()
    }

    pub fn is_empty(&self) -> bool {
        false
    }

    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl Drop for HostBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed` with exactly this layout.
        unsafe { dealloc(self.ptr.as_ptr(), self.layout) }
    }
}
