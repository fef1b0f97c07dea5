//! The logits pipeline and the draw.

use candle_core::{DType, Tensor};
use rayon::prelude::*;

use crate::{rng, Error, Result, SamplingParams};

/// One sampled token with its log-probability under the raw model distribution.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampled {
    pub token: u32,
    /// `log_softmax(logits)[token]` before any processing.
    pub logprob: f32,
    /// The `top_logprobs` most likely tokens of the raw distribution, most likely first.
    pub top_logprobs: Vec<(u32, f32)>,
    /// `token`'s place in the raw distribution from 1, ties going to the lower id (as the
    /// `top_logprobs` order): vLLM's rank, from [`ranked_logprobs_of`] (a pass over the
    /// vocabulary the sampling path does not pay).
    pub rank: Option<u32>,
}

/// Applies [`SamplingParams`] to logits and draws tokens. Each call to [`Sampler::sample`] uses a
/// new RNG step; rows of a batch use their row index, so results never depend on scheduling.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    /// Masked while the output is shorter than `params.min_tokens`.
    end_ids: Vec<u32>,
    step: u64,
}

/// Rejects NaN and +inf (−inf is a legal mask).
pub(crate) fn check_logits(logits: &[f32], row: usize) -> Result<()> {
    match logits.iter().position(|v| v.is_nan() || *v == f32::INFINITY) {
        Some(index) => Err(Error::NonFiniteLogits {
            row,
            index,
            value: logits[index],
        }),
        None => Ok(()),
    }
}

/// Index of the largest value, lowest index on ties.
pub(crate) fn argmax(v: &[f32]) -> usize {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best
}

/// Draws an index from unnormalised non-negative weights by inverse CDF with `u ∈ [0, 1)`.
pub(crate) fn draw_index(weights: &[f32], u: f64, row: usize) -> Result<usize> {
    let total: f64 = weights.iter().map(|&w| w as f64).sum();
    if total <= 0.0 {
        return Err(Error::Empty { row });
    }
    let target = u * total;
    let mut acc = 0.0f64;
    let mut last = 0;
    for (i, &w) in weights.iter().enumerate() {
        if w > 0.0 {
            acc += w as f64;
            last = i;
            if acc > target {
                return Ok(i);
            }
        }
    }
    Ok(last) // rounding left target at the very end
}

fn log_softmax(logits: &[f32]) -> Vec<f32> {
    let m = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let lse = m as f64 + logits.iter().map(|&l| ((l - m) as f64).exp()).sum::<f64>().ln();
    logits.iter().map(|&l| (l as f64 - lse) as f32).collect()
}

/// `token`'s log-probability under the raw distribution of `logits` (`log_softmax`, no
/// penalties or temperature), with the `top` most likely tokens, most likely first (lower id
/// first on ties).
pub fn logprobs_of(logits: &[f32], token: u32, top: usize) -> Sampled {
    entry_of(&log_softmax(logits), token, top)
}

/// [`logprobs_of`] with `token`'s rank (prompt log-probabilities).
pub fn ranked_logprobs_of(logits: &[f32], token: u32, top: usize) -> Sampled {
    let lp = log_softmax(logits);
    let logprob = lp[token as usize];
    let above = lp
        .iter()
        .enumerate()
        .filter(|&(i, &x)| x > logprob || (x == logprob && (i as u32) < token))
        .count();
    Sampled {
        rank: Some(1 + above as u32),
        ..entry_of(&lp, token, top)
    }
}

/// `token`'s entry under the log-probabilities `lp`, with the `top` most likely tokens.
fn entry_of(lp: &[f32], token: u32, top: usize) -> Sampled {
    let mut top_logprobs = Vec::new();
    if top > 0 {
        let mut idx: Vec<u32> = (0..lp.len() as u32).collect();
        let n = top.min(idx.len());
        let cmp = |a: &u32, b: &u32| lp[*b as usize].total_cmp(&lp[*a as usize]).then(a.cmp(b));
        if n < idx.len() {
            idx.select_nth_unstable_by(n - 1, cmp);
            idx.truncate(n);
        }
        idx.sort_unstable_by(cmp);
        top_logprobs = idx.into_iter().map(|i| (i, lp[i as usize])).collect();
    }
    Sampled {
        token,
        logprob: lp[token as usize],
        top_logprobs,
        rank: None,
    }
}

impl Sampler {
    /// A sampler; checks the parameters.
    pub fn new(params: SamplingParams) -> Result<Self> {
        params.validate()?;
        Ok(Self {
            params,
            end_ids: Vec::new(),
            step: 0,
        })
    }

    /// The ids kept out of the output's first `min_tokens` tokens (a request's stop ids).
    pub fn with_end_ids(mut self, ids: &[u32]) -> Self {
        self.end_ids = ids.to_vec();
        self
    }

    /// The parameters.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Reserves a fresh RNG step (callers drawing several numbers per position use lanes of it).
    pub fn next_step(&mut self) -> u64 {
        let s = self.step;
        self.step += 1;
        s
    }

    /// A uniform draw for `(row, step, lane)` under this sampler's seed.
    pub fn uniform(&self, row: usize, step: u64, lane: u64) -> f64 {
        rng::uniform(self.params.seed, row as u64, step, lane)
    }

    /// Penalised logits: every id outside `allowed_ids` (when given) masked, the end ids masked
    /// while `output` is shorter than `min_tokens`, each bad word's last id masked where
    /// `output` ends with the ids before it, the logit biases (as vLLM applies them),
    /// then the repetition penalty over `prompt ∪ output`, presence/frequency over `output`.
    pub fn penalised(&self, logits: &[f32], prompt: &[u32], output: &[u32]) -> Vec<f32> {
        let p = &self.params;
        let mut l = match p.allowed_ids.is_empty() {
            true => logits.to_vec(),
            // Every id masked, then the allowed ones' logits put back.
            false => {
                let mut l = vec![f32::NEG_INFINITY; logits.len()];
                for &t in &p.allowed_ids {
                    if let (Some(x), Some(&v)) = (l.get_mut(t as usize), logits.get(t as usize)) {
                        *x = v;
                    }
                }
                l
            }
        };
        if output.len() < p.min_tokens {
            for &t in &self.end_ids {
                if let Some(x) = l.get_mut(t as usize) {
                    *x = f32::NEG_INFINITY;
                }
            }
        }
        for word in &p.bad_words {
            if let Some((&last, before)) = word.split_last() {
                if output.ends_with(before) {
                    if let Some(x) = l.get_mut(last as usize) {
                        *x = f32::NEG_INFINITY;
                    }
                }
            }
        }
        for &(t, b) in &p.logit_bias {
            if let Some(x) = l.get_mut(t as usize) {
                // A finite logit stays finite; -inf (a masked id) stays masked.
                if x.is_finite() {
                    *x = (*x + b).clamp(f32::MIN, f32::MAX);
                }
            }
        }
        if p.repetition_penalty != 1.0 {
            let mut seen = vec![false; l.len()];
            for &t in prompt.iter().chain(output) {
                if let Some(s) = seen.get_mut(t as usize) {
                    *s = true;
                }
            }
            for (x, s) in l.iter_mut().zip(seen) {
                if s {
                    let y = if *x > 0.0 {
                        *x / p.repetition_penalty
                    } else {
                        *x * p.repetition_penalty
                    };
                    // A finite logit stays finite (a penalty far from 1 saturates it), so no
                    // extreme penalty can make the distribution NaN; -inf (a masked id) stays.
                    *x = if x.is_finite() {
                        y.clamp(f32::MIN, f32::MAX)
                    } else {
                        y
                    };
                }
            }
        }
        if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
            let mut counts = std::collections::HashMap::<u32, u32>::new();
            for &t in output {
                *counts.entry(t).or_default() += 1;
            }
            for (t, c) in counts {
                if let Some(x) = l.get_mut(t as usize) {
                    if x.is_finite() {
                        let y = *x - (p.presence_penalty + p.frequency_penalty * c as f32);
                        *x = y.clamp(f32::MIN, f32::MAX);
                    }
                }
            }
        }
        l
    }

    /// The distribution a token is drawn from (after every step of the pipeline), normalised.
    /// Greedy gives a one-hot vector at the argmax of the penalised logits.
    pub fn probs(&self, logits: &[f32], prompt: &[u32], output: &[u32], row: usize) -> Result<Vec<f32>> {
        check_logits(logits, row)?;
        let p = &self.params;
        let l = self.penalised(logits, prompt, output);
        let mut probs = vec![0.0f32; l.len()];
        if p.is_greedy() {
            if l.iter().all(|&x| x == f32::NEG_INFINITY) {
                return Err(Error::Empty { row });
            }
            probs[argmax(&l)] = 1.0;
            return Ok(probs);
        }
        let m = l.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        if m == f32::NEG_INFINITY {
            return Err(Error::Empty { row });
        }
        for (q, &x) in probs.iter_mut().zip(&l) {
            *q = (((x - m) / p.temperature) as f64).exp() as f32;
        }
        // Candidates sorted by (probability desc, id asc); ties at a cut are kept together so the
        // kept set never depends on an arbitrary order.
        let mut order: Vec<u32> = (0..probs.len() as u32)
            .filter(|&i| probs[i as usize] > 0.0)
            .collect();
        if order.is_empty() {
            return Err(Error::Empty { row });
        }
        let by_prob = |a: &u32, b: &u32| probs[*b as usize].total_cmp(&probs[*a as usize]).then(a.cmp(b));
        if p.top_k > 0 && p.top_k < order.len() {
            order.select_nth_unstable_by(p.top_k - 1, by_prob);
            let kth = probs[order[p.top_k - 1] as usize];
            order.retain(|&i| probs[i as usize] >= kth);
        }
        order.sort_unstable_by(by_prob);
        let total: f64 = order.iter().map(|&i| probs[i as usize] as f64).sum();
        let mut keep = order.len();
        if p.top_p < 1.0 {
            let mut acc = 0.0f64;
            for (n, &i) in order.iter().enumerate() {
                acc += probs[i as usize] as f64 / total;
                if acc >= p.top_p as f64 {
                    keep = n + 1;
                    break;
                }
            }
            let cut = probs[order[keep - 1] as usize];
            while keep < order.len() && probs[order[keep] as usize] == cut {
                keep += 1;
            }
        }
        if p.min_p > 0.0 {
            let floor = p.min_p * probs[order[0] as usize];
            keep = order[..keep]
                .iter()
                .take_while(|&&i| probs[i as usize] >= floor)
                .count();
        }
        let mut out = vec![0.0f32; probs.len()];
        let kept_total: f64 = order[..keep].iter().map(|&i| probs[i as usize] as f64).sum();
        for &i in &order[..keep] {
            out[i as usize] = (probs[i as usize] as f64 / kept_total) as f32;
        }
        Ok(out)
    }

    /// Samples one token for batch row `row` at RNG `step` (no state change).
    pub fn sample_at(
        &self,
        logits: &[f32],
        prompt: &[u32],
        output: &[u32],
        row: usize,
        step: u64,
    ) -> Result<Sampled> {
        let probs = self.probs(logits, prompt, output, row)?;
        let token = if self.params.is_greedy() {
            argmax(&probs)
        } else {
            draw_index(&probs, self.uniform(row, step, 0), row)?
        };
        Ok(self.logprobs(logits, token as u32))
    }

    /// `token`'s log-probability under the raw distribution of `logits`, with the
    /// `top_logprobs` most likely tokens (for a token chosen elsewhere, e.g. an accepted draft).
    pub fn logprobs(&self, logits: &[f32], token: u32) -> Sampled {
        logprobs_of(logits, token, self.params.top_logprobs)
    }

    /// Speculative acceptance coupled to plain sampling: the token at each verified position is
    /// drawn exactly as plain decoding draws it there ([`Self::sample_at`] with the RNG step of
    /// its output index, penalties over the output up to it), and draft `j` is kept while it
    /// equals that token. Every emitted token is a draw of the target distribution (lossless),
    /// accepted with probability `p(draft)` like the one-hot rule of [`crate::accept_stochastic`],
    /// and the tokens are the same as plain decoding's with this seed whatever the drafts.
    /// `rows[j]` are the logits after `output ++ drafts[..j]`.
    pub fn accept_coupled(
        &self,
        drafts: &[u32],
        rows: &[Vec<f32>],
        prompt: &[u32],
        output: &[u32],
    ) -> Result<crate::Acceptance> {
        if rows.len() != drafts.len() + 1 {
            return Err(Error::Shape(format!(
                "{} drafts need {} target rows, found {}",
                drafts.len(),
                drafts.len() + 1,
                rows.len()
            )));
        }
        let mut ctx = output.to_vec();
        let draw = |row: &[f32], ctx: &[u32]| -> Result<u32> {
            Ok(self.sample_at(row, prompt, ctx, 0, ctx.len() as u64)?.token)
        };
        for (j, &d) in drafts.iter().enumerate() {
            let t = draw(&rows[j], &ctx)?;
            if t != d {
                return Ok(crate::Acceptance { accepted: j, next: t });
            }
            ctx.push(t);
        }
        Ok(crate::Acceptance {
            accepted: drafts.len(),
            next: draw(&rows[drafts.len()], &ctx)?,
        })
    }

    /// Samples the next token of one sequence from `logits: [vocab]`.
    pub fn sample(&mut self, logits: &[f32], prompt: &[u32], output: &[u32]) -> Result<Sampled> {
        let step = self.next_step();
        self.sample_at(logits, prompt, output, 0, step)
    }

    /// Samples every row of `logits: [batch, vocab]` in parallel; `contexts[row] = (prompt, output)`.
    pub fn sample_rows(&mut self, logits: &Tensor, contexts: &[(&[u32], &[u32])]) -> Result<Vec<Sampled>> {
        let rows = logits.to_dtype(DType::F32)?.to_vec2::<f32>()?;
        if rows.len() != contexts.len() {
            return Err(Error::Shape(format!(
                "{} logits rows but {} contexts",
                rows.len(),
                contexts.len()
            )));
        }
        let step = self.next_step();
        rows.par_iter()
            .zip(contexts.par_iter())
            .enumerate()
            .map(|(row, (l, (prompt, output)))| self.sample_at(l, prompt, output, row, step))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A token's rank is its place in the `top_logprobs` order, from 1 (ties to the lower id).
    #[test]
    fn ranks_are_places_in_the_top_order() {
        let logits = [1.0f32, 3.0, 2.0, 3.0];
        let rank = |t| ranked_logprobs_of(&logits, t, 0).rank.unwrap();
        assert_eq!([rank(1), rank(3), rank(2), rank(0)], [1, 2, 3, 4]);
        assert_eq!(logprobs_of(&logits, 1, 0).rank, None);
        assert_eq!(
            ranked_logprobs_of(&logits, 2, 2).top_logprobs,
            logprobs_of(&logits, 2, 2).top_logprobs
        );
        let top: Vec<u32> = logprobs_of(&logits, 0, 4)
            .top_logprobs
            .iter()
            .map(|t| t.0)
            .collect();
        assert_eq!(top, [1, 3, 2, 0]);
    }

    /// Inverse CDF over half-open intervals: index i is drawn for `u` in `[F(i − 1), F(i))`, and
    /// a zero weight never.
    #[test]
    fn draw_index_intervals_are_half_open_and_skip_zero_weights() {
        let w = [0.5f32, 0.0, 0.5, 0.0];
        assert_eq!(draw_index(&w, 0.0, 0).unwrap(), 0);
        assert_eq!(draw_index(&w, 0.499, 0).unwrap(), 0);
        assert_eq!(draw_index(&w, 0.5, 0).unwrap(), 2);
        assert_eq!(draw_index(&w, 1.0 - f64::EPSILON / 2.0, 0).unwrap(), 2);
        assert!(matches!(
            draw_index(&[0.0, 0.0], 0.3, 4),
            Err(Error::Empty { row: 4 })
        ));
    }

    /// Coupled acceptance keeps drafts while they equal plain sampling's draw at their position
    /// (the RNG step of each is its output index), then returns that draw.
    #[test]
    fn coupled_acceptance_follows_plain_draws() {
        let rows = vec![vec![0.0, 3.0, 1.0], vec![2.0, 0.0, 1.0], vec![0.0, 0.0, 5.0]];
        let greedy = Sampler::new(SamplingParams::greedy()).unwrap();
        let acc = |s: &Sampler, d: &[u32]| s.accept_coupled(d, &rows[..d.len() + 1], &[], &[9]).unwrap();
        assert_eq!(
            (acc(&greedy, &[1, 0]).accepted, acc(&greedy, &[1, 0]).next),
            (2, 2)
        );
        assert_eq!(
            (acc(&greedy, &[1, 2]).accepted, acc(&greedy, &[1, 2]).next),
            (1, 0)
        );
        assert_eq!((acc(&greedy, &[]).accepted, acc(&greedy, &[]).next), (0, 1));
        assert!(greedy.accept_coupled(&[1], &rows, &[], &[]).is_err());
        // Sampled: each position's token is sample_at with step = its output index.
        let hot = Sampler::new(SamplingParams {
            temperature: 1.0,
            seed: 5,
            ..Default::default()
        })
        .unwrap();
        let mut ctx = vec![9u32];
        for row in &rows {
            let t = hot.sample_at(row, &[], &ctx, 0, ctx.len() as u64).unwrap().token;
            ctx.push(t);
        }
        let plain = &ctx[1..];
        let a = hot.accept_coupled(&plain[..2], &rows, &[], &[9]).unwrap();
        assert_eq!((a.accepted, a.next), (2, plain[2]));
        let wrong = (plain[1] + 1) % 3;
        let a = hot.accept_coupled(&[plain[0], wrong], &rows, &[], &[9]).unwrap();
        assert_eq!((a.accepted, a.next), (1, plain[1]));
    }

    #[test]
    fn params_are_kept() {
        let p = SamplingParams {
            temperature: 0.5,
            top_k: 3,
            seed: 9,
            ..Default::default()
        };
        assert_eq!(Sampler::new(p.clone()).unwrap().params(), &p);
    }
}
