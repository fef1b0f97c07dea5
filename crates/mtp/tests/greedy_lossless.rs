//! Greedy speculative decoding is token-identical to plain greedy decoding: 1000 tokens, MTP and
//! n-gram drafters, k = 1..4, both fixture models.

mod common;

use common::*;
use qwen36_mtp::{Drafter, MtpDrafter, NgramDrafter, SpecConfig, SpeculativeDecoder};
use qwen36_sampling::SamplingParams;

const N: usize = 1000;

#[test]
fn greedy_speculative_equals_plain_greedy() {
    for name in ["tiny-flat", "tiny-nested"] {
        let (model, head) = load(name);
        let p = prompt(name, "prompt1.ids", 16);
        let want = plain_greedy(&model, &p, N);
        for k in 1..=4 {
            let mut mtp = MtpDrafter::new(&model, &head);
            let mut ngram = NgramDrafter::default();
            let drafters: [(&str, &mut dyn Drafter); 2] = [("mtp", &mut mtp), ("ngram", &mut ngram)];
            for (dname, drafter) in drafters {
                let mut dec = SpeculativeDecoder::new(&model, SamplingParams::greedy()).unwrap();
                let cfg = SpecConfig {
                    k,
                    max_new_tokens: N,
                    stop_token_ids: vec![],
                };
                let out = dec.generate(drafter, &p, &cfg, |_| true).unwrap();
                let first_diff = out.tokens.iter().zip(&want).position(|(a, b)| a != b);
                assert_eq!(first_diff, None, "{name} {dname} k={k}: diverged");
                assert_eq!(out.tokens.len(), N);
                let s = &out.stats;
                eprintln!(
                    "{name} {dname} k={k}: {} cycles, accept len {:.2}, by position {:?}",
                    s.cycles,
                    s.accepted_len_mean(),
                    s.acceptance_by_position()
                        .iter()
                        .map(|x| format!("{x:.2}"))
                        .collect::<Vec<_>>()
                );
            }
        }
    }
}

/// One decoder and one drafter over several sequences: each starts from a reset cache (the same
/// tokens as plain greedy decoding), and where verify passes replay CUDA graphs, a later sequence
/// that fits the same KV buffers replays the first one's graphs instead of recording new ones.
#[test]
fn reused_decoder_starts_each_sequence_fresh_and_keeps_its_graphs() {
    let name = "tiny-nested";
    let (model, head) = load(name);
    let p = prompt(name, "prompt1.ids", 16);
    let want = plain_greedy(&model, &p, 64);
    // A different sequence of the same length in between: its KV entries and GDN states must not
    // leak into the next one.
    let other: Vec<u32> = p.iter().rev().copied().collect();
    assert_ne!(other, p);
    let cfg = SpecConfig {
        k: 3,
        max_new_tokens: 64,
        stop_token_ids: vec![],
    };
    let mut dec = SpeculativeDecoder::new(&model, SamplingParams::greedy()).unwrap();
    let mut mtp = MtpDrafter::new(&model, &head);
    let first = dec.generate(&mut mtp, &p, &cfg, |_| true).unwrap().tokens;
    let stepper = &dec.session().stepper;
    let recorded = stepper.recordings();
    assert_eq!(recorded > 0, stepper.uses_graphs());
    let between = dec.generate(&mut mtp, &other, &cfg, |_| true).unwrap().tokens;
    assert_eq!(between, plain_greedy(&model, &other, 64));
    let again = dec.generate(&mut mtp, &p, &cfg, |_| true).unwrap().tokens;
    assert_eq!(first, want);
    assert_eq!(again, want);
    assert_eq!(
        dec.session().stepper.recordings(),
        recorded,
        "a later sequence re-recorded"
    );
}
