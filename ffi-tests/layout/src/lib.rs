//! The C view of include/kvswap.h, as bindgen sees it.
#![allow(non_camel_case_types, non_upper_case_globals, non_snake_case, dead_code, clippy::all)]
pub mod c {
    include!(concat!(env!("OUT_DIR"), "/c_view.rs"));
}
