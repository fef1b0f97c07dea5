//! A growable key/value cache for one attention layer.

use candle_core::{Result, Tensor};

/// Keys and values of one attention layer, `[batch, kv_heads, len, head_dim]`, stored in a buffer
/// that grows by doubling so appends are amortised O(new tokens). `truncate` is O(1): speculative
/// decoding drops rejected positions by shortening the valid length.
#[derive(Debug, Clone, Default)]
pub struct KvCache {
    k: Option<Tensor>,
    v: Option<Tensor>,
    len: usize,
}

impl KvCache {
    /// An empty cache.
    pub fn new() -> Self {
        Self::default()
    }

    /// Valid positions.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when no position is cached.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Forgets every position (keeps the buffer for reuse).
    pub fn reset(&mut self) {
        self.len = 0;
    }

    /// Keeps the first `len` positions.
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    /// Appends `k, v: [batch, kv_heads, new, head_dim]` and returns all valid keys and values.
    pub fn append(&mut self, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let new = k.dim(2)?;
        let needed = self.len + new;
        let capacity = self.k.as_ref().map(|t| t.dim(2)).transpose()?.unwrap_or(0);
        if needed > capacity {
            let cap = needed.max(2 * capacity).max(64);
            let grow = |old: &Option<Tensor>, like: &Tensor| -> Result<Tensor> {
                let (b, h, _, d) = like.dims4()?;
                let buf = Tensor::zeros((b, h, cap, d), like.dtype(), like.device())?;
                if let (Some(old), true) = (old, self.len > 0) {
                    buf.slice_set(&old.narrow(2, 0, self.len)?.contiguous()?, 2, 0)?;
                }
                Ok(buf)
            };
            self.k = Some(grow(&self.k, k)?);
            self.v = Some(grow(&self.v, v)?);
        }
        let (kb, vb) = (
            self.k.as_ref().expect("allocated"),
            self.v.as_ref().expect("allocated"),
        );
        kb.slice_set(&k.contiguous()?, 2, self.len)?;
        vb.slice_set(&v.contiguous()?, 2, self.len)?;
        self.len = needed;
        Ok((kb.narrow(2, 0, needed)?, vb.narrow(2, 0, needed)?))
    }
}
