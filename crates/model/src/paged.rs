//! Pooled caches and flat batches for serving many sequences at once.
//!
//! A [`PagedCache`] holds every GDN layer's state for a fixed set of sequence slots and every
//! attention layer's keys and values in fixed-size blocks of positions; a sequence owns a slot
//! and a list of blocks (its block table), which the engine hands out. A [`ForwardBatch`] lists,
//! per sequence, the new tokens of one forward (a prefill chunk, a decode token, or the tokens a
//! speculative verify checks); [`crate::Qwen36Model::forward_batch`] runs them all in one pass.

use std::ops::Range;

use candle_core::{DType, Tensor};
use qwen36_gdn::{GatedDeltaNet, PoolStash};

use crate::attention::{AttnPart, PagedSeq};
use crate::{Error, Result};

/// The tokens per slot a pool's stashes hold once a verify of `verify` tokens has run: a few
/// more than asked (at least 4, a power of two), since a stash that grows re-records graphs.
pub fn stash_tokens(verify: usize) -> usize {
    verify.next_power_of_two().max(4)
}

/// What one layer keeps for every sequence of the pool.
#[derive(Debug, Clone)]
pub(crate) enum PagedLayer {
    /// GDN layer: conv windows `[slots, conv_dim, K-1]` (activation dtype) and recurrent
    /// states `[slots, Hv, dk, dv]` f32, one row per sequence slot; once a verify has run, the
    /// stashes of its deferred commits (conv, delta rule: `[slots, tokens, ...]`); the layer
    /// itself, which applies them.
    Gdn {
        conv: Tensor,
        recurrent: Tensor,
        stash: Option<(Tensor, Tensor)>,
        layer: Box<GatedDeltaNet>,
    },
    /// Attention layer: keys and values `[blocks · block_size, kv_heads, head_dim]`; position
    /// `j` of block `b` is row `b · block_size + j`.
    Attention { k: Tensor, v: Tensor },
}

/// The pools of the whole model: GDN state per slot, paged K/V per block. Made by
/// [`crate::Qwen36Model::new_paged_cache`]; written in place by each forward.
///
/// Commits are deferred: a verify leaves each slot's GDN state as it was before the verified
/// tokens and stashes them; [`Self::commit`] only records how many were accepted, and the next
/// forward over the slot applies them first (bit for bit as they ran), so no per-token state is
/// kept. A slot's state is thus its rows plus what it has yet to replay; [`Self::copy_slot`]
/// copies both, [`Self::slot_state`] applies them first.
#[derive(Debug)]
pub struct PagedCache {
    pub(crate) layers: Vec<PagedLayer>,
    pub(crate) slots: usize,
    pub(crate) blocks: usize,
    pub(crate) block_size: usize,
    /// Per slot: the stashed tokens the next pass applies first (its accepted ones, at most
    /// what its last verify stashed).
    pub(crate) replay: Vec<u32>,
    /// Per slot: a count of the changes to its state other than commits (passes over it,
    /// settles, copies into it, clears), which a [`BatchPending`] records after its pass: a
    /// commit from a pass the slot has moved on from would replay other tokens.
    pub(crate) epoch: Vec<u64>,
    /// This pool among the process's pools (a pending is committed to the pool it came from).
    id: u64,
    /// The activation dtype (the stashes' inputs).
    dtype: DType,
    /// Tests only: the fault of the model that made it.
    #[cfg(feature = "fault-injection")]
    pub(crate) fault: Option<crate::Fault>,
}

impl PagedCache {
    /// Sequence slots (GDN states).
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// KV blocks.
    pub fn blocks(&self) -> usize {
        self.blocks
    }

    /// Positions per KV block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Bytes of one slot's GDN state (every layer's conv window and recurrent state, and the
    /// stash of its deferred commits once a verify has made one).
    pub fn slot_bytes(&self) -> u64 {
        let row = |t: &Tensor| (t.elem_count() / self.slots.max(1) * t.dtype().size_in_bytes()) as u64;
        self.layers
            .iter()
            .map(|l| match l {
                PagedLayer::Gdn {
                    conv,
                    recurrent,
                    stash,
                    ..
                } => row(conv) + row(recurrent) + stash.as_ref().map_or(0, |(c, r)| row(c) + row(r)),
                PagedLayer::Attention { .. } => 0,
            })
            .sum()
    }

    /// Zeroes slot `slot`'s GDN state in every layer (a sequence starting there sees nothing of
    /// the one before), with nothing left to replay.
    pub fn clear_slot(&mut self, slot: u32) -> Result<()> {
        self.check_slot(slot)?;
        // (Its stash is read only as far as it is to replay: nothing now.)
        for (pool, _) in self.slot_rows().filter(|(_, stash)| !stash) {
            let row = pool.narrow(0, 0, 1)?.zeros_like()?;
            pool.slice_set(&row, 0, slot as usize)?;
        }
        self.forget(slot);
        Ok(())
    }

    /// Tests only: zeroes nothing but forgets what slot `slot` had to replay (a slot not cleared).
    #[cfg(feature = "fault-injection")]
    pub(crate) fn forget_only(&mut self, slot: u32) {
        self.forget(slot);
    }

    /// The slot has nothing to replay, and its state has changed (no pending commit of it
    /// holds).
    fn forget(&mut self, slot: u32) {
        self.replay[slot as usize] = 0;
        self.epoch[slot as usize] += 1;
    }

    /// Every pool of the GDN layers that holds a row per slot (windows, states, their stashes),
    /// with whether it is a stash.
    fn slot_rows(&self) -> impl Iterator<Item = (&Tensor, bool)> {
        self.layers.iter().flat_map(|l| match l {
            PagedLayer::Gdn {
                conv,
                recurrent,
                stash,
                ..
            } => {
                let mut v = vec![(conv, false), (recurrent, false)];
                if let Some((c, r)) = stash {
                    v.extend([(c, true), (r, true)]);
                }
                v
            }
            PagedLayer::Attention { .. } => Vec::new(),
        })
    }

    /// Copies slot `src`'s GDN state into slot `dst`: every layer's conv window and recurrent
    /// state, and what it has yet to replay (a prefix-cache snapshot taken from a sequence, or
    /// restored into one).
    pub fn copy_slot(&mut self, src: u32, dst: u32) -> Result<()> {
        self.check_slot(src)?;
        self.check_slot(dst)?;
        if src == dst {
            return Ok(());
        }
        let pending = self.replay[src as usize] > 0;
        for (pool, stash) in self.slot_rows() {
            // A stash matters only while something is left to replay from it.
            if stash && !pending {
                continue;
            }
            let row = pool.narrow(0, src as usize, 1)?.copy()?;
            pool.slice_set(&row, 0, dst as usize)?;
        }
        self.replay[dst as usize] = self.replay[src as usize];
        self.epoch[dst as usize] += 1;
        Ok(())
    }

    /// Slot `slot`'s state in GDN layer `layer` (counting all layers), its deferred commits
    /// applied first: the conv window `[conv_dim, K-1]` and the recurrent state `[Hv, dk, dv]`
    /// (copies). `None` for an attention layer.
    pub fn slot_state(&mut self, layer: usize, slot: u32) -> Result<Option<(Tensor, Tensor)>> {
        self.check_slot(slot)?;
        self.settle(&[slot])?;
        Ok(match self.layers.get(layer) {
            Some(PagedLayer::Gdn { conv, recurrent, .. }) => {
                let row = |t: &Tensor| t.get(slot as usize).and_then(|r| r.copy());
                Some((row(conv)?, row(recurrent)?))
            }
            Some(PagedLayer::Attention { .. }) => None,
            None => return Err(Error::Cache(format!("no layer {layer}"))),
        })
    }

    /// Applies the deferred commits of `slots` now (the replay a next pass would run first),
    /// leaving them nothing to replay. A slot listed twice settles once.
    pub fn settle(&mut self, slots: &[u32]) -> Result<()> {
        let mut due: Vec<u32> = slots
            .iter()
            .copied()
            .filter(|&s| self.replay.get(s as usize).is_some_and(|&r| r > 0))
            .collect();
        // Each slot once: the CUDA kernels would replay a repeated row twice, racing (the CPU
        // form refuses it).
        due.sort_unstable();
        due.dedup();
        if due.is_empty() {
            return Ok(());
        }
        let device = self.device()?;
        let counts: Vec<u32> = due.iter().map(|&s| self.replay[s as usize]).collect();
        let (slot_t, replay_t) = (
            Tensor::new(due.as_slice(), &device)?,
            Tensor::new(counts.as_slice(), &device)?,
        );
        for l in &self.layers {
            if let PagedLayer::Gdn {
                conv,
                recurrent,
                stash: Some((cs, rs)),
                layer,
            } = l
            {
                let stash = PoolStash {
                    conv: cs,
                    recurrent: rs,
                    replay: &replay_t,
                };
                layer.replay_pooled((conv, recurrent, &slot_t), &stash)?;
            }
        }
        for s in due {
            self.forget(s);
        }
        Ok(())
    }

    /// Makes room in the stashes for verifies of `tokens` tokens (grown once for all slots,
    /// keeping what they hold): the stashes' tensors change, so graphs recorded over the old
    /// ones must be recorded again.
    pub(crate) fn reserve_stash(&mut self, tokens: usize) -> Result<()> {
        let dtype = self.dtype;
        for l in &mut self.layers {
            let PagedLayer::Gdn {
                conv,
                recurrent,
                stash,
                layer,
            } = l
            else {
                continue;
            };
            let held = stash.as_ref().map_or(0, |(c, _)| c.dim(1).unwrap_or(0));
            if held >= tokens {
                continue;
            }
            let (c, r) = layer.new_pool_stash(conv, recurrent, tokens, dtype)?;
            if let Some((oc, or)) = stash.as_ref() {
                c.slice_set(oc, 1, 0)?;
                r.slice_set(or, 1, 0)?;
            }
            *stash = Some((c, r));
        }
        Ok(())
    }

    /// The stashes' size in tokens per slot (0 before any verify).
    pub(crate) fn stash_tokens(&self) -> usize {
        self.layers
            .iter()
            .find_map(|l| match l {
                PagedLayer::Gdn {
                    stash: Some((c, _)), ..
                } => c.dim(1).ok(),
                _ => None,
            })
            .unwrap_or(0)
    }

    /// After a forward that verified `chunk` (its [`SeqChunk::verify`]): keeps its first `keep`
    /// tokens, so that its slot's GDN states are exactly the state after them (applied by the
    /// next pass over the slot, or [`Self::settle`]). Its K/V past them stay in the blocks,
    /// unread, until later tokens overwrite them: the caller shortens the sequence.
    pub fn commit(&mut self, pending: &BatchPending, chunk: usize, keep: usize) -> Result<()> {
        self.commit_many(pending, &[(chunk, keep)])
    }

    /// [`Self::commit`] for several verified chunks at once, `(chunk, keep)` each (distinct
    /// chunks).
    pub fn commit_many(&mut self, pending: &BatchPending, keeps: &[(usize, usize)]) -> Result<()> {
        let into: Vec<(usize, usize, u32)> = keeps
            .iter()
            .map(|&(chunk, keep)| {
                Ok((
                    chunk,
                    keep,
                    *pending.slots.get(chunk).ok_or_else(|| no_chunk(chunk))?,
                ))
            })
            .collect::<Result<_>>()?;
        #[cfg(feature = "fault-injection")]
        let into = self.faulty_keeps(pending, into)?;
        self.commit_into(pending, &into)?;
        #[cfg(feature = "fault-injection")]
        if self.fault == Some(crate::Fault::Bf16State) {
            for &(_, _, slot) in &into {
                self.round_slot_to_bf16(slot)?;
            }
        }
        Ok(())
    }

    /// Tests only: the keeps of a wrong rollback (one token more than asked, within the chunk).
    #[cfg(feature = "fault-injection")]
    fn faulty_keeps(
        &self,
        pending: &BatchPending,
        into: Vec<(usize, usize, u32)>,
    ) -> Result<Vec<(usize, usize, u32)>> {
        if self.fault != Some(crate::Fault::WrongRollback) {
            return Ok(into);
        }
        into.into_iter()
            .map(|(chunk, keep, slot)| Ok((chunk, (keep + 1).min(pending.chunk_len(chunk)?), slot)))
            .collect()
    }

    /// Tests only: slot `slot`'s GDN state (settled) in every layer, as a pool of one slot.
    #[cfg(feature = "fault-injection")]
    pub(crate) fn slot_copy(&mut self, slot: u32) -> Result<PagedCache> {
        self.check_slot(slot)?;
        self.settle(&[slot])?;
        let layers = self
            .layers
            .iter()
            .map(|l| {
                Ok(match l {
                    PagedLayer::Gdn {
                        conv,
                        recurrent,
                        layer,
                        ..
                    } => PagedLayer::Gdn {
                        conv: conv.narrow(0, slot as usize, 1)?.copy()?,
                        recurrent: recurrent.narrow(0, slot as usize, 1)?.copy()?,
                        stash: None,
                        layer: layer.clone(),
                    },
                    PagedLayer::Attention { k, v } => PagedLayer::Attention {
                        k: k.clone(),
                        v: v.clone(),
                    },
                })
            })
            .collect::<Result<_>>()?;
        Ok(PagedCache {
            layers,
            slots: 1,
            blocks: self.blocks,
            block_size: self.block_size,
            replay: vec![0],
            epoch: vec![0],
            id: next_pool_id(),
            dtype: self.dtype,
            fault: None,
        })
    }

    /// Tests only: writes `old` (a [`Self::slot_copy`]) back into slot `slot`, with nothing to
    /// replay.
    #[cfg(feature = "fault-injection")]
    pub(crate) fn restore_slot(&mut self, slot: u32, old: &PagedCache) -> Result<()> {
        for (layer, old) in self.layers.iter().zip(&old.layers) {
            if let (
                PagedLayer::Gdn { conv, recurrent, .. },
                PagedLayer::Gdn {
                    conv: c,
                    recurrent: r,
                    ..
                },
            ) = (layer, old)
            {
                conv.slice_set(c, 0, slot as usize)?;
                recurrent.slice_set(r, 0, slot as usize)?;
            }
        }
        self.forget(slot);
        Ok(())
    }

    /// Tests only: rounds slot `slot`'s recurrent states to bf16 (a bf16 state).
    #[cfg(feature = "fault-injection")]
    pub(crate) fn round_slot_to_bf16(&mut self, slot: u32) -> Result<()> {
        for layer in &self.layers {
            if let PagedLayer::Gdn { recurrent, .. } = layer {
                let row = recurrent.narrow(0, slot as usize, 1)?;
                let rounded = row.to_dtype(DType::BF16)?.to_dtype(DType::F32)?;
                recurrent.slice_set(&rounded, 0, slot as usize)?;
            }
        }
        Ok(())
    }

    /// Makes `slot` hold the GDN state after the first `keep` tokens of each verified `chunk`
    /// (`(chunk, keep, slot)` each, distinct slots): [`Self::commit_many`] when each slot is its
    /// chunk's own, a snapshot of a state the verify passed through when it is another (a copy
    /// of the chunk's slot, which still holds the state before the verify, with its stash). Run
    /// after the forward and before the next one over these slots.
    /// Every entry is checked before any is applied: an error changes nothing. A pending whose
    /// chunk's slot has changed since its pass (another pass over it, a settle of its commit, a
    /// copy into it, a clear) is refused.
    pub fn commit_into(&mut self, pending: &BatchPending, keeps: &[(usize, usize, u32)]) -> Result<()> {
        if pending.pool != self.id {
            return Err(Error::Cache(
                "a verify's pending commits only to the pool its pass ran over".into(),
            ));
        }
        for &(chunk, keep, slot) in keeps {
            let len = pending.chunk_len(chunk)?;
            self.check_slot(slot)?;
            let own = pending.slots[chunk];
            self.check_slot(own)?;
            if self.epoch[own as usize] != pending.epochs[chunk] {
                return Err(Error::Cache(format!(
                    "chunk {chunk}'s verify is stale: slot {own} has changed since (a later pass, \
                     a settle of its commit, a copy into it or a clear), so its stash holds other tokens"
                )));
            }
            // Another chunk's slot would lose its own state (and a later entry could copy it on
            // as that chunk's).
            if slot != own && pending.slots.contains(&slot) {
                return Err(Error::Cache(format!(
                    "chunk {chunk}'s state cannot go into slot {slot}, which another chunk of the pass runs on"
                )));
            }
            if keep == 0 || keep > len {
                return Err(Error::Cache(format!(
                    "cannot keep {keep} of chunk {chunk}'s {len} verified tokens (need 1..={len})"
                )));
            }
        }
        for &(chunk, keep, slot) in keeps {
            let own = pending.slots[chunk];
            if own != slot {
                // The chunk's own slot may have its keep recorded already: copy what the verify
                // left (its state before the verify and its stash), then the keep.
                let recorded = self.replay[own as usize];
                self.replay[own as usize] = keep as u32;
                let copied = self.copy_slot(own, slot);
                self.replay[own as usize] = recorded;
                copied?;
            }
            self.replay[slot as usize] = keep as u32;
        }
        Ok(())
    }

    /// Before a forward of `batch`: its slots' states are about to change (a pass that fails
    /// midway leaves them changed too), so no earlier pending holds for them.
    pub(crate) fn passing(&mut self, batch: &ForwardBatch) {
        for c in &batch.chunks {
            self.epoch[c.slot as usize] += 1;
        }
    }

    /// After a forward of `batch`: what each chunk replayed is spent (a verify's slot holds its
    /// tokens in the stash, none accepted until its commit).
    /// (Their epochs moved in [`Self::passing`].)
    pub(crate) fn passed(&mut self, batch: &ForwardBatch) {
        for c in &batch.chunks {
            self.replay[c.slot as usize] = 0;
        }
    }

    fn check_slot(&self, slot: u32) -> Result<()> {
        if slot as usize >= self.slots {
            return Err(Error::Cache(format!(
                "slot {slot} is outside the pool of {} slots",
                self.slots
            )));
        }
        Ok(())
    }

    /// The pool row of each position in `positions` of a sequence with block table `blocks`.
    pub(crate) fn position_rows(&self, blocks: &[u32], positions: Range<usize>) -> Vec<u32> {
        let bs = self.block_size;
        positions
            .map(|p| blocks[p / bs] * bs as u32 + (p % bs) as u32)
            .collect()
    }
}

/// A new pool's [`PagedCache::id`].
fn next_pool_id() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

fn no_chunk(chunk: usize) -> Error {
    Error::Cache(format!("chunk {chunk} was not verified in this batch"))
}

/// One sequence's new tokens in a [`ForwardBatch`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeqChunk {
    /// The sequence's GDN state slot.
    pub slot: u32,
    /// Tokens the sequence has already run (the position of the first new token); 0 starts the
    /// sequence from a zero state, whatever the slot held.
    pub start: usize,
    /// The new tokens (at least one).
    pub tokens: Vec<u32>,
    /// The sequence's KV blocks, covering at least `start + tokens.len()` positions.
    pub blocks: Vec<u32>,
    /// A speculative verify: the tokens run one by one like decode steps and the GDN pools stash
    /// them, so that [`PagedCache::commit`] keeps any prefix (replayed on the slot's next pass).
    pub verify: bool,
}

/// Where a chunk's tokens sit among the rows its sequence takes in a padded flat step (a
/// recorded graph's shape: every sequence as many rows). Padding rows take token 0 and write no
/// K/V; their outputs are never read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) enum Padding {
    /// The tokens first, padding at the positions after them, which no token of the chunk
    /// attends (causal). A verify's GDN state stays as it was before its tokens (deferred
    /// commits), and at most its own tokens are ever accepted, so its padding leaves nothing.
    After,
    /// The tokens last, padding at the positions just before the chunk's start (written
    /// already), so each sequence's last row is its last token's. For layers without GDN state
    /// only (MTP draft steps), which padding tokens would advance.
    Before,
}

/// The sequences of one forward, in groups that run their GDN conv and delta rule together
/// (equal token counts and mode: every decode token of a step is one group). Rows of the
/// output follow the groups; [`Self::rows`] says where each chunk's are.
#[derive(Debug, Clone)]
pub struct ForwardBatch {
    pub(crate) chunks: Vec<SeqChunk>,
    /// Chunk indices per group, in row order.
    pub(crate) groups: Vec<Vec<usize>>,
    /// The first row of each chunk.
    first_row: Vec<usize>,
    rows: usize,
}

impl ForwardBatch {
    /// Groups `chunks` (in their order of first appearance by token count and mode).
    pub fn new(chunks: Vec<SeqChunk>) -> Self {
        let mut keys: Vec<(usize, bool)> = Vec::new();
        let mut groups: Vec<Vec<usize>> = Vec::new();
        for (i, c) in chunks.iter().enumerate() {
            let key = (c.tokens.len(), c.verify);
            match keys.iter().position(|k| *k == key) {
                Some(g) => groups[g].push(i),
                None => {
                    keys.push(key);
                    groups.push(vec![i]);
                }
            }
        }
        let mut first_row = vec![0; chunks.len()];
        let mut rows = 0;
        for &i in groups.iter().flatten() {
            first_row[i] = rows;
            rows += chunks[i].tokens.len();
        }
        Self {
            chunks,
            groups,
            first_row,
            rows,
        }
    }

    /// Rows `[batch rows, ...]` in this batch's row order laid out for a padded step of `seqs`
    /// sequences of `len` rows (chunk `i`'s at [`Self::padded_row`]); padding rows repeat a
    /// row of their chunk (or row 0), which nothing reads.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn padded(&self, x: &Tensor, seqs: usize, len: usize, padding: Padding) -> Result<Tensor> {
        let mut from = vec![0u32; seqs * len];
        for i in 0..self.chunks.len() {
            let rows = self.rows(i);
            from[i * len..(i + 1) * len].fill(rows.start as u32);
            for (j, r) in rows.enumerate() {
                from[self.padded_row(i, j, len, padding)] = r as u32;
            }
        }
        if from.iter().enumerate().all(|(p, &r)| p == r as usize) && from.len() == x.dim(0)? {
            // A copy all the same: a recorded graph keeps its input buffer, never the caller's.
            return Ok(x.copy()?);
        }
        Ok(x.index_select(&Tensor::new(from.as_slice(), x.device())?, 0)?)
    }

    /// This batch's rows, in its row order, of a padded step's output `[seqs · len, ...]`.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn unpadded(&self, out: &Tensor, len: usize, padding: Padding) -> Result<Tensor> {
        let mut at = vec![0u32; self.rows];
        for i in 0..self.chunks.len() {
            for (j, r) in self.rows(i).enumerate() {
                at[r] = self.padded_row(i, j, len, padding) as u32;
            }
        }
        if at.iter().enumerate().all(|(r, &p)| p as usize == r) {
            return Ok(out.narrow(0, 0, at.len())?);
        }
        Ok(out.index_select(&Tensor::new(at.as_slice(), out.device())?, 0)?)
    }

    /// The row of chunk `i`'s token `j` when every sequence takes `len` rows in chunk order
    /// (a recorded step's padded layout; `len` at least the chunk's tokens).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn padded_row(&self, i: usize, j: usize, len: usize, padding: Padding) -> usize {
        let pad = len - self.chunks[i].tokens.len();
        i * len + j + if padding == Padding::Before { pad } else { 0 }
    }

    /// The position of chunk `i`'s first padded row: its start, or with [`Padding::Before`] as
    /// many positions earlier as rows pad it (`None` when that would be before position 0, or
    /// when the chunk has more tokens than `len` rows).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn padded_start(&self, i: usize, len: usize, padding: Padding) -> Option<usize> {
        let c = &self.chunks[i];
        let pad = len.checked_sub(c.tokens.len())?;
        match padding {
            Padding::After => Some(c.start),
            Padding::Before => c.start.checked_sub(pad),
        }
    }

    /// The chunks, in the order given.
    pub fn chunks(&self) -> &[SeqChunk] {
        &self.chunks
    }

    /// Rows of the output that hold chunk `i`'s tokens, in token order.
    pub fn rows(&self, i: usize) -> Range<usize> {
        let r = self.first_row[i];
        r..r + self.chunks[i].tokens.len()
    }

    /// Rows (tokens) in the batch.
    pub fn total_rows(&self) -> usize {
        self.rows
    }

    /// The chunk indices in row order.
    pub(crate) fn row_order(&self) -> impl Iterator<Item = usize> + '_ {
        self.groups.iter().flatten().copied()
    }

    /// Checks the batch against the pools and the model's vocabulary and context.
    pub(crate) fn check(&self, cache: &PagedCache, vocab: usize, max_positions: usize) -> Result<()> {
        if self.chunks.is_empty() {
            return Err(Error::Input("an empty batch".into()));
        }
        let mut slots = std::collections::HashSet::new();
        for (i, c) in self.chunks.iter().enumerate() {
            let Some(end) = c.start.checked_add(c.tokens.len()) else {
                return Err(Error::Input(format!(
                    "chunk {i}: start {} is past any position",
                    c.start
                )));
            };
            if c.tokens.is_empty() {
                return Err(Error::Input(format!("chunk {i} has no tokens")));
            }
            if let Some(&id) = c.tokens.iter().find(|&&id| id as usize >= vocab) {
                return Err(Error::Input(format!(
                    "chunk {i}: token id {id} is outside the vocabulary of {vocab}"
                )));
            }
            if end > max_positions {
                return Err(Error::ContextOverflow {
                    needed: end,
                    max: max_positions,
                });
            }
            cache.check_slot(c.slot)?;
            if !slots.insert(c.slot) {
                return Err(Error::Cache(format!(
                    "slot {} is used twice in one batch",
                    c.slot
                )));
            }
            if c.blocks.len() * cache.block_size < end {
                return Err(Error::Cache(format!(
                    "chunk {i}: {} blocks of {} positions do not hold {end} positions",
                    c.blocks.len(),
                    cache.block_size
                )));
            }
            if let Some(&b) = c.blocks.iter().find(|&&b| b as usize >= cache.blocks) {
                return Err(Error::Cache(format!(
                    "chunk {i}: block {b} is outside the pool of {} blocks",
                    cache.blocks
                )));
            }
        }
        Ok(())
    }

    /// What the attention layers need, in row order: the pool row of every new token (u32
    /// `[rows]`) and the parts that attend: each group whose token count `decode` accepts as one
    /// paged decode launch (its block tables and lengths), every other chunk on its own (the
    /// pool rows of all its positions).
    pub(crate) fn attention_parts(
        &self,
        cache: &PagedCache,
        decode: impl Fn(usize) -> bool,
    ) -> Result<(Tensor, Vec<AttnPart>)> {
        let device = cache.device()?;
        let mut kv_rows: Vec<u32> = Vec::with_capacity(self.rows);
        let mut parts = Vec::new();
        for members in &self.groups {
            let t = self.chunks[members[0]].tokens.len();
            for &i in members {
                let c = &self.chunks[i];
                kv_rows.extend(cache.position_rows(&c.blocks, c.start..c.start + t));
                if !decode(t) {
                    let rows = cache.position_rows(&c.blocks, 0..c.start + t);
                    parts.push(AttnPart::Seq(PagedSeq {
                        start: c.start,
                        len: t,
                        rows: Tensor::new(rows.as_slice(), &device)?,
                    }));
                }
            }
            if decode(t) {
                let maxb = members
                    .iter()
                    .map(|&i| self.chunks[i].blocks.len())
                    .max()
                    .unwrap_or(0);
                let tables: Vec<u32> = members
                    .iter()
                    .flat_map(|&i| {
                        let b = &self.chunks[i].blocks;
                        (0..maxb).map(move |j| b.get(j).copied().unwrap_or(0))
                    })
                    .collect();
                let lens: Vec<u32> = members
                    .iter()
                    .map(|&i| (self.chunks[i].start + t) as u32)
                    .collect();
                parts.push(AttnPart::Decode {
                    batch: members.len(),
                    t,
                    tables: Tensor::from_vec(tables, (members.len(), maxb), &device)?,
                    lens: Tensor::new(lens.as_slice(), &device)?,
                    block_size: cache.block_size,
                });
            }
        }
        Ok((Tensor::new(kv_rows.as_slice(), &device)?, parts))
    }
}

impl ForwardBatch {
    /// What a forward of this batch over `cache` leaves for [`PagedCache::commit`]: each
    /// verified chunk's slot and token count, and the slots' states as the pass left them
    /// (`None` when no chunk verifies). Made after [`PagedCache::passed`].
    pub(crate) fn pending(&self, cache: &PagedCache) -> Option<BatchPending> {
        if !self.chunks.iter().any(|c| c.verify) {
            return None;
        }
        Some(BatchPending {
            verified: self
                .chunks
                .iter()
                .map(|c| c.verify.then_some(c.tokens.len()))
                .collect(),
            slots: self.chunks.iter().map(|c| c.slot).collect(),
            epochs: self.chunks.iter().map(|c| cache.epoch[c.slot as usize]).collect(),
            pool: cache.id,
        })
    }
}

/// What a forward with verifying chunks leaves for [`PagedCache::commit`]: per chunk, its
/// slot, when it verified its token count, and its slot's [`PagedCache`] epoch after the pass
/// (valid until the slot changes again).
#[derive(Debug, Clone)]
pub struct BatchPending {
    pub(crate) verified: Vec<Option<usize>>,
    pub(crate) slots: Vec<u32>,
    pub(crate) epochs: Vec<u64>,
    /// The [`PagedCache`] the pass ran over.
    pool: u64,
}

impl BatchPending {
    /// Tokens verified chunk `chunk` ran.
    fn chunk_len(&self, chunk: usize) -> Result<usize> {
        self.verified
            .get(chunk)
            .copied()
            .flatten()
            .ok_or_else(|| no_chunk(chunk))
    }
}

/// The result of [`crate::Qwen36Model::forward_batch`].
#[derive(Debug, Clone)]
pub struct BatchOutput {
    /// Final-norm hidden states `[rows, hidden]` (rows as [`ForwardBatch::rows`] gives them).
    pub hidden: Tensor,
    /// What the verified chunks leave to commit, when some chunk verified.
    pub pending: Option<BatchPending>,
}

impl PagedCache {
    fn device(&self) -> Result<candle_core::Device> {
        match self.layers.first() {
            Some(PagedLayer::Gdn { conv, .. }) => Ok(conv.device().clone()),
            Some(PagedLayer::Attention { k, .. }) => Ok(k.device().clone()),
            None => Err(Error::Cache("a cache of no layers".into())),
        }
    }

    /// A pool of `slots` GDN states and `blocks` KV blocks of `block_size` positions, zeroed.
    pub(crate) fn zeros(
        kinds: impl Iterator<Item = PoolShape>,
        (slots, blocks, block_size): (usize, usize, usize),
        dtype: DType,
        device: &candle_core::Device,
    ) -> Result<Self> {
        if slots == 0 || blocks == 0 || block_size == 0 {
            return Err(Error::Cache(format!(
                "a pool needs slots, blocks and positions per block; found {slots}, {blocks}, {block_size}"
            )));
        }
        let layers = kinds
            .map(|k| {
                Ok(match k {
                    PoolShape::Gdn {
                        conv,
                        recurrent,
                        layer,
                    } => PagedLayer::Gdn {
                        conv: Tensor::zeros([&[slots][..], &conv].concat(), dtype, device)?,
                        recurrent: Tensor::zeros([&[slots][..], &recurrent].concat(), DType::F32, device)?,
                        stash: None,
                        layer,
                    },
                    PoolShape::Attention { kv_heads, head_dim } => {
                        let shape = (blocks * block_size, kv_heads, head_dim);
                        PagedLayer::Attention {
                            k: Tensor::zeros(shape, dtype, device)?,
                            v: Tensor::zeros(shape, dtype, device)?,
                        }
                    }
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            layers,
            slots,
            blocks,
            block_size,
            replay: vec![0; slots],
            epoch: vec![0; slots],
            id: next_pool_id(),
            dtype,
            #[cfg(feature = "fault-injection")]
            fault: None,
        })
    }
}

/// The shape of one layer's pooled cache per slot or position.
pub(crate) enum PoolShape {
    /// A GDN layer's conv window `[conv_dim, K-1]` and recurrent state `[Hv, dk, dv]`, and the
    /// layer (which makes and applies the stashes of deferred commits).
    Gdn {
        conv: Vec<usize>,
        recurrent: Vec<usize>,
        layer: Box<GatedDeltaNet>,
    },
    /// An attention layer's K/V row `[kv_heads, head_dim]`.
    Attention { kv_heads: usize, head_dim: usize },
}

#[cfg(test)]
mod tests {
    use candle_core::Device;

    use super::*;

    /// A chunk may end exactly at the model's last position and not one past it; its token ids
    /// must be below the vocabulary (the last id in, the next out).
    #[test]
    fn a_chunk_reaches_the_last_position_and_the_last_id() -> Result<()> {
        let kv = PoolShape::Attention {
            kv_heads: 1,
            head_dim: 4,
        };
        let cache = PagedCache::zeros([kv].into_iter(), (1, 2, 4), DType::F32, &Device::Cpu)?;
        let (vocab, max_positions) = (10, 8);
        let batch = |start: usize, id: u32| {
            ForwardBatch::new(vec![SeqChunk {
                slot: 0,
                start,
                tokens: vec![id],
                blocks: vec![0, 1, 1],
                verify: false,
            }])
        };
        batch(7, 9).check(&cache, vocab, max_positions)?;
        assert!(matches!(
            batch(8, 9).check(&cache, vocab, max_positions),
            Err(Error::ContextOverflow { needed: 9, max: 8 })
        ));
        assert!(matches!(
            batch(7, 10).check(&cache, vocab, max_positions),
            Err(Error::Input(_))
        ));
        Ok(())
    }
}
