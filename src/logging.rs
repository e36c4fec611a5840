//! Log output. kvswap logs through the `log` crate; when the host program has
//! installed no logger, kvswap installs one that writes to stderr (level from
//! `KVSWAP_LOG`: off, error, warn, info (default), debug, trace) or hands each
//! line to a callback set with `kvswap_set_log_callback`.

use std::ffi::{c_char, c_void, CString};
use std::io::Write;
use std::sync::{Once, RwLock};

/// Called with a log level (1 = error .. 5 = trace), a NUL-terminated line and
/// the `user_data` given to `kvswap_set_log_callback`. It may be called from
/// any thread that calls into kvswap.
pub type KvswapLogCallback = Option<unsafe extern "C" fn(level: u32, line: *const c_char, user_data: *mut c_void)>;

struct Sink {
    callback: KvswapLogCallback,
    user_data: usize,
}

static SINK: RwLock<Sink> = RwLock::new(Sink { callback: None, user_data: 0 });
static INIT: Once = Once::new();

struct KvswapLogger;

impl log::Log for KvswapLogger {
    fn enabled(&self, m: &log::Metadata) -> bool {
        m.level() <= log::max_level()
    }
    fn log(&self, r: &log::Record) {
        if !self.enabled(r.metadata()) {
            return;
        }
        let line = format!("{}", r.args());
        // Copy the sink out so the callback runs without the lock held (it
        // may itself call kvswap_set_log_callback).
        let (callback, user_data) = {
            let sink = SINK.read().unwrap_or_else(|p| p.into_inner());
            (sink.callback, sink.user_data)
        };
        match callback {
            Some(cb) => {
                let c = CString::new(line.replace('\0', " ")).unwrap_or_default();
                // SAFETY: the engine registered `cb` for exactly this call shape.
                unsafe { cb(r.level() as u32, c.as_ptr(), user_data as *mut c_void) }
            }
            None => {
                let _ = writeln!(std::io::stderr().lock(), "{line}");
            }
        }
    }
    fn flush(&self) {}
}

fn level_from_env() -> log::LevelFilter {
    match std::env::var("KVSWAP_LOG").ok().as_deref().map(str::trim) {
        Some("off") | Some("0") => log::LevelFilter::Off,
        Some("error") => log::LevelFilter::Error,
        Some("warn") => log::LevelFilter::Warn,
        Some("debug") => log::LevelFilter::Debug,
        Some("trace") => log::LevelFilter::Trace,
        _ => log::LevelFilter::Info,
    }
}

/// Installs kvswap's logger unless the program has one. Idempotent.
pub fn init() {
    INIT.call_once(|| {
        if log::set_logger(&KvswapLogger).is_ok() {
            log::set_max_level(level_from_env());
        }
    });
}

/// Routes log lines to `callback` (None: back to stderr).
pub fn set_callback(callback: KvswapLogCallback, user_data: *mut c_void) {
    init();
    let mut s = SINK.write().unwrap_or_else(|p| p.into_inner());
    s.callback = callback;
    s.user_data = user_data as usize;
}

/// 0 = off, 1 = error, 2 = warn, 3 = info, 4 = debug, 5 = trace.
pub fn set_level(level: u32) -> bool {
    init();
    let f = match level {
        0 => log::LevelFilter::Off,
        1 => log::LevelFilter::Error,
        2 => log::LevelFilter::Warn,
        3 => log::LevelFilter::Info,
        4 => log::LevelFilter::Debug,
        5 => log::LevelFilter::Trace,
        _ => return false,
    };
    log::set_max_level(f);
    true
}
