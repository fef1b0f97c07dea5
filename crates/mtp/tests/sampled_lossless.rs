//! Sampled speculative decoding reproduces the target distribution at every generated position.
//!
//! On the 16-token fixture model, many seeded generations of N tokens each (k = 1..4, three
//! drafters, temperature ≠ 1 with and without penalties, top-k / top-p / min-p). For each emitted
//! token t, given the tokens before it, the target's processed distribution p gives the randomised
//! probability integral transform `u = F(t − 1) + v · p(t)` (F the CDF over ids, v uniform and
//! independent): if every token follows p given its history, the u of each position are uniform
//! on [0, 1) (Rosenblatt), whatever the drafts were. A chi-square on 10 bins tests every position,
//! the first token included, and separately the bonus tokens (those after k accepted drafts: being
//! a bonus is decided by the earlier tokens, so their u are uniform too).

mod common;

use common::*;
use qwen36_model::{MtpHead, Qwen36Model};
use qwen36_mtp::{DraftContext, Drafter, MtpDrafter, NgramDrafter};
use qwen36_sampling::{rng, Sampler, SamplingParams};

const SEEDS: u64 = 600;
const N: usize = 8;
const BINS: usize = 10;

/// The target's processed distribution for every output position: row i is p(· | prompt, out[..i]).
fn target_rows(model: &Qwen36Model, params: &SamplingParams, prompt: &[u32], out: &[u32]) -> Vec<Vec<f32>> {
    let ctx: Vec<u32> = prompt.iter().chain(out).copied().collect();
    let mut cache = model.new_cache(1).unwrap();
    let logits = model
        .forward(&ids_tensor(&ctx), &mut cache)
        .unwrap()
        .squeeze(0)
        .unwrap()
        .to_vec2::<f32>()
        .unwrap();
    let s = Sampler::new(params.clone()).unwrap();
    (0..out.len())
        .map(|i| {
            s.probs(&logits[prompt.len() - 1 + i], prompt, &out[..i], 0)
                .unwrap()
        })
        .collect()
}

/// Chi-square of the bin counts of `u` against the uniform distribution; returns (stat, n).
fn chi2_uniform(us: &[f64]) -> (f64, usize) {
    let mut counts = [0usize; BINS];
    for &u in us {
        counts[((u * BINS as f64) as usize).min(BINS - 1)] += 1;
    }
    let e = us.len() as f64 / BINS as f64;
    (counts.iter().map(|&c| (c as f64 - e).powi(2) / e).sum(), us.len())
}

/// The 1 − 1e-5 quantile of chi-square with BINS − 1 = 9 degrees of freedom (Wilson-Hilferty):
/// over the ~110 checks below a correct decoder fails one with probability about 0.1%, and the
/// seeds are fixed, so the outcome is reproducible.
const LIMIT: f64 = 40.1;

/// Proposes the argmax chain of the target's penalised logits (no cache, a full forward per
/// draft): drafts are often accepted, so bonus tokens are frequent.
struct TargetArgmax<'m> {
    model: &'m Qwen36Model,
    sampler: Sampler,
    prompt_len: usize,
}

impl Drafter for TargetArgmax<'_> {
    fn propose(&mut self, ctx: &DraftContext, k: usize) -> qwen36_mtp::Result<Vec<u32>> {
        let mut t = ctx.tokens.to_vec();
        for _ in 0..k {
            let mut cache = self.model.new_cache(1).unwrap();
            let l = self.model.forward_last(&ids_tensor(&t), &mut cache).unwrap();
            let l = l.squeeze(0).unwrap().to_vec1::<f32>().unwrap();
            let (prompt, output) = t.split_at(self.prompt_len);
            let l = self.sampler.penalised(&l, prompt, output);
            let best = (0..l.len()).max_by(|&a, &b| l[a].total_cmp(&l[b]).then(b.cmp(&a)));
            t.push(best.unwrap() as u32);
        }
        Ok(t[ctx.tokens.len()..].to_vec())
    }
    fn reset(&mut self) {}
}

/// Records where each cycle starts (output tokens before it) and how many drafts it verifies.
struct Recording<'a> {
    inner: &'a mut dyn Drafter,
    prompt_len: usize,
    cycles: Vec<(usize, usize)>,
}

impl Drafter for Recording<'_> {
    fn propose(&mut self, ctx: &DraftContext, k: usize) -> qwen36_mtp::Result<Vec<u32>> {
        let mut d = self.inner.propose(ctx, k)?;
        d.truncate(k);
        self.cycles.push((ctx.tokens.len() - self.prompt_len, d.len()));
        Ok(d)
    }
    fn reset(&mut self) {
        self.inner.reset();
        self.cycles.clear();
    }
}

/// Temperature ≠ 1 with the cuts and no penalties, and with every penalty and top-p.
fn param_sets() -> [SamplingParams; 2] {
    [
        SamplingParams {
            temperature: 0.7,
            top_k: 8,
            min_p: 0.05,
            ..Default::default()
        },
        SamplingParams {
            temperature: 0.8,
            top_p: 0.9,
            repetition_penalty: 1.3,
            presence_penalty: 0.3,
            frequency_penalty: 0.2,
            ..Default::default()
        },
    ]
}

/// Generates `seeds` sequences of N tokens after `prompt` with drafter `dname` and `k` drafts per
/// verify, and checks the uniformity of every position's and every bonus token's PIT values.
/// Returns (bonus tokens, histogram of accepted lengths).
fn check(
    (model, head): &(Qwen36Model, MtpHead),
    prompt: &[u32],
    seeds: u64,
    dname: &str,
    k: usize,
    params: &SamplingParams,
) -> (usize, Vec<usize>) {
    let mut per_pos = vec![Vec::new(); N];
    let mut bonus = Vec::new();
    let mut hist = vec![0usize; k + 1];
    for seed in 0..seeds {
        let mut mtp = MtpDrafter::new(model, head);
        let mut ngram = NgramDrafter { min_n: 1, max_n: 2 };
        let mut target = TargetArgmax {
            model,
            sampler: Sampler::new(params.clone()).unwrap(),
            prompt_len: prompt.len(),
        };
        let inner: &mut dyn Drafter = match dname {
            "mtp" => &mut mtp,
            "ngram" => &mut ngram,
            _ => &mut target,
        };
        let mut rec = Recording {
            inner,
            prompt_len: prompt.len(),
            cycles: Vec::new(),
        };
        let params = SamplingParams {
            seed,
            ..params.clone()
        };
        let out = speculate(model, params.clone(), &mut rec, prompt, k, N);
        assert_eq!(out.tokens.len(), N);
        for (a, c) in out.stats.accepted_len_hist.iter().zip(hist.iter_mut()) {
            *c += a;
        }
        let rows = target_rows(model, &params, prompt, &out.tokens);
        let pit: Vec<f64> = out
            .tokens
            .iter()
            .zip(&rows)
            .enumerate()
            .map(|(i, (&t, p))| {
                assert!(p[t as usize] > 0.0, "seed {seed}: token {i} has probability 0");
                let below: f64 = p[..t as usize].iter().map(|&x| x as f64).sum();
                below + rng::uniform(seed, 1_000_003, i as u64, 0) * p[t as usize] as f64
            })
            .collect();
        for (i, &u) in pit.iter().enumerate() {
            per_pos[i].push(u);
        }
        // A cycle starting at output position s with all k drafts accepted emits its bonus token
        // at s + k; the next cycle (or the end of the output) then starts at s + k + 1.
        rec.cycles.push((N, 0));
        for w in rec.cycles.windows(2) {
            let ((s, d), (next, _)) = (w[0], w[1]);
            if d == k && next == s + d + 1 {
                bonus.push(pit[s + d]);
            }
        }
    }
    for (i, us) in per_pos.iter().enumerate() {
        let (stat, n) = chi2_uniform(us);
        assert!(
            stat < LIMIT,
            "{dname} k={k} {params:?}: position {i} chi2 {stat:.1} over {n} samples"
        );
    }
    let (stat, n) = chi2_uniform(&bonus);
    eprintln!("{dname} k={k} {params:?}: accepted lengths {hist:?}, {n} bonus tokens (chi2 {stat:.1})");
    if n >= 50 {
        assert!(
            stat < LIMIT,
            "{dname} k={k} {params:?}: bonus chi2 {stat:.1} over {n}"
        );
    }
    (n, hist)
}

/// With the target's own argmax as drafts, every accepted length 0..=k occurs and bonus tokens
/// are frequent: k = 1..4 under every parameter set.
#[test]
fn every_position_and_bonus_token_follow_the_target() {
    let m = load_with_head("tiny-vocab");
    let p = prompt("tiny-vocab", "prompt0.ids", 8);
    for k in 1..=4 {
        for params in param_sets() {
            let (bonus, hist) = check(&m, &p, SEEDS, "target", k, &params);
            assert!(bonus >= 100, "k={k}: only {bonus} bonus tokens");
            assert_every_accepted_length(&hist, &format!("k={k}"));
        }
    }
}

/// The MTP head's and the n-gram drafter's proposals (mostly rejected on this random model).
#[test]
fn every_position_follows_the_target_with_model_drafters() {
    let m = load_with_head("tiny-vocab");
    let p = prompt("tiny-vocab", "prompt0.ids", 8);
    for (i, params) in param_sets().iter().enumerate() {
        for (dname, k) in [("mtp", 1 + 2 * i), ("ngram", 2 + 2 * i)] {
            let (_, hist) = check(&m, &p, SEEDS, dname, k, params);
            assert!(
                hist[0] > 0 && hist[1] > 0,
                "{dname} k={k}: accepted lengths {hist:?}"
            );
        }
    }
}

/// The bundled model with its trained MTP head (4096 ids, drafts accepted about half the time):
/// fewer seeds, the same checks, and every accepted length occurs.
#[test]
fn every_position_follows_the_target_on_the_bundled_model() {
    let m = load_bundled();
    let p = bundled_prompt(2);
    let (_, hist) = check(&m, &p, 160, "mtp", 3, &param_sets()[0]);
    assert_every_accepted_length(&hist, "bundled");
}
