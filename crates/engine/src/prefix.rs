//! The prefix cache's bookkeeping (the scheduler and the engine decide where snapshots are kept
//! and restore hits; see `scheduler.rs`): full KV blocks of token prefixes shared by refcount through a chain of block hashes, and GDN state
//! snapshots kept at chosen block boundaries. A hybrid model cannot rebuild its recurrent state
//! from the KV, so a prefix is only a hit where a snapshot of the state at its end is kept: the
//! longest such prefix gives its blocks (shared) and its snapshot (copied into the sequence's own
//! slot), and only the rest of the prompt runs.
//!
//! Entries are exact: a node keeps its block's tokens and its parent, and a lookup compares both,
//! so a hash collision cannot alias two prefixes. A snapshot is immutable once kept (sequences
//! copy from it, never into it); eviction frees least-recently-used entries that only the cache
//! holds, leaves first, and among snapshots those a deeper one supersedes (a conversation keeps
//! its latest turn's state, a shared system prompt its own) first.

use std::collections::hash_map::DefaultHasher;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};

use crate::{BlockId, BlockPool, BlockTable, Result, SlotId, SlotPool};

/// One cached block: `tokens` (a whole block) after its parent's prefix.
#[derive(Debug, Clone)]
struct Node {
    /// Its chain hash (its key in the index).
    hash: u64,
    parent: Option<usize>,
    tokens: Vec<u32>,
    block: BlockId,
    /// The GDN state after this block's last token, when kept.
    snapshot: Option<SlotId>,
    /// Set once the MTP head's K/V of all this block's positions is written: the token after
    /// the block that its last pair was fed with (the pair at position `p` is the final hidden
    /// state at `p` and token `p + 1`). Only then can an MTP-drafting request share the block.
    mtp_next: Option<u32>,
    children: usize,
    last_used: u64,
}

/// What a lookup found: the first `positions` tokens are cached.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefixHit {
    /// Tokens covered (a multiple of the block size, shorter than the tokens looked up).
    pub positions: usize,
    /// Their KV blocks in order, each retained once for the caller's block table.
    pub blocks: Vec<BlockId>,
    /// The state after them, retained once for the caller: copy it into the sequence's slot,
    /// then release it.
    pub snapshot: SlotId,
}

/// Counters of the cache's use.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixStats {
    pub lookups: u64,
    pub hits: u64,
    /// Tokens looked up, and of them those served from the cache.
    pub lookup_tokens: u64,
    pub hit_tokens: u64,
    /// Blocks and snapshots held now.
    pub blocks: usize,
    pub snapshots: usize,
    /// Entries (blocks or snapshots) freed to make room.
    pub evictions: u64,
}

/// Cached prefixes over a block pool and a state slot pool (see the module's documentation).
#[derive(Debug, Clone)]
pub struct PrefixCache {
    block_size: usize,
    nodes: Vec<Option<Node>>,
    free_nodes: Vec<usize>,
    /// Chain hash → node.
    index: HashMap<u64, usize>,
    /// Cached block → its node.
    by_block: HashMap<BlockId, usize>,
    /// The chain hash ([`chain`]; tests give one that collides).
    hash: fn(Option<u64>, &[u32]) -> u64,
    clock: u64,
    stats: PrefixStats,
}

/// The chain hash of a block after a parent's.
fn chain(parent: Option<u64>, tokens: &[u32]) -> u64 {
    let mut h = DefaultHasher::new();
    parent.hash(&mut h);
    tokens.hash(&mut h);
    h.finish()
}

impl PrefixCache {
    /// An empty cache for blocks of `block_size` positions.
    pub fn new(block_size: usize) -> Self {
        Self {
            block_size,
            nodes: Vec::new(),
            free_nodes: Vec::new(),
            index: HashMap::new(),
            by_block: HashMap::new(),
            hash: chain,
            clock: 0,
            stats: PrefixStats::default(),
        }
    }

    /// Positions per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The counters.
    pub fn stats(&self) -> PrefixStats {
        self.stats
    }

    fn node(&self, i: usize) -> &Node {
        self.nodes[i].as_ref().expect("a live node")
    }

    fn node_mut(&mut self, i: usize) -> &mut Node {
        self.nodes[i].as_mut().expect("a live node")
    }

    /// The nodes of `tokens`' cached whole blocks, from the first, with their chain hashes.
    fn walk(&self, tokens: &[u32]) -> Vec<(usize, u64)> {
        let mut out = Vec::new();
        let (mut parent, mut parent_hash) = (None, None);
        for block in tokens.chunks_exact(self.block_size) {
            let h = (self.hash)(parent_hash, block);
            let found = self.index.get(&h).copied().filter(|&i| {
                let n = self.node(i);
                n.parent == parent && n.tokens == block
            });
            let Some(i) = found else { break };
            out.push((i, h));
            parent = Some(i);
            parent_hash = Some(h);
        }
        out
    }

    /// Counts a lookup of `tokens` tokens whose first `hit` were served from the cache (the
    /// caller counts the lookups it acts on, once per request admitted).
    pub fn record(&mut self, tokens: usize, hit: usize) {
        self.stats.lookups += 1;
        self.stats.lookup_tokens += tokens as u64;
        self.stats.hits += u64::from(hit > 0);
        self.stats.hit_tokens += hit as u64;
    }

    /// Positions of `tokens`' longest prefix of cached whole blocks, snapshot or not, that leaves
    /// a token to run (where a new request branches off a cached one: a snapshot point).
    pub fn cached_positions(&self, tokens: &[u32]) -> usize {
        self.walk(&tokens[..tokens.len().saturating_sub(1)]).len() * self.block_size
    }

    /// Whether the state after all of `tokens` (whole blocks) is kept already.
    pub fn has_snapshot(&self, tokens: &[u32]) -> bool {
        let path = self.walk(tokens);
        path.len() * self.block_size == tokens.len()
            && path.last().is_some_and(|&(i, _)| self.node(i).snapshot.is_some())
    }

    /// Blocks and snapshot slots that only the cache holds (what eviction could free now).
    pub fn exclusive(&self, blocks: &BlockPool, slots: &SlotPool) -> (usize, usize) {
        self.nodes.iter().flatten().fold((0, 0), |(b, s), n| {
            let only = |refs: u32| usize::from(refs == 1);
            (
                b + only(blocks.refs(n.block)),
                s + n.snapshot.map_or(0, |x| only(slots.refs(x))),
            )
        })
    }

    /// The longest cached prefix of `tokens` that ends at a kept snapshot and leaves at least one
    /// token to run; its blocks and snapshot are retained once for the caller (the counters are
    /// the caller's: [`Self::record`]). With `mtp` (the request drafts with the MTP head), only
    /// blocks whose MTP K/V is written with `tokens`' own next token count ([`Self::mark_mtp`]).
    pub fn lookup(
        &mut self,
        tokens: &[u32],
        mtp: bool,
        blocks: &mut BlockPool,
        slots: &mut SlotPool,
    ) -> Result<Option<PrefixHit>> {
        let usable = tokens.len().saturating_sub(1);
        let mut path = self.walk(&tokens[..usable]);
        if mtp {
            let bs = self.block_size;
            let written =
                |&(j, &(i, _)): &(usize, &(usize, u64))| self.node(i).mtp_next == Some(tokens[(j + 1) * bs]);
            let n = path.iter().enumerate().take_while(written).count();
            path.truncate(n);
        }
        let Some(depth) = path.iter().rposition(|&(i, _)| self.node(i).snapshot.is_some()) else {
            return Ok(None);
        };
        // Only the hit counts as a use: a shallower snapshot on its path is superseded for this
        // prefix (and its blocks, having children, outlive the leaves anyway).
        self.clock += 1;
        let now = self.clock;
        self.node_mut(path[depth].0).last_used = now;
        let mut hit_blocks = Vec::with_capacity(depth + 1);
        for &(i, _) in &path[..=depth] {
            let b = self.node(i).block;
            blocks.retain(b)?;
            hit_blocks.push(b);
        }
        let snapshot = self.node(path[depth].0).snapshot.expect("a snapshot at the hit");
        slots.retain(snapshot)?;
        let positions = (depth + 1) * self.block_size;
        Ok(Some(PrefixHit {
            positions,
            blocks: hit_blocks,
            snapshot,
        }))
    }

    /// Keeps the whole blocks of `tokens[..len]` that `table` holds (the cache retains each block
    /// it newly keeps; blocks already cached under the same prefix are left as they are). The
    /// MTP head's K/V of `table`'s positions `0..mtp_fed` is written (each pair `p` with token
    /// `tokens[p + 1]`): those blocks are noted ([`Self::mark_mtp`]), and replace cached ones
    /// without MTP K/V. Returns how many blocks it newly keeps.
    pub fn insert(
        &mut self,
        tokens: &[u32],
        len: usize,
        table: &BlockTable,
        blocks: &mut BlockPool,
        mtp_fed: usize,
    ) -> Result<usize> {
        let whole = (len.min(tokens.len()) / self.block_size).min(table.blocks().len());
        let (mut parent, mut parent_hash) = (None, None);
        let mut added = 0;
        self.clock += 1;
        for (k, block) in tokens[..whole * self.block_size]
            .chunks_exact(self.block_size)
            .enumerate()
        {
            let h = (self.hash)(parent_hash, block);
            let existing = self.index.get(&h).copied().filter(|&i| {
                let n = self.node(i);
                n.parent == parent && n.tokens == block
            });
            let i = match existing {
                Some(i) => i,
                None if self.index.contains_key(&h) => break, // a collision: stop, stay exact
                None => {
                    let b = table.blocks()[k];
                    blocks.retain(b)?;
                    let node = Node {
                        hash: h,
                        parent,
                        tokens: block.to_vec(),
                        block: b,
                        snapshot: None,
                        mtp_next: None,
                        children: 0,
                        last_used: self.clock,
                    };
                    let i = match self.free_nodes.pop() {
                        Some(i) => {
                            self.nodes[i] = Some(node);
                            i
                        }
                        None => {
                            self.nodes.push(Some(node));
                            self.nodes.len() - 1
                        }
                    };
                    if let Some(p) = parent {
                        self.node_mut(p).children += 1;
                    }
                    self.index.insert(h, i);
                    self.by_block.insert(b, i);
                    self.stats.blocks += 1;
                    added += 1;
                    i
                }
            };
            let now = self.clock;
            self.node_mut(i).last_used = now;
            let end = (k + 1) * self.block_size;
            let mine = table.blocks()[k];
            let n = self.node(i);
            if n.mtp_next.is_none() && n.block != mine {
                // The sequence computed the same K/V again (no snapshot let it hit): the node
                // takes the sequence's block and lets its old one go (freed unless another
                // sequence holds it), since a block cached only, under a node that a running
                // sequence's blocks extend, could never be evicted. A node whose block holds
                // the MTP head's K/V keeps it.
                let old = n.block;
                blocks.retain(mine)?;
                blocks.release(old)?;
                self.by_block.remove(&old);
                self.by_block.insert(mine, i);
                self.node_mut(i).block = mine;
            }
            if let (true, Some(&next)) = (end <= mtp_fed, tokens.get(end)) {
                self.mark_mtp(mine, next);
            }
            parent = Some(i);
            parent_hash = Some(h);
        }
        Ok(added)
    }

    /// Keeps `slot`, which holds the state after `tokens[..pos]` (`pos` a positive multiple of
    /// the block size whose blocks are cached), as that prefix's snapshot: the cache takes over
    /// the caller's reference. When the prefix is not cached, or already has a snapshot, the
    /// slot is released instead and the result is false.
    pub fn insert_snapshot(
        &mut self,
        tokens: &[u32],
        pos: usize,
        slot: SlotId,
        slots: &mut SlotPool,
    ) -> Result<bool> {
        // (A position of 0 walks no block and finds no node.)
        let target = (pos % self.block_size == 0 && pos <= tokens.len())
            .then(|| self.walk(&tokens[..pos]))
            .filter(|path| path.len() * self.block_size == pos)
            .and_then(|path| path.last().map(|&(i, _)| i))
            .filter(|&i| self.node(i).snapshot.is_none());
        match target {
            Some(i) => {
                self.node_mut(i).snapshot = Some(slot);
                self.stats.snapshots += 1;
                Ok(true)
            }
            None => {
                slots.release(slot)?;
                Ok(false)
            }
        }
    }

    /// Notes that the MTP head's K/V of all of `block`'s positions is written, its last pair fed
    /// with token `next`, when `block` is cached and not noted yet (what is written is never
    /// rewritten: a sequence writes MTP pairs only past those it has fed).
    pub fn mark_mtp(&mut self, block: BlockId, next: u32) {
        if let Some(&i) = self.by_block.get(&block) {
            let n = self.node_mut(i);
            n.mtp_next.get_or_insert(next);
        }
    }

    /// Frees least-recently-used entries only the cache holds until `blocks` has `want_blocks`
    /// free blocks and `slots` `want_slots` free slots, or nothing more can go: for a slot, a
    /// snapshot no sequence is copying, superseded ones first (with its block when that is an
    /// unshared leaf); for a
    /// block, a leaf block no sequence shares (with its snapshot). Returns the blocks and
    /// snapshots it freed.
    pub fn evict(
        &mut self,
        want_blocks: usize,
        want_slots: usize,
        blocks: &mut BlockPool,
        slots: &mut SlotPool,
    ) -> Result<u64> {
        let mut freed = 0;
        loop {
            let want_slot = slots.free() < want_slots;
            let want_block = blocks.free() < want_blocks;
            if !want_slot && !want_block {
                break;
            }
            let lru = |keep: &dyn Fn(&Node) -> bool| {
                self.nodes
                    .iter()
                    .enumerate()
                    .filter_map(|(i, n)| n.as_ref().filter(|n| keep(n)).map(|n| (i, n.last_used)))
                    .min_by_key(|&(_, t)| t)
                    .map(|(i, _)| i)
            };
            let leaf = |n: &Node| n.children == 0 && blocks.refs(n.block) == 1;
            let lone_snapshot = |n: &Node| n.snapshot.is_some_and(|s| slots.refs(s) == 1);
            // A snapshot when a slot is wanted (a superseded one first), else a leaf block when a
            // block is.
            let snapshot = || {
                let superseded = self.superseded();
                let lone_superseded = |n: &Node| lone_snapshot(n) && superseded.contains(&n.hash);
                lru(&lone_superseded).or_else(|| lru(&lone_snapshot))
            };
            let (i, whole) = match (
                want_slot.then(snapshot).flatten(),
                want_block.then(|| lru(&leaf)).flatten(),
            ) {
                (Some(i), _) => (i, leaf(self.node(i))),
                (None, Some(i)) => (i, true),
                (None, None) => break,
            };
            if let Some(s) = self.node_mut(i).snapshot.take() {
                slots.release(s)?;
                self.stats.snapshots -= 1;
                freed += 1;
            }
            if whole {
                self.remove(i, blocks)?;
                freed += 1;
            }
        }
        self.stats.evictions += freed;
        Ok(freed)
    }

    /// The chain hashes of superseded snapshots: those with a deeper snapshot below them along
    /// blocks no other cached prefix branches from (a conversation's earlier turns). A prompt
    /// hits such a snapshot rather than the deeper one only by branching off between them, which
    /// no cached prompt has done, or by repeating that earlier prompt.
    fn superseded(&self) -> std::collections::HashSet<u64> {
        let mut out = std::collections::HashSet::new();
        for n in self.nodes.iter().flatten().filter(|n| n.snapshot.is_some()) {
            let mut up = n.parent;
            while let Some(a) = up.map(|i| self.node(i)) {
                if a.children != 1 {
                    break;
                }
                if a.snapshot.is_some() {
                    out.insert(a.hash);
                    break;
                }
                up = a.parent;
            }
        }
        out
    }

    /// Drops node `i` (a leaf) and releases its block.
    fn remove(&mut self, i: usize, blocks: &mut BlockPool) -> Result<()> {
        let n = self.nodes[i].take().expect("a live node");
        debug_assert_eq!(n.children, 0);
        blocks.release(n.block)?;
        self.index.remove(&n.hash);
        self.by_block.remove(&n.block);
        if let Some(p) = n.parent {
            self.node_mut(p).children -= 1;
        }
        self.free_nodes.push(i);
        self.stats.blocks -= 1;
        Ok(())
    }

    /// Frees everything only the cache holds (blocks and snapshots shared with running
    /// sequences stay until those end).
    pub fn clear(&mut self, blocks: &mut BlockPool, slots: &mut SlotPool) -> Result<()> {
        self.evict(usize::MAX, usize::MAX, blocks, slots)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BS: usize = 4;

    struct Pools {
        blocks: BlockPool,
        slots: SlotPool,
    }

    fn pools() -> Pools {
        Pools {
            blocks: BlockPool::new(32, BS).unwrap(),
            slots: SlotPool::new(8).unwrap(),
        }
    }

    /// A sequence that ran `tokens`: its table of blocks and, at `snap` (a boundary), a snapshot.
    fn run(cache: &mut PrefixCache, p: &mut Pools, tokens: &[u32], snap: usize) -> BlockTable {
        let mut table = BlockTable::default();
        table.reserve(tokens.len(), &mut p.blocks).unwrap();
        cache
            .insert(tokens, tokens.len(), &table, &mut p.blocks, 0)
            .unwrap();
        let slot = p.slots.alloc().unwrap();
        cache.insert_snapshot(tokens, snap, slot, &mut p.slots).unwrap();
        table
    }

    /// With a hash under which every block collides, the cache stays exact: a prefix hits only
    /// where its tokens are the cached ones, and a colliding block is not kept over another.
    #[test]
    fn hash_collisions_cannot_alias_prefixes() {
        let mut c = PrefixCache::new(BS);
        c.hash = |_, _| 7;
        let mut p = pools();
        let a: Vec<u32> = (0..9).collect();
        run(&mut c, &mut p, &a, 4);
        assert_eq!(
            c.stats().blocks,
            1,
            "the second block collides with the first: not kept"
        );
        let b: Vec<u32> = (100..109).collect();
        assert!(
            c.lookup(&b, false, &mut p.blocks, &mut p.slots)
                .unwrap()
                .is_none(),
            "same hash, other tokens"
        );
        let hit = c.lookup(&a, false, &mut p.blocks, &mut p.slots).unwrap().unwrap();
        assert_eq!(hit.positions, 4);
        // A block whose tokens match but whose parent differs is no hit either: with a hash
        // that ignores the parent, x|y and z|y collide at y.
        let mut d = PrefixCache::new(BS);
        d.hash = |_, tokens| tokens[0] as u64;
        let xy: Vec<u32> = (0..9).collect();
        let zy: Vec<u32> = (100..104).chain(4..12).chain([0]).collect();
        run(&mut d, &mut p, &xy, 8);
        run(&mut d, &mut p, &zy, 4);
        assert_eq!(
            d.stats().blocks,
            3,
            "z|y's second block collides: it and the rest not kept"
        );
        let hit = d
            .lookup(&zy, false, &mut p.blocks, &mut p.slots)
            .unwrap()
            .unwrap();
        assert_eq!(hit.positions, 4, "not x|y's snapshot at 8");
    }

    /// Recorded lookups and hits are counted, insert says how many blocks it newly keeps, and
    /// the cached run and the cache-only holdings are what was inserted.
    #[test]
    fn counters_and_insert_counts() {
        let mut c = PrefixCache::new(BS);
        let mut p = pools();
        let a: Vec<u32> = (0..12).collect();
        let mut table = BlockTable::default();
        table.reserve(12, &mut p.blocks).unwrap();
        assert_eq!(c.insert(&a, 8, &table, &mut p.blocks, 0).unwrap(), 2);
        assert_eq!(c.insert(&a, 12, &table, &mut p.blocks, 0).unwrap(), 1);
        assert_eq!(c.insert(&a, 12, &table, &mut p.blocks, 0).unwrap(), 0);
        assert!(c
            .lookup(&a, false, &mut p.blocks, &mut p.slots)
            .unwrap()
            .is_none());
        assert_eq!(c.stats().lookups, 0, "a lookup alone is not counted");
        c.record(12, 0);
        c.record(20, 8);
        c.record(9, 4);
        let st = c.stats();
        assert_eq!(
            (st.lookups, st.hits, st.lookup_tokens, st.hit_tokens, st.blocks),
            (3, 2, 41, 12, 3)
        );
        // The cached run of blocks, with or without a snapshot, leaving a token to run.
        assert_eq!(c.cached_positions(&a), 8);
        assert_eq!(c.cached_positions(&[a.clone(), vec![5]].concat()), 12);
        assert_eq!(c.cached_positions(&[0, 1, 2, 9, 4]), 0);
        // Only the cache holds no block yet: the table holds them too.
        assert_eq!(c.exclusive(&p.blocks, &p.slots), (0, 0));
        table.truncate(4, &mut p.blocks).unwrap();
        let slot = p.slots.alloc().unwrap();
        assert!(!c.has_snapshot(&a[..8]));
        c.insert_snapshot(&a, 8, slot, &mut p.slots).unwrap();
        assert_eq!(c.exclusive(&p.blocks, &p.slots), (2, 1));
        assert!(c.has_snapshot(&a[..8]));
        assert!(!c.has_snapshot(&a[..4]) && !c.has_snapshot(&a[..12]) && !c.has_snapshot(&a[..7]));
    }

    /// Eviction goes least recently used first (a lookup or an insert counts as a use) and
    /// stops as soon as enough is free.
    #[test]
    fn eviction_is_lru_and_stops_when_enough_is_free() {
        let mut c = PrefixCache::new(BS);
        let mut p = pools();
        let (a, b): (Vec<u32>, Vec<u32>) = ((0..5).collect(), (10..15).collect());
        let mut ta = run(&mut c, &mut p, &a, 4);
        let mut tb = run(&mut c, &mut p, &b, 4);
        ta.release(&mut p.blocks).unwrap();
        tb.release(&mut p.blocks).unwrap();
        // a was used last: b's entry goes first, and only it.
        let hit = c.lookup(&a, false, &mut p.blocks, &mut p.slots).unwrap().unwrap();
        for blk in &hit.blocks {
            p.blocks.release(*blk).unwrap();
        }
        p.slots.release(hit.snapshot).unwrap();
        let slots_free = p.slots.free();
        assert_eq!(
            c.evict(0, slots_free + 1, &mut p.blocks, &mut p.slots).unwrap(),
            2
        );
        let hit = c
            .lookup(&a, false, &mut p.blocks, &mut p.slots)
            .unwrap()
            .expect("a stays");
        for blk in &hit.blocks {
            p.blocks.release(*blk).unwrap();
        }
        p.slots.release(hit.snapshot).unwrap();
        assert!(
            c.lookup(&b, false, &mut p.blocks, &mut p.slots)
                .unwrap()
                .is_none(),
            "b went"
        );
        // Exactly enough free already: nothing goes (a's entry could).
        let (blocks_free, slots_free) = (p.blocks.free(), p.slots.free());
        assert_eq!(
            c.evict(blocks_free, slots_free, &mut p.blocks, &mut p.slots)
                .unwrap(),
            0
        );
        // An insert counts as a use too: b again, then a re-inserted; a slot wanted: b goes.
        let mut tb = run(&mut c, &mut p, &b, 4);
        tb.release(&mut p.blocks).unwrap();
        let mut ta = BlockTable::default();
        ta.reserve(5, &mut p.blocks).unwrap();
        c.insert(&a, 5, &ta, &mut p.blocks, 0).unwrap();
        ta.release(&mut p.blocks).unwrap();
        let slots_free = p.slots.free();
        c.evict(0, slots_free + 1, &mut p.blocks, &mut p.slots).unwrap();
        assert!(
            c.lookup(&b, false, &mut p.blocks, &mut p.slots)
                .unwrap()
                .is_none(),
            "b went first"
        );
    }

    /// A hit refreshes its own snapshot only: the shallower one on its path is evicted first.
    #[test]
    fn a_deeper_hit_leaves_the_shallower_snapshot_to_go_first() {
        let mut c = PrefixCache::new(BS);
        let mut p = pools();
        // Two entries inserted and cleared (oldest first) leave the deeper block of `a` the
        // lower node index, so that a tie in age would pick it.
        for x in [50u32, 60] {
            let mut t = BlockTable::default();
            t.reserve(BS, &mut p.blocks).unwrap();
            c.insert(&(x..x + 4).collect::<Vec<_>>(), BS, &t, &mut p.blocks, 0)
                .unwrap();
            t.release(&mut p.blocks).unwrap();
        }
        c.clear(&mut p.blocks, &mut p.slots).unwrap();
        let a: Vec<u32> = (0..10).collect();
        let mut t = run(&mut c, &mut p, &a, 4);
        let deep = p.slots.alloc().unwrap();
        assert!(c.insert_snapshot(&a, 8, deep, &mut p.slots).unwrap());
        t.release(&mut p.blocks).unwrap();
        let hit = c.lookup(&a, false, &mut p.blocks, &mut p.slots).unwrap().unwrap();
        assert_eq!(hit.positions, 8);
        for b in &hit.blocks {
            p.blocks.release(*b).unwrap();
        }
        p.slots.release(hit.snapshot).unwrap();
        let free = p.slots.free();
        c.evict(0, free + 1, &mut p.blocks, &mut p.slots).unwrap();
        assert_eq!(p.slots.refs(deep), 1, "the deeper snapshot stays");
        let hit = c
            .lookup(&a[..9], false, &mut p.blocks, &mut p.slots)
            .unwrap()
            .unwrap();
        assert_eq!(hit.positions, 8);
        assert_eq!(c.stats().snapshots, 1);
    }

    #[test]
    fn a_shared_prefix_hits_at_its_deepest_snapshot() {
        let mut c = PrefixCache::new(BS);
        let mut p = pools();
        let first: Vec<u32> = (0..14).collect(); // three whole blocks and two tokens
        let mut t1 = run(&mut c, &mut p, &first, 8);
        assert_eq!(c.stats().blocks, 3);
        // A second prompt sharing 12 tokens then diverging: the snapshot at 8 is the hit.
        let second: Vec<u32> = (0..12).chain([99, 98, 97]).collect();
        let hit = c
            .lookup(&second, false, &mut p.blocks, &mut p.slots)
            .unwrap()
            .expect("a hit");
        assert_eq!(hit.positions, 8);
        assert_eq!(hit.blocks, t1.blocks()[..2].to_vec());
        assert!(
            hit.blocks.iter().all(|&b| p.blocks.refs(b) == 3),
            "sequence, cache, caller"
        );
        assert_eq!(p.slots.refs(hit.snapshot), 2);
        // Diverging inside the first block: no hit; no snapshot anywhere: no hit.
        assert!(c
            .lookup(
                &[0, 1, 7, 3, 4, 5, 6, 7, 8, 9],
                false,
                &mut p.blocks,
                &mut p.slots
            )
            .unwrap()
            .is_none());
        let mut other = PrefixCache::new(BS);
        let mut table = BlockTable::default();
        table.reserve(8, &mut p.blocks).unwrap();
        other.insert(&first[..8], 8, &table, &mut p.blocks, 0).unwrap();
        assert!(
            other
                .lookup(&first, false, &mut p.blocks, &mut p.slots)
                .unwrap()
                .is_none(),
            "KV alone is no hit"
        );
        // Give everything back: the caller's hit, both tables, both caches.
        for b in hit.blocks {
            p.blocks.release(b).unwrap();
        }
        p.slots.release(hit.snapshot).unwrap();
        t1.release(&mut p.blocks).unwrap();
        table.release(&mut p.blocks).unwrap();
        c.clear(&mut p.blocks, &mut p.slots).unwrap();
        other.clear(&mut p.blocks, &mut p.slots).unwrap();
        assert_eq!((p.blocks.free(), p.slots.free()), (32, 8));
        assert_eq!((c.stats().blocks, c.stats().snapshots), (0, 0));
    }

    /// The positions a lookup hits (its references given back at once).
    fn hit_len(c: &mut PrefixCache, p: &mut Pools, tokens: &[u32], mtp: bool) -> usize {
        let hit = c.lookup(tokens, mtp, &mut p.blocks, &mut p.slots).unwrap();
        hit.map_or(0, |h| {
            for b in h.blocks {
                p.blocks.release(b).unwrap();
            }
            p.slots.release(h.snapshot).unwrap();
            h.positions
        })
    }

    /// An MTP-drafting request hits only blocks whose MTP K/V is noted as written, each with its
    /// own next token after the block; a note is kept once, and goes with its block.
    #[test]
    fn mtp_hits_need_blocks_noted_with_their_next_token() {
        let mut c = PrefixCache::new(BS);
        let mut p = pools();
        let a: Vec<u32> = (0..14).collect();
        let mut t = run(&mut c, &mut p, &a, 8);
        let deep = p.slots.alloc().unwrap();
        assert!(c.insert_snapshot(&a, 12, deep, &mut p.slots).unwrap());
        assert_eq!(
            (
                hit_len(&mut c, &mut p, &a, false),
                hit_len(&mut c, &mut p, &a, true)
            ),
            (12, 0)
        );
        let blocks = t.blocks().to_vec();
        c.mark_mtp(blocks[0], 4);
        c.mark_mtp(blocks[1], 8);
        assert_eq!(
            hit_len(&mut c, &mut p, &a, true),
            8,
            "the third block is not noted"
        );
        // Noted with another next token: a's own pair at 11 is not the one written.
        c.mark_mtp(blocks[2], 99);
        c.mark_mtp(blocks[2], 12);
        assert_eq!(hit_len(&mut c, &mut p, &a, true), 8, "the first note stays");
        let b: Vec<u32> = (0..12).chain([99, 5]).collect();
        assert_eq!(hit_len(&mut c, &mut p, &b, true), 12);
        // A block noted before its first: no MTP hit past the gap.
        let mut d = PrefixCache::new(BS);
        run(&mut d, &mut p, &a, 8);
        let u = p.slots.alloc().unwrap();
        assert!(d.insert_snapshot(&a, 12, u, &mut p.slots).unwrap());
        d.mark_mtp(blocks[1], 8);
        d.mark_mtp(blocks[2], 12);
        assert_eq!(
            hit_len(&mut d, &mut p, &a, true),
            0,
            "the first block is not noted"
        );
        // A note goes with its node: once a's blocks leave the cache, noting them marks nothing
        // (not the nodes that took their places, over other blocks).
        let e: Vec<u32> = (50..63).collect();
        let mut te = BlockTable::default();
        te.reserve(12, &mut p.blocks).unwrap();
        t.release(&mut p.blocks).unwrap();
        c.clear(&mut p.blocks, &mut p.slots).unwrap();
        assert_eq!(c.stats().blocks, 0);
        c.insert(&e, 12, &te, &mut p.blocks, 0).unwrap();
        let slot = p.slots.alloc().unwrap();
        assert!(c.insert_snapshot(&e, 8, slot, &mut p.slots).unwrap());
        c.mark_mtp(blocks[0], e[4]);
        c.mark_mtp(blocks[1], e[8]);
        assert_eq!(
            (
                hit_len(&mut c, &mut p, &e, false),
                hit_len(&mut c, &mut p, &e, true)
            ),
            (8, 0)
        );
        c.mark_mtp(te.blocks()[0], e[4]);
        c.mark_mtp(te.blocks()[1], e[8]);
        assert_eq!(hit_len(&mut c, &mut p, &e, true), 8);
        te.release(&mut p.blocks).unwrap();
    }

    /// Blocks cached without MTP K/V give way to the same prefix's blocks of a later table,
    /// noted with their next tokens where its pairs completed the MTP head's K/V; the replaced
    /// blocks lose the cache's reference only; a block noted so stays.
    #[test]
    fn blocks_with_mtp_kv_replace_cached_ones_without() {
        let mut c = PrefixCache::new(BS);
        let mut p = pools();
        let a: Vec<u32> = (0..14).collect();
        let plain = run(&mut c, &mut p, &a, 8);
        let slot = p.slots.alloc().unwrap();
        assert!(c.insert_snapshot(&a, 12, slot, &mut p.slots).unwrap());
        let mut mine = BlockTable::default();
        mine.reserve(14, &mut p.blocks).unwrap();
        // Pairs 0..11 written: the first two blocks are complete, the third lacks its last.
        assert_eq!(c.insert(&a, 12, &mine, &mut p.blocks, 11).unwrap(), 0);
        let refs = |t: &BlockTable, p: &Pools| -> Vec<u32> {
            t.blocks().iter().map(|&b| p.blocks.refs(b)).collect()
        };
        assert_eq!(refs(&plain, &p)[..3], [1, 1, 1]);
        assert_eq!(refs(&mine, &p)[..3], [2, 2, 2]);
        assert_eq!(hit_len(&mut c, &mut p, &a, true), 8);
        assert_eq!(hit_len(&mut c, &mut p, &a, false), 12);
        // Once noted, a block stays: another table's does not replace it.
        let mut third = BlockTable::default();
        third.reserve(14, &mut p.blocks).unwrap();
        c.insert(&a, 12, &third, &mut p.blocks, 13).unwrap();
        assert_eq!(refs(&third, &p)[..3], [1, 1, 2]);
        assert_eq!(hit_len(&mut c, &mut p, &a, true), 12);
        // Eviction frees the blocks the cache holds now.
        for mut t in [plain, mine, third] {
            t.release(&mut p.blocks).unwrap();
        }
        c.clear(&mut p.blocks, &mut p.slots).unwrap();
        assert_eq!((p.blocks.free(), p.slots.free()), (32, 8));
    }

    /// At least one token is left to run: a prompt that ends on a snapshot hits the one before.
    #[test]
    fn a_hit_leaves_a_token_to_run() {
        let mut c = PrefixCache::new(BS);
        let mut p = pools();
        let tokens: Vec<u32> = (0..8).collect();
        run(&mut c, &mut p, &tokens, 4);
        let slot = p.slots.alloc().unwrap();
        assert!(c.insert_snapshot(&tokens, 8, slot, &mut p.slots).unwrap());
        let hit = c
            .lookup(&tokens, false, &mut p.blocks, &mut p.slots)
            .unwrap()
            .unwrap();
        assert_eq!(hit.positions, 4);
        let longer: Vec<u32> = (0..9).collect();
        assert_eq!(
            c.lookup(&longer, false, &mut p.blocks, &mut p.slots)
                .unwrap()
                .unwrap()
                .positions,
            8
        );
    }

    /// A snapshot with a deeper one below it, along blocks no other prefix branches from, goes
    /// first when a slot is wanted, however recently used; one where prefixes branch (a shared
    /// system prompt) goes by age with the rest.
    #[test]
    fn superseded_snapshots_go_first() {
        let mut c = PrefixCache::new(BS);
        let mut p = pools();
        // A conversation's two turns (snapshots at 4 and 12 on one chain), then another prefix.
        let turns: Vec<u32> = (0..13).collect();
        let t = run(&mut c, &mut p, &turns, 4);
        let deeper = p.slots.alloc().unwrap();
        assert!(c.insert_snapshot(&turns, 12, deeper, &mut p.slots).unwrap());
        let other: Vec<u32> = (50..55).collect();
        let o = run(&mut c, &mut p, &other, 4);
        // The earlier turn's snapshot is the most recently used, and still goes first.
        assert_eq!(hit_len(&mut c, &mut p, &turns[..6], false), 4);
        let free = p.slots.free();
        c.evict(0, free + 1, &mut p.blocks, &mut p.slots).unwrap();
        assert_eq!(hit_len(&mut c, &mut p, &turns[..6], false), 0);
        assert_eq!(hit_len(&mut c, &mut p, &other, false), 4);
        assert_eq!(hit_len(&mut c, &mut p, &turns, false), 12);
        // A branch at 4 (a prefix continuing differently): the snapshot there is no longer
        // superseded, and the least recently used goes (the other prefix's).
        let slot = p.slots.alloc().unwrap();
        assert!(c.insert_snapshot(&turns, 4, slot, &mut p.slots).unwrap());
        let branch: Vec<u32> = (0..4).chain(90..95).collect();
        let mut b = BlockTable::default();
        b.reserve(9, &mut p.blocks).unwrap();
        c.insert(&branch, 8, &b, &mut p.blocks, 0).unwrap();
        assert_eq!(hit_len(&mut c, &mut p, &turns[..6], false), 4);
        assert_eq!(hit_len(&mut c, &mut p, &turns, false), 12);
        let free = p.slots.free();
        c.evict(0, free + 1, &mut p.blocks, &mut p.slots).unwrap();
        assert_eq!(hit_len(&mut c, &mut p, &other, false), 0);
        assert_eq!(hit_len(&mut c, &mut p, &turns[..6], false), 4);
        for mut x in [t, o, b] {
            x.release(&mut p.blocks).unwrap();
        }
    }

    /// Snapshots only go where the prefix is cached and has none: otherwise the slot is
    /// released, never leaked or aliased.
    #[test]
    fn snapshots_need_their_cached_prefix() {
        let mut c = PrefixCache::new(BS);
        let mut p = pools();
        let tokens: Vec<u32> = (0..8).collect();
        let t = run(&mut c, &mut p, &tokens, 4);
        for (pos, toks) in [
            (12, &tokens),
            (4, &vec![5u32; 8]),
            (4, &tokens),
            (6, &tokens),
            (0, &tokens),
        ] {
            let slot = p.slots.alloc().unwrap();
            assert!(
                !c.insert_snapshot(toks, pos, slot, &mut p.slots).unwrap(),
                "at {pos}"
            );
            assert_eq!(p.slots.refs(slot), 0, "released");
        }
        assert_eq!(c.stats().snapshots, 1);
        drop(t);
    }

    /// Eviction takes least-recently-used leaves only the cache holds, keeps blocks a sequence
    /// still uses and the parents of kept blocks, and frees snapshots alone when slots are
    /// wanted.
    #[test]
    fn eviction_frees_lru_leaves_the_cache_alone_holds() {
        let mut c = PrefixCache::new(BS);
        let mut p = pools();
        let a: Vec<u32> = (0..8).collect();
        let b: Vec<u32> = (0..4).chain(50..54).collect();
        let mut ta = run(&mut c, &mut p, &a, 8);
        let mut tb = run(&mut c, &mut p, &b, 8);
        ta.release(&mut p.blocks).unwrap(); // a ended; b still runs
        assert_eq!(c.stats().blocks, 3, "a shared first block and two leaves");
        let free = p.blocks.free();
        // Blocks wanted: only a's leaf can go (b's are in use; the root has children).
        assert_eq!(
            c.evict(free + 5, 0, &mut p.blocks, &mut p.slots).unwrap(),
            2,
            "a's snapshot and block"
        );
        assert_eq!(p.blocks.free(), free + 1);
        assert_eq!(c.stats().blocks, 2);
        // Slots wanted: b's snapshot goes, its blocks stay (b runs).
        let slots_free = p.slots.free();
        assert_eq!(
            c.evict(0, slots_free + 1, &mut p.blocks, &mut p.slots).unwrap(),
            1
        );
        assert_eq!((c.stats().blocks, c.stats().snapshots), (2, 0));
        tb.release(&mut p.blocks).unwrap();
        c.clear(&mut p.blocks, &mut p.slots).unwrap();
        assert_eq!((p.blocks.free(), p.slots.free()), (32, 8));
        assert_eq!(c.stats().evictions, 3 + 2);
    }
}
