// Runs bindgen over include/kvswap.h so the test can compare the C view of
// every struct and enum with the Rust #[repr(C)] definitions.
use std::path::PathBuf;

fn main() {
    let header = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../include/kvswap.h");
    println!("cargo::rerun-if-changed={}", header.display());
    let bindings = bindgen::Builder::default()
        .header(header.to_string_lossy())
        .allowlist_type("Kvswap.*|Fm.*")
        .allowlist_var("KVSWAP_.*|FM_.*")
        .layout_tests(true)
        .derive_default(false)
        .generate()
        .expect("bindgen failed on include/kvswap.h");
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap()).join("c_view.rs");
    bindings.write_to_file(out).expect("write bindings");
}
