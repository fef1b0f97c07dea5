//! Helpers shared by the model's integration tests.
#![allow(dead_code, unused_imports)]

use std::collections::HashMap;

use candle_core::{DType, Tensor};
use qwen36_model::Qwen36Model;
pub use qwen36_testutil::{
    fixture_dir, fixture_reference, ids_of, ids_tensor, load_tensors, max_abs_diff, max_row_rel_err,
    test_device, FIXTURES,
};

#[path = "../../../testutil/include/model.rs"]
mod model_helpers;
pub use model_helpers::*;

/// A fixture model in `dtype` on the test device, and HF's outputs for it.
pub fn load_with_reference(name: &str, dtype: DType) -> (Qwen36Model, HashMap<String, Tensor>) {
    (load(name, dtype), fixture_reference(name))
}

/// Each of [`FIXTURES`] (one at a time) with its name and HF's outputs for it.
pub fn fixture_models(
    dtype: DType,
) -> impl Iterator<Item = (&'static str, Qwen36Model, HashMap<String, Tensor>)> {
    FIXTURES.into_iter().map(move |name| {
        let (model, r) = load_with_reference(name, dtype);
        (name, model, r)
    })
}

/// Copies a fixture model's files into a temp dir so a test can break it.
pub fn copy_fixture(name: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(fixture_dir(name)).unwrap() {
        let p = entry.unwrap().path();
        if p.is_file() {
            std::fs::copy(&p, dir.path().join(p.file_name().unwrap())).unwrap();
        }
    }
    dir
}

/// Rewrites `file` in `dir` after `edit` changes its tensors.
pub fn edit_tensors(dir: &std::path::Path, file: &str, edit: impl FnOnce(&mut HashMap<String, Tensor>)) {
    let path = dir.join(file);
    let mut map = candle_core::safetensors::load(&path, &candle_core::Device::Cpu).unwrap();
    edit(&mut map);
    candle_core::safetensors::save(&map, &path).unwrap();
}

/// Rewrites `dir/config.json` after `edit` changes it.
pub fn edit_config(dir: &std::path::Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let path = dir.join("config.json");
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut v);
    std::fs::write(&path, serde_json::to_string(&v).unwrap()).unwrap();
}
