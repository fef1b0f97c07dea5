//! The speculative decoding loop: draft, verify, accept, commit.

use candle_core::Tensor;
use qwen36_model::{Qwen36Model, Session};
use qwen36_sampling::{accept_greedy, accept_stochastic, Sampler, SamplingParams};

use crate::{DraftContext, Drafter, Error, Result, SpecStats};

/// Settings of one speculative generation.
#[derive(Debug, Clone)]
pub struct SpecConfig {
    /// Drafts per verify pass (0 = plain decoding through the same loop).
    pub k: usize,
    /// Upper bound on generated tokens.
    pub max_new_tokens: usize,
    /// Generation ends after any of these (included in the output).
    pub stop_token_ids: Vec<u32>,
}

/// Why a speculative generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpecStopReason {
    /// `max_new_tokens` reached.
    MaxTokens,
    /// A stop token was emitted (the last of `tokens`).
    StopToken(u32),
    /// The model's context is full.
    ContextFull,
    /// The `on_token` callback asked to stop (e.g. a stop string matched).
    Callback,
}

/// Output of a speculative generation.
#[derive(Debug, Clone)]
pub struct SpecOutput {
    /// Generated ids (a stop token included).
    pub tokens: Vec<u32>,
    pub stop_reason: SpecStopReason,
    pub stats: SpecStats,
}

/// Runs speculative decoding of one sequence on a target model.
///
/// Lossless: with greedy sampling the output is the target's own greedy continuation; with
/// sampling each token follows the target's processed distribution (drafts are the drafter's
/// argmax picks, so `q` is one-hot: accept with probability `p(d)`, else draw from `p` without `d`).
///
/// The target's cache and its stepper (whose verify passes replay CUDA graphs where the device
/// allows) live as long as the decoder: later generations reset the cache and reuse the graphs.
pub struct SpeculativeDecoder<'m> {
    model: &'m Qwen36Model,
    sampler: Sampler,
    session: Session,
}

impl<'m> SpeculativeDecoder<'m> {
    /// A decoder sampling with `params`.
    pub fn new(model: &'m Qwen36Model, params: SamplingParams) -> Result<Self> {
        Self::with_session(model, params, Session::new(model, 1)?)
    }

    /// A decoder that generates in `session` (a batch-1 cache of `model`, e.g. one kept from an
    /// earlier decoder with [`Self::into_session`]: its graphs are reused).
    pub fn with_session(model: &'m Qwen36Model, params: SamplingParams, session: Session) -> Result<Self> {
        if session.cache.batch() != 1 {
            return Err(Error::Input(format!(
                "speculative decoding runs one sequence; the session's cache holds {}",
                session.cache.batch()
            )));
        }
        Ok(Self {
            model,
            sampler: Sampler::new(params)?,
            session,
        })
    }

    /// The cache and stepper, for a later decoder.
    pub fn into_session(self) -> Session {
        self.session
    }

    /// The cache and stepper the generations run in.
    pub fn session(&self) -> &Session {
        &self.session
    }

    /// Generates after `prompt`, calling `on_token` for every emitted token; it returns `false` to
    /// stop generation after that token.
    pub fn generate(
        &mut self,
        drafter: &mut dyn Drafter,
        prompt: &[u32],
        cfg: &SpecConfig,
        mut on_token: impl FnMut(u32) -> bool,
    ) -> Result<SpecOutput> {
        if prompt.is_empty() {
            return Err(Error::Input("empty prompt".into()));
        }
        if cfg.max_new_tokens == 0 {
            return Err(Error::Input("max_new_tokens must be at least 1".into()));
        }
        let model = self.model;
        let dev = model.device();
        let max_ctx = model.config().max_position_embeddings;
        let mut stats = SpecStats::default();
        self.session.reset()?;
        // Each generation samples from its seed's start, as a fresh decoder would; its stop ids
        // are kept out of the first `min_tokens`.
        self.sampler = Sampler::new(self.sampler.params().clone())?.with_end_ids(&cfg.stop_token_ids);
        let Session { cache, stepper } = &mut self.session;
        drafter.reset();

        let hidden = model.forward_hidden(&Tensor::new(prompt, dev)?.unsqueeze(0)?, cache)?;
        let last = model
            .logits(&hidden.narrow(1, prompt.len() - 1, 1)?)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let first = self.sampler.sample(&last, prompt, &[])?.token;
        let mut output = vec![first];
        let mut tokens: Vec<u32> = prompt.iter().copied().chain([first]).collect();
        let mut new_hidden = hidden;
        let mut reason = SpecStopReason::MaxTokens;
        if cfg.stop_token_ids.contains(&first) {
            reason = SpecStopReason::StopToken(first);
        }
        if !on_token(first) && reason == SpecStopReason::MaxTokens {
            reason = SpecStopReason::Callback;
        }

        while reason == SpecStopReason::MaxTokens && output.len() < cfg.max_new_tokens {
            // The verify pass runs the last token plus the drafts: all must fit the context, and
            // drafts past max_new_tokens would be wasted (k drafts give up to k + 1 tokens).
            if cache.seq_len() + 1 > max_ctx {
                reason = SpecStopReason::ContextFull;
                break;
            }
            let room = max_ctx - cache.seq_len() - 1;
            let k = cfg.k.min(room).min(cfg.max_new_tokens - output.len() - 1);
            let ctx = DraftContext {
                tokens: &tokens,
                new_hidden: &new_hidden,
            };
            let mut drafts = if k > 0 {
                drafter.propose(&ctx, k)?
            } else {
                Vec::new()
            };
            drafts.truncate(k);

            let x = *tokens.last().expect("non-empty");
            let ids: Vec<u32> = std::iter::once(x).chain(drafts.iter().copied()).collect();
            let ids = Tensor::new(ids.as_slice(), dev)?.unsqueeze(0)?;
            let h = stepper.forward_verify(model, &ids, cache)?;
            let rows = model.logits(&h)?.squeeze(0)?.to_vec2::<f32>()?;
            let acc = accept_drafts(&mut self.sampler, &drafts, &rows, prompt, &output)?;
            stepper.commit(cache, acc.accepted + 1)?;
            stats.record(drafts.len(), acc.accepted, cfg.k);

            let fresh: Vec<u32> = drafts[..acc.accepted].iter().copied().chain([acc.next]).collect();
            for &t in &fresh {
                output.push(t);
                tokens.push(t);
                let go_on = on_token(t);
                if cfg.stop_token_ids.contains(&t) {
                    reason = SpecStopReason::StopToken(t);
                    break;
                }
                if !go_on {
                    reason = SpecStopReason::Callback;
                    break;
                }
                if output.len() >= cfg.max_new_tokens {
                    break;
                }
            }
            new_hidden = h.narrow(1, 0, acc.accepted + 1)?;
        }
        Ok(SpecOutput {
            tokens: output,
            stop_reason: reason,
            stats,
        })
    }
}

/// Accepts a prefix of `drafts` (the drafter's argmax picks) given the target logits `rows` of a
/// verify pass (row j follows `output + drafts[..j]`), under `sampler`'s processing: greedy, or
/// lossless rejection sampling with one RNG step of `sampler` per call.
pub fn accept_drafts(
    sampler: &mut Sampler,
    drafts: &[u32],
    rows: &[Vec<f32>],
    prompt: &[u32],
    output: &[u32],
) -> Result<qwen36_sampling::Acceptance> {
    let mut ctx = output.to_vec();
    let mut probs = Vec::with_capacity(rows.len());
    for (j, row) in rows.iter().enumerate() {
        probs.push(sampler.probs(row, prompt, &ctx, j)?);
        if let Some(&d) = drafts.get(j) {
            ctx.push(d);
        }
    }
    if sampler.params().is_greedy() {
        let argmax: Vec<u32> = probs
            .iter()
            .map(|p| p.iter().position(|&v| v == 1.0).unwrap_or(0) as u32)
            .collect();
        return Ok(accept_greedy(drafts, &argmax)?);
    }
    let step = sampler.next_step();
    let s = &*sampler;
    Ok(accept_stochastic(drafts, None, &probs, |lane| {
        s.uniform(0, step, lane)
    })?)
}
