//! Runs the built `kvswap` binary the way a newcomer does and checks what it
//! prints, its exit codes and the files it writes.

use std::os::unix::fs::FileTypeExt;
use std::path::PathBuf;
use std::process::{Command, Output};

/// Runs `kvswap ARGS` with library logs off and returns (exit code, stdout, stderr).
fn kvswap(args: &[&str]) -> (i32, String, String) {
    let out: Output =
        Command::new(env!("CARGO_BIN_EXE_kvswap")).args(args).env_remove("KVSWAP_LOG").output().expect("run kvswap");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A fresh scratch directory for this test process.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvswap-cli-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

/// The number after `label` in `text`, e.g. `number_after(s, "hit rate:")`.
fn number_after(text: &str, label: &str) -> f64 {
    let rest = &text[text.find(label).unwrap_or_else(|| panic!("{label:?} not in:\n{text}")) + label.len()..];
    let num: String = rest
        .trim_start()
        .chars()
        .take_while(|c| c.is_ascii_digit() || *c == '.' || *c == ',' || *c == '-')
        .filter(|c| *c != ',')
        .collect();
    num.parse().unwrap_or_else(|_| panic!("no number after {label:?} in:\n{text}"))
}

#[test]
fn plan_1m_reproduces_the_reference_figures() {
    let (code, out, err) = kvswap(&["plan", "--context", "1M"]);
    assert_eq!(code, 0, "{err}");
    for needle in [
        "context 1,048,576 tokens (1M)",
        "262,144", // ratio-4 compressed_cap
        "8,192",   // ratio-128 compressed_cap
        "536.87",  // 537 MB pinned per ratio-4 layer
        "16.78",   // 17 MB per ratio-128 layer
        "suggested KVSWAP_PINNED_MIB=16384",
        "GPU KV 10.7 GB without swap vs 26.2 MB with swap (512 slots per layer)",
        "indexer keys 5.6 GB",
        "scorer weights 0.5 GB",
        "net GPU saving 4.6 GB",
        "counting the ratio-4 layers only as the reference table does (20 layers)",
    ] {
        assert!(out.contains(needle), "missing {needle:?} in:\n{out}");
    }
    // ~11 GB pinned (DESIGN), in decimal GB.
    let gb = number_after(&out, "MB =");
    assert!((11.0..11.2).contains(&gb), "pinned {gb} GB");
}

#[test]
fn plan_small_contexts_suggest_the_design_cap() {
    let (code, out, _) = kvswap(&["plan", "--context", "8K"]);
    assert_eq!(code, 0);
    assert!(out.contains("suggested KVSWAP_PINNED_MIB=256"), "{out}");
    assert!(out.contains("2,048") && out.contains("4.19") && out.contains("0.13"), "{out}");
    let mb = number_after(&out, "pinned host tier, all layers:");
    assert!((86.0..88.0).contains(&mb), "~87 MB pinned, got {mb}");
    // The ratio-128 layers (cap 64 <= 512 slots) keep swap off but count as pinned.
    assert!(out.contains("(20 of 41 layers swap)"), "{out}");

    let (code, out, _) = kvswap(&["plan", "--context", "256K"]);
    assert_eq!(code, 0);
    assert!(out.contains("suggested KVSWAP_PINNED_MIB=4096"), "{out}");
    assert!(out.contains("= 2.77 GB"), "{out}");
}

#[test]
fn plan_json_and_model_file() {
    let (code, out, _) = kvswap(&["plan", "--context", "256K", "--json"]);
    assert_eq!(code, 0);
    let v: serde_json::Value = serde_json::from_str(&out).expect("valid JSON");
    assert_eq!(v["suggested_pinned_mib"], 4096);
    assert_eq!(v["classes"][0]["compressed_cap"], 65536);
    assert_eq!(v["classes"][1]["compressed_cap"], 2048);

    let model = concat!(env!("CARGO_MANIFEST_DIR"), "/integrations/models/reference.toml");
    let (code, out, _) = kvswap(&["plan", "--model", model, "--context", "1M", "--dtype", "bf16", "--json"]);
    assert_eq!(code, 0);
    let v: serde_json::Value = serde_json::from_str(&out).expect("valid JSON");
    assert_eq!(v["classes"][0]["chunk_bytes"], 1024, "--dtype overrides the file");
    assert_eq!(v["pinned_bytes_total"], (20 * 262_144 + 21 * 8_192) * 1024u64);
}

#[test]
fn bad_input_exits_2_naming_flag_and_value() {
    for (args, needles) in [
        (&["plan", "--layers", "20x0"][..], &["--layers", "20x0", "ratio"][..]),
        (&["plan", "--layers", "20-4"], &["--layers", "20-4"]),
        (&["plan", "--dtype", "int4"], &["--dtype", "int4"]),
        (&["plan", "--context", "0"], &["--context", "'0'"]),
        (&["plan", "--context", "-5"], &["--context", "'-5'"]),
        (&["bench", "--backend", "cpu", "--device", "5"], &["--device 5", "--backend cpu"]),
        (&["bench", "--backend", "cpu", "--json", "/nonexistent-kvswap-dir/b.json"], &["--json", "is not a folder"]),
        (&["demo", "--context", "--steps", "1"], &["a value is required", "--context"]),
        (&["plan", "--no-such-flag"], &["--no-such-flag"]),
        (&["demo", "--gpu-chunks", "256"], &["--gpu-chunks", "256", "--topk=512"]),
        (&["demo", "--locality", "1.5"], &["--locality", "1.5"]),
        (&["demo", "--sweep-chunks", "128,512"], &["--sweep-chunks", "128"]),
    ] {
        let (code, out, err) = kvswap(args);
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(out.is_empty(), "{args:?} printed to stdout: {out}");
        for n in needles {
            assert!(err.contains(n), "{args:?}: {n:?} not in {err}");
        }
    }
    let dir = scratch("bad-model");
    let bad = dir.join("bad.toml");
    std::fs::write(&bad, "[[layers]]\ncount = 20\nratio = 0\n").unwrap();
    let (code, _, err) = kvswap(&["plan", "--model", bad.to_str().unwrap()]);
    assert_eq!(code, 2);
    assert!(err.contains("layers[0].ratio") && err.contains("\"0\""), "{err}");
}

#[test]
fn demo_runs_and_reports_hit_rate_and_bytes() {
    let (code, out, err) = kvswap(&["demo", "--steps", "200", "--context", "64K", "--backend", "cpu"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("backend cpu (host memory plays the device)"), "{out}");
    assert!(out.contains("65,536 tokens (64K) = 16,384 chunks per layer"), "{out}");
    let hit = number_after(&out, "hit rate:");
    assert!(hit > 50.0 && hit < 100.0, "hit rate {hit}%");
    let h2d = number_after(&out, "h2d");
    assert!(h2d > 0.0, "{out}");
    // 200 tokens at ratio 4 = 50 new chunks x 4 layers x 2,048 B over 200 steps.
    assert_eq!(number_after(&out, "d2h"), 2048.0, "{out}");
    assert!(number_after(&out, "throughput:") > 0.0);
    assert!(number_after(&out, "p99") >= number_after(&out, "p50"));
    assert!(out.contains("with swap 5.24 MB (5.00 MiB)"), "4 x (128 + 512) x 2 KB: {out}");
    assert!(!err.contains('\u{1b}'), "no progress bar when stderr is not a terminal");
}

#[test]
fn demo_sweep_writes_table_svg_and_json() {
    let dir = scratch("sweep");
    let svg = dir.join("sweep.svg");
    let json = dir.join("sweep.json");
    let (code, out, err) = kvswap(&[
        "demo",
        "--sweep",
        "--steps",
        "100",
        "--context",
        "32K",
        "--sweep-chunks",
        "512,1024",
        "--svg",
        svg.to_str().unwrap(),
        "--json",
        json.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("gpu_chunks") && out.contains("hit rate") && out.contains("steps/s"), "{out}");
    let rows: Vec<&str> =
        out.lines().filter(|l| l.trim_start().starts_with("512 ") || l.trim_start().starts_with("1024 ")).collect();
    assert_eq!(rows.len(), 2, "{out}");
    assert!(rows[0].contains("5.00") && rows[1].contains("9.00"), "GPU MiB with swap: {out}");

    let text = std::fs::read_to_string(&svg).expect("svg written");
    assert!(text.starts_with("<svg"), "{}", &text[..80.min(text.len())]);
    assert!(text.trim_end().ends_with("</svg>"));
    assert!(text.contains("hit rate") && text.contains("steps/s") && text.contains("gpu_chunks"));
    assert_eq!(text.matches("<polyline").count(), 3);

    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let results = v["results"].as_array().expect("results");
    assert_eq!(results.len(), 2);
    assert_eq!(results[1]["gpu_chunks"], 1024);
    assert_eq!(v["params"]["sweep_chunks"], serde_json::json!([512, 1024]), "the swept list, not one run's value");
    assert!(v["params"].get("gpu_chunks").is_none(), "no single gpu_chunks for a sweep: {}", v["params"]);
    let (h0, h1) = (results[0]["hit_rate"].as_f64().unwrap(), results[1]["hit_rate"].as_f64().unwrap());
    assert!(h1 >= h0, "more slots never hit less on the same sequence: {h0} {h1}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn demo_cuda_without_device_fails_clearly() {
    let (code, out, err) = kvswap(&["demo", "--backend", "cuda", "--steps", "10", "--context", "8K"]);
    if cfg!(feature = "cuda") && code == 0 {
        assert!(out.contains("cuda backend"), "a CUDA build on a GPU machine runs on CUDA: {out}");
        return;
    }
    assert_eq!(code, 1, "runtime error, not a usage error: {err}");
    assert!(out.is_empty(), "{out}");
    assert!(err.contains("NO_DEVICE") || err.contains("no CUDA"), "{err}");
}

/// Small inputs that used to panic or ask for terabytes: a usage error (exit
/// 2) naming the flag, or (--kv-dim 1) a normal run.
#[test]
fn demo_limits_are_usage_errors_not_crashes() {
    let (code, out, err) = kvswap(&["demo", "--backend", "cpu", "--kv-dim", "1", "--context", "8K", "--steps", "5"]);
    assert_eq!(code, 0, "--kv-dim 1 (4-byte chunks): {err}");
    assert!(out.contains("hit rate"), "{out}");
    for (args, flag) in [
        (vec!["--steps", "18446744073709551615"], "--steps"),
        (vec!["--ratio", "4294967295", "--context", "4G", "--steps", "100000000000"], "--steps"),
        (vec!["--layers", "4294967295", "--context", "4", "--steps", "1"], "--layers"),
        (vec!["--window", "100000000"], "--window"),
        (vec!["--gpu-chunks", "1073741000", "--window", "1000"], "--gpu-chunks"),
        (vec!["--svg", "x.svg"], "--svg"),
        // Output folders are checked before the run, not after it.
        (vec!["--sweep-chunks", "512", "--svg", "/nonexistent-kvswap-dir/x.svg"], "is not a folder"),
        (vec!["--steps", "1", "--json", "/nonexistent-kvswap-dir/x.json"], "is not a folder"),
        (vec!["--steps", "1", "--json", "Cargo.toml/x.json"], "is not a folder"),
        (vec!["--steps", "1", "--json", "."], "is a directory"),
    ] {
        let mut all = vec!["demo", "--backend", "cpu"];
        all.extend(&args);
        let (code, _, err) = kvswap(&all);
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(err.contains(flag) && !err.contains("panicked"), "{args:?}: {err}");
    }
    // A sweep takes gpu_chunks from its list: --topk above the default
    // --gpu-chunks runs the default list's values >= --topk.
    let dir = scratch("sweep-topk");
    let svg = dir.join("s.svg");
    let (code, out, err) =
        kvswap(&["demo", "--backend", "cpu", "--sweep", "--topk", "1024", "--context", "64K", "--steps", "3", "--svg", svg.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("1024") && out.contains("8192") && svg.exists(), "{out}");
}

/// Inputs that used to read without end or print saturated figures.
#[test]
fn plan_and_fm_refuse_devices_and_overflowing_figures() {
    let (code, _, err) = kvswap(&["plan", "--model", "/dev/zero"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--model") && err.contains("regular file"), "{err}");
    let (code, _, err) = kvswap(&["fm", "info", "/dev/zero"]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("not a regular file"), "{err}");
    // fm init writes beside --out and renames over it: a FIFO (as a device
    // would be) or a symbolic link there is refused, not replaced.
    let dir = scratch("fm-init-link");
    let fifo = dir.join("fifo");
    let _ = std::fs::remove_file(&fifo);
    assert!(Command::new("mkfifo").arg(&fifo).status().expect("mkfifo").success());
    let (code, _, err) = kvswap(&["fm", "init", "--hidden", "8", "--heads", "2", "--head-dim", "4", "--scorers", "1", "--out", fifo.to_str().unwrap()]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("fifo") && err.contains("not a regular file"), "{err}");
    assert!(std::fs::symlink_metadata(&fifo).unwrap().file_type().is_fifo(), "the FIFO is still there");
    let (target, link) = (dir.join("target.st"), dir.join("link.st"));
    std::fs::write(&target, b"keep").unwrap();
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(&target, &link).unwrap();
    let (code, _, err) = kvswap(&["fm", "init", "--hidden", "8", "--heads", "2", "--head-dim", "4", "--scorers", "1", "--out", link.to_str().unwrap()]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("symbolic link"), "{err}");
    assert!(std::fs::symlink_metadata(&link).unwrap().file_type().is_symlink() && std::fs::read(&target).unwrap() == b"keep");
    let (code, _, err) = kvswap(&["plan", "--indexer-bytes-per-token", "18446744073709551615"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--indexer-bytes-per-token"), "{err}");
}

#[test]
fn plan_notes_a_pinned_tier_above_the_machines_memory() {
    // 1000 ratio-4 layers at 1G tokens: a 550 TB host tier, above any
    // machine's memory. The note goes to stderr; stdout
    // stays the plan.
    let (code, out, err) = kvswap(&["plan", "--context", "1G", "--layers", "1000x4"]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("more than this machine's memory") && err.contains("549,755.8 GB"), "{err}");
    assert!(out.contains("suggested KVSWAP_PINNED_MIB=536870912") && !out.contains("note:"), "{out}");
    let (code, _, err) = kvswap(&["plan", "--context", "8K"]);
    assert_eq!(code, 0, "{err}");
    assert!(!err.contains("machine's memory"), "{err}");
}

/// bench's GPU benchmarks: two at once, or one GPU for all GPUs, are usage
/// errors (they were silently ignored), on every build.
#[test]
fn bench_refuses_conflicting_gpu_flags() {
    let (code, _, err) = kvswap(&["bench", "--scorer", "--multi-gpu", "--quick"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--scorer and --multi-gpu"), "{err}");
    let (code, _, err) = kvswap(&["bench", "--multi-gpu", "--device", "1", "--quick"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--multi-gpu measures every GPU"), "{err}");
    // --chunk-bytes sizes the CUDA swap-in table only; sizes are checked.
    for args in [&["--scorer"][..], &["--multi-gpu"], &["--backend", "cpu"]] {
        let mut a = vec!["bench", "--chunk-bytes", "2052", "--quick"];
        a.extend_from_slice(args);
        let (code, _, err) = kvswap(&a);
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(err.contains("--chunk-bytes sizes the CUDA swap-in table"), "{args:?}: {err}");
    }
    for bad in ["0", "65537", "2k", "2048,,4096"] {
        let (code, _, err) = kvswap(&["bench", "--chunk-bytes", bad, "--quick"]);
        assert_eq!(code, 2, "{bad}: {err}");
        assert!(err.contains("--chunk-bytes"), "{bad}: {err}");
    }
}

/// An unknown KVSWAP_LOG value leaves the default level, and says so once.
#[test]
fn an_unknown_log_level_is_named() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvswap"))
        .args(["demo", "--backend", "cpu", "--context", "8K", "--steps", "2"])
        .env("KVSWAP_LOG", "bogus")
        .output()
        .expect("run kvswap");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert_eq!(err.matches("KVSWAP_LOG=\"bogus\" is not a level").count(), 1, "{err}");
}
