//! The model against HF transformers' `qwen3_5` (fixtures from tools/reference/make_fixtures.py,
//! float32 on CPU). Tolerance: 1e-4 relative to each row's largest |value|. Both sides compute in
//! f32 with different summation orders (chunked GDN, matmul blocking), so ~1e-6 relative error per
//! op compounding over 5-6 layers is expected; 1e-4 leaves room for that and nothing else: a
//! convention error (a missing 1+w, a wrong head mapping, a mis-ordered decay) moves logits by O(1).

mod common;

use candle_core::{DType, IndexOp};
use common::*;

#[test]
fn prompt_logits_and_hidden_states_match_hf() {
    for (name, model, r) in fixture_models(DType::F32) {
        for p in 0..2 {
            let ids = ids_of(&r[&format!("prompt{p}.ids")]);
            let mut cache = model.new_cache(1).unwrap();
            let hidden = model
                .forward_hidden(&ids_tensor(&ids), &mut cache)
                .unwrap()
                .squeeze(0)
                .unwrap();
            let logits = model.logits(&hidden).unwrap();
            let logits_err = max_row_rel_err(&logits, &r[&format!("prompt{p}.logits")]);
            assert!(
                logits_err <= 1e-4,
                "{name} prompt{p}: logits max relative error {logits_err}"
            );
            // HF's last hidden state is after the final norm, like ours.
            let hf_hidden = r[&format!("prompt{p}.hidden")]
                .i(model.config().num_hidden_layers)
                .unwrap();
            let err = max_row_rel_err(&hidden, &hf_hidden);
            assert!(
                err <= 1e-4,
                "{name} prompt{p}: final hidden max relative error {err}"
            );
            eprintln!(
                "{name} prompt{p}: T={} logits rel err {logits_err:.2e}, hidden {err:.2e}",
                ids.len()
            );
        }
    }
}

#[test]
fn greedy_continuation_matches_hf() {
    for (name, model, r) in fixture_models(DType::F32) {
        for p in 0..2 {
            let ids = ids_of(&r[&format!("prompt{p}.ids")]);
            let want = ids_of(&r[&format!("prompt{p}.greedy")]);
            assert!(want.len() >= 40);
            let got = plain_greedy(&model, &ids, want.len());
            assert_eq!(got, want, "{name} prompt{p}: greedy continuation differs from HF");
        }
    }
}

#[test]
fn prefill_then_decode_equals_prefill() {
    for (name, model, r) in fixture_models(DType::F32) {
        let ids = ids_of(&r["prompt0.ids"]);
        let t = ids.len();
        let mut c1 = model.new_cache(1).unwrap();
        let full = model
            .forward(&ids_tensor(&ids), &mut c1)
            .unwrap()
            .i((0, t - 1))
            .unwrap();
        let mut c2 = model.new_cache(1).unwrap();
        model.forward(&ids_tensor(&ids[..t - 1]), &mut c2).unwrap();
        let step = model
            .forward_last(&ids_tensor(&ids[t - 1..]), &mut c2)
            .unwrap()
            .squeeze(0)
            .unwrap();
        let err = max_row_rel_err(&step.unsqueeze(0).unwrap(), &full.unsqueeze(0).unwrap());
        assert!(err <= 1e-5, "{name}: prefill(T-1)+decode(1) vs prefill(T): {err}");
        assert_eq!(c2.seq_len(), t);
        // A multi-token continuation (chunked GDN from a non-zero state) too.
        let mut c3 = model.new_cache(1).unwrap();
        model.forward(&ids_tensor(&ids[..100]), &mut c3).unwrap();
        let rest = model.forward(&ids_tensor(&ids[100..]), &mut c3).unwrap();
        let err = max_row_rel_err(
            &rest.i((0, t - 101)).unwrap().unsqueeze(0).unwrap(),
            &full.unsqueeze(0).unwrap(),
        );
        assert!(
            err <= 1e-5,
            "{name}: prefill(100)+prefill(rest) vs prefill(T): {err}"
        );
    }
}

#[test]
fn sequences_back_to_back_through_a_reset_cache_equal_each_alone() {
    for (name, model, r) in fixture_models(DType::F32) {
        let (a, b) = (ids_of(&r["prompt0.ids"]), ids_of(&r["prompt1.ids"]));
        let b_alone = plain_greedy(&model, &b, 40);
        let mut cache = model.new_cache(1).unwrap();
        let a_first = greedy(&model, &mut cache, &a, 40);
        cache.reset().unwrap();
        assert_eq!(cache.seq_len(), 0);
        let b_after = greedy(&model, &mut cache, &b, 40);
        assert_eq!(b_after, b_alone, "{name}: state leaked across a reset");
        cache.reset().unwrap();
        assert_eq!(
            greedy(&model, &mut cache, &a, 40),
            a_first,
            "{name}: rerun of the first sequence differs"
        );
    }
}

#[test]
fn batch_rows_equal_single_runs() {
    let name = "tiny-nested";
    let (model, r) = load_with_reference(name, DType::F32);
    let (a, b) = (ids_of(&r["prompt0.ids"]), ids_of(&r["prompt1.ids"]));
    let n = b.len();
    let batch = candle_core::Tensor::new(vec![a[..n].to_vec(), b.clone()], &test_device()).unwrap();
    let mut cache = model.new_cache(2).unwrap();
    let both = model.forward(&batch, &mut cache).unwrap();
    for (row, ids) in [&a[..n], &b[..]].into_iter().enumerate() {
        let mut c = model.new_cache(1).unwrap();
        let single = model
            .forward(&ids_tensor(ids), &mut c)
            .unwrap()
            .squeeze(0)
            .unwrap();
        let err = max_row_rel_err(&both.i(row).unwrap(), &single);
        assert!(err <= 1e-5, "batch row {row}: {err}");
    }
}
