//! RMSNorm variants and L2 normalisation, all computed in f32 and cast back to the input dtype.
//!
//! Qwen3.6 uses two RMSNorm conventions (docs/MODEL.md §3.2): the zero-centred `(1 + w)` norm for
//! every decoder, final and q/k norm, and a plain-weight norm gated by `silu(z)` inside GDN.
//!
//! [`reference`](mod@reference) holds the CPU forms (candle ops in f32); `cuda.rs` the launchers of cuda/norm.cu.

#[cfg(feature = "cuda")]
pub(crate) mod cuda;
pub mod reference;

use candle_core::{DType, Tensor};

use crate::{KernelPolicy, Result};

pub use reference::l2_norm;

/// Zero-centred RMSNorm (`Qwen3_5RMSNorm`, Gemma style): `y = norm(x) · (1 + w)`.
/// The stored weight is `1 + w` in f32, so the checkpoint's `w` is added to once, at load.
#[derive(Debug, Clone)]
pub struct RmsNorm {
    scale: Tensor,
    eps: f64,
    policy: KernelPolicy,
}

impl RmsNorm {
    /// Builds the norm from the checkpoint weight `w` (`[dim]`, zero-initialised in training).
    pub fn zero_centred(w: &Tensor, eps: f64) -> Result<Self> {
        let scale = (w.to_dtype(DType::F32)? + 1.0)?;
        Ok(Self {
            scale,
            eps,
            policy: KernelPolicy::DEFAULT,
        })
    }

    /// The norm with its CUDA kernels launched under `policy`.
    pub fn with_policy(self, policy: KernelPolicy) -> Self {
        Self { policy, ..self }
    }

    /// The policy its CUDA kernels run under.
    pub fn policy(&self) -> &KernelPolicy {
        &self.policy
    }

    /// The stored `1 + w` (f32 `[dim]`) and eps, for kernels that fuse the norm.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn parts(&self) -> (&Tensor, f64) {
        (&self.scale, self.eps)
    }

    /// Normalises over the last dim; `x: [..., dim]`, output in `x`'s dtype.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if x.device().is_cuda() {
            return Ok(cuda::rms_norm(x, None, &self.scale, self.eps, &self.policy)?.0);
        }
        reference::rms_norm(x, &self.scale, self.eps)
    }

    /// `forward(x + residual)`, also returning the sum (the new residual stream).
    pub fn forward_residual(&self, x: &Tensor, residual: &Tensor) -> Result<(Tensor, Tensor)> {
        #[cfg(feature = "cuda")]
        if x.device().is_cuda() && x.dims() == residual.dims() && x.dtype() == residual.dtype() {
            let (y, sum) = cuda::rms_norm(x, Some(residual), &self.scale, self.eps, &self.policy)?;
            return Ok((y, sum.expect("a residual gives a sum")));
        }
        let sum = (x + residual)?;
        Ok((self.forward(&sum)?, sum))
    }
}

/// A residual stream `x: [..., hidden]` entering a pre-norm block, with `normed`, its
/// normalisation by that block's norm, when the pass that closed the previous residual connection
/// made it (one kernel for the add and the norm, [`crate::linear::Linear::forward_add_norm`]).
#[derive(Debug, Clone)]
pub struct Stream {
    /// The residual stream.
    pub x: Tensor,
    /// `x` normalised by the norm of the block it enters, when already computed.
    pub normed: Option<Tensor>,
    /// That normalisation left to the CUDA tile kernels of the block's first projection, when
    /// the kernel that wrote `x` prepared it.
    pub deferred: Option<DeferredNorm>,
}

/// A residual stream's RMSNorm left to the tile kernels that read it (CUDA, 1..8 rows): the
/// kernel writing the stream `x: [rows, d]` also wrote `scaled = x ⊙ g` (g the norm's scale,
/// rounded to x's dtype) and each row's sums of squares of x by 16-column part, `sumsq: [rows,
/// ⌈d/16⌉]` f32; a projection reading `scaled` multiplies each row's sums by `1 / rms(x)` (the
/// parts summed in one fixed order). That is `norm(x)`'s projection with one rounding moved (at `x·g`
/// instead of `x·g/rms`), the same for every row count, and no norm launch.
#[derive(Debug, Clone)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub struct DeferredNorm {
    pub(crate) scaled: Tensor,
    pub(crate) sumsq: Tensor,
    pub(crate) eps: f64,
}

impl Stream {
    /// A stream whose normalisation is still to be computed.
    pub fn new(x: Tensor) -> Self {
        Self {
            x,
            normed: None,
            deferred: None,
        }
    }

    /// A stream with its normalisation by the norm of the block it enters.
    pub fn with_normed(x: Tensor, normed: Tensor) -> Self {
        Self {
            x,
            normed: Some(normed),
            deferred: None,
        }
    }

    /// The deferred normalisation, for a block that opens with `norm` (which must be the norm it
    /// was prepared with, as for `normed`); `None` without one.
    pub fn deferred(&self, norm: Option<&RmsNorm>) -> Option<&DeferredNorm> {
        norm.and(self.deferred.as_ref())
    }

    /// What a block's first projection reads, with the norm it must still apply: with the block's
    /// `norm`, the normalisation made with the stream (no norm left) or `x` and `norm`; without
    /// one (a layer outside a block), `x`.
    pub fn input<'a>(&'a self, norm: Option<&'a RmsNorm>) -> (&'a Tensor, Option<&'a RmsNorm>) {
        match (norm, &self.normed) {
            (Some(_), Some(normed)) => (normed, None),
            (norm, _) => (&self.x, norm),
        }
    }

    /// `norm.forward(x)`: the normalisation made with the stream, else a pass of `norm` (which
    /// must be the block's norm that `normed` was made with).
    pub fn normed_by(&self, norm: &RmsNorm) -> Result<Tensor> {
        match &self.normed {
            Some(n) => Ok(n.clone()),
            None => norm.forward(&self.x),
        }
    }
}

/// Gated RMSNorm (`Qwen3_5RMSNormGated`): `y = (w ⊙ norm(x)) ⊙ silu(z)`, plain weight, not `1 + w`.
#[derive(Debug, Clone)]
pub struct GatedRmsNorm {
    weight: Tensor,
    eps: f64,
    policy: KernelPolicy,
}

impl GatedRmsNorm {
    /// Builds the norm from the checkpoint weight `w` (`[dim]`, initialised to ones).
    pub fn new(w: &Tensor, eps: f64) -> Result<Self> {
        Ok(Self {
            weight: w.to_dtype(DType::F32)?,
            eps,
            policy: KernelPolicy::DEFAULT,
        })
    }

    /// The norm with its CUDA kernel launched under `policy`.
    pub fn with_policy(self, policy: KernelPolicy) -> Self {
        Self { policy, ..self }
    }

    /// The policy its CUDA kernel runs under.
    pub fn policy(&self) -> &KernelPolicy {
        &self.policy
    }

    /// `x: [..., heads, dim]`, `z`: the same shape or with the last two dims merged (`[..., heads·dim]`,
    /// as the projection gives it: on CUDA a narrow of the projection is read in place); the output
    /// has `x`'s shape and `out_dtype`. `x` may be f32 (the GDN read-out) to avoid an f16 overflow
    /// before normalisation (docs/MODEL.md §6 pitfall 3).
    pub fn forward(&self, x: &Tensor, z: &Tensor, out_dtype: DType) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if x.device().is_cuda()
            && x.dtype() == DType::F32
            && z.dtype() == out_dtype
            && z.elem_count() == x.elem_count()
        {
            return cuda::gated_rms_norm(x, z, &self.weight, self.eps, &self.policy);
        }
        reference::gated_rms_norm(x, z, &self.weight, self.eps, out_dtype)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn naive_rms(x: &[f32], eps: f32) -> Vec<f32> {
        let ms = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
        x.iter().map(|v| v / (ms + eps).sqrt()).collect()
    }

    #[test]
    fn zero_centred_uses_one_plus_w() -> Result<()> {
        let x = [1.0f32, -2.0, 3.0, 0.5];
        let w = [0.1f32, -0.2, 0.0, 0.3];
        let norm = RmsNorm::zero_centred(&Tensor::new(&w, &Device::Cpu)?, 1e-6)?;
        let y = norm.forward(&Tensor::new(&x, &Device::Cpu)?)?.to_vec1::<f32>()?;
        let n = naive_rms(&x, 1e-6);
        for i in 0..4 {
            assert!(
                (y[i] - n[i] * (1.0 + w[i])).abs() < 1e-6,
                "{i}: {} vs {}",
                y[i],
                n[i] * (1.0 + w[i])
            );
        }
        Ok(())
    }

    /// Half-precision rows are normalised in f32 and rounded once: the output equals an f64
    /// computation rounded to the dtype (a norm summed in the half dtype moves a third of the
    /// elements by an ulp). Rounding f64 instead of f32 may flip a tie-near element by one ulp.
    #[test]
    fn half_rows_normalise_in_f32_and_round_once() -> Result<()> {
        let dev = Device::Cpu;
        let (rows, dim) = (8, 256);
        let x = qwen36_testutil::randn(11, 3.0, (rows, dim), &dev)?;
        let w = qwen36_testutil::randn(12, 0.2, dim, &dev)?;
        let norm = RmsNorm::zero_centred(&w, 1e-6)?;
        let wv = w.to_vec1::<f32>()?;
        for dt in [DType::BF16, DType::F16] {
            let xh = x.to_dtype(dt)?;
            let y = norm.forward(&xh)?.to_dtype(DType::F32)?.to_vec2::<f32>()?;
            let xs = xh.to_dtype(DType::F32)?.to_vec2::<f32>()?;
            let mut want = Vec::new();
            for row in &xs {
                let ms = row.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / dim as f64;
                let inv = 1.0 / (ms + 1e-6).sqrt();
                want.extend(
                    row.iter()
                        .zip(&wv)
                        .map(|(&v, &w)| (v as f64 * inv * (1.0 + w as f64)) as f32),
                );
            }
            let want = Tensor::from_vec(want, (rows, dim), &dev)?
                .to_dtype(dt)?
                .to_dtype(DType::F32)?;
            let want = want.to_vec2::<f32>()?;
            let ulp = if dt == DType::BF16 {
                2f32.powi(-7)
            } else {
                2f32.powi(-10)
            };
            let mut differ = 0;
            for (a, b) in y.iter().flatten().zip(want.iter().flatten()) {
                if a != b {
                    differ += 1;
                    assert!((a - b).abs() <= ulp * b.abs(), "{dt:?}: {a} vs {b}");
                }
            }
            assert!(
                differ <= rows * dim / 100,
                "{dt:?}: {differ} of {} elements differ",
                rows * dim
            );
        }
        Ok(())
    }

    #[test]
    fn gated_uses_plain_weight_and_silu_gate() -> Result<()> {
        let x = [1.0f32, -2.0, 3.0, 0.5];
        let z = [0.5f32, -1.0, 2.0, 0.0];
        let w = [1.5f32, 0.5, -1.0, 2.0];
        let dev = Device::Cpu;
        let norm = GatedRmsNorm::new(&Tensor::new(&w, &dev)?, 1e-6)?;
        let y = norm
            .forward(&Tensor::new(&x, &dev)?, &Tensor::new(&z, &dev)?, DType::F32)?
            .to_vec1::<f32>()?;
        let n = naive_rms(&x, 1e-6);
        for i in 0..4 {
            let silu = z[i] / (1.0 + (-z[i]).exp());
            let want = w[i] * n[i] * silu;
            assert!((y[i] - want).abs() < 1e-6, "{i}: {} vs {want}", y[i]);
        }
        Ok(())
    }

    #[test]
    fn l2_norm_gives_unit_rows() -> Result<()> {
        let x = Tensor::new(&[[3.0f32, 4.0], [0.0, 2.0]], &Device::Cpu)?;
        let y = l2_norm(&x, 0.0)?.to_vec2::<f32>()?;
        assert_eq!(y, vec![vec![0.6, 0.8], vec![0.0, 1.0]]);
        Ok(())
    }
}
