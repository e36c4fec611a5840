//! Lines logged while kvswap holds a lock wait until it is released
//! (`logging::defer`), so that the engine's log callback, which may call
//! kvswap, never runs under one of kvswap's locks. Its own test binary: the
//! logger and its callback are process-wide.

use kvswap::ffi::{kvswap_set_log_callback, kvswap_set_log_level};
use kvswap::KvswapStatus;
use std::ffi::{c_char, c_void, CStr};
use std::sync::Mutex;

static LINES: Mutex<Vec<String>> = Mutex::new(Vec::new());

unsafe extern "C" fn record(_level: u32, line: *const c_char, _user_data: *mut c_void) {
    // SAFETY: kvswap passes a NUL-terminated line valid for the call.
    let line = unsafe { CStr::from_ptr(line) }.to_string_lossy().into_owned();
    if line.starts_with("log-defer-test:") {
        LINES.lock().unwrap().push(line);
    }
}

fn seen() -> Vec<String> {
    LINES.lock().unwrap().clone()
}

#[test]
fn lines_logged_under_a_guard_are_written_when_the_outermost_guard_drops() {
    assert_eq!(kvswap_set_log_callback(Some(record), std::ptr::null_mut()), KvswapStatus::Ok);
    assert_eq!(kvswap_set_log_level(3), KvswapStatus::Ok);
    log::info!("log-defer-test: direct");
    assert_eq!(seen(), ["log-defer-test: direct"]);
    {
        let _outer = kvswap::logging::defer();
        log::warn!("log-defer-test: held 1");
        {
            let _inner = kvswap::logging::defer();
            log::info!("log-defer-test: held 2");
        }
        assert_eq!(seen(), ["log-defer-test: direct"], "an inner guard writes nothing");
        // Another thread's lines are not held back by this thread's guard.
        std::thread::spawn(|| log::info!("log-defer-test: other thread")).join().unwrap();
        assert_eq!(seen(), ["log-defer-test: direct", "log-defer-test: other thread"]);
    }
    assert_eq!(seen(), ["log-defer-test: direct", "log-defer-test: other thread", "log-defer-test: held 1", "log-defer-test: held 2"]);
    // A line below the level is dropped, not held.
    {
        let _g = kvswap::logging::defer();
        log::debug!("log-defer-test: below the level");
    }
    assert_eq!(seen().len(), 4);
    assert_eq!(kvswap_set_log_callback(None, std::ptr::null_mut()), KvswapStatus::Ok);
}
