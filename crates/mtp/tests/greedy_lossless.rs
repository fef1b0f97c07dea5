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
