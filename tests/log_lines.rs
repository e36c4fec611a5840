//! Log lines through the callback: lines logged while kvswap holds a lock
//! wait until it is released (`logging::defer`), so that the engine's log
//! callback, which may call kvswap, never runs under one of kvswap's locks;
//! `KVSWAP_MEM_PROFILE`'s lines at each stage. Its own test binary: the
//! logger and its callback are process-wide (the tests take turns).

use kvswap::ffi::{kvswap_set_log_callback, kvswap_set_log_level};
use kvswap::KvswapStatus;
use std::ffi::{c_char, c_void, CStr};
use std::sync::Mutex;

static LINES: Mutex<Vec<String>> = Mutex::new(Vec::new());
/// Held by each test for its length: one callback and one set of lines at a time.
static TURN: Mutex<()> = Mutex::new(());

unsafe extern "C" fn record(_level: u32, line: *const c_char, _user_data: *mut c_void) {
    // SAFETY: kvswap passes a NUL-terminated line valid for the call.
    let line = unsafe { CStr::from_ptr(line) }.to_string_lossy().into_owned();
    if line.starts_with("log-defer-test:") || line.starts_with("kvswap_mem ") || line.contains("(KVSWAP_INDEX_TOPK) is above") {
        LINES.lock().unwrap().push(line);
    }
}

fn seen() -> Vec<String> {
    LINES.lock().unwrap().clone()
}

/// This test's turn: no lines yet, `record` the callback, level info.
fn start() -> std::sync::MutexGuard<'static, ()> {
    let turn = TURN.lock().unwrap_or_else(|p| p.into_inner());
    LINES.lock().unwrap().clear();
    assert_eq!(kvswap_set_log_callback(Some(record), std::ptr::null_mut()), KvswapStatus::Ok);
    assert_eq!(kvswap_set_log_level(3), KvswapStatus::Ok);
    turn
}

#[test]
fn lines_logged_under_a_guard_are_written_when_the_outermost_guard_drops() {
    let _turn = start();
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

#[test]
fn memory_profile_lines_at_each_stage() {
    use kvswap::scorer::{write, Checkpoint, Meta, Scorer, WeightDtype};
    use kvswap::{BackendChoice, Config, Context, Ensemble, KvswapLayerSpec};
    let _turn = start();
    // A context: its host tier and staging at create and at destroy.
    let config = Config { backend: BackendChoice::Cpu, enable: true, gpu_chunks: 8, index_topk: 8, mem_profile: true, ..Config::default() };
    let spec = KvswapLayerSpec { compressed_cap: 64, chunk_bytes: 1 << 14, staging: std::ptr::null_mut(), staging_stride: 0 };
    drop(Context::new(config, &[spec; 2]).unwrap());
    // A scorer: its weights at load and at free (KVSWAP_MEM_PROFILE, read at load).
    let meta = Meta { n_scorers: 2, hidden: 64, n_heads: 4, head_dim: 16, ensemble: Ensemble::Max };
    let ckpt = std::sync::Arc::new(Checkpoint::from_bytes(write::to_bytes(&meta, &write::random(&meta, WeightDtype::Bf16, 3).unwrap()).unwrap()).unwrap());
    std::env::set_var("KVSWAP_MEM_PROFILE", "1");
    let scorer = Scorer::new(ckpt.clone(), -1);
    std::env::remove_var("KVSWAP_MEM_PROFILE");
    drop(scorer.unwrap());
    drop(Scorer::new(ckpt, -1).unwrap()); // not profiled
    assert_eq!(kvswap_set_log_callback(None, std::ptr::null_mut()), KvswapStatus::Ok);
    let lines = seen();
    let stages: Vec<&str> = lines.iter().map(|l| l.split_whitespace().nth(1).unwrap()).collect();
    assert_eq!(stages, ["stage=create", "stage=destroy", "stage=scorer_load", "stage=scorer_free"], "{lines:#?}");
    // 2 layers x 64 chunks x 16 KiB of host tier, 2 x 8 slots x 16 KiB of staging.
    assert!(lines[0].contains("host_tier_mib=2.00") && lines[0].contains("staging_mib=0.25") && lines[0].contains("layers=2"), "{}", lines[0]);
    assert!(lines[1].contains("host_tier_mib=2.00"), "{}", lines[1]);
    // bf16: 2 scorers x 4 heads x (16 + 1) rows x 64 x 2 bytes.
    let mib = (2 * 4 * 17 * 64 * 2) as f64 / (1 << 20) as f64;
    assert!(lines[2].contains(&format!("weights_mib={mib:.2}")) && lines[2].contains("device=-1"), "{}", lines[2]);
}

/// A top-k above what the scorers select is said once per context, not
/// once per reading of the config (kvswap_config_from_env and
/// kvswap_create each validate it).
#[test]
fn an_index_topk_above_the_scorers_limit_is_logged_once() {
    use kvswap::ffi::{kvswap_config_default, kvswap_create, kvswap_destroy};
    use kvswap::{KvswapConfig, KvswapLayerSpec};
    let _turn = start();
    let mut cfg = std::mem::MaybeUninit::<KvswapConfig>::uninit();
    assert_eq!(kvswap_config_default(cfg.as_mut_ptr()), KvswapStatus::Ok);
    // SAFETY: written by kvswap_config_default on success.
    let mut cfg = unsafe { cfg.assume_init() };
    cfg.backend = kvswap::config::KVSWAP_BACKEND_CPU;
    cfg.enable = 1;
    cfg.gpu_chunks = 4096;
    cfg.index_topk = 4096;
    let spec = KvswapLayerSpec { compressed_cap: 8192, chunk_bytes: 16, staging: std::ptr::null_mut(), staging_stride: 0 };
    let mut ctx = std::ptr::null_mut();
    assert_eq!(kvswap_create(&cfg, &spec, 1, &mut ctx), KvswapStatus::Ok);
    kvswap_destroy(ctx);
    let lines = seen();
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(lines[0].contains("index_topk=4096"), "{lines:?}");
}
