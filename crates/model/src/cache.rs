//! The per-sequence cache of the whole model: KV for attention layers, GDN state for linear layers.

use qwen36_gdn::{GdnState, VerifyCheckpoints};

use crate::{Error, KvCache, Result};

/// Checkpoints of the last verify pass, until it is committed.
#[derive(Debug, Clone)]
pub(crate) struct Pending {
    /// Sequence length before the pass.
    pub base: usize,
    /// Tokens the pass ran.
    pub len: usize,
    /// Per layer: the GDN checkpoints (`None` for attention layers).
    pub checkpoints: Vec<Option<VerifyCheckpoints>>,
}

/// What one layer keeps between calls.
#[derive(Debug, Clone)]
pub enum LayerCache {
    /// Gated-attention layer: keys and values.
    Attention(KvCache),
    /// GDN layer: conv window and f32 recurrent state.
    Gdn(GdnState),
}

/// The cache for one batch of sequences that advance together. `clone()` is a cheap snapshot of
/// the GDN states (their tensors are replaced, never mutated) while no state is in place (a
/// recorded CUDA graph's: `DecodeGraph` turns it on); KV buffers are shared, so a snapshot's keys
/// and values hold only until the live cache writes positions below its length again (restoring
/// it, then running on from there, is exact: its length is restored too).
#[derive(Debug, Clone)]
pub struct Cache {
    pub(crate) layers: Vec<LayerCache>,
    pub(crate) batch: usize,
    pub(crate) seq_len: usize,
    pub(crate) pending: Option<Pending>,
    /// Tests only: the fault of the model that made it.
    #[cfg(feature = "fault-injection")]
    pub(crate) fault: Option<crate::Fault>,
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
        #[cfg(feature = "fault-injection")]
        let keep_states = self.fault == Some(crate::Fault::NoReset);
        #[cfg(not(feature = "fault-injection"))]
        let keep_states = false;
        for l in &mut self.layers {
            match l {
                LayerCache::Attention(kv) => kv.reset(),
                LayerCache::Gdn(_) if keep_states => {}
                LayerCache::Gdn(s) => s.reset()?,
            }
        }
        self.seq_len = 0;
        self.pending = None;
        Ok(())
    }

    /// After [`crate::Qwen36Model::forward_verify`] over `k+1` tokens: keeps the first `keep`
    /// (1..=k+1) of them. GDN layers restore the state after token `keep-1` exactly (a copy of the
    /// pass's checkpoint), attention layers drop the later KV positions.
    pub fn commit(&mut self, keep: usize) -> Result<()> {
        self.commit_with(keep, true)
    }

    /// [`Self::commit`]; without `copies`, only its bookkeeping (a recorded CUDA graph makes the
    /// copies).
    pub(crate) fn commit_with(&mut self, keep: usize, copies: bool) -> Result<()> {
        let p = self
            .pending
            .take()
            .ok_or_else(|| Error::Cache("commit without a verify pass before it".into()))?;
        #[cfg(feature = "fault-injection")]
        let keep = match self.fault {
            Some(crate::Fault::WrongRollback) => (keep + 1).min(p.len),
            _ => keep,
        };
        if keep == 0 || keep > p.len {
            let len = p.len;
            self.pending = Some(p);
            return Err(Error::Cache(format!(
                "cannot keep {keep} of the {len} verified tokens"
            )));
        }
        // Every layer checked before any moves: an error leaves the cache as the pass left it.
        if p.checkpoints.len() != self.layers.len() {
            let n = p.checkpoints.len();
            self.pending = Some(p);
            return Err(Error::Cache(format!(
                "a verify of {n} layers' checkpoints for a cache of {} layers",
                self.layers.len()
            )));
        }
        for (layer, cp) in self.layers.iter().zip(&p.checkpoints) {
            let fits = match (layer, cp) {
                (LayerCache::Attention(_), _) => Ok(()),
                (LayerCache::Gdn(s), Some(cp)) => s.check_commit(cp, keep),
                (LayerCache::Gdn(_), None) => {
                    Err(qwen36_gdn::Error::State("GDN layer without checkpoints".into()))
                }
            };
            if let Err(e) = fits {
                self.pending = Some(p);
                return Err(e.into());
            }
        }
        for (layer, cp) in self.layers.iter_mut().zip(&p.checkpoints) {
            match (layer, cp) {
                (LayerCache::Attention(kv), _) => kv.truncate(p.base + keep),
                (LayerCache::Gdn(s), Some(cp)) if copies => s.commit(cp, keep)?,
                (LayerCache::Gdn(s), Some(cp)) => s.commit_replayed(cp, keep)?,
                (LayerCache::Gdn(_), None) => {
                    return Err(Error::Cache("GDN layer without checkpoints".into()))
                }
            }
        }
        self.seq_len = p.base + keep;
        #[cfg(feature = "fault-injection")]
        if self.fault == Some(crate::Fault::Bf16State) {
            for l in &mut self.layers {
                if let LayerCache::Gdn(s) = l {
                    let rounded = s
                        .recurrent()
                        .to_dtype(candle_core::DType::BF16)?
                        .to_dtype(candle_core::DType::F32)?;
                    *s = qwen36_gdn::GdnState::from_parts(s.conv().clone(), rounded, s.seen())?;
                }
            }
        }
        Ok(())
    }

    /// The checkpoints of the pending verify pass, when there is one.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn pending_checkpoints(&self) -> Option<&[Option<VerifyCheckpoints>]> {
        self.pending.as_ref().map(|p| p.checkpoints.as_slice())
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Tensor};

    use super::*;

    /// A commit whose GDN checkpoints do not fit the layer's state, or that has checkpoints for
    /// fewer layers (a broken pending), is refused before anything moves: the attention layer
    /// before it keeps its positions, the sequence its length, and the verify stays pending.
    #[test]
    fn a_commit_that_does_not_fit_changes_nothing() -> Result<()> {
        let dev = Device::Cpu;
        let zeros = |shape: &[usize]| Tensor::zeros(shape, DType::F32, &dev);
        let mut kv = KvCache::new();
        kv.append(&zeros(&[1, 1, 6, 4])?, &zeros(&[1, 1, 6, 4])?)?;
        let state = GdnState::from_parts(zeros(&[1, 3, 2])?, zeros(&[1, 2, 2, 2])?, 3)?;
        // Recurrent states of dv 3 where the state has 2.
        let cp = VerifyCheckpoints::from_buffers(zeros(&[1, 3, 2, 2, 3])?, zeros(&[1, 3, 5])?)?;
        let mut cache = Cache {
            layers: vec![LayerCache::Attention(kv), LayerCache::Gdn(state)],
            batch: 1,
            seq_len: 6,
            pending: Some(Pending {
                base: 3,
                len: 3,
                checkpoints: vec![None, Some(cp)],
            }),
            #[cfg(feature = "fault-injection")]
            fault: None,
        };
        let err = cache.commit(1).unwrap_err();
        assert!(err.to_string().contains("do not fit"), "{err}");
        let LayerCache::Attention(kv) = &cache.layers[0] else {
            unreachable!()
        };
        assert_eq!((kv.len(), cache.seq_len(), cache.pending.is_some()), (6, 6, true));
        // Checkpoints for fewer layers than the cache has: refused too.
        if let Some(p) = cache.pending.as_mut() {
            p.checkpoints.pop();
        }
        assert!(cache.commit(1).is_err());
        let LayerCache::Attention(kv) = &cache.layers[0] else {
            unreachable!()
        };
        assert_eq!((kv.len(), cache.pending.is_some()), (6, true));
        Ok(())
    }
}
