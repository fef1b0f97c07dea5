//! The engine: requests in, one batched forward per step, events out.

use std::ops::Range;
use std::sync::atomic::AtomicBool;
use std::sync::mpsc::channel;
use std::sync::Arc;

use candle_core::{DType, Tensor};
use qwen36_model::{BatchPending, ForwardBatch, PagedCache, Qwen36Model, SeqChunk};
use qwen36_mtp::{accept_drafts, NgramDrafter};
use qwen36_sampling::Sampler;

use crate::scheduler::{Scheduler, Sequence};
use crate::{
    BlockPool, Error, Event, Request, RequestHandle, Result, SlotPool, Speculation, StopReason, Usage,
};

/// Logits rows (f32, one per token) of one sequence's chunk.
type Rows = Vec<Vec<f32>>;

/// Sizes and limits of an engine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineConfig {
    /// Sequences running at once (GDN state slots).
    pub max_seqs: usize,
    /// KV blocks in the pool; `None`: enough for every slot to reach the model's context.
    pub kv_blocks: Option<usize>,
    /// Positions per KV block.
    pub block_size: usize,
    /// Requests that may wait for a slot; a submit beyond them is refused.
    pub max_queue: usize,
    /// The most tokens one forward runs (prefill chunks and decode tokens together).
    pub step_tokens: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            max_seqs: 8,
            kv_blocks: None,
            block_size: 16,
            max_queue: 256,
            step_tokens: 512,
        }
    }
}

/// What one [`Engine::step`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepStats {
    /// Sequences in the forward.
    pub sequences: usize,
    /// Tokens the forward ran.
    pub tokens: usize,
    /// Tokens generated.
    pub generated: usize,
    /// Requests that ended.
    pub finished: usize,
}

/// Many sequences at once over pooled GDN state and paged KV: [`Self::submit`] requests, call
/// [`Self::step`] (each runs one forward of every scheduled sequence), read each request's events
/// from its [`RequestHandle`].
#[derive(Debug)]
pub struct Engine {
    model: Qwen36Model,
    cache: PagedCache,
    sched: Scheduler,
    cfg: EngineConfig,
    next_id: u64,
}

impl Engine {
    /// An engine over `model` with pools sized by `cfg`.
    pub fn new(model: Qwen36Model, cfg: EngineConfig) -> Result<Self> {
        let context = model.config().max_position_embeddings;
        if cfg.step_tokens == 0 || cfg.max_seqs == 0 {
            return Err(Error::Size {
                pool: "engine",
                msg: format!(
                    "needs max_seqs and step_tokens above 0, found {} and {}",
                    cfg.max_seqs, cfg.step_tokens
                ),
            });
        }
        let blocks = cfg
            .kv_blocks
            .unwrap_or_else(|| cfg.max_seqs * context.div_ceil(cfg.block_size.max(1)));
        let sched = Scheduler {
            waiting: Default::default(),
            running: Vec::new(),
            slots: SlotPool::new(cfg.max_seqs)?,
            blocks: BlockPool::new(blocks, cfg.block_size)?,
            step_tokens: cfg.step_tokens,
        };
        let cache = model.new_paged_cache(cfg.max_seqs, blocks, cfg.block_size)?;
        Ok(Self {
            model,
            cache,
            sched,
            cfg,
            next_id: 0,
        })
    }

    /// The model.
    pub fn model(&self) -> &Qwen36Model {
        &self.model
    }

    /// The sizes it runs with.
    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// Queues a request. Refused with a typed error when it is malformed or can never fit
    /// (prompt and `max_tokens` over the model's context or the whole KV pool), or when the
    /// queue is full.
    pub fn submit(&mut self, req: Request) -> Result<RequestHandle> {
        let context = self.model.config().max_position_embeddings;
        let vocab = self.model.config().vocab_size;
        if req.prompt.is_empty() {
            return Err(Error::Request("the prompt has no tokens".into()));
        }
        if let Some(&id) = req.prompt.iter().find(|&&id| id as usize >= vocab) {
            return Err(Error::Request(format!(
                "prompt token {id} is outside the vocabulary of {vocab}"
            )));
        }
        if req.max_tokens == Some(0) {
            return Err(Error::Request("max_tokens must be at least 1".into()));
        }
        // The last generated token is never run, so a sequence holds prompt + max_tokens − 1.
        let positions = req.prompt.len() + req.max_tokens.unwrap_or(1) - 1;
        let pool = self.sched.blocks.capacity() * self.sched.blocks.block_size();
        if positions > context.min(pool) {
            return Err(Error::TooLong {
                needed: req.prompt.len() + req.max_tokens.unwrap_or(1),
                context,
                pool,
            });
        }
        if self.sched.waiting.len() >= self.cfg.max_queue {
            return Err(Error::QueueFull(self.cfg.max_queue));
        }
        let sampler = Sampler::new(req.sampling).map_err(|e| Error::Request(e.to_string()))?;
        let (tx, rx) = channel();
        let cancel = Arc::new(AtomicBool::new(false));
        let id = self.next_id;
        self.next_id += 1;
        self.sched.wait(Sequence {
            id,
            prompt: req.prompt,
            output: Vec::new(),
            sampler,
            max_tokens: req.max_tokens,
            stop_ids: req.stop_ids,
            logprobs: req.logprobs,
            events: tx,
            cancel: cancel.clone(),
            slot: None,
            table: Default::default(),
            computed: 0,
            preemptions: 0,
            speculation: req.speculation,
            verify: false,
            drafts: Vec::new(),
            drafted: 0,
            accepted: 0,
        });
        Ok(RequestHandle::new(id, rx, cancel))
    }

    /// Requests waiting or running.
    pub fn pending(&self) -> usize {
        self.sched.waiting.len() + self.sched.running.len()
    }

    /// Requests waiting for a slot.
    pub fn waiting(&self) -> usize {
        self.sched.waiting.len()
    }

    /// Slots and KV blocks in use.
    pub fn pool_use(&self) -> (usize, usize) {
        let (s, b) = (&self.sched.slots, &self.sched.blocks);
        (s.capacity() - s.free(), b.capacity() - b.free())
    }

    /// Runs one forward of every scheduled sequence, samples their next tokens (or verifies
    /// their drafts) and sends the events. A failing forward fails the requests in it (each gets
    /// [`Event::Failed`]) and returns the error.
    pub fn step(&mut self) -> Result<StepStats> {
        self.draft();
        let (plan, ended) = self.sched.schedule()?;
        let mut stats = StepStats {
            finished: ended.len(),
            ..Default::default()
        };
        for (s, reason) in ended {
            finish(&s, reason);
        }
        if plan.is_empty() {
            return Ok(stats);
        }
        let chunks: Vec<SeqChunk> = plan
            .iter()
            .map(|p| {
                let s = &self.sched.running[p.index];
                let mut tokens = s.tokens(s.computed, p.tokens - s.drafts.len());
                tokens.extend(&s.drafts);
                SeqChunk {
                    slot: s.slot.expect("a running sequence has a slot").0,
                    start: s.computed,
                    tokens,
                    blocks: s.table.blocks().iter().map(|b| b.0).collect(),
                    verify: s.verify,
                }
            })
            .collect();
        stats.sequences = chunks.len();
        stats.tokens = chunks.iter().map(|c| c.tokens.len()).sum();
        let batch = ForwardBatch::new(chunks);
        // The rows whose logits are read: a verify's every row, else the last row of a chunk
        // that reaches the end of what its sequence knows (a chunk inside a prompt has none).
        let reads: Vec<Range<usize>> = plan
            .iter()
            .enumerate()
            .map(|(c, p)| {
                let rows = batch.rows(c);
                let s = &self.sched.running[p.index];
                if batch.chunks()[c].verify {
                    rows
                } else if s.pending() == p.tokens {
                    rows.end - 1..rows.end
                } else {
                    rows.end..rows.end
                }
            })
            .collect();
        let (logits, pending) = match self.forward(&batch, &reads) {
            Ok(l) => l,
            Err(e) => {
                self.fail_running(&plan.iter().map(|p| p.index).collect::<Vec<_>>(), &e)?;
                return Err(e);
            }
        };
        let mut done = Vec::new();
        for (c, (p, rows)) in plan.iter().zip(logits).enumerate() {
            let s = &mut self.sched.running[p.index];
            if rows.is_empty() {
                s.computed += p.tokens;
                continue;
            }
            let fresh = if batch.chunks()[c].verify {
                let drafts = std::mem::take(&mut s.drafts);
                match accept_drafts(&mut s.sampler, &drafts, &rows, &s.prompt, &s.output) {
                    Ok(acc) => {
                        let pending = pending.as_ref().expect("a verify keeps checkpoints");
                        self.cache.commit(pending, c, acc.accepted + 1)?;
                        s.computed += acc.accepted + 1;
                        s.drafted += drafts.len();
                        s.accepted += acc.accepted;
                        let mut fresh = drafts[..acc.accepted].to_vec();
                        fresh.push(acc.next);
                        Ok(fresh)
                    }
                    Err(e) => Err(e.to_string()),
                }
            } else {
                s.computed += p.tokens;
                let row = &rows[0];
                s.sampler
                    .sample(row, &s.prompt, &s.output)
                    .map(|t| vec![t.token])
                    .map_err(|e| e.to_string())
            };
            let context = self.model.config().max_position_embeddings;
            match fresh.map(|fresh| emit(s, &fresh, &rows, context)) {
                Ok((n, reason)) => {
                    stats.generated += n;
                    if let Some(r) = reason {
                        done.push((p.index, Ok(r)));
                    }
                }
                Err(e) => done.push((p.index, Err(e))),
            }
        }
        done.sort_by_key(|(i, _)| std::cmp::Reverse(*i));
        stats.finished += done.len();
        for (index, outcome) in done {
            let mut s = self.sched.running.remove(index);
            s.release(&mut self.sched.slots, &mut self.sched.blocks)?;
            match outcome {
                Ok(reason) => finish(&s, reason),
                Err(error) => {
                    let _ = s.events.send(Event::Failed { error });
                }
            }
        }
        Ok(stats)
    }

    /// Steps until no request waits or runs.
    pub fn run_to_completion(&mut self) -> Result<()> {
        while self.pending() > 0 {
            self.step()?;
        }
        Ok(())
    }

    /// Proposes the drafts of every decoding sequence that speculates, within its `max_tokens`
    /// and the context.
    fn draft(&mut self) {
        let context = self.model.config().max_position_embeddings;
        for s in &mut self.sched.running {
            s.drafts.clear();
            s.verify = false;
            let Some(Speculation::Ngram { k, min_n, max_n }) = s.speculation else {
                continue;
            };
            if s.pending() != 1 {
                continue;
            }
            s.verify = true;
            let left = s.max_tokens.map_or(usize::MAX, |m| m - s.output.len());
            let room = context.saturating_sub(s.computed + 1);
            let k = k.min(left).min(room);
            if k > 0 {
                let all = s.tokens(0, s.len());
                s.drafts = NgramDrafter { min_n, max_n }.propose_tokens(&all, k);
            }
        }
    }

    /// The forward of `batch`, the f32 logits of the rows in `reads` (one list per entry) and
    /// the checkpoints of its verifies.
    fn forward(
        &mut self,
        batch: &ForwardBatch,
        reads: &[Range<usize>],
    ) -> Result<(Vec<Rows>, Option<BatchPending>)> {
        let out = self.model.forward_batch(batch, &mut self.cache)?;
        let rows: Vec<u32> = reads.iter().flat_map(|r| r.clone().map(|i| i as u32)).collect();
        let mut flat = if rows.is_empty() {
            Vec::new()
        } else {
            let rows = Tensor::new(rows.as_slice(), out.hidden.device())?;
            let logits = self.model.logits(&out.hidden.index_select(&rows, 0)?)?;
            logits.to_dtype(DType::F32)?.to_vec2::<f32>()?
        }
        .into_iter();
        let per_read = reads
            .iter()
            .map(|r| flat.by_ref().take(r.len()).collect())
            .collect();
        Ok((per_read, out.pending))
    }

    /// Ends the running sequences at `indices` with `Failed`, freeing what they hold.
    fn fail_running(&mut self, indices: &[usize], e: &Error) -> Result<()> {
        let mut indices = indices.to_vec();
        indices.sort_unstable_by(|a, b| b.cmp(a));
        for i in indices {
            let mut s = self.sched.running.remove(i);
            s.release(&mut self.sched.slots, &mut self.sched.blocks)?;
            let _ = s.events.send(Event::Failed { error: e.to_string() });
        }
        Ok(())
    }
}

/// Appends `fresh` tokens (row `j` of `rows` gave `fresh[j]`) to `s`'s output up to its first
/// stop: a stop id, `max_tokens`, or a full context; sends them. Returns how many were added and
/// the stop, if any.
fn emit(s: &mut Sequence, fresh: &[u32], rows: &[Vec<f32>], context: usize) -> (usize, Option<StopReason>) {
    let mut reason = None;
    let mut sent = Vec::new();
    for &t in fresh {
        s.output.push(t);
        sent.push(t);
        if s.stop_ids.contains(&t) {
            reason = Some(StopReason::StopToken(t));
        } else if s.max_tokens.is_some_and(|m| s.output.len() >= m) {
            reason = Some(StopReason::MaxTokens);
        } else if s.len() > context {
            reason = Some(StopReason::ContextFull);
        }
        if reason.is_some() {
            break;
        }
    }
    // The state holds every accepted token; those past a stop are never read again.
    let logprobs = s.logprobs.then(|| {
        sent.iter()
            .zip(rows)
            .map(|(&t, row)| s.sampler.logprobs(row, t))
            .collect()
    });
    let n = sent.len();
    if s.events.send(Event::Token { ids: sent, logprobs }).is_err() {
        reason = Some(StopReason::Cancelled);
    }
    (n, reason)
}

/// Sends a sequence's `Finished` event.
fn finish(s: &Sequence, reason: StopReason) {
    let usage = Usage {
        prompt_tokens: s.prompt.len(),
        completion_tokens: s.output.len(),
        preemptions: s.preemptions,
        drafted: s.drafted,
        accepted: s.accepted,
    };
    // A client that is gone has nothing to receive.
    let _ = s.events.send(Event::Finished { reason, usage });
}
