//! Runs the C11 and C++17 programs of `ffi-tests/` against the cdylib that
//! this very `cargo test` built: plainly, under ASan+UBSan, and under
//! valgrind. Each test uses its own build directory so they run in parallel.
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

/// Runs `make -C ffi-tests <target>` with its own BUILD directory, stdout and
/// stderr interleaved into one log; panics with the whole log on failure.
fn run_make(target: &str) {
    let lib = lib_dir();
    // CARGO_TARGET_TMPDIR is shared by every profile: keep their builds apart.
    let exe = std::env::current_exe().expect("current_exe");
    let profile = exe
        .parent()
        .and_then(Path::parent)
        .and_then(Path::file_name)
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "unknown".into());
    let build = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("ffi-{profile}-{target}"));
    std::fs::create_dir_all(&build).expect("create build directory");
    let log_path = build.join("make.log");
    let log = File::create(&log_path).expect("create make.log");
    let status = Command::new("make")
        .arg("-C")
        .arg(repo_root().join("ffi-tests"))
        .arg(target)
        .arg(format!("LIBDIR={}", lib.display()))
        .arg(format!("BUILD={}", build.display()))
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
    run_make("test");
}

#[test]
fn c_and_cpp_under_asan_ubsan() {
    run_make("sanitize");
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
    run_make("valgrind");
}
