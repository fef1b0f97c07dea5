//! Drafters: what proposes the tokens the target verifies.

use candle_core::Tensor;
use qwen36_model::{DraftSession, MtpHead, Qwen36Model};

use crate::Result;

/// What a drafter sees before proposing.
#[derive(Debug, Clone, Copy)]
pub struct DraftContext<'a> {
    /// Every token so far, prompt included; the last one was sampled but not yet run by the target.
    pub tokens: &'a [u32],
    /// The target's final-norm hidden states `[1, m, hidden]` of the `m` positions committed since
    /// the previous call: positions `tokens.len() - 1 - m ..= tokens.len() - 2`.
    pub new_hidden: &'a Tensor,
}

/// Proposes draft tokens for the target to verify.
pub trait Drafter {
    /// Up to `k` tokens to follow `ctx.tokens` (fewer, or none, when it has no guess).
    fn propose(&mut self, ctx: &DraftContext, k: usize) -> Result<Vec<u32>>;
    /// Forgets the sequence (called before a new one).
    fn reset(&mut self);
}

/// Drafts with the checkpoint's MTP head: greedy chain of `k` steps, the first step fed the
/// target's hidden states, the next ones the head's own output. Steps replay CUDA graphs where
/// the device allows ([`qwen36_model::DraftStepper`]), kept with the head's cache across
/// sequences.
pub struct MtpDrafter<'m> {
    model: &'m Qwen36Model,
    head: &'m MtpHead,
    session: DraftSession,
}

impl<'m> MtpDrafter<'m> {
    /// A drafter over `model` and its `head`.
    pub fn new(model: &'m Qwen36Model, head: &'m MtpHead) -> Self {
        Self::with_session(model, head, DraftSession::new(model, head))
    }

    /// A drafter that runs in `session` (made for `head`, e.g. kept from an earlier drafter with
    /// [`Self::into_session`]: its graphs are reused).
    pub fn with_session(model: &'m Qwen36Model, head: &'m MtpHead, session: DraftSession) -> Self {
        Self { model, head, session }
    }

    /// The head's cache and draft stepper, for a later drafter.
    pub fn into_session(self) -> DraftSession {
        self.session
    }

    /// One chain step: the last position's post-norm state `[1, 1, hidden]` and its greedy token
    /// `[1, 1]` (u32), left on the device so the chain needs no host round trip.
    fn step(&mut self, hidden: &Tensor, ids: &Tensor, step: usize) -> Result<(Tensor, Tensor)> {
        let DraftSession { cache, stepper } = &mut self.session;
        Ok(stepper.draft(self.head, self.model, hidden, ids, cache, step)?)
    }
}

impl Drafter for MtpDrafter<'_> {
    fn propose(&mut self, ctx: &DraftContext, k: usize) -> Result<Vec<u32>> {
        let m = ctx.new_hidden.dim(1)?;
        let n = ctx.tokens.len();
        if k == 0 || m == 0 || n < m + 1 {
            return Ok(Vec::new());
        }
        // Positions before the new ones hold real pairs; later entries were last round's draft
        // chain: drop them, then feed the pairs (h_i, x_{i+1}) of the newly committed positions.
        let committed = n - 1 - m;
        self.session.cache.truncate(committed);
        let dev = self.model.device();
        let next = Tensor::new(&ctx.tokens[committed + 1..n], dev)?.unsqueeze(0)?;
        let (mut last, mut tok) = self.step(ctx.new_hidden, &next, 0)?;
        let mut drafts = vec![tok.clone()];
        for step in 1..k {
            (last, tok) = self.step(&last, &tok, step)?;
            drafts.push(tok.clone());
        }
        // The only host synchronisation of the chain.
        Ok(Tensor::cat(&drafts, 1)?.flatten_all()?.to_vec1::<u32>()?)
    }

    fn reset(&mut self) {
        self.session.reset();
    }
}

/// Prompt-lookup drafting: find the longest recent n-gram (`max_n` down to `min_n` tokens) that
/// ends the context and occurred before; propose what followed its latest earlier occurrence. A
/// continuation that runs into the end of the context continues with its own proposal, so a
/// repeating pattern is drafted for all `k` tokens.
#[derive(Debug, Clone)]
pub struct NgramDrafter {
    /// Shortest suffix to match.
    pub min_n: usize,
    /// Longest suffix to match.
    pub max_n: usize,
}

impl Default for NgramDrafter {
    fn default() -> Self {
        Self { min_n: 1, max_n: 4 }
    }
}

impl NgramDrafter {
    /// Up to `k` drafts continuing `tokens`: what followed the latest earlier occurrence of its
    /// longest suffix of `min_n..=max_n` tokens (none when no suffix recurs).
    pub fn propose_tokens(&self, t: &[u32], k: usize) -> Vec<u32> {
        // (Suffixes as long as `t` have no earlier occurrence.)
        for n in (self.min_n.max(1)..=self.max_n.min(t.len().saturating_sub(1))).rev() {
            let suffix = &t[t.len() - n..];
            // Latest earlier occurrence whose continuation exists.
            if let Some(start) = (0..t.len() - n).rev().find(|&i| &t[i..i + n] == suffix) {
                let mut out: Vec<u32> = Vec::with_capacity(k);
                for j in start + n..start + n + k {
                    out.push(if j < t.len() { t[j] } else { out[j - t.len()] });
                }
                return out;
            }
        }
        Vec::new()
    }
}

impl Drafter for NgramDrafter {
    fn propose(&mut self, ctx: &DraftContext, k: usize) -> Result<Vec<u32>> {
        Ok(self.propose_tokens(ctx.tokens, k))
    }

    fn reset(&mut self) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Suffix lengths past the tokens are not walked (a huge `max_n` hung).
    #[test]
    fn a_huge_max_n_is_cut_to_the_tokens() {
        let d = NgramDrafter {
            min_n: 1,
            max_n: usize::MAX,
        };
        assert_eq!(d.propose_tokens(&[1, 2, 1], 2), vec![2, 1]);
        assert!(d.propose_tokens(&[], 2).is_empty());
    }

    fn ngram(d: &mut NgramDrafter, tokens: &[u32], k: usize) -> Vec<u32> {
        let h = Tensor::zeros((1, 1, 1), candle_core::DType::F32, &candle_core::Device::Cpu).unwrap();
        d.propose(
            &DraftContext {
                tokens,
                new_hidden: &h,
            },
            k,
        )
        .unwrap()
    }

    /// Prompt lookup by hand: the longest suffix (up to `max_n`) seen before wins, its latest
    /// earlier occurrence is continued, and a continuation that runs into the end of the context
    /// repeats its own proposal.
    #[test]
    fn ngram_continues_the_latest_longest_match() {
        let mut d = NgramDrafter::default();
        // Suffix [1, 2] occurred at 0: continue with 3, 4, 1, 2, then 3, 4 again.
        assert_eq!(ngram(&mut d, &[1, 2, 3, 4, 1, 2], 3), vec![3, 4, 1]);
        assert_eq!(ngram(&mut d, &[1, 2, 3, 4, 1, 2], 6), vec![3, 4, 1, 2, 3, 4]);
        // [7, 2] beats the shorter [2]: [2] last occurred before 9, [7, 2] before 5.
        assert_eq!(ngram(&mut d, &[7, 2, 5, 2, 9, 7, 2], 2), vec![5, 2]);
        // The latest of two occurrences of [2].
        assert_eq!(ngram(&mut d, &[2, 5, 2, 6, 2], 1), vec![6]);
        // No earlier occurrence, or too short a context: nothing.
        assert_eq!(ngram(&mut d, &[1, 2, 3], 2), Vec::<u32>::new());
        assert_eq!(ngram(&mut d, &[4], 2), Vec::<u32>::new());
        // min_n above the only match's length: nothing.
        let mut long = NgramDrafter { min_n: 2, max_n: 3 };
        assert_eq!(ngram(&mut long, &[2, 5, 2, 6, 2], 1), Vec::<u32>::new());
        assert_eq!(ngram(&mut long, &[8, 2, 5, 8, 2], 2), vec![5, 8]);
    }
}
