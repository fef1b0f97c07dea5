//! The MTP head against the PyTorch reference (tools/reference/mtp_reference.py, vLLM semantics),
//! f32. Tolerance 1e-4 of each row's scale, as for the main model (the head is one more layer).

mod common;

use candle_core::{DType, Device, IndexOp, Tensor};
use common::*;
use qwen36_model::{Error, MtpHead};

#[test]
fn mtp_logits_and_chained_drafts_match_reference() {
    for name in FIXTURES {
        let model = load(name, DType::F32);
        let head = MtpHead::load_dir(fixture_dir(name), model.config(), opts(DType::F32)).unwrap();
        let r = reference(name);
        let ids = ids_of(&r["prompt0.ids"]);
        let first = ids_of(&r["prompt0.greedy"])[0];
        let mut next: Vec<u32> = ids[1..].to_vec();
        next.push(first);

        // Our own target hidden states (already checked against HF), fed as pairs (h_i, x_{i+1}).
        let mut cache = model.new_cache(1).unwrap();
        let hidden = model.forward_hidden(&ids_tensor(&ids), &mut cache).unwrap();
        let mut mcache = head.new_cache();
        let d = head
            .forward(&model, &hidden, &ids_tensor(&next), &mut mcache, 0)
            .unwrap();
        let logits = model.logits(&d).unwrap().squeeze(0).unwrap();
        let err = max_row_rel_err(&logits, &r["prompt0.mtp_logits"]);
        eprintln!("{name}: MTP logits rel err {err:.2e}");
        assert!(err <= 1e-4, "{name}: MTP logits error {err}");
        assert_eq!(mcache.len(), ids.len());

        // Chained greedy drafts: feed back (d, argmax) one position at a time.
        let want_ids = ids_of(&r["prompt0.mtp_chain_ids"]);
        let t = ids.len();
        let mut last_d = d.narrow(1, t - 1, 1).unwrap();
        let mut tok = logits
            .i(t - 1)
            .unwrap()
            .argmax(0)
            .unwrap()
            .to_scalar::<u32>()
            .unwrap();
        for (step, want) in want_ids.iter().enumerate() {
            assert_eq!(tok, *want, "{name}: chain token {step}");
            let tokt = Tensor::new(&[[tok]], &test_device()).unwrap();
            last_d = head
                .forward(&model, &last_d, &tokt, &mut mcache, step + 1)
                .unwrap();
            let row = model.logits(&last_d).unwrap().squeeze(0).unwrap();
            let err = max_row_rel_err(&row, &r["prompt0.mtp_chain_logits"].i(step..step + 1).unwrap());
            assert!(err <= 1e-4, "{name}: chain step {step} error {err}");
            tok = row
                .squeeze(0)
                .unwrap()
                .argmax(0)
                .unwrap()
                .to_scalar::<u32>()
                .unwrap();
        }
        // Truncating drops the chain entries: re-feeding the last pair reproduces its output.
        mcache.truncate(t - 1);
        let again = head
            .forward(
                &model,
                &hidden.narrow(1, t - 1, 1).unwrap(),
                &ids_tensor(&[first]),
                &mut mcache,
                0,
            )
            .unwrap();
        let e = max_row_rel_err(&again.squeeze(0).unwrap(), &d.i((0, t - 1..t)).unwrap());
        assert!(e <= 1e-5, "{name}: re-fed pair differs {e}");
    }
}

#[test]
fn missing_mtp_head_is_a_clear_error_only_when_asked() {
    let dir = tempfile::tempdir().unwrap();
    let src = fixture_dir("tiny-flat");
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(src.join(f), dir.path().join(f)).unwrap();
    }
    let path = dir.path().join("model.safetensors");
    let mut map = candle_core::safetensors::load(&path, &Device::Cpu).unwrap();
    map.retain(|k, _| !k.starts_with("mtp."));
    candle_core::safetensors::save(&map, &path).unwrap();
    // The main model loads fine without it...
    let model = qwen36_model::Qwen36Model::load(dir.path(), opts(DType::F32)).unwrap();
    // ...and asking for the head names the problem.
    let e = MtpHead::load_dir(dir.path(), model.config(), opts(DType::F32)).unwrap_err();
    assert!(matches!(e, Error::NoMtpHead), "{e}");
}
