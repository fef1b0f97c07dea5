//! Sampled speculative decoding reproduces the target distribution: over many seeds on the
//! 16-token fixture model, the 2nd and 3rd generated tokens (the ones verification decides)
//! follow the target's processed distribution conditioned on the tokens before them.

mod common;

use common::*;
use qwen36_model::Qwen36Model;
use qwen36_mtp::{Drafter, MtpDrafter, NgramDrafter, SpecConfig, SpeculativeDecoder};
use qwen36_sampling::{Sampler, SamplingParams};

const SEEDS: u64 = 2500;

fn probs(model: &Qwen36Model, params: &SamplingParams, prompt: &[u32], output: &[u32]) -> Vec<f32> {
    let ctx: Vec<u32> = prompt.iter().chain(output).copied().collect();
    let mut cache = model.new_cache(1).unwrap();
    let logits = model
        .forward_last(&ids(&ctx), &mut cache)
        .unwrap()
        .squeeze(0)
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    Sampler::new(params.clone())
        .unwrap()
        .probs(&logits, prompt, output, 0)
        .unwrap()
}

fn argmax(p: &[f32]) -> u32 {
    (0..p.len()).max_by(|&a, &b| p[a].total_cmp(&p[b])).unwrap() as u32
}

/// Chi-square of counts against p, pooling cells with expected count < 5; returns (stat, dof).
fn chi2(counts: &[usize], p: &[f32]) -> (f64, usize) {
    let n: usize = counts.iter().sum();
    let (mut stat, mut cells) = (0.0, 0usize);
    let (mut pool_o, mut pool_e) = (0.0, 0.0);
    for (&c, &q) in counts.iter().zip(p) {
        let e = n as f64 * q as f64;
        if q == 0.0 {
            assert_eq!(c, 0, "a token of probability 0 was emitted");
        } else if e < 5.0 {
            pool_o += c as f64;
            pool_e += e;
        } else {
            stat += (c as f64 - e).powi(2) / e;
            cells += 1;
        }
    }
    if pool_e > 0.0 {
        stat += (pool_o - pool_e).powi(2) / pool_e;
        cells += 1;
    }
    (stat, cells.saturating_sub(1))
}

/// 0.999 quantile of chi-square (Wilson-Hilferty).
fn limit(dof: usize) -> f64 {
    let k = dof.max(1) as f64;
    k * (1.0 - 2.0 / (9.0 * k) + 3.09 * (2.0 / (9.0 * k)).sqrt()).powi(3)
}

#[test]
fn speculative_sampling_matches_target_distribution() {
    let (model, head) = load("tiny-vocab");
    let prompt = prompt("tiny-vocab", "prompt0.ids", 8);
    let cases = [
        (
            "mtp",
            SamplingParams {
                temperature: 0.7,
                ..Default::default()
            },
        ),
        (
            "mtp",
            SamplingParams {
                temperature: 1.0,
                top_p: 0.9,
                presence_penalty: 0.5,
                ..Default::default()
            },
        ),
        (
            "ngram",
            SamplingParams {
                temperature: 1.5,
                top_k: 8,
                top_p: 0.95,
                ..Default::default()
            },
        ),
    ];
    for (dname, params) in cases {
        let p1 = probs(&model, &params, &prompt, &[]);
        let m1 = argmax(&p1);
        let p2 = probs(&model, &params, &prompt, &[m1]);
        let m2 = argmax(&p2);
        let p3 = probs(&model, &params, &prompt, &[m1, m2]);
        let (mut c2, mut c3) = (vec![0usize; p1.len()], vec![0usize; p1.len()]);
        let mut accepted = 0;
        for seed in 0..SEEDS {
            let mut mtp = MtpDrafter::new(&model, &head);
            let mut ngram = NgramDrafter { min_n: 1, max_n: 2 };
            let drafter: &mut dyn Drafter = if dname == "mtp" { &mut mtp } else { &mut ngram };
            let params = SamplingParams {
                seed,
                ..params.clone()
            };
            let mut dec = SpeculativeDecoder::new(&model, params).unwrap();
            let cfg = SpecConfig {
                k: 2,
                max_new_tokens: 3,
                stop_token_ids: vec![],
            };
            let out = dec.generate(drafter, &prompt, &cfg, |_| true).unwrap();
            accepted += out.stats.accepted;
            let t = &out.tokens;
            if t[0] == m1 {
                c2[t[1] as usize] += 1;
                if t[1] == m2 {
                    c3[t[2] as usize] += 1;
                }
            }
        }
        for (what, c, p) in [("2nd", &c2, &p2), ("3rd", &c3, &p3)] {
            let n: usize = c.iter().sum();
            let (stat, dof) = chi2(c, p);
            eprintln!(
                "{dname} {params:?}: {what} token n={n} chi2 {stat:.1} dof {dof} (limit {:.1})",
                limit(dof)
            );
            assert!(n > 200, "too few conditional samples ({n})");
            assert!(
                stat < limit(dof),
                "{dname}: {what} token chi2 {stat} >= {}",
                limit(dof)
            );
        }
        // Drafts were really accepted and rejected (both paths exercised).
        assert!(
            accepted > 0 && accepted < 2 * SEEDS as usize,
            "{dname}: accepted {accepted}"
        );
    }
}
