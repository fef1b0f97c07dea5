//! Acceptance statistics of a speculative run.

/// Counters of one speculative generation.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SpecStats {
    /// Target forwards after the prefill: verifies, and steps that had no drafts to verify.
    pub cycles: usize,
    /// Draft tokens proposed.
    pub drafted: usize,
    /// Draft tokens accepted.
    pub accepted: usize,
    /// Tokens emitted by those passes (accepted drafts + one correction or bonus each).
    pub emitted: usize,
    /// `reached[j]`: cycles in which draft position j was verified (all drafts before it accepted).
    pub reached: Vec<usize>,
    /// `accepted_at[j]`: cycles in which draft position j was accepted.
    pub accepted_at: Vec<usize>,
    /// How often each accepted length 0..=k occurred.
    pub accepted_len_hist: Vec<usize>,
}

impl SpecStats {
    /// Counts one verify pass of `drafted` drafts (of up to `k` asked for) whose first
    /// `accepted` passed; a pass with no drafts (plain decoding through the loop, k = 0 included)
    /// counts as accepted length 0.
    pub fn record(&mut self, drafted: usize, accepted: usize, k: usize) {
        debug_assert!(accepted <= drafted, "{accepted} of {drafted} drafts accepted");
        let accepted = accepted.min(drafted);
        let k = k.max(drafted);
        if self.accepted_len_hist.len() < k + 1 {
            self.reached.resize(k, 0);
            self.accepted_at.resize(k, 0);
            self.accepted_len_hist.resize(k + 1, 0);
        }
        self.cycles += 1;
        self.drafted += drafted;
        self.accepted += accepted;
        self.emitted += accepted + 1;
        for j in 0..drafted.min(accepted + 1) {
            self.reached[j] += 1;
            if j < accepted {
                self.accepted_at[j] += 1;
            }
        }
        self.accepted_len_hist[accepted] += 1;
    }

    /// Adds another run's counters to these (a server's or a benchmark's total over requests).
    pub fn add(&mut self, other: &SpecStats) {
        self.cycles += other.cycles;
        self.drafted += other.drafted;
        self.accepted += other.accepted;
        self.emitted += other.emitted;
        for (mine, theirs) in [
            (&mut self.reached, &other.reached),
            (&mut self.accepted_at, &other.accepted_at),
            (&mut self.accepted_len_hist, &other.accepted_len_hist),
        ] {
            if mine.len() < theirs.len() {
                mine.resize(theirs.len(), 0);
            }
            for (m, t) in mine.iter_mut().zip(theirs) {
                *m += t;
            }
        }
    }

    /// Mean tokens emitted per pass (accepted drafts + 1): SGLang's "accept length" when every
    /// pass drafts; passes without drafts count as 1.
    pub fn accepted_len_mean(&self) -> f64 {
        if self.cycles == 0 {
            0.0
        } else {
            self.emitted as f64 / self.cycles as f64
        }
    }

    /// Verify passes that had drafts (vLLM's `num_drafts`).
    pub fn verifies(&self) -> usize {
        self.reached.first().copied().unwrap_or(0)
    }

    /// vLLM's mean acceptance length: 1 + the drafts accepted per verify that had drafts.
    pub fn accepted_len_per_verify(&self) -> f64 {
        match self.verifies() {
            0 => 0.0,
            v => 1.0 + self.accepted as f64 / v as f64,
        }
    }

    /// vLLM's per-position acceptance rates: the share of verifies with drafts that accepted
    /// draft j (so every draft before it too).
    pub fn accepted_shares(&self) -> Vec<f64> {
        let v = self.verifies().max(1) as f64;
        self.accepted_at.iter().map(|&a| a as f64 / v).collect()
    }

    /// `P(draft j accepted | drafts before j accepted)`, per draft position.
    pub fn acceptance_by_position(&self) -> Vec<f64> {
        self.reached
            .iter()
            .zip(&self.accepted_at)
            .map(|(&r, &a)| if r == 0 { 0.0 } else { a as f64 / r as f64 })
            .collect()
    }

    /// The acceptance at draft position `j` (given every draft before it passed), shrunk toward
    /// `prior` by `weight` pseudo-counts, so that a few verifies do not decide.
    pub fn rate(&self, j: usize, prior: f64, weight: f64) -> f64 {
        let (a, r) = (
            self.accepted_at.get(j).copied().unwrap_or(0) as f64,
            self.reached.get(j).copied().unwrap_or(0) as f64,
        );
        if r + weight <= 0.0 {
            return prior;
        }
        (a + weight * prior) / (r + weight)
    }

    /// Accepted / proposed drafts.
    pub fn acceptance_rate(&self) -> f64 {
        if self.drafted == 0 {
            0.0
        } else {
            self.accepted as f64 / self.drafted as f64
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Adding two runs' counters gives the counters of their passes recorded together.
    #[test]
    fn added_runs_count_as_one() {
        let passes = [(3, 3, 3), (3, 1, 3), (0, 0, 3), (5, 4, 5), (2, 0, 2)];
        let (mut a, mut b, mut all) = (SpecStats::default(), SpecStats::default(), SpecStats::default());
        for (i, &(d, acc, k)) in passes.iter().enumerate() {
            let part = if i < 2 { &mut a } else { &mut b };
            part.record(d, acc, k);
            all.record(d, acc, k);
        }
        a.add(&b);
        assert_eq!(a, all);
        // The other way round, the shorter vectors grow too.
        let (mut b2, mut a2) = (SpecStats::default(), SpecStats::default());
        b2.record(5, 4, 5);
        a2.record(3, 3, 3);
        b2.add(&a2);
        assert_eq!(b2.reached, [2, 2, 2, 1, 1]);
    }

    /// With no verify and no pseudo-counts the rate is the prior, not 0/0.
    #[test]
    fn an_unseen_position_without_weight_is_the_prior() {
        assert_eq!(SpecStats::default().rate(0, 0.5, 0.0), 0.5);
        assert_eq!(SpecStats::default().accepted_len_per_verify(), 0.0);
        assert_eq!(SpecStats::default().rate(3, 0.25, 2.0), 0.25);
    }

    /// Position j is reached when every draft before it passed; accepted lengths are counted.
    #[test]
    fn acceptance_conditions_on_reaching() {
        let mut c = SpecStats::default();
        c.record(3, 3, 3); // all accepted
        c.record(3, 1, 3); // the second rejected: the third never reached
        c.record(2, 0, 3);
        c.record(0, 0, 3); // no drafts: a plain step
        assert_eq!(c.reached, [3, 2, 1]);
        assert_eq!(c.accepted_at, [2, 1, 1]);
        assert_eq!(c.accepted_len_hist, [2, 1, 0, 1]);
        assert_eq!((c.cycles, c.drafted, c.accepted, c.emitted), (4, 8, 4, 8));
        assert_eq!(c.accepted_len_mean(), 2.0);
        // vLLM's figures leave out the pass without drafts.
        assert_eq!(c.verifies(), 3);
        assert_eq!(c.accepted_len_per_verify(), 1.0 + 4.0 / 3.0);
        assert_eq!(c.accepted_shares(), [2.0 / 3.0, 1.0 / 3.0, 1.0 / 3.0]);
        assert_eq!(c.rate(0, 0.5, 0.0), 2.0 / 3.0);
        assert_eq!(c.rate(5, 0.7, 4.0), 0.7, "no count: the prior");
        assert_eq!(c.rate(1, 0.0, 2.0), 0.25);
        // More drafts than the k given still count (k grows to them).
        c.record(5, 4, 1);
        assert_eq!(c.reached.len(), 5);
        assert_eq!(c.accepted_len_hist[4], 1);
    }
}
