//! Run-time compilation of `kernels/*.cu` with NVRTC, straight to a CUBIN for
//! one GPU architecture, cached per process and architecture.

use crate::error::{Error, KvswapStatus, Result};
use cudarc::nvrtc::sys;
use std::collections::HashMap;
use std::ffi::{c_char, CString};
use std::sync::{Arc, Mutex, OnceLock};

fn nvrtc_check(r: sys::nvrtcResult, what: &str) -> Result<()> {
    if r == sys::nvrtcResult::NVRTC_SUCCESS {
        Ok(())
    } else {
        Err(Error::new(KvswapStatus::DeviceError, format!("{what} failed: {r:?}")))
    }
}

/// Whether libnvrtc can be loaded.
pub fn available() -> bool {
    // SAFETY: only probes whether the library can be opened.
    unsafe { sys::is_culib_present() }
}

/// NVRTC's (major, minor) version (asked once per process).
pub fn version() -> Result<(i32, i32)> {
    static VERSION: OnceLock<Result<(i32, i32)>> = OnceLock::new();
    VERSION
        .get_or_init(|| {
            require()?;
            let (mut a, mut b) = (0, 0);
            // SAFETY: writes two ints.
            nvrtc_check(unsafe { sys::nvrtcVersion(&mut a, &mut b) }, "nvrtcVersion")?;
            Ok((a, b))
        })
        .clone()
}

fn require() -> Result<()> {
    if available() {
        Ok(())
    } else {
        Err(Error::new(
            KvswapStatus::NoDevice,
            "NVRTC not found: libnvrtc.so.13 could not be loaded (install the CUDA 13 runtime compiler, \
             e.g. `pip install nvidia-cuda-nvrtc==13.0.*`, and add its lib/ folder to LD_LIBRARY_PATH)",
        ))
    }
}

/// Compiles `source` for `sm_<major><minor>` and returns the CUBIN.
pub fn compile(name: &str, source: &str, cc: (i32, i32)) -> Result<Vec<u8>> {
    compile_with(name, source, cc, &[])
}

/// `compile` with extra options (e.g. `-DFM_HEADS=64`).
pub fn compile_with(name: &str, source: &str, cc: (i32, i32), extra: &[String]) -> Result<Vec<u8>> {
    compile_with_log(name, source, cc, extra).map(|(cubin, _)| cubin)
}

/// `compile_with`, also returning NVRTC's log of a successful compile (its
/// warnings; empty when there are none).
pub fn compile_with_log(name: &str, source: &str, cc: (i32, i32), extra: &[String]) -> Result<(Vec<u8>, String)> {
    require()?;
    let src = CString::new(source).map_err(|_| Error::invalid("kernel source contains NUL"))?;
    let cname = CString::new(name).unwrap_or_default();
    let mut prog: sys::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: src and name outlive the program (destroyed below).
    nvrtc_check(
        unsafe { sys::nvrtcCreateProgram(&mut prog, src.as_ptr(), cname.as_ptr(), 0, std::ptr::null(), std::ptr::null()) },
        "nvrtcCreateProgram",
    )?;
    // An explicit --gpu-architecture in `extra` (e.g. sm_90a) replaces the default.
    let arch = if extra.iter().any(|o| o.starts_with("--gpu-architecture=")) {
        None
    } else {
        Some(format!("--gpu-architecture=sm_{}{}", cc.0, cc.1))
    };
    let opts: Vec<CString> = arch
        .into_iter()
        .chain([
            "--std=c++17".to_string(),
            "--extra-device-vectorization".to_string(),
            "-default-device".to_string(),
        ])
        .chain(extra.iter().cloned())
    .map(|o| CString::new(o).unwrap())
    .collect();
    let ptrs: Vec<*const c_char> = opts.iter().map(|o| o.as_ptr()).collect();
    // SAFETY: prog is live; option strings outlive the call.
    let r = unsafe { sys::nvrtcCompileProgram(prog, ptrs.len() as i32, ptrs.as_ptr()) };
    let result = if r != sys::nvrtcResult::NVRTC_SUCCESS {
        Err(Error::new(KvswapStatus::DeviceError, format!("NVRTC could not compile {name} for sm_{}{}: {r:?}\n{}", cc.0, cc.1, log(prog))))
    } else {
        let mut size = 0usize;
        // SAFETY: prog compiled successfully.
        nvrtc_check(unsafe { sys::nvrtcGetCUBINSize(prog, &mut size) }, "nvrtcGetCUBINSize").and_then(|_| {
            let mut cubin = vec![0u8; size];
            // SAFETY: cubin holds `size` bytes.
            nvrtc_check(unsafe { sys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr() as *mut c_char) }, "nvrtcGetCUBIN")?;
            Ok((cubin, log(prog)))
        })
    };
    // SAFETY: destroys the program created above.
    unsafe { sys::nvrtcDestroyProgram(&mut prog) };
    result
}

fn log(prog: sys::nvrtcProgram) -> String {
    let mut size = 0usize;
    // SAFETY: prog is live.
    if unsafe { sys::nvrtcGetProgramLogSize(prog, &mut size) } != sys::nvrtcResult::NVRTC_SUCCESS || size == 0 {
        return String::new();
    }
    let mut buf = vec![0u8; size];
    // SAFETY: buf holds `size` bytes.
    unsafe { sys::nvrtcGetProgramLog(prog, buf.as_mut_ptr() as *mut c_char) };
    String::from_utf8_lossy(&buf).trim_end_matches('\0').to_string()
}

/// `compile`, cached per (kernel file, architecture) for the process.
pub fn compile_cached(name: &str, source: &str, cc: (i32, i32)) -> Result<Arc<Vec<u8>>> {
    compile_cached_with(name, source, cc, &[])
}

/// `compile_with`, cached per (kernel file, architecture, options).
pub fn compile_cached_with(name: &str, source: &str, cc: (i32, i32), extra: &[String]) -> Result<Arc<Vec<u8>>> {
    type Key = (String, i32, i32, Vec<String>);
    static CACHE: OnceLock<Mutex<HashMap<Key, Arc<Vec<u8>>>>> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    let key = (name.to_string(), cc.0, cc.1, extra.to_vec());
    if let Some(c) = cache.lock().unwrap_or_else(|p| p.into_inner()).get(&key) {
        return Ok(c.clone());
    }
    let t = std::time::Instant::now();
    let cubin = Arc::new(compile_with(name, source, cc, extra)?);
    log::debug!("kvswap: compiled {name} for sm_{}{} in {:.0} ms", cc.0, cc.1, t.elapsed().as_secs_f64() * 1e3);
    cache.lock().unwrap_or_else(|p| p.into_inner()).insert(key, cubin.clone());
    Ok(cubin)
}
