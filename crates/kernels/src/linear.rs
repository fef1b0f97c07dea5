//! Linear layers `y = x·wᵀ (+ b)`. The reference is candle's matmul (what `candle_nn::Linear`
//! runs); on CUDA, calls with at most [`SKINNY_MAX_ROWS`] rows (decode, MTP verify) go to a
//! weight-streaming kernel instead, because cuBLAS reads the weights at only ~84% of the copy
//! bandwidth on those shapes (PERF-ANCHORS) and decode is nothing but reading weights.

use std::sync::atomic::{AtomicUsize, Ordering};

use candle_core::{Module, Tensor};

use crate::{Error, Result};

/// The most rows (`batch · len`) a call may have to use the CUDA weight-streaming kernel.
pub const SKINNY_MAX_ROWS: usize = 8;

/// 0: pick the kernel variant by row count; 1, 2, 4: columns per warp; anything else: no kernel.
static SKINNY_VARIANT: AtomicUsize = AtomicUsize::new(0);

/// Benchmark knob (process-wide): `Some(c)` forces the CUDA kernel variant computing `c` ∈ {1, 2,
/// 4} output columns per warp, or with any other `c` the matmul; `None` restores the default.
#[doc(hidden)]
pub fn force_skinny_variant(columns_per_warp: Option<usize>) {
    SKINNY_VARIANT.store(columns_per_warp.unwrap_or(0), Ordering::Relaxed);
}

/// Output columns per warp of the CUDA kernel for `rows` rows of outputs `columns` wide, or
/// `None` for the matmul.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn skinny_variant(rows: usize, columns: usize) -> Option<usize> {
    match SKINNY_VARIANT.load(Ordering::Relaxed) {
        // Measured on the H200 (docs/BENCHMARKS.md, bench_linear): at one row the kernel beats
        // cuBLAS by 0-10% with one column per warp, or two for 8k-32k wide outputs; from two
        // rows on cuBLAS is as fast or faster.
        0 if rows == 1 && (8192..32768).contains(&columns) => Some(2),
        0 if rows == 1 => Some(1),
        0 => None,
        c @ (1 | 2 | 4) => Some(c),
        _ => None,
    }
}

/// A linear layer; the weight is `[out, in]` as in checkpoints.
#[derive(Debug, Clone)]
pub struct Linear {
    inner: candle_nn::Linear,
}

impl Linear {
    /// `weight: [out, in]`, `bias: [out]`.
    pub fn new(weight: Tensor, bias: Option<Tensor>) -> Self {
        Self {
            inner: candle_nn::Linear::new(weight, bias),
        }
    }

    /// Several layers with the same input as one: weights (and biases) stacked along `out` in the
    /// given order, so one pass reads every weight once. Split the output with
    /// [`Tensor::narrow`] on the last dim at the running sums of [`Self::out_features`].
    pub fn fused(parts: Vec<Linear>) -> Result<Self> {
        let Some(first) = parts.first() else {
            return Err(Error::Shape {
                op: "Linear::fused",
                msg: "no layers to fuse".into(),
            });
        };
        let has_bias = first.bias().is_some();
        if parts.iter().any(|p| p.bias().is_some() != has_bias) {
            return Err(Error::Shape {
                op: "Linear::fused",
                msg: "either every layer has a bias or none has".into(),
            });
        }
        if parts.len() == 1 {
            return Ok(parts.into_iter().next().expect("one layer"));
        }
        let weights: Vec<&Tensor> = parts.iter().map(|p| p.weight()).collect();
        let weight = Tensor::cat(&weights, 0)?;
        let bias = if has_bias {
            let biases: Vec<&Tensor> = parts.iter().filter_map(|p| p.bias()).collect();
            Some(Tensor::cat(&biases, 0)?)
        } else {
            None
        };
        Ok(Self::new(weight, bias))
    }

    /// `[out, in]`.
    pub fn weight(&self) -> &Tensor {
        self.inner.weight()
    }

    /// `[out]`, when the layer has one.
    pub fn bias(&self) -> Option<&Tensor> {
        self.inner.bias()
    }

    /// Output features (`out`).
    pub fn out_features(&self) -> usize {
        self.weight().dim(0).unwrap_or(0)
    }

    /// `x: [..., in]` → `[..., out]`, in `x`'s dtype (which must be the weight's).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if let Some(y) = self.forward_skinny(x)? {
            return Ok(y);
        }
        // candle's CUDA matmul rejects some strided inputs (a row view at an odd offset, say).
        Ok(self.inner.forward(&x.contiguous()?)?)
    }

    /// The CUDA weight-streaming path, when it applies (few rows, matching dtypes, 16-byte
    /// aligned rows); `None` otherwise.
    #[cfg(feature = "cuda")]
    fn forward_skinny(&self, x: &Tensor) -> Result<Option<Tensor>> {
        let w = self.weight();
        if !x.device().is_cuda() || x.dtype() != w.dtype() || x.rank() == 0 {
            return Ok(None);
        }
        let k = x.dim(candle_core::D::Minus1)?;
        let rows = x.elem_count() / k.max(1);
        if rows == 0 || rows > SKINNY_MAX_ROWS || w.dim(1)? != k {
            return Ok(None);
        }
        let Some(columns) = skinny_variant(rows, w.dim(0)?) else {
            return Ok(None);
        };
        let x2 = x.contiguous()?.reshape((rows, k))?;
        let Some(y) = crate::cuda::skinny_linear(&x2, w, columns)? else {
            return Ok(None);
        };
        let mut dims = x.dims().to_vec();
        *dims.last_mut().expect("rank > 0") = w.dim(0)?;
        let y = y.reshape(dims)?;
        Ok(Some(match self.bias() {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        }))
    }
}

impl Module for Linear {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        Linear::forward(self, x).map_err(|e| match e {
            Error::Candle(e) => e,
            other => candle_core::Error::Msg(other.to_string()),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    #[test]
    fn fused_layer_equals_its_parts() -> Result<()> {
        let dev = Device::Cpu;
        let x = Tensor::randn(0f32, 1.0, (2, 3, 16), &dev)?;
        let parts: Vec<Linear> = [5usize, 7, 1]
            .iter()
            .map(|&o| -> Result<Linear> {
                Ok(Linear::new(
                    Tensor::randn(0f32, 1.0, (o, 16), &dev)?,
                    Some(Tensor::randn(0f32, 1.0, o, &dev)?),
                ))
            })
            .collect::<Result<_>>()?;
        let fused = Linear::fused(parts.clone())?;
        let y = fused.forward(&x)?;
        let mut at = 0;
        for p in &parts {
            let want = p.forward(&x)?;
            let got = y.narrow(2, at, p.out_features())?;
            let diff = (got - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert!(diff < 1e-5, "fused slice at {at} differs by {diff}");
            at += p.out_features();
        }
        assert_eq!(at, y.dim(2)?);
        Ok(())
    }

    #[test]
    fn fusing_needs_consistent_biases() -> Result<()> {
        let dev = Device::Cpu;
        let w = Tensor::zeros((2, 4), DType::F32, &dev)?;
        let with = Linear::new(w.clone(), Some(Tensor::zeros(2, DType::F32, &dev)?));
        let without = Linear::new(w, None);
        let e = Linear::fused(vec![with, without]).unwrap_err();
        assert!(e.to_string().contains("bias"), "{e}");
        assert!(Linear::fused(vec![]).is_err());
        Ok(())
    }
}
