fn main() {
    println!("cargo::rerun-if-changed=original_lru.cpp");
    cc::Build::new().cpp(true).file("original_lru.cpp").flag("-std=c++17").opt_level(2).compile("original_lru");
}
