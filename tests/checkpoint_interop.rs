//! A checkpoint written by the official `safetensors` Python package (not
//! kvswap's writer) loads: tests/fixtures/py-safetensors.safetensors, made
//! by tests/fixtures/make_py_checkpoint.py (its 8-byte-aligned header with
//! trailing spaces, mixed f32/f16 tensors, an ignored int64 tensor).

use kvswap::scorer::checkpoint::Checkpoint;
use kvswap::Ensemble;
use std::path::Path;

#[test]
fn a_checkpoint_from_the_python_safetensors_package_loads() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/py-safetensors.safetensors");
    let c = Checkpoint::load(&path).unwrap_or_else(|e| panic!("{e}"));
    let m = c.meta();
    assert_eq!((m.n_scorers, m.hidden, m.n_heads, m.head_dim, m.ensemble), (1, 8, 2, 4, Ensemble::Max));
    for r in 0..8 {
        for col in 0..8 {
            assert_eq!(c.wq(0).get(r, col), r as f32 - col as f32 / 8.0, "wq[{r}, {col}]");
        }
    }
    for h in 0..2 {
        for col in 0..8 {
            assert_eq!(c.ww(0).get(h, col), h as f32 + col as f32 / 4.0, "ww[{h}, {col}]");
        }
    }
    let names: Vec<&str> = c.file_tensors().iter().map(|(n, _, _)| n.as_str()).collect();
    assert!(names.contains(&"training.step"), "the ignored tensor is listed: {names:?}");
    assert_eq!(c.weight_bytes(), 8 * 8 * 4 + 2 * 8 * 2);
}
