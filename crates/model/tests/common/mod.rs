//! Helpers shared by the model's integration tests.
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::PathBuf;

use candle_core::{DType, Device, Tensor};
use qwen36_model::{Cache, LoadOptions, Qwen36Model};

/// The two HF-made fixture models (tools/reference/make_fixtures.py).
pub const FIXTURES: [&str; 2] = ["tiny-flat", "tiny-nested"];

pub fn fixture_dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// The device tests run on: CPU, or the first CUDA GPU with `QWEN36_TEST_DEVICE=cuda`
/// (scripts/gpu-check runs every test both ways).
pub fn device() -> Device {
    match std::env::var("QWEN36_TEST_DEVICE").as_deref() {
        Ok("cuda") => Device::new_cuda(0).expect("QWEN36_TEST_DEVICE=cuda but no CUDA device"),
        _ => Device::Cpu,
    }
}

/// Load options for the test device.
pub fn opts(dtype: DType) -> LoadOptions {
    LoadOptions {
        dtype,
        device: device(),
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
    Tensor::new(ids, &device()).unwrap().unsqueeze(0).unwrap()
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

/// Max over rows of `max_j |a_j − b_j| / max_j |b_j|`: error relative to each row's scale.
pub fn max_row_rel_err(a: &Tensor, b: &Tensor) -> f32 {
    let a = a.to_device(&Device::Cpu).unwrap().to_dtype(DType::F32).unwrap();
    let b = b.to_device(&Device::Cpu).unwrap().to_dtype(DType::F32).unwrap();
    let d = a.dims().len() - 1;
    let err = (a - &b).unwrap().abs().unwrap().max_keepdim(d).unwrap();
    let scale = b.abs().unwrap().max_keepdim(d).unwrap();
    (err / scale)
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}
