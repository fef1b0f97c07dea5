//! Test helpers that need qwen36-model: loading onto the test device and greedy decoding.
//!
//! Not a module of qwen36-testutil (which cannot depend on qwen36-model: qwen36-kernels
//! dev-depends on it). The suites of the crates that depend on qwen36-model compile it into
//! themselves:
//!
//! ```ignore
//! #[path = "../../testutil/include/model.rs"] // relative to the including file's folder
//! mod model_helpers;
//! ```
#![allow(dead_code)]

use std::path::Path;

use candle_core::DType;
use qwen36_model::{Cache, LoadOptions, MtpHead, Qwen36Model};
use qwen36_testutil::{bundled_dir, fixture_dir, ids_tensor, test_device};

/// Load options for the test device.
pub fn load_options(dtype: DType) -> LoadOptions {
    LoadOptions {
        dtype,
        device: test_device(),
        ..Default::default()
    }
}

/// The model in `dir` on the test device; panics naming the directory.
pub fn load_at(dir: impl AsRef<Path>, dtype: DType) -> Qwen36Model {
    let dir = dir.as_ref();
    Qwen36Model::load(dir, load_options(dtype)).unwrap_or_else(|e| panic!("loading {}: {e}", dir.display()))
}

/// A fixture model (crates/model/tests/fixtures/<name>) on the test device.
pub fn load(name: &str, dtype: DType) -> Qwen36Model {
    load_at(fixture_dir(name), dtype)
}

/// The model in `dir` and its MTP head, f32 on the test device.
pub fn load_with_head_at(dir: impl AsRef<Path>) -> (Qwen36Model, MtpHead) {
    let dir = dir.as_ref();
    let model = load_at(dir, DType::F32);
    let head = MtpHead::load_dir(dir, model.config(), load_options(DType::F32))
        .unwrap_or_else(|e| panic!("loading the MTP head of {}: {e}", dir.display()));
    (model, head)
}

/// A fixture model and its MTP head, f32 on the test device.
pub fn load_with_head(name: &str) -> (Qwen36Model, MtpHead) {
    load_with_head_at(fixture_dir(name))
}

/// The bundled trained model (models/qwen36-tiny) and its MTP head, f32 on the test device: its
/// drafts are accepted ~60% of the time, so partial commits and bonus tokens are frequent.
pub fn load_bundled() -> (Qwen36Model, MtpHead) {
    load_with_head_at(bundled_dir())
}

/// Plain greedy decoding of `n` tokens: `prompt` through `cache`, then one token per forward (none
/// after the last token). Ties go to the lowest id, as the samplers and the engine break them
/// (half-precision logits tie now and then; candle's argmax promises no order).
pub fn greedy(model: &Qwen36Model, cache: &mut Cache, prompt: &[u32], n: usize) -> Vec<u32> {
    let next = |h: candle_core::Tensor| {
        let last = h.narrow(1, h.dim(1).unwrap() - 1, 1).unwrap();
        model
            .greedy_ids(&last)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<u32>()
            .unwrap()[0]
    };
    let mut tok = next(model.forward_hidden(&ids_tensor(prompt), cache).unwrap());
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        out.push(tok);
        if out.len() < n {
            tok = next(model.forward_hidden(&ids_tensor(&[tok]), cache).unwrap());
        }
    }
    out
}

/// [`greedy`] from a fresh cache.
pub fn plain_greedy(model: &Qwen36Model, prompt: &[u32], n: usize) -> Vec<u32> {
    greedy(model, &mut model.new_cache(1).unwrap(), prompt, n)
}
