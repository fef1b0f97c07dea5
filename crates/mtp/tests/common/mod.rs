//! Helpers shared by the speculative decoder's tests: fixture models with their MTP heads, plain
//! (non-speculative) greedy decoding, and one speculative generation.
#![allow(dead_code, unused_imports)]

use qwen36_model::{MtpHead, Qwen36Model};
use qwen36_mtp::{Drafter, SpecConfig, SpecOutput, SpeculativeDecoder};
use qwen36_sampling::SamplingParams;
pub use qwen36_testutil::{
    bundled_reference, fixture_dir, fixture_ids, ids_of, ids_tensor, max_abs_diff, test_device, FIXTURES,
};

#[path = "../../../testutil/include/model.rs"]
mod model_helpers;
pub use model_helpers::{load_bundled, load_options, load_with_head, plain_greedy};

/// The first `len` ids stored under `key` in a fixture model's reference.
pub fn prompt(name: &str, key: &str, len: usize) -> Vec<u32> {
    let mut ids = fixture_ids(name, key);
    ids.truncate(len);
    ids
}

/// A fixture model with its MTP head (f32 on the test device), and the first `len` ids stored
/// under `key` in its reference.
pub fn load_with_prompt(name: &str, key: &str, len: usize) -> (Qwen36Model, MtpHead, Vec<u32>) {
    let (model, head) = load_with_head(name);
    (model, head, prompt(name, key, len))
}

/// A prompt of the bundled model's reference (Python source the model was not trained on).
pub fn bundled_prompt(p: usize) -> Vec<u32> {
    ids_of(&bundled_reference()[&format!("prompt{p}.ids")])
}

/// Settings for `n` new tokens with `k` drafts per verify pass and no stop tokens.
pub fn spec_config(k: usize, n: usize) -> SpecConfig {
    SpecConfig {
        k,
        max_new_tokens: n,
        stop_token_ids: vec![],
    }
}

/// One generation of a fresh decoder with `params`: up to `n` tokens after `prompt`, `k` drafts
/// from `drafter` per verify pass, no stop tokens, every token accepted by the callback.
pub fn speculate(
    model: &Qwen36Model,
    params: SamplingParams,
    drafter: &mut dyn Drafter,
    prompt: &[u32],
    k: usize,
    n: usize,
) -> SpecOutput {
    let mut dec = SpeculativeDecoder::new(model, params).unwrap();
    dec.generate(drafter, prompt, &spec_config(k, n), |_| true)
        .unwrap()
}

/// Every accepted length 0..=k occurred: `hist` counts the cycles by accepted drafts
/// (`SpecStats::accepted_len_hist`).
pub fn assert_every_accepted_length(hist: &[usize], what: &str) {
    assert!(hist.iter().all(|&c| c > 0), "{what}: accepted lengths {hist:?}");
}
