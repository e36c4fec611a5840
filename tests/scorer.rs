//! The FlashMemory scorer through its C ABI (`fm_*`) on the CPU backend:
//! checkpoint round trip and every malformed-checkpoint case, the math
//! against a hand computation, top-k order and ties, magnitudes, NaN
//! handling, bf16/fp8 keys against exactly equal f32 keys, batched against
//! single calls, and the key-bounds scorer against brute force.
//!
//! Random inputs use a fresh seed per test (printed; `KVSWAP_SEED=N`
//! replays it) and are never all zero.

mod common;

use common::Rng;
use half::bf16;
use kvswap::ffi::*;
use kvswap::scorer::dtype::fp8_e4m3_to_f32;
use kvswap::scorer::keys::{FM_KEYS_BF16, FM_KEYS_F32, FM_KEYS_FP8_E4M3};
use kvswap::scorer::{reference, Checkpoint, Keys, ScoreMode, KVSWAP_FM_QUERY_AUTO, KVSWAP_FM_QUERY_WIDE};
use kvswap::{Ensemble, KvswapStatus};
use std::ffi::{CStr, CString};
use std::path::{Path, PathBuf};
use std::ptr::{null, null_mut};

// ------------------------------------------------------------ helpers

fn last_error() -> String {
    // SAFETY: kvswap_last_error never returns NULL.
    unsafe { CStr::from_ptr(kvswap_last_error()) }.to_string_lossy().into_owned()
}

/// A scratch directory of this test process.
fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("scorer-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

fn cpath(p: &Path) -> CString {
    CString::new(p.to_str().expect("utf-8 path")).expect("no NUL")
}

/// An owned scorer handle, freed on drop.
struct Fm(*mut FmScorer);

impl Drop for Fm {
    fn drop(&mut self) {
        fm_scorer_free(self.0);
    }
}

impl Fm {
    fn info(&self) -> FmScorerInfo {
        let mut i = FmScorerInfo::default();
        assert_eq!(fm_scorer_info(self.0, &mut i), KvswapStatus::Ok, "{}", last_error());
        i
    }

    /// fm_score_topk on host data; Err carries status and message.
    fn topk(&self, hidden: &[f32], keys: &FmKeys, n_chunks: usize, k: u32) -> Result<Vec<i32>, (KvswapStatus, String)> {
        let mut out = vec![i32::MIN; k as usize];
        let s = fm_score_topk(self.0, hidden.as_ptr(), keys, n_chunks, k, out.as_mut_ptr(), null_mut());
        if s != KvswapStatus::Ok {
            assert!(out.iter().all(|&v| v == i32::MIN), "out_indices written on failure");
            return Err((s, last_error()));
        }
        Ok(out)
    }
}

fn load(path: &Path, device: i32) -> Result<Fm, (KvswapStatus, String)> {
    let mut h: *mut FmScorer = null_mut();
    let s = fm_scorer_load(cpath(path).as_ptr(), device, &mut h);
    if s != KvswapStatus::Ok {
        assert!(h.is_null(), "out written on failure");
        return Err((s, last_error()));
    }
    Ok(Fm(h))
}

fn f32_keys(keys: &[f32]) -> FmKeys {
    FmKeys { data: keys.as_ptr().cast(), scales: null(), row_stride_bytes: 0, dtype: FM_KEYS_F32 }
}

fn bf16_keys(keys: &[bf16]) -> FmKeys {
    FmKeys { data: keys.as_ptr().cast(), scales: null(), row_stride_bytes: 0, dtype: FM_KEYS_BF16 }
}

fn fp8_keys(keys: &[u8], scales: &[f32]) -> FmKeys {
    FmKeys { data: keys.as_ptr().cast(), scales: scales.as_ptr(), row_stride_bytes: 0, dtype: FM_KEYS_FP8_E4M3 }
}

impl Rng {
    /// Uniform in [0, 1).
    fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    /// A standard normal number (Box-Muller).
    fn normal(&mut self) -> f32 {
        let (u, v) = (1.0 - self.unit(), self.unit());
        ((-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()) as f32
    }
    /// `n` values of magnitude in [0.5, 2) with random signs: never zero,
    /// never near an f32 range limit after scaling by 2^+-100.
    fn away_from_zero(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| (0.5 + 1.5 * self.unit()) as f32 * if self.chance(0.5) { -1.0 } else { 1.0 }).collect()
    }
    fn normals(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.normal()).collect()
    }
}

/// Bytes of a safetensors file, written here independently of the library
/// (and of the `safetensors` crate), so malformed files can be made.
/// `tensors`: name, dtype string, shape, little-endian bytes.
fn st_file(meta: &[(&str, &str)], tensors: &[(String, &str, Vec<usize>, Vec<u8>)]) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    if !meta.is_empty() {
        let m: serde_json::Map<_, _> = meta.iter().map(|(k, v)| (k.to_string(), serde_json::json!(v))).collect();
        header.insert("__metadata__".into(), serde_json::Value::Object(m));
    }
    let mut offset = 0usize;
    for (name, dtype, shape, data) in tensors {
        header.insert(
            name.clone(),
            serde_json::json!({ "dtype": dtype, "shape": shape, "data_offsets": [offset, offset + data.len()] }),
        );
        offset += data.len();
    }
    let mut h = serde_json::to_vec(&serde_json::Value::Object(header)).unwrap();
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut file = (h.len() as u64).to_le_bytes().to_vec();
    file.extend(h);
    for (_, _, _, data) in tensors {
        file.extend(data);
    }
    file
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn meta_fields<'a>(n_scorers: &'a str, hidden: &'a str, heads: &'a str, head_dim: &'a str) -> Vec<(&'a str, &'a str)> {
    vec![
        ("format", "flashmemory-v1"),
        ("n_scorers", n_scorers),
        ("hidden", hidden),
        ("n_heads", heads),
        ("head_dim", head_dim),
        ("ensemble", "max"),
    ]
}

/// A random model: per scorer, `wq` (heads*head_dim x hidden) and `ww`
/// (heads x hidden), f32, N(0, 1/hidden).
struct Model {
    n_scorers: usize,
    hidden: usize,
    heads: usize,
    head_dim: usize,
    wq: Vec<Vec<f32>>,
    ww: Vec<Vec<f32>>,
}

impl Model {
    fn random(rng: &mut Rng, n_scorers: usize, hidden: usize, heads: usize, head_dim: usize) -> Model {
        let s = 1.0 / (hidden as f32).sqrt();
        let mut m = |n: usize| -> Vec<f32> { rng.normals(n).iter().map(|v| v * s).collect() };
        let wq = (0..n_scorers).map(|_| m(heads * head_dim * hidden)).collect();
        let ww = (0..n_scorers).map(|_| m(heads * hidden)).collect();
        Model { n_scorers, hidden, heads, head_dim, wq, ww }
    }

    fn tensors(&self) -> Vec<(String, &'static str, Vec<usize>, Vec<u8>)> {
        let mut t = Vec::new();
        for i in 0..self.n_scorers {
            t.push((format!("scorers.{i}.wq"), "F32", vec![self.heads * self.head_dim, self.hidden], f32_bytes(&self.wq[i])));
            t.push((format!("scorers.{i}.ww"), "F32", vec![self.heads, self.hidden], f32_bytes(&self.ww[i])));
        }
        t
    }

    fn write(&self, path: &Path, ensemble: &str) {
        let (n, h, a, d) = (self.n_scorers.to_string(), self.hidden.to_string(), self.heads.to_string(), self.head_dim.to_string());
        let mut meta = meta_fields(&n, &h, &a, &d);
        meta[5].1 = ensemble;
        std::fs::write(path, st_file(&meta, &self.tensors())).unwrap();
    }
}

/// A random model written to a scratch file and loaded on the CPU.
fn random_scorer(rng: &mut Rng, name: &str, n_scorers: usize, hidden: usize, heads: usize, head_dim: usize) -> (Fm, Model, PathBuf) {
    let m = Model::random(rng, n_scorers, hidden, heads, head_dim);
    let path = scratch(name).join("fm.safetensors");
    m.write(&path, "max");
    (load(&path, -1).expect("load"), m, path)
}

/// The top-k by the spec, from per-chunk scores: score desc, id asc.
fn spec_topk(scores: &[f64], k: usize) -> Vec<i32> {
    let mut ids: Vec<usize> = (0..scores.len()).collect();
    ids.sort_by(|&a, &b| scores[b].partial_cmp(&scores[a]).unwrap().then(a.cmp(&b)));
    let mut out: Vec<i32> = ids.into_iter().take(k).map(|i| i as i32).collect();
    out.resize(k, -1);
    out
}

// ------------------------------------------------------------ checkpoints

#[test]
fn checkpoint_round_trip_through_the_cli() {
    let dir = scratch("roundtrip");
    let file = dir.join("init.safetensors");
    let run = |args: &[&str]| {
        let o = std::process::Command::new(env!("CARGO_BIN_EXE_kvswap")).args(args).output().expect("run kvswap");
        (o.status.code(), String::from_utf8_lossy(&o.stdout).into_owned(), String::from_utf8_lossy(&o.stderr).into_owned())
    };
    let f = file.to_str().unwrap();
    let (code, out, err) = run(&[
        "fm", "init", "--hidden", "48", "--heads", "4", "--head-dim", "8", "--scorers", "3", "--out", f, "--dtype", "bf16",
        "--ensemble", "mean", "--seed", "11",
    ]);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("wrote") && out.contains("3 scorers"), "{out}");

    let fm = load(&file, -1).expect("load the init checkpoint");
    let i = fm.info();
    assert_eq!((i.n_scorers, i.hidden, i.n_heads, i.head_dim, i.device), (3, 48, 4, 8, -1));
    assert_eq!(i.ensemble, kvswap::config::KVSWAP_ENSEMBLE_MEAN);
    assert_eq!(i.weight_bytes, 3 * (4 * 8 + 4) * 48 * 2);
    assert_eq!(fm_scorer_set_ensemble(fm.0, kvswap::config::KVSWAP_ENSEMBLE_MAX), KvswapStatus::Ok);
    assert_eq!(fm.info().ensemble, kvswap::config::KVSWAP_ENSEMBLE_MAX);
    assert_eq!(fm_scorer_set_ensemble(fm.0, 7), KvswapStatus::InvalidArgument);
    assert!(last_error().contains("ensemble = 7"), "{}", last_error());

    let (code, out, err) = run(&["fm", "info", f]);
    assert_eq!(code, Some(0), "{err}");
    for needle in ["flashmemory-v1", "n_scorers=3 hidden=48 n_heads=4 head_dim=8 ensemble=mean", "scorers.2.ww", "BF16", "[32, 48]", "[4, 48]"] {
        assert!(out.contains(needle), "missing {needle:?} in:\n{out}");
    }
    let (code, json, _) = run(&["fm", "info", "--json", f]);
    assert_eq!(code, Some(0));
    let v: serde_json::Value = serde_json::from_str(&json).expect("json");
    assert_eq!(v["tensors"].as_array().unwrap().len(), 6);
    for t in v["tensors"].as_array().unwrap() {
        // N(0, 1/hidden) weights: a sample std of n values is within 5 of
        // its standard errors (target / sqrt(2n)) of the target, plus bf16's
        // rounding (wq: 1,536 values, +-0.013; ww: 192, +-0.037).
        let std = t["std"].as_f64().unwrap();
        let n: u64 = t["shape"].as_array().unwrap().iter().map(|d| d.as_u64().unwrap()).product();
        let target = 1.0 / 48f64.sqrt();
        let tol = 5.0 * target / (2.0 * n as f64).sqrt() + 0.002;
        assert!((std - target).abs() < tol, "std {std} of {} ({n} values): expected {target} +- {tol}", t["name"]);
    }

    // The same seed writes the same weights; another seed different ones.
    let again = dir.join("again.safetensors");
    let other = dir.join("other.safetensors");
    for (p, seed) in [(&again, "11"), (&other, "12")] {
        let (code, _, err) = run(&[
            "fm", "init", "--hidden", "48", "--heads", "4", "--head-dim", "8", "--scorers", "3", "--out",
            p.to_str().unwrap(), "--ensemble", "mean", "--seed", seed,
        ]);
        assert_eq!(code, Some(0), "{err}");
    }
    // The same seed writes the same file, byte for byte (metadata keys in a
    // fixed order), with the permissions of any file this process creates
    // (not the 0600 of a temporary file).
    let bytes = |p: &Path| std::fs::read(p).unwrap();
    assert!(bytes(&file) == bytes(&again), "same seed, different files");
    let weights = |p: &Path| -> Vec<Vec<u8>> {
        let c = Checkpoint::load(p).unwrap();
        c.weight_tensors().map(|t| c.raw(t).to_vec()).collect()
    };
    assert!(weights(&file) != weights(&other), "different seeds, same weights");
    {
        use std::os::unix::fs::PermissionsExt;
        let plain = dir.join("plain");
        std::fs::File::create(&plain).unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&file), mode(&plain), "checkpoint permissions");
    }

    // A bad or missing checkpoint is a run-time failure (exit 1) with the
    // reason, not a usage error.
    let bad = dir.join("bad.safetensors");
    std::fs::write(&bad, b"not a checkpoint").unwrap();
    let (code, _, err) = run(&["fm", "info", bad.to_str().unwrap()]);
    assert_eq!(code, Some(1));
    assert!(err.contains("KVSWAP_STATUS_BAD_CHECKPOINT"), "{err}");
    let (code, _, err) = run(&["fm", "info", dir.join("missing.safetensors").to_str().unwrap()]);
    assert_eq!(code, Some(1));
    assert!(err.contains("KVSWAP_STATUS_IO") && !err.contains("--help"), "{err}");
    // Shapes each in range whose weights would not fit in memory: a usage
    // error before anything is allocated.
    let (code, _, err) = run(&["fm", "init", "--hidden", "1048576", "--heads", "4096", "--head-dim", "4096", "--out", dir.join("huge").to_str().unwrap()]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("at most 4 GiB"), "{err}");
    assert!(!dir.join("huge").exists());
}

#[test]
fn the_writer_refuses_what_the_loader_refuses() {
    use kvswap::scorer::{write, Meta, WeightDtype};
    let meta = Meta { n_scorers: 1, hidden: 2, n_heads: 1, head_dim: 1, ensemble: Ensemble::Max };
    let ok = vec![vec![0.5f32, -0.25]];
    // 1e5 overflows f16 (Inf), NaN is NaN: both named, as the loader names them.
    let e = write::from_weights(&meta, WeightDtype::F16, &[vec![0.5, 1e5]], &ok).unwrap_err();
    assert!(e.message.contains("scorers.0.wq element [0, 1]") && e.message.contains("finite"), "{e}");
    let e = write::from_weights(&meta, WeightDtype::Bf16, &ok, &[vec![f32::NAN, 0.0]]).unwrap_err();
    assert!(e.message.contains("scorers.0.ww element [0, 0]"), "{e}");
    let t = write::from_weights(&meta, WeightDtype::F16, &ok, &ok).unwrap();
    assert!(Checkpoint::from_bytes(write::to_bytes(&meta, &t).unwrap()).is_ok());
}

#[test]
fn library_writer_round_trip_keeps_raw_bytes() {
    use kvswap::scorer::{write, Meta, WeightDtype};
    let meta = Meta { n_scorers: 2, hidden: 16, n_heads: 2, head_dim: 4, ensemble: Ensemble::Max };
    for dtype in [WeightDtype::F32, WeightDtype::F16, WeightDtype::Bf16] {
        let tensors = write::random(&meta, dtype, 3).unwrap();
        let path = scratch("writer").join(format!("{}.safetensors", dtype.name()));
        write::save(&path, &meta, &tensors).unwrap();
        let c = Checkpoint::load(&path).unwrap();
        assert_eq!(*c.meta(), meta);
        for (t, written) in c.weight_tensors().zip(&tensors) {
            assert_eq!(t.name, written.name);
            assert_eq!(t.dtype, dtype);
            assert_eq!(c.raw(t), &written.data[..], "raw bytes of {} as stored", t.name);
        }
        assert_eq!(c.file_bytes(), std::fs::metadata(&path).unwrap().len());
        // save streams the file; its bytes are to_bytes's (sorted metadata).
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(bytes, write::to_bytes(&meta, &tensors).unwrap(), "save and to_bytes write the same file");
        let len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let header = std::str::from_utf8(&bytes[8..8 + len]).unwrap();
        let keys: Vec<usize> = ["\"ensemble\"", "\"format\"", "\"head_dim\"", "\"hidden\"", "\"n_heads\"", "\"n_scorers\""]
            .iter()
            .map(|k| header.find(k).unwrap_or_else(|| panic!("{k} in {header}")))
            .collect();
        assert!(keys.windows(2).all(|w| w[0] < w[1]), "metadata keys sorted: {header}");
    }
}

/// Random corruptions of a valid checkpoint (bytes changed in its length
/// field, header and data; cut short; bytes inserted into the header): each
/// load either succeeds or fails with BAD_CHECKPOINT and a message naming
/// the file, never panics or aborts, and leaves the handle NULL on failure.
/// A load that succeeds gives the checkpoint's shape and a scorer that
/// scores (data bytes changed into finite weights are still a checkpoint;
/// one made huge may overflow a projection, which the call reports).
#[test]
fn corrupted_checkpoints_load_or_are_refused() {
    let mut rng = Rng::fresh("corrupted_checkpoints");
    let dir = scratch("corrupt");
    let good = Model::random(&mut rng, 2, 8, 2, 4);
    let meta = meta_fields("2", "8", "2", "4");
    let full = st_file(&meta, &good.tensors());
    let header_end = 8 + u64::from_le_bytes(full[..8].try_into().unwrap()) as usize;
    let path = dir.join("c.safetensors");
    let hidden: Vec<f32> = (0..2 * 8).map(|i| 0.125 * i as f32 - 1.0).collect(); // n_scorers x hidden
    let keys: Vec<f32> = (0..5 * 4).map(|i| (i % 7) as f32 * 0.5 - 1.5).collect();
    let (mut loaded, mut refused) = (0, 0);
    for round in 0..common::scaled(400) {
        let mut bytes = full.clone();
        let what = match rng.below(5) {
            0 => {
                let i = rng.below(8) as usize; // the header length field
                bytes[i] ^= 1 << rng.below(8);
                "length field"
            }
            1 => {
                for _ in 0..1 + rng.below(3) {
                    let i = 8 + rng.below((header_end - 8) as u64) as usize;
                    bytes[i] = rng.below(256) as u8;
                }
                "header bytes"
            }
            2 => {
                let i = header_end + rng.below((full.len() - header_end) as u64) as usize;
                bytes[i] = rng.below(256) as u8;
                "data byte"
            }
            3 => {
                bytes.truncate(rng.below(full.len() as u64) as usize);
                "cut short"
            }
            _ => {
                let i = 8 + rng.below((header_end - 8) as u64) as usize;
                let extra: Vec<u8> = (0..1 + rng.below(4)).map(|_| b" {}[],:\"0123456789eE-+.\\x"[rng.below(22) as usize]).collect();
                bytes.splice(i..i, extra);
                "bytes inserted into the header"
            }
        };
        std::fs::write(&path, &bytes).unwrap();
        match load(&path, -1) {
            Ok(fm) => {
                loaded += 1;
                let info = fm.info();
                assert_eq!((info.n_scorers, info.hidden, info.n_heads, info.head_dim), (2, 8, 2, 4), "round {round} ({what}): shape");
                // A changed data byte can make a weight huge but finite:
                // a projection may then overflow, which the call reports.
                if let Err((s, msg)) = fm.topk(&hidden, &f32_keys(&keys), 5, 3) {
                    assert_ne!(s, KvswapStatus::Panic, "round {round} ({what}): {msg}");
                    assert!(what == "data byte" && !msg.is_empty(), "round {round} ({what}): a loaded scorer fails to score: {s:?} {msg}");
                }
            }
            Err((s, msg)) => {
                refused += 1;
                assert_eq!(s, KvswapStatus::BadCheckpoint, "round {round} ({what}): {msg}");
                assert!(msg.starts_with("fm_scorer_load: checkpoint ") && msg.contains(path.to_str().unwrap()), "round {round} ({what}): {msg}");
            }
        }
    }
    eprintln!("corrupted checkpoints: {loaded} loaded, {refused} refused");
    assert!(refused > 0, "no corruption was refused");
}

/// Every malformed checkpoint: the status and the words of the message.
#[test]
fn bad_checkpoints_are_named() {
    let mut rng = Rng::fresh("bad_checkpoints_are_named");
    let dir = scratch("bad");
    let good = Model::random(&mut rng, 2, 3, 2, 4);
    let meta = meta_fields("2", "3", "2", "4");
    let mut cases: Vec<(&str, Vec<u8>, KvswapStatus, Vec<&str>)> = Vec::new();
    let bad = KvswapStatus::BadCheckpoint;

    let with_meta = |key: &'static str, value: Option<&'static str>| -> Vec<u8> {
        let mut m: Vec<(&str, &str)> = meta.iter().filter(|(k, _)| *k != key).cloned().collect();
        m.extend(value.map(|v| (key, v)));
        st_file(&m, &good.tensors())
    };
    cases.push(("wrong-tag", with_meta("format", Some("flashmemory-v0")), bad, vec!["format", "\"flashmemory-v0\"", "expected \"flashmemory-v1\""]));
    cases.push(("no-tag", with_meta("format", None), bad, vec!["no `format` field", "flashmemory-v1"]));
    cases.push(("no-metadata", st_file(&[], &good.tensors()), bad, vec!["no `format` field"]));
    cases.push(("no-head-dim", with_meta("head_dim", None), bad, vec!["no `head_dim` field"]));
    cases.push(("text-heads", with_meta("n_heads", Some("two")), bad, vec!["`n_heads` = \"two\"", "positive integer"]));
    cases.push(("zero-hidden", with_meta("hidden", Some("0")), bad, vec!["`hidden` = 0", "1..="]));
    cases.push(("bad-ensemble", with_meta("ensemble", Some("median")), bad, vec!["`ensemble` = \"median\"", "\"max\" or \"mean\""]));

    let mut t = good.tensors();
    t.retain(|x| x.0 != "scorers.1.ww");
    cases.push(("missing-tensor", st_file(&meta, &t), bad, vec!["`scorers.1.ww` is missing", "[2, 3]"]));

    let mut t = good.tensors();
    t[0].2 = vec![4, 4];
    t[0].3.truncate(16 * 4);
    cases.push(("wrong-shape", st_file(&meta, &t), bad, vec!["`scorers.0.wq` has shape [4, 4]", "expected [8, 3]"]));

    let mut t = good.tensors();
    t[1].1 = "I32";
    cases.push(("int-dtype", st_file(&meta, &t), bad, vec!["`scorers.0.ww` has dtype I32", "F32, F16 or BF16"]));

    let mut t = good.tensors();
    t[2].3[4 * 7..4 * 8].copy_from_slice(&f32::NAN.to_le_bytes()); // scorers.1.wq element 7 = [2, 1]
    cases.push(("nan-weight", st_file(&meta, &t), bad, vec!["`scorers.1.wq` element [2, 1] is NaN"]));

    let mut t = good.tensors();
    t[3].1 = "BF16";
    t[3].3 = (0..6).flat_map(|i| if i == 5 { bf16::INFINITY } else { bf16::from_f32(0.25) }.to_le_bytes()).collect();
    cases.push(("inf-bf16-weight", st_file(&meta, &t), bad, vec!["`scorers.1.ww` element [1, 2] is inf"]));

    let mut t = good.tensors();
    t.push(("scorers.2.wq".into(), "F32", vec![8, 3], f32_bytes(&[0.5; 24])));
    cases.push(("stray-scorer", st_file(&meta, &t), bad, vec!["`scorers.2.wq` is not expected", "n_scorers = 2"]));

    let full = st_file(&meta, &good.tensors());
    cases.push(("truncated", full[..full.len() - 10].to_vec(), bad, vec!["not a valid safetensors file", "truncated"]));
    cases.push(("garbage", b"hello, I am not a checkpoint".to_vec(), bad, vec!["not a valid safetensors file"]));
    cases.push(("empty", Vec::new(), bad, vec!["not a valid safetensors file"]));
    // Another format's first bytes: refused from the length field.
    let mut gguf = b"GGUF\x03\0\0\0".to_vec();
    gguf.extend([0u8; 64]);
    cases.push(("gguf", gguf, bad, vec!["not a valid safetensors file", "header length field", "limit"]));
    let mut not_json = 5u64.to_le_bytes().to_vec();
    not_json.extend(b"hello");
    cases.push(("not-json", not_json, bad, vec!["not a valid safetensors file", "header is not JSON"]));
    let mut trailing = full.clone();
    trailing.extend([0u8; 16]);
    cases.push(("trailing", trailing, bad, vec!["not a valid safetensors file", "its header describes"]));

    for (name, bytes, status, words) in cases {
        let path = dir.join(format!("{name}.safetensors"));
        std::fs::write(&path, bytes).unwrap();
        let (s, msg) = load(&path, -1).err().unwrap_or_else(|| panic!("{name}: loaded"));
        assert_eq!(s, status, "{name}: {msg}");
        assert!(msg.starts_with("fm_scorer_load: checkpoint ") && msg.contains(path.to_str().unwrap()), "{name}: {msg}");
        for w in words {
            assert!(msg.contains(w), "{name}: {w:?} not in {msg:?}");
        }
    }

    // A file far larger than its header describes (sparse: no disk used) is
    // refused from the header, before anything is read or allocated for it
    // (it once was read whole: a process abort when the allocation failed).
    let path = dir.join("huge.safetensors");
    std::fs::write(&path, &full).unwrap();
    std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(full.len() as u64 + (64u64 << 30)).unwrap();
    let (s, msg) = load(&path, -1).err().expect("huge: loaded");
    assert_eq!(s, bad, "{msg}");
    assert!(msg.contains(&format!("header describes {} bytes", full.len())), "{msg}");
    std::fs::remove_file(&path).unwrap();

    // Extra tensors outside `scorers.` are ignored; the good file loads.
    let mut t = good.tensors();
    t.push(("optimizer.step".into(), "I64", vec![1], 7i64.to_le_bytes().to_vec()));
    let path = dir.join("extra.safetensors");
    std::fs::write(&path, st_file(&meta, &t)).unwrap();
    assert!(load(&path, -1).is_ok(), "{}", last_error());

    // Missing file, directory, NULL and empty path, bad device.
    let (s, msg) = load(&dir.join("missing.safetensors"), -1).err().unwrap();
    assert_eq!(s, KvswapStatus::Io, "{msg}");
    assert!(msg.contains("missing.safetensors") && msg.contains("No such file"), "{msg}");
    assert_eq!(load(&dir, -1).err().unwrap().0, KvswapStatus::Io);
    let mut h = null_mut();
    assert_eq!(fm_scorer_load(null(), -1, &mut h), KvswapStatus::NullPointer);
    assert_eq!(fm_scorer_load(c"".as_ptr(), -1, &mut h), KvswapStatus::InvalidArgument);
    assert_eq!(fm_scorer_load(cpath(&path).as_ptr(), -1, null_mut()), KvswapStatus::NullPointer);
    assert_eq!(load(&path, -2).err().unwrap().0, KvswapStatus::InvalidArgument);
    let (s, msg) = load(&path, 0).err().unwrap();
    assert_eq!(s, KvswapStatus::NoDevice, "{msg}");
    assert!(msg.contains("device 0") && msg.contains("device -1"), "{msg}");
    fm_scorer_free(null_mut());
}

// ------------------------------------------------------------ the math

/// 1 or 2 scorers, 2 heads, head_dim 2, hidden 3, worked out by hand.
///
/// Scorer 0: Wq rows [1,0,0] [0,1,0] [0,0,1] [1,1,1]; Ww rows [1,0,0] [0.5,0,1].
/// h = [1, 2, -1]: q = Wq h = [1, 2, -1, 2], so q[0] = (1, 2), q[1] = (-1, 2);
/// w = Ww h = [1, 0.5 - 1] = [1, -0.5].
/// Keys: k0 = (1, 1), k1 = (1, -1), k2 = (-1, 1), k3 = (0, 2).
///   k0: q0.k = 3,  q1.k = 1  -> 1*3 - 0.5*1 = 2.5
///   k1: q0.k = -1, q1.k = -3 -> 0 (both relu'd away)
///   k2: q0.k = 1,  q1.k = 3  -> 1 - 1.5 = -0.5
///   k3: q0.k = 4,  q1.k = 4  -> 4 - 2 = 2
/// Scorer 1: the same Wq, Ww rows [-1,0,0] [0,0,0]: w = [-1, 0], so
/// s1 = -relu(q0.k) = [-3, 0, -1, -4].
/// max(s0, s1) = [2.5, 0, -0.5, 2] -> order 0, 3, 1, 2
/// mean = [-0.25, 0, -0.75, -1]    -> order 1, 0, 2, 3
#[test]
fn hand_computed_scores() {
    let wq = [1.0f32, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0];
    let ww0 = [1.0f32, 0.0, 0.0, 0.5, 0.0, 1.0];
    let ww1 = [-1.0f32, 0.0, 0.0, 0.0, 0.0, 0.0];
    let keys = [1.0f32, 1.0, 1.0, -1.0, -1.0, 1.0, 0.0, 2.0];
    let dir = scratch("hand");

    let one = dir.join("one.safetensors");
    let t = vec![
        ("scorers.0.wq".to_string(), "F32", vec![4, 3], f32_bytes(&wq)),
        ("scorers.0.ww".to_string(), "F32", vec![2, 3], f32_bytes(&ww0)),
    ];
    std::fs::write(&one, st_file(&meta_fields("1", "3", "2", "2"), &t)).unwrap();
    let fm = load(&one, -1).unwrap();
    let h = [1.0f32, 2.0, -1.0];
    assert_eq!(fm.topk(&h, &f32_keys(&keys), 4, 3).unwrap(), vec![0, 3, 1]);
    assert_eq!(fm.topk(&h, &f32_keys(&keys), 4, 6).unwrap(), vec![0, 3, 1, 2, -1, -1]);
    let ckpt = Checkpoint::load(&one).unwrap();
    let scores = reference::chunk_scores(&ckpt, Ensemble::Max, &h, &Keys::f32(&keys, 2).unwrap()).unwrap();
    assert_eq!(scores, vec![2.5, 0.0, -0.5, 2.0]);

    let two = dir.join("two.safetensors");
    let mut t2 = t.clone();
    t2.push(("scorers.1.wq".to_string(), "F32", vec![4, 3], f32_bytes(&wq)));
    t2.push(("scorers.1.ww".to_string(), "F32", vec![2, 3], f32_bytes(&ww1)));
    std::fs::write(&two, st_file(&meta_fields("2", "3", "2", "2"), &t2)).unwrap();
    let fm = load(&two, -1).unwrap();
    let h2 = [1.0f32, 2.0, -1.0, 1.0, 2.0, -1.0];
    assert_eq!(fm.topk(&h2, &f32_keys(&keys), 4, 4).unwrap(), vec![0, 3, 1, 2]);
    assert_eq!(fm_scorer_set_ensemble(fm.0, kvswap::config::KVSWAP_ENSEMBLE_MEAN), KvswapStatus::Ok);
    assert_eq!(fm.topk(&h2, &f32_keys(&keys), 4, 4).unwrap(), vec![1, 0, 2, 3]);
    let ckpt = Checkpoint::load(&two).unwrap();
    let keys_view = Keys::f32(&keys, 2).unwrap();
    assert_eq!(reference::chunk_scores(&ckpt, Ensemble::Mean, &h2, &keys_view).unwrap(), vec![-0.25, 0.0, -0.75, -1.0]);
    // Each scorer reads its own slice of the hidden input.
    let h_other = [1.0f32, 2.0, -1.0, -1.0, -2.0, 1.0]; // scorer 1 sees -h: q negated
    let s = reference::chunk_scores(&ckpt, Ensemble::Mean, &h_other, &keys_view).unwrap();
    // s1 with q -> -q and w -> -w: -(-1)*relu(-q0.k) = relu(-q0.k) = [0, 1, 0, 0]
    assert_eq!(s, vec![1.25, 0.5, -0.25, 1.0]);
}

/// Random inputs: the ABI's top-k is the spec's order of the reference scores.
#[test]
fn topk_matches_the_reference_order() {
    let mut rng = Rng::fresh("topk_matches_the_reference_order");
    let (fm, _, path) = random_scorer(&mut rng, "order", 3, 24, 4, 8);
    let ckpt = Checkpoint::load(&path).unwrap();
    for round in 0..20 {
        let n = 1 + rng.below(300) as usize;
        let k = 1 + rng.below(64) as u32;
        let hidden = rng.normals(3 * 24);
        let keys = rng.normals(n * 8);
        let e = if round % 2 == 0 { Ensemble::Max } else { Ensemble::Mean };
        fm_scorer_set_ensemble(fm.0, kvswap::scorer::ensemble_code(e));
        let scores = reference::chunk_scores(&ckpt, e, &hidden, &Keys::f32(&keys, 8).unwrap()).unwrap();
        assert!(scores.iter().any(|&s| s != 0.0));
        assert_eq!(fm.topk(&hidden, &f32_keys(&keys), n, k).unwrap(), spec_topk(&scores, k as usize), "n {n} k {k}");
    }
}

#[test]
fn ties_go_to_the_lower_id() {
    let mut rng = Rng::fresh("ties_go_to_the_lower_id");
    let (fm, _, path) = random_scorer(&mut rng, "ties", 2, 16, 4, 8);
    let hidden = rng.normals(2 * 16);
    // Every chunk has the same (non-zero) key: all scores are equal.
    let key = rng.away_from_zero(8);
    let same: Vec<f32> = key.iter().cycle().take(100 * 8).copied().collect();
    assert_eq!(fm.topk(&hidden, &f32_keys(&same), 100, 10).unwrap(), (0..10).collect::<Vec<i32>>());
    // Three distinct keys spread over 500 chunks: many exact ties.
    let distinct: Vec<Vec<f32>> = (0..3).map(|_| rng.away_from_zero(8)).collect();
    let which: Vec<usize> = (0..500).map(|_| rng.below(3) as usize).collect();
    let keys: Vec<f32> = which.iter().flat_map(|&w| distinct[w].clone()).collect();
    let out = fm.topk(&hidden, &f32_keys(&keys), 500, 300).unwrap();
    let c = Checkpoint::load(&path).unwrap();
    let ckpt_scores = reference::chunk_scores(&c, Ensemble::Max, &hidden, &Keys::f32(&keys, 8).unwrap()).unwrap();
    assert_eq!(out, spec_topk(&ckpt_scores, 300));
    // Within each run of equal scores the ids ascend.
    for w in out.windows(2) {
        let (a, b) = (w[0] as usize, w[1] as usize);
        assert!(ckpt_scores[a] > ckpt_scores[b] || (ckpt_scores[a] == ckpt_scores[b] && a < b));
    }
}

#[test]
fn padding_and_a_single_chunk() {
    let mut rng = Rng::fresh("padding_and_a_single_chunk");
    let (fm, _, _) = random_scorer(&mut rng, "pad", 1, 8, 2, 4);
    let hidden = rng.normals(8);
    let keys = rng.normals(3 * 4);
    let out = fm.topk(&hidden, &f32_keys(&keys), 3, 7).unwrap();
    assert_eq!(&out[3..], &[-1; 4]);
    let mut first: Vec<i32> = out[..3].to_vec();
    first.sort();
    assert_eq!(first, vec![0, 1, 2]);
    assert_eq!(fm.topk(&hidden, &f32_keys(&keys), 1, 1).unwrap(), vec![0]);
    let padded = fm.topk(&hidden, &f32_keys(&keys), 1, 2048).unwrap();
    assert_eq!(padded.len(), 2048);
    assert!(padded[0] == 0 && padded[1..].iter().all(|&v| v == -1), "k = 2048 over one chunk: 0, then -1 to the end");
}

/// Scaling the hidden state by a > 0 scales every score by a^2 (relu is
/// positively homogeneous); by a power of two that is exact in f64, so the
/// top-k is identical. Keys scaled the same way scale scores by a. Neither
/// 1e30 nor 1e-30 overflows or underflows the f64 accumulation.
#[test]
fn huge_and_tiny_magnitudes() {
    let mut rng = Rng::fresh("huge_and_tiny_magnitudes");
    let (fm, _, path) = random_scorer(&mut rng, "magnitude", 3, 16, 4, 8);
    let ckpt = Checkpoint::load(&path).unwrap();
    let n = 200;
    let hidden = rng.away_from_zero(3 * 16);
    let keys = rng.away_from_zero(n * 8);
    let base = fm.topk(&hidden, &f32_keys(&keys), n, 50).unwrap();
    let base_scores = reference::chunk_scores(&ckpt, Ensemble::Max, &hidden, &Keys::f32(&keys, 8).unwrap()).unwrap();
    for p in [100i32, -100] {
        let a = 2f32.powi(p);
        let h: Vec<f32> = hidden.iter().map(|v| v * a).collect();
        let k: Vec<f32> = keys.iter().map(|v| v * a).collect();
        assert_eq!(fm.topk(&h, &f32_keys(&keys), n, 50).unwrap(), base, "hidden x 2^{p}");
        assert_eq!(fm.topk(&hidden, &f32_keys(&k), n, 50).unwrap(), base, "keys x 2^{p}");
        assert_eq!(fm.topk(&h, &f32_keys(&k), n, 50).unwrap(), base, "both x 2^{p}");
        let s = reference::chunk_scores(&ckpt, Ensemble::Max, &h, &Keys::f32(&k, 8).unwrap()).unwrap();
        let a3 = (a as f64).powi(3);
        assert!(s.iter().zip(&base_scores).all(|(x, b)| *x == b * a3), "scores x 2^{}", 3 * p);
    }
    for a in [1e30f32, 1e-30] {
        let h: Vec<f32> = hidden.iter().map(|v| v * a).collect();
        let k: Vec<f32> = keys.iter().map(|v| v * a).collect();
        let s = reference::chunk_scores(&ckpt, Ensemble::Mean, &h, &Keys::f32(&k, 8).unwrap()).unwrap();
        assert!(s.iter().all(|v| v.is_finite()), "a = {a}");
        assert!(s.iter().any(|v| *v != 0.0), "a = {a}: every score underflowed");
        // The top-k follows the scores at these magnitudes too (the
        // checkpoint's ensemble is max).
        let s_max = reference::chunk_scores(&ckpt, Ensemble::Max, &h, &Keys::f32(&k, 8).unwrap()).unwrap();
        assert_eq!(fm.topk(&h, &f32_keys(&k), n, 50).unwrap(), spec_topk(&s_max, 50), "a = {a}");
    }
    // The largest finite f32 everywhere still gives finite scores.
    let big_h = vec![f32::MAX; 3 * 16];
    let big_k = vec![f32::MAX; n * 8];
    let s = reference::chunk_scores(&ckpt, Ensemble::Max, &big_h, &Keys::f32(&big_k, 8).unwrap()).unwrap();
    assert!(s.iter().all(|v| v.is_finite()));
}

#[test]
fn nan_and_inf_inputs_are_errors() {
    let mut rng = Rng::fresh("nan_and_inf_inputs_are_errors");
    let (fm, _, _) = random_scorer(&mut rng, "nan", 2, 16, 2, 4);
    let n = 10;
    let hidden = rng.normals(2 * 16);
    let keys = rng.normals(n * 4);
    for (pos, v, words) in [(16 + 5, f32::NAN, "scorer 1, position 5 is NaN"), (3, f32::INFINITY, "scorer 0, position 3 is inf")] {
        let mut h = hidden.clone();
        h[pos] = v;
        let (s, msg) = fm.topk(&h, &f32_keys(&keys), n, 4).unwrap_err();
        assert_eq!(s, KvswapStatus::InvalidArgument);
        assert!(msg.starts_with("fm_score_topk: hidden: ") && msg.contains(words), "{msg}");
    }
    let mut k = keys.clone();
    k[3 * 4 + 1] = f32::NEG_INFINITY;
    let (s, msg) = fm.topk(&hidden, &f32_keys(&k), n, 4).unwrap_err();
    assert_eq!(s, KvswapStatus::InvalidArgument);
    assert!(msg.contains("chunk 3, element 1 is -inf"), "{msg}");

    let mut k16: Vec<bf16> = keys.iter().map(|&v| bf16::from_f32(v)).collect();
    k16[9] = bf16::NAN;
    let (_, msg) = fm.topk(&hidden, &bf16_keys(&k16), n, 4).unwrap_err();
    assert!(msg.contains("chunk 2, element 1 is NaN (bf16 key)"), "{msg}");

    let mut k8 = vec![0x38u8; n * 4];
    let scales = vec![0.5f32; n];
    k8[7] = 0x7f; // S.1111.111
    let (_, msg) = fm.topk(&hidden, &fp8_keys(&k8, &scales), n, 4).unwrap_err();
    assert!(msg.contains("chunk 1, element 3 is NaN (fp8_e4m3 key)"), "{msg}");
    k8[7] = 0xff;
    assert!(fm.topk(&hidden, &fp8_keys(&k8, &scales), n, 4).is_err());
    k8[7] = 0x7e; // 448: a number
    assert!(fm.topk(&hidden, &fp8_keys(&k8, &scales), n, 4).is_ok());
    let mut bad_scales = scales.clone();
    bad_scales[6] = f32::NAN;
    let (_, msg) = fm.topk(&hidden, &fp8_keys(&k8, &bad_scales), n, 4).unwrap_err();
    assert!(msg.contains("scale of chunk 6 is NaN"), "{msg}");
}

#[test]
fn argument_errors() {
    let mut rng = Rng::fresh("argument_errors");
    let (fm, _, _) = random_scorer(&mut rng, "args", 1, 8, 2, 4);
    let hidden = rng.normals(8);
    let keys = rng.normals(16 * 4);
    let fk = f32_keys(&keys);
    let check = |r: Result<Vec<i32>, (KvswapStatus, String)>, status: KvswapStatus, words: &str| {
        let (s, msg) = r.unwrap_err();
        assert_eq!(s, status, "{msg}");
        assert!(msg.contains(words), "{words:?} not in {msg:?}");
    };
    check(fm.topk(&hidden, &fk, 16, 0), KvswapStatus::InvalidArgument, "k is 0");
    check(fm.topk(&hidden, &fk, 16, 2049), KvswapStatus::OutOfRange, "k = 2049 is above the limit FM_MAX_TOPK = 2048");
    check(fm.topk(&hidden, &fk, 0, 4), KvswapStatus::InvalidArgument, "n_chunks is 0");
    // Checked before anything is read: the small buffer is never touched.
    check(fm.topk(&hidden, &fk, 4_194_305, 4), KvswapStatus::OutOfRange, "FM_MAX_CHUNKS = 4194304");
    let mut bad = fk;
    bad.dtype = 9;
    check(fm.topk(&hidden, &bad, 16, 4), KvswapStatus::InvalidArgument, "keys.dtype = 9");
    let mut bad = fk;
    bad.row_stride_bytes = 12;
    check(fm.topk(&hidden, &bad, 16, 4), KvswapStatus::InvalidArgument, "row_stride_bytes = 12");
    // Rows spanning more than an object can (isize::MAX bytes): refused, not
    // sliced (a slice that large is undefined behaviour).
    bad.row_stride_bytes = 1 << 63;
    check(fm.topk(&hidden, &bad, 2, 1), KvswapStatus::InvalidArgument, "overflow the address space");
    let mut bad = fk;
    bad.row_stride_bytes = 18;
    check(fm.topk(&hidden, &bad, 4, 4), KvswapStatus::InvalidArgument, "multiple of 4");
    let mut bad = fk;
    bad.data = null();
    check(fm.topk(&hidden, &bad, 16, 4), KvswapStatus::NullPointer, "keys.data");
    let fp8 = vec![0x38u8; 16 * 4];
    let mut no_scales = fp8_keys(&fp8, &[]);
    no_scales.scales = null();
    check(fm.topk(&hidden, &no_scales, 16, 4), KvswapStatus::NullPointer, "keys.scales");
    let misaligned = unsafe { hidden.as_ptr().cast::<u8>().add(1).cast::<f32>() };
    let mut out = [0i32; 4];
    let s = fm_score_topk(fm.0, misaligned, &fk, 16, 4, out.as_mut_ptr(), null_mut());
    assert_eq!(s, KvswapStatus::InvalidArgument);
    assert!(last_error().contains("4-byte aligned"), "{}", last_error());
    assert_eq!(fm_score_topk(null(), hidden.as_ptr(), &fk, 16, 4, out.as_mut_ptr(), null_mut()), KvswapStatus::NullPointer);
    assert_eq!(fm_score_topk(fm.0, null(), &fk, 16, 4, out.as_mut_ptr(), null_mut()), KvswapStatus::NullPointer);
    assert_eq!(fm_score_topk(fm.0, hidden.as_ptr(), null(), 16, 4, out.as_mut_ptr(), null_mut()), KvswapStatus::NullPointer);
    assert_eq!(fm_score_topk(fm.0, hidden.as_ptr(), &fk, 16, 4, null_mut(), null_mut()), KvswapStatus::NullPointer);
    let mut info = FmScorerInfo::default();
    assert_eq!(fm_scorer_info(null(), &mut info), KvswapStatus::NullPointer);
    assert_eq!(fm_scorer_info(fm.0, null_mut()), KvswapStatus::NullPointer);
    assert_eq!(fm_score_topk_batch(fm.0, 1, null(), 4, null_mut()), KvswapStatus::NullPointer);
    let seq = FmSeq { hidden: hidden.as_ptr(), keys: fk, n_chunks: 16, out_indices: out.as_mut_ptr() };
    assert_eq!(fm_score_topk_batch(fm.0, 0, &seq, 4, null_mut()), KvswapStatus::InvalidArgument);
    assert_eq!(fm_score_topk_batch(fm.0, 4097, &seq, 4, null_mut()), KvswapStatus::OutOfRange);
}

// ------------------------------------------------------------ key types

/// bf16 and fp8 keys give exactly the results of f32 keys holding their
/// decoded values (fp8 scales with few mantissa bits keep fp8 x scale exact
/// in f32); strided rows are read without their padding.
#[test]
fn bf16_and_fp8_keys_match_exact_f32_keys() {
    let mut rng = Rng::fresh("bf16_and_fp8_keys_match_exact_f32_keys");
    let (fm, _, path) = random_scorer(&mut rng, "keytypes", 3, 32, 4, 16);
    let ckpt = Checkpoint::load(&path).unwrap();
    let n = 1 + rng.below(400) as usize;
    let dim = 16;
    let hidden = rng.normals(3 * 32);

    let k16: Vec<bf16> = rng.normals(n * dim).iter().map(|&v| bf16::from_f32(v)).collect();
    let k16_as_f32: Vec<f32> = k16.iter().map(|v| v.to_f32()).collect();
    let want = fm.topk(&hidden, &f32_keys(&k16_as_f32), n, 64).unwrap();
    assert_eq!(fm.topk(&hidden, &bf16_keys(&k16), n, 64).unwrap(), want);
    let s_f32 = reference::chunk_scores(&ckpt, Ensemble::Max, &hidden, &Keys::f32(&k16_as_f32, dim).unwrap()).unwrap();
    let s_b16 = reference::chunk_scores(&ckpt, Ensemble::Max, &hidden, &Keys::bf16(&k16, dim).unwrap()).unwrap();
    assert_eq!(s_f32, s_b16);

    let k8: Vec<u8> = (0..n * dim)
        .map(|_| loop {
            let b = rng.below(256) as u8;
            if b & 0x7f != 0x7f && b & 0x7f != 0 {
                break b;
            }
        })
        .collect();
    // scale = (1 + m/4) * 2^e: at most 3 significant bits.
    let scales: Vec<f32> = (0..n).map(|_| (1.0 + rng.below(4) as f32 / 4.0) * 2f32.powi(rng.below(21) as i32 - 10)).collect();
    let k8_as_f32: Vec<f32> = (0..n * dim).map(|i| fp8_e4m3_to_f32(k8[i]) * scales[i / dim]).collect();
    for (i, v) in k8_as_f32.iter().enumerate() {
        assert_eq!(*v as f64, fp8_e4m3_to_f32(k8[i]) as f64 * scales[i / dim] as f64, "exact product");
    }
    // The wide query: fp8 keys score as f32 keys of their values.
    assert_eq!(fm_scorer_set_query(fm.0, KVSWAP_FM_QUERY_WIDE), KvswapStatus::Ok);
    let want = fm.topk(&hidden, &f32_keys(&k8_as_f32), n, 64).unwrap();
    assert_eq!(fm.topk(&hidden, &fp8_keys(&k8, &scales), n, 64).unwrap(), want);
    let wide = ScoreMode { ensemble: Ensemble::Mean, fp8_query: false };
    let s_fp8 = reference::chunk_scores(&ckpt, wide, &hidden, &Keys::fp8(&k8, &scales, dim).unwrap()).unwrap();
    let s_ref = reference::chunk_scores(&ckpt, Ensemble::Mean, &hidden, &Keys::f32(&k8_as_f32, dim).unwrap()).unwrap();
    assert_eq!(s_fp8, s_ref);
    // The fp8 query (the default): as f32 keys of their values scored with
    // the quantized q, through the C ABI too.
    assert_eq!(fm_scorer_set_query(fm.0, KVSWAP_FM_QUERY_AUTO), KvswapStatus::Ok);
    let projs: Vec<_> = reference::project_batch(&ckpt, &[&hidden]).remove(0).iter().map(|p| reference::fp8_query(p, dim)).collect();
    let s_q8 = reference::ensemble_scores(&projs, &Keys::f32(&k8_as_f32, dim).unwrap(), Ensemble::Mean).unwrap();
    assert_eq!(reference::chunk_scores(&ckpt, Ensemble::Mean, &hidden, &Keys::fp8(&k8, &scales, dim).unwrap()).unwrap(), s_q8);
    assert_ne!(s_q8, s_ref, "the fp8 query changes the scores");
    let s_q8_max = reference::ensemble_scores(&projs, &Keys::f32(&k8_as_f32, dim).unwrap(), ckpt.meta().ensemble).unwrap();
    assert_eq!(fm.topk(&hidden, &fp8_keys(&k8, &scales), n, 64).unwrap(), kvswap::scorer::topk::topk(&s_q8_max, 64));

    // Strided bf16 rows whose padding holds NaN: the padding is never read.
    let stride = dim + 8;
    let mut padded = vec![bf16::NAN; n * stride];
    for c in 0..n {
        padded[c * stride..c * stride + dim].copy_from_slice(&k16[c * dim..(c + 1) * dim]);
    }
    let mut keys = bf16_keys(&padded);
    keys.row_stride_bytes = stride * 2;
    let want = fm.topk(&hidden, &bf16_keys(&k16), n, 64).unwrap();
    assert_eq!(fm.topk(&hidden, &keys, n, 64).unwrap(), want);
}

// ------------------------------------------------------------ batches

#[test]
fn batch_equals_single_calls() {
    let mut rng = Rng::fresh("batch_equals_single_calls");
    let (fm, _, _) = random_scorer(&mut rng, "batch", 3, 24, 4, 8);
    // 2 to 8 sequences (the overlap check below needs two), and a batch of
    // one after the first comparison.
    let b = 2 + rng.below(7) as usize;
    let k = 1 + rng.below(40) as u32;
    struct Seq {
        hidden: Vec<f32>,
        f32: Vec<f32>,
        bf16: Vec<bf16>,
        fp8: Vec<u8>,
        scales: Vec<f32>,
        n: usize,
        kind: u64,
    }
    let seqs: Vec<Seq> = (0..b)
        .map(|_| {
            let n = 1 + rng.below(200) as usize;
            Seq {
                hidden: rng.normals(3 * 24),
                f32: rng.normals(n * 8),
                bf16: rng.normals(n * 8).iter().map(|&v| bf16::from_f32(v)).collect(),
                fp8: (0..n * 8).map(|_| (rng.below(0x7e) as u8 + 1) | if rng.chance(0.5) { 0x80 } else { 0 }).collect(),
                scales: (0..n).map(|_| 0.25 + rng.unit() as f32).collect(),
                n,
                kind: rng.below(3),
            }
        })
        .collect();
    let keys_of = |s: &Seq| match s.kind {
        0 => f32_keys(&s.f32),
        1 => bf16_keys(&s.bf16),
        _ => fp8_keys(&s.fp8, &s.scales),
    };
    let singles: Vec<Vec<i32>> = seqs.iter().map(|s| fm.topk(&s.hidden, &keys_of(s), s.n, k).unwrap()).collect();
    let mut outs = vec![vec![i32::MIN; k as usize]; b];
    let c_seqs: Vec<FmSeq> = seqs
        .iter()
        .zip(outs.iter_mut())
        .map(|(s, o)| FmSeq { hidden: s.hidden.as_ptr(), keys: keys_of(s), n_chunks: s.n, out_indices: o.as_mut_ptr() })
        .collect();
    assert_eq!(fm_score_topk_batch(fm.0, b, c_seqs.as_ptr(), k, null_mut()), KvswapStatus::Ok, "{}", last_error());
    assert_eq!(outs, singles);
    // A batch of one sequence (the last) is its single call too.
    let mut one = vec![i32::MIN; k as usize];
    let s1 = &seqs[b - 1];
    let c1 = [FmSeq { hidden: s1.hidden.as_ptr(), keys: keys_of(s1), n_chunks: s1.n, out_indices: one.as_mut_ptr() }];
    assert_eq!(fm_score_topk_batch(fm.0, 1, c1.as_ptr(), k, null_mut()), KvswapStatus::Ok, "{}", last_error());
    assert_eq!(one, singles[b - 1]);

    // One bad sequence: the error names it and no output is written.
    let mut bad_hidden = seqs[b - 1].hidden.clone();
    bad_hidden[24 + 2] = f32::NAN;
    let mut outs = vec![vec![i32::MIN; k as usize]; b];
    let mut c_seqs: Vec<FmSeq> = seqs
        .iter()
        .zip(outs.iter_mut())
        .map(|(s, o)| FmSeq { hidden: s.hidden.as_ptr(), keys: keys_of(s), n_chunks: s.n, out_indices: o.as_mut_ptr() })
        .collect();
    c_seqs[b - 1].hidden = bad_hidden.as_ptr();
    assert_eq!(fm_score_topk_batch(fm.0, b, c_seqs.as_ptr(), k, null_mut()), KvswapStatus::InvalidArgument);
    assert!(last_error().contains(&format!("seqs[{}]: hidden: scorer 1, position 2 is NaN", b - 1)), "{}", last_error());
    assert!(outs.iter().flatten().all(|&v| v == i32::MIN));
    c_seqs[b - 1].hidden = seqs[b - 1].hidden.as_ptr();
    c_seqs[0].n_chunks = 0;
    assert_eq!(fm_score_topk_batch(fm.0, b, c_seqs.as_ptr(), k, null_mut()), KvswapStatus::InvalidArgument);
    assert!(last_error().contains("seqs[0].n_chunks is 0"), "{}", last_error());
    // Two sequences writing overlapping outputs (the last one writes into
    // the first one's buffer, one element in; with k = 1 the same element,
    // as one element in would merely touch it): refused, nothing written.
    c_seqs[0].n_chunks = seqs[0].n;
    c_seqs[b - 1].out_indices = c_seqs[0].out_indices.wrapping_add((k > 1) as usize);
    assert_eq!(fm_score_topk_batch(fm.0, b, c_seqs.as_ptr(), k, null_mut()), KvswapStatus::InvalidArgument);
    let e = last_error();
    assert!(e.contains("seqs[0].out_indices") && e.contains(&format!("seqs[{}].out_indices", b - 1)) && e.contains("overlap"), "{e}");
    assert!(outs.iter().flatten().all(|&v| v == i32::MIN));
}

#[test]
fn one_scorer_many_threads() {
    let mut rng = Rng::fresh("one_scorer_many_threads");
    let (fm, _, _) = random_scorer(&mut rng, "threads", 2, 16, 2, 8);
    let hidden = rng.normals(2 * 16);
    let keys = rng.normals(300 * 8);
    let want = fm.topk(&hidden, &f32_keys(&keys), 300, 32).unwrap();
    let handle = fm.0 as usize;
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| {
                let fm = handle as *const FmScorer;
                for _ in 0..10 {
                    let mut out = vec![0i32; 32];
                    let st = fm_score_topk(fm, hidden.as_ptr(), &f32_keys(&keys), 300, 32, out.as_mut_ptr(), null_mut());
                    assert_eq!(st, KvswapStatus::Ok);
                    assert_eq!(out, want);
                }
            });
        }
    });
}

// ------------------------------------------------------------ key bounds

/// fm_bounds_build + fm_bounds_topk against a brute force written here:
/// per-chunk min/max of the keys, the bound score, and its order. The bound
/// is never below any key's dot product with the query.
#[test]
fn bounds_scorer_matches_brute_force() {
    let mut rng = Rng::fresh("bounds_scorer_matches_brute_force");
    for _ in 0..10 {
        let dim = 1 + rng.below(24) as usize;
        let chunk_tokens = 1 + rng.below(9) as usize;
        let n_tokens = 1 + rng.below(600) as usize;
        let n_chunks = n_tokens.div_ceil(chunk_tokens);
        let k = 1 + rng.below(80) as u32;
        let keys = rng.normals(n_tokens * dim);
        let query = rng.normals(dim);

        let (mut lo, mut hi) = (vec![0f32; n_chunks * dim], vec![0f32; n_chunks * dim]);
        let s = fm_bounds_build(&f32_keys(&keys), n_tokens, dim as u32, chunk_tokens as u32, lo.as_mut_ptr(), hi.as_mut_ptr());
        assert_eq!(s, KvswapStatus::Ok, "{}", last_error());

        let mut brute = vec![0f64; n_chunks];
        for c in 0..n_chunks {
            let tokens = c * chunk_tokens..((c + 1) * chunk_tokens).min(n_tokens);
            for d in 0..dim {
                let col = tokens.clone().map(|t| keys[t * dim + d]);
                let (mn, mx) = (col.clone().fold(f32::INFINITY, f32::min), col.fold(f32::NEG_INFINITY, f32::max));
                assert_eq!((lo[c * dim + d], hi[c * dim + d]), (mn, mx), "bounds of chunk {c}, element {d}");
                brute[c] += (query[d] as f64 * mn as f64).max(query[d] as f64 * mx as f64);
            }
            for t in tokens {
                let dot: f64 = (0..dim).map(|d| query[d] as f64 * keys[t * dim + d] as f64).sum();
                assert!(brute[c] >= dot - 1e-9 * dot.abs().max(1.0), "bound below a key of chunk {c}");
            }
        }
        let mut out = vec![i32::MIN; k as usize];
        let s = fm_bounds_topk(-1, query.as_ptr(), lo.as_ptr(), hi.as_ptr(), dim as u32, n_chunks, k, out.as_mut_ptr(), null_mut());
        assert_eq!(s, KvswapStatus::Ok, "{}", last_error());
        assert_eq!(out, spec_topk(&brute, k as usize));
    }
}

#[test]
fn bounds_from_bf16_and_fp8_keys() {
    let mut rng = Rng::fresh("bounds_from_bf16_and_fp8_keys");
    let (dim, n_tokens, chunk) = (8usize, 50usize, 4u32);
    let n_chunks = n_tokens.div_ceil(chunk as usize);
    let build = |keys: &FmKeys| {
        let (mut lo, mut hi) = (vec![0f32; n_chunks * dim], vec![0f32; n_chunks * dim]);
        let s = fm_bounds_build(keys, n_tokens, dim as u32, chunk, lo.as_mut_ptr(), hi.as_mut_ptr());
        assert_eq!(s, KvswapStatus::Ok, "{}", last_error());
        (lo, hi)
    };
    let k16: Vec<bf16> = rng.normals(n_tokens * dim).iter().map(|&v| bf16::from_f32(v)).collect();
    let k16_f32: Vec<f32> = k16.iter().map(|v| v.to_f32()).collect();
    assert_eq!(build(&bf16_keys(&k16)), build(&f32_keys(&k16_f32)));

    // fp8 with scales that make inexact products: bounds hold every key.
    let k8: Vec<u8> = (0..n_tokens * dim).map(|_| rng.below(0x7e) as u8 + 1 + if rng.chance(0.5) { 0x80 } else { 0 }).collect();
    let scales: Vec<f32> = (0..n_tokens).map(|_| 0.1 + rng.unit() as f32).collect();
    let (lo, hi) = build(&fp8_keys(&k8, &scales));
    for t in 0..n_tokens {
        for d in 0..dim {
            let v = fp8_e4m3_to_f32(k8[t * dim + d]) as f64 * scales[t] as f64;
            let c = t / chunk as usize;
            assert!(lo[c * dim + d] as f64 <= v && v <= hi[c * dim + d] as f64, "token {t}, element {d}");
        }
    }

    // Errors: NaN key names the token; zero sizes; NULL outputs.
    let mut bad = k16_f32.clone();
    bad[3 * dim + 2] = f32::NAN;
    let (mut lo, mut hi) = (vec![0f32; n_chunks * dim], vec![0f32; n_chunks * dim]);
    let s = fm_bounds_build(&f32_keys(&bad), n_tokens, dim as u32, chunk, lo.as_mut_ptr(), hi.as_mut_ptr());
    assert_eq!(s, KvswapStatus::InvalidArgument);
    assert!(last_error().contains("token 3, element 2 is NaN"), "{}", last_error());
    assert!(lo.iter().chain(&hi).all(|&v| v == 0.0), "outputs written on failure");
    let s = fm_bounds_build(&f32_keys(&bad), n_tokens, dim as u32, 0, lo.as_mut_ptr(), hi.as_mut_ptr());
    assert_eq!(s, KvswapStatus::InvalidArgument);
    let s = fm_bounds_build(&f32_keys(&bad), n_tokens, dim as u32, chunk, null_mut(), hi.as_mut_ptr());
    assert_eq!(s, KvswapStatus::NullPointer);

    // fp8 x scale beyond f32 (448 x 1e37): no finite f32 bound holds it.
    let (mut lo2, mut hi2) = ([0f32; 2], [0f32; 2]);
    let s = fm_bounds_build(&fp8_keys(&[0x7e, 0xfe], &[1e37]), 1, 2, 1, lo2.as_mut_ptr(), hi2.as_mut_ptr());
    assert_eq!(s, KvswapStatus::InvalidArgument, "{}", last_error());
    assert!(last_error().contains("token 0 element 0") && last_error().contains("outside the f32 range"), "{}", last_error());
    assert_eq!((lo2, hi2), ([0f32; 2], [0f32; 2]), "outputs written on failure");
    // More chunks than FM_MAX_CHUNKS: refused from the sizes, before any
    // key (only n_tokens rows' worth of address space is checked) is read.
    let s = fm_bounds_build(&f32_keys(&k16_f32), (1 << 22) + 1, 1, 1, lo.as_mut_ptr(), hi.as_mut_ptr());
    assert_eq!(s, KvswapStatus::OutOfRange, "{}", last_error());
    assert!(last_error().contains("n_chunks = 4194305"), "{}", last_error());
    // The two outputs overlapping (here the same buffer).
    let s = fm_bounds_build(&f32_keys(&k16_f32), n_tokens, dim as u32, chunk, lo.as_mut_ptr(), lo.as_mut_ptr());
    assert_eq!(s, KvswapStatus::InvalidArgument);
    assert!(last_error().contains("overlap"), "{}", last_error());
    let s = fm_bounds_build(&f32_keys(&k16_f32), n_tokens, dim as u32, chunk, lo.as_mut_ptr(), lo[dim..].as_mut_ptr());
    assert_eq!(s, KvswapStatus::InvalidArgument);
    assert!(lo.iter().chain(&hi).all(|&v| v == 0.0), "outputs written on failure");
}

/// fm_bounds_sync on a device checks the device and the stream even before
/// any asynchronous bounds call: never OK for the legacy stream (without a
/// CUDA driver: NO_DEVICE, as fm_bounds_topk says).
#[test]
fn bounds_sync_checks_its_arguments() {
    let s = fm_bounds_sync(0, null_mut());
    assert!(matches!(s, KvswapStatus::NoDevice | KvswapStatus::InvalidArgument), "{s:?}: {}", last_error());
    assert_eq!(fm_bounds_sync(-2, null_mut()), KvswapStatus::InvalidArgument);
    assert_eq!(fm_bounds_sync(-1, null_mut()), KvswapStatus::Ok);
}

#[test]
fn bounds_argument_errors() {
    let mut rng = Rng::fresh("bounds_argument_errors");
    let q = rng.normals(4);
    let lo = rng.normals(8).iter().map(|v| v - 3.0).collect::<Vec<f32>>();
    let hi = rng.normals(8).iter().map(|v| v + 3.0).collect::<Vec<f32>>();
    let mut out = [0i32; 2];
    let call = |device: i32, q: &[f32], lo: &[f32], dim: u32, n: usize, k: u32, out: &mut [i32]| {
        fm_bounds_topk(device, q.as_ptr(), lo.as_ptr(), hi.as_ptr(), dim, n, k, out.as_mut_ptr(), null_mut())
    };
    assert_eq!(call(-1, &q, &lo, 4, 2, 2, &mut out), KvswapStatus::Ok);
    assert_eq!(call(0, &q, &lo, 4, 2, 2, &mut out), KvswapStatus::NoDevice);
    assert_eq!(call(-3, &q, &lo, 4, 2, 2, &mut out), KvswapStatus::InvalidArgument);
    assert_eq!(call(-1, &q, &lo, 0, 2, 2, &mut out), KvswapStatus::InvalidArgument);
    assert_eq!(call(-1, &q, &lo, 4, 0, 2, &mut out), KvswapStatus::InvalidArgument);
    assert_eq!(call(-1, &q, &lo, 4, 2, 0, &mut out), KvswapStatus::InvalidArgument);
    assert_eq!(call(-1, &q, &lo, 4, 2, 2049, &mut out), KvswapStatus::OutOfRange);
    let mut nan_q = q.clone();
    nan_q[1] = f32::NAN;
    assert_eq!(call(-1, &nan_q, &lo, 4, 2, 2, &mut out), KvswapStatus::InvalidArgument);
    assert!(last_error().contains("query: element 1 is NaN"), "{}", last_error());
    let swapped: Vec<f32> = hi.iter().map(|v| v + 10.0).collect();
    assert_eq!(call(-1, &q, &swapped, 4, 2, 2, &mut out), KvswapStatus::InvalidArgument);
    assert!(last_error().contains("bounds_min") && last_error().contains("> bounds_max"), "{}", last_error());
    let s = fm_bounds_topk(-1, q.as_ptr(), null(), hi.as_ptr(), 4, 2, 2, out.as_mut_ptr(), null_mut());
    assert_eq!(s, KvswapStatus::NullPointer);
}
