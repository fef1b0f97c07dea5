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
    for name in FIXTURES {
        let model = load(name, dtype);
        let r = reference(name);
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
        for name in FIXTURES {
            let model = load(name, dtype);
            let r = reference(name);
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
