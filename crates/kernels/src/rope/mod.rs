//! Partial rotate-half rotary position embedding (docs/MODEL.md §3.1 step 4).
//!
//! Only the first `rotary_dim` dims of each head rotate (64 of 256 for Qwen3.6, from
//! `partial_rotary_factor = 0.25`); the rest pass through. Pairs are `(i, i + rotary_dim/2)`.
//! For text-only input the interleaved mRoPE of Qwen3.6 is exactly this 1-D RoPE.
//!
//! [`reference`](mod@reference) holds the CPU forms (candle's `rope_thd`); `cuda.rs` the launcher of the fused
//! q/k norm + RoPE kernel.

#[cfg(feature = "cuda")]
mod cuda;
pub mod reference;

use candle_core::{DType, Device, Tensor, D};

use crate::norm::RmsNorm;
use crate::{expect_rank, Error, KernelPolicy, Result};

pub use reference::apply_partial_rope;

/// Inverse frequencies `θ^(-2j/rotary_dim)`, `j < rotary_dim/2`, in f32 like the reference.
#[derive(Debug, Clone)]
pub struct RotaryEmbedding {
    inv_freq: Vec<f32>,
    rotary_dim: usize,
}

impl RotaryEmbedding {
    /// `rotary_dim` must be even and positive.
    pub fn new(rotary_dim: usize, theta: f64) -> Result<Self> {
        if rotary_dim == 0 || rotary_dim % 2 != 0 {
            return Err(Error::Shape {
                op: "rope",
                msg: format!("rotary_dim must be even and positive, found {rotary_dim}"),
            });
        }
        let inv_freq = (0..rotary_dim / 2)
            .map(|j| 1.0 / (theta as f32).powf((2 * j) as f32 / rotary_dim as f32))
            .collect();
        Ok(Self { inv_freq, rotary_dim })
    }

    /// Number of rotated dims per head.
    pub fn rotary_dim(&self) -> usize {
        self.rotary_dim
    }

    /// `(cos, sin)` for positions `start..start+len`, each `[len, rotary_dim/2]`, in `dtype`.
    pub fn cos_sin(
        &self,
        start: usize,
        len: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<(Tensor, Tensor)> {
        self.cos_sin_at(start..start + len, dtype, device)
    }

    /// `(cos, sin)` for any positions (the rows of a flat batch of several sequences), each
    /// `[positions, rotary_dim/2]`, in `dtype`.
    pub fn cos_sin_at(
        &self,
        positions: impl IntoIterator<Item = usize>,
        dtype: DType,
        device: &Device,
    ) -> Result<(Tensor, Tensor)> {
        let half = self.inv_freq.len();
        let (mut cos, mut sin) = (Vec::new(), Vec::new());
        for p in positions {
            for &f in &self.inv_freq {
                let angle = p as f32 * f;
                cos.push(angle.cos());
                sin.push(angle.sin());
            }
        }
        let len = cos.len() / half;
        let cos = Tensor::from_vec(cos, (len, half), device)?.to_dtype(dtype)?;
        let sin = Tensor::from_vec(sin, (len, half), device)?.to_dtype(dtype)?;
        Ok((cos, sin))
    }

    /// Rotates the first `rotary_dim` dims of `x: [batch, len, heads, head_dim]` at positions
    /// `start..start+len`; returns the same shape and dtype.
    pub fn apply(&self, x: &Tensor, start: usize) -> Result<Tensor> {
        expect_rank("rope", "x", x, 4)?;
        let (_, len, _, head_dim) = x.dims4()?;
        if head_dim < self.rotary_dim {
            return Err(Error::Shape {
                op: "rope",
                msg: format!(
                    "head_dim {head_dim} is smaller than rotary_dim {}",
                    self.rotary_dim
                ),
            });
        }
        let (cos, sin) = self.cos_sin(start, len, x.dtype(), x.device())?;
        apply_partial_rope(x, &cos, &sin)
    }
}

/// The q or k preparation of a gated-attention layer: per-head (1+w) RMSNorm (`norm`, or none),
/// then rotate-half RoPE on the first `2 · cos.dim(1)` dims, returned head-major.
/// `x: [batch, len, n]` holds per token `heads` heads of `head_dim` elements, `head_stride` apart
/// (`heads · head_stride ≤ n`): a narrow of the fused projection rows is read in place on CUDA.
/// `cos, sin: [len, rotary_dim/2]` in `x`'s dtype. Returns `[batch, heads, len, head_dim]`. On CUDA
/// one kernel (launched under `policy`); elsewhere, and for rows the kernel does not take, the
/// composition of [`RmsNorm::forward`] and [`apply_partial_rope`] ([`reference::norm_rope_heads`]).
#[allow(clippy::too_many_arguments)]
pub fn norm_rope_heads(
    x: &Tensor,
    heads: usize,
    head_stride: usize,
    head_dim: usize,
    norm: Option<&RmsNorm>,
    cos: &Tensor,
    sin: &Tensor,
    policy: &KernelPolicy,
) -> Result<Tensor> {
    let op = "norm_rope_heads";
    expect_rank(op, "x", x, 3)?;
    let (b, t, n) = x.dims3()?;
    let half = cos.dim(D::Minus1)?;
    if heads * head_stride > n
        || head_dim > head_stride
        || 2 * half > head_dim
        || cos.dims() != [t, half]
        || sin.dims() != cos.dims()
    {
        return Err(Error::Shape {
            op,
            msg: format!(
                "x {:?} with {heads} heads of {head_dim} every {head_stride}, cos {:?}, sin {:?}",
                x.dims(),
                cos.dims(),
                sin.dims()
            ),
        });
    }
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() {
        let (scale, eps) = norm.map(|n| n.parts()).unzip();
        if let Some(y) = cuda::norm_rope_heads(
            x,
            heads,
            head_stride,
            head_dim,
            scale,
            eps.unwrap_or(0.0),
            cos,
            sin,
            policy,
        )? {
            return Ok(y);
        }
    }
    let _ = (b, t, policy);
    reference::norm_rope_heads(x, heads, head_stride, head_dim, norm, cos, sin)
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: &KernelPolicy = &KernelPolicy::DEFAULT;

    /// Naive rotate-half on one head vector.
    fn naive(x: &[f32], pos: usize, rotary_dim: usize, theta: f32) -> Vec<f32> {
        let half = rotary_dim / 2;
        let mut y = x.to_vec();
        for j in 0..half {
            let f = 1.0 / theta.powf((2 * j) as f32 / rotary_dim as f32);
            let (s, c) = (pos as f32 * f).sin_cos();
            y[j] = x[j] * c - x[j + half] * s;
            y[j + half] = x[j + half] * c + x[j] * s;
        }
        y
    }

    /// The attention layer's q preparation on a q|gate-interleaved row: each head's slot is read,
    /// (1+w) RMS-normalised and rotated like a naive per-head loop; the gate slots are skipped.
    #[test]
    fn norm_rope_heads_matches_naive_per_head() -> Result<()> {
        let (b, t, heads, hd, rd, pos) = (2, 3, 2, 8, 4, 5);
        let stride = 2 * hd;
        let n = heads * stride + 3; // a wider row, as the fused projection gives
        let data: Vec<f32> = (0..b * t * n)
            .map(|i| ((i * 29 % 13) as f32 - 6.0) / 4.0)
            .collect();
        let x = Tensor::from_vec(data.clone(), (b, t, n), &Device::Cpu)?;
        let w: Vec<f32> = (0..hd).map(|i| i as f32 / 10.0 - 0.3).collect();
        let norm = RmsNorm::zero_centred(&Tensor::new(w.as_slice(), &Device::Cpu)?, 1e-6)?;
        let rope = RotaryEmbedding::new(rd, 10_000.0)?;
        let (cos, sin) = rope.cos_sin(pos, t, DType::F32, &Device::Cpu)?;
        let y = norm_rope_heads(&x, heads, stride, hd, Some(&norm), &cos, &sin, P)?;
        assert_eq!(y.dims(), [b, heads, t, hd]);
        let got = y.flatten_all()?.to_vec1::<f32>()?;
        for bi in 0..b {
            for ti in 0..t {
                for h in 0..heads {
                    let off = (bi * t + ti) * n + h * stride;
                    let head = &data[off..off + hd];
                    let inv = 1.0 / (head.iter().map(|v| v * v).sum::<f32>() / hd as f32 + 1e-6).sqrt();
                    let normed: Vec<f32> = head.iter().zip(&w).map(|(v, wi)| v * inv * (1.0 + wi)).collect();
                    let want = naive(&normed, pos + ti, rd, 10_000.0);
                    let at = ((bi * heads + h) * t + ti) * hd;
                    for k in 0..hd {
                        assert!((got[at + k] - want[k]).abs() < 1e-5, "b{bi} t{ti} h{h} d{k}");
                    }
                }
            }
        }
        Ok(())
    }

    /// Heads that do not fit the row, or angles for another length, are shape errors.
    #[test]
    fn norm_rope_heads_rejects_bad_shapes() -> Result<()> {
        let x = Tensor::zeros((1, 2, 16), DType::F32, &Device::Cpu)?;
        let (cos, sin) = RotaryEmbedding::new(4, 10_000.0)?.cos_sin(0, 2, DType::F32, &Device::Cpu)?;
        for (heads, stride, hd) in [(3, 8, 8), (2, 8, 9)] {
            let e = norm_rope_heads(&x, heads, stride, hd, None, &cos, &sin, P).unwrap_err();
            assert!(
                matches!(
                    e,
                    Error::Shape {
                        op: "norm_rope_heads",
                        ..
                    }
                ),
                "{e}"
            );
        }
        let (c3, s3) = RotaryEmbedding::new(4, 10_000.0)?.cos_sin(0, 3, DType::F32, &Device::Cpu)?;
        assert!(norm_rope_heads(&x, 2, 8, 8, None, &c3, &s3, P).is_err());
        Ok(())
    }

    #[test]
    fn partial_rope_matches_naive_and_keeps_tail() -> Result<()> {
        let (b, t, h, d, rd) = (1, 5, 2, 8, 4);
        let data: Vec<f32> = (0..b * t * h * d)
            .map(|i| ((i * 37 % 11) as f32 - 5.0) / 3.0)
            .collect();
        let x = Tensor::from_vec(data.clone(), (b, t, h, d), &Device::Cpu)?;
        let rope = RotaryEmbedding::new(rd, 10_000.0)?;
        let y = rope.apply(&x, 7)?.flatten_all()?.to_vec1::<f32>()?;
        for ti in 0..t {
            for hi in 0..h {
                let off = (ti * h + hi) * d;
                let want = naive(&data[off..off + d], 7 + ti, rd, 10_000.0);
                for k in 0..d {
                    assert!((y[off + k] - want[k]).abs() < 1e-5, "t{ti} h{hi} d{k}");
                }
            }
        }
        Ok(())
    }
}
