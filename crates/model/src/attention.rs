//! Gated softmax attention (ARCHITECTURE §3.1): per-head q/gate split, (1+w) q/k norms, partial
//! RoPE, GQA, causal softmax, sigmoid output gate.

use candle_core::{DType, Module, Tensor, D};
use candle_nn::Linear;
use qwen36_kernels::{norm::RmsNorm, rope::RotaryEmbedding};

use crate::{Config, KvCache, Result, Weights};

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
        let total = k.dim(2)?;
        // GQA without copying K/V: query heads h = j·g + r share KV head j, so fold the g heads of
        // a group into the row dimension: [b, nkv, g·t, hd].
        let g = nh / nkv;
        let q = q.transpose(1, 2)?.contiguous()?.reshape((b, nkv, g * t, hd))?;
        let scale = (hd as f64).powf(-0.5);
        let scores = (q.matmul(&k.t()?.contiguous()?)?.to_dtype(DType::F32)? * scale)?;
        let scores = match causal_mask(t, start, total, g, x.device())? {
            Some(mask) => scores.broadcast_add(&mask)?,
            None => scores,
        };
        let probs = candle_nn::ops::softmax_last_dim(&scores)?.to_dtype(v.dtype())?;
        let out = probs.matmul(&v.contiguous()?)?; // [b, nkv, g·t, hd]
        let out = out
            .reshape((b, nh, t, hd))?
            .transpose(1, 2)?
            .reshape((b, t, nh * hd))?;
        let out = (out * candle_nn::ops::sigmoid(&gate)?)?;
        Ok(self.o_proj.forward(&out)?)
    }
}

/// Additive mask `[g·t, total]`: row `r` is query position `start + r % t`; `None` when every
/// query may see every key (a single new token).
fn causal_mask(
    t: usize,
    start: usize,
    total: usize,
    g: usize,
    dev: &candle_core::Device,
) -> Result<Option<Tensor>> {
    if t == 1 {
        return Ok(None);
    }
    let mut m = vec![0f32; g * t * total];
    for r in 0..g * t {
        let pos = start + r % t;
        for (j, e) in m[r * total..(r + 1) * total].iter_mut().enumerate() {
            if j > pos {
                *e = f32::NEG_INFINITY;
            }
        }
    }
    Ok(Some(Tensor::from_vec(m, (g * t, total), dev)?))
}
