//! Runs the C11 and C++17 programs of `ffi-tests/` against the cdylib that
//! this very `cargo test` built: plainly, under ASan+UBSan, and under
//! valgrind, all on the CPU backend. Each test uses its own build directory
//! so they run in parallel.
//!
//! The same programs run on the CUDA backend with `KVSWAP_TEST_BACKEND=cuda`
//! (`make -C ffi-tests test-cuda`, or `.ci/gpu-run.sh` on a GPU machine).
//! Here, `cuda_run_without_driver_fails_cleanly` checks that such a run on
//! a machine without the NVIDIA driver stops with a clear message and a
//! non-zero exit status instead of crashing (and, on a machine with a GPU,
//! that it passes).
//!
//! The FlashMemory scorer groups of the programs need a checkpoint, which
//! they never make themselves: [`fm_checkpoint`] writes a small seeded one
//! with this build's `kvswap fm init` and every run gets its path in
//! `KVSWAP_TEST_FM_CKPT` (with `KVSWAP_TEST_REQUIRE_FM_CKPT=1`, so a run
//! here can never skip them); the logs are checked for those groups too.
//!
//! Where the cdylib is: `cargo test` builds the library with every crate type
//! it declares (`cdylib` and `rlib`), but leaves `libkvswap.so` in
//! `target/<profile>/deps/` — it is copied up to `target/<profile>/` only by
//! `cargo build`. So the tests link the copy in `deps/`, next to this test's
//! own executable, which is always the one built from the current sources.
//! `target/<profile>/libkvswap.so` is used only when `deps/` has none, and if
//! neither exists the library is built with `cargo build --lib` into a
//! separate target directory (the outer cargo holds the lock on this one).

use std::fs::File;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

const LIB_NAME: &str = "libkvswap.so";

fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The directory holding the `libkvswap.so` to link against.
fn lib_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    // target/<profile>/deps/ffi_c-<hash>
    let deps = exe.parent().expect("test executable has a parent").to_path_buf();
    if deps.join(LIB_NAME).is_file() {
        return deps;
    }
    if let Some(profile_dir) = deps.parent() {
        if profile_dir.join(LIB_NAME).is_file() {
            eprintln!(
                "note: {} has no {LIB_NAME}; using {} (built by an earlier `cargo build`)",
                deps.display(),
                profile_dir.display()
            );
            return profile_dir.to_path_buf();
        }
    }
    build_cdylib_elsewhere()
}

/// Builds the cdylib into a target directory of its own (the outer `cargo
/// test` holds the lock on the main one) and returns where it is.
fn build_cdylib_elsewhere() -> PathBuf {
    static ONCE: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    ONCE.get_or_init(|| {
        let target = Path::new(env!("CARGO_TARGET_TMPDIR")).join("ffi-cdylib");
        eprintln!("note: no {LIB_NAME} next to the test executable; running `cargo build --lib` into {}", target.display());
        let out = Command::new(env!("CARGO"))
            .current_dir(repo_root())
            .args(["build", "--lib", "--target-dir"])
            .arg(&target)
            .output()
            .expect("run cargo build --lib");
        assert!(
            out.status.success(),
            "cargo build --lib failed:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let dir = target.join("debug");
        assert!(dir.join(LIB_NAME).is_file(), "cargo build --lib produced no {}", dir.join(LIB_NAME).display());
        dir
    })
    .clone()
}

/// The cargo profile directory this test runs from (`debug`, `release`, ...):
/// CARGO_TARGET_TMPDIR is shared by every profile, so keep their files apart.
fn profile() -> String {
    let exe = std::env::current_exe().expect("current_exe");
    exe.parent()
        .and_then(Path::parent)
        .and_then(Path::file_name)
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "unknown".into())
}

/// The flags of the checkpoint the C and C++ programs expect (see the
/// comment at the top of ffi-tests/Makefile).
const FM_INIT_ARGS: [&str; 12] =
    ["--hidden", "64", "--heads", "16", "--head-dim", "64", "--scorers", "2", "--dtype", "bf16", "--seed", "7"];

/// A small seeded scorer checkpoint, written once per test process with the
/// `kvswap` CLI of this build (to a temporary name, then renamed, so a
/// concurrent `cargo test` of the same profile never reads half a file).
fn fm_checkpoint() -> PathBuf {
    static ONCE: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    ONCE.get_or_init(|| {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("ffi-{}-fm", profile()));
        std::fs::create_dir_all(&dir).expect("create checkpoint directory");
        let tmp = dir.join(format!("fm.{}.tmp", std::process::id()));
        let out = Command::new(env!("CARGO_BIN_EXE_kvswap"))
            .args(["fm", "init"])
            .args(FM_INIT_ARGS)
            .arg("--out")
            .arg(&tmp)
            .stdin(Stdio::null())
            .output()
            .expect("run kvswap fm init");
        assert!(
            out.status.success() && tmp.is_file(),
            "kvswap fm init {} --out {} failed ({}):\n{}{}",
            FM_INIT_ARGS.join(" "),
            tmp.display(),
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let path = dir.join("fm.safetensors");
        std::fs::rename(&tmp, &path).expect("rename the checkpoint");
        path
    })
    .clone()
}

/// The scorer groups ran (not skipped) in the output of the C and C++ programs.
fn assert_scorer_groups_ran(target: &str, output: &str) {
    for line in [
        "ok   fm_scorer_load:",
        "ok   fm_score_topk:",
        "ok   fm_score_topk_batch:",
        "ok   fm_bounds_build",
        "ok   C++: fm_scorer_load",
    ] {
        assert!(output.contains(line), "`make {target}`: no line \"{line}\" in its output:\n{output}");
    }
    assert!(!output.contains("SKIPPED"), "`make {target}`: the scorer groups were skipped:\n{output}");
}

/// Runs `make -C ffi-tests <target>` with its own BUILD directory, stdout and
/// stderr interleaved into one log; panics with the whole log on failure.
/// Returns the BUILD directory and the log.
fn run_make(target: &str) -> (PathBuf, String) {
    let lib = lib_dir();
    let ckpt = fm_checkpoint();
    let build = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("ffi-{}-{target}", profile()));
    std::fs::create_dir_all(&build).expect("create build directory");
    let log_path = build.join("make.log");
    let log = File::create(&log_path).expect("create make.log");
    let status = Command::new("make")
        .arg("-C")
        .arg(repo_root().join("ffi-tests"))
        .arg(target)
        .arg(format!("LIBDIR={}", lib.display()))
        .arg(format!("BUILD={}", build.display()))
        .env("KVSWAP_TEST_FM_CKPT", &ckpt)
        .env("KVSWAP_TEST_REQUIRE_FM_CKPT", "1")
        .stdin(Stdio::null())
        .stdout(log.try_clone().expect("clone log handle"))
        .stderr(log)
        .status();
    let output = std::fs::read_to_string(&log_path).unwrap_or_default();
    match status {
        Err(e) => panic!("could not run `make` (is it installed?): {e}"),
        Ok(s) if !s.success() => panic!(
            "`make -C ffi-tests {target}` failed ({s}) with LIBDIR={} BUILD={}; its output:\n\
             ----------------------------------------------------------------\n{output}\
             ----------------------------------------------------------------",
            lib.display(),
            build.display()
        ),
        Ok(_) => {
            // Shown with --nocapture (or --no-capture under nextest).
            println!("`make -C ffi-tests {target}` with LIBDIR={}:\n{output}", lib.display());
        }
    }
    (build, output)
}

/// The C ABI functions `include/kvswap.h` declares (`kvswap_*`, `fm_*`).
fn header_functions() -> Vec<String> {
    let header = std::fs::read_to_string(repo_root().join("include/kvswap.h")).expect("read include/kvswap.h");
    let mut names = Vec::new();
    for line in header.lines().map(str::trim) {
        if line.starts_with("//") || line.starts_with('#') || line.starts_with("typedef") || line.starts_with('*') {
            continue;
        }
        let Some(open) = line.find('(') else { continue };
        let before = &line[..open];
        let name = before.rsplit(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).next().unwrap_or("");
        if (name.starts_with("kvswap_") || name.starts_with("fm_")) && !names.iter().any(|n| n == name) {
            names.push(name.to_string());
        }
    }
    names
}

#[test]
fn c_and_cpp_programs() {
    // test_abi.c promises to call every function of the header: keep it so.
    let functions = header_functions();
    assert!(functions.len() >= 16, "parsed only {functions:?} from include/kvswap.h");
    let c_test = std::fs::read_to_string(repo_root().join("ffi-tests/test_abi.c")).expect("read ffi-tests/test_abi.c");
    let missing: Vec<&String> = functions.iter().filter(|f| !c_test.contains(&format!("{f}("))).collect();
    assert!(
        missing.is_empty(),
        "ffi-tests/test_abi.c does not call these functions of include/kvswap.h: {missing:?}; add them to the C test"
    );
    let (_, output) = run_make("test");
    assert_scorer_groups_ran("test", &output);
}

#[test]
fn c_and_cpp_under_asan_ubsan() {
    let (_, output) = run_make("sanitize");
    assert_scorer_groups_ran("sanitize", &output);
}

#[test]
fn c_and_cpp_under_valgrind() {
    let have_valgrind = Command::new("valgrind")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    if !have_valgrind {
        if std::env::var("KVSWAP_REQUIRE_VALGRIND").as_deref() == Ok("1") {
            panic!("valgrind is not installed, and KVSWAP_REQUIRE_VALGRIND=1 requires the valgrind run of ffi-tests");
        }
        // Written straight to the stderr handle, which the test harness does
        // not capture (eprintln! output of a passing test would be hidden).
        use std::io::Write;
        let _ = std::io::stderr().write_all(
            b"\n\
              ****************************************************************\n\
              * NOTE: valgrind is not installed: the valgrind run of          *\n\
              * ffi-tests was NOT done (test c_and_cpp_under_valgrind passes  *\n\
              * without running). Install valgrind, or set                    *\n\
              * KVSWAP_REQUIRE_VALGRIND=1 to make its absence a failure.      *\n\
              ****************************************************************\n",
        );
        return;
    }
    let (_, output) = run_make("valgrind");
    assert_scorer_groups_ran("valgrind", &output);
}

/// `KVSWAP_TEST_BACKEND=cuda` on a machine without libcuda.so.1: each program
/// exits non-zero (not by a signal) saying it cannot load the driver. Where
/// the driver is installed the CUDA run must pass instead. A bad backend name
/// exits with status 2.
#[test]
fn cuda_run_without_driver_fails_cleanly() {
    let (build, _) = run_make("build");
    let lib = lib_dir();
    let ckpt = fm_checkpoint();
    let ld_path = match std::env::var_os("LD_LIBRARY_PATH") {
        Some(p) if !p.is_empty() => {
            let mut v = lib.clone().into_os_string();
            v.push(":");
            v.push(p);
            v
        }
        _ => lib.clone().into_os_string(),
    };
    for prog in ["test_abi", "test_abi_cpp"] {
        let exe = build.join(prog);
        let run = |backend: &str| {
            Command::new(&exe)
                .env("KVSWAP_TEST_BACKEND", backend)
                .env("LD_LIBRARY_PATH", &ld_path)
                .env("KVSWAP_TEST_FM_CKPT", &ckpt)
                .env("KVSWAP_TEST_REQUIRE_FM_CKPT", "1")
                .stdin(Stdio::null())
                .output()
                .unwrap_or_else(|e| panic!("run {}: {e}", exe.display()))
        };
        let out = run("cuda");
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        if let Some(sig) = out.status.signal() {
            panic!("{prog} with KVSWAP_TEST_BACKEND=cuda was killed by signal {sig}; its output:\n{text}");
        }
        if out.status.success() {
            // A machine with a GPU: the CUDA run itself passed.
            assert!(text.contains("backend: cuda"), "{prog} passed but did not run on CUDA:\n{text}");
            assert!(text.contains("all groups passed") && !text.contains("SKIPPED"), "{prog}:\n{text}");
            println!("{prog}: the CUDA run passed on this machine");
        } else {
            assert!(
                text.contains("cannot load libcuda.so.1"),
                "{prog} with KVSWAP_TEST_BACKEND=cuda failed ({}) without saying it cannot load libcuda.so.1 \
                 (a real CUDA failure, if this machine has a GPU); its output:\n{text}",
                out.status
            );
            assert_eq!(out.status.code(), Some(1), "{prog}: {text}");
            assert!(!text.contains("all groups passed"), "{prog}: {text}");
        }
        let out = run("tpu");
        let text = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{prog} with KVSWAP_TEST_BACKEND=tpu: {}", out.status);
        assert!(text.contains("KVSWAP_TEST_BACKEND=tpu"), "{prog}: {text}");
    }
}

/// The README's C example ("The C API in a few lines") compiles as C11 with
/// `-Wall -Wextra -Werror` inside a function that declares what it leaves
/// to the engine, and links and loads with the README's link line: the
/// documentation cannot drift from the header.
#[test]
fn readme_c_example_compiles_and_links() {
    let readme = std::fs::read_to_string(repo_root().join("README.md")).expect("README.md");
    let section = readme.split("## The C API in a few lines").nth(1).expect("README has the C API section");
    let code = section.split("```c\n").nth(1).and_then(|s| s.split("```").next()).expect("a ```c block in the C API section");
    let src = format!(
        "#include <stdio.h>\n#include \"kvswap.h\"\n\
         enum KvswapStatus example(int32_t chunk_id, const void *chunk_src, KvswapStream stream, const float *hidden,\n\
         \x20                        const void *index_keys, size_t n_chunks);\n\
         enum KvswapStatus example(int32_t chunk_id, const void *chunk_src, KvswapStream stream, const float *hidden,\n\
         \x20                        const void *index_keys, size_t n_chunks) {{\n{code}    return st;\n}}\n\
         int main(int argc, char **argv) {{\n\
         \x20   (void)argv;\n\
         \x20   if (argc > 99) return (int)example(0, NULL, NULL, NULL, NULL, 0);\n\
         \x20   printf(\"%s\\n\", kvswap_version());\n\
         \x20   return 0;\n}}\n"
    );
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("readme-c");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("app.c"), &src).unwrap();
    let lib = lib_dir();
    // The README's line: cc -std=c11 -Iinclude app.c -L<lib> -lkvswap -Wl,-rpath,<lib> -o app
    let out = Command::new("cc")
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-I"])
        .arg(repo_root().join("include"))
        .arg(dir.join("app.c"))
        .arg(format!("-L{}", lib.display()))
        .arg("-lkvswap")
        .arg(format!("-Wl,-rpath,{}", lib.display()))
        .arg("-o")
        .arg(dir.join("app"))
        .output()
        .expect("run cc");
    assert!(out.status.success(), "the README's C example does not compile:\n{src}\n{}", String::from_utf8_lossy(&out.stderr));
    let run = Command::new(dir.join("app")).env_remove("LD_LIBRARY_PATH").output().expect("run the example");
    assert!(run.status.success(), "the linked example does not run: {}", String::from_utf8_lossy(&run.stderr));
    assert!(String::from_utf8_lossy(&run.stdout).trim().starts_with(env!("CARGO_PKG_VERSION")), "kvswap_version(): {:?}", run.stdout);
}
