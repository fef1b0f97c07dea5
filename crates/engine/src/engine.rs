//! The engine: requests in, one batched forward per step, events out.

use std::hash::{Hash, Hasher};
use std::ops::Range;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Instant;

use candle_core::{DType, Tensor};
use qwen36_model::{
    BatchPending, BatchStepper, DeviceClock, DraftVocab, ForwardBatch, MtpHead, PagedCache, Qwen36Model,
    SeqChunk,
};
use qwen36_mtp::NgramDrafter;
use qwen36_sampling::{
    accept_greedy, Acceptance, Detokenize, RepetitionDetector, Sampled, Sampler, TextStream,
};
use rayon::prelude::*;

use crate::scheduler::{note_mtp, reserve_evicting, Scheduler, Sequence};
use crate::spec::{choose_k, SpecCosts};
use crate::{
    BlockPool, Error, Event, PrefixCache, PrefixStats, Request, RequestHandle, Result, SlotId, SlotPool,
    SpecStats, Speculation, StopReason, Usage,
};

/// Positions per slot of a pool sized by default (16384: 1 GiB of K/V per sequence at the
/// Qwen3.6-27B shapes in bf16, where the whole 262144-position context would take 16 GiB).
pub const DEFAULT_POSITIONS: usize = 16384;

/// Logits rows (f32, one per token) of one sequence's chunk.
type Rows = Vec<Vec<f32>>;

/// Sizes and limits of an engine.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineConfig {
    /// Sequences running at once (GDN state slots).
    pub max_seqs: usize,
    /// KV blocks in the pool; `None`: enough for every slot to hold the model's context or
    /// [`DEFAULT_POSITIONS`], whichever is shorter (size a pool for long contexts from a memory
    /// budget with [`crate::PoolSizes`]; a request that can never fit is refused at submit).
    pub kv_blocks: Option<usize>,
    /// Positions per KV block.
    pub block_size: usize,
    /// Requests that may wait beyond the free slots (those the next step admits); a submit
    /// beyond them is refused. 0: only as many as there are free slots.
    pub max_queue: usize,
    /// The most tokens one forward runs (prefill chunks and decode tokens together).
    pub step_tokens: usize,
    /// Benchmarks only: a verify accepts draft `j` in a share `rates[j]` of its verifies
    /// instead of checking it, so that speculative decoding can be timed with random weights at
    /// a real model's acceptance; the tokens are then meaningless. The rates are per position as
    /// vLLM reports them (draft `j` accepted with every draft before it), so the accepted length
    /// is `1 + Σ rates`, and they do not increase; later positions keep the last ratio.
    pub timing_accept_rates: Option<Vec<f64>>,
    /// Choose each round's number of drafts (up to what a request asks, 0 included) from the
    /// measured acceptance and costs ([`crate::spec::choose_k`]); `false` always drafts the
    /// requested `k`.
    pub adaptive_k: bool,
    /// Replay decode and verify steps from recorded CUDA graphs where the model's device can
    /// record them (a device from `qwen36_model::cuda_device`); `false` runs every step eagerly.
    pub cuda_graphs: bool,
    /// The longest sequence (prompt and output) taken, below the model's context; `None`: the
    /// model's `max_position_embeddings`.
    pub max_model_len: Option<usize>,
    /// MTP draft steps choose among the first this many ids only (a draft vocabulary: the
    /// drafts' lm_head reads shrink; the tokens stay the verified ones). `None`: all ids.
    pub draft_vocab: Option<usize>,
    /// State slots beyond `max_seqs` for the prefix cache's GDN snapshots (each the size of a
    /// sequence's state); 0 turns the prefix cache off.
    pub prefix_snapshots: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            max_seqs: 8,
            kv_blocks: None,
            block_size: 16,
            max_queue: 256,
            step_tokens: 512,
            timing_accept_rates: None,
            adaptive_k: true,
            cuda_graphs: true,
            prefix_snapshots: 8,
            draft_vocab: None,
            max_model_len: None,
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
    /// Time in the forward (and the logits rows' copy to the host).
    pub forward: std::time::Duration,
    /// Time sampling and accepting.
    pub sampling: std::time::Duration,
    /// Time in the MTP head's draft steps.
    pub drafting: std::time::Duration,
    /// Time committing verified sequences' states (bookkeeping: the next forward applies the
    /// accepted tokens, [`qwen36_model::PagedCache::commit`]).
    pub committing: std::time::Duration,
    /// Whether the forward replayed a recorded CUDA graph.
    pub graphed: bool,
    /// MTP draft steps run, and those of them that replayed a recorded CUDA graph.
    pub draft_steps: usize,
    pub draft_steps_graphed: usize,
    /// The whole step on the host, from its start to its return (its device work included:
    /// a step ends by reading its tokens back).
    pub wall: std::time::Duration,
}

/// How busy an engine is ([`Engine::load`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EngineLoad {
    /// Requests waiting for a slot.
    pub waiting: usize,
    /// Sequences running (holding a slot).
    pub running: usize,
    /// GDN state slots that requests hold (their own, and a finishing turn's snapshot), of
    /// `slots` (`max_seqs` and the prefix cache's `prefix_snapshots`).
    pub slots_used: usize,
    pub slots: usize,
    /// KV blocks in use, of `blocks`.
    pub blocks_used: usize,
    pub blocks: usize,
    /// Slots (snapshots) and blocks that only the prefix cache holds: free for the taking.
    pub cached_slots: usize,
    pub cached_blocks: usize,
    /// The prefix cache's counters, when it is on.
    pub prefix: Option<PrefixStats>,
    /// Bytes of one GDN state slot (a snapshot's size).
    pub slot_bytes: u64,
}

/// Many sequences at once over pooled GDN state and paged KV: [`Self::submit`] requests, call
/// [`Self::step`] (each runs one forward of every scheduled sequence), read each request's events
/// from its [`RequestHandle`].
#[derive(Debug)]
pub struct Engine {
    model: Qwen36Model,
    cache: PagedCache,
    /// Runs the forwards over `cache` (its graphs are bound to the pools).
    runner: BatchStepper,
    /// The MTP head and its KV pool (same block tables as the target's), when loaded.
    mtp: Option<(MtpHead, PagedCache, BatchStepper)>,
    sched: Scheduler,
    cfg: EngineConfig,
    next_id: u64,
    /// Measured (or given) costs of decode and verify steps and of MTP draft steps.
    pub(crate) costs: SpecCosts,
    /// A tensor-parallel rank stepping in lockstep with the others ([`Engine::spawn_ranks`]):
    /// what could differ between ranks comes from the first rank before each step (cancels,
    /// the costs its decisions use: `costs`, while this step's timings go to `measured`), and a
    /// closed event channel cancels nothing by itself.
    pub(crate) lockstep: bool,
    pub(crate) measured: SpecCosts,
    /// Acceptance over every request, per drafter: the prior of each request's own rates.
    accept_mtp: SpecStats,
    accept_ngram: SpecStats,
    /// Turns output tokens into the events' text, when set.
    detokenizer: Option<Detokenizer>,
    /// Tests only: the next step panics (the engine thread's panic handling).
    #[cfg(test)]
    pub(crate) panic_next_step: bool,
    /// Tests only: the next submit panics.
    #[cfg(test)]
    pub(crate) panic_next_submit: bool,
    /// Tests only: the next state copy fails (as a device error would).
    #[cfg(test)]
    pub(crate) fail_next_copy: bool,
}

/// The engine's detokenizer ([`Engine::with_detokenizer`]).
#[derive(Clone)]
struct Detokenizer(Arc<dyn Detokenize>);

impl std::fmt::Debug for Detokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Detokenizer")
    }
}

impl Engine {
    /// An engine over `model` with pools sized by `cfg`.
    pub fn new(model: Qwen36Model, cfg: EngineConfig) -> Result<Self> {
        Self::build(model, None, cfg)
    }

    /// An engine over `model` whose requests may draft with its MTP `head`
    /// ([`Speculation::Mtp`]).
    pub fn with_mtp_head(model: Qwen36Model, head: MtpHead, cfg: EngineConfig) -> Result<Self> {
        Self::build(model, Some(head), cfg)
    }

    fn build(model: Qwen36Model, head: Option<MtpHead>, cfg: EngineConfig) -> Result<Self> {
        let context = context_of(&model, &cfg);
        if cfg.step_tokens == 0 || cfg.max_seqs == 0 {
            return Err(Error::Size {
                pool: "engine",
                msg: format!(
                    "needs max_seqs and step_tokens above 0, found {} and {}",
                    cfg.max_seqs, cfg.step_tokens
                ),
            });
        }
        if let Some(rates) = &cfg.timing_accept_rates {
            if rates.is_empty() || !rates.iter().all(|r| (0.0..=1.0).contains(r)) {
                return Err(Error::Request(format!(
                    "timing acceptance rates must be probabilities in [0, 1], found {rates:?}"
                )));
            }
            if rates.windows(2).any(|w| w[1] > w[0]) {
                return Err(Error::Request(format!(
                    "timing acceptance rates are per position (a draft is accepted only with every draft before it), so they cannot increase, found {rates:?}"
                )));
            }
        }
        let blocks = cfg
            .kv_blocks
            .unwrap_or_else(|| cfg.max_seqs * context.min(DEFAULT_POSITIONS).div_ceil(cfg.block_size.max(1)));
        // Running sequences' slots, then the prefix cache's snapshots.
        let slots = cfg
            .max_seqs
            .checked_add(cfg.prefix_snapshots)
            .ok_or_else(|| Error::Size {
                pool: "engine",
                msg: format!(
                    "max_seqs {} + prefix_snapshots {} slots",
                    cfg.max_seqs, cfg.prefix_snapshots
                ),
            })?;
        let sched = Scheduler {
            waiting: Default::default(),
            running: Vec::new(),
            slots: SlotPool::new(slots)?,
            blocks: BlockPool::new(blocks, cfg.block_size)?,
            step_tokens: cfg.step_tokens,
            max_running: cfg.max_seqs,
            prefix: (cfg.prefix_snapshots > 0).then(|| PrefixCache::new(cfg.block_size)),
            restores: Vec::new(),
            ended: Vec::new(),
        };
        let cache = model.new_paged_cache(slots, blocks, cfg.block_size)?;
        // Graphs' block tables cover a sequence of up to DEFAULT_POSITIONS (256 KiB of tables
        // per step at 64 sequences in blocks of 16), so those never make them re-record.
        let table_blocks = context
            .min(DEFAULT_POSITIONS)
            .min(blocks * cfg.block_size)
            .div_ceil(cfg.block_size);
        let mtp = match head {
            Some(h) => {
                let pool = h.new_paged_cache(&model, slots, blocks, cfg.block_size)?;
                let mut stepper = BatchStepper::new(&model, cfg.cuda_graphs, table_blocks);
                if let Some(n) = cfg.draft_vocab {
                    stepper = stepper.with_draft_vocab(DraftVocab::first(&model, n, &[])?);
                }
                Some((h, pool, stepper))
            }
            None => None,
        };
        Ok(Self {
            runner: BatchStepper::new(&model, cfg.cuda_graphs, table_blocks),
            model,
            cache,
            mtp,
            sched,
            cfg,
            next_id: 0,
            costs: SpecCosts::default(),
            lockstep: false,
            measured: SpecCosts::default(),
            accept_mtp: SpecStats::default(),
            accept_ngram: SpecStats::default(),
            detokenizer: None,
            #[cfg(test)]
            panic_next_step: false,
            #[cfg(test)]
            panic_next_submit: false,
            #[cfg(test)]
            fail_next_copy: false,
        })
    }

    /// The engine with a detokenizer: every request's `Token` events then carry their text, and
    /// requests may stop at strings ([`Request::stop_strings`]).
    pub fn with_detokenizer(mut self, detokenizer: Arc<dyn Detokenize>) -> Self {
        self.detokenizer = Some(Detokenizer(detokenizer));
        self
    }

    /// Replaces the measured speculation costs (e.g. with [`SpecCosts::fixed`] ones).
    pub fn set_spec_costs(&mut self, costs: SpecCosts) {
        self.measured = costs.clone();
        self.costs = costs;
    }

    /// Where this step's timings go: the costs in use, or (a lockstep rank) the measured ones.
    fn costs_to_record(&mut self) -> &mut SpecCosts {
        match self.lockstep {
            true => &mut self.measured,
            false => &mut self.costs,
        }
    }

    /// Whether request `id` is waiting or running.
    pub(crate) fn has_request(&self, id: u64) -> bool {
        self.sched
            .waiting
            .iter()
            .chain(&self.sched.running)
            .any(|s| s.id == id)
    }

    /// A lockstep rank's check that every rank planned the same step (which sequences run how
    /// many tokens from where, with which drafts; see [`agree`]).
    fn agree_on(&self, plan: &[crate::scheduler::Scheduled]) -> Result<()> {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        (self.sched.waiting.len(), self.sched.running.len()).hash(&mut h);
        for p in plan {
            let s = &self.sched.running[p.index];
            (s.id, p.tokens, s.computed, s.verify, &s.drafts).hash(&mut h);
        }
        agree(&self.model, "step plan", h.finish())
    }

    /// Cancels request `id` as its handle would; false when it is not waiting or running.
    pub fn cancel(&mut self, id: u64) -> bool {
        let sched = &self.sched;
        match sched.waiting.iter().chain(&sched.running).find(|s| s.id == id) {
            Some(s) => {
                s.cancel.store(true, std::sync::atomic::Ordering::Relaxed);
                true
            }
            None => false,
        }
    }

    /// The model.
    pub fn model(&self) -> &Qwen36Model {
        &self.model
    }

    /// Whether its decode and verify steps replay CUDA graphs.
    pub fn uses_graphs(&self) -> bool {
        self.runner.uses_graphs()
    }

    /// The sizes it runs with.
    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// The longest sequence (prompt and output) it takes: the model's context, or
    /// [`EngineConfig::max_model_len`] when shorter.
    pub fn context(&self) -> usize {
        context_of(&self.model, &self.cfg)
    }

    /// The most requests it takes at once when it has none: a slot each and the queue
    /// ([`EngineConfig::max_seqs`] + [`EngineConfig::max_queue`]); a submit past that is refused
    /// as [`Error::QueueFull`] until some end.
    pub fn capacity(&self) -> usize {
        self.cfg.max_seqs.saturating_add(self.cfg.max_queue)
    }

    /// Queues a request. Refused with a typed error when it is malformed or can never fit
    /// (prompt and `max_tokens` over the model's context or the whole KV pool), or when the
    /// queue is full.
    pub fn submit(&mut self, req: Request) -> Result<RequestHandle> {
        let (id, rx, cancel) = self.submit_parts(req)?;
        Ok(RequestHandle::new(id, rx, cancel))
    }

    /// [`Self::submit`]'s checks and queueing: the request's id, events and cancel flag.
    pub(crate) fn submit_parts(
        &mut self,
        req: Request,
    ) -> Result<(u64, flume::Receiver<Event>, Arc<AtomicBool>)> {
        #[cfg(test)]
        if std::mem::take(&mut self.panic_next_submit) {
            panic!("a panic injected by a test");
        }
        let context = self.context();
        check_request(&req, self.model.config().vocab_size)?;
        // The last generated token is never run, so a sequence holds prompt + max_tokens − 1
        // (its whole prompt when it generates nothing); without max_tokens, at least
        // min_tokens.
        let least = req.max_tokens.unwrap_or(1).max(req.sampling.min_tokens);
        let positions = req.prompt.len().saturating_add(least.max(1)) - 1;
        let pool = self.sched.blocks.capacity() * self.sched.blocks.block_size();
        if positions > context.min(pool) {
            return Err(Error::TooLong {
                needed: req.prompt.len().saturating_add(least),
                context,
                pool,
            });
        }
        if matches!(req.speculation, Some(Speculation::Mtp { .. })) && self.mtp.is_none() {
            return Err(Error::Request(
                "MTP speculation asked for, but the engine has no MTP head (Engine::with_mtp_head)".into(),
            ));
        }
        let masked = req.constraint.is_some()
            || req.sampling.min_tokens > 0
            || !req.sampling.allowed_ids.is_empty()
            || !req.sampling.bad_words.is_empty();
        if masked && self.cfg.timing_accept_rates.is_some() {
            return Err(Error::Request(
                "output constraints, min_tokens, allowed ids and bad words need real acceptance (this engine times drafts: timing_accept_rates)"
                    .into(),
            ));
        }
        if !req.stop_strings.is_empty() && self.detokenizer.is_none() {
            return Err(Error::Request(
                "stop strings need a detokenizer (Engine::with_detokenizer)".into(),
            ));
        }
        // (Requests the next step admits into free slots wait only until then.)
        let free = self.cfg.max_seqs.saturating_sub(self.sched.running.len());
        if self.sched.waiting.len() >= self.cfg.max_queue.saturating_add(free) {
            return Err(Error::QueueFull(self.cfg.max_queue));
        }
        let min_tokens = req.sampling.min_tokens;
        let sampler = Sampler::new(req.sampling)
            .map_err(|e| Error::Request(e.to_string()))?
            .with_end_ids(&req.stop_ids);
        let constraint = match &req.constraint {
            Some(spec) => Some(
                spec.0
                    .start()
                    .map_err(|e| Error::Request(format!("output constraint: {e}")))?,
            ),
            None => None,
        };
        let (tx, rx) = flume::unbounded();
        let cancel = Arc::new(AtomicBool::new(false));
        let id = self.next_id;
        self.next_id += 1;
        self.sched.wait(Sequence {
            id,
            priority: req.priority,
            prompt: req.prompt,
            output: Vec::new(),
            sampler,
            max_tokens: req.max_tokens,
            stop_ids: req.stop_ids,
            text: self.detokenizer.as_ref().map(|_| {
                TextStream::new(&req.stop_strings)
                    .min_tokens(min_tokens)
                    .keep_stop_strings(req.keep_stop_strings)
                    .keep_special_tokens(req.keep_special_tokens)
            }),
            logprobs: req.logprobs,
            prompt_logprobs: req.prompt_logprobs,
            prompt_lps: req.prompt_logprobs.map(|_| Vec::new()),
            constraint,
            events: tx,
            cancel: cancel.clone(),
            slot: None,
            table: Default::default(),
            computed: 0,
            preemptions: 0,
            speculation: req.speculation,
            verify: false,
            drafts: Vec::new(),
            mtp_len: 0,
            unfed: None,
            spec: SpecStats::default(),
            degeneration: req.degeneration.map(RepetitionDetector::new),
            stop_on_degeneration: req.stop_on_degeneration,
            cached: 0,
            snap_points: Vec::new(),
            rolling: None,
            kept: 0,
        });
        Ok((id, rx, cancel))
    }

    /// Requests waiting or running.
    pub fn pending(&self) -> usize {
        self.sched.waiting.len() + self.sched.running.len()
    }

    /// Requests waiting for a slot.
    pub fn waiting(&self) -> usize {
        self.sched.waiting.len()
    }

    /// Slots and KV blocks in use by requests (not counting what only the prefix cache holds).
    pub fn pool_use(&self) -> (usize, usize) {
        self.pool_use_given(self.cached())
    }

    fn pool_use_given(&self, (cached_blocks, cached_slots): (usize, usize)) -> (usize, usize) {
        let (s, b) = (&self.sched.slots, &self.sched.blocks);
        (
            s.capacity() - s.free() - cached_slots,
            b.capacity() - b.free() - cached_blocks,
        )
    }

    /// Blocks and slots only the prefix cache holds.
    fn cached(&self) -> (usize, usize) {
        let (s, b) = (&self.sched.slots, &self.sched.blocks);
        self.sched.prefix.as_ref().map_or((0, 0), |p| p.exclusive(b, s))
    }

    /// The prefix cache's counters, when it is on.
    pub fn prefix_stats(&self) -> Option<PrefixStats> {
        self.sched.prefix.as_ref().map(PrefixCache::stats)
    }

    /// Frees every cached prefix no request uses.
    pub fn clear_prefix_cache(&mut self) -> Result<()> {
        let sched = &mut self.sched;
        match sched.prefix.as_mut() {
            Some(p) => p.clear(&mut sched.blocks, &mut sched.slots),
            None => Ok(()),
        }
    }

    /// Queue, running sequences and pool use now (what a server's metrics show).
    pub fn load(&self) -> EngineLoad {
        let (cached_blocks, cached_slots) = self.cached();
        let (slots_used, blocks_used) = self.pool_use_given((cached_blocks, cached_slots));
        EngineLoad {
            cached_slots,
            cached_blocks,
            prefix: self.prefix_stats(),
            slot_bytes: self.cache.slot_bytes(),
            waiting: self.sched.waiting.len(),
            running: self.sched.running.len(),
            slots_used,
            slots: self.sched.slots.capacity(),
            blocks_used,
            blocks: self.sched.blocks.capacity(),
        }
    }

    /// Runs one forward of every scheduled sequence, samples their next tokens (or verifies
    /// their drafts) and sends the events. A failing forward fails the requests in it (each gets
    /// [`Event::Failed`]) and returns the error.
    pub fn step(&mut self) -> Result<StepStats> {
        let start = std::time::Instant::now();
        let mut stats = self.step_parts()?;
        stats.wall = start.elapsed();
        Ok(stats)
    }

    /// [`Self::step`] but for its wall time.
    fn step_parts(&mut self) -> Result<StepStats> {
        #[cfg(test)]
        if std::mem::take(&mut self.panic_next_step) {
            panic!("a panic injected by a test");
        }
        self.draft();
        let planned = self.sched.schedule();
        let ended = std::mem::take(&mut self.sched.ended);
        let mut stats = StepStats {
            finished: ended.len(),
            ..Default::default()
        };
        // (Before the ranks agree, and whether planning failed or not: the sequences that
        // ended are out of the queues, so an error from here on would leave them without their
        // last event.)
        for (mut s, reason) in ended {
            self.finish(&mut s, reason);
        }
        let plan = planned?;
        if self.lockstep {
            self.agree_on(&plan)?;
        }
        // Every snapshot is released, whether its copy (or an earlier one) failed or not.
        let mut restored = Ok(());
        for (snapshot, slot) in std::mem::take(&mut self.sched.restores) {
            if restored.is_ok() {
                restored = self.copy_slot(snapshot, slot);
            }
            let released = self.sched.slots.release(snapshot).map(|_| ());
            restored = restored.and(released);
        }
        restored?;
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
                } else if s.pending() == p.tokens && s.max_tokens != Some(0) {
                    rows.end - 1..rows.end
                } else {
                    rows.end..rows.end
                }
            })
            .collect();
        let started = Instant::now();
        let full: Vec<bool> = plan
            .iter()
            .map(|p| self.sched.running[p.index].needs_logits())
            .collect();
        let replays = self.runner.graph_counts().1;
        let (logits, pending, hidden) = match self.forward(&batch, &reads, &full) {
            Ok(l) => l,
            Err(e) => return self.fail_step(&plan, e),
        };
        // Prompt log-probabilities: per chunk, the rows of its prompt positions not read before.
        let mut prompt_lps = Vec::with_capacity(plan.len());
        for (c, p) in plan.iter().enumerate() {
            let s = &self.sched.running[p.index];
            let start = batch.chunks()[c].start;
            // (The positions of this chunk whose rows are still to read.)
            let positions = s
                .prompt_rows_left()
                .map(|left| left.start.max(start)..left.end.min(start + p.tokens))
                .filter(|positions| !positions.is_empty());
            let lps = match positions {
                Some(positions) => {
                    let targets = &s.prompt[positions.start + 1..positions.end + 1];
                    let first = batch.rows(c).start + positions.start - start;
                    let top = s.prompt_logprobs.unwrap_or(0);
                    match self.prompt_logprobs(&hidden, first, targets, top) {
                        Ok(lps) => lps,
                        Err(e) => return self.fail_step(&plan, e),
                    }
                }
                None => Vec::new(),
            };
            prompt_lps.push(lps);
        }
        stats.forward = started.elapsed();
        stats.graphed = self.runner.graph_counts().1 > replays;
        // Each sequence's sample or acceptance, in parallel (each touches only its own sampler).
        let sampling = Instant::now();
        let rates = self.cfg.timing_accept_rates.as_deref();
        let decisions: Vec<Decision> = {
            let mut mine: Vec<Option<&mut Sequence>> = self.sched.running.iter_mut().map(Some).collect();
            let work: Vec<(&mut Sequence, Read, bool)> = plan
                .iter()
                .zip(logits)
                .enumerate()
                .map(|(c, (p, read))| {
                    (
                        mine[p.index].take().expect("distinct"),
                        read,
                        batch.chunks()[c].verify,
                    )
                })
                .collect();
            work.into_par_iter()
                .map(|(s, read, verify)| decide(s, read, verify, rates))
                .collect()
        };
        stats.sampling = sampling.elapsed();
        let mut done = Vec::new();
        let mut feeds = Vec::new();
        let mut commits = Vec::new();
        // Per chunk: the position it started at, when it generated tokens (its sequence decodes).
        let mut decoded = vec![None; plan.len()];
        let context = self.context();
        for (c, ((p, decision), lps)) in plan.iter().zip(decisions).zip(prompt_lps).enumerate() {
            let s = &mut self.sched.running[p.index];
            let mtp = matches!(s.speculation, Some(Speculation::Mtp { .. }));
            let start = batch.chunks()[c].start;
            if let Some(read) = s.prompt_lps.as_mut() {
                read.extend(lps);
                // All read: they go out before any token (a client gone is noticed by `emit`).
                if read.len() + 1 == s.prompt.len() {
                    let logprobs = s.prompt_lps.take().unwrap_or_default();
                    let _ = s.events.send(Event::Prompt { logprobs });
                }
            }
            let (fresh, rows) = match decision {
                Decision::Prefilled => {
                    s.computed += p.tokens;
                    // A request for the prompt alone ends once it has run.
                    if s.max_tokens == Some(0) && s.computed == s.len() {
                        done.push((p.index, Ok(StopReason::MaxTokens)));
                        continue;
                    }
                    if mtp {
                        feeds.push((p.index, start, batch.rows(c), false));
                    }
                    continue;
                }
                Decision::Failed(e) => {
                    done.push((p.index, Err(e)));
                    continue;
                }
                Decision::Sampled(token, rows) => {
                    s.computed += p.tokens;
                    decoded[c] = Some(start);
                    // A speculating sequence's decode step without drafts: a pass of length 1.
                    if let (Some(sp), true) = (s.speculation, p.tokens == 1 && start >= s.prompt.len()) {
                        s.spec.record(0, 0, sp.k());
                    }
                    (vec![token], rows)
                }
                Decision::Verified(acc, drafts, rows) => {
                    commits.push((c, acc.accepted + 1));
                    decoded[c] = Some(start);
                    s.computed += acc.accepted + 1;
                    let k = s.speculation.map_or(0, |sp| sp.k());
                    s.spec.record(drafts.len(), acc.accepted, k);
                    match s.speculation {
                        Some(Speculation::Mtp { .. }) => &mut self.accept_mtp,
                        _ => &mut self.accept_ngram,
                    }
                    .record(drafts.len(), acc.accepted, k);
                    let mut fresh = drafts[..acc.accepted].to_vec();
                    fresh.push(acc.next);
                    (fresh, rows)
                }
            };
            let (n, reason) = match emit(
                s,
                &fresh,
                &rows,
                context,
                self.detokenizer.as_ref(),
                self.lockstep,
            ) {
                Ok(emitted) => emitted,
                Err(error) => {
                    done.push((p.index, Err(error)));
                    continue;
                }
            };
            stats.generated += n;
            if let Some(c) = s.constraint.as_deref_mut() {
                if let Err(e) = c.consume(&fresh[..n]) {
                    done.push((p.index, Err(format!("output constraint: {e}"))));
                    continue;
                }
            }
            let first_row = batch.rows(c).start;
            match reason {
                // The pairs of the positions this forward committed.
                None if mtp => {
                    feeds.push((p.index, start, first_row..first_row + (s.computed - start), false))
                }
                None => {}
                Some(r) => {
                    // A finished sequence's pairs are fed only to complete blocks the prefix
                    // cache may keep (the next turn's MTP hits need their MTP K/V), up to the
                    // last token it ran.
                    let ran = s.computed.min(s.len() - 1);
                    let bs = self.sched.blocks.block_size();
                    if mtp && self.sched.prefix.is_some() && ran / bs > s.mtp_len / bs {
                        feeds.push((p.index, start, first_row..first_row + (ran - start), true));
                    }
                    done.push((p.index, Ok(r)));
                }
            }
        }
        if !commits.is_empty() {
            let committing = Instant::now();
            let pending = pending.as_ref().expect("a verify leaves its commits pending");
            if let Err(e) = self.cache.commit_many(pending, &commits) {
                // The states are not the accepted ones: no sequence of the step can go on.
                return self.fail_step(&plan, Error::from(e));
            }
            stats.committing = committing.elapsed();
        }
        if self.sched.prefix.is_some() {
            let failed: Vec<usize> = done.iter().filter(|(_, o)| o.is_err()).map(|(i, _)| *i).collect();
            self.keep_states(&plan, &batch, &decoded, &failed, pending.as_ref())?;
        }
        // A step of decode tokens and verifies only: what a cycle of its length costs.
        let decode_only = plan
            .iter()
            .zip(batch.chunks())
            .all(|(p, c)| c.verify || p.tokens == 1);
        if decode_only {
            let t = batch.chunks().iter().map(|c| c.tokens.len()).max().unwrap_or(1);
            self.costs_to_record()
                .record_step(plan.len(), t, started.elapsed().as_secs_f64());
        }
        // The sequences that ended with no pairs to feed free their slots and blocks before the
        // drafts reserve theirs (the MTP K/V of those drafting may need the blocks).
        let (unfed, mut done): (Vec<_>, Vec<_>) = done
            .into_iter()
            .partition(|(i, _)| !feeds.iter().any(|f| f.0 == *i));
        let below = |i: usize| unfed.iter().filter(|(u, _)| *u < i).count();
        for f in &mut feeds {
            f.0 -= below(f.0);
        }
        for d in &mut done {
            d.0 -= below(d.0);
        }
        stats.finished += unfed.len();
        let freed = self.end_sequences(unfed);
        let drafting = Instant::now();
        let drafted = self.mtp_draft(&feeds, &hidden, &mut stats);
        stats.drafting = drafting.elapsed();
        if let Err(e) = drafted {
            // A lockstep rank cannot go on alone: the others may wait in a reduction it skipped.
            if self.lockstep {
                return Err(e);
            }
            let mut failed: Vec<usize> = feeds.iter().map(|f| f.0).collect();
            failed.retain(|i| !done.iter().any(|(d, _)| d == i));
            for i in failed {
                done.push((i, Err(format!("MTP drafting failed: {e}"))));
            }
        }
        stats.finished += done.len();
        let freed = freed.and(self.end_sequences(done));
        freed.map(|()| stats)
    }

    /// Ends the running sequences `done` names (running index, its stop reason or error) and
    /// frees them: each is removed, its blocks kept by the prefix cache where it finished, its
    /// slot and blocks released, its last events sent. Every one of them ends; the first
    /// bookkeeping error is returned.
    fn end_sequences(
        &mut self,
        mut done: Vec<(usize, std::result::Result<StopReason, String>)>,
    ) -> Result<()> {
        done.sort_by_key(|(i, _)| std::cmp::Reverse(*i));
        let mut freed = Ok(());
        for (index, outcome) in done {
            let mut s = self.sched.running.remove(index);
            let kept = match outcome {
                Ok(_) => self.sched.keep_leaving(&mut s),
                Err(_) => Ok(()),
            };
            let released = s.release(&mut self.sched.slots, &mut self.sched.blocks);
            match outcome {
                Ok(reason) => self.finish(&mut s, reason),
                Err(error) => {
                    let _ = s.events.send(Event::Failed { error });
                }
            }
            freed = freed.and(kept).and(released);
        }
        freed
    }

    /// The prefix cache's share of a step: each planned sequence whose chunk ended at a snapshot
    /// point keeps its state there in the cache (with its blocks); each decoding sequence that
    /// passed a block boundary it keeps ([`ROLLING_BLOCKS`]) copies the state there to its rolling
    /// slot (a copy of the slot with the accepted tokens up to the boundary still to replay, when
    /// the boundary was inside a verified run), for
    /// `Scheduler::keep_leaving`.
    fn keep_states(
        &mut self,
        plan: &[crate::scheduler::Scheduled],
        batch: &ForwardBatch,
        decoded: &[Option<usize>],
        failed: &[usize],
        pending: Option<&BatchPending>,
    ) -> Result<()> {
        let bs = self.sched.blocks.block_size();
        let mut inside_verifies = Vec::new();
        for (c, p) in plan.iter().enumerate() {
            if failed.contains(&p.index) {
                continue;
            }
            let s = &self.sched.running[p.index];
            let (computed, slot) = (s.computed, s.slot.expect("a running sequence has a slot"));
            if s.snap_points.first() == Some(&computed) {
                let tokens = s.tokens(0, computed);
                let prefix = self.sched.prefix.as_ref().expect("the prefix cache is on");
                let wanted = !prefix.has_snapshot(&tokens);
                let s = &mut self.sched.running[p.index];
                s.snap_points.remove(0);
                // (An identical prompt's snapshot is kept already: no slot, no copy.)
                if !wanted {
                    s.kept = computed;
                    continue;
                }
                let Some(snapshot) = self.spare_slot(false)? else {
                    continue;
                };
                if let Err(e) = self.copy_slot(slot, snapshot) {
                    let _ = self.sched.slots.release(snapshot);
                    return Err(e);
                }
                let sched = &mut self.sched;
                let s = &mut sched.running[p.index];
                let prefix = sched.prefix.as_mut().expect("the prefix cache is on");
                let mtp_fed = if s.drafts_with_mtp() { s.mtp_len } else { 0 };
                prefix.insert(&tokens, computed, &s.table, &mut sched.blocks, mtp_fed)?;
                if prefix.insert_snapshot(&tokens, computed, snapshot, &mut sched.slots)? {
                    s.kept = computed;
                }
                continue;
            }
            let Some(start) = decoded[c] else { continue };
            // (A stop inside a verified run leaves accepted positions past the output's end.)
            let boundary = computed.min(s.len()) / bs * bs;
            let verified = batch.chunks()[c].verify;
            if boundary <= start || (!verified && boundary != computed) {
                continue;
            }
            // Not every boundary: every ROLLING_BLOCKS-th, and the last one before `max_tokens`
            // ends the request (one state copy per sequence every 128 tokens at blocks of 16).
            let last = s.max_tokens.map(|m| (s.prompt.len() + m - 1) / bs * bs);
            if boundary % (ROLLING_BLOCKS * bs) != 0 && Some(boundary) != last {
                continue;
            }
            let rolling = match self.sched.running[p.index].rolling {
                Some((r, _)) => r,
                None => match self.spare_slot(true)? {
                    Some(r) => r,
                    None => continue,
                },
            };
            self.sched.running[p.index].rolling = Some((rolling, boundary));
            match verified {
                true => inside_verifies.push((c, boundary - start, rolling.0)),
                false => self.copy_slot(slot, rolling)?,
            }
        }
        if let (Some(pending), false) = (pending, inside_verifies.is_empty()) {
            self.cache.commit_into(pending, &inside_verifies)?;
        }
        Ok(())
    }

    /// A free slot for a snapshot (evicting the least recently used cached one when none is
    /// free); none when the prefix cache is off, when the slots left are the running sequences'
    /// share, or for a rolling snapshot when rolling ones hold half of `prefix_snapshots`.
    fn spare_slot(&mut self, rolling: bool) -> Result<Option<SlotId>> {
        let sched = &mut self.sched;
        if sched.prefix.is_none() {
            return Ok(None);
        }
        // Rolling snapshots take at most half the snapshot slots (they may evict cached ones).
        let rollings = sched.running.iter().filter(|s| s.rolling.is_some()).count();
        if rolling && rollings >= self.cfg.prefix_snapshots.div_ceil(2) {
            return Ok(None);
        }
        // Slots running sequences may still take: one per sequence that can be admitted.
        let reserve = sched.max_running - sched.running.len();
        if sched.slots.free() <= reserve {
            sched.evict(0, reserve + 1)?;
        }
        if sched.slots.free() <= reserve {
            return Ok(None);
        }
        Ok(Some(sched.slots.alloc()?))
    }

    /// Copies slot `from`'s state (and what it has left to replay) into slot `to`.
    fn copy_slot(&mut self, from: SlotId, to: SlotId) -> Result<()> {
        #[cfg(test)]
        if std::mem::take(&mut self.fail_next_copy) {
            return Err(Error::Request("a state copy failure injected by a test".into()));
        }
        Ok(self.cache.copy_slot(from.0, to.0)?)
    }

    /// Sends a sequence's last events: the text its stream still holds, then `Finished`.
    fn finish(&self, s: &mut Sequence, reason: StopReason) {
        let tail = s.text.as_mut().map(TextStream::finish).unwrap_or_default();
        // A client that is gone has nothing to receive.
        if !tail.is_empty() {
            let _ = s.events.send(Event::Token {
                ids: Vec::new(),
                text: tail,
                logprobs: None,
            });
        }
        let usage = Usage {
            prompt_tokens: s.prompt.len(),
            completion_tokens: s.output.len(),
            // (A preempted request's hit may reach into its own output.)
            cached_tokens: s.cached.min(s.prompt.len()),
            preemptions: s.preemptions,
            speculation: s.spec.clone(),
            degeneration: s.degeneration.as_ref().and_then(RepetitionDetector::first),
        };
        let _ = s.events.send(Event::Finished { reason, usage });
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
        let context = self.context();
        let batch = self.sched.running.len();
        let ngram =
            |s: &Sequence| matches!(s.speculation, Some(Speculation::Ngram { .. })) && s.pending() == 1;
        let k_max = self
            .sched
            .running
            .iter()
            .filter(|s| ngram(s))
            .map(|s| s.speculation.map_or(0, |sp| sp.k()))
            .max()
            .unwrap_or(0);
        let alphas: Vec<Vec<f64>> = self
            .sched
            .running
            .iter()
            .filter(|s| ngram(s))
            .map(|s| rates(&s.spec, &self.accept_ngram, k_max))
            .collect();
        let k_round = match self.cfg.adaptive_k {
            true => choose_k(&alphas, k_max, batch, &self.costs, false),
            false => k_max,
        };
        for s in &mut self.sched.running {
            match s.speculation {
                // MTP drafts were made at the end of the last step.
                Some(Speculation::Mtp { .. }) if s.pending() == 1 => {}
                Some(Speculation::Ngram { k, min_n, max_n }) if s.pending() == 1 => {
                    let k = draft_room(s, k.min(k_round), context);
                    let all = s.tokens(0, s.len());
                    s.drafts = NgramDrafter { min_n, max_n }.propose_tokens(&all, k);
                }
                _ => s.drafts.clear(),
            }
            // A decode step with drafts verifies them; without, it is a plain decode step.
            s.verify = !s.drafts.is_empty();
        }
    }

    /// Feeds each MTP-speculating sequence's newly committed pairs to the MTP head (`feeds`:
    /// running index, first position, the rows of `hidden` holding those positions' final
    /// hidden states, and whether the sequence has finished: its pairs are written now, no
    /// drafts made), all sequences in one batched pass, then chains greedy draft steps for those
    /// now decoding: their drafts for the next step's verify.
    fn mtp_draft(&mut self, feeds: &[Feed], hidden: &Tensor, stats: &mut StepStats) -> Result<()> {
        let context = self.context();
        let Some((head, pool, stepper)) = self.mtp.as_mut() else {
            return Ok(());
        };
        let batch_size = self.sched.running.len();
        let running = &mut self.sched.running;
        // This round's drafts: the best k for the sequences now decoding.
        let decoding =
            |s: &Sequence| matches!(s.speculation, Some(Speculation::Mtp { .. })) && s.pending() == 1;
        let deciders: Vec<&Sequence> = feeds
            .iter()
            .filter(|f| !f.3)
            .map(|f| &running[f.0])
            .filter(|s| decoding(s))
            .collect();
        let k_max = deciders
            .iter()
            .map(|s| s.speculation.map_or(0, |sp| sp.k()))
            .max()
            .unwrap_or(0);
        let alphas: Vec<Vec<f64>> = deciders
            .iter()
            .map(|s| rates(&s.spec, &self.accept_mtp, k_max))
            .collect();
        let k_round = match self.cfg.adaptive_k {
            true => choose_k(&alphas, k_max, batch_size, &self.costs, true),
            false => k_max,
        };
        // The chunks of draft step 0, their states, and per chunk (running index, drafts wanted).
        let (mut chunks, mut parts, mut who) = (Vec::new(), Vec::new(), Vec::new());
        // Per chunk, the MTP positions its pairs write.
        let mut fed: Vec<Range<usize>> = Vec::new();
        for (index, start, rows, finished) in feeds {
            let s = &mut running[*index];
            let Some(Speculation::Mtp { k }) = s.speculation else {
                continue;
            };
            let unfed = s.unfed.take();
            let held = unfed.as_ref().map_or(Ok(0), |u| u.dim(0))?;
            if s.mtp_len + held != *start || rows.is_empty() {
                continue; // a gap in the pairs (cannot happen): no more drafts, still lossless
            }
            let m = held + rows.len();
            // (A finished sequence may have run accepted positions past its output's end.)
            let k = if !finished && decoding(s) {
                draft_room(s, k.min(k_round), context)
            } else {
                0
            };
            // Without drafts now, the pairs wait (the head is not run) unless many are held.
            if k == 0 && m < FEED_AT_MOST && !finished {
                s.unfed = Some(held_states(hidden, unfed, rows.clone())?);
                continue;
            }
            // The chain writes MTP positions up to start + m + k − 2: blocks only the prefix
            // cache holds give way to them, as to the sequence's own K/V; without room, fewer
            // drafts.
            let first = s.mtp_len;
            let end = first + m + k.saturating_sub(1);
            let (blocks, slots, prefix) = (
                &mut self.sched.blocks,
                &mut self.sched.slots,
                self.sched.prefix.as_mut(),
            );
            let k = match reserve_evicting(&mut s.table, end, blocks, slots, prefix) {
                Ok(()) => k,
                Err(Error::Exhausted { .. }) => k.min(1),
                Err(e) => return Err(e),
            };
            chunks.push(SeqChunk {
                slot: s.slot.expect("a running sequence has a slot").0,
                start: first,
                tokens: s.tokens(first + 1, m),
                blocks: s.table.blocks().iter().map(|b| b.0).collect(),
                verify: false,
            });
            parts.push((unfed, rows.clone()));
            who.push((*index, k));
            fed.push(first..first + m);
        }
        if self.lockstep {
            // Every rank feeds and drafts alike, or the head's reductions would not pair up.
            let mut h = std::collections::hash_map::DefaultHasher::new();
            (&who, &fed).hash(&mut h);
            agree(&self.model, "MTP drafts", h.finish())?;
        }
        if chunks.is_empty() {
            return Ok(());
        }
        let batch = ForwardBatch::new(chunks);
        let mut in_rows: Vec<usize> = (0..parts.len()).collect();
        in_rows.sort_by_key(|&c| batch.rows(c).start);
        let input = if parts.iter().all(|(unfed, _)| unfed.is_none()) {
            // One gather of every chunk's rows of `hidden`, in the batch's row order.
            let idx: Vec<u32> = in_rows
                .iter()
                .flat_map(|&c| parts[c].1.clone().map(|r| r as u32))
                .collect();
            hidden.index_select(&Tensor::new(idx.as_slice(), hidden.device())?, 0)?
        } else {
            let mut states = Vec::with_capacity(parts.len());
            for &c in &in_rows {
                let (unfed, rows) = &mut parts[c];
                states.push(held_states(hidden, unfed.take(), rows.clone())?);
            }
            Tensor::cat(&states, 0)?
        };
        let drafting = who.iter().filter(|w| w.1 > 0).count();
        // The draft steps' times as the device ran them: a step's tokens are read back once,
        // after the last, so that each step is issued while the one before it runs.
        let mut clock = DeviceClock::new(self.model.device());
        clock.mark();
        let replays = stepper.graph_counts().1;
        let (last, first) = stepper.draft(head, &self.model, &input, &batch, pool, 0)?;
        clock.mark();
        stats.draft_steps += 1;
        stats.draft_steps_graphed += usize::from(stepper.graph_counts().1 > replays);
        // The pairs are written: the sequences' MTP K/V reaches past them (not before: after a
        // failure no block may be noted as holding pairs it lacks).
        for (&(index, _), fed) in who.iter().zip(fed) {
            let s = &mut running[index];
            s.mtp_len = fed.end;
            if let Some(prefix) = self.sched.prefix.as_mut() {
                note_mtp(prefix, s, fed);
            }
        }
        // Chain: each drafting sequence's (running index, drafts wanted), last state and token.
        let mut chain: Vec<(usize, usize)> = Vec::new();
        let mut members = Vec::new();
        for (c, &(index, k)) in who.iter().enumerate() {
            if k > 0 {
                chain.push((index, k));
                members.push(c as u32);
                running[index].drafts.clear();
            }
        }
        if chain.is_empty() {
            return Ok(());
        }
        let dev = last.device().clone();
        let (mut states, mut tokens) = match members.len() == who.len() {
            true => (last, first),
            false => {
                let m = Tensor::new(members.as_slice(), &dev)?;
                (last.index_select(&m, 0)?, first.index_select(&m, 0)?)
            }
        };
        // Each step's tokens on the device, and the chain members they belong to (`live`: those
        // still drafting; the live set only shrinks, so `states` and `tokens` follow it).
        let mut live: Vec<usize> = (0..chain.len()).collect();
        let mut drawn: Vec<(Vec<usize>, Tensor)> = vec![(live.clone(), tokens.clone())];
        for step in 1.. {
            let now: Vec<usize> = live.iter().copied().filter(|&i| chain[i].1 > step).collect();
            if now.is_empty() {
                break;
            }
            if now.len() < live.len() {
                let keep: Vec<u32> = (0..live.len())
                    .filter(|&c| chain[live[c]].1 > step)
                    .map(|c| c as u32)
                    .collect();
                let keep = Tensor::new(keep.as_slice(), &dev)?;
                states = states.index_select(&keep, 0)?;
                tokens = tokens.index_select(&keep, 0)?;
            }
            live = now;
            // One token each (the last step's, on the device): one group, in chunk order.
            let chunks: Vec<SeqChunk> = live
                .iter()
                .map(|&i| {
                    let s = &running[chain[i].0];
                    SeqChunk {
                        slot: s.slot.expect("a running sequence has a slot").0,
                        start: s.mtp_len + step - 1,
                        tokens: vec![0],
                        blocks: s.table.blocks().iter().map(|b| b.0).collect(),
                        verify: false,
                    }
                })
                .collect();
            let batch = ForwardBatch::new(chunks);
            let replays = stepper.graph_counts().1;
            let (picked, next) =
                stepper.draft_from(head, &self.model, &states, &tokens, &batch, pool, step)?;
            clock.mark();
            stats.draft_steps += 1;
            stats.draft_steps_graphed += usize::from(stepper.graph_counts().1 > replays);
            drawn.push((live.clone(), next.clone()));
            (states, tokens) = (picked, next);
        }
        // Every step's tokens in one read.
        let all = Tensor::cat(&drawn.iter().map(|(_, t)| t).collect::<Vec<_>>(), 0)?.to_vec1::<u32>()?;
        let mut at = 0;
        for (live, _) in &drawn {
            for &i in live {
                running[chain[i].0].drafts.push(all[at]);
                at += 1;
            }
        }
        let spans = clock.spans();
        let costs = if self.lockstep {
            &mut self.measured
        } else {
            &mut self.costs
        };
        // The first step's cost as a decode round has it: a few new pairs per sequence.
        if let Some(secs) = spans[0].filter(|_| batch.total_rows() <= who.len() * (k_max + 1)) {
            costs.record_draft(drafting, 0, secs);
        }
        for (step, ((live, _), secs)) in drawn.iter().zip(&spans).enumerate().skip(1) {
            if let Some(secs) = *secs {
                costs.record_draft(live.len(), step, secs);
            }
        }
        Ok(())
    }

    /// The forward of `batch`, what each entry of `reads` needs of its rows (with `full`, their
    /// f32 logits; otherwise only their argmax, taken on the device), what its verifies leave to
    /// commit and the final hidden states.
    fn forward(
        &mut self,
        batch: &ForwardBatch,
        reads: &[Range<usize>],
        full: &[bool],
    ) -> Result<(Vec<Read>, Option<BatchPending>, Tensor)> {
        let out = self.runner.forward(&self.model, batch, &mut self.cache)?;
        let rows: Vec<u32> = reads.iter().flat_map(|r| r.clone().map(|i| i as u32)).collect();
        if rows.is_empty() {
            let reads = reads.iter().map(|_| Read::Ids(Vec::new())).collect();
            return Ok((reads, out.pending, out.hidden));
        }
        let dev = out.hidden.device();
        // Logits in the activation dtype: their argmax is that of the f32 logits (widening is
        // exact), so only the rows read in full are cast.
        let head = self.model.lm_head();
        let logits = head
            .forward(&out.hidden.index_select(&Tensor::new(rows.as_slice(), dev)?, 0)?)
            .map_err(qwen36_model::Error::from)?;
        let ids = qwen36_kernels::argmax::argmax_last_dim(&logits, head.policy())
            .map_err(qwen36_model::Error::from)?
            .to_vec1::<u32>()?;
        // The full rows of the entries that need them, in one copy.
        let mut wanted = Vec::new();
        let mut at = 0u32;
        for (r, &f) in reads.iter().zip(full) {
            if f {
                wanted.extend(at..at + r.len() as u32);
            }
            at += r.len() as u32;
        }
        let mut rows_full = if wanted.is_empty() {
            Vec::new()
        } else {
            let w = Tensor::new(wanted.as_slice(), dev)?;
            logits
                .index_select(&w, 0)?
                .to_dtype(DType::F32)?
                .to_vec2::<f32>()?
        }
        .into_iter();
        let mut ids = ids.into_iter();
        let per_read = reads
            .iter()
            .zip(full)
            .map(|(r, &f)| {
                let mine: Vec<u32> = ids.by_ref().take(r.len()).collect();
                match f && !r.is_empty() {
                    true => Read::Rows(rows_full.by_ref().take(r.len()).collect()),
                    false => Read::Ids(mine),
                }
            })
            .collect();
        Ok((per_read, out.pending, out.hidden))
    }

    /// The log-probabilities of `targets` under the logits of `hidden`'s rows from `first` on
    /// (row `first + i` predicts `targets[i]`), with `top` alternatives each: the logits of
    /// [`PROMPT_ROWS`] rows at a time, as f32 on the host (the same `log_softmax` as the
    /// output's log-probabilities).
    fn prompt_logprobs(
        &self,
        hidden: &Tensor,
        first: usize,
        targets: &[u32],
        top: usize,
    ) -> Result<Vec<Sampled>> {
        let mut out = Vec::with_capacity(targets.len());
        for (g, group) in targets.chunks(PROMPT_ROWS).enumerate() {
            let rows = hidden.narrow(0, first + g * PROMPT_ROWS, group.len())?;
            let logits = self.model.logits(&rows)?.to_dtype(DType::F32)?.to_vec2::<f32>()?;
            out.par_extend(
                logits
                    .into_par_iter()
                    .zip(group)
                    .map(|(row, &t)| qwen36_sampling::ranked_logprobs_of(&row, t, top)),
            );
        }
        Ok(out)
    }

    /// Ends every waiting and running request with `Failed` naming `e`, freeing what they hold
    /// (after an error no request can go on from).
    pub(crate) fn fail_all(&mut self, e: &Error) {
        let running: Vec<usize> = (0..self.sched.running.len()).collect();
        // Every one of them is told and removed even where freeing what it holds fails.
        let _ = self.fail_running(&running, e);
        // (A waiting sequence holds nothing, unless planning failed while admitting it.)
        for mut s in std::mem::take(&mut self.sched.waiting) {
            let _ = s.events.send(Event::Failed { error: e.to_string() });
            let _ = s.release(&mut self.sched.slots, &mut self.sched.blocks);
        }
    }

    /// A step that cannot go on: every sequence of its `plan` fails with `e`, which is returned
    /// (a bookkeeping error while freeing them first).
    fn fail_step(&mut self, plan: &[crate::scheduler::Scheduled], e: Error) -> Result<StepStats> {
        self.fail_running(&plan.iter().map(|p| p.index).collect::<Vec<_>>(), &e)?;
        Err(e)
    }

    /// Ends the running sequences at `indices` with `Failed`, freeing what they hold: each is
    /// told and removed whatever happens to the others; the first failure to free is returned.
    fn fail_running(&mut self, indices: &[usize], e: &Error) -> Result<()> {
        let mut indices = indices.to_vec();
        indices.sort_unstable_by(|a, b| b.cmp(a));
        let mut freed = Ok(());
        for i in indices {
            let mut s = self.sched.running.remove(i);
            let _ = s.events.send(Event::Failed { error: e.to_string() });
            let released = s.release(&mut self.sched.slots, &mut self.sched.blocks);
            if freed.is_ok() {
                freed = released;
            }
        }
        freed
    }
}

/// A lockstep rank's check that every rank of `model`'s group holds the same `print` (a hash of
/// a decision, `what`): one small reduction, whose sum is `size` times each rank's own only when
/// all are equal. A divergence (a bug) is an error on every rank at once, never a wait for a
/// reduction that does not come. Nothing to check on one device.
fn agree(model: &Qwen36Model, what: &str, print: u64) -> Result<()> {
    let Some(comm) = model.communicator() else {
        return Ok(());
    };
    // Eight 8-bit parts and their squares: the sums over up to 2^8 ranks stay exact in f32, and
    // n·Σp² = (Σp)² holds exactly when every rank's p is the same, a verdict every rank reads
    // from the same sums.
    let parts: Vec<f32> = (0..8).map(|i| ((print >> (8 * i)) & 0xFF) as f32).collect();
    let squares: Vec<f32> = parts.iter().map(|p| p * p).collect();
    let t = Tensor::new([parts, squares].concat().as_slice(), model.device())?;
    let sum = comm.all_reduce_sum(&t)?.to_vec1::<f32>()?;
    let n = comm.size() as f64;
    let (sums, sums_sq) = sum.split_at(8);
    if sums
        .iter()
        .zip(sums_sq)
        .any(|(&s, &q)| n * f64::from(q) != f64::from(s) * f64::from(s))
    {
        return Err(Error::Ranks(format!("the {what} differs between ranks")));
    }
    Ok(())
}

/// The longest sequence an engine of `cfg` over `model` takes.
fn context_of(model: &Qwen36Model, cfg: &EngineConfig) -> usize {
    let model_len = model.config().max_position_embeddings;
    cfg.max_model_len.map_or(model_len, |m| m.min(model_len))
}

/// The acceptance of [`EngineConfig::timing_accept_rates`]: draft `j` is accepted in a share
/// `rates[j]` of the verifies, so once every draft before it passed it passes with
/// `rates[j] / rates[j - 1]`; the next token is the target's argmax there. Each request draws
/// from its own stream (`id`), so that requests of one seed do not accept alike.
fn timed_acceptance(
    rates: &[f64],
    drafts: &[u32],
    argmax: &[u32],
    sampler: &mut Sampler,
    id: u64,
) -> Acceptance {
    let step = sampler.next_step();
    let stream = id as usize;
    let accepted = (0..drafts.len())
        .take_while(|&j| sampler.uniform(stream, step, j as u64) < passing_rate(rates, j))
        .count();
    Acceptance {
        accepted,
        next: argmax[accepted],
    }
}

/// `P(draft j passes | drafts 0..j passed)` for per-position rates `rates` (non-increasing);
/// past the last position the last ratio goes on (one rate: every position passes with it).
fn passing_rate(rates: &[f64], j: usize) -> f64 {
    let n = rates.len();
    let (num, den) = match j {
        _ if n == 0 => return 0.0,
        0 => (rates[0], 1.0),
        j if j < n => (rates[j], rates[j - 1]),
        _ if n == 1 => (rates[0], 1.0),
        _ => (rates[n - 1], rates[n - 2]),
    };
    if den > 0.0 {
        num / den
    } else {
        0.0
    }
}

/// What the forward gives one sequence's read rows: their f32 logits, or (a sequence that only
/// needs the argmax) their greedy ids.
#[derive(Debug)]
enum Read {
    Rows(Rows),
    Ids(Vec<u32>),
}

/// What one sequence's rows decided.
enum Decision {
    /// A chunk inside its prompt: nothing to sample.
    Prefilled,
    /// The next token (and the rows it came from, for log-probabilities).
    Sampled(u32, Rows),
    /// A verify's acceptance of its drafts.
    Verified(Acceptance, Vec<u32>, Rows),
    /// The sampler refused the rows (e.g. NaN logits).
    Failed(String),
}

/// Samples or accepts for `s` from its rows (on the device's argmax alone where `s` is plain
/// greedy without log-probabilities: the sampler would take the same argmax).
fn decide(s: &mut Sequence, read: Read, verify: bool, rates: Option<&[f64]>) -> Decision {
    let fail = |e: &dyn std::fmt::Display| Decision::Failed(e.to_string());
    match (read, verify) {
        (Read::Ids(ids), _) if ids.is_empty() => Decision::Prefilled,
        (Read::Rows(rows), _) if rows.is_empty() => Decision::Prefilled,
        (read, true) => {
            let mut drafts = std::mem::take(&mut s.drafts);
            let (acc, rows) = match (read, rates) {
                (Read::Ids(ids), Some(r)) => (
                    Ok(timed_acceptance(r, &drafts, &ids, &mut s.sampler, s.id)),
                    Vec::new(),
                ),
                (Read::Ids(ids), None) => (
                    accept_greedy(&drafts, &ids).map_err(|e| e.to_string()),
                    Vec::new(),
                ),
                (Read::Rows(rows), Some(r)) => {
                    let ids: Vec<u32> = rows.iter().map(|row| argmax_of(row)).collect();
                    (Ok(timed_acceptance(r, &drafts, &ids, &mut s.sampler, s.id)), rows)
                }
                (Read::Rows(rows), None) => {
                    // Under a constraint, acceptance reads the masked rows (the emitted
                    // log-probabilities stay the raw rows').
                    let masked = match s.constraint.as_deref_mut() {
                        Some(c) => match crate::constraint::masked_rows(c, &drafts, &rows) {
                            Ok(m) => {
                                drafts.truncate(m.len() - 1);
                                Some(m)
                            }
                            Err(e) => return fail(&e),
                        },
                        None => None,
                    };
                    let read = masked.as_ref().unwrap_or(&rows);
                    (
                        s.sampler
                            .accept_coupled(&drafts, read, &s.prompt, &s.output)
                            .map_err(|e| e.to_string()),
                        rows,
                    )
                }
            };
            match acc {
                Ok(acc) => Decision::Verified(acc, drafts, rows),
                Err(e) => fail(&e),
            }
        }
        (Read::Ids(ids), false) => Decision::Sampled(ids[0], Vec::new()),
        // The RNG step of a token is its output index, as in speculative acceptance.
        (Read::Rows(rows), false) => {
            let masked = match s.constraint.as_deref_mut() {
                Some(c) => match crate::constraint::masked(c, &rows[0]) {
                    Ok(m) => Some(m),
                    Err(e) => return fail(&e),
                },
                None => None,
            };
            let row = masked.as_deref().unwrap_or(&rows[0]);
            match s
                .sampler
                .sample_at(row, &s.prompt, &s.output, 0, s.output.len() as u64)
            {
                Ok(t) => Decision::Sampled(t.token, rows),
                Err(e) => fail(&e),
            }
        }
    }
}

/// The index of the largest value, lowest on ties.
fn argmax_of(row: &[f32]) -> u32 {
    (0..row.len()).fold(0, |best, i| if row[i] > row[best] { i } else { best }) as u32
}

/// Prompt rows whose logits are made at once for prompt log-probabilities (their f32 copy is
/// `PROMPT_ROWS × vocab × 4` bytes: 64 MB for Qwen3.6's 248k vocabulary).
const PROMPT_ROWS: usize = 64;

/// A sequence's pairs for the MTP head: the states it held back (`unfed`), then `rows` of the
/// forward's `hidden`.
fn held_states(hidden: &Tensor, unfed: Option<Tensor>, rows: Range<usize>) -> Result<Tensor> {
    let idx: Vec<u32> = rows.map(|r| r as u32).collect();
    let new = hidden.index_select(&Tensor::new(idx.as_slice(), hidden.device())?, 0)?;
    Ok(match unfed {
        Some(u) => Tensor::cat(&[&u, &new], 0)?,
        None => new,
    })
}

/// Pairs for the MTP head: a running sequence's index, the first position, the rows of the
/// forward's hidden states holding them, and whether the sequence has finished.
type Feed = (usize, usize, Range<usize>, bool);

/// Pairs a sequence may hold back from its MTP head (while it drafts nothing) before they are
/// fed anyway: their hidden states wait in memory (`[pairs, hidden]`).
const FEED_AT_MOST: usize = 512;

/// A decoding sequence keeps the state at every this many blocks (and at the last boundary
/// before its `max_tokens`) for the prefix cache: a turn that ends early (a stop) leaves the next
/// turn at most this many blocks more to prefill.
const ROLLING_BLOCKS: usize = 8;

/// A sequence's acceptance rates for draft positions `0..k`, shrunk toward the engine-wide ones
/// (themselves toward 1/2).
fn rates(own: &SpecStats, all: &SpecStats, k: usize) -> Vec<f64> {
    (0..k).map(|j| own.rate(j, all.rate(j, 0.5, 4.0), 4.0)).collect()
}

/// Drafts a decoding sequence may verify: `k` within the context, and within its `max_tokens`:
/// a verify of `d` drafts yields up to `d + 1` tokens, so `left − 1` drafts reach the end (and
/// its positions stay within the `prompt + max_tokens − 1` that `submit` admitted).
fn draft_room(s: &Sequence, k: usize, context: usize) -> usize {
    let left = s.max_tokens.map_or(usize::MAX, |m| m - s.output.len());
    k.min(left.saturating_sub(1))
        .min(context.saturating_sub(s.computed + 1))
}

/// Appends `fresh` tokens (row `j` of `rows` gave `fresh[j]`) to `s`'s output up to its first
/// stop: a stop id, a stop string in the text, `max_tokens`, or a full context; sends them with
/// their text. Returns how many were added and the stop, if any; an error when detokenizing
/// fails.
fn emit(
    s: &mut Sequence,
    fresh: &[u32],
    rows: &[Vec<f32>],
    context: usize,
    detokenizer: Option<&Detokenizer>,
    lockstep: bool,
) -> std::result::Result<(usize, Option<StopReason>), String> {
    let mut reason = None;
    let mut sent = Vec::new();
    let mut text = String::new();
    for (j, &t) in fresh.iter().enumerate() {
        s.output.push(t);
        sent.push(t);
        // (The first `min_tokens` tokens are never stop ids: the sampler masks them.)
        let stop_id = s.stop_ids.contains(&t);
        if stop_id {
            reason = Some(StopReason::StopToken(t));
        }
        // A stop id's text is kept only with the stop strings (vLLM's
        // include_stop_str_in_output).
        let stream = s.text.as_mut().filter(|st| !stop_id || st.keeps_stop_strings());
        if let (Some(stream), Some(d)) = (stream, detokenizer) {
            let (piece, go_on) = stream
                .push(t, d.0.as_ref())
                .map_err(|e| format!("detokenizing failed: {e}"))?;
            text.push_str(&piece);
            if !go_on && reason.is_none() {
                reason = Some(StopReason::StopString(stream.stopped_by().unwrap_or(0)));
            }
        }
        // The step's entropy where its row was read (sampled requests), else none.
        let seen = s
            .degeneration
            .as_mut()
            .and_then(|d| d.observe(t, rows.get(j).map(|r| qwen36_sampling::entropy(r))));
        if let (None, Some(d), true) = (&reason, seen, s.stop_on_degeneration) {
            reason = Some(StopReason::Degenerate(d));
        }
        if reason.is_none() && s.max_tokens.is_some_and(|m| s.output.len() >= m) {
            reason = Some(StopReason::MaxTokens);
        } else if reason.is_none() && s.len() > context {
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
    let event = Event::Token {
        ids: sent,
        text,
        logprobs,
    };
    // (A lockstep rank learns of a client gone from the first rank's cancel, at a step start.)
    if s.events.send(event).is_err() && !lockstep {
        reason = Some(StopReason::Cancelled);
    }
    Ok((n, reason))
}

/// A request's own checks (the rest depend on the engine's pools and heads): its prompt
/// ([`check_prompt`]), its stop, logit-bias and allowed ids within `vocab` (one past it could
/// never fire, bias or be drawn), some allowed id left while `min_tokens` masks the stop ids
/// and a stop id among them beside a constraint, `max_tokens` at least 1 (or 0 with `prompt_logprobs`) and not under
/// `min_tokens`, and its sampling, speculation and degeneration settings.
pub fn check_request(req: &Request, vocab: usize) -> Result<()> {
    check_prompt(&req.prompt, vocab)?;
    if let Some(&id) = req.stop_ids.iter().find(|&&id| id as usize >= vocab) {
        return Err(Error::Request(format!(
            "stop token {id} is outside the vocabulary of {vocab}"
        )));
    }
    if let Some(&(id, _)) = req
        .sampling
        .logit_bias
        .iter()
        .find(|&&(id, _)| id as usize >= vocab)
    {
        return Err(Error::Request(format!(
            "logit_bias: token {id} is outside the vocabulary of {vocab}"
        )));
    }
    let allowed = &req.sampling.allowed_ids;
    if let Some(&id) = allowed.iter().find(|&&id| id as usize >= vocab) {
        return Err(Error::Request(format!(
            "allowed_token_ids: token {id} is outside the vocabulary of {vocab}"
        )));
    }
    // (A finished constraint allows only the stop ids: one must be allowed.)
    if !allowed.is_empty() && req.constraint.is_some() && !allowed.iter().any(|id| req.stop_ids.contains(id))
    {
        return Err(Error::Request(
            "allowed_token_ids with an output constraint: a finished constraint ends at a stop id, which none of them is"
                .into(),
        ));
    }
    // (min_tokens masks the stop ids, one-id bad words their ids: one allowed id must be left.
    // Bad words alone are `SamplingParams::validate`'s, below.)
    if req.sampling.masks_every_allowed_id(&req.stop_ids) && !req.sampling.masks_every_allowed_id(&[]) {
        return Err(Error::Request(
            "allowed_token_ids: only stop ids, which min_tokens masks, or one-id bad words".into(),
        ));
    }
    if let Some(max) = req.max_tokens.filter(|&m| req.sampling.min_tokens > m) {
        return Err(Error::Request(format!(
            "min_tokens {} is over max_tokens {max}",
            req.sampling.min_tokens
        )));
    }
    // (A finished grammar allows only the stop ids, which min_tokens masks.)
    if req.constraint.is_some() && req.sampling.min_tokens > 0 && !req.stop_ids.is_empty() {
        return Err(Error::Request(
            "min_tokens with an output constraint: a finished constraint ends at a stop id".into(),
        ));
    }
    if req.max_tokens == Some(0) && req.prompt_logprobs.is_none() {
        return Err(Error::Request(
            "max_tokens must be at least 1 (0 only with prompt_logprobs)".into(),
        ));
    }
    req.sampling
        .validate()
        .map_err(|e| Error::Request(e.to_string()))?;
    if let Some(spec) = &req.speculation {
        spec.check().map_err(Error::Request)?;
    }
    if let Some(d) = &req.degeneration {
        d.validate()
            .map_err(|e| Error::Request(format!("degeneration: {e}")))?;
    }
    Ok(())
}

/// A prompt's own checks (the rest depend on the engine): not empty, every id within `vocab`.
pub fn check_prompt(prompt: &[u32], vocab: usize) -> Result<()> {
    if prompt.is_empty() {
        return Err(Error::Request("the prompt has no tokens".into()));
    }
    if let Some(&id) = prompt.iter().find(|&&id| id as usize >= vocab) {
        return Err(Error::Request(format!(
            "prompt token {id} is outside the vocabulary of {vocab}"
        )));
    }
    Ok(())
}

/// Tests only: an engine of the bundled model under `cfg`.
#[cfg(test)]
pub(crate) fn bundled_engine(cfg: EngineConfig) -> Engine {
    let opts = qwen36_model::LoadOptions::default();
    let model = Qwen36Model::load(qwen36_testutil::bundled_dir(), opts).unwrap();
    Engine::new(model, cfg).unwrap()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// After an error no request can go on from, every waiting and running request gets
    /// `Failed` naming it, and the pools are empty.
    #[test]
    fn fail_all_ends_every_request() {
        let mut engine = bundled_engine(EngineConfig {
            max_seqs: 1,
            ..Default::default()
        });
        let handles: Vec<RequestHandle> = (0..2)
            .map(|i| engine.submit(Request::greedy(vec![1, 2, 3 + i], 8)).unwrap())
            .collect();
        engine.step().unwrap();
        assert_eq!((engine.waiting(), engine.pool_use().0), (1, 1));
        engine.fail_all(&Error::Stopped);
        assert_eq!((engine.pending(), engine.pool_use()), (0, (0, 0)));
        for h in &handles {
            let last = h.drain().pop();
            assert!(
                matches!(&last, Some(Event::Failed { error }) if error.contains("shut down")),
                "{last:?}"
            );
        }
    }

    /// A state copy that fails (a device error) fails the step; every request gets `Failed`
    /// and, after `fail_all`, nothing is held but what the prefix cache keeps: `restore` picks
    /// the copy that fails, the snapshot a new prompt keeps at its end (`false`) or the restore
    /// of a cached one into a new sequence's slot (`true`).
    fn a_failing_state_copy_leaks_no_slot(restore: bool) {
        let mut engine = bundled_engine(EngineConfig {
            prefix_snapshots: 4,
            ..Default::default()
        });
        let prompt: Vec<u32> = (1..=2 * engine.cfg.block_size as u32).collect();
        if restore {
            let h = engine.submit(Request::greedy(prompt.clone(), 2)).unwrap();
            engine.run_to_completion().unwrap();
            assert!(matches!(h.drain().pop(), Some(Event::Finished { .. })));
            assert_eq!(engine.cached().1, 1, "the prompt's end is kept");
        }
        let mut longer = prompt.clone();
        longer.extend([7, 8, 9]);
        let h = engine.submit(Request::greedy(longer, 4)).unwrap();
        engine.fail_next_copy = true;
        let e = engine.step().unwrap_err();
        engine.fail_all(&e);
        assert_eq!((engine.pending(), engine.pool_use()), (0, (0, 0)));
        let last = h.drain().pop();
        assert!(
            matches!(&last, Some(Event::Failed { error }) if error.contains("injected")),
            "{last:?}"
        );
        // The engine goes on: the same request now runs to its end.
        let h = engine.submit(Request::greedy(prompt, 2)).unwrap();
        engine.run_to_completion().unwrap();
        assert!(matches!(h.drain().pop(), Some(Event::Finished { .. })));
        assert_eq!(engine.pool_use(), (0, 0));
    }

    #[test]
    fn a_failing_snapshot_copy_leaks_no_slot() {
        a_failing_state_copy_leaks_no_slot(false);
    }

    #[test]
    fn a_failing_restore_leaks_no_slot() {
        a_failing_state_copy_leaks_no_slot(true);
    }

    /// A planning error (here a bookkeeping bug: a cancelled sequence's slot freed behind the
    /// scheduler's back) loses no request: the cancelled one still gets `Finished`, the others
    /// `Failed` from `fail_all`, and its blocks are freed although its slot's release failed.
    #[test]
    fn a_planning_error_loses_no_request() {
        let mut engine = bundled_engine(EngineConfig::default());
        let handles: Vec<RequestHandle> = (0..2)
            .map(|i| engine.submit(Request::greedy(vec![1, 2, 3 + i], 8)).unwrap())
            .collect();
        engine.step().unwrap();
        handles[0].cancel();
        let slot = engine.sched.running[0].slot.unwrap();
        engine.sched.slots.release(slot).unwrap();
        let e = engine.step().unwrap_err();
        assert!(matches!(e, Error::NotAllocated { .. }), "{e}");
        engine.fail_all(&e);
        assert_eq!((engine.pending(), engine.pool_use()), (0, (0, 0)));
        let ends: Vec<Option<Event>> = handles.iter().map(|h| h.drain().pop()).collect();
        assert!(
            matches!(
                &ends[0],
                Some(Event::Finished {
                    reason: StopReason::Cancelled,
                    ..
                })
            ),
            "{:?}",
            ends[0]
        );
        assert!(matches!(&ends[1], Some(Event::Failed { .. })), "{:?}", ends[1]);
    }

    /// The timing rates are per position, as vLLM reports them: over many verifies, draft `j`
    /// is accepted in a share `rates[j]` of them and the accepted length is `1 + Σ rates`
    /// (3.41 for the published Qwen3.6-27B head, not the 3.23 of chaining them as conditional
    /// rates). 40000 draws: a share's standard error is at most 0.0025, the tolerance 0.01.
    #[test]
    fn timing_rates_are_shares_per_position() {
        let rates = [0.963, 0.804, 0.640];
        let mut sampler = Sampler::new(qwen36_sampling::SamplingParams::default()).unwrap();
        let (n, drafts, argmax) = (40_000, [7u32, 8, 9], [1u32, 2, 3, 4]);
        let mut at = [0usize; 4];
        let mut emitted = 0;
        for _ in 0..n {
            let a = timed_acceptance(&rates, &drafts, &argmax, &mut sampler, 0);
            assert_eq!(a.next, argmax[a.accepted]);
            emitted += a.accepted + 1;
            for c in &mut at[..a.accepted] {
                *c += 1;
            }
        }
        for (j, r) in rates.iter().enumerate() {
            let share = at[j] as f64 / n as f64;
            assert!((share - r).abs() < 0.01, "position {j}: {share} against {r}");
        }
        let al = emitted as f64 / n as f64;
        assert!((al - 3.407).abs() < 0.02, "accepted length {al}");
        // Two requests of one seed draw apart.
        let draw = |id: u64| {
            let mut sampler = Sampler::new(qwen36_sampling::SamplingParams::default()).unwrap();
            (0..64)
                .map(|_| timed_acceptance(&rates, &drafts, &argmax, &mut sampler, id).accepted)
                .collect::<Vec<usize>>()
        };
        assert_ne!(draw(0), draw(1));
        // Past the rates the last ratio goes on; one rate is every position's ratio.
        assert!((passing_rate(&rates, 3) - 0.640 / 0.804).abs() < 1e-12);
        assert!((passing_rate(&rates, 5) - 0.640 / 0.804).abs() < 1e-12);
        assert_eq!(passing_rate(&[0.5], 3), 0.5);
        assert_eq!(passing_rate(&[0.5, 0.0], 4), 0.0);
        assert_eq!(passing_rate(&[0.0, 0.0], 1), 0.0);
        assert_eq!(passing_rate(&[], 0), 0.0);
        let five = [0.9, 0.8, 0.6, 0.3, 0.2];
        assert!((passing_rate(&five, 7) - 0.2 / 0.3).abs() < 1e-12);
    }
}
