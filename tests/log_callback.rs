//! The log callback hand-over (`kvswap_set_log_callback`): once it returns,
//! no thread is inside the callback it replaced, so its user data may be
//! freed; a callback may log and replace the callback itself without a
//! deadlock. Its own test binary: the logger is process-wide.

use kvswap::ffi::{kvswap_set_log_callback, kvswap_set_log_level};
use kvswap::KvswapStatus;
use std::ffi::{c_char, c_void};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

/// What a callback's user data points to.
struct Probe {
    alive: AtomicBool,
    calls: AtomicUsize,
    /// Calls that found the probe already released by the engine.
    late: AtomicUsize,
}

impl Probe {
    fn new() -> Box<Probe> {
        Box::new(Probe { alive: AtomicBool::new(true), calls: AtomicUsize::new(0), late: AtomicUsize::new(0) })
    }
}

/// Checks the probe on entry and after a pause (the window in which a
/// replacement could release it).
unsafe extern "C" fn slow_probe(_level: u32, _line: *const c_char, user_data: *mut c_void) {
    // SAFETY: user_data is a Probe that the test keeps allocated to the end.
    let p = unsafe { &*(user_data as *const Probe) };
    if !p.alive.load(Ordering::SeqCst) {
        p.late.fetch_add(1, Ordering::SeqCst);
    }
    std::thread::sleep(Duration::from_micros(20));
    if !p.alive.load(Ordering::SeqCst) {
        p.late.fetch_add(1, Ordering::SeqCst);
    }
    p.calls.fetch_add(1, Ordering::SeqCst);
}

/// `slow_probe`, and every 7th call replaces the callback from inside with
/// itself and the same probe (a replacement that must not wait).
unsafe extern "C" fn replacing_probe(level: u32, line: *const c_char, user_data: *mut c_void) {
    // SAFETY: as slow_probe.
    unsafe { slow_probe(level, line, user_data) };
    // SAFETY: as slow_probe.
    let p = unsafe { &*(user_data as *const Probe) };
    if p.calls.load(Ordering::SeqCst) % 7 == 0 {
        assert_eq!(kvswap_set_log_callback(Some(replacing_probe), user_data), KvswapStatus::Ok);
    }
}

/// Logs, and replaces the callback from inside itself (with itself).
unsafe extern "C" fn reentrant(_level: u32, _line: *const c_char, user_data: *mut c_void) {
    // SAFETY: user_data is an AtomicUsize that outlives the test.
    let depth = unsafe { &*(user_data as *const AtomicUsize) };
    if depth.fetch_add(1, Ordering::SeqCst) < 3 {
        log::info!("line logged from inside the callback");
        assert_eq!(kvswap_set_log_callback(Some(reentrant), user_data), KvswapStatus::Ok);
    }
}

/// Takes the loggers' lines while they stop: a replacement by NULL would
/// send them to stderr (thousands of lines in the test output).
unsafe extern "C" fn quiet(_level: u32, _line: *const c_char, _user_data: *mut c_void) {}

/// Threads that log without pause until stopped.
struct Loggers {
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<u64>>,
}

impl Loggers {
    fn start(n: usize) -> Loggers {
        let stop = Arc::new(AtomicBool::new(false));
        let threads = (0..n)
            .map(|t| {
                let stop = stop.clone();
                std::thread::spawn(move || {
                    let mut n = 0u64;
                    while !stop.load(Ordering::SeqCst) {
                        log::info!("logger {t} line {n}");
                        n += 1;
                    }
                    n
                })
            })
            .collect();
        Loggers { stop, threads }
    }

    /// Stops them; the lines they logged.
    fn stop(self) -> u64 {
        self.stop.store(true, Ordering::SeqCst);
        self.threads.into_iter().map(|h| h.join().unwrap()).sum()
    }
}

/// Runs `f` on a thread and fails the test if it does not finish in 30 s.
fn within_30s(what: &str, f: impl FnOnce() + Send + 'static) {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        f();
        let _ = tx.send(());
    });
    rx.recv_timeout(Duration::from_secs(30)).unwrap_or_else(|_| panic!("{what}: no return in 30 s (deadlock)"));
}

// One test function: the two parts share the process-wide logger.
#[test]
fn replaced_callback_is_never_called_after_the_replacement_returns() {
    kvswap::logging::init();
    assert_eq!(kvswap_set_log_level(3), KvswapStatus::Ok);

    // Part 1: four threads log without pause while the callback is replaced
    // 300 times; each replaced probe is marked released right after the
    // replacement returns, and must never be seen by a call again.
    assert_eq!(kvswap_set_log_callback(Some(quiet), std::ptr::null_mut()), KvswapStatus::Ok);
    let loggers = Loggers::start(4);
    let probes: Arc<Mutex<Vec<Box<Probe>>>> = Arc::new(Mutex::new(Vec::new()));
    let p2 = probes.clone();
    within_30s("replacing under load", move || {
        let mut current = Probe::new();
        assert_eq!(kvswap_set_log_callback(Some(slow_probe), &*current as *const Probe as *mut c_void), KvswapStatus::Ok);
        for _ in 0..300 {
            std::thread::sleep(Duration::from_micros(50));
            let next = Probe::new();
            assert_eq!(kvswap_set_log_callback(Some(slow_probe), &*next as *const Probe as *mut c_void), KvswapStatus::Ok);
            current.alive.store(false, Ordering::SeqCst); // the engine frees it here
            p2.lock().unwrap().push(std::mem::replace(&mut current, next));
        }
        assert_eq!(kvswap_set_log_callback(Some(quiet), std::ptr::null_mut()), KvswapStatus::Ok);
        current.alive.store(false, Ordering::SeqCst);
        p2.lock().unwrap().push(current);
    });
    let lines = loggers.stop();
    let probes = probes.lock().unwrap();
    let calls: usize = probes.iter().map(|p| p.calls.load(Ordering::SeqCst)).sum();
    let late: usize = probes.iter().map(|p| p.late.load(Ordering::SeqCst)).sum();
    assert!(calls > 300, "the callbacks ran ({calls} calls for {lines} lines)");
    assert_eq!(late, 0, "{late} calls reached a callback after its replacement returned ({calls} calls)");

    // Part 3: as part 1, but the callbacks also replace the callback from
    // inside themselves (with their own probe), and two threads replace
    // from outside at once: no deadlock, and no probe released by an
    // outside replacement is seen again.
    let loggers = Loggers::start(4);
    let probes: Arc<Mutex<Vec<Box<Probe>>>> = Arc::new(Mutex::new(Vec::new()));
    let replacers: Vec<_> = (0..2)
        .map(|_| {
            let probes = probes.clone();
            std::thread::spawn(move || {
                for _ in 0..150 {
                    std::thread::sleep(Duration::from_micros(50));
                    let next = Probe::new();
                    assert_eq!(kvswap_set_log_callback(Some(replacing_probe), &*next as *const Probe as *mut c_void), KvswapStatus::Ok);
                    probes.lock().unwrap().push(next);
                }
            })
        })
        .collect();
    within_30s("replacing from inside and from two threads", move || {
        for r in replacers {
            r.join().unwrap();
        }
        assert_eq!(kvswap_set_log_callback(Some(quiet), std::ptr::null_mut()), KvswapStatus::Ok);
    });
    // Every probe was replaced by an outside call that has returned: none
    // may be called from now on.
    let probes3 = probes.lock().unwrap();
    for p in probes3.iter() {
        p.alive.store(false, Ordering::SeqCst);
    }
    std::thread::sleep(Duration::from_millis(20));
    loggers.stop();
    let calls3: usize = probes3.iter().map(|p| p.calls.load(Ordering::SeqCst)).sum();
    let late3: usize = probes3.iter().map(|p| p.late.load(Ordering::SeqCst)).sum();
    assert!(calls3 > 0, "the callbacks ran");
    assert_eq!(late3, 0, "{late3} calls reached a callback after the last replacement returned");

    // Part 2: a callback that logs and replaces the callback from inside
    // itself returns, and so does the next replacement from outside.
    static DEPTH: AtomicUsize = AtomicUsize::new(0);
    within_30s("replacing from inside the callback", || {
        assert_eq!(kvswap_set_log_callback(Some(reentrant), &DEPTH as *const AtomicUsize as *mut c_void), KvswapStatus::Ok);
        log::info!("first line");
        assert_eq!(kvswap_set_log_callback(None, std::ptr::null_mut()), KvswapStatus::Ok);
    });
    assert!(DEPTH.load(Ordering::SeqCst) >= 4, "the callback ran nested: {}", DEPTH.load(Ordering::SeqCst));
}
