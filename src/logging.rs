//! Log output. kvswap logs through the `log` crate; when the host program has
//! installed no logger, kvswap installs one that writes to stderr (level from
//! `KVSWAP_LOG`: off, error, warn, info (default), debug, trace) or hands each
//! line to a callback set with `kvswap_set_log_callback`.

use std::cell::RefCell;
use std::ffi::{c_char, c_void, CString};
use std::io::Write;
use std::sync::{Condvar, Mutex, MutexGuard, Once};

/// Called with a log level (1 = error .. 5 = trace), a NUL-terminated line and
/// the `user_data` given to `kvswap_set_log_callback`. It may be called from
/// any thread that calls into kvswap.
pub type KvswapLogCallback = Option<unsafe extern "C" fn(level: u32, line: *const c_char, user_data: *mut c_void)>;

#[derive(Clone, Copy)]
struct Sink {
    callback: KvswapLogCallback,
    user_data: usize,
}

/// The callback in use, its generation (bumped by every replacement), and
/// how many calls of each generation's callback are running. No lock is held
/// while a callback runs: lines from many threads go out at once, and a
/// callback may call into kvswap (and log) freely.
struct State {
    sink: Sink,
    generation: u64,
    running: Vec<(u64, usize)>,
}

static STATE: Mutex<State> = Mutex::new(State { sink: Sink { callback: None, user_data: 0 }, generation: 0, running: Vec::new() });
/// Signalled when a callback call of a replaced generation returns.
static RETURNED: Condvar = Condvar::new();
static INIT: Once = Once::new();

thread_local! {
    /// Per callback call this thread is inside (nested when a callback's own
    /// kvswap calls log): the generation it knows as current (its own, or
    /// the one its replacement from inside made).
    static INSIDE: RefCell<Vec<u64>> = const { RefCell::new(Vec::new()) };
}

fn state() -> MutexGuard<'static, State> {
    STATE.lock().unwrap_or_else(|p| p.into_inner())
}

/// Counts a running call of `generation`'s callback (+1 / -1).
fn count(st: &mut State, generation: u64, up: bool) {
    match st.running.iter().position(|&(g, _)| g == generation) {
        Some(i) if up => st.running[i].1 += 1,
        Some(i) => {
            st.running[i].1 -= 1;
            if st.running[i].1 == 0 {
                st.running.swap_remove(i);
            }
        }
        None => st.running.push((generation, 1)),
    }
}

struct KvswapLogger;

thread_local! {
    /// Lines this thread logged while a [`defer`] guard was alive (None: no
    /// guard), written when the outermost guard drops.
    static DEFERRED: RefCell<Option<Vec<(log::Level, String)>>> = const { RefCell::new(None) };
}

/// Holds back this thread's log lines until it drops (guards nest: the
/// outermost one writes them, in order). Made before a kvswap call takes a
/// lock, it keeps the engine's log callback, which may call kvswap, from
/// running while that lock is held.
pub struct Deferred {
    outermost: bool,
}

/// Starts holding back this thread's log lines; see [`Deferred`].
pub fn defer() -> Deferred {
    let outermost = DEFERRED
        .try_with(|d| {
            let mut d = d.borrow_mut();
            let first = d.is_none();
            if first {
                *d = Some(Vec::new());
            }
            first
        })
        .unwrap_or(false);
    Deferred { outermost }
}

impl Drop for Deferred {
    fn drop(&mut self) {
        if !self.outermost {
            return;
        }
        let lines = DEFERRED.try_with(|d| d.borrow_mut().take()).ok().flatten().unwrap_or_default();
        for (level, line) in lines {
            emit(level, line);
        }
    }
}

impl log::Log for KvswapLogger {
    fn enabled(&self, m: &log::Metadata) -> bool {
        m.level() <= log::max_level()
    }
    fn log(&self, r: &log::Record) {
        if !self.enabled(r.metadata()) {
            return;
        }
        let line = format!("{}", r.args());
        // Held back under a `defer` guard, else written now (also while the
        // thread's locals are torn down).
        let mut line = Some(line);
        let _ = DEFERRED.try_with(|d| {
            if let Some(v) = d.borrow_mut().as_mut() {
                v.extend(line.take().map(|l| (r.level(), l)));
            }
        });
        if let Some(line) = line {
            emit(r.level(), line);
        }
    }
    fn flush(&self) {}
}

/// Writes one line to the callback in force, or to stderr.
fn emit(level: log::Level, line: String) {
    let (sink, generation) = {
        let mut st = state();
        let (sink, generation) = (st.sink, st.generation);
        if sink.callback.is_some() {
            count(&mut st, generation, true);
        }
        (sink, generation)
    };
    let Some(cb) = sink.callback else {
        let _ = writeln!(std::io::stderr().lock(), "{line}");
        return;
    };
    /// Ends the call's count (also if it unwinds), waking a replacement
    /// that waits for its generation. Made right after the count went up.
    struct Running(u64, bool);
    impl Drop for Running {
        fn drop(&mut self) {
            if self.1 {
                let _ = INSIDE.try_with(|v| v.borrow_mut().pop());
            }
            let mut st = state();
            count(&mut st, self.0, false);
            if self.0 != st.generation {
                RETURNED.notify_all();
            }
        }
    }
    let mut running = Running(generation, false);
    // (Not available while the thread's locals are torn down: a line
    // logged from a destructor then goes out unmarked.)
    running.1 = INSIDE.try_with(|v| v.borrow_mut().push(generation)).is_ok();
    let c = CString::new(line.replace('\0', " ")).unwrap_or_default();
    // SAFETY: the engine registered `cb` for exactly this call shape.
    unsafe { cb(level as u32, c.as_ptr(), sink.user_data as *mut c_void) }
}

/// The level `KVSWAP_LOG` sets, if it sets one.
fn env_level() -> Option<log::LevelFilter> {
    std::env::var("KVSWAP_LOG").ok().as_deref().and_then(parse_level)
}

fn level_from_env() -> log::LevelFilter {
    env_level().unwrap_or(log::LevelFilter::Info)
}

/// A `KVSWAP_LOG` value: a level name in any case (`off`, `error`, `warn` or
/// `warning`, `info`, `debug`, `trace`) or its number as `kvswap_set_log_level`
/// takes it (0 off .. 5 trace); None for a blank or unknown value (the
/// default, info, applies).
pub fn parse_level(v: &str) -> Option<log::LevelFilter> {
    Some(match v.trim().to_ascii_lowercase().as_str() {
        "off" | "0" => log::LevelFilter::Off,
        "error" | "1" => log::LevelFilter::Error,
        "warn" | "warning" | "2" => log::LevelFilter::Warn,
        "info" | "3" => log::LevelFilter::Info,
        "debug" | "4" => log::LevelFilter::Debug,
        "trace" | "5" => log::LevelFilter::Trace,
        _ => return None,
    })
}

/// Whether `KVSWAP_LOG` sets a level (a blank or unknown value does not).
pub fn level_from_env_set() -> bool {
    env_level().is_some()
}

/// Installs kvswap's logger unless the program has one. Idempotent.
pub fn init() {
    INIT.call_once(|| {
        if log::set_logger(&KvswapLogger).is_ok() {
            log::set_max_level(level_from_env());
            // An unknown value leaves the default: said once, so a typo
            // does not go unnoticed.
            if let Ok(v) = std::env::var("KVSWAP_LOG") {
                if !v.trim().is_empty() && parse_level(&v).is_none() {
                    log::warn!(
                        "kvswap: KVSWAP_LOG={v:?} is not a level (off, error, warn, info, debug, trace, or 0-5): info applies"
                    );
                }
            }
        }
    });
}

/// Routes log lines to `callback` (None: back to stderr). Later lines go to
/// the new callback at once; the call then waits until no other thread is
/// inside an earlier callback, so their user data may be freed. From inside
/// a callback it does not wait (two callbacks replacing each other would
/// wait for each other), and does nothing once another thread has replaced
/// the callback since that callback was called.
pub fn set_callback(callback: KvswapLogCallback, user_data: *mut c_void) {
    init();
    let mut st = state();
    let next = Sink { callback, user_data: user_data as usize };
    // From inside a callback: no wait, and no effect once another thread has
    // replaced the callback since this call began (that replacement has
    // waited for this callback and its caller may have freed what it uses).
    let inside = INSIDE.try_with(|v| v.borrow().last().copied()).ok().flatten();
    if let Some(known) = inside {
        if known == st.generation {
            st.sink = next;
            st.generation += 1;
            let now = st.generation;
            let _ = INSIDE.try_with(|v| v.borrow_mut().last_mut().map(|g| *g = now));
        }
        return;
    }
    st.sink = next;
    st.generation += 1;
    let now = st.generation;
    while st.running.iter().any(|&(g, _)| g < now) {
        st = RETURNED.wait(st).unwrap_or_else(|p| p.into_inner());
    }
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

#[cfg(test)]
mod tests {
    use super::parse_level;
    use log::LevelFilter;

    #[test]
    fn log_levels_by_name_any_case_or_number() {
        assert_eq!(parse_level("ERROR"), Some(LevelFilter::Error));
        assert_eq!(parse_level(" Warning "), Some(LevelFilter::Warn));
        assert_eq!(parse_level("2"), Some(LevelFilter::Warn));
        assert_eq!(parse_level("0"), Some(LevelFilter::Off));
        assert_eq!(parse_level("5"), Some(LevelFilter::Trace));
        assert_eq!(parse_level("info"), Some(LevelFilter::Info));
        assert_eq!(parse_level(""), None);
        assert_eq!(parse_level("6"), None);
        assert_eq!(parse_level("loud"), None);
    }
}
