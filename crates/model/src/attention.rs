//! Gated softmax attention (docs/MODEL.md §3.1): per-head q/gate split, (1+w) q/k norms, partial
//! RoPE, GQA, causal softmax, sigmoid output gate.

use candle_core::{DType, Device, Tensor, D};
use qwen36_kernels::attention::{
    causal_softmax, decode_attention, decode_attention_fits, paged_decode_attention, prefill_attention,
    prefill_attention_fits, write_kv_rows, AttentionInputs, Pages,
};
use qwen36_kernels::norm::{RmsNorm, Stream};
use qwen36_kernels::rope::norm_rope_heads;
use qwen36_kernels::{linear::Linear, rope::RotaryEmbedding, KernelPolicy};

use crate::{Config, KvCache, Result, Weights};

/// Elements of one query block's score matrix `[batch, heads, block, keys]` (the CPU path also
/// holds it in f32: 1 GiB).
const SCORE_BUDGET: usize = 1 << 28;
/// The most new tokens a pass may have to use the decode kernel (a decode step, an MTP verify).
const DECODE_MAX_TOKENS: usize = 8;

/// What every attention layer of one forward shares: the RoPE angles of the new positions, and
/// the positions and the valid length as device tensors, which the KV write and the decode kernel
/// read (so a recorded CUDA graph replays at any position once they are rewritten).
#[derive(Debug, Clone)]
pub(crate) struct AttnStep {
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    tokens: usize,
    /// `[tokens, rotary_dim/2]` in the activation dtype.
    cos: Tensor,
    sin: Tensor,
    /// u32 `[tokens]`: the new positions `start..start+tokens`.
    positions: Tensor,
    /// u32 `[1]`: `start + tokens`, the valid keys once the new ones are written.
    len: Tensor,
}

impl AttnStep {
    /// The step of `tokens` new positions after `start` cached ones.
    pub(crate) fn new(
        rope: &RotaryEmbedding,
        start: usize,
        tokens: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let (cos, sin) = rope.cos_sin(start, tokens, dtype, device)?;
        let positions: Vec<u32> = (start..start + tokens).map(|p| p as u32).collect();
        Ok(Self {
            tokens,
            cos,
            sin,
            positions: Tensor::new(positions.as_slice(), device)?,
            len: Tensor::new(&[(start + tokens) as u32], device)?,
        })
    }

    /// New tokens of the step.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn tokens(&self) -> usize {
        self.tokens
    }

    /// Copies `src` (same token count) into this step's buffers, in place.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn write_from(&self, src: &AttnStep) -> Result<()> {
        for (dst, src) in [
            (&self.cos, &src.cos),
            (&self.sin, &src.sin),
            (&self.positions, &src.positions),
            (&self.len, &src.len),
        ] {
            dst.slice_set(src, 0, 0)?;
        }
        Ok(())
    }
}

/// The new tokens' heads: q `[b, nh, t, hd]` and k `[b, nkv, t, hd]` normalised and rotated, v
/// `[b, nkv, t, hd]` and the output gate `[b, t, nh, hd]` (views of the projection `proj`, `[b,
/// t, (2·nh + 2·nkv)·hd]`).
struct Heads {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    gate: Tensor,
    proj: Tensor,
}

impl Heads {
    /// Rows `row..row+len` of a flat batch (`b = 1`).
    fn rows(&self, row: usize, len: usize) -> Result<Self> {
        Ok(Self {
            q: self.q.narrow(2, row, len)?,
            k: self.k.narrow(2, row, len)?,
            v: self.v.narrow(2, row, len)?,
            gate: self.gate.narrow(1, row, len)?,
            proj: self.proj.narrow(1, row, len)?,
        })
    }
}

/// One part of a flat batch for the attention layers ([`GatedAttention::forward_paged_block`]),
/// in row order.
#[derive(Debug, Clone)]
pub(crate) enum AttnPart {
    /// `batch` sequences of `t` new tokens each, attended in one paged decode launch.
    Decode {
        batch: usize,
        t: usize,
        /// u32 `[batch, max blocks]`: their block tables.
        tables: Tensor,
        /// u32 `[batch]`: their positions once the new ones are written.
        lens: Tensor,
        block_size: usize,
    },
    /// One sequence attending over its positions gathered from the pools.
    Seq(PagedSeq),
}

/// One sequence's part of a flat batch with paged K/V ([`GatedAttention::forward_paged_block`]).
#[derive(Debug, Clone)]
pub(crate) struct PagedSeq {
    /// Positions before the new tokens.
    pub start: usize,
    /// New tokens (the sequence's rows of the batch).
    pub len: usize,
    /// u32 `[start + len]`: the pool row of every position.
    pub rows: Tensor,
}

/// One gated-attention mixer.
#[derive(Debug, Clone)]
pub struct GatedAttention {
    /// `q_proj` (queries and gates, `[2·nh·hd, hidden]`), `k_proj`, `v_proj` stacked: one read.
    qkv_proj: Linear,
    o_proj: Linear,
    q_norm: RmsNorm,
    k_norm: RmsNorm,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    policy: KernelPolicy,
}

impl GatedAttention {
    /// Loads `{prefix}q_proj.weight` etc.; `prefix` is a full tensor-name prefix ending in
    /// `self_attn.` (main layers and the MTP layer share this code).
    pub fn load(cfg: &Config, w: &Weights, prefix: &str) -> Result<Self> {
        let get = |name: &str, shape: &[usize]| w.get(name, shape, w.options().dtype);
        let policy = w.options().kernels;
        let (h, nh, nkv, hd) = (
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        );
        let linear = |name: &str, out: usize, inp: usize| -> Result<Linear> {
            let weight = w.linear(&format!("{prefix}{name}"), &[out, inp], cfg.quantization.as_ref())?;
            let bias = if cfg.attention_bias {
                Some(get(&format!("{prefix}{name}.bias"), &[out])?)
            } else {
                None
            };
            Ok(Linear::from_weight(weight, bias).with_policy(policy))
        };
        let eps = cfg.rms_norm_eps;
        let norm = |name: &str| -> Result<RmsNorm> {
            let w = get(&format!("{prefix}{name}.weight"), &[hd])?;
            Ok(RmsNorm::zero_centred(&w, eps)?.with_policy(policy))
        };
        Ok(Self {
            qkv_proj: Linear::fused(vec![
                linear("q_proj", nh * hd * 2, h)?,
                linear("k_proj", nkv * hd, h)?,
                linear("v_proj", nkv * hd, h)?,
            ])?,
            o_proj: linear("o_proj", h, nh * hd)?,
            q_norm: norm("q_norm")?,
            k_norm: norm("k_norm")?,
            n_heads: nh,
            n_kv_heads: nkv,
            head_dim: hd,
            policy,
        })
    }

    /// The layer as a tensor-parallel rank's part other than the first: its output projection
    /// gives a partial sum without the residual.
    pub fn partial_sum(self) -> Self {
        Self {
            o_proj: self.o_proj.partial_sum(),
            ..self
        }
    }

    /// The policies of every kernel-launching part (tests check that loading set them all).
    #[cfg(test)]
    pub(crate) fn policies(&self) -> Vec<KernelPolicy> {
        let parts = [
            self.qkv_proj.policy(),
            self.o_proj.policy(),
            self.q_norm.policy(),
            self.k_norm.policy(),
        ];
        parts.into_iter().copied().chain([self.policy]).collect()
    }

    /// `x: [batch, len, hidden]` at positions `cache.len()..`; appends to `cache`.
    pub fn forward(&self, x: &Tensor, rope: &RotaryEmbedding, cache: &mut KvCache) -> Result<Tensor> {
        let step = AttnStep::new(rope, cache.len(), x.dim(1)?, x.dtype(), x.device())?;
        self.forward_step(x, &step, cache)
    }

    /// True when a pass of `tokens` new tokens in `dtype` on `device` runs the decode kernel (on
    /// CUDA, up to [`DECODE_MAX_TOKENS`]); otherwise the matmul path runs.
    pub(crate) fn uses_decode_kernel(&self, tokens: usize, dtype: DType, device: &Device) -> bool {
        let rows = tokens * self.n_heads / self.n_kv_heads;
        device.is_cuda() && tokens <= DECODE_MAX_TOKENS && decode_attention_fits(rows, self.head_dim, dtype)
    }

    /// [`Self::forward`] with the positions of `step` (which must start at `cache.len()`).
    pub(crate) fn forward_step(&self, x: &Tensor, step: &AttnStep, cache: &mut KvCache) -> Result<Tensor> {
        let kernel = self.uses_decode_kernel(x.dim(1)?, x.dtype(), x.device());
        let x = Stream::new(x.clone());
        Ok(self.forward_with(&x, None, step, cache, kernel, SCORE_BUDGET)?.x)
    }

    /// The pre-norm residual block around [`Self::forward_step`]: `x + forward_step(norm(x))` for
    /// the residual stream `x` (its normalisation taken from the stream when it comes with it),
    /// as the stream entering the block whose norm is `next`; the norm done by the q|k|v
    /// projection as it reads `x` and the residual added by the output projection as it writes,
    /// where the kernels allow (CUDA, one row).
    pub(crate) fn forward_step_block(
        &self,
        x: &Stream,
        (norm, next): (&RmsNorm, Option<&RmsNorm>),
        step: &AttnStep,
        cache: &mut KvCache,
    ) -> Result<Stream> {
        let kernel = self.uses_decode_kernel(x.x.dim(1)?, x.x.dtype(), x.x.device());
        self.forward_with(x, Some((norm, next)), step, cache, kernel, SCORE_BUDGET)
    }

    /// The layer (with `block`, its norm and the next block's: the residual block around it, as
    /// the stream entering the next block) with the decode kernel over the whole KV buffer
    /// (`kernel`), else the prefill kernel where it fits (CUDA, half types), else the matmul path
    /// with its queries split so one block's scores hold at most `budget` elements.
    fn forward_with(
        &self,
        x: &Stream,
        block: Option<(&RmsNorm, Option<&RmsNorm>)>,
        step: &AttnStep,
        cache: &mut KvCache,
        kernel: bool,
        budget: usize,
    ) -> Result<Stream> {
        let start = cache.len();
        let heads = self.project(x, block.map(|(norm, _)| norm), &step.cos, &step.sin)?;
        let out = if kernel {
            let (kb, vb) = cache.append_at(&heads.k, &heads.v, &step.positions, &self.policy)?;
            self.attend_new(&heads, &kb, &vb, start, Some(&step.len), budget)?
        } else {
            let (k, v) = cache.append(&heads.k, &heads.v)?; // [b, nkv, L, hd]
            self.attend_new(&heads, &k, &v, start, None, budget)?
        };
        self.output(&out, x, block.map(|(_, next)| next))
    }

    /// The pre-norm residual block over a flat batch of several sequences (`x: [1, rows,
    /// hidden]`, `cos, sin: [rows, rotary_dim/2]` at each row's position) with paged K/V:
    /// `k_pool, v_pool: [pool rows, kv_heads, head_dim]`, a position's row given by its
    /// sequence's block table. The projections read all rows at once and every row's key and
    /// value go to its pool row (`kv_rows`, u32 `[rows]`) in one write; then each part attends:
    /// a decode group in one paged launch, any other sequence over its gathered positions with
    /// the kernels a pass of its length takes alone. Returns the stream entering the block whose
    /// norm is `next` ([`Linear::forward_add_norm`]).
    pub(crate) fn forward_paged_block(
        &self,
        x: &Stream,
        (norm, next): (&RmsNorm, Option<&RmsNorm>),
        (cos, sin): (&Tensor, &Tensor),
        (kv_rows, parts): (&Tensor, &[AttnPart]),
        (k_pool, v_pool): (&Tensor, &Tensor),
    ) -> Result<Stream> {
        let heads = self.project(x, Some(norm), cos, sin)?;
        let p = &self.policy;
        write_kv_rows(
            &heads.k.squeeze(0)?,
            &heads.v.squeeze(0)?,
            k_pool,
            v_pool,
            kv_rows,
            p,
        )?;
        let (nh, nkv, hd) = (self.n_heads, self.n_kv_heads, self.head_dim);
        let scale = (hd as f64).powf(-0.5);
        let mut outs = Vec::with_capacity(parts.len());
        let mut row = 0;
        for part in parts {
            match part {
                AttnPart::Decode {
                    batch,
                    t,
                    tables,
                    lens,
                    block_size,
                } => {
                    let (b, t) = (*batch, *t);
                    let rows = heads.rows(row, b * t)?;
                    // [nh, b·t, hd] → [b, nkv, g·t, hd], rows member·t + token (one copy).
                    let q = rows
                        .q
                        .squeeze(0)?
                        .reshape((nh, b, t, hd))?
                        .transpose(0, 1)?
                        .contiguous()?
                        .reshape((b, nkv, nh / nkv * t, hd))?;
                    // The gate as a view of this part's projection rows, [b, t, nh, hd].
                    let gate = self.gate_of(&rows.proj.reshape((b, t, ()))?)?;
                    let pages = Pages {
                        tables,
                        lens,
                        block_size: *block_size,
                    };
                    let x = AttentionInputs::new(&q, k_pool, v_pool, Some(&gate), scale);
                    let out = paged_decode_attention(x, pages, t, p)?;
                    outs.push(out.reshape((1, b * t, nh, hd))?);
                    row += b * t;
                }
                AttnPart::Seq(s) => {
                    let part = heads.rows(row, s.len)?;
                    // Every position of the sequence, head-major: [1, nkv, start + len, hd].
                    let gather = |pool: &Tensor| -> Result<Tensor> {
                        Ok(pool
                            .index_select(&s.rows, 0)?
                            .transpose(0, 1)?
                            .unsqueeze(0)?
                            .contiguous()?)
                    };
                    let (k, v) = (gather(k_pool)?, gather(v_pool)?);
                    let len = if self.uses_decode_kernel(s.len, x.x.dtype(), x.x.device()) {
                        Some(Tensor::new(&[(s.start + s.len) as u32], x.x.device())?)
                    } else {
                        None
                    };
                    outs.push(self.attend_new(&part, &k, &v, s.start, len.as_ref(), SCORE_BUDGET)?);
                    row += s.len;
                }
            }
        }
        self.output(&Tensor::cat(&outs, 1)?, x, Some(next))
    }

    /// The output gate `[b, t, nh, hd]` as a view of the projection `proj: [b, t, width]`:
    /// q_proj rows are `[q_h0 | gate_h0 | q_h1 | gate_h1 | ...]`, and the whole row `[q|gate per
    /// head | k | v]` is nh + nkv blocks of 2·hd, so a free reshape exposes the gates.
    fn gate_of(&self, proj: &Tensor) -> Result<Tensor> {
        let (b, t, _) = proj.dims3()?;
        let (nh, nkv, hd) = (self.n_heads, self.n_kv_heads, self.head_dim);
        Ok(proj
            .reshape((b, t, nh + nkv, 2 * hd))?
            .narrow(2, 0, nh)?
            .narrow(3, hd, hd)?)
    }

    /// The q|k|v projection of `x: [b, t, hidden]` (with `block`, of `block(x)`: the stream's
    /// own normalisation when it has one, else normalised as the projection reads it) split into
    /// heads, q and k normalised and rotated by `cos, sin: [t, rotary_dim/2]`.
    fn project(&self, x: &Stream, block: Option<&RmsNorm>, cos: &Tensor, sin: &Tensor) -> Result<Heads> {
        let (b, t, _) = x.x.dims3()?;
        let (nh, nkv, hd) = (self.n_heads, self.n_kv_heads, self.head_dim);
        let qkv = self.qkv_proj.forward_stream(x, block)?;
        let (qd, kd) = (2 * nh * hd, nkv * hd);
        // q_proj rows are [q_h0 | gate_h0 | q_h1 | gate_h1 | ...]: split per head, not flat; the
        // gates are a strided view [b, t, nh, hd] (no copy).
        let qg = qkv.narrow(D::Minus1, 0, qd)?;
        let gate = self.gate_of(&qkv)?;
        // Likewise in blocks of hd the values are blocks 2·nh + nkv.. of each row.
        let v = qkv
            .reshape((b, t, 2 * (nh + nkv), hd))?
            .narrow(2, 2 * nh + nkv, nkv)?;
        // Per-head norm + RoPE, head-major, read from the projection rows: [b, nh | nkv, t, hd].
        let p = &self.policy;
        let q = norm_rope_heads(&qg, nh, 2 * hd, hd, Some(&self.q_norm), cos, sin, p)?;
        let kx = qkv.narrow(D::Minus1, qd, kd)?;
        let k = norm_rope_heads(&kx, nkv, hd, hd, Some(&self.k_norm), cos, sin, p)?;
        let v = v.transpose(1, 2)?; // [b, nkv, t, hd], a view the cache copies once
        Ok(Heads {
            q,
            k,
            v,
            gate,
            proj: qkv,
        })
    }

    /// Gated causal attention of the new tokens `heads` (at positions `start..start+t`) over
    /// the keys and values `k, v: [b, nkv, L, hd]` of every position (theirs written): with
    /// `len` (u32 `[1]`, the valid length; `k, v` may be longer) the decode kernel, else the
    /// prefill kernel where it fits, else the matmul path in query blocks of about `budget`
    /// scores. Returns `[b, t, nh, hd]`.
    fn attend_new(
        &self,
        heads: &Heads,
        k: &Tensor,
        v: &Tensor,
        start: usize,
        len: Option<&Tensor>,
        budget: usize,
    ) -> Result<Tensor> {
        let (b, _, t, hd) = heads.q.dims4()?;
        let (nh, nkv) = (self.n_heads, self.n_kv_heads);
        let scale = (hd as f64).powf(-0.5);
        let (p, gate) = (&self.policy, &heads.gate);
        Ok(if let Some(len) = len {
            // Rows r = member·t + token of each KV head's group, as the kernel wants them.
            let q = heads.q.reshape((b, nkv, nh / nkv * t, hd))?;
            // The kernel applies the gate as it writes.
            decode_attention(AttentionInputs::new(&q, k, v, Some(gate), scale), len, t, p)?
        } else if prefill_attention_fits(hd, heads.q.dtype(), heads.q.device()) {
            // The kernel applies the gate as it writes.
            prefill_attention(AttentionInputs::new(&heads.q, k, v, Some(gate), scale), start, p)?
                .transpose(1, 2)?
        } else {
            let out = self.attend_blocks(&heads.q, k, v, start, budget)?;
            (out.transpose(1, 2)? * candle_nn::ops::sigmoid(gate)?)?
        })
    }

    /// The output projection of the attention output `out: [b, t, nh, hd]` (with `block`,
    /// adding the residual stream `x` as the stream entering the block of the norm it holds).
    fn output(&self, out: &Tensor, x: &Stream, block: Option<Option<&RmsNorm>>) -> Result<Stream> {
        let (b, t, _) = x.x.dims3()?;
        let out = out.reshape((b, t, self.n_heads * self.head_dim))?;
        Ok(match block {
            Some(next) => self.o_proj.forward_add_norm(&out, &x.x, next)?,
            None => Stream::new(self.o_proj.forward(&out)?),
        })
    }

    /// Causal attention of `q: [b, nh, t, hd]` at positions `start..` over all cached `k, v`
    /// `[b, nkv, L, hd]`, in query blocks that bound the f32 score matrix (about `budget`
    /// elements) so long prompts fit. Returns `[b, nh, t, hd]`.
    fn attend_blocks(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        start: usize,
        budget: usize,
    ) -> Result<Tensor> {
        let (b, nh, t, _) = q.dims4()?;
        let total = k.dim(2)?;
        let block = (budget / (b * nh * total).max(1)).clamp(1, t);
        // Whole multiples of 64 queries where the budget allows: from a cache length that is a
        // multiple of 8, every block's key count then is one too, so the score rows stay 16-byte
        // aligned (cuBLAS's vectorised kernels, the vector softmax) instead of odd widths.
        let block = if block >= 64 && block < t {
            block / 64 * 64
        } else {
            block
        };
        let mut outs = Vec::with_capacity(t.div_ceil(block));
        for t0 in (0..t).step_by(block) {
            let tb = block.min(t - t0);
            // Keys after the block's last query are masked for every row: leave them out.
            let visible = start + t0 + tb;
            outs.push(self.attend(&q.narrow(2, t0, tb)?, k, v, start + t0, visible)?);
        }
        Ok(if outs.len() == 1 {
            outs.pop().expect("one block")
        } else {
            Tensor::cat(&outs, 2)?
        })
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
        // Scores in the activation dtype (as the reference's matmul gives them); scale, causal
        // mask and softmax in f32 in one op.
        let scores = q.matmul(&k.t()?)?;
        let probs = causal_softmax(&scores, scale, pos0, tb, &self.policy)?;
        let out = probs.matmul(&v)?; // [b, nkv, g·tb, hd]
        Ok(out.reshape((b, nh, tb, hd))?)
    }
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
            qkv_proj: Linear::fused(vec![
                w(nh * hd * 2, h, 0.1)?,
                w(nkv * hd, h, 0.2)?,
                w(nkv * hd, h, 0.3)?,
            ])?,
            o_proj: w(h, nh * hd, 0.4)?,
            q_norm: RmsNorm::zero_centred(&norm_w, 1e-6)?,
            k_norm: RmsNorm::zero_centred(&norm_w, 1e-6)?,
            n_heads: nh,
            n_kv_heads: nkv,
            head_dim: hd,
            policy: KernelPolicy::DEFAULT,
        })
    }

    /// One pass at positions `cache.len()..` through the kernel path or the matmul path.
    fn pass(
        attn: &GatedAttention,
        rope: &RotaryEmbedding,
        x: &Tensor,
        cache: &mut KvCache,
        kernel: bool,
        budget: usize,
    ) -> Result<Tensor> {
        let step = AttnStep::new(rope, cache.len(), x.dim(1)?, x.dtype(), x.device())?;
        Ok(attn
            .forward_with(&Stream::new(x.clone()), None, &step, cache, kernel, budget)?
            .x)
    }

    /// The decode path (KV written at tensor positions, the decode attention reference over the
    /// whole buffer with the length as a tensor) equals the matmul path for one-token steps and
    /// a 3-token verify after a prefix, including across a buffer growth (capacity 64).
    #[test]
    fn decode_path_matches_matmul_path() -> Result<()> {
        let dev = Device::Cpu;
        let attn = attention(&dev)?;
        let rope = RotaryEmbedding::new(4, 10_000.0)?;
        let x = qwen36_testutil::randn(601, 1.0, (2, 70, 16), &dev)?;
        let (mut a, mut b) = (KvCache::new(), KvCache::new());
        let prefix = x.narrow(1, 0, 60)?;
        pass(&attn, &rope, &prefix, &mut a, false, usize::MAX)?;
        pass(&attn, &rope, &prefix, &mut b, false, usize::MAX)?;
        for (t0, len) in [(60, 1), (61, 3), (64, 1), (65, 5)] {
            let xs = x.narrow(1, t0, len)?;
            let want = pass(&attn, &rope, &xs, &mut a, false, usize::MAX)?;
            let got = pass(&attn, &rope, &xs, &mut b, true, usize::MAX)?;
            let diff = qwen36_testutil::max_abs_diff(&got, &want);
            assert!(diff < 1e-5, "tokens {t0}..+{len}: max diff {diff}");
            assert_eq!(a.len(), b.len());
        }
        assert!(b.capacity() > 64, "the verify grew the buffer");
        Ok(())
    }

    /// The residual block is `x + forward_step(norm(x))`, on the CPU the same ops: equal bits, for
    /// a prefill and a decode step; a stream that comes with its normalisation enters as that, and
    /// with a next norm the output comes with its own (the add and the norm in one pass).
    #[test]
    fn block_is_the_residual_around_the_normalised_layer() -> Result<()> {
        let dev = Device::Cpu;
        let attn = attention(&dev)?;
        let rope = RotaryEmbedding::new(4, 10_000.0)?;
        let norm = RmsNorm::zero_centred(&qwen36_testutil::randn(602, 0.3, 16, &dev)?, 1e-6)?;
        let next = RmsNorm::zero_centred(&qwen36_testutil::randn(605, 0.3, 16, &dev)?, 1e-6)?;
        let x = qwen36_testutil::randn(603, 1.0, (2, 9, 16), &dev)?;
        let (mut a, mut b) = (KvCache::new(), KvCache::new());
        for (t0, len, then) in [(0, 8, None), (8, 1, Some(&next))] {
            let xs = x.narrow(1, t0, len)?;
            let step = AttnStep::new(&rope, a.len(), len, xs.dtype(), xs.device())?;
            // The second pass's input comes normalised by another norm, which it must take.
            let input = match then {
                None => Stream::new(xs.clone()),
                Some(n) => Stream::with_normed(xs.clone(), n.forward(&xs)?),
            };
            let normed = input.normed_by(&norm)?;
            let want = (&xs + attn.forward_step(&normed, &step, &mut a)?)?;
            let got = attn.forward_step_block(&input, (&norm, then), &step, &mut b)?;
            assert_eq!(
                qwen36_testutil::max_abs_diff(&got.x, &want),
                0.0,
                "tokens {t0}..+{len}"
            );
            match then {
                Some(n) => {
                    let normed = got.normed.expect("normed");
                    assert_eq!(qwen36_testutil::max_abs_diff(&normed, &n.forward(&want)?), 0.0);
                }
                None => assert!(got.normed.is_none()),
            }
        }
        Ok(())
    }

    /// Query blocks (down to one query per block, after a cached prefix) give the same output as
    /// one block: the device-built mask and the per-block key range are right.
    #[test]
    fn query_blocks_match_one_block() -> Result<()> {
        let dev = Device::Cpu;
        let attn = attention(&dev)?;
        let rope = RotaryEmbedding::new(4, 10_000.0)?;
        let x = qwen36_testutil::randn(604, 1.0, (2, 13, 16), &dev)?;
        let (prefix, rest) = (x.narrow(1, 0, 5)?, x.narrow(1, 5, 8)?);
        let run = |budget: usize| -> Result<Tensor> {
            let mut cache = KvCache::new();
            pass(&attn, &rope, &prefix, &mut cache, false, usize::MAX)?;
            pass(&attn, &rope, &rest, &mut cache, false, budget)
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
