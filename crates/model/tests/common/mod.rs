//! Helpers shared by the model's integration tests.
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::PathBuf;

use candle_core::{DType, Device, Tensor};
use qwen36_model::{Cache, LoadOptions, Qwen36Model};
#[allow(unused_imports)]
pub use qwen36_testutil::{max_abs_diff, max_row_rel_err, test_device};

/// The two HF-made fixture models (tools/reference/make_fixtures.py).
pub const FIXTURES: [&str; 2] = ["tiny-flat", "tiny-nested"];

pub fn fixture_dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// Load options for the test device.
pub fn opts(dtype: DType) -> LoadOptions {
    LoadOptions {
        dtype,
        device: test_device(),
        ..Default::default()
    }
}

pub fn load(name: &str, dtype: DType) -> Qwen36Model {
    let opts = opts(dtype);
    Qwen36Model::load(fixture_dir(name), opts).unwrap_or_else(|e| panic!("loading {name}: {e}"))
}

/// HF's outputs for a fixture model: `prompt{i}.{ids,logits,hidden,greedy,greedy_margin}`.
pub fn reference(name: &str) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(fixture_dir(name).join("reference.safetensors"), &Device::Cpu).unwrap()
}

pub fn ids_of(t: &Tensor) -> Vec<u32> {
    t.to_dtype(DType::U32).unwrap().to_vec1::<u32>().unwrap()
}

pub fn ids_tensor(ids: &[u32]) -> Tensor {
    Tensor::new(ids, &test_device()).unwrap().unsqueeze(0).unwrap()
}

/// Greedy decoding from a prompt: prefill, then one token at a time through the cache.
pub fn greedy(model: &Qwen36Model, cache: &mut Cache, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut logits = model.forward_last(&ids_tensor(prompt), cache).unwrap();
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let next = logits.argmax(1).unwrap().to_vec1::<u32>().unwrap()[0];
        out.push(next);
        logits = model.forward_last(&ids_tensor(&[next]), cache).unwrap();
    }
    out
}
