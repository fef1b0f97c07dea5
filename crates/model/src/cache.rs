//! The per-sequence cache of the whole model: KV for attention layers, GDN state for linear layers.

use qwen36_gdn::GdnState;

use crate::{KvCache, Result};

/// What one layer keeps between calls.
#[derive(Debug, Clone)]
pub enum LayerCache {
    /// Gated-attention layer: keys and values.
    Attention(KvCache),
    /// GDN layer: conv window and f32 recurrent state.
    Gdn(GdnState),
}

/// The cache for one batch of sequences that advance together. `clone()` is a cheap snapshot of
/// the GDN states (their tensors are replaced, never mutated); KV buffers are shared, which is
/// fine because restoring a snapshot also restores the shorter KV length.
#[derive(Debug, Clone)]
pub struct Cache {
    pub(crate) layers: Vec<LayerCache>,
    pub(crate) batch: usize,
    pub(crate) seq_len: usize,
}

impl Cache {
    /// Tokens already processed (the position of the next token).
    pub fn seq_len(&self) -> usize {
        self.seq_len
    }

    /// Sequences in the batch.
    pub fn batch(&self) -> usize {
        self.batch
    }

    /// Per-layer caches.
    pub fn layers(&self) -> &[LayerCache] {
        &self.layers
    }

    /// Clears everything so the next call starts a new sequence: KV lengths to 0, GDN states to zero.
    pub fn reset(&mut self) -> Result<()> {
        for l in &mut self.layers {
            match l {
                LayerCache::Attention(kv) => kv.reset(),
                LayerCache::Gdn(s) => s.reset()?,
            }
        }
        self.seq_len = 0;
        Ok(())
    }
}
