//! What the `generate` and `serve` examples share: the `--dtype`, `--cuda` and `--model` flags
//! turned into load options and a model directory (the bundled model by default).

use candle_core::{DType, Device};

/// The activation dtype named by `--dtype`.
pub fn dtype(name: &str) -> Result<DType, String> {
    match name {
        "f32" => Ok(DType::F32),
        "bf16" => Ok(DType::BF16),
        "f16" => Ok(DType::F16),
        other => Err(format!("--dtype {other:?}: expected f32, bf16 or f16")),
    }
}

/// The first CUDA GPU (made so that graphs can record on it) with `cuda`, else the CPU.
pub fn device(cuda: bool) -> qwen36::model::Result<Device> {
    if cuda {
        qwen36::model::cuda_device(0)
    } else {
        Ok(Device::Cpu)
    }
}

/// `--model`, or the bundled model.
pub fn model_dir(model: Option<std::path::PathBuf>) -> std::path::PathBuf {
    model.unwrap_or_else(|| std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/qwen36-tiny"))
}
