//! Refcounted pools of fixed size: GDN state slots and KV blocks. An allocation takes the lowest
//! free indices (so runs are reproducible) and is all or nothing; a release frees an index when its
//! last holder lets go. The pools hold indices only: the tensors they index (`[slots, Hv, dk, dv]`
//! states, `[blocks, kv_heads, block_size, hd]` K and V per layer) are allocated once beside them.

use std::collections::BTreeSet;

use crate::{Error, Result};

/// One GDN state slot: a sequence's recurrent state and conv window in every GDN layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SlotId(pub u32);

/// One KV block: `block_size` consecutive positions of every attention layer's K and V.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockId(pub u32);

/// Reference counts over `0..capacity` with the free indices in order.
#[derive(Debug, Clone)]
struct Refcounts {
    pool: &'static str,
    refs: Vec<u32>,
    free: BTreeSet<u32>,
}

impl Refcounts {
    fn new(pool: &'static str, capacity: usize) -> Result<Self> {
        let n = u32::try_from(capacity).map_err(|_| Error::Size {
            pool,
            msg: format!("of {capacity} entries is over the u32 index range"),
        })?;
        Ok(Self {
            pool,
            refs: vec![0; capacity],
            free: (0..n).collect(),
        })
    }

    /// `n` free indices, lowest first, each with one reference; none when fewer are free.
    fn alloc(&mut self, n: usize) -> Result<Vec<u32>> {
        if n > self.free.len() {
            return Err(Error::Exhausted {
                pool: self.pool,
                wanted: n,
                free: self.free.len(),
                capacity: self.refs.len(),
            });
        }
        let taken: Vec<u32> = self.free.iter().take(n).copied().collect();
        for &i in &taken {
            self.free.remove(&i);
            self.refs[i as usize] = 1;
        }
        Ok(taken)
    }

    fn refs_mut(&mut self, index: u32) -> Result<&mut u32> {
        match self.refs.get_mut(index as usize) {
            Some(r) if *r > 0 => Ok(r),
            _ => Err(Error::NotAllocated {
                pool: self.pool,
                index,
            }),
        }
    }

    /// One more holder of an allocated index.
    fn retain(&mut self, index: u32) -> Result<()> {
        *self.refs_mut(index)? += 1;
        Ok(())
    }

    /// One holder fewer; true when that freed the index.
    fn release(&mut self, index: u32) -> Result<bool> {
        let r = self.refs_mut(index)?;
        *r -= 1;
        let freed = *r == 0;
        if freed {
            self.free.insert(index);
        }
        Ok(freed)
    }

    fn refs(&self, index: u32) -> u32 {
        self.refs.get(index as usize).copied().unwrap_or(0)
    }
}

/// The GDN state slots: one per running sequence (and per kept snapshot, for the prefix cache).
#[derive(Debug, Clone)]
pub struct SlotPool(Refcounts);

impl SlotPool {
    /// `capacity` slots, all free.
    pub fn new(capacity: usize) -> Result<Self> {
        Ok(Self(Refcounts::new("state slot", capacity)?))
    }

    /// A free slot with one holder. The caller zeroes its state before use (a slot keeps what
    /// its last sequence left).
    pub fn alloc(&mut self) -> Result<SlotId> {
        Ok(SlotId(self.0.alloc(1)?[0]))
    }

    /// One more holder of `slot`.
    pub fn retain(&mut self, slot: SlotId) -> Result<()> {
        self.0.retain(slot.0)
    }

    /// One holder fewer; true when `slot` became free.
    pub fn release(&mut self, slot: SlotId) -> Result<bool> {
        self.0.release(slot.0)
    }

    /// Holders of `slot` (0: free).
    pub fn refs(&self, slot: SlotId) -> u32 {
        self.0.refs(slot.0)
    }

    /// Free slots.
    pub fn free(&self) -> usize {
        self.0.free.len()
    }

    /// All slots.
    pub fn capacity(&self) -> usize {
        self.0.refs.len()
    }
}

/// The paged KV cache's blocks.
#[derive(Debug, Clone)]
pub struct BlockPool {
    refs: Refcounts,
    block_size: usize,
}

impl BlockPool {
    /// `capacity` blocks of `block_size` (at least 1) positions each, all free.
    pub fn new(capacity: usize, block_size: usize) -> Result<Self> {
        let pool = "KV block";
        if block_size == 0 {
            return Err(Error::Size {
                pool,
                msg: "needs blocks of at least one position".into(),
            });
        }
        Ok(Self {
            refs: Refcounts::new(pool, capacity)?,
            block_size,
        })
    }

    /// Positions per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks that hold `positions` positions.
    pub fn blocks_for(&self, positions: usize) -> usize {
        positions.div_ceil(self.block_size)
    }

    /// `n` free blocks with one holder each, or none when fewer are free.
    pub fn alloc(&mut self, n: usize) -> Result<Vec<BlockId>> {
        Ok(self.refs.alloc(n)?.into_iter().map(BlockId).collect())
    }

    /// One more holder of `block` (a sequence sharing a cached prefix).
    pub fn retain(&mut self, block: BlockId) -> Result<()> {
        self.refs.retain(block.0)
    }

    /// One holder fewer; true when `block` became free.
    pub fn release(&mut self, block: BlockId) -> Result<bool> {
        self.refs.release(block.0)
    }

    /// Holders of `block` (0: free).
    pub fn refs(&self, block: BlockId) -> u32 {
        self.refs.refs(block.0)
    }

    /// Free blocks.
    pub fn free(&self) -> usize {
        self.refs.free.len()
    }

    /// All blocks.
    pub fn capacity(&self) -> usize {
        self.refs.refs.len()
    }
}

/// A sequence's KV blocks in position order: position `p` lives in `blocks[p / block_size]` at
/// offset `p % block_size`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BlockTable {
    blocks: Vec<BlockId>,
}

impl BlockTable {
    /// A table starting with `blocks`, each already retained for it (a prefix-cache hit).
    pub fn shared(blocks: Vec<BlockId>) -> Self {
        Self { blocks }
    }

    /// The blocks, in position order.
    pub fn blocks(&self) -> &[BlockId] {
        &self.blocks
    }

    /// Positions the table holds room for.
    pub fn capacity(&self, pool: &BlockPool) -> usize {
        self.blocks.len() * pool.block_size()
    }

    /// The block and offset of position `pos`, if the table reaches it.
    pub fn locate(&self, pos: usize, pool: &BlockPool) -> Option<(BlockId, usize)> {
        let bs = pool.block_size();
        self.blocks.get(pos / bs).map(|&b| (b, pos % bs))
    }

    /// Grows the table to hold `positions` positions: all the missing blocks or, when the pool
    /// has too few, none (the table is unchanged).
    pub fn reserve(&mut self, positions: usize, pool: &mut BlockPool) -> Result<()> {
        let missing = pool.blocks_for(positions).saturating_sub(self.blocks.len());
        self.blocks.extend(pool.alloc(missing)?);
        Ok(())
    }

    /// Keeps the blocks that hold positions `0..positions` and releases the rest (a speculative
    /// rollback, or a preemption to `0`): every one of them, the first error returned.
    pub fn truncate(&mut self, positions: usize, pool: &mut BlockPool) -> Result<()> {
        let keep = pool.blocks_for(positions).min(self.blocks.len());
        let mut released = Ok(());
        for b in self.blocks.drain(keep..).rev() {
            released = released.and(pool.release(b).map(|_| ()));
        }
        released
    }

    /// Releases every block (the sequence ended).
    pub fn release(&mut self, pool: &mut BlockPool) -> Result<()> {
        self.truncate(0, pool)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Lowest free first, all or nothing, and an exhausted pool names what was asked for.
    #[test]
    fn allocation_takes_the_lowest_free_and_is_all_or_nothing() -> Result<()> {
        let mut pool = BlockPool::new(5, 16)?;
        assert_eq!(pool.alloc(2)?, [BlockId(0), BlockId(1)]);
        let e = pool.alloc(4).unwrap_err();
        assert!(
            matches!(
                e,
                Error::Exhausted {
                    wanted: 4,
                    free: 3,
                    capacity: 5,
                    ..
                }
            ),
            "{e}"
        );
        assert_eq!(pool.free(), 3, "a refused allocation takes nothing");
        assert!(pool.release(BlockId(0))?);
        assert_eq!(pool.alloc(2)?, [BlockId(0), BlockId(2)]);
        assert_eq!(pool.free(), 2);
        // Exactly what is free fits.
        assert_eq!(pool.alloc(2)?, [BlockId(3), BlockId(4)]);
        assert_eq!((pool.free(), pool.capacity()), (0, 5));
        // Blocks of no positions are refused, naming the pool.
        let e = BlockPool::new(5, 0).unwrap_err().to_string();
        assert!(
            e.contains("KV block pool needs blocks of at least one position"),
            "{e}"
        );
        Ok(())
    }

    /// A shared entry is freed by its last holder only, and never twice.
    #[test]
    fn refcounts_free_at_the_last_release() -> Result<()> {
        let mut slots = SlotPool::new(2)?;
        let s = slots.alloc()?;
        slots.retain(s)?;
        assert_eq!(slots.refs(s), 2);
        assert!(!slots.release(s)?);
        assert_eq!(slots.free(), 1);
        assert!(slots.release(s)?);
        assert_eq!((slots.free(), slots.refs(s), slots.capacity()), (2, 0, 2));
        for e in [
            slots.release(s).unwrap_err(),
            slots.retain(SlotId(7)).unwrap_err(),
        ] {
            assert!(matches!(e, Error::NotAllocated { .. }), "{e}");
        }
        assert!(slots.retain(s).is_err(), "a free slot cannot be retained");
        Ok(())
    }

    /// A table grows by whole blocks, maps positions to (block, offset), shrinks on rollback, and
    /// gives every block back; an allocation that does not fit leaves it as it was.
    #[test]
    fn block_tables_grow_locate_truncate_and_release() -> Result<()> {
        let mut pool = BlockPool::new(4, 4)?;
        let mut t = BlockTable::default();
        t.reserve(5, &mut pool)?;
        assert_eq!(t.blocks(), [BlockId(0), BlockId(1)]);
        assert_eq!(t.capacity(&pool), 8);
        assert_eq!(t.locate(6, &pool), Some((BlockId(1), 2)));
        assert_eq!(t.locate(8, &pool), None);
        t.reserve(8, &mut pool)?;
        assert_eq!(t.blocks().len(), 2, "8 positions fit the two blocks");
        let before = t.clone();
        assert!(t.reserve(17, &mut pool).is_err());
        assert_eq!((t.clone(), pool.free()), (before, 2));
        t.reserve(12, &mut pool)?;
        t.truncate(5, &mut pool)?;
        assert_eq!(t.blocks(), [BlockId(0), BlockId(1)]);
        assert_eq!(pool.free(), 2);
        // A block another table shares stays allocated until both let go.
        pool.retain(BlockId(0))?;
        assert_eq!((pool.refs(BlockId(0)), pool.refs(BlockId(3))), (2, 0));
        t.release(&mut pool)?;
        assert_eq!((pool.free(), pool.refs(BlockId(0))), (3, 1));
        assert!(pool.release(BlockId(0))?);
        assert_eq!(pool.free(), pool.capacity());
        Ok(())
    }
}
