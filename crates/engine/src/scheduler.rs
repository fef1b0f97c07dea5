//! Continuous batching: which sequences run in the next forward and how many tokens each.
//!
//! By priority, then first come first served: running sequences first (decode tokens, their
//! drafts and the rest of their prompts, in that order), then waiting ones while a slot, KV
//! blocks and the step's token budget allow; a prompt longer than the budget runs in chunks over
//! several steps, beside everyone's decode tokens. When KV blocks run out the last running
//! sequence in that order (the newest of the lowest priority) is preempted: its slot and blocks
//! are freed and it waits again, to be recomputed from its prompt and the tokens it already has.

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use qwen36_sampling::{RepetitionDetector, Sampled, Sampler, TextStream};

use crate::{
    BlockPool, BlockTable, Constraint, Error, Event, PrefixCache, Result, SlotId, SlotPool, Speculation,
    StopReason,
};
use qwen36_mtp::SpecStats;

/// One request inside the engine.
#[derive(Debug)]
pub(crate) struct Sequence {
    pub id: u64,
    /// [`crate::Request::priority`].
    pub priority: i32,
    pub prompt: Vec<u32>,
    pub output: Vec<u32>,
    pub sampler: Sampler,
    pub max_tokens: Option<usize>,
    pub stop_ids: Vec<u32>,
    /// The output's text as it streams, with the stop strings (when the engine detokenizes).
    pub text: Option<TextStream>,
    pub logprobs: bool,
    /// Alternatives per prompt token when the request asked for prompt log-probabilities.
    pub prompt_logprobs: Option<usize>,
    /// The prompt log-probabilities read so far (`[i]` is `prompt[i + 1]`'s), until they are
    /// sent; `None` when not asked or sent. Kept through preemptions.
    pub prompt_lps: Option<Vec<Sampled>>,
    /// What its output must match (it follows the tokens emitted).
    pub constraint: Option<Box<dyn Constraint>>,
    pub events: flume::Sender<Event>,
    pub cancel: Arc<AtomicBool>,
    pub slot: Option<SlotId>,
    pub table: BlockTable,
    /// Tokens whose state and K/V are in the pools (the position of the next token to run).
    pub computed: usize,
    pub preemptions: usize,
    pub speculation: Option<Speculation>,
    /// The next forward verifies the last token and `drafts`.
    pub verify: bool,
    /// Drafts to verify after the last token in the next forward.
    pub drafts: Vec<u32>,
    /// Pairs in the MTP head's KV (positions `0..mtp_len`; entries past it are draft-chain
    /// leftovers, overwritten by the next pairs).
    pub mtp_len: usize,
    /// Final hidden states `[pairs, hidden]` of the positions after `mtp_len` not yet fed to the
    /// MTP head (held while the sequence drafts nothing).
    pub unfed: Option<candle_core::Tensor>,
    /// Its verifies (and the plain decode steps of a speculating sequence): acceptance per
    /// position, accepted lengths.
    pub spec: SpecStats,
    /// Watches the output for loops and entropy collapse, when the request asked.
    pub degeneration: Option<RepetitionDetector>,
    pub stop_on_degeneration: bool,
    /// Prompt tokens its last admission restored from the prefix cache.
    pub cached: usize,
    /// Block boundaries (ascending, past `computed`) where a prefill chunk ends and the state is
    /// kept in the prefix cache: where it branches off a cached prefix, and its prompt's last.
    pub snap_points: Vec<usize>,
    /// The state at the last block boundary its decoding passed (slot, position): kept in the
    /// prefix cache when it finishes (the next turn's prefix).
    pub rolling: Option<(SlotId, usize)>,
    /// The furthest snapshot point it passed where the cache keeps the state (its own snapshot
    /// or an identical prefix's).
    pub kept: usize,
}

impl Sequence {
    /// The scheduling order: priority (lower first), then age.
    pub fn order(&self) -> (i32, u64) {
        (self.priority, self.id)
    }

    /// Prompt and generated tokens.
    pub fn len(&self) -> usize {
        self.prompt.len() + self.output.len()
    }

    /// Token `i` of prompt ++ output.
    pub fn token(&self, i: usize) -> Option<u32> {
        match i.checked_sub(self.prompt.len()) {
            None => Some(self.prompt[i]),
            Some(j) => self.output.get(j).copied(),
        }
    }

    /// Tokens `range` of prompt ++ output.
    pub fn tokens(&self, from: usize, n: usize) -> Vec<u32> {
        self.prompt
            .iter()
            .chain(&self.output)
            .skip(from)
            .take(n)
            .copied()
            .collect()
    }

    /// Tokens known but not yet run (the prompt's rest, or the last sampled token).
    pub fn pending(&self) -> usize {
        self.len() - self.computed
    }

    /// Whether it decodes (its one pending token is the last sampled) rather than runs a prompt.
    fn decoding(&self) -> bool {
        self.pending() <= 1
    }

    /// Whether sampling needs the full logits rows: not for plain greedy decoding (no
    /// penalties or biases, no log-probabilities, no constraint), which takes the argmax.
    pub fn needs_logits(&self) -> bool {
        self.logprobs || !self.sampler.params().is_plain_greedy() || self.constraint.is_some()
    }

    /// The prompt positions whose rows still give prompt log-probabilities (row `i` gives
    /// `prompt[i + 1]`'s), when it has any left to read.
    pub fn prompt_rows_left(&self) -> Option<Range<usize>> {
        let read = self.prompt_lps.as_ref()?.len();
        Some(read..self.prompt.len() - 1)
    }

    /// Whether it drafts with the MTP head (and so feeds it pairs).
    pub fn drafts_with_mtp(&self) -> bool {
        matches!(self.speculation, Some(Speculation::Mtp { .. }))
    }

    fn cancelled(&self) -> bool {
        self.cancel.load(Ordering::Relaxed)
    }

    /// The most tokens its next chunk may run: up to its next snapshot point.
    fn chunk_cap(&self) -> usize {
        self.snap_points
            .first()
            .map_or(usize::MAX, |&p| p - self.computed)
    }

    /// Frees its slots and blocks: all of them even where one fails (a bookkeeping bug), whose
    /// error is returned.
    pub fn release(&mut self, slots: &mut SlotPool, blocks: &mut BlockPool) -> Result<()> {
        let slot = self.slot.take().map_or(Ok(()), |s| slots.release(s).map(|_| ()));
        let rolling = self
            .rolling
            .take()
            .map_or(Ok(()), |(s, _)| slots.release(s).map(|_| ()));
        let table = self.table.release(blocks);
        self.snap_points.clear();
        self.kept = 0;
        self.computed = 0;
        self.verify = false;
        self.drafts.clear();
        self.mtp_len = 0;
        self.unfed = None;
        slot.and(rolling).and(table)
    }
}

/// Notes in the prefix cache the blocks of `s` that its MTP pairs `fed` (positions whose pairs
/// are now written) completed: each block whose last position is in `fed`, with the token after
/// it (the one its last pair was fed with).
pub(crate) fn note_mtp(prefix: &mut PrefixCache, s: &Sequence, fed: Range<usize>) {
    let bs = prefix.block_size();
    for k in fed.start / bs..fed.end / bs {
        if let (Some(&block), Some(next)) = (s.table.blocks().get(k), s.token((k + 1) * bs)) {
            prefix.mark_mtp(block, next);
        }
    }
}

/// How many tokens one running sequence runs in the next forward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Scheduled {
    /// Index into the running sequences.
    pub index: usize,
    pub tokens: usize,
}

/// The next forward's plan.
pub(crate) type Plan = Vec<Scheduled>;

/// The queues and the pools' bookkeeping.
#[derive(Debug)]
pub(crate) struct Scheduler {
    /// Waiting sequences in [`Sequence::order`].
    pub waiting: VecDeque<Sequence>,
    /// Running sequences (holding a slot), in [`Sequence::order`] after each `schedule`.
    pub running: Vec<Sequence>,
    pub slots: SlotPool,
    pub blocks: BlockPool,
    /// The most tokens one forward runs.
    pub step_tokens: usize,
    /// The most sequences running at once (the slot pool also holds the prefix cache's).
    pub max_running: usize,
    /// Cached prefixes, when on.
    pub prefix: Option<PrefixCache>,
    /// Snapshots to copy into newly admitted sequences' slots before the next forward
    /// `(snapshot, slot)`; the engine copies them, then releases each snapshot.
    pub restores: Vec<(SlotId, SlotId)>,
    /// Sequences that ended while planning (cancelled, or too long for the whole pool), already
    /// released, for the engine to finish: kept here so that a planning error loses none.
    pub ended: Vec<(Sequence, StopReason)>,
}

/// Grows `table` to hold `positions` positions; when the pool is short, blocks that only the
/// prefix cache holds give way first (a sequence's own K/V and its MTP head's K/V alike).
pub(crate) fn reserve_evicting(
    table: &mut BlockTable,
    positions: usize,
    blocks: &mut BlockPool,
    slots: &mut SlotPool,
    prefix: Option<&mut PrefixCache>,
) -> Result<()> {
    let reserved = table.reserve(positions, blocks);
    if let (Err(Error::Exhausted { wanted, .. }), Some(prefix)) = (&reserved, prefix) {
        if prefix.evict(*wanted, 0, blocks, slots)? > 0 {
            return table.reserve(positions, blocks);
        }
    }
    reserved
}

impl Scheduler {
    /// Plans the next forward; sequences that end here go to [`Self::ended`]. On an error
    /// (a bookkeeping bug) every sequence is still in a queue or in `ended`.
    pub fn schedule(&mut self) -> Result<Plan> {
        for queue_pos in (0..self.waiting.len()).rev() {
            if self.waiting[queue_pos].cancelled() {
                let s = self.waiting.remove(queue_pos).expect("index in range");
                self.ended.push((s, StopReason::Cancelled));
            }
        }
        for i in (0..self.running.len()).rev() {
            if self.running[i].cancelled() {
                let mut s = self.running.remove(i);
                let released = s.release(&mut self.slots, &mut self.blocks);
                self.ended.push((s, StopReason::Cancelled));
                released?;
            }
        }
        self.running.sort_by_key(Sequence::order);
        // Decode tokens first (a decoding sequence's one pending token), then their drafts, then
        // the rest of the prompts, each in order: drafts never starve another sequence's decode
        // token, and a long prompt's chunk does not drop the drafts of the sequences decoding
        // beside it (their verify rows cost little in a step its chunk makes compute-bound, and
        // each accepted draft saves a whole step). While prompts wait, drafts take at most half of
        // what the decode tokens leave, so that prompts still advance in small budgets.
        let mut budget = self.step_tokens;
        // A sequence's pending tokens (up to its next snapshot point) from the budget.
        let take = |s: &Sequence, budget: &mut usize| {
            let t = s.pending().min(*budget).min(s.chunk_cap());
            *budget -= t;
            t
        };
        let mut counts = vec![0; self.running.len()];
        for (s, count) in self.running.iter().zip(&mut counts) {
            if s.decoding() {
                *count = take(s, &mut budget);
            }
        }
        let prompts_wait = !self.waiting.is_empty() || self.running.iter().any(|s| !s.decoding());
        let mut draft_budget = if prompts_wait { budget / 2 } else { budget };
        for (s, count) in self.running.iter_mut().zip(&mut counts) {
            // Only decoding sequences have drafts, and one that got no token left no budget.
            // (Nor past a snapshot point: the state there is kept from a plain chunk's end.)
            let drafts = s.drafts.len().min(draft_budget).min(s.chunk_cap() - *count);
            s.drafts.truncate(drafts);
            s.verify &= drafts > 0;
            *count += drafts;
            budget -= drafts;
            draft_budget -= drafts;
        }
        for (s, count) in self.running.iter().zip(&mut counts) {
            if !s.decoding() {
                *count = take(s, &mut budget);
            }
        }
        let mut plan = Vec::new();
        let mut i = 0;
        while i < self.running.len() {
            let tokens = counts[i];
            if tokens == 0 {
                i += 1;
                continue;
            }
            let s = &mut self.running[i];
            let needed = s.computed + tokens;
            let prefix = self.prefix.as_mut();
            match reserve_evicting(&mut s.table, needed, &mut self.blocks, &mut self.slots, prefix) {
                Ok(()) => {
                    plan.push(Scheduled { index: i, tokens });
                    i += 1;
                }
                // Drafts past what the pool holds are dropped (the last first) before anyone
                // is preempted: they only speed the sequence up, and a sequence ended or
                // preempted for them would give less, or later, than it gives alone.
                Err(Error::Exhausted { .. }) if !self.running[i].drafts.is_empty() => {
                    let s = &mut self.running[i];
                    s.drafts.pop();
                    s.verify &= !s.drafts.is_empty();
                    counts[i] -= 1;
                    budget += 1;
                }
                Err(Error::Exhausted { .. }) => {
                    // Preempt the last in order (possibly this one) and try again.
                    let newest = self.running.len() - 1;
                    let mut victim = self.running.remove(newest);
                    budget += counts.remove(newest);
                    // Its rolling snapshot lets it (or another) restart past its prompt.
                    let kept = self.keep_leaving(&mut victim);
                    let released = victim.release(&mut self.slots, &mut self.blocks);
                    if newest == 0 {
                        // Alone and still too long: the whole pool is its context.
                        self.ended.push((victim, StopReason::ContextFull));
                    } else {
                        victim.preemptions += 1;
                        self.wait(victim);
                    }
                    kept.and(released)?;
                }
                Err(e) => return Err(e),
            }
        }
        // Admit waiting sequences in order while a slot, blocks and the budget allow.
        while budget > 0 && self.running.len() < self.max_running {
            if self.waiting.is_empty() || (self.slots.free() == 0 && !self.evict(0, 1)?) {
                break;
            }
            let hit = self.restore_front()?;
            let s = self.waiting.front_mut().expect("a front");
            let tokens = s.pending().min(budget).min(s.chunk_cap());
            let (table, prefix) = (&mut s.table, self.prefix.as_mut());
            let reserved = reserve_evicting(
                table,
                s.computed + tokens,
                &mut self.blocks,
                &mut self.slots,
                prefix,
            );
            if reserved.is_err() {
                self.abandon_front(hit)?;
                if self.running.is_empty() {
                    let s = self.waiting.pop_front().expect("a front");
                    self.ended.push((s, StopReason::ContextFull));
                    continue;
                }
                break;
            }
            // (A slot is free: checked above, so `alloc` fails only on a bookkeeping bug.)
            let slot = match self.slots.alloc() {
                Ok(slot) => slot,
                Err(e) => {
                    let _ = self.abandon_front(hit);
                    return Err(e);
                }
            };
            let mut s = self.waiting.pop_front().expect("a front");
            s.slot = Some(slot);
            if let Some(prefix) = self.prefix.as_mut() {
                prefix.record(s.len(), s.cached);
            }
            if let Some(snapshot) = hit {
                self.restores.push((snapshot, slot));
            }
            self.running.push(s);
            plan.push(Scheduled {
                index: self.running.len() - 1,
                tokens,
            });
            budget -= tokens;
        }
        Ok(plan)
    }

    /// Frees what the front waiting sequence holds and its prefix hit's snapshot `hit` (it stays
    /// in the queue): all of it, the first error returned.
    fn abandon_front(&mut self, hit: Option<SlotId>) -> Result<()> {
        let s = self.waiting.front_mut().expect("a front");
        let released = s.release(&mut self.slots, &mut self.blocks);
        let snapshot = hit.map_or(Ok(()), |h| self.slots.release(h).map(|_| ()));
        released.and(snapshot)
    }

    /// With the prefix cache on, starts the front waiting sequence from its longest cached
    /// prefix (its blocks shared, `computed` past it; the snapshot to restore is returned,
    /// retained) and sets its snapshot points. An MTP-drafting sequence hits only blocks whose
    /// MTP K/V is written with its own next tokens; its MTP pairs then start past the hit.
    fn restore_front(&mut self) -> Result<Option<SlotId>> {
        let (Some(prefix), Some(s)) = (self.prefix.as_mut(), self.waiting.front_mut()) else {
            return Ok(None);
        };
        let tokens = s.tokens(0, s.len());
        let mut snapshot = None;
        s.cached = 0;
        let mtp = s.drafts_with_mtp();
        // Positions whose prompt log-probabilities are still to read must run: a hit ends at the
        // first of them.
        let usable = s.prompt_rows_left().map_or(tokens.len(), |r| r.start + 1);
        if let Some(hit) = prefix.lookup(&tokens[..usable], mtp, &mut self.blocks, &mut self.slots)? {
            s.table = BlockTable::shared(hit.blocks);
            s.computed = hit.positions;
            s.cached = hit.positions;
            if mtp {
                s.mtp_len = hit.positions;
            }
            snapshot = Some(hit.snapshot);
        }
        let bs = self.blocks.block_size();
        let branch = prefix.cached_positions(&tokens);
        let end = tokens.len() / bs * bs;
        s.snap_points = [branch, end].into_iter().filter(|&p| p > s.computed).collect();
        s.snap_points.sort_unstable();
        s.snap_points.dedup();
        Ok(snapshot)
    }

    /// Hands what a leaving sequence keeps to the prefix cache: its rolling snapshot with the
    /// blocks before it (when it finishes: the next turn of its conversation starts there; when
    /// preempted: it restarts there), and an MTP-drafting sequence's blocks up to all it kept
    /// (they carry the MTP K/V its pairs wrote, which cached blocks may lack).
    pub fn keep_leaving(&mut self, s: &mut Sequence) -> Result<()> {
        let Some(prefix) = self.prefix.as_mut() else {
            return Ok(());
        };
        let rolling = s.rolling.take();
        let mtp_fed = if s.drafts_with_mtp() { s.mtp_len } else { 0 };
        let upto = rolling.map_or(0, |r| r.1).max(s.kept.min(mtp_fed));
        if upto == 0 {
            return Ok(());
        }
        let tokens = s.tokens(0, s.len());
        prefix.insert(&tokens, upto, &s.table, &mut self.blocks, mtp_fed)?;
        if let Some((slot, at)) = rolling {
            prefix.insert_snapshot(&tokens, at, slot, &mut self.slots)?;
        }
        Ok(())
    }

    /// Frees cached entries only the cache holds until `blocks` blocks and `slots` slots are
    /// free; false when the cache freed nothing.
    pub fn evict(&mut self, blocks: usize, slots: usize) -> Result<bool> {
        let Some(prefix) = self.prefix.as_mut() else {
            return Ok(false);
        };
        Ok(prefix.evict(blocks, slots, &mut self.blocks, &mut self.slots)? > 0)
    }

    /// Queues `s` in order (a preempted sequence goes before younger ones of its priority).
    pub fn wait(&mut self, s: Sequence) {
        let at = self.waiting.partition_point(|w| w.order() < s.order());
        self.waiting.insert(at, s);
    }
}
