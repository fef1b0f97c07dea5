//! The MTP head against the PyTorch reference (tools/reference/mtp_reference.py, vLLM semantics),
//! f32. Tolerance 1e-4 of each row's scale, as for the main model (the head is one more layer).

mod common;

use candle_core::{DType, Device, IndexOp, Tensor};
use common::*;
use qwen36_model::{DraftVocab, Error, MtpHead};

#[test]
fn mtp_logits_and_chained_drafts_match_reference() {
    for name in FIXTURES {
        let (model, head) = load_with_head(name);
        let r = fixture_reference(name);
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
    let model = qwen36_model::Qwen36Model::load(dir.path(), load_options(DType::F32)).unwrap();
    // ...and asking for the head names the problem.
    let e = MtpHead::load_dir(dir.path(), model.config(), load_options(DType::F32)).unwrap_err();
    assert!(matches!(e, Error::NoMtpHead), "{e}");
}

/// A draft step over a draft vocabulary proposes the id whose logit is largest among those ids:
/// checked against the full logits of the same state, restricted to the subset on the host. The
/// whole vocabulary as a draft vocabulary drafts what the unrestricted step drafts. Bad id lists
/// are typed errors.
#[test]
fn draft_vocabulary_drafts_the_best_of_its_ids() {
    let name = "tiny-nested";
    let (model, head) = load_with_head(name);
    let r = fixture_reference(name);
    let ids = ids_of(&r["prompt0.ids"]);
    let mut cache = model.new_cache(1).unwrap();
    let hidden = model.forward_hidden(&ids_tensor(&ids), &mut cache).unwrap();
    let next = ids_tensor(&ids[1..]);
    let fed = hidden.narrow(1, 0, ids.len() - 1).unwrap();
    let vocab_size = model.config().vocab_size;
    // Every third id, the last id, and the stop-like id 0 given as an extra.
    let subset: Vec<u32> = (1..vocab_size as u32)
        .step_by(3)
        .chain([vocab_size as u32 - 1])
        .collect();
    let partial = DraftVocab::new(&model, &subset).unwrap();
    let full = DraftVocab::first(&model, vocab_size, &[]).unwrap();
    assert_eq!(full.len(), vocab_size);
    let mut drafted = 0;
    for (vocab, want_len) in [
        (Some(&partial), subset.len()),
        (Some(&full), vocab_size),
        (None, 0),
    ] {
        assert_eq!(vocab.map_or(0, DraftVocab::len), want_len);
        let mut mc = head.new_cache();
        let (mut last, mut tok) = head.draft(&model, &fed, &next, &mut mc, 0, vocab).unwrap();
        for step in 0..4 {
            let logits: Vec<f32> = model
                .logits(&last)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            let allowed: Vec<u32> = match vocab {
                Some(v) => v.ids().to_vec1().unwrap(),
                None => (0..vocab_size as u32).collect(),
            };
            // Ties to the lowest id, as the argmax kernel.
            let want = allowed
                .iter()
                .copied()
                .fold(None::<u32>, |best, i| match best {
                    Some(b) if logits[b as usize] >= logits[i as usize] => Some(b),
                    _ => Some(i),
                })
                .unwrap();
            let got = tok.flatten_all().unwrap().to_vec1::<u32>().unwrap()[0];
            assert_eq!(got, want, "step {step}, vocabulary of {want_len}");
            drafted += 1;
            (last, tok) = head.draft(&model, &last, &tok, &mut mc, step + 1, vocab).unwrap();
        }
    }
    assert_eq!(drafted, 12);
    for bad in [&[][..], &[vocab_size as u32][..]] {
        let e = DraftVocab::new(&model, bad).unwrap_err();
        assert!(matches!(e, Error::Input(_)), "{e}");
        assert!(e.to_string().contains("draft vocabulary"), "{e}");
    }
}
