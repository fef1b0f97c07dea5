//! Gated softmax attention (ARCHITECTURE §3.1): per-head q/gate split, (1+w) q/k norms, partial
//! RoPE, GQA, causal softmax, sigmoid output gate.

use candle_core::{DType, Module, Tensor, D};
use candle_nn::Linear;
use qwen36_kernels::{norm::RmsNorm, rope::RotaryEmbedding};

use crate::{Config, KvCache, Result, Weights};

/// Elements of one query block's f32 score matrix `[batch, heads, block, keys]` (1 GiB).
const SCORE_BUDGET: usize = 1 << 28;

/// One gated-attention mixer.
#[derive(Debug, Clone)]
pub struct GatedAttention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    q_norm: RmsNorm,
    k_norm: RmsNorm,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
}

impl GatedAttention {
    /// Loads `{prefix}q_proj.weight` etc.; `prefix` is a full tensor-name prefix ending in
    /// `self_attn.` (main layers and the MTP layer share this code).
    pub fn load(cfg: &Config, w: &Weights, prefix: &str) -> Result<Self> {
        let get = |name: &str, shape: &[usize]| w.get(name, shape, w.options().dtype);
        let (h, nh, nkv, hd) = (
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        );
        let linear = |name: &str, out: usize, inp: usize| -> Result<Linear> {
            let weight = get(&format!("{prefix}{name}.weight"), &[out, inp])?;
            let bias = if cfg.attention_bias {
                Some(get(&format!("{prefix}{name}.bias"), &[out])?)
            } else {
                None
            };
            Ok(Linear::new(weight, bias))
        };
        let eps = cfg.rms_norm_eps;
        Ok(Self {
            q_proj: linear("q_proj", nh * hd * 2, h)?,
            k_proj: linear("k_proj", nkv * hd, h)?,
            v_proj: linear("v_proj", nkv * hd, h)?,
            o_proj: linear("o_proj", h, nh * hd)?,
            q_norm: RmsNorm::zero_centred(&get(&format!("{prefix}q_norm.weight"), &[hd])?, eps)?,
            k_norm: RmsNorm::zero_centred(&get(&format!("{prefix}k_norm.weight"), &[hd])?, eps)?,
            n_heads: nh,
            n_kv_heads: nkv,
            head_dim: hd,
        })
    }

    /// `x: [batch, len, hidden]` at positions `cache.len()..`; appends to `cache`.
    pub fn forward(&self, x: &Tensor, rope: &RotaryEmbedding, cache: &mut KvCache) -> Result<Tensor> {
        self.forward_blocked(x, rope, cache, SCORE_BUDGET)
    }

    /// [`Self::forward`] with queries split so one block's scores hold at most `budget` elements.
    fn forward_blocked(
        &self,
        x: &Tensor,
        rope: &RotaryEmbedding,
        cache: &mut KvCache,
        budget: usize,
    ) -> Result<Tensor> {
        let (b, t, _) = x.dims3()?;
        let (nh, nkv, hd) = (self.n_heads, self.n_kv_heads, self.head_dim);
        let start = cache.len();
        // q_proj rows are [q_h0 | gate_h0 | q_h1 | gate_h1 | ...]: split per head, not flat.
        let qg = self.q_proj.forward(x)?.reshape((b, t, nh, 2 * hd))?;
        let q = qg.narrow(D::Minus1, 0, hd)?;
        let gate = qg.narrow(D::Minus1, hd, hd)?.reshape((b, t, nh * hd))?;
        let q = rope.apply(&self.q_norm.forward(&q)?, start)?;
        let k = self.k_proj.forward(x)?.reshape((b, t, nkv, hd))?;
        let k = rope.apply(&self.k_norm.forward(&k)?, start)?;
        let v = self.v_proj.forward(x)?.reshape((b, t, nkv, hd))?;

        let (k, v) = cache.append(&k.transpose(1, 2)?, &v.transpose(1, 2)?)?; // [b, nkv, L, hd]
        let q = q.transpose(1, 2)?.contiguous()?; // [b, nh, t, hd]
                                                  // Query blocks bound the f32 score matrix (about 2^28 elements) so long prompts fit.
        let total = k.dim(2)?;
        let block = (budget / (b * nh * total).max(1)).clamp(1, t);
        let mut outs = Vec::with_capacity(t.div_ceil(block));
        for t0 in (0..t).step_by(block) {
            let tb = block.min(t - t0);
            // Keys after the block's last query are masked for every row: leave them out.
            let visible = start + t0 + tb;
            outs.push(self.attend(&q.narrow(2, t0, tb)?, &k, &v, start + t0, visible)?);
        }
        let out = if outs.len() == 1 {
            outs.pop().expect("one block")
        } else {
            Tensor::cat(&outs, 2)?
        };
        let out = out.transpose(1, 2)?.reshape((b, t, nh * hd))?;
        let out = (out * candle_nn::ops::sigmoid(&gate)?)?;
        Ok(self.o_proj.forward(&out)?)
    }

    /// Causal attention of queries `q: [b, nh, tb, hd]` at positions `pos0..pos0+tb` over the first
    /// `visible` cached keys/values `[b, nkv, L, hd]`; returns `[b, nh, tb, hd]`.
    fn attend(&self, q: &Tensor, k: &Tensor, v: &Tensor, pos0: usize, visible: usize) -> Result<Tensor> {
        let (b, _, tb, hd) = q.dims4()?;
        let (nh, nkv) = (self.n_heads, self.n_kv_heads);
        let (k, v) = (k.narrow(2, 0, visible)?, v.narrow(2, 0, visible)?);
        // GQA without copying K/V: query heads h = j·g + r share KV head j, so fold the g heads of
        // a group into the row dimension: [b, nkv, g·tb, hd].
        let g = nh / nkv;
        let q = q.contiguous()?.reshape((b, nkv, g * tb, hd))?;
        let scale = (hd as f64).powf(-0.5);
        // K and V stay views into the cache buffer: both matmul backends take the per-head row
        // stride and the transposed K as they are (copying them cost O(context) per step).
        let scores = (q.matmul(&k.t()?)?.to_dtype(DType::F32)? * scale)?;
        let scores = match causal_mask(tb, pos0, visible, g, q.device())? {
            Some(mask) => scores.broadcast_add(&mask)?,
            None => scores,
        };
        let probs = candle_nn::ops::softmax_last_dim(&scores)?.to_dtype(v.dtype())?;
        let out = probs.matmul(&v)?; // [b, nkv, g·tb, hd]
        Ok(out.reshape((b, nh, tb, hd))?)
    }
}

/// Additive mask `[g·tb, keys]` built on the device: row `r` is the query at position
/// `pos0 + r % tb` and sees keys `0..=pos0 + r % tb`. `None` when every row sees every key.
fn causal_mask(
    tb: usize,
    pos0: usize,
    keys: usize,
    g: usize,
    dev: &candle_core::Device,
) -> Result<Option<Tensor>> {
    if pos0 + tb == keys && tb == 1 {
        return Ok(None);
    }
    let pos = Tensor::arange(pos0 as u32, (pos0 + tb) as u32, dev)?
        .repeat(g)?
        .reshape((g * tb, 1))?;
    let key = Tensor::arange(0u32, keys as u32, dev)?.reshape((1, keys))?;
    // A large finite negative rather than -inf: exp underflows to exactly 0 either way, and
    // 0 * -inf would be NaN.
    let future = key.broadcast_gt(&pos)?.to_dtype(DType::F32)?;
    Ok(Some((future * -1e30)?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn attention(dev: &Device) -> Result<GatedAttention> {
        let (h, nh, nkv, hd) = (16, 4, 2, 8);
        let w = |o: usize, i: usize, seed: f32| -> Result<Linear> {
            let n = o * i;
            let v: Vec<f32> = (0..n).map(|j| (j as f32 * 0.37 + seed).sin() * 0.3).collect();
            Ok(Linear::new(Tensor::from_vec(v, (o, i), dev)?, None))
        };
        let norm_w = Tensor::from_vec((0..hd).map(|j| j as f32 * 0.01).collect(), hd, dev)?;
        Ok(GatedAttention {
            q_proj: w(nh * hd * 2, h, 0.1)?,
            k_proj: w(nkv * hd, h, 0.2)?,
            v_proj: w(nkv * hd, h, 0.3)?,
            o_proj: w(h, nh * hd, 0.4)?,
            q_norm: RmsNorm::zero_centred(&norm_w, 1e-6)?,
            k_norm: RmsNorm::zero_centred(&norm_w, 1e-6)?,
            n_heads: nh,
            n_kv_heads: nkv,
            head_dim: hd,
        })
    }

    /// Query blocks (down to one query per block, after a cached prefix) give the same output as
    /// one block: the device-built mask and the per-block key range are right.
    #[test]
    fn query_blocks_match_one_block() -> Result<()> {
        let dev = Device::Cpu;
        let attn = attention(&dev)?;
        let rope = RotaryEmbedding::new(4, 10_000.0)?;
        let x = Tensor::randn(0f32, 1.0, (2, 13, 16), &dev)?;
        let (prefix, rest) = (x.narrow(1, 0, 5)?, x.narrow(1, 5, 8)?);
        let run = |budget: usize| -> Result<Tensor> {
            let mut cache = KvCache::new();
            attn.forward_blocked(&prefix, &rope, &mut cache, usize::MAX)?;
            attn.forward_blocked(&rest, &rope, &mut cache, budget)
        };
        let whole = run(usize::MAX)?;
        // 2 batches × 4 heads × 13 keys: budgets of 1, 3 and 8 query rows per block.
        for budget in [1, 2 * 4 * 13 * 3, 2 * 4 * 13 * 8 - 1] {
            let blocked = run(budget)?;
            let diff = qwen36_testutil::max_abs_diff(&blocked, &whole);
            assert!(diff < 1e-6, "budget {budget}: max diff {diff}");
        }
        Ok(())
    }
}
