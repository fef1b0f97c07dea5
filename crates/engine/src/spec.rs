//! How many drafts to verify: from how often drafts are accepted and what drafting and
//! verifying cost at the current batch size, the `k` that yields the most tokens per second, 0
//! included (then a sequence decodes plainly and its MTP head is not run).

use std::collections::HashMap;

/// The batch sizes costs are kept for: a batch counts as the next power of two.
fn bucket(batch: usize) -> usize {
    batch.max(1).next_power_of_two()
}

/// Samples of a step shape that are not counted: on a graph device its first step runs eagerly
/// and its second records the graph, both slower than the replays that follow (a first cost
/// that high could make a `k` look too dear ever to be measured again).
const WARMUP: u32 = 2;

/// A running mean that follows drift (each new sample weighs 1/4 once four are in), after the
/// first [`WARMUP`] samples.
#[derive(Debug, Clone, Copy, Default)]
struct Mean {
    value: f64,
    n: u32,
    skipped: u32,
}

impl Mean {
    fn add(&mut self, x: f64) {
        if self.skipped < WARMUP {
            self.skipped += 1;
            return;
        }
        self.n += 1;
        let w = 1.0 / f64::from(self.n.min(4));
        self.value += w * (x - self.value);
    }

    /// The mean, once a sample counts.
    fn get(&self) -> Option<f64> {
        (self.n > 0).then_some(self.value)
    }
}

/// The seconds speculation costs, per batch size: a step whose sequences each run `t` tokens
/// (a decode step is `t = 1`, a verify of `k` drafts `t = k + 1`), the MTP head's first draft step
/// (it also feeds the newly committed pairs) and each further draft step. Measured by the engine
/// as it runs, or given ([`Self::fixed`]).
#[derive(Debug, Clone, Default)]
pub struct SpecCosts {
    verify: HashMap<(usize, usize), Mean>,
    first_draft: HashMap<usize, Mean>,
    draft: HashMap<usize, Mean>,
    fixed: bool,
}

impl SpecCosts {
    /// Costs that measurements do not change: `verify(t)` seconds for a step of `t` tokens per
    /// sequence, `first_draft` and `draft` seconds per draft step, at every batch size up to
    /// `max_batch`.
    pub fn fixed(
        max_batch: usize,
        max_t: usize,
        verify: impl Fn(usize) -> f64,
        first_draft: f64,
        draft: f64,
    ) -> Self {
        let mut c = Self::default();
        let mut b = 1;
        while b <= bucket(max_batch) {
            for t in 1..=max_t {
                c.verify.insert(
                    (b, t),
                    Mean {
                        value: verify(t),
                        n: 1,
                        skipped: WARMUP,
                    },
                );
            }
            c.first_draft.insert(
                b,
                Mean {
                    value: first_draft,
                    n: 1,
                    skipped: WARMUP,
                },
            );
            c.draft.insert(
                b,
                Mean {
                    value: draft,
                    n: 1,
                    skipped: WARMUP,
                },
            );
            b *= 2;
        }
        c.fixed = true;
        c
    }

    /// A step of `batch` sequences that each ran `t` tokens took `secs`.
    pub(crate) fn record_step(&mut self, batch: usize, t: usize, secs: f64) {
        if !self.fixed {
            self.verify.entry((bucket(batch), t)).or_default().add(secs);
        }
    }

    /// The MTP head's draft step `step` over `batch` sequences took `secs`.
    pub(crate) fn record_draft(&mut self, batch: usize, step: usize, secs: f64) {
        if !self.fixed {
            let map = if step == 0 {
                &mut self.first_draft
            } else {
                &mut self.draft
            };
            map.entry(bucket(batch)).or_default().add(secs);
        }
    }

    /// Seconds of one cycle of `k` drafts at `batch`: the verify, and with `mtp` the draft
    /// steps; `None` while a part is unmeasured.
    fn cycle(&self, batch: usize, k: usize, mtp: bool) -> Option<f64> {
        let b = bucket(batch);
        let verify = self.verify.get(&(b, k + 1))?.get()?;
        if !mtp || k == 0 {
            return Some(verify);
        }
        let first = self.first_draft.get(&b)?.get()?;
        let rest = if k > 1 { self.draft.get(&b)?.get()? } else { 0.0 };
        Some(verify + first + (k - 1) as f64 * rest)
    }
}

/// Expected tokens one verify of `k` drafts yields: 1 (the correction or bonus token) plus the
/// chance that each prefix of drafts is all accepted, with `alpha[j]` the conditional acceptance
/// of position `j`.
pub fn expected_tokens(alpha: &[f64], k: usize) -> f64 {
    let mut all = 1.0;
    let mut e = 1.0;
    for &a in alpha.iter().take(k) {
        all *= a;
        e += all;
    }
    e
}

/// The number of drafts (`0..=k_max`) that gives the most tokens per second for sequences
/// whose acceptance is `alphas` (one list per sequence), at `batch` sequences, under `costs`
/// (`mtp`: drafts come from the MTP head and cost its steps; otherwise drafting is free). A `k`
/// whose cost is not measured yet is chosen to measure it, largest first.
pub fn choose_k(alphas: &[Vec<f64>], k_max: usize, batch: usize, costs: &SpecCosts, mtp: bool) -> usize {
    if let Some(k) = (0..=k_max).rev().find(|&k| costs.cycle(batch, k, mtp).is_none()) {
        return k;
    }
    let rate = |k: usize| -> f64 {
        let tokens: f64 = alphas.iter().map(|a| expected_tokens(a, k)).sum();
        tokens / costs.cycle(batch, k, mtp).unwrap_or(f64::INFINITY).max(1e-12)
    };
    // The smallest k of the best rate (a tie costs nothing to keep plain).
    (1..=k_max).fold(0, |best, k| if rate(k) > rate(best) { k } else { best })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A measured step: past the warm-up samples, each `secs`.
    fn step(c: &mut SpecCosts, batch: usize, t: usize, secs: f64) {
        for _ in 0..=WARMUP {
            c.record_step(batch, t, secs);
        }
    }

    /// A measured draft step, likewise.
    fn draft(c: &mut SpecCosts, batch: usize, at: usize, secs: f64) {
        for _ in 0..=WARMUP {
            c.record_draft(batch, at, secs);
        }
    }

    #[test]
    fn expected_tokens_multiplies_conditional_rates() {
        assert_eq!(expected_tokens(&[0.5, 0.5], 0), 1.0);
        assert_eq!(expected_tokens(&[0.5, 0.5], 1), 1.5);
        assert_eq!(expected_tokens(&[0.5, 0.5], 2), 1.75);
        assert_eq!(
            expected_tokens(&[0.5], 3),
            1.5,
            "no rate beyond the list counts as 0 gain"
        );
    }

    /// The published Qwen3.6-27B acceptance (0.963, 0.804, 0.640 at k = 3) on a GPU, where a
    /// verify of four tokens costs about a decode step: all three drafts pay.
    #[test]
    fn cheap_verifies_take_every_draft() {
        let alpha = vec![vec![0.963, 0.804, 0.640]];
        let costs = SpecCosts::fixed(1, 4, |t| 14e-3 + 0.1e-3 * t as f64, 1.2e-3, 1.0e-3);
        assert_eq!(choose_k(&alpha, 3, 1, &costs, true), 3);
    }

    /// When drafting costs more than the accepted drafts save, k falls to 0.
    #[test]
    fn costly_drafts_fall_to_zero() {
        let alpha = vec![vec![0.6, 0.5, 0.4]];
        // A CPU-like verify: each token costs as much as a decode step.
        let costs = SpecCosts::fixed(1, 4, |t| 7e-3 * t as f64, 3e-3, 3e-3);
        assert_eq!(choose_k(&alpha, 3, 1, &costs, true), 0);
        // The same drafts for free (prompt lookup) but a verify still costs per token.
        assert_eq!(choose_k(&alpha, 3, 1, &costs, false), 0);
        // Free drafts and flat verifies: speculate.
        let flat = SpecCosts::fixed(1, 4, |_| 7e-3, 0.0, 0.0);
        assert_eq!(choose_k(&alpha, 3, 1, &flat, false), 3);
        // Nothing accepted: never worth a draft, even at no cost beyond the verify.
        assert_eq!(choose_k(&[vec![0.0; 3]], 3, 1, &flat, true), 0);
    }

    /// A cycle is its verify of k + 1 tokens, plus with MTP the first draft step and k − 1
    /// further ones; costs are kept per power-of-two batch.
    #[test]
    fn a_cycle_adds_its_draft_steps() {
        let ms = |t: usize| t as f64 * 1e-3;
        let c = SpecCosts::fixed(4, 4, ms, 10e-3, 100e-3);
        let at = |b, k, mtp| c.cycle(b, k, mtp).map(|s| (s * 1e6).round() / 1e3);
        assert_eq!(at(1, 0, true), Some(1.0));
        assert_eq!(at(1, 1, true), Some(12.0));
        assert_eq!(at(1, 3, true), Some(214.0));
        assert_eq!(at(1, 3, false), Some(4.0));
        assert_eq!(at(4, 2, true), Some(113.0), "batches 3..4 share bucket 4");
        assert_eq!(at(2, 1, true), Some(12.0));
        assert_eq!(at(8, 1, true), None, "fixed up to batch 4 only");
        // Measured: the first draft step and the later ones are kept apart.
        let mut m = SpecCosts::default();
        for t in 1..=3 {
            step(&mut m, 2, t, ms(t));
        }
        draft(&mut m, 2, 0, 10e-3);
        assert_eq!(m.cycle(2, 1, true).map(|s| (s * 1e6).round()), Some(12e3));
        assert!(m.cycle(2, 2, true).is_none(), "no later draft step measured yet");
        draft(&mut m, 2, 1, 100e-3);
        draft(&mut m, 2, 2, 100e-3);
        assert_eq!(m.cycle(2, 2, true).map(|s| (s * 1e6).round()), Some(113e3));
        // Given costs do not move.
        let mut f = SpecCosts::fixed(1, 2, ms, 0.0, 0.0);
        step(&mut f, 1, 1, 5.0);
        draft(&mut f, 1, 0, 5.0);
        assert_eq!(f.cycle(1, 1, true), Some(2e-3));
    }

    /// Where the costs end, the unmeasured k is tried (largest first).
    #[test]
    fn unmeasured_costs_are_explored() {
        let mut costs = SpecCosts::default();
        let alpha = vec![vec![0.9; 3]];
        assert_eq!(choose_k(&alpha, 3, 2, &costs, true), 3);
        step(&mut costs, 2, 4, 0.01);
        draft(&mut costs, 2, 0, 0.001);
        draft(&mut costs, 2, 1, 0.001);
        assert_eq!(choose_k(&alpha, 3, 2, &costs, true), 2, "t = 3 is unmeasured");
        for t in 1..=3 {
            step(&mut costs, 2, t, 0.01);
        }
        assert_eq!(choose_k(&alpha, 3, 2, &costs, true), 3);
        // Batch 3 counts as 4: nothing measured there yet.
        assert_eq!(choose_k(&alpha, 3, 3, &costs, true), 3);
        assert!(costs.cycle(4, 3, true).is_none());
    }

    /// The first samples of a shape (an eager step, a graph's recording) do not count: until a
    /// later one comes the shape is unmeasured, and then its cost is the later ones'.
    #[test]
    fn warm_up_samples_do_not_count() {
        let mut c = SpecCosts::default();
        for _ in 0..WARMUP {
            c.record_step(1, 4, 1.0);
            assert!(c.cycle(1, 3, false).is_none());
        }
        c.record_step(1, 4, 0.01);
        assert_eq!(c.cycle(1, 3, false), Some(0.01));
    }

    #[test]
    fn means_follow_drift() {
        let mut m = Mean {
            skipped: WARMUP,
            ..Mean::default()
        };
        assert_eq!(m.get(), None);
        m.add(4.0);
        assert_eq!(m.value, 4.0);
        m.add(2.0);
        assert_eq!(m.value, 3.0);
        for _ in 0..40 {
            m.add(10.0);
        }
        assert!((m.value - 10.0).abs() < 1e-3);
    }
}
