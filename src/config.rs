//! Settings: the C-visible [`KvswapConfig`] struct, its validated Rust twin
//! [`Config`], and loading from `KVSWAP_*` environment variables (with the
//! original engine's `POCKETLLM_GGUF_*` names accepted as aliases).

use crate::error::{Error, KvswapStatus, Result};
use crate::layer::ID_COUNT_MAX;
use std::ffi::{c_char, CStr};
use std::path::PathBuf;

/// Longest checkpoint path (including the terminating NUL) a `KvswapConfig` holds.
pub const KVSWAP_PATH_MAX: usize = 4096;

/// Which backend a context uses (`KVSWAP_BACKEND`).
pub type KvswapBackendKind = u32;
/// CUDA when the driver reports a device, else the CPU backend (no driver,
/// or no device: one info log line says so). Where the driver reports
/// devices there is no fall back: a CUDA backend that cannot start there is
/// an error (a `device` the driver does not have, or no NVRTC:
/// `KVSWAP_STATUS_NO_DEVICE`; a driver older than CUDA 12.3, or of an older
/// CUDA major version than NVRTC: `KVSWAP_STATUS_UNSUPPORTED`), and so are
/// errors after the backend started (memory, limits). The CPU backend reads
/// every pointer as host memory: an engine passing device pointers sets
/// `KVSWAP_BACKEND_CUDA`, or checks `kvswap_context_info` after creating.
/// (Where a CUDA driver is installed, the CPU backend and the CPU scorers
/// refuse device memory the driver identifies, with
/// `KVSWAP_STATUS_INVALID_ARGUMENT`, instead of reading it.)
pub const KVSWAP_BACKEND_AUTO: KvswapBackendKind = 0;
/// Host memory plays the device: the reference backend, runs everywhere.
pub const KVSWAP_BACKEND_CPU: KvswapBackendKind = 1;
/// CUDA through the driver API, loaded at run time.
pub const KVSWAP_BACKEND_CUDA: KvswapBackendKind = 2;

/// How the FlashMemory scorers are combined (`KVSWAP_FM_ENSEMBLE`).
pub type KvswapEnsemble = u32;
/// Ensemble score is the maximum over scorers.
pub const KVSWAP_ENSEMBLE_MAX: KvswapEnsemble = 0;
/// Ensemble score is the mean over scorers.
pub const KVSWAP_ENSEMBLE_MEAN: KvswapEnsemble = 1;

/// Every setting of a kvswap context. Fill it with `kvswap_config_default()`
/// or `kvswap_config_from_env()`, then change fields as needed. Flags are
/// 0 or 1.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct KvswapConfig {
    /// Swap on (1) or off (0, every chunk stays resident). `KVSWAP_ENABLE`, default 0.
    pub enable: u32,
    /// Staging slots per layer on the device. `KVSWAP_GPU_CHUNKS`, default 512.
    pub gpu_chunks: u32,
    /// Cap on the pinned host tier of all layers, in MiB. `KVSWAP_PINNED_MIB`, default 16384.
    pub pinned_mib: u64,
    /// 1: errors are returned by the call itself; 0: no host wait, errors are
    /// returned by the next synchronising call. `KVSWAP_SYNC`, default 1.
    pub sync: u32,
    /// Check every staged chunk against its host copy. `KVSWAP_VALIDATE`, default 0.
    pub validate: u32,
    /// Allow `gpu_chunks < index_topk` (tests only). `KVSWAP_TEST_ALLOW_TOPK_REDUCTION`, default 0.
    /// kvswap does not cut the top-k itself: a swap-in still takes at most
    /// `gpu_chunks` selected ids (more is `KVSWAP_STATUS_OUT_OF_RANGE`), so
    /// the engine passes the first `gpu_chunks` of its descending top-k.
    pub test_allow_topk_reduction: u32,
    /// k of the global top-k, 1 to 2^30 - 1. `KVSWAP_INDEX_TOPK`, default 512.
    pub index_topk: u32,
    /// Sliding-window tokens read besides the selected chunks. `KVSWAP_WINDOW`, default 128.
    /// `kvswap_create` checks that `window` + a layer's slots stay below 2^30
    /// (physical ids fit an int32) and logs it; each swap-in's `window_len` is
    /// that call's own and is not compared with it.
    pub window: u32,
    /// `KVSWAP_ENSEMBLE_MAX` or `KVSWAP_ENSEMBLE_MEAN`. `KVSWAP_FM_ENSEMBLE`,
    /// default max. `fm_scorer_load` applies the variable itself when it is
    /// set (the checkpoint's ensemble otherwise): pass this field to
    /// `fm_scorer_set_ensemble` only to override a loaded scorer.
    pub fm_ensemble: KvswapEnsemble,
    /// Log memory per stage (`kvswap_mem stage=create` / `destroy` for the
    /// context; `fm_scorer_load` reads the variable itself for its
    /// `scorer_load` / `scorer_free` lines). `KVSWAP_MEM_PROFILE`, default 0.
    pub mem_profile: u32,
    /// `KVSWAP_BACKEND_AUTO`, `_CPU` or `_CUDA`. `KVSWAP_BACKEND`, default auto.
    pub backend: KvswapBackendKind,
    /// CUDA device ordinal (>= 0) the context binds to. `KVSWAP_DEVICE`,
    /// default 0. The CPU backend ignores it and also accepts -1 (the CPU's
    /// number in `KvswapContextInfo` and `fm_scorer_load`); -1 with another
    /// backend, or below -1, is `KVSWAP_STATUS_INVALID_ARGUMENT`.
    pub device: i32,
    /// Scorer checkpoint path, NUL-terminated, empty for none. `KVSWAP_FM_CKPT`.
    pub fm_ckpt: [c_char; KVSWAP_PATH_MAX],
}

/// Backend choice, validated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendChoice {
    Auto,
    Cpu,
    Cuda,
}

/// Scorer ensemble, validated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ensemble {
    Max,
    Mean,
}

/// The validated settings the library works with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    pub enable: bool,
    pub gpu_chunks: u32,
    pub pinned_mib: u64,
    pub sync: bool,
    pub validate: bool,
    pub test_allow_topk_reduction: bool,
    pub index_topk: u32,
    pub window: u32,
    pub fm_ensemble: Ensemble,
    pub mem_profile: bool,
    pub backend: BackendChoice,
    pub device: i32,
    pub fm_ckpt: Option<PathBuf>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            enable: false,
            gpu_chunks: 512,
            pinned_mib: 16384,
            sync: true,
            validate: false,
            test_allow_topk_reduction: false,
            index_topk: 512,
            window: 128,
            fm_ensemble: Ensemble::Max,
            mem_profile: false,
            backend: BackendChoice::Auto,
            device: 0,
            fm_ckpt: None,
        }
    }
}

/// One environment setting: the kvswap name, the original engine's alias.
struct Var {
    name: &'static str,
    alias: Option<&'static str>,
}

const VARS: &[Var] = &[
    Var { name: "KVSWAP_ENABLE", alias: Some("POCKETLLM_GGUF_KV_SWAP") },
    Var { name: "KVSWAP_GPU_CHUNKS", alias: Some("POCKETLLM_GGUF_KV_SWAP_GPU_CHUNKS") },
    Var { name: "KVSWAP_PINNED_MIB", alias: Some("POCKETLLM_GGUF_KV_SWAP_PINNED_MIB") },
    Var { name: "KVSWAP_SYNC", alias: Some("POCKETLLM_GGUF_KV_SWAP_SYNC") },
    Var { name: "KVSWAP_VALIDATE", alias: Some("POCKETLLM_GGUF_KV_SWAP_VALIDATE") },
    Var {
        name: "KVSWAP_TEST_ALLOW_TOPK_REDUCTION",
        alias: Some("POCKETLLM_GGUF_KV_SWAP_TEST_ALLOW_TOPK_REDUCTION"),
    },
    Var { name: "KVSWAP_INDEX_TOPK", alias: None },
    Var { name: "KVSWAP_WINDOW", alias: None },
    Var { name: "KVSWAP_FM_CKPT", alias: Some("POCKETLLM_GGUF_FLASHMEMORY_CKPT") },
    Var { name: "KVSWAP_FM_ENSEMBLE", alias: Some("POCKETLLM_GGUF_FLASHMEMORY_ENSEMBLE") },
    Var { name: "KVSWAP_MEM_PROFILE", alias: Some("POCKETLLM_GGUF_MEM_PROFILE") },
    Var { name: "KVSWAP_BACKEND", alias: None },
    Var { name: "KVSWAP_DEVICE", alias: None },
];

/// Every environment variable kvswap reads, with its alias, for docs and `--help`.
pub fn env_names() -> impl Iterator<Item = (&'static str, Option<&'static str>)> {
    VARS.iter().map(|v| (v.name, v.alias))
}

fn bad(var: &str, value: &str, expected: &str) -> Error {
    Error::invalid(format!("{var}={} is not a valid value: expected {expected}", quoted(value)))
}

/// A setting's value in a message: quoted, a long one by its first 64
/// characters (a megabyte of digits would otherwise be quoted whole).
fn quoted(value: &str) -> String {
    if value.chars().nth(64).is_some() {
        format!("{:?}...", value.chars().take(64).collect::<String>())
    } else {
        format!("{value:?}")
    }
}

fn parse_bool(var: &str, v: &str) -> Result<bool> {
    match v.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "on" | "yes" => Ok(true),
        "0" | "false" | "off" | "no" => Ok(false),
        _ => Err(bad(var, v, "0 or 1 (also true/false, on/off, yes/no)")),
    }
}

fn parse_uint<T: TryFrom<u128>>(var: &str, v: &str, what: &str) -> Result<T> {
    let t = v.trim();
    if t.starts_with('-') {
        return Err(bad(var, v, &format!("{what}; negative values are refused")));
    }
    let n = t.parse::<u128>().map_err(|e| match e.kind() {
        std::num::IntErrorKind::PosOverflow => bad(var, v, &format!("{what}; this one is too large")),
        _ => bad(var, v, what),
    })?;
    T::try_from(n).map_err(|_| bad(var, v, &format!("{what}; this one is too large")))
}

/// A count that an int32 physical id must hold beside others: 1 ..= 2^30 - 1
/// (0 allowed when `zero_ok`), refused naming the variable actually set.
fn parse_count(var: &str, v: &str, what: &str, zero_ok: bool) -> Result<u32> {
    let n: u32 = parse_uint(var, v, what)?;
    if (n == 0 && !zero_ok) || n as u64 > ID_COUNT_MAX {
        return Err(bad(var, v, &format!("{what}, at most {ID_COUNT_MAX}")));
    }
    Ok(n)
}

impl Config {
    /// Defaults overridden by the process environment.
    pub fn from_env() -> Result<Config> {
        Self::from_os_lookup(|k| std::env::var_os(k))
    }

    /// The settings with only `name` (and its alias) read from the
    /// environment, and whether either is set to a non-blank value: for
    /// calls that need that one setting (the scorer), so a bad value of
    /// another variable does not fail them.
    fn one_from_env(name: &str) -> Result<(Config, bool)> {
        let var = VARS.iter().find(|v| v.name == name).expect("a setting of the table");
        let only = |k: &str| (k == var.name || Some(k) == var.alias).then(|| std::env::var_os(k)).flatten();
        let set = std::iter::once(var.name).chain(var.alias).any(|n| only(n).is_some_and(|v| v.to_str().is_none_or(|t| !t.trim().is_empty())));
        Ok((Self::from_os_lookup(only)?, set))
    }

    /// `KVSWAP_SYNC` (or its alias) alone, from the environment.
    pub fn sync_from_env() -> Result<bool> {
        Ok(Self::one_from_env("KVSWAP_SYNC")?.0.sync)
    }

    /// `KVSWAP_MEM_PROFILE` (or its alias) alone, from the environment.
    pub fn mem_profile_from_env() -> Result<bool> {
        Ok(Self::one_from_env("KVSWAP_MEM_PROFILE")?.0.mem_profile)
    }

    /// `KVSWAP_FM_ENSEMBLE` (or its alias) from the environment: None when
    /// neither is set (or both are blank), so that a scorer keeps its
    /// checkpoint's ensemble; a bad value is an error naming the variable.
    pub fn fm_ensemble_from_env() -> Result<Option<Ensemble>> {
        let (c, set) = Self::one_from_env("KVSWAP_FM_ENSEMBLE")?;
        Ok(set.then_some(c.fm_ensemble))
    }

    /// `from_lookup` over raw environment values: a value that is not UTF-8
    /// is refused, naming its variable (not taken as unset).
    pub fn from_os_lookup(lookup: impl Fn(&str) -> Option<std::ffi::OsString>) -> Result<Config> {
        for var in VARS {
            // The variable `from_lookup` reads: the kvswap name, else its alias.
            // A blank value counts as unset there, so it is skipped here too.
            let unset = |v: &std::ffi::OsString| v.to_str().is_some_and(|t| t.trim().is_empty());
            let used = std::iter::once(var.name).chain(var.alias).find_map(|n| lookup(n).filter(|v| !unset(v)).map(|v| (n, v)));
            if let Some((name, v)) = used {
                if v.to_str().is_none() {
                    return Err(bad(name, &v.to_string_lossy(), "UTF-8 text"));
                }
            }
        }
        Self::from_lookup(|k| lookup(k).and_then(|v| v.into_string().ok()))
    }

    /// Defaults overridden by `lookup(name)`; the kvswap name wins over its
    /// alias. A variable set to an empty (or blank) value counts as unset:
    /// `KVSWAP_SYNC=` keeps the default 1 instead of reading as 0.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Config> {
        let lookup = |name: &str| lookup(name).filter(|v| !v.trim().is_empty());
        let mut c = Config::default();
        for var in VARS {
            let (used, value) = match lookup(var.name) {
                Some(v) => {
                    // Both set, to different values: the kvswap name wins, said once.
                    if let Some((a, w)) = var.alias.and_then(|a| lookup(a).map(|w| (a, w))).filter(|(_, w)| w.trim() != v.trim()) {
                        log::warn!("kvswap: {}={} and {a}={} are both set: {} is used", var.name, quoted(&v), quoted(&w), var.name);
                    }
                    (var.name, v)
                }
                None => match var.alias.and_then(|a| lookup(a).map(|v| (a, v))) {
                    Some(p) => p,
                    None => continue,
                },
            };
            c.apply(var.name, used, &value)?;
        }
        c.validate()?;
        Ok(c)
    }

    fn apply(&mut self, canonical: &str, used: &str, v: &str) -> Result<()> {
        match canonical {
            "KVSWAP_ENABLE" => self.enable = parse_bool(used, v)?,
            "KVSWAP_GPU_CHUNKS" => self.gpu_chunks = parse_count(used, v, "a slot count >= 1", false)?,
            "KVSWAP_PINNED_MIB" => self.pinned_mib = parse_uint(used, v, "a size in MiB")?,
            "KVSWAP_SYNC" => self.sync = parse_bool(used, v)?,
            "KVSWAP_VALIDATE" => self.validate = parse_bool(used, v)?,
            "KVSWAP_TEST_ALLOW_TOPK_REDUCTION" => {
                self.test_allow_topk_reduction = parse_bool(used, v)?
            }
            "KVSWAP_INDEX_TOPK" => self.index_topk = parse_count(used, v, "a chunk count >= 1", false)?,
            "KVSWAP_WINDOW" => self.window = parse_count(used, v, "a token count", true)?,
            "KVSWAP_FM_CKPT" => {
                if v.len() >= KVSWAP_PATH_MAX || v.contains('\0') {
                    return Err(bad(used, &format!("{}...", v.chars().take(64).collect::<String>()), &format!(
                        "a path shorter than {KVSWAP_PATH_MAX} bytes (this one has {})",
                        v.len()
                    )));
                }
                self.fm_ckpt = if v.is_empty() { None } else { Some(PathBuf::from(v)) }
            }
            "KVSWAP_FM_ENSEMBLE" => {
                self.fm_ensemble = match v.trim().to_ascii_lowercase().as_str() {
                    "max" => Ensemble::Max,
                    "mean" => Ensemble::Mean,
                    _ => return Err(bad(used, v, "max or mean")),
                }
            }
            "KVSWAP_MEM_PROFILE" => self.mem_profile = parse_bool(used, v)?,
            "KVSWAP_BACKEND" => {
                self.backend = match v.trim().to_ascii_lowercase().as_str() {
                    "auto" | "" => BackendChoice::Auto,
                    "cpu" => BackendChoice::Cpu,
                    "cuda" => BackendChoice::Cuda,
                    _ => return Err(bad(used, v, "auto, cpu or cuda")),
                }
            }
            "KVSWAP_DEVICE" => self.device = parse_uint::<u16>(used, v, "a device ordinal")? as i32,
            _ => unreachable!("unknown setting {canonical}"),
        }
        Ok(())
    }

    /// Checks values that are wrong on their own (not the guards that need
    /// the layer specs, which `Context::new` applies).
    pub fn validate(&self) -> Result<()> {
        if self.gpu_chunks == 0 {
            return Err(Error::invalid("gpu_chunks must be >= 1 (KVSWAP_GPU_CHUNKS)"));
        }
        if self.gpu_chunks as u64 > ID_COUNT_MAX {
            return Err(Error::invalid(format!(
                "gpu_chunks={} is too large (KVSWAP_GPU_CHUNKS)",
                self.gpu_chunks
            )));
        }
        if self.index_topk == 0 {
            return Err(Error::invalid("index_topk must be >= 1 (KVSWAP_INDEX_TOPK)"));
        }
        if self.index_topk as u64 > ID_COUNT_MAX {
            return Err(Error::invalid(format!("index_topk={} is too large: at most {ID_COUNT_MAX} (KVSWAP_INDEX_TOPK)", self.index_topk)));
        }
        if self.window as u64 > ID_COUNT_MAX {
            return Err(Error::invalid(format!("window={} is too large (KVSWAP_WINDOW)", self.window)));
        }
        if let Some(p) = &self.fm_ckpt {
            if p.as_os_str().len() >= KVSWAP_PATH_MAX {
                return Err(Error::invalid(format!("fm_ckpt is {} bytes; the limit is {}", p.as_os_str().len(), KVSWAP_PATH_MAX - 1)));
            }
        }
        // -1 is the CPU's number elsewhere in the API (KvswapContextInfo,
        // fm_scorer_load): accepted with the CPU backend, which ignores the
        // field.
        if self.device == -1 && self.backend != BackendChoice::Cpu {
            return Err(Error::invalid(
                "device=-1 (the CPU) needs backend=KVSWAP_BACKEND_CPU (KVSWAP_BACKEND=cpu); a CUDA device is >= 0 (KVSWAP_DEVICE)",
            ));
        }
        if self.device < -1 {
            return Err(Error::invalid(format!("device={} must be >= 0, or -1 with the CPU backend (KVSWAP_DEVICE)", self.device)));
        }
        Ok(())
    }

    /// The guard of DESIGN: fewer slots than the top-k would drop selected chunks.
    pub fn check_topk_guard(&self) -> Result<()> {
        if self.enable && self.gpu_chunks < self.index_topk && !self.test_allow_topk_reduction {
            return Err(Error::new(
                KvswapStatus::TopkGuard,
                format!(
                    "gpu_chunks={} < index_topk={}: every selected chunk needs a slot; raise \
                     KVSWAP_GPU_CHUNKS, or lower KVSWAP_INDEX_TOPK to the k your scorer selects, or set \
                     KVSWAP_TEST_ALLOW_TOPK_REDUCTION=1 (tests only)",
                    self.gpu_chunks, self.index_topk
                ),
            ));
        }
        Ok(())
    }

    /// The C-visible form.
    pub fn to_c(&self) -> KvswapConfig {
        let mut fm_ckpt = [0 as c_char; KVSWAP_PATH_MAX];
        if let Some(p) = &self.fm_ckpt {
            let bytes = p.as_os_str().as_encoded_bytes();
            // Paths from the environment or from_c are checked to fit; a
            // longer PathBuf set by Rust code is truncated (validate() refuses it).
            for (d, s) in fm_ckpt.iter_mut().zip(bytes.iter().take(KVSWAP_PATH_MAX - 1)) {
                *d = *s as c_char;
            }
        }
        KvswapConfig {
            enable: self.enable as u32,
            gpu_chunks: self.gpu_chunks,
            pinned_mib: self.pinned_mib,
            sync: self.sync as u32,
            validate: self.validate as u32,
            test_allow_topk_reduction: self.test_allow_topk_reduction as u32,
            index_topk: self.index_topk,
            window: self.window,
            fm_ensemble: match self.fm_ensemble {
                Ensemble::Max => KVSWAP_ENSEMBLE_MAX,
                Ensemble::Mean => KVSWAP_ENSEMBLE_MEAN,
            },
            mem_profile: self.mem_profile as u32,
            backend: match self.backend {
                BackendChoice::Auto => KVSWAP_BACKEND_AUTO,
                BackendChoice::Cpu => KVSWAP_BACKEND_CPU,
                BackendChoice::Cuda => KVSWAP_BACKEND_CUDA,
            },
            device: self.device,
            fm_ckpt,
        }
    }

    /// Reads and validates the C-visible form.
    pub fn from_c(c: &KvswapConfig) -> Result<Config> {
        fn flag(name: &str, v: u32) -> Result<bool> {
            match v {
                0 => Ok(false),
                1 => Ok(true),
                _ => Err(Error::invalid(format!("config.{name}={v}: a flag must be 0 or 1"))),
            }
        }
        let fm_ckpt = {
            let bytes: Vec<u8> = c.fm_ckpt.iter().map(|&b| b as u8).collect();
            let s = CStr::from_bytes_until_nul(&bytes).map_err(|_| {
                Error::invalid("config.fm_ckpt is not NUL-terminated within KVSWAP_PATH_MAX bytes")
            })?;
            let s = s.to_str().map_err(|_| Error::invalid("config.fm_ckpt is not valid UTF-8"))?;
            if s.is_empty() { None } else { Some(PathBuf::from(s)) }
        };
        let cfg = Config {
            enable: flag("enable", c.enable)?,
            gpu_chunks: c.gpu_chunks,
            pinned_mib: c.pinned_mib,
            sync: flag("sync", c.sync)?,
            validate: flag("validate", c.validate)?,
            test_allow_topk_reduction: flag("test_allow_topk_reduction", c.test_allow_topk_reduction)?,
            index_topk: c.index_topk,
            window: c.window,
            fm_ensemble: match c.fm_ensemble {
                KVSWAP_ENSEMBLE_MAX => Ensemble::Max,
                KVSWAP_ENSEMBLE_MEAN => Ensemble::Mean,
                v => return Err(Error::invalid(format!("config.fm_ensemble={v}: expected KVSWAP_ENSEMBLE_MAX or _MEAN"))),
            },
            mem_profile: flag("mem_profile", c.mem_profile)?,
            backend: match c.backend {
                KVSWAP_BACKEND_AUTO => BackendChoice::Auto,
                KVSWAP_BACKEND_CPU => BackendChoice::Cpu,
                KVSWAP_BACKEND_CUDA => BackendChoice::Cuda,
                v => return Err(Error::invalid(format!("config.backend={v}: expected KVSWAP_BACKEND_AUTO, _CPU or _CUDA"))),
            },
            device: c.device,
            fm_ckpt,
        };
        cfg.validate()?;
        Ok(cfg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> =
            pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn values_that_are_not_text_are_refused_by_name() {
        use std::os::unix::ffi::OsStringExt;
        // Not UTF-8: refused, naming the variable (the alias when that is the one set).
        fn raw(name: &'static str) -> impl Fn(&str) -> Option<std::ffi::OsString> {
            move |k| (k == name).then(|| std::ffi::OsString::from_vec(vec![0xff, 0xfe]))
        }
        let e = Config::from_os_lookup(raw("KVSWAP_GPU_CHUNKS")).unwrap_err();
        assert!(e.message.contains("KVSWAP_GPU_CHUNKS") && e.message.contains("UTF-8"), "{e}");
        let e = Config::from_os_lookup(raw("POCKETLLM_GGUF_KV_SWAP_GPU_CHUNKS")).unwrap_err();
        assert!(e.message.contains("POCKETLLM_GGUF_KV_SWAP_GPU_CHUNKS"), "{e}");
        // The kvswap name set blank reads as unset, so its alias is read:
        // an alias that is not UTF-8 is refused there too.
        let e = Config::from_os_lookup(|k: &str| match k {
            "KVSWAP_SYNC" => Some(" ".into()),
            "POCKETLLM_GGUF_KV_SWAP_SYNC" => Some(std::ffi::OsString::from_vec(vec![b'0', 0xff])),
            _ => None,
        })
        .unwrap_err();
        assert!(e.message.contains("POCKETLLM_GGUF_KV_SWAP_SYNC") && e.message.contains("UTF-8"), "{e}");
        // UTF-8 values go through as before.
        let c = Config::from_os_lookup(|k: &str| (k == "KVSWAP_GPU_CHUNKS").then(|| "64".into())).unwrap();
        assert_eq!(c.gpu_chunks, 64);
        // A checkpoint path too long, in characters of several bytes: an
        // error quoting its first 64 characters, not a panic mid-character.
        let long = "\u{20ac}".repeat(1400);
        let e = Config::from_lookup(env(&[("KVSWAP_FM_CKPT", &long)])).unwrap_err();
        assert_eq!(e.status, KvswapStatus::InvalidArgument, "{e}");
        assert!(e.message.contains(&"\u{20ac}".repeat(64)), "{e}");
    }

    #[test]
    fn range_errors_name_the_variable_set_and_the_limit() {
        // The alias that was set, not the kvswap name, and the limit.
        let e = Config::from_lookup(env(&[("POCKETLLM_GGUF_KV_SWAP_GPU_CHUNKS", "2000000000")])).unwrap_err();
        assert!(e.message.starts_with("POCKETLLM_GGUF_KV_SWAP_GPU_CHUNKS=") && e.message.contains("at most 1073741823"), "{e}");
        // Beyond u32: too large, not "expected >= 1".
        let e = Config::from_lookup(env(&[("KVSWAP_GPU_CHUNKS", "99999999999999")])).unwrap_err();
        assert!(e.message.contains("too large"), "{e}");
        let e = Config::from_lookup(env(&[("KVSWAP_WINDOW", "1073741824")])).unwrap_err();
        assert!(e.message.starts_with("KVSWAP_WINDOW=") && e.message.contains("at most 1073741823"), "{e}");
        assert_eq!(Config::from_lookup(env(&[("KVSWAP_WINDOW", "0")])).unwrap().window, 0);
        assert_eq!(Config::from_lookup(env(&[("KVSWAP_GPU_CHUNKS", "1073741823")])).unwrap().gpu_chunks, 1073741823);
        let e = Config::from_lookup(env(&[("KVSWAP_PINNED_MIB", "18446744073709551616")])).unwrap_err();
        assert!(e.message.contains("too large"), "{e}");
    }

    #[test]
    fn empty_values_count_as_unset() {
        // `KVSWAP_SYNC=` used to read as 0 (async); blank values keep the
        // defaults, and an empty kvswap name lets its alias through.
        let c = Config::from_lookup(env(&[("KVSWAP_SYNC", ""), ("KVSWAP_GPU_CHUNKS", "  "), ("KVSWAP_BACKEND", "")])).unwrap();
        assert_eq!(c, Config::default());
        let c = Config::from_lookup(env(&[("KVSWAP_SYNC", ""), ("POCKETLLM_GGUF_KV_SWAP_SYNC", "0")])).unwrap();
        assert!(!c.sync);
    }

    #[test]
    fn defaults_match_design_table() {
        let c = Config::from_lookup(env(&[])).unwrap();
        assert_eq!(c, Config::default());
        assert!(!c.enable);
        assert_eq!((c.gpu_chunks, c.pinned_mib, c.index_topk, c.window), (512, 16384, 512, 128));
        assert!(c.sync && !c.validate && !c.test_allow_topk_reduction && !c.mem_profile);
        assert_eq!(c.fm_ensemble, Ensemble::Max);
        assert_eq!(c.fm_ckpt, None);
    }

    #[test]
    fn every_variable_is_read() {
        let c = Config::from_lookup(env(&[
            ("KVSWAP_ENABLE", "1"),
            ("KVSWAP_GPU_CHUNKS", "1024"),
            ("KVSWAP_PINNED_MIB", "4096"),
            ("KVSWAP_SYNC", "0"),
            ("KVSWAP_VALIDATE", "true"),
            ("KVSWAP_TEST_ALLOW_TOPK_REDUCTION", "on"),
            ("KVSWAP_INDEX_TOPK", "256"),
            ("KVSWAP_WINDOW", "64"),
            ("KVSWAP_FM_CKPT", "/tmp/fm.safetensors"),
            ("KVSWAP_FM_ENSEMBLE", "MEAN"),
            ("KVSWAP_MEM_PROFILE", "yes"),
            ("KVSWAP_BACKEND", "cpu"),
            ("KVSWAP_DEVICE", "3"),
        ]))
        .unwrap();
        assert!(c.enable && !c.sync && c.validate && c.test_allow_topk_reduction && c.mem_profile);
        assert_eq!((c.gpu_chunks, c.pinned_mib, c.index_topk, c.window), (1024, 4096, 256, 64));
        assert_eq!(c.fm_ckpt.as_deref(), Some(std::path::Path::new("/tmp/fm.safetensors")));
        assert_eq!(c.fm_ensemble, Ensemble::Mean);
        assert_eq!(c.backend, BackendChoice::Cpu);
        assert_eq!(c.device, 3);
    }

    #[test]
    fn aliases_work_and_kvswap_name_wins() {
        let c = Config::from_lookup(env(&[
            ("POCKETLLM_GGUF_KV_SWAP", "1"),
            ("POCKETLLM_GGUF_KV_SWAP_GPU_CHUNKS", "2048"),
            ("KVSWAP_GPU_CHUNKS", "768"),
            ("POCKETLLM_GGUF_KV_SWAP_PINNED_MIB", "256"),
            ("POCKETLLM_GGUF_KV_SWAP_SYNC", "0"),
            ("POCKETLLM_GGUF_KV_SWAP_VALIDATE", "1"),
            ("POCKETLLM_GGUF_KV_SWAP_TEST_ALLOW_TOPK_REDUCTION", "1"),
            ("POCKETLLM_GGUF_FLASHMEMORY_CKPT", "a.st"),
            ("POCKETLLM_GGUF_FLASHMEMORY_ENSEMBLE", "mean"),
            ("POCKETLLM_GGUF_MEM_PROFILE", "1"),
        ]))
        .unwrap();
        assert!(c.enable && !c.sync && c.validate && c.test_allow_topk_reduction && c.mem_profile);
        assert_eq!(c.gpu_chunks, 768, "KVSWAP_ name wins over the alias");
        assert_eq!(c.pinned_mib, 256);
        assert_eq!(c.fm_ensemble, Ensemble::Mean);
        assert_eq!(c.fm_ckpt.as_deref(), Some(std::path::Path::new("a.st")));
    }

    #[test]
    fn bad_values_name_the_variable_and_value() {
        let cases: &[(&str, &str)] = &[
            ("KVSWAP_GPU_CHUNKS", "abc"),
            ("KVSWAP_GPU_CHUNKS", "-4"),
            ("KVSWAP_PINNED_MIB", "-1"),
            ("KVSWAP_PINNED_MIB", "1.5"),
            ("KVSWAP_FM_ENSEMBLE", "foo"),
            ("POCKETLLM_GGUF_FLASHMEMORY_ENSEMBLE", "foo"),
            ("KVSWAP_ENABLE", "maybe"),
            ("POCKETLLM_GGUF_KV_SWAP_SYNC", "2"),
            ("KVSWAP_BACKEND", "tpu"),
            ("KVSWAP_DEVICE", "-1"),
            ("KVSWAP_INDEX_TOPK", "99999999999"),
        ];
        for (k, v) in cases {
            let e = Config::from_lookup(env(&[(k, v)])).unwrap_err();
            assert_eq!(e.status, KvswapStatus::InvalidArgument);
            assert!(e.message.contains(k), "{e} names {k}");
            assert!(e.message.contains(&format!("{v:?}")), "{e} names {v}");
        }
        let e = Config::from_lookup(env(&[("KVSWAP_GPU_CHUNKS", "0")])).unwrap_err();
        assert!(e.message.contains("KVSWAP_GPU_CHUNKS=\"0\""), "{e}");
        // index_topk has the cap of the other counts; a number past u128 is
        // "too large"; a long value is quoted by its start.
        let e = Config::from_lookup(env(&[("KVSWAP_INDEX_TOPK", "4294967295")])).unwrap_err();
        assert!(e.message.contains(&format!("at most {ID_COUNT_MAX}")), "{e}");
        let long = "9".repeat(1 << 20);
        let e = Config::from_lookup(env(&[("KVSWAP_GPU_CHUNKS", long.as_str())])).unwrap_err();
        assert!(e.message.contains("too large") && e.message.len() < 300, "{}", &e.message[..e.message.len().min(300)]);
        let e = Config::from_lookup(env(&[("POCKETLLM_GGUF_KV_SWAP_GPU_CHUNKS", "0")])).unwrap_err();
        assert!(e.message.contains("POCKETLLM_GGUF_KV_SWAP_GPU_CHUNKS=\"0\""), "an alias is named as set: {e}");
        let long = "x".repeat(KVSWAP_PATH_MAX + 10);
        let e = Config::from_lookup(env(&[("KVSWAP_FM_CKPT", &long)])).unwrap_err();
        assert!(e.message.contains("KVSWAP_FM_CKPT") && e.message.contains("shorter than"), "{e}");
    }

    #[test]
    fn c_round_trip_and_bad_c_values() {
        // Every field away from its default and from the others' values, so a
        // field dropped, defaulted or swapped on the way shows.
        let c = Config {
            enable: true,
            gpu_chunks: 1000,
            pinned_mib: 777,
            sync: false,
            validate: true,
            test_allow_topk_reduction: true,
            index_topk: 300,
            window: 64,
            fm_ensemble: Ensemble::Mean,
            mem_profile: true,
            backend: BackendChoice::Cuda,
            device: 3,
            fm_ckpt: Some("/x/y.safetensors".into()),
        };
        let d = Config::default();
        // Every field differs from the default, so the round trip below
        // shows each one carried.
        macro_rules! all_differ {
            ($($f:ident),*) => { $( assert!(c.$f != d.$f, concat!(stringify!($f), " must differ from the default")); )* };
        }
        all_differ!(enable, gpu_chunks, pinned_mib, sync, validate, test_allow_topk_reduction, index_topk, window, fm_ensemble, mem_profile, backend, device, fm_ckpt);
        let cc = c.to_c();
        assert_eq!(Config::from_c(&cc).unwrap(), c);
        for b in [BackendChoice::Auto, BackendChoice::Cpu] {
            let other = Config { backend: b, fm_ensemble: Ensemble::Max, sync: true, ..c.clone() };
            assert_eq!(Config::from_c(&other.to_c()).unwrap(), other);
        }
        let mut bad = cc;
        bad.sync = 7;
        assert!(Config::from_c(&bad).unwrap_err().message.contains("sync"));
        let mut bad = cc;
        bad.backend = 9;
        assert!(Config::from_c(&bad).unwrap_err().message.contains("backend"));
        let mut bad = cc;
        bad.fm_ckpt = [b'a' as c_char; KVSWAP_PATH_MAX];
        assert!(Config::from_c(&bad).unwrap_err().message.contains("NUL"));
    }

    #[test]
    fn topk_guard() {
        let mut c = Config { enable: true, gpu_chunks: 256, ..Config::default() };
        let e = c.check_topk_guard().unwrap_err();
        assert_eq!(e.status, KvswapStatus::TopkGuard);
        assert!(e.message.contains("gpu_chunks=256 < index_topk=512"));
        c.test_allow_topk_reduction = true;
        c.check_topk_guard().unwrap();
    }
}
