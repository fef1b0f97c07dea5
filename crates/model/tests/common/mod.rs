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
