//! Pooled caches and flat batches for serving many sequences at once.
//!
//! A [`PagedCache`] holds every GDN layer's state for a fixed set of sequence slots and every
//! attention layer's keys and values in fixed-size blocks of positions; a sequence owns a slot
//! and a list of blocks (its block table), which the engine hands out. A [`ForwardBatch`] lists,
//! per sequence, the new tokens of one forward (a prefill chunk, a decode token, or the tokens a
//! speculative verify checks); [`crate::Qwen36Model::forward_batch`] runs them all in one pass.

use std::ops::Range;

use candle_core::{DType, Tensor};
use qwen36_gdn::VerifyCheckpoints;
use qwen36_kernels::copy::copy_rows;
use qwen36_kernels::KernelPolicy;

use crate::attention::{AttnPart, PagedSeq};
use crate::{Error, Result};

/// What one layer keeps for every sequence of the pool.
#[derive(Debug, Clone)]
pub(crate) enum PagedLayer {
    /// GDN layer: conv windows `[slots, conv_dim, K-1]` (activation dtype) and recurrent
    /// states `[slots, Hv, dk, dv]` f32, one row per sequence slot.
    Gdn { conv: Tensor, recurrent: Tensor },
    /// Attention layer: keys and values `[blocks · block_size, kv_heads, head_dim]`; position
    /// `j` of block `b` is row `b · block_size + j`.
    Attention { k: Tensor, v: Tensor },
}

/// The pools of the whole model: GDN state per slot, paged K/V per block. Made by
/// [`crate::Qwen36Model::new_paged_cache`]; written in place by each forward.
#[derive(Debug)]
pub struct PagedCache {
    pub(crate) layers: Vec<PagedLayer>,
    pub(crate) slots: usize,
    pub(crate) blocks: usize,
    pub(crate) block_size: usize,
    /// The kernel policy of its own launches (the commits' copies): the model's.
    policy: KernelPolicy,
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

    /// Bytes of one slot's GDN state (every layer's conv window and recurrent state).
    pub fn slot_bytes(&self) -> u64 {
        let row = |t: &Tensor| (t.elem_count() / self.slots.max(1) * t.dtype().size_in_bytes()) as u64;
        self.layers
            .iter()
            .map(|l| match l {
                PagedLayer::Gdn { conv, recurrent } => row(conv) + row(recurrent),
                PagedLayer::Attention { .. } => 0,
            })
            .sum()
    }

    /// Zeroes slot `slot`'s GDN state in every layer (a sequence starting there sees nothing of
    /// the one before).
    pub fn clear_slot(&mut self, slot: u32) -> Result<()> {
        self.check_slot(slot)?;
        for layer in &self.layers {
            if let PagedLayer::Gdn { conv, recurrent } = layer {
                for pool in [conv, recurrent] {
                    let row = pool.narrow(0, 0, 1)?.zeros_like()?;
                    pool.slice_set(&row, 0, slot as usize)?;
                }
            }
        }
        Ok(())
    }

    /// Copies slot `src`'s GDN state (every layer's conv window and recurrent state) into slot
    /// `dst`: a prefix-cache snapshot taken from a sequence, or restored into one.
    pub fn copy_slot(&mut self, src: u32, dst: u32) -> Result<()> {
        self.check_slot(src)?;
        self.check_slot(dst)?;
        if src == dst {
            return Ok(());
        }
        for layer in &self.layers {
            if let PagedLayer::Gdn { conv, recurrent } = layer {
                for pool in [conv, recurrent] {
                    let row = pool.narrow(0, src as usize, 1)?.copy()?;
                    pool.slice_set(&row, 0, dst as usize)?;
                }
            }
        }
        Ok(())
    }

    /// Slot `slot`'s state in GDN layer `layer` (counting all layers): the conv window
    /// `[conv_dim, K-1]` and the recurrent state `[Hv, dk, dv]` (copies). `None` for an
    /// attention layer.
    pub fn slot_state(&self, layer: usize, slot: u32) -> Result<Option<(Tensor, Tensor)>> {
        self.check_slot(slot)?;
        Ok(match self.layers.get(layer) {
            Some(PagedLayer::Gdn { conv, recurrent }) => {
                let row = |t: &Tensor| t.get(slot as usize).and_then(|r| r.copy());
                Some((row(conv)?, row(recurrent)?))
            }
            Some(PagedLayer::Attention { .. }) => None,
            None => return Err(Error::Cache(format!("no layer {layer}"))),
        })
    }

    /// After a forward that verified `chunk` (its [`SeqChunk::verify`]): keeps its first `keep`
    /// tokens, setting its slot's GDN states to exactly the state after them. Its K/V past them
    /// stay in the blocks, unread, until later tokens overwrite them: the caller shortens the
    /// sequence.
    pub fn commit(&mut self, pending: &BatchPending, chunk: usize, keep: usize) -> Result<()> {
        self.commit_many(pending, &[(chunk, keep)])
    }

    /// [`Self::commit`] for several verified chunks at once, `(chunk, keep)` each (distinct
    /// chunks): one copy per GDN layer, pool and verify group for all of them.
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
            .map(|(chunk, keep, slot)| {
                let (group, _) = pending.member(chunk)?;
                Ok((chunk, (keep + 1).min(pending.group_len(group)?), slot))
            })
            .collect()
    }

    /// Tests only: slot `slot`'s GDN state in every layer, as a pool of one slot.
    #[cfg(feature = "fault-injection")]
    pub(crate) fn slot_copy(&self, slot: u32) -> Result<PagedCache> {
        self.check_slot(slot)?;
        let layers = self
            .layers
            .iter()
            .map(|l| {
                Ok(match l {
                    PagedLayer::Gdn { conv, recurrent } => PagedLayer::Gdn {
                        conv: conv.narrow(0, slot as usize, 1)?.copy()?,
                        recurrent: recurrent.narrow(0, slot as usize, 1)?.copy()?,
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
            policy: self.policy,
            fault: None,
        })
    }

    /// Tests only: writes `old` (a [`Self::slot_copy`]) back into slot `slot`.
    #[cfg(feature = "fault-injection")]
    pub(crate) fn restore_slot(&mut self, slot: u32, old: &PagedCache) -> Result<()> {
        for (layer, old) in self.layers.iter().zip(&old.layers) {
            if let (
                PagedLayer::Gdn { conv, recurrent },
                PagedLayer::Gdn {
                    conv: c,
                    recurrent: r,
                },
            ) = (layer, old)
            {
                conv.slice_set(c, 0, slot as usize)?;
                recurrent.slice_set(r, 0, slot as usize)?;
            }
        }
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

    /// Writes the GDN state after the first `keep` tokens of each verified `chunk` into `slot`
    /// (`(chunk, keep, slot)` each, distinct slots): [`Self::commit_many`] when each slot is its
    /// chunk's own, a snapshot of a state the verify passed through when it is another.
    pub fn commit_into(&mut self, pending: &BatchPending, keeps: &[(usize, usize, u32)]) -> Result<()> {
        // Per verify group: each kept chunk's slot, its member index, its row of the group's
        // per-token states (member · len + keep - 1) and its window's first column (keep).
        let mut groups: Vec<(usize, [Vec<u32>; 4])> = Vec::new();
        for &(chunk, keep, slot) in keeps {
            let (group, member) = pending.member(chunk)?;
            self.check_slot(slot)?;
            let len = pending.group_len(group)?;
            if keep == 0 || keep > len {
                return Err(Error::Cache(format!(
                    "cannot keep {keep} of chunk {chunk}'s {len} verified tokens (need 1..={len})"
                )));
            }
            let at = match groups.iter().position(|g| g.0 == group) {
                Some(at) => at,
                None => {
                    groups.push((group, Default::default()));
                    groups.len() - 1
                }
            };
            let [slots, members, rows, cols] = &mut groups[at].1;
            slots.push(slot);
            members.push(member as u32);
            rows.push((member * len + keep - 1) as u32);
            cols.push(keep as u32);
        }
        let device = self.device()?;
        let groups = groups
            .into_iter()
            .map(|(group, lists)| {
                let [s, m, r, c] = lists.map(|v| Tensor::new(v.as_slice(), &device));
                Ok((group, s?, m?, r?, c?))
            })
            .collect::<Result<Vec<_>>>()?;
        for (layer, cps) in self.layers.iter().zip(&pending.layers) {
            let (PagedLayer::Gdn { conv, recurrent }, Some(cps)) = (layer, cps) else {
                continue;
            };
            for (group, slots, members, rows, cols) in &groups {
                let cp = cps
                    .get(*group)
                    .and_then(Option::as_ref)
                    .ok_or_else(|| Error::Cache("a verify group without checkpoints".into()))?;
                // [members, len, Hv, dk, dv] as rows [members · len, Hv, dk, dv].
                let (b, t, hv, dk, dv) = cp.states().dims5()?;
                let states = cp.states().reshape((b * t, hv, dk, dv))?;
                copy_rows(recurrent, &states, slots, rows, None, &self.policy)?;
                copy_rows(conv, cp.window(), slots, members, Some(cols), &self.policy)?;
            }
        }
        Ok(())
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
    /// Keep the GDN state after every new token (a speculative verify), for
    /// [`PagedCache::commit`]; the tokens then run one by one like decode steps.
    pub verify: bool,
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
            let end = c.start + c.tokens.len();
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
    /// What a forward of this batch keeps for [`PagedCache::commit`], from each layer's
    /// checkpoints per group (`None` when no chunk verifies).
    pub(crate) fn pending(
        &self,
        layers: Vec<Option<Vec<Option<VerifyCheckpoints>>>>,
    ) -> Option<BatchPending> {
        if layers.iter().all(Option::is_none) {
            return None;
        }
        let mut member_of = vec![None; self.chunks.len()];
        for (g, members) in self.groups.iter().enumerate() {
            for (i, &chunk) in members.iter().enumerate() {
                if self.chunks[chunk].verify {
                    member_of[chunk] = Some((g, i));
                }
            }
        }
        Some(BatchPending {
            layers,
            member_of,
            slots: self.chunks.iter().map(|c| c.slot).collect(),
        })
    }
}

/// Per layer of a flat forward, each group's verify checkpoints (`None` for a layer without any:
/// attention layers, or no verifying group).
pub(crate) type LayerCheckpoints = Vec<Option<Vec<Option<VerifyCheckpoints>>>>;

/// What a forward with verifying chunks keeps for [`PagedCache::commit`]: per layer, each
/// group's checkpoints (GDN layers; `None` for attention layers).
#[derive(Debug, Clone)]
pub struct BatchPending {
    pub(crate) layers: LayerCheckpoints,
    /// Per chunk: (group, index in the group) when it verified.
    pub(crate) member_of: Vec<Option<(usize, usize)>>,
    pub(crate) slots: Vec<u32>,
}

impl BatchPending {
    /// The verify group of `chunk` and its member index there.
    fn member(&self, chunk: usize) -> Result<(usize, usize)> {
        self.member_of
            .get(chunk)
            .copied()
            .flatten()
            .ok_or_else(|| no_chunk(chunk))
    }

    /// Tokens each chunk of verify group `group` ran.
    fn group_len(&self, group: usize) -> Result<usize> {
        self.layers
            .iter()
            .flatten()
            .find_map(|cps| cps.get(group).and_then(Option::as_ref))
            .map(VerifyCheckpoints::len)
            .ok_or_else(|| Error::Cache(format!("group {group} kept no checkpoints")))
    }
}

/// The result of [`crate::Qwen36Model::forward_batch`].
#[derive(Debug, Clone)]
pub struct BatchOutput {
    /// Final-norm hidden states `[rows, hidden]` (rows as [`ForwardBatch::rows`] gives them).
    pub hidden: Tensor,
    /// The checkpoints, when some chunk verified.
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
        policy: KernelPolicy,
    ) -> Result<Self> {
        if slots == 0 || blocks == 0 || block_size == 0 {
            return Err(Error::Cache(format!(
                "a pool needs slots, blocks and positions per block; found {slots}, {blocks}, {block_size}"
            )));
        }
        let layers = kinds
            .map(|k| {
                Ok(match k {
                    PoolShape::Gdn { conv, recurrent } => PagedLayer::Gdn {
                        conv: Tensor::zeros([&[slots][..], &conv].concat(), dtype, device)?,
                        recurrent: Tensor::zeros([&[slots][..], &recurrent].concat(), DType::F32, device)?,
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
            policy,
            #[cfg(feature = "fault-injection")]
            fault: None,
        })
    }
}

/// The shape of one layer's pooled cache per slot or position.
pub(crate) enum PoolShape {
    /// A GDN layer's conv window `[conv_dim, K-1]` and recurrent state `[Hv, dk, dv]`.
    Gdn { conv: Vec<usize>, recurrent: Vec<usize> },
    /// An attention layer's K/V row `[kv_heads, head_dim]`.
    Attention { kv_heads: usize, head_dim: usize },
}
