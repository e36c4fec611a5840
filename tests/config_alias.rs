//! A setting given under both its `KVSWAP_` name and its alias, with
//! different values: the `KVSWAP_` name is used and a warning says so (the
//! same value twice says nothing). Its own test binary: the log callback
//! is process-wide.

use kvswap::ffi::{kvswap_set_log_callback, kvswap_set_log_level};
use kvswap::{Config, KvswapStatus};
use std::ffi::{c_char, c_void, CStr};
use std::sync::Mutex;

/// Collects the warning lines (level 2) into the Mutex<Vec<String>> at `user_data`.
unsafe extern "C" fn collect(level: u32, line: *const c_char, user_data: *mut c_void) {
    // SAFETY: user_data is the test's Mutex, alive while the callback is set;
    // line is a NUL-terminated string for the duration of the call.
    let (lines, line) = unsafe { (&*(user_data as *const Mutex<Vec<String>>), CStr::from_ptr(line)) };
    if level == 2 {
        lines.lock().unwrap().push(line.to_string_lossy().into_owned());
    }
}

#[test]
fn a_name_and_its_alias_set_differently_warn_once() {
    let lines: &'static Mutex<Vec<String>> = Box::leak(Box::new(Mutex::new(Vec::new())));
    assert_eq!(kvswap_set_log_callback(Some(collect), lines as *const _ as *mut c_void), KvswapStatus::Ok);
    assert_eq!(kvswap_set_log_level(2), KvswapStatus::Ok);
    let env = |pairs: &'static [(&'static str, &'static str)]| move |k: &str| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string());
    let c = Config::from_lookup(env(&[("KVSWAP_GPU_CHUNKS", "64"), ("POCKETLLM_GGUF_KV_SWAP_GPU_CHUNKS", "abc")])).unwrap();
    assert_eq!(c.gpu_chunks, 64, "the KVSWAP_ name wins");
    let got = lines.lock().unwrap().clone();
    assert_eq!(got.len(), 1, "{got:?}");
    assert!(
        got[0].contains("KVSWAP_GPU_CHUNKS=\"64\"") && got[0].contains("POCKETLLM_GGUF_KV_SWAP_GPU_CHUNKS=\"abc\"") && got[0].contains("KVSWAP_GPU_CHUNKS is used"),
        "{got:?}"
    );
    // The same value under both names: no warning.
    Config::from_lookup(env(&[("KVSWAP_GPU_CHUNKS", "64"), ("POCKETLLM_GGUF_KV_SWAP_GPU_CHUNKS", " 64 ")])).unwrap();
    assert_eq!(lines.lock().unwrap().len(), 1);
    assert_eq!(kvswap_set_log_callback(None, std::ptr::null_mut()), KvswapStatus::Ok);
}
