//! Helpers shared by the generator's integration tests.
#![allow(dead_code, unused_imports)]

use std::path::Path;

use candle_core::DType;
use qwen36::Generator;
pub use qwen36_testutil::{
    bundled_dir, bundled_reference, fixture_dir, fixture_ids, ids_of, load_tensors, test_device,
};

#[path = "../../../testutil/include/model.rs"]
mod model_helpers;
pub use model_helpers::load_options;

/// A generator for the model in `dir`, f32 on the test device.
pub fn load_generator(dir: impl AsRef<Path>) -> Generator {
    let dir = dir.as_ref();
    Generator::load(dir, load_options(DType::F32))
        .unwrap_or_else(|e| panic!("loading {}: {e}", dir.display()))
}
