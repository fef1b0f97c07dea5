//! Sampling parameters.

use crate::{Error, Result};

/// How one sequence samples. Defaults are plain greedy decoding.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 = greedy (argmax); otherwise logits are divided by it.
    pub temperature: f32,
    /// Keep the k most likely tokens; 0 = off.
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose mass reaches top_p; 1 = off.
    pub top_p: f32,
    /// Drop tokens whose probability is below `min_p · p_max`; 0 = off.
    pub min_p: f32,
    /// HF-style: seen tokens' positive logits are divided by it, negative ones multiplied; 1 = off.
    pub repetition_penalty: f32,
    /// Subtracted once from the logit of every token already generated, in [-2, 2]; 0 = off.
    pub presence_penalty: f32,
    /// Subtracted per occurrence from the logit of tokens already generated, in [-2, 2]; 0 = off.
    pub frequency_penalty: f32,
    /// Seed of the counter-based RNG.
    pub seed: u64,
    /// Return this many top log-probabilities per step (of the raw model distribution).
    pub top_logprobs: usize,
    /// Added to these token ids' logits before the penalties (OpenAI's `logit_bias`, each in
    /// [-100, 100]); empty = off.
    pub logit_bias: Vec<(u32, f32)>,
    /// The output's first `min_tokens` tokens are never one of the sampler's end ids
    /// ([`crate::Sampler::with_end_ids`]: a request's stop ids; vLLM's `min_tokens`); 0 = off.
    pub min_tokens: usize,
    /// Only these ids may be drawn (vLLM's `allowed_token_ids`), every other one masked before
    /// the biases; empty = all.
    pub allowed_ids: Vec<u32>,
    /// Id sequences the output never contains (vLLM's `bad_words`): a sequence's last id is
    /// masked wherever the output ends with the ids before it; empty = off.
    pub bad_words: Vec<Vec<u32>>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: 0,
            top_logprobs: 0,
            logit_bias: Vec::new(),
            min_tokens: 0,
            allowed_ids: Vec::new(),
            bad_words: Vec::new(),
        }
    }
}

impl SamplingParams {
    /// Greedy decoding.
    pub fn greedy() -> Self {
        Self::default()
    }

    /// True when decoding takes the argmax.
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// True when the token is the argmax of the raw logits: greedy without penalties, biases,
    /// a minimum length, allowed ids or bad words.
    pub fn is_plain_greedy(&self) -> bool {
        self.is_greedy()
            && self.min_tokens == 0
            && self.repetition_penalty == 1.0
            && self.presence_penalty == 0.0
            && self.frequency_penalty == 0.0
            && self.logit_bias.is_empty()
            && self.allowed_ids.is_empty()
            && self.bad_words.is_empty()
    }

    /// True when `allowed_ids` are given and the first step masks every one of them: each is a
    /// one-id bad word (masked at every step) or, under `min_tokens`, one of `end_ids` (the
    /// sampler's [`crate::Sampler::with_end_ids`]). No token could then be drawn.
    pub fn masks_every_allowed_id(&self, end_ids: &[u32]) -> bool {
        let masked = |t: &u32| {
            self.bad_words.iter().any(|w| w[..] == [*t]) || (self.min_tokens > 0 && end_ids.contains(t))
        };
        !self.allowed_ids.is_empty() && self.allowed_ids.iter().all(masked)
    }

    /// Checks every parameter's range.
    pub fn validate(&self) -> Result<()> {
        let bad = |name, value: f32, msg| {
            Err(Error::Param {
                name,
                value: value as f64,
                msg,
            })
        };
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return bad("temperature", self.temperature, "must be finite and >= 0");
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad("top_p", self.top_p, "must be in (0, 1]");
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad("min_p", self.min_p, "must be in [0, 1]");
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            return bad(
                "repetition_penalty",
                self.repetition_penalty,
                "must be finite and > 0",
            );
        }
        // OpenAI's range, which vLLM enforces too.
        for (name, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !(-2.0..=2.0).contains(&v) {
                return bad(name, v, "must be in [-2, 2]");
            }
        }
        // OpenAI's range.
        if let Some(&(_, b)) = self
            .logit_bias
            .iter()
            .find(|(_, b)| !(-100.0..=100.0).contains(b))
        {
            return bad("logit_bias", b, "each bias must be in [-100, 100]");
        }
        if self.bad_words.iter().any(Vec::is_empty) {
            return bad("bad_words", 0.0, "each bad word needs at least one id");
        }
        if self.masks_every_allowed_id(&[]) {
            return bad(
                "bad_words",
                0.0,
                "masks every id of allowed_token_ids: no token could be drawn",
            );
        }
        Ok(())
    }
}
