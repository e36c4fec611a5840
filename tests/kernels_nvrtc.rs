//! Every kernel in kernels/ compiles with NVRTC for the GPU generations
//! kvswap supports, on a machine without a GPU: a kernel that does not
//! compile cannot land. `.ci/run` installs NVRTC from PyPI
//! (`nvidia-cuda-nvrtc==13.0.*`) and sets KVSWAP_REQUIRE_NVRTC=1.
#![cfg(feature = "cuda")]

use kvswap::backend::cuda::nvrtc;

/// A note the reader must see even when the test passes: written straight to
/// the stderr handle, which the test harness does not capture (eprintln!
/// output of a passing test is hidden).
fn loud_note(text: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "\nNOTE ({}): {text}", env!("CARGO_CRATE_NAME"));
}

/// Compiles `src` and fails on an error or on any warning in NVRTC's log
/// (a warning has meant code that did not do what it said, e.g. a
/// `#pragma unroll` that no longer preceded its loop).
fn compile_clean(what: &str, name: &str, src: &str, cc: (i32, i32), opts: &[String]) -> Vec<u8> {
    let (cubin, log) = nvrtc::compile_with_log(name, src, cc, opts).unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(!log.to_lowercase().contains("warning"), "{what}: NVRTC warned:\n{log}");
    cubin
}

#[test]
fn every_kernel_compiles() {
    if !nvrtc::available() {
        assert!(
            std::env::var_os("KVSWAP_REQUIRE_NVRTC").is_none(),
            "KVSWAP_REQUIRE_NVRTC is set but libnvrtc.so.13 cannot be loaded (LD_LIBRARY_PATH?)"
        );
        loud_note("NVRTC (libnvrtc.so.13) not found: kernel compilation NOT checked; set KVSWAP_REQUIRE_NVRTC=1 to fail instead");
        return;
    }
    let (major, minor) = nvrtc::version().unwrap();
    eprintln!("NVRTC {major}.{minor}");
    // Ampere, Ada, Hopper, Blackwell (datacenter).
    for cc in [(8, 0), (8, 9), (9, 0), (10, 0)] {
        for (name, src) in kvswap::kernels::ALL {
            let cubin = compile_clean(&format!("{name} sm_{}{}", cc.0, cc.1), name, src, cc, &[]);
            assert!(cubin.len() > 1000 && cubin.starts_with(b"\x7fELF"), "{name}: not a CUBIN");
        }
    }
    // The scorer as the CUDA backend compiles it: per shape, and the Hopper
    // wgmma kernel for sm_90a.
    for (s, h, d) in [(3, 64, 128), (1, 8, 128), (2, 16, 64), (4, 64, 256)] {
        let mut opts = vec![format!("-DFM_SCORERS={s}"), format!("-DFM_HEADS={h}"), format!("-DFM_HEAD_DIM={d}")];
        compile_clean(&format!("scorer {s}x{h}x{d}"), "scorer.cu", kvswap::kernels::SCORER_CU, (9, 0), &opts);
        if [64, 128, 192, 256].contains(&(s * h)) {
            opts.extend(["-DFM_WGMMA".to_string(), "--gpu-architecture=sm_90a".to_string()]);
            compile_clean(&format!("scorer wgmma {s}x{h}x{d}"), "scorer.cu", kvswap::kernels::SCORER_CU, (9, 0), &opts);
        }
    }
    // The development switches (KVSWAP_FM_DEFINES) keep compiling: the
    // timelines (the fp8 kernels' -DFM_TRACE, fm_order's merge tree
    // -DFM_OTRACE, the call timeline -DFM_CTRACE), fm_score_wg_fp8q's FMA
    // head sums (-DFM_Q8_FMA_HEADSUM; 8 scorers take them by default) and
    // its mma.sync head sums at 192 query rows (-DFM_Q8_HMMA_HEADSUM). The
    // default build's tensor-core head sums at 1, 2 and 4 scorers (4, 2 and
    // 4 head-sum k-steps per scorer) and the wgmma ones at 4 x 48 (3 k-steps).
    let dev: [(&str, (u32, u32, u32)); 10] = [
        ("-DFM_TRACE -DFM_OTRACE", (3, 64, 128)),
        ("-DFM_CTRACE", (3, 64, 128)),
        ("-DFM_Q8_FMA_HEADSUM", (3, 64, 128)),
        ("-DFM_Q8_FMA_HEADSUM", (4, 64, 128)),
        ("-DFM_Q8_HMMA_HEADSUM", (3, 64, 128)),
        ("", (2, 32, 128)),
        ("", (4, 48, 128)),
        ("", (1, 64, 128)),
        ("", (4, 64, 128)),
        ("", (8, 8, 128)),
    ];
    for (defines, (s, h, d)) in dev {
        let mut opts = vec![format!("-DFM_SCORERS={s}"), format!("-DFM_HEADS={h}"), format!("-DFM_HEAD_DIM={d}")];
        opts.extend(["-DFM_WGMMA", "--gpu-architecture=sm_90a"].map(String::from));
        opts.extend(defines.split_whitespace().map(String::from));
        compile_clean(&format!("scorer {s}x{h}x{d} with {defines:?}"), "scorer.cu", kvswap::kernels::SCORER_CU, (9, 0), &opts);
    }
}

#[test]
fn compile_errors_carry_the_log() {
    if !nvrtc::available() {
        assert!(std::env::var_os("KVSWAP_REQUIRE_NVRTC").is_none(), "KVSWAP_REQUIRE_NVRTC is set but libnvrtc.so.13 cannot be loaded");
        loud_note("NVRTC (libnvrtc.so.13) not found: compile-error reporting NOT checked");
        return;
    }
    let e = nvrtc::compile("bad.cu", "extern \"C\" __global__ void k() { undefined_thing(); }", (9, 0)).unwrap_err();
    assert!(e.message.contains("undefined_thing"), "{}", e.message);
}
