//! bf16 / f16 activations against HF's float32 logits.
//!
//! Tolerance: HF's own bf16/f16 model, loaded from the same checkpoint, lands at some distance from
//! its f32 output (stored in the fixture as `prompt0.hf_{bf16,f16}_rel_err`: 5e-2 to 1e-1 for bf16,
//! under 1e-2 for f16 on these models). Rounding in a different order gives errors of the same size,
//! so ours must be within 2× of the reference's own (measured on CPU: bf16 0.85×-1.24×, f16 1.5× and 3.3×, see below; candle's CPU half matmuls
//! accumulate in f32 like torch's). A convention error moves logits by O(1) of
//! the row scale (the f32 mutation check shows 1.2), far outside this bound.

mod common;

use candle_core::DType;
use common::*;

fn check(dtype: DType, key: &str, factor: f32) {
    for (name, model, r) in fixture_models(dtype) {
        let hf_err = r[&format!("prompt0.hf_{key}_rel_err")].to_vec1::<f32>().unwrap()[0];
        let tol = factor * hf_err;
        let ids = ids_of(&r["prompt0.ids"]);
        let mut cache = model.new_cache(1).unwrap();
        let logits = model
            .forward(&ids_tensor(&ids), &mut cache)
            .unwrap()
            .squeeze(0)
            .unwrap();
        let err = max_row_rel_err(&logits, &r["prompt0.logits"]);
        eprintln!("{name} {dtype:?}: logits max row-relative error {err:.3e} (HF's own: {hf_err:.3e})");
        assert!(err <= tol, "{name} {dtype:?}: {err} > {tol}");
        // The GDN recurrent state stays f32 whatever the activation dtype.
        for l in cache.layers() {
            if let qwen36_model::LayerCache::Gdn(s) = l {
                assert_eq!(s.recurrent().dtype(), DType::F32);
                assert_eq!(s.conv().dtype(), dtype);
            }
        }
    }
}

#[test]
fn bf16_logits_within_rounding_of_f32_reference() {
    check(DType::BF16, "bf16", 2.0);
}

#[test]
fn f16_logits_within_rounding_of_f32_reference() {
    // f16: every layer's residual stream is at parity with HF's (see `per_layer_errors`), but one
    // early position (row 1) of the last GDN layer of tiny-nested lands at 3.3× HF's own error: the
    // gated norm normalises a small read-out there and amplifies input rounding. Bound: 4×.
    check(DType::F16, "f16", 4.0);
}

/// Diagnostic (run with --ignored --nocapture): per-layer error of the residual stream.
#[test]
#[ignore]
fn per_layer_errors() {
    use candle_core::IndexOp;
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        for (name, model, r) in fixture_models(dtype) {
            let ids = ids_of(&r["prompt0.ids"]);
            let mut cache = model.new_cache(1).unwrap();
            let (fin, states) = model
                .forward_hidden_states(&ids_tensor(&ids), &mut cache)
                .unwrap();
            let l = states.len() - 1;
            let fin_err = max_row_rel_err(&fin.squeeze(0).unwrap(), &r["prompt0.hidden"].i(l).unwrap());
            let logit_err = max_row_rel_err(
                &model.logits(&fin).unwrap().squeeze(0).unwrap(),
                &r["prompt0.logits"],
            );
            eprintln!("{name} {dtype:?}: final norm {fin_err:.1e}, logits {logit_err:.1e}");
            let errs: Vec<String> = states
                .iter()
                .enumerate()
                .map(|(i, s)| {
                    format!(
                        "{:.1e}",
                        max_row_rel_err(&s.squeeze(0).unwrap(), &r["prompt0.hidden"].i(i).unwrap())
                    )
                })
                .collect();
            eprintln!("{name} {dtype:?}: {}", errs.join(" "));
        }
    }
}

/// HF's own half-precision steps (tools/reference/half_reference.py): P prompt tokens, then S
/// decode steps.
const P: usize = 70;
const S: usize = 6;
/// Tokens of the verify pass checked against HF's decode steps.
const V: usize = 4;

fn half_reference(name: &str) -> std::collections::HashMap<String, candle_core::Tensor> {
    load_tensors(fixture_dir(name).join("half_reference.safetensors"))
}

/// Per-layer row-relative errors of `ours` (`layers + 1` tensors `[rows, hidden]`: the residual
/// stream entering each layer, then the final-norm output) against HF's `[layers + 1, rows,
/// hidden]`.
fn layer_errors(ours: &[candle_core::Tensor], hf: &candle_core::Tensor) -> Vec<f32> {
    use candle_core::IndexOp;
    ours.iter()
        .enumerate()
        .map(|(l, x)| max_row_rel_err(x, &hf.i(l).unwrap()))
        .collect()
}

/// Our prefill and decode steps in `dtype`, layer by layer, and a verify pass's logits: errors
/// against HF in the same dtype, and HF's own distance from its f32 steps, per layer.
struct StepErrors {
    prefill: Vec<f32>,
    decode: Vec<f32>,
    verify_logits: f32,
    hf_prefill: Vec<f32>,
    hf_decode: Vec<f32>,
}

/// Runs `ids` after `cache` and returns what HF's `output_hidden_states` holds: the residual
/// stream entering each layer, then the final-norm output, each `[len, hidden]`.
fn hf_layout_states(
    model: &qwen36_model::Qwen36Model,
    ids: &[u32],
    cache: &mut qwen36_model::Cache,
) -> Vec<candle_core::Tensor> {
    let (fin, mut states) = model.forward_hidden_states(&ids_tensor(ids), cache).unwrap();
    states.pop();
    states.push(fin);
    states.iter().map(|s| s.squeeze(0).unwrap()).collect()
}

fn step_errors(name: &str, dtype: DType, key: &str) -> StepErrors {
    use candle_core::IndexOp;
    let (model, r) = load_with_reference(name, dtype);
    let h = half_reference(name);
    let ids = ids_of(&r["prompt0.ids"]);
    let hf_f32_prefill = &h["f32.prefill.hidden"];
    let hf_prefill = &h[&format!("{key}.prefill.hidden")];
    let hf_decode = &h[&format!("{key}.decode.hidden")]; // [S, layers + 1, hidden]

    let mut cache = model.new_cache(1).unwrap();
    let states = hf_layout_states(&model, &ids[..P + S], &mut cache);
    let prefill = layer_errors(&states, hf_prefill);
    let hf_prefill_own: Vec<f32> = (0..states.len())
        .map(|l| max_row_rel_err(&hf_prefill.i(l).unwrap(), &hf_f32_prefill.i(l).unwrap()))
        .collect();

    let mut cache = model.new_cache(1).unwrap();
    model.forward(&ids_tensor(&ids[..P]), &mut cache).unwrap();
    let mut verify_cache = cache.clone();
    let mut decode = vec![0f32; states.len()];
    let mut hf_decode_own = vec![0f32; states.len()];
    for s in 0..S {
        let st = hf_layout_states(&model, &ids[P + s..P + s + 1], &mut cache);
        let hf_s = hf_decode.i(s).unwrap().unsqueeze(1).unwrap();
        let hf32_s = h["f32.decode.hidden"].i(s).unwrap().unsqueeze(1).unwrap();
        for (l, e) in layer_errors(&st, &hf_s).into_iter().enumerate() {
            decode[l] = decode[l].max(e);
            let own = max_row_rel_err(&hf_s.i(l).unwrap(), &hf32_s.i(l).unwrap());
            hf_decode_own[l] = hf_decode_own[l].max(own);
        }
    }
    let hv = model
        .forward_verify(&ids_tensor(&ids[P..P + V]), &mut verify_cache)
        .unwrap();
    let verify_logits = max_row_rel_err(
        &model.logits(&hv).unwrap().squeeze(0).unwrap(),
        &h[&format!("{key}.decode.logits")].narrow(0, 0, V).unwrap(),
    );
    StepErrors {
        prefill,
        decode,
        verify_logits,
        hf_prefill: hf_prefill_own,
        hf_decode: hf_decode_own,
    }
}

fn fmt(v: &[f32]) -> String {
    v.iter().map(|e| format!("{e:.2e}")).collect::<Vec<_>>().join(" ")
}

/// Our errors against HF's own steps in the same dtype, measured on the CPU: per layer (the
/// residual stream entering each layer, then the final-norm output) for the prefill and the
/// decode steps, then the verify pass's logits. The two implementations round at different
/// points (ours keeps the GDN read-out in f32 up to the gated norm, HF rounds it; HF rounds
/// the normalised value before the `(1 + w)` scale), so they part by a few half ulps from the
/// first layer on, growing with depth; layer 0 (the embedding) is exact.
struct Measured {
    name: &'static str,
    dtype: DType,
    prefill: &'static [f32],
    decode: &'static [f32],
    verify: f32,
}

const MEASURED: [Measured; 4] = [
    Measured {
        name: "tiny-flat",
        dtype: DType::BF16,
        prefill: &[0.0, 1.29e-2, 1.56e-2, 2.25e-2, 3.45e-2, 4.11e-2, 5.07e-2],
        decode: &[0.0, 8.20e-3, 1.56e-2, 1.96e-2, 2.41e-2, 2.53e-2, 4.38e-2],
        verify: 2.2e-2,
    },
    Measured {
        name: "tiny-nested",
        dtype: DType::BF16,
        prefill: &[0.0, 1.31e-2, 2.35e-2, 2.71e-2, 3.15e-2, 6.36e-2],
        decode: &[0.0, 1.31e-2, 1.77e-2, 1.86e-2, 2.37e-2, 2.76e-2],
        verify: 2.6e-2,
    },
    Measured {
        name: "tiny-flat",
        dtype: DType::F16,
        prefill: &[0.0, 2.87e-3, 3.98e-3, 4.03e-3, 1.06e-2, 9.00e-3, 1.73e-2],
        decode: &[0.0, 1.03e-3, 1.70e-3, 2.15e-3, 3.43e-3, 4.34e-3, 6.70e-3],
        verify: 2.1e-3,
    },
    Measured {
        name: "tiny-nested",
        dtype: DType::F16,
        prefill: &[0.0, 1.67e-3, 2.78e-3, 3.52e-3, 3.58e-3, 1.85e-2],
        decode: &[0.0, 1.09e-3, 1.97e-3, 1.94e-3, 2.39e-3, 5.45e-3],
        verify: 4.2e-3,
    },
];

/// bf16 and f16 prefill, decode and verify steps against HF's own steps in the same dtype, layer
/// by layer, within 1.5× the errors measured when the bounds were set (headroom for a change of
/// summation order; on CUDA, whose kernels fuse and reduce in another order, 3×). A norm computed
/// in half precision instead of f32 raises the first layers' f16 errors 1.6-2.8×, past these
/// bounds; a convention error moves them by O(1).
#[test]
fn half_steps_within_measured_bounds_of_hf_half_steps() {
    let factor = if test_device().is_cuda() { 3.0 } else { 1.5 };
    for m in &MEASURED {
        let key = if m.dtype == DType::BF16 { "bf16" } else { "f16" };
        let e = step_errors(m.name, m.dtype, key);
        eprintln!("{} {key} prefill ours-HF: {}", m.name, fmt(&e.prefill));
        eprintln!("{} {key} prefill HF-f32:  {}", m.name, fmt(&e.hf_prefill));
        eprintln!("{} {key} decode  ours-HF: {}", m.name, fmt(&e.decode));
        eprintln!("{} {key} decode  HF-f32:  {}", m.name, fmt(&e.hf_decode));
        eprintln!(
            "{} {key} verify logits ours-HF decode: {:.2e}",
            m.name, e.verify_logits
        );
        for (what, errs, bounds) in [
            ("prefill", &e.prefill, m.prefill),
            ("decode", &e.decode, m.decode),
        ] {
            assert_eq!(errs.len(), bounds.len());
            for (l, (err, b)) in errs.iter().zip(bounds.iter()).enumerate() {
                assert!(
                    *err <= factor * b,
                    "{} {key} {what} layer {l}: {err:.2e} > {factor} × {b:.2e}",
                    m.name
                );
            }
        }
        assert!(
            e.verify_logits <= factor * m.verify,
            "{} {key} verify logits: {:.2e} > {factor} × {:.2e}",
            m.name,
            e.verify_logits,
            m.verify
        );
    }
}
