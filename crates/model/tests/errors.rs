//! Every malformed input gives a typed error that names the culprit, never a panic.

mod common;

use std::path::Path;

use candle_core::{DType, Device, Tensor};
use common::*;
use qwen36_model::{Error, LoadOptions, Qwen36Model};

fn load_dir(dir: &Path) -> Result<Qwen36Model, Error> {
    Qwen36Model::load(dir, load_options(DType::F32))
}

const A_LOG: &str = "model.layers.0.linear_attn.A_log";

#[test]
fn missing_tensor_is_named() {
    let dir = copy_fixture("tiny-flat");
    edit_tensors(dir.path(), "model.safetensors", |m| {
        m.remove(A_LOG);
    });
    let e = load_dir(dir.path()).unwrap_err();
    assert!(matches!(&e, Error::MissingTensor(n) if n == A_LOG), "{e}");
}

#[test]
fn wrong_shape_is_named_with_both_shapes() {
    let dir = copy_fixture("tiny-flat");
    edit_tensors(dir.path(), "model.safetensors", |m| {
        m.insert(A_LOG.into(), Tensor::zeros(3, DType::F32, &Device::Cpu).unwrap());
    });
    let e = load_dir(dir.path()).unwrap_err();
    assert!(
        matches!(&e, Error::TensorShape { name, expected, found } if name == A_LOG && expected == &[4] && found == &[3]),
        "{e}"
    );
}

/// A tensor stored as integers with the right shape is refused by name (it loaded as
/// integer-valued weights).
#[test]
fn integer_tensor_is_named() {
    let dir = copy_fixture("tiny-flat");
    edit_tensors(dir.path(), "model.safetensors", |m| {
        m.insert(A_LOG.into(), Tensor::zeros(4, DType::I64, &Device::Cpu).unwrap());
    });
    let e = load_dir(dir.path()).unwrap_err();
    assert!(
        matches!(&e, Error::TensorDtype { name, stored } if name == A_LOG && stored == "I64"),
        "{e}"
    );
}

#[test]
fn nan_in_weights_is_refused() {
    let dir = copy_fixture("tiny-flat");
    let name = "model.layers.1.self_attn.k_proj.weight";
    edit_tensors(dir.path(), "model.safetensors", |m| {
        let t = &m[name];
        let mut v = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        v[5] = f32::NAN;
        m.insert(name.into(), Tensor::from_vec(v, t.dims(), &Device::Cpu).unwrap());
    });
    let e = load_dir(dir.path()).unwrap_err();
    assert!(matches!(&e, Error::NonFinite(n) if n == name), "{e}");
}

#[test]
fn unknown_layer_type_is_named() {
    let dir = copy_fixture("tiny-nested");
    edit_config(dir.path(), |v| {
        v["text_config"]["layer_types"][2] = "sliding_window".into()
    });
    let e = load_dir(dir.path()).unwrap_err();
    assert!(
        matches!(&e, Error::UnknownLayerType { index: 2, value } if value == "sliding_window"),
        "{e}"
    );
}

#[test]
fn bad_json_names_the_file() {
    let dir = copy_fixture("tiny-flat");
    std::fs::write(dir.path().join("config.json"), "{\"hidden_size\": 64,").unwrap();
    let e = load_dir(dir.path()).unwrap_err();
    assert!(
        matches!(&e, Error::Json { path, .. } if path.ends_with("config.json")),
        "{e}"
    );
}

#[test]
fn non_f32_state_request_is_refused() {
    let dir = copy_fixture("tiny-nested");
    edit_config(dir.path(), |v| {
        v["text_config"]["mamba_ssm_dtype"] = "bfloat16".into()
    });
    let e = load_dir(dir.path()).unwrap_err();
    assert!(matches!(&e, Error::StateDtype(s) if s == "bfloat16"), "{e}");
    assert!(e.to_string().contains("mamba_ssm_dtype"));
}

#[test]
fn missing_files_are_named() {
    let dir = copy_fixture("tiny-nested");
    std::fs::remove_file(dir.path().join("model-00003-of-00010.safetensors")).unwrap();
    let e = load_dir(dir.path()).unwrap_err();
    assert!(
        matches!(&e, Error::MissingFile(p) if p.ends_with("model-00003-of-00010.safetensors")),
        "{e}"
    );

    let empty = tempfile::tempdir().unwrap();
    let e = load_dir(empty.path()).unwrap_err();
    assert!(
        matches!(&e, Error::Io { path, .. } if path.ends_with("config.json")),
        "{e}"
    );
    std::fs::copy(
        fixture_dir("tiny-flat").join("config.json"),
        empty.path().join("config.json"),
    )
    .unwrap();
    let e = load_dir(empty.path()).unwrap_err();
    assert!(matches!(&e, Error::MissingFile(_)), "{e}");
}

/// A tensor stored in two shards is refused by name (the mapped view took one of the two).
#[test]
fn a_tensor_in_two_shards_is_named() {
    let dir = copy_fixture("tiny-nested");
    let name = "model.language_model.layers.0.linear_attn.A_log";
    let doubled = Tensor::ones(4, DType::F32, &Device::Cpu).unwrap();
    edit_tensors(dir.path(), "model-00005-of-00010.safetensors", |m| {
        m.insert(name.into(), doubled);
    });
    let e = load_dir(dir.path()).unwrap_err();
    assert!(
        matches!(&e, Error::DuplicateTensor { name: n, first, second }
            if n == name
                && first.ends_with("model-00002-of-00010.safetensors")
                && second.ends_with("model-00005-of-00010.safetensors")),
        "{e}"
    );
}

#[test]
fn prompt_over_context_bad_ids_and_wrong_cache_are_errors() {
    let dir = copy_fixture("tiny-flat");
    edit_config(dir.path(), |v| v["max_position_embeddings"] = 10.into());
    let model = load_dir(dir.path()).unwrap();
    let mut cache = model.new_cache(1).unwrap();
    let e = model.forward(&ids_tensor(&[1; 11]), &mut cache).unwrap_err();
    assert!(matches!(e, Error::ContextOverflow { needed: 11, max: 10 }), "{e}");
    model.forward(&ids_tensor(&[1; 8]), &mut cache).unwrap();
    let e = model.forward(&ids_tensor(&[1; 3]), &mut cache).unwrap_err();
    assert!(matches!(e, Error::ContextOverflow { needed: 11, max: 10 }), "{e}");

    let e = model
        .forward(&ids_tensor(&[1, 384]), &mut model.new_cache(1).unwrap())
        .unwrap_err();
    assert!(matches!(&e, Error::Input(m) if m.contains("384")), "{e}");
    let e = model
        .forward(&ids_tensor(&[]), &mut model.new_cache(1).unwrap())
        .unwrap_err();
    assert!(matches!(e, Error::Input(_)), "{e}");
    let e = model
        .forward(&ids_tensor(&[1, 2]), &mut model.new_cache(2).unwrap())
        .unwrap_err();
    assert!(matches!(e, Error::Cache(_)), "{e}");
}

#[test]
fn unsupported_dtype_is_refused() {
    let e = Qwen36Model::load(
        fixture_dir("tiny-flat"),
        LoadOptions {
            dtype: DType::U8,
            ..load_options(DType::F32)
        },
    )
    .unwrap_err();
    assert!(matches!(e, Error::Dtype(DType::U8)), "{e}");
}
