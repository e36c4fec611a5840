//! Safe wrapper over the C++ baseline in `original_lru.cpp`.

use std::ffi::c_void;

extern "C" {
    fn original_lru_new(slots: i32, cap: i32) -> *mut c_void;
    fn original_lru_free(p: *mut c_void);
    fn original_lru_mark_stored(p: *mut c_void, id: i32);
    fn original_lru_swap_in(p: *mut c_void, idx: *mut i32, window: i32, count: i32) -> i32;
}

/// The original engine's `std::list` + `std::unordered_map` slot LRU.
pub struct OriginalLru {
    p: *mut c_void,
    cap: i32,
}

impl OriginalLru {
    pub fn new(slots: i32, cap: i32) -> Self {
        assert!(slots > 0 && cap > 0);
        // SAFETY: plain constructor; freed in Drop.
        OriginalLru { p: unsafe { original_lru_new(slots, cap) }, cap }
    }
    pub fn mark_stored(&mut self, id: i32) {
        assert!((0..self.cap).contains(&id));
        // SAFETY: id checked in range.
        unsafe { original_lru_mark_stored(self.p, id) }
    }
    /// Rewrites `idx[window..]` to physical ids; returns the number of misses,
    /// or None when an id is invalid (nothing changed).
    pub fn swap_in(&mut self, idx: &mut [i32], window: usize) -> Option<u32> {
        let count = idx.len() - window;
        // SAFETY: idx holds window + count ints.
        let r = unsafe { original_lru_swap_in(self.p, idx.as_mut_ptr(), window as i32, count as i32) };
        (r >= 0).then_some(r as u32)
    }
}

impl Drop for OriginalLru {
    fn drop(&mut self) {
        // SAFETY: created by original_lru_new.
        unsafe { original_lru_free(self.p) }
    }
}
