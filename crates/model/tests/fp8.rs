//! FP8 checkpoints (the format of Qwen's `-FP8` models, HF FineGrainedFP8) against transformers:
//! the `tiny-fp8` fixture (tools/reference/make_fp8_fixture.py) is tiny-flat with its attention,
//! MLP and GDN projections (main and MTP layers) in float8 e4m3 with 32×32 block scales, bf16 in
//! the main layers and f32 in the MTP layer. The reference is transformers' `qwen3_5` over the
//! dequantized weights in f32, whose weights equal transformers' own FP8 dequantization bit for
//! bit (recorded by the script). An e4m3 value (4 significant bits) times a bf16 or f32 scale is
//! exact in f32, so the weights are the reference's exactly and only summation order differs:
//! the same 1e-4 of each row's scale as `hf_reference.rs`.

mod common;

use std::path::Path;

use candle_core::{DType, Device, IndexOp, Tensor};
use common::*;
use qwen36_model::{MtpHead, Qwen36Model};

const FP8: &str = "tiny-fp8";

/// The dense checkpoint of the same (dequantized) weights, written by the same script.
fn dense_dir() -> std::path::PathBuf {
    fixture_dir(FP8).join("dense")
}

#[test]
fn fp8_logits_hidden_states_greedy_and_mtp_match_transformers() {
    let (model, r) = load_with_reference(FP8, DType::F32);
    assert_eq!(
        r["hf_fp8_weight_max_abs_diff"].to_vec1::<f32>().unwrap(),
        vec![0.0],
        "the fixture's dequantization is transformers' own"
    );
    for p in 0..2 {
        let ids = ids_of(&r[&format!("prompt{p}.ids")]);
        let mut cache = model.new_cache(1).unwrap();
        let hidden = model
            .forward_hidden(&ids_tensor(&ids), &mut cache)
            .unwrap()
            .squeeze(0)
            .unwrap();
        let logits = model.logits(&hidden).unwrap();
        let err = max_row_rel_err(&logits, &r[&format!("prompt{p}.logits")]);
        let hf_hidden = r[&format!("prompt{p}.hidden")]
            .i(model.config().num_hidden_layers)
            .unwrap();
        let herr = max_row_rel_err(&hidden, &hf_hidden);
        eprintln!("tiny-fp8 prompt{p}: logits rel err {err:.2e}, hidden {herr:.2e}");
        assert!(
            err <= 1e-4 && herr <= 1e-4,
            "prompt{p}: logits {err}, hidden {herr}"
        );
        let want = ids_of(&r[&format!("prompt{p}.greedy")]);
        assert_eq!(
            plain_greedy(&model, &ids, want.len()),
            want,
            "prompt{p}: greedy continuation"
        );
    }
    // The MTP head (its layer in FP8 with f32 scales, mtp.fc dense).
    let head = MtpHead::load_dir(fixture_dir(FP8), model.config(), load_options(DType::F32)).unwrap();
    let ids = ids_of(&r["prompt0.ids"]);
    let mut next: Vec<u32> = ids[1..].to_vec();
    next.push(ids_of(&r["prompt0.greedy"])[0]);
    let mut cache = model.new_cache(1).unwrap();
    let hidden = model.forward_hidden(&ids_tensor(&ids), &mut cache).unwrap();
    let d = head
        .forward(&model, &hidden, &ids_tensor(&next), &mut head.new_cache(), 0)
        .unwrap();
    let err = max_row_rel_err(
        &model.logits(&d).unwrap().squeeze(0).unwrap(),
        &r["prompt0.mtp_logits"],
    );
    eprintln!("tiny-fp8: MTP logits rel err {err:.2e}");
    assert!(err <= 1e-4, "MTP logits {err}");
}

/// The FP8 model computes what a dense model of its dequantized weights computes: the same bits
/// on the CPU in f32 and bf16 (each weight rounded once to the activation dtype either way). On
/// CUDA the FP8 kernels keep the f32 products of the dequantized weights where the dense bf16
/// model rounds its weights to bf16, so there bf16 is held to twice transformers' own bf16 error
/// on this model (`prompt0.hf_bf16_rel_err`), f32 to 1e-4.
#[test]
fn fp8_model_equals_the_dense_model_of_its_weights() {
    let r = fixture_reference(FP8);
    let ids = ids_tensor(&ids_of(&r["prompt0.ids"]));
    let cuda = test_device().is_cuda();
    let hf_bf16 = r["prompt0.hf_bf16_rel_err"].to_vec1::<f32>().unwrap()[0];
    for dtype in [DType::F32, DType::BF16] {
        let fp8 = load(FP8, dtype);
        let dense = load_at(dense_dir(), dtype);
        let run = |m: &Qwen36Model| {
            let mut cache = m.new_cache(1).unwrap();
            m.forward(&ids, &mut cache)
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap()
                .squeeze(0)
                .unwrap()
        };
        let (a, b) = (run(&fp8), run(&dense));
        let (abs, rel) = (max_abs_diff(&a, &b), max_row_rel_err(&a, &b));
        eprintln!("{dtype:?}: FP8 against dense: max |d| {abs:.3e}, row rel {rel:.3e}");
        match (cuda, dtype) {
            (false, _) => assert_eq!(abs, 0.0, "{dtype:?}: FP8 and dense differ on the CPU"),
            (true, DType::F32) => assert!(rel <= 1e-4, "{rel}"),
            (true, _) => assert!(
                rel <= 2.0 * hf_bf16,
                "{rel} against HF's own bf16 error {hf_bf16}"
            ),
        }
    }
}

fn load_error(dir: &Path) -> String {
    match Qwen36Model::load(dir, load_options(DType::F32)) {
        Ok(_) => panic!("a broken FP8 checkpoint loaded"),
        Err(e) => e.to_string(),
    }
}

const Q: &str = "model.layers.0.mlp.down_proj";

/// Every malformed FP8 checkpoint is refused with an error naming the field or tensor: another
/// quantization method (never read as plain numbers), another format or activation scheme, no
/// block size, FP8 tensors without a quantization config, a missing, misshapen or non-finite
/// scale, a NaN weight, an FP8 tensor where a plain one is read.
#[test]
fn malformed_fp8_checkpoints_are_typed_errors() {
    type Case = (&'static str, Box<dyn Fn(&Path)>, &'static [&'static str]);
    let cases: Vec<Case> = vec![
        (
            "awq",
            Box::new(|d| edit_config(d, |c| c["quantization_config"]["quant_method"] = "awq".into())),
            &["quantization_config.quant_method", "\"awq\" is not supported"],
        ),
        (
            "gptq without fp8 fields",
            Box::new(|d| {
                edit_config(d, |c| {
                    c["quantization_config"] = serde_json::json!({"quant_method": "gptq", "bits": 4})
                })
            }),
            &["\"gptq\""],
        ),
        (
            "e5m2",
            Box::new(|d| edit_config(d, |c| c["quantization_config"]["fmt"] = "e5m2".into())),
            &["quantization_config.fmt", "e5m2"],
        ),
        (
            "static activations",
            Box::new(|d| {
                edit_config(d, |c| {
                    c["quantization_config"]["activation_scheme"] = "static".into()
                })
            }),
            &["activation_scheme", "static"],
        ),
        (
            "per-tensor",
            Box::new(|d| {
                edit_config(d, |c| {
                    c["quantization_config"]
                        .as_object_mut()
                        .unwrap()
                        .remove("weight_block_size");
                })
            }),
            &["weight_block_size", "per-tensor"],
        ),
        (
            "zero block",
            Box::new(|d| {
                edit_config(d, |c| {
                    c["quantization_config"]["weight_block_size"] = serde_json::json!([0, 32])
                })
            }),
            &["weight_block_size", "positive"],
        ),
        (
            "no quantization_config",
            Box::new(|d| {
                edit_config(d, |c| {
                    c.as_object_mut().unwrap().remove("quantization_config");
                })
            }),
            &["float8 e4m3", "declares no quantization_config"],
        ),
        (
            "missing scale",
            Box::new(|d| {
                edit_tensors(d, "model.safetensors", |m| {
                    m.remove(&format!("{Q}.weight_scale_inv"));
                })
            }),
            &[Q, "weight_scale_inv", "missing"],
        ),
        (
            "scale shape",
            Box::new(|d| {
                edit_tensors(d, "model.safetensors", |m| {
                    m.insert(
                        format!("{Q}.weight_scale_inv"),
                        Tensor::ones((1, 1), DType::BF16, &Device::Cpu).unwrap(),
                    );
                })
            }),
            &["down_proj.weight_scale_inv", "[2, 4]"],
        ),
        (
            "NaN scale",
            Box::new(|d| {
                edit_tensors(d, "model.safetensors", |m| {
                    let s = m[&format!("{Q}.weight_scale_inv")].to_dtype(DType::F32).unwrap();
                    let nan = (s.ones_like().unwrap() * f64::NAN).unwrap();
                    m.insert(
                        format!("{Q}.weight_scale_inv"),
                        nan.to_dtype(DType::BF16).unwrap(),
                    );
                })
            }),
            &["down_proj.weight_scale_inv"],
        ),
        (
            "integer scale",
            Box::new(|d| {
                edit_tensors(d, "model.safetensors", |m| {
                    let s = m[&format!("{Q}.weight_scale_inv")].to_dtype(DType::I64).unwrap();
                    m.insert(format!("{Q}.weight_scale_inv"), s);
                })
            }),
            &["down_proj.weight_scale_inv", "I64"],
        ),
        (
            "NaN weight",
            Box::new(|d| {
                edit_tensors(d, "model.safetensors", |m| {
                    let (o, i) = m[&format!("{Q}.weight")].dims2().unwrap();
                    let mut bytes = vec![0x38u8; o * i]; // 1.0
                    bytes[7] = 0x7F; // e4m3 NaN
                    let t = Tensor::from_raw_buffer(&bytes, DType::F8E4M3, &[o, i], &Device::Cpu).unwrap();
                    m.insert(format!("{Q}.weight"), t);
                })
            }),
            &["down_proj.weight"],
        ),
        (
            "FP8 norm",
            Box::new(|d| {
                edit_tensors(d, "model.safetensors", |m| {
                    let name = "model.norm.weight";
                    let t = m[name].to_dtype(DType::F8E4M3).unwrap();
                    m.insert(name.into(), t);
                })
            }),
            &["model.norm.weight", "float8 e4m3"],
        ),
    ];
    for (what, edit, says) in cases {
        let dir = copy_fixture(FP8);
        edit(dir.path());
        let e = load_error(dir.path());
        for s in says {
            assert!(e.contains(s), "{what}: {e:?} should say {s:?}");
        }
    }
}

/// Block scales stored in f64 (the format says f32; some converters write doubles) read as
/// their f32 values: the same logits as the checkpoint with f32 scales.
#[test]
fn f64_block_scales_read_as_f32() {
    let dir = copy_fixture(FP8);
    edit_tensors(dir.path(), "model.safetensors", |m| {
        let name = format!("{Q}.weight_scale_inv");
        let s = m[&name].to_dtype(DType::F64).unwrap();
        m.insert(name, s);
    });
    let ids = ids_tensor(&ids_of(&fixture_reference(FP8)["prompt0.ids"]));
    let run = |m: &Qwen36Model| {
        let mut cache = m.new_cache(1).unwrap();
        m.forward(&ids, &mut cache)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
    };
    let doubles = Qwen36Model::load(dir.path(), load_options(DType::F32)).unwrap();
    assert_eq!(run(&doubles), run(&load(FP8, DType::F32)));
}

/// On sm_90 an FP8 model with Qwen's 128×128 blocks runs its FP8 layers of many rows (a prefill)
/// through the FP8 GEMM, its activations quantized to e4m3 (w8a8), where under
/// `Fp8GemmPath::Dequantize` they stay bf16 (w8a16: the tile kernel up to 48 rows): the same
/// random model (hidden 512, every FP8 layer whole 128-column blocks, a multiple of 4 of them a
/// row) in both, its final
/// hidden states of a 40-token prefill within 10% of each other per row (an e4m3 rounding moves
/// each activation by at most 2⁻⁴ of itself, its layer's output by a few percent of its size; a
/// wrong scale or a misplaced block moves them by their whole size) and not equal (the GEMM ran).
#[cfg(feature = "cuda")]
#[test]
fn fp8_prefill_through_the_gemm_stays_near_the_dequantized_model() {
    use qwen36_kernels::{Fp8GemmPath, KernelPolicy};
    use qwen36_model::{Config, LoadOptions, Weights};
    let dev = test_device();
    if !dev.is_cuda() {
        return;
    }
    assert!(
        qwen36_kernels::linear::fp8_gemm_available(&dev),
        "the FP8 GEMM needs an sm_90 device"
    );
    let mut cfg = Config::from_file(qwen36_testutil::bundled_dir().join("config.json")).unwrap();
    cfg.hidden_size = 512;
    cfg.intermediate_size = 1024;
    cfg.num_attention_heads = 8;
    cfg.linear_key_head_dim = 64;
    cfg.linear_value_head_dim = 64;
    cfg.linear_num_key_heads = 4;
    cfg.linear_num_value_heads = 8;
    cfg.num_hidden_layers = 4;
    cfg.layer_types.truncate(4);
    let hidden = |fp8_gemm| {
        let kernels = KernelPolicy {
            fp8_gemm,
            ..KernelPolicy::DEFAULT
        };
        let opts = LoadOptions {
            dtype: DType::BF16,
            device: dev.clone(),
            kernels,
            ..LoadOptions::default()
        };
        // The same dense weights in both models (the FP8 ones are made from a fixed seed).
        dev.set_seed(7).unwrap();
        let model = Qwen36Model::from_weights(cfg.clone(), &Weights::random_fp8(opts, [128, 128])).unwrap();
        let ids: Vec<u32> = (0..40).map(|i| (i * 97 + 13) % 4096).collect();
        model
            .forward_hidden(&ids_tensor(&ids), &mut model.new_cache(1).unwrap())
            .unwrap()
            .squeeze(0)
            .unwrap()
    };
    let (w8a8, w8a16) = (hidden(Fp8GemmPath::Auto), hidden(Fp8GemmPath::Dequantize));
    let rel = max_row_rel_err(&w8a8, &w8a16);
    eprintln!("FP8 GEMM (w8a8) against w8a16: row rel err {rel:.3e}");
    assert!(rel <= 0.1 && rel > 0.0, "{rel}");
}
