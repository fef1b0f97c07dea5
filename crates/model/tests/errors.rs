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

/// A copy of tiny-flat whose tensor `name` holds `value` at one element.
fn tiny_flat_with_value(name: &str, value: f32) -> tempfile::TempDir {
    let dir = copy_fixture("tiny-flat");
    edit_tensors(dir.path(), "model.safetensors", |m| {
        let t = &m[name];
        let mut v = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        v[5] = value;
        m.insert(name.into(), Tensor::from_vec(v, t.dims(), &Device::Cpu).unwrap());
    });
    dir
}

#[test]
fn nan_in_weights_is_refused() {
    let name = "model.layers.1.self_attn.k_proj.weight";
    let dir = tiny_flat_with_value(name, f32::NAN);
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

/// The config's message for `edit` applied to fixture `name`'s config.
fn config_error(name: &str, edit: impl FnOnce(&mut serde_json::Value)) -> String {
    let dir = copy_fixture(name);
    edit_config(dir.path(), edit);
    match qwen36_model::Config::from_file(dir.path().join("config.json")) {
        Ok(_) => panic!("the config was taken"),
        Err(e) => e.to_string(),
    }
}

/// Config values that would size something absurd before any check, or change the model's
/// math without a word (a RoPE scaling beside the default one, a mixture of experts, an ε or
/// θ out of range), are refused naming the field; a `rope_scaling: null` is no scaling.
#[test]
fn config_values_out_of_range_or_ignored_are_named() {
    let unset = |key: &'static str| {
        move |c: &mut serde_json::Value| {
            c.as_object_mut().unwrap().remove(key);
        }
    };
    type Case<'a> = (
        Box<dyn FnOnce(&mut serde_json::Value) + 'a>,
        &'static [&'static str],
    );
    let cases: Vec<Case> = vec![
        (
            Box::new(|c| c["num_hidden_layers"] = 0.into()),
            &["num_hidden_layers", "found 0"],
        ),
        (
            Box::new(|c| {
                unset("layer_types")(c);
                c["num_hidden_layers"] = u64::MAX.into();
            }),
            &["num_hidden_layers", "at most 4096"],
        ),
        (
            Box::new(|c| c["mtp_num_hidden_layers"] = 100_000.into()),
            &["mtp_num_hidden_layers"],
        ),
        (
            Box::new(|c| c["rope_scaling"] = serde_json::json!({"rope_type": "yarn", "factor": 4.0})),
            &["rope_scaling.rope_type", "yarn"],
        ),
        (
            Box::new(|c| c["rope_parameters"]["rope_theta"] = 1e39.into()),
            &["rope_theta", "f32"],
        ),
        (
            Box::new(|c| c["rms_norm_eps"] = 2.0.into()),
            &["rms_norm_eps", "(0, 1)"],
        ),
        // (The bounds themselves: ε of 0 and of 1 are out.)
        (Box::new(|c| c["rms_norm_eps"] = 0.0.into()), &["rms_norm_eps"]),
        (Box::new(|c| c["rms_norm_eps"] = 1.0.into()), &["rms_norm_eps"]),
        (
            Box::new(|c| c["num_experts"] = 8.into()),
            &["num_experts", "mixture-of-experts"],
        ),
    ];
    for (edit, says) in cases {
        let e = config_error("tiny-flat", edit);
        for s in says {
            assert!(e.contains(s), "{e:?} should say {s:?}");
        }
    }
    let e = config_error("tiny-nested", |c| {
        c["text_config"]["rope_scaling"] = serde_json::json!({"type": "linear", "factor": 2.0})
    });
    assert!(e.contains("text_config.rope_scaling.rope_type"), "{e}");
    let dir = copy_fixture("tiny-flat");
    edit_config(dir.path(), |c| c["rope_scaling"] = serde_json::Value::Null);
    qwen36_model::Config::from_file(dir.path().join("config.json")).unwrap();
    edit_config(dir.path(), |c| {
        c.as_object_mut().unwrap().remove("layer_types");
        c["num_hidden_layers"] = 4096.into();
        c["mtp_num_hidden_layers"] = 4096.into();
        c["num_experts"] = 0.into();
    });
    let cfg = qwen36_model::Config::from_file(dir.path().join("config.json")).unwrap();
    assert_eq!((cfg.num_hidden_layers, cfg.mtp_num_hidden_layers), (4096, 4096));
    // Multimodal RoPE (Qwen2-VL's legacy form) is the plain one for text.
    edit_config(dir.path(), |c| {
        c["rope_scaling"] = serde_json::json!({"type": "mrope", "mrope_section": [2, 1, 1]})
    });
    qwen36_model::Config::from_file(dir.path().join("config.json")).unwrap();
}

/// A sharded checkpoint's index names files of its directory: a name leading out of it is
/// refused, naming the entry. Tensors are found by the files' own headers, so an entry for a
/// tensor no shard holds (published indexes have them, e.g. an MTP head left out) or placed
/// in another file loads as before.
#[test]
fn an_index_names_files_of_its_directory() {
    let name = "model.language_model.layers.0.linear_attn.A_log";
    let index = "model.safetensors.index.json";
    let edit_index = |edit: &dyn Fn(&mut serde_json::Map<String, serde_json::Value>)| {
        let dir = copy_fixture("tiny-nested");
        let path = dir.path().join(index);
        let mut v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        edit(v["weight_map"].as_object_mut().unwrap());
        std::fs::write(&path, v.to_string()).unwrap();
        load_dir(dir.path())
    };
    let e = edit_index(&|m| {
        m.insert(name.into(), "../model-00002-of-00010.safetensors".into());
    })
    .unwrap_err()
    .to_string();
    assert!(
        e.contains(&format!("weight_map.{name}")) && e.contains("expected a file name"),
        "{e}"
    );
    edit_index(&|m| {
        m.insert("mtp.fc.weight".into(), "model-00001-of-00010.safetensors".into());
        m.insert(name.into(), "model-00005-of-00010.safetensors".into());
    })
    .unwrap();
}

/// Finite weights that overflow f16 (beyond ±65504) are named as such, not as NaN; the same
/// checkpoint loads in bf16.
#[test]
fn weights_beyond_f16_are_named() {
    let name = "model.layers.1.self_attn.k_proj.weight";
    let dir = tiny_flat_with_value(name, 1e5);
    let e = Qwen36Model::load(dir.path(), load_options(DType::F16)).unwrap_err();
    assert!(
        matches!(&e, Error::OutOfRange { name: n, dtype: DType::F16 } if n == name),
        "{e}"
    );
    Qwen36Model::load(dir.path(), load_options(DType::BF16)).unwrap();
}
