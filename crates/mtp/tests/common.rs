#![allow(dead_code)]
//! Shared helpers: fixture models and plain (non-speculative) greedy decoding.

use std::path::PathBuf;

use candle_core::{DType, Device, Tensor};
use qwen36_model::{LoadOptions, MtpHead, Qwen36Model};
#[allow(unused_imports)]
pub use qwen36_testutil::{max_abs_diff, test_device};

pub fn fixture_dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../model/tests/fixtures")
        .join(name)
}

pub fn load(name: &str) -> (Qwen36Model, MtpHead) {
    let opts = LoadOptions {
        device: test_device(),
        ..Default::default()
    };
    let model = Qwen36Model::load(fixture_dir(name), opts.clone()).unwrap();
    let head = MtpHead::load_dir(fixture_dir(name), model.config(), opts).unwrap();
    (model, head)
}

pub fn prompt(name: &str, key: &str, len: usize) -> Vec<u32> {
    let r = candle_core::safetensors::load(fixture_dir(name).join("reference.safetensors"), &Device::Cpu)
        .unwrap();
    let ids: Vec<u32> = r[key].to_dtype(DType::U32).unwrap().to_vec1().unwrap();
    ids[..len.min(ids.len())].to_vec()
}

pub fn ids(t: &[u32]) -> Tensor {
    Tensor::new(t, &test_device()).unwrap().unsqueeze(0).unwrap()
}

/// Plain greedy decoding, one token per forward.
pub fn plain_greedy(model: &Qwen36Model, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut cache = model.new_cache(1).unwrap();
    let mut logits = model.forward_last(&ids(prompt), &mut cache).unwrap();
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        let t = logits.argmax(1).unwrap().to_vec1::<u32>().unwrap()[0];
        out.push(t);
        if out.len() < n {
            logits = model.forward_last(&ids(&[t]), &mut cache).unwrap();
        }
    }
    out
}

/// The bundled trained model (models/qwen36-tiny): its MTP head's drafts are accepted ~60% of
/// the time, so partial commits and bonus tokens are frequent.
pub fn load_bundled() -> (Qwen36Model, MtpHead) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/qwen36-tiny");
    let opts = LoadOptions {
        device: test_device(),
        ..Default::default()
    };
    let model = Qwen36Model::load(&dir, opts.clone()).unwrap();
    let head = MtpHead::load_dir(&dir, model.config(), opts).unwrap();
    (model, head)
}

/// A prompt of the bundled model's reference (Python source the model was not trained on).
pub fn bundled_prompt(p: usize) -> Vec<u32> {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/qwen36-tiny.reference.safetensors");
    let r = candle_core::safetensors::load(path, &Device::Cpu).unwrap();
    r[&format!("prompt{p}.ids")]
        .to_dtype(DType::U32)
        .unwrap()
        .to_vec1()
        .unwrap()
}
