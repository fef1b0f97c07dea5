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

    /// Allocated positions (the buffer's length).
    pub fn capacity(&self) -> usize {
        self.k.as_ref().and_then(|t| t.dim(2).ok()).unwrap_or(0)
    }

    /// The whole key and value buffers `[batch, kv_heads, capacity, head_dim]` (positions past
    /// [`Self::len`] hold stale data), when allocated.
    pub fn buffers(&self) -> Option<(&Tensor, &Tensor)> {
        self.k.as_ref().zip(self.v.as_ref())
    }

    /// Makes room for `needed` positions of `[batch, kv_heads, ·, head_dim]` rows in `dtype` on
    /// `device` (buffers grow by doubling, keeping what they hold). A recorded CUDA graph writes
    /// into the buffers it saw: reserve before recording.
    pub fn reserve(
        &mut self,
        needed: usize,
        (b, h, d): (usize, usize, usize),
        dtype: candle_core::DType,
        device: &candle_core::Device,
    ) -> Result<()> {
        let capacity = self.capacity();
        if needed <= capacity {
            return Ok(());
        }
        let cap = needed.max(2 * capacity).max(64);
        let len = self.len;
        let grow = |old: &Option<Tensor>| -> Result<Tensor> {
            let buf = Tensor::zeros((b, h, cap, d), dtype, device)?;
            if let (Some(old), true) = (old, len > 0) {
                buf.slice_set(&old.narrow(2, 0, len)?.contiguous()?, 2, 0)?;
            }
            Ok(buf)
        };
        self.k = Some(grow(&self.k)?);
        self.v = Some(grow(&self.v)?);
        Ok(())
    }

    /// Appends `k, v: [batch, kv_heads, new, head_dim]` (the same shape) and returns all valid
    /// keys and values.
    pub fn append(&mut self, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let new = k.dim(2)?;
        let needed = self.len + new;
        let (b, h, _, d) = k.dims4()?;
        same_shape(k, v)?;
        self.reserve(needed.max(1), (b, h, d), k.dtype(), k.device())?;
        let (kb, vb) = self
            .buffers()
            .map(|(k, v)| (k.clone(), v.clone()))
            .expect("reserved");
        kb.slice_set(&k.contiguous()?, 2, self.len)?;
        vb.slice_set(&v.contiguous()?, 2, self.len)?;
        self.len = needed;
        Ok((kb.narrow(2, 0, needed)?, vb.narrow(2, 0, needed)?))
    }

    /// Like [`Self::append`], but the positions come from a tensor, `positions`: u32
    /// `[new]` holding `len..len+new` (what a recorded CUDA graph reads at replay). Returns the
    /// whole buffers (see [`Self::buffers`]).
    /// The write's kernel runs under `policy`.
    pub fn append_at(
        &mut self,
        k: &Tensor,
        v: &Tensor,
        positions: &Tensor,
        policy: &qwen36_kernels::KernelPolicy,
    ) -> Result<(Tensor, Tensor)> {
        let (b, h, new, d) = k.dims4()?;
        same_shape(k, v)?;
        self.reserve((self.len + new).max(1), (b, h, d), k.dtype(), k.device())?;
        let (kb, vb) = self
            .buffers()
            .map(|(k, v)| (k.clone(), v.clone()))
            .expect("reserved");
        qwen36_kernels::attention::write_kv(k, v, &kb, &vb, positions, policy)
            .map_err(candle_core::Error::wrap)?;
        self.len += new;
        Ok((kb, vb))
    }

    /// Counts `new` positions as written (a graph replay wrote them).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn advance(&mut self, new: usize) {
        self.len += new;
    }

    /// Sets the valid length back to `len` (after a graph's warm-up run).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn set_len(&mut self, len: usize) {
        self.len = len;
    }
}

/// An append's keys and values are shaped alike.
fn same_shape(k: &Tensor, v: &Tensor) -> Result<()> {
    if v.dims() != k.dims() {
        candle_core::bail!("values {:?} do not match keys {:?}", v.dims(), k.dims());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    /// Zero new positions on an empty cache give empty keys and values (it had found no buffer);
    /// values of another shape than the keys are refused, the length unchanged.
    #[test]
    fn appends_of_nothing_work_and_mismatched_values_are_refused() -> Result<()> {
        let dev = Device::Cpu;
        let mut kv = KvCache::new();
        let none = Tensor::zeros((1, 2, 0, 8), DType::F32, &dev)?;
        let (k, v) = kv.append(&none, &none)?;
        assert_eq!(
            (k.dims(), v.dims(), kv.len()),
            (&[1, 2, 0, 8][..], &[1, 2, 0, 8][..], 0)
        );
        let k3 = Tensor::ones((1, 2, 3, 8), DType::F32, &dev)?;
        let v1 = Tensor::ones((1, 2, 1, 8), DType::F32, &dev)?;
        assert!(kv.append(&k3, &v1).is_err());
        assert_eq!(kv.len(), 0);
        kv.append(&k3, &k3)?;
        assert_eq!(kv.len(), 3);
        Ok(())
    }
}
