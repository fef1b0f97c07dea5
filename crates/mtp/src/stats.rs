//! Acceptance statistics of a speculative run.

/// Counters of one speculative generation.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SpecStats {
    /// Verify passes (target forwards after the prefill).
    pub cycles: usize,
    /// Draft tokens proposed.
    pub drafted: usize,
    /// Draft tokens accepted.
    pub accepted: usize,
    /// Tokens emitted by verify passes (accepted drafts + one correction or bonus each).
    pub emitted: usize,
    /// `reached[j]`: cycles in which draft position j was verified (all drafts before it accepted).
    pub reached: Vec<usize>,
    /// `accepted_at[j]`: cycles in which draft position j was accepted.
    pub accepted_at: Vec<usize>,
    /// How often each accepted length 0..=k occurred.
    pub accepted_len_hist: Vec<usize>,
}

impl SpecStats {
    pub(crate) fn record(&mut self, drafted: usize, accepted: usize, k: usize) {
        // k = 0 (plain decoding through the loop) still counts its cycles' accepted length 0.
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

    /// Mean tokens emitted per verify pass (accepted drafts + 1): SGLang's "accept length".
    pub fn accepted_len_mean(&self) -> f64 {
        if self.cycles == 0 {
            0.0
        } else {
            self.emitted as f64 / self.cycles as f64
        }
    }

    /// `P(draft j accepted | drafts before j accepted)`, per draft position.
    pub fn acceptance_by_position(&self) -> Vec<f64> {
        self.reached
            .iter()
            .zip(&self.accepted_at)
            .map(|(&r, &a)| if r == 0 { 0.0 } else { a as f64 / r as f64 })
            .collect()
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
