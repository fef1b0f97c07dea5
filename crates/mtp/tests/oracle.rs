//! Rollback exactness: an oracle drafter proposes the true greedy continuation with one chosen
//! position corrupted, so every accepted length 0..=k occurs; and at the model level each
//! commit of `a + 1` verified tokens is compared with a fresh run over the kept tokens.

mod common;

use candle_core::IndexOp;
use common::*;
use qwen36_model::LayerCache;
use qwen36_mtp::{DraftContext, Drafter, NgramDrafter, SpeculativeDecoder};
use qwen36_sampling::SamplingParams;

/// Proposes `truth` after the prompt, corrupting draft position `cycle % (k + 1)` (none when k).
struct Oracle {
    truth: Vec<u32>,
    prompt_len: usize,
    vocab: u32,
    cycle: usize,
}

impl Drafter for Oracle {
    fn propose(&mut self, ctx: &DraftContext, k: usize) -> qwen36_mtp::Result<Vec<u32>> {
        let done = ctx.tokens.len() - self.prompt_len; // output tokens so far
        let mut d: Vec<u32> = self.truth[done..done + k].to_vec();
        let c = self.cycle % (k + 1);
        if c < k {
            d[c] = (d[c] + 1) % self.vocab;
        }
        self.cycle += 1;
        Ok(d)
    }
    fn reset(&mut self) {
        self.cycle = 0;
    }
}

#[test]
fn every_accepted_length_occurs_and_output_stays_greedy() {
    let name = "tiny-nested";
    let (model, _, p) = load_with_prompt(name, "prompt0.ids", 40);
    let n = 200;
    for k in 1..=4 {
        let truth = plain_greedy(&model, &p, n + k + 1);
        let mut oracle = Oracle {
            truth: truth.clone(),
            prompt_len: p.len(),
            vocab: model.config().vocab_size as u32,
            cycle: 0,
        };
        let out = speculate(&model, SamplingParams::greedy(), &mut oracle, &p, k, n);
        assert_eq!(out.tokens, truth[..n], "k={k}");
        let hist = &out.stats.accepted_len_hist;
        assert_every_accepted_length(hist, &format!("k={k}"));
    }
}

#[test]
fn commit_equals_a_fresh_run_over_the_kept_tokens() {
    for name in FIXTURES {
        let (model, _, p) = load_with_prompt(name, "prompt0.ids", 70);
        let k = 4;
        let truth = plain_greedy(&model, &p, k + 3);
        let mut base = model.new_cache(1).unwrap();
        model.forward(&ids_tensor(&p), &mut base).unwrap();
        for a in 0..=k {
            // Verify [x, d1..dk] with d_{a+1} wrong, keep x and a drafts: a + 1 tokens.
            let mut tokens: Vec<u32> = truth[..=k].to_vec();
            if a < k {
                tokens[a + 1] = (tokens[a + 1] + 1) % model.config().vocab_size as u32;
            }
            let mut cache = base.clone();
            model.forward_verify(&ids_tensor(&tokens), &mut cache).unwrap();
            // Keeping none or more than were verified is refused, and the pass stays pending.
            for bad in [0, k + 2] {
                assert!(
                    matches!(cache.commit(bad), Err(qwen36_model::Error::Cache(_))),
                    "keep {bad}"
                );
            }
            cache.commit(a + 1).unwrap();
            assert!(cache.commit(a + 1).is_err(), "a second commit of the same pass");
            assert_eq!(cache.seq_len(), p.len() + a + 1);

            let kept: Vec<u32> = p.iter().chain(&truth[..=a]).copied().collect();
            let mut fresh = model.new_cache(1).unwrap();
            model.forward(&ids_tensor(&kept), &mut fresh).unwrap();
            assert_eq!(cache.layers().len(), model.config().num_hidden_layers);
            assert_eq!(fresh.layers().len(), model.config().num_hidden_layers);
            for (l, (x, y)) in cache.layers().iter().zip(fresh.layers()).enumerate() {
                match (x, y) {
                    (LayerCache::Gdn(x), LayerCache::Gdn(y)) => {
                        let d =
                            max_abs_diff(x.recurrent(), y.recurrent()).max(max_abs_diff(x.conv(), y.conv()));
                        // f32 chunked (fresh) vs token-by-token (verify) forms: ~1e-6.
                        assert!(d < 1e-5, "{name} a={a} layer {l}: GDN state differs by {d}");
                        assert_eq!(x.seen(), y.seen());
                    }
                    (LayerCache::Attention(x), LayerCache::Attention(y)) => assert_eq!(x.len(), y.len()),
                    _ => unreachable!(),
                }
            }
            // The next step from the committed cache equals the fresh one.
            let next = truth[a + 1];
            let l1 = model.forward_last(&ids_tensor(&[next]), &mut cache).unwrap();
            let l2 = model.forward_last(&ids_tensor(&[next]), &mut fresh).unwrap();
            let rel = max_abs_diff(&l1, &l2)
                / l2.abs()
                    .unwrap()
                    .max_all()
                    .unwrap()
                    .to_device(&candle_core::Device::Cpu)
                    .unwrap()
                    .to_scalar::<f32>()
                    .unwrap();
            assert!(rel < 1e-5, "{name} a={a}: next logits differ by {rel} (relative)");
            assert_eq!(
                l1.i(0).unwrap().argmax(0).unwrap().to_scalar::<u32>().unwrap(),
                truth[a + 2]
            );
        }
    }
}

/// Drafts are never asked for past `max_new_tokens`: a drafter that always proposes all it is
/// asked for is asked for at most the tokens still to generate less the verify's own (k drafts
/// give up to k + 1 tokens), and every token a pass gives is emitted and counted.
#[test]
fn drafts_stop_at_max_new_tokens() {
    struct Greedy {
        truth: Vec<u32>,
        prompt_len: usize,
        max_new: usize,
        asked: Vec<usize>,
    }
    impl Drafter for Greedy {
        fn propose(&mut self, ctx: &DraftContext, k: usize) -> qwen36_mtp::Result<Vec<u32>> {
            let done = ctx.tokens.len() - self.prompt_len;
            assert!(
                k < self.max_new - done,
                "asked for {k} drafts with {done} of {} done",
                self.max_new
            );
            self.asked.push(k);
            Ok(self.truth[done..done + k].to_vec())
        }
        fn reset(&mut self) {}
    }
    let (model, _, p) = load_with_prompt("tiny-flat", "prompt0.ids", 30);
    let truth = plain_greedy(&model, &p, 12);
    // Every draft is accepted, so each cycle asks for min(k, tokens still to come − 1): with
    // one token to come a plain step (no drafter call).
    for (max_new, want_asked) in [(2, vec![]), (3, vec![1]), (7, vec![4])] {
        let mut d = Greedy {
            truth: truth.clone(),
            prompt_len: p.len(),
            max_new,
            asked: Vec::new(),
        };
        let out = speculate(&model, SamplingParams::greedy(), &mut d, &p, 4, max_new);
        assert_eq!(out.tokens, truth[..max_new]);
        assert_eq!(d.asked, want_asked, "max_new {max_new}");
        assert_eq!(
            out.stats.emitted,
            max_new - 1,
            "max_new {max_new}: all but the prefill's"
        );
    }
}

/// `max_new_tokens = 0` is refused (it gave one token); a reused decoder samples each
/// generation from its seed's start, as a fresh one does.
#[test]
fn zero_tokens_are_refused_and_a_reused_decoder_repeats_itself() {
    let (model, _) = load_bundled();
    let p = bundled_prompt(0);
    let params = SamplingParams {
        temperature: 1.0,
        seed: 5,
        ..Default::default()
    };
    let mut dec = SpeculativeDecoder::new(&model, params.clone()).unwrap();
    let mut ngram = NgramDrafter::default();
    let e = dec
        .generate(&mut ngram, &p, &spec_config(2, 0), |_| true)
        .unwrap_err();
    assert!(e.to_string().contains("max_new_tokens"), "{e}");
    let first = dec
        .generate(&mut ngram, &p, &spec_config(2, 24), |_| true)
        .unwrap();
    let again = dec
        .generate(&mut ngram, &p, &spec_config(2, 24), |_| true)
        .unwrap();
    let fresh = speculate(&model, params.clone(), &mut NgramDrafter::default(), &p, 2, 24);
    assert_eq!(first.tokens, fresh.tokens);
    assert_eq!(again.tokens, fresh.tokens);
    // (The draws matter: another seed gives other tokens.)
    let other = SamplingParams { seed: 6, ..params };
    let other = speculate(&model, other, &mut NgramDrafter::default(), &p, 2, 24);
    assert_ne!(other.tokens, fresh.tokens);
}
