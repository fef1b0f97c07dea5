//! Linear layers `y = x·wᵀ (+ b)`. The reference is candle's matmul (what `candle_nn::Linear`
//! runs, [`reference::linear`]); on CUDA, calls with one row (decode) go to a weight-streaming
//! kernel instead (`cuda.rs`), because cuBLAS reads the weights at only ~84% of the copy bandwidth
//! on those shapes (PERF-ANCHORS) and decode is nothing but reading weights.

#[cfg(feature = "cuda")]
mod cuda;
pub mod reference;

use candle_core::{Module, Tensor};

use crate::norm::RmsNorm;
use crate::policy::SkinnyPath;
use crate::{Error, KernelPolicy, Result};

/// The most rows (`batch · len`) a call may have to use the CUDA weight-streaming kernel.
pub const SKINNY_MAX_ROWS: usize = crate::consts::LINEAR_MAX_ROWS;

/// Columns per warp of the streaming kernel for `rows` rows of outputs `columns` wide under `path`,
/// or `None` for the matmul. Measured on the H200 (docs/BENCHMARKS.md,
/// bench_linear): at one row the kernel beats cuBLAS by 0-10% with one column per warp, or two for
/// 8k-32k wide outputs. From two rows on cuBLAS: the kernel for 2..8 rows (on tensor cores in
/// bf16/f16) beats it in isolation at two rows but not inside the verify's graph, and from three
/// rows on not at all.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn streaming_columns(path: SkinnyPath, rows: usize, columns: usize) -> Option<usize> {
    match path {
        SkinnyPath::Auto | SkinnyPath::Multi(_) if rows == 1 && (8192..32768).contains(&columns) => Some(2),
        SkinnyPath::Auto | SkinnyPath::Multi(_) if rows == 1 => Some(1),
        SkinnyPath::Streaming(c) | SkinnyPath::Multi(c) => Some(c),
        SkinnyPath::Auto | SkinnyPath::Matmul => None,
    }
}

/// `x`'s dims with the last replaced by `n` (an output of `n` features per row).
#[cfg(feature = "cuda")]
fn out_dims(x: &Tensor, n: usize) -> Vec<usize> {
    let mut dims = x.dims().to_vec();
    if let Some(last) = dims.last_mut() {
        *last = n;
    }
    dims
}

/// A linear layer; the weight is `[out, in]` as in checkpoints.
#[derive(Debug, Clone)]
pub struct Linear {
    inner: candle_nn::Linear,
    policy: KernelPolicy,
}

impl Linear {
    /// `weight: [out, in]`, `bias: [out]`.
    pub fn new(weight: Tensor, bias: Option<Tensor>) -> Self {
        Self {
            inner: candle_nn::Linear::new(weight, bias),
            policy: KernelPolicy::DEFAULT,
        }
    }

    /// The layer with its CUDA kernels chosen and launched under `policy`.
    pub fn with_policy(self, policy: KernelPolicy) -> Self {
        Self { policy, ..self }
    }

    /// The policy its CUDA calls run under.
    pub fn policy(&self) -> &KernelPolicy {
        &self.policy
    }

    /// Several layers with the same input as one: weights (and biases) stacked along `out` in the
    /// given order, so one pass reads every weight once (under the first layer's policy). Split the
    /// output with [`Tensor::narrow`] on the last dim at the running sums of [`Self::out_features`].
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
        let policy = first.policy;
        let weights: Vec<&Tensor> = parts.iter().map(|p| p.weight()).collect();
        let weight = Tensor::cat(&weights, 0)?;
        let bias = if has_bias {
            let biases: Vec<&Tensor> = parts.iter().filter_map(|p| p.bias()).collect();
            Some(Tensor::cat(&biases, 0)?)
        } else {
            None
        };
        Ok(Self::new(weight, bias).with_policy(policy))
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
        if let Some((y, _)) = self.forward_skinny(x, None, None)? {
            return Ok(y);
        }
        reference::linear(&self.inner, x)
    }

    /// `self.forward(norm.forward(x))`: the projection that opens a pre-norm block. On CUDA one
    /// row goes through the streaming kernel that normalises `x` as it reads it (the same bits as
    /// the two steps, one kernel fewer); otherwise the two steps.
    pub fn forward_normed(&self, x: &Tensor, norm: &RmsNorm) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if let Some((y, _)) = self.forward_skinny(x, None, Some(norm))? {
            return Ok(y);
        }
        self.forward(&norm.forward(x)?)
    }

    /// `swiglu(self.forward(x))` for a layer whose outputs are `[gate | up]` halves (the MLP's
    /// fused gate and up projections): `silu(gate) · up`, `[..., out / 2]`. On CUDA one row goes
    /// through the streaming kernel with the activation in its epilogue (no rounding of the
    /// halves, no second pass); otherwise the two steps.
    pub fn forward_swiglu(&self, x: &Tensor) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if let Some(y) = self.forward_skinny_swiglu(x, None)? {
            return Ok(y);
        }
        crate::activation::swiglu(&self.forward(x)?, &self.policy)
    }

    /// `self.forward_swiglu(norm.forward(x))`, on CUDA for one row in one kernel that normalises
    /// `x` as it reads it (as [`Self::forward_normed`]).
    pub fn forward_swiglu_normed(&self, x: &Tensor, norm: &RmsNorm) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if let Some(y) = self.forward_skinny_swiglu(x, Some(norm))? {
            return Ok(y);
        }
        self.forward_swiglu(&norm.forward(x)?)
    }

    /// The one-row SwiGLU kernel when it applies (the streaming kernel's conditions, one row, no
    /// bias), normalising `x` first when given `norm`; `None` for the two steps.
    #[cfg(feature = "cuda")]
    fn forward_skinny_swiglu(&self, x: &Tensor, norm: Option<&RmsNorm>) -> Result<Option<Tensor>> {
        let Some((rows, k, n, _)) = self.skinny_operands(x)? else {
            return Ok(None);
        };
        if rows != 1 || n % 2 != 0 || self.bias().is_some() {
            return Ok(None);
        }
        let x2 = x.contiguous()?.reshape((1, k))?;
        let what = cuda::Skinny::SwiGlu;
        let Some(y) = cuda::skinny_linear(&x2, self.weight(), what, norm.map(RmsNorm::parts), &self.policy)?
        else {
            return Ok(None);
        };
        Ok(Some(y.reshape(out_dims(x, n / 2))?))
    }

    /// `(rows, in, out, columns per warp)` when the CUDA streaming kernel takes `x` (a CUDA tensor
    /// of the weight's dtype, 1..=[`SKINNY_MAX_ROWS`] rows, the path not switched off by the
    /// policy); `None` for the matmul.
    #[cfg(feature = "cuda")]
    fn skinny_operands(&self, x: &Tensor) -> Result<Option<(usize, usize, usize, usize)>> {
        let w = self.weight();
        if !x.device().is_cuda() || x.dtype() != w.dtype() || x.rank() == 0 {
            return Ok(None);
        }
        let k = x.dim(candle_core::D::Minus1)?;
        let rows = x.elem_count() / k.max(1);
        let n = w.dim(0)?;
        if rows == 0 || rows > SKINNY_MAX_ROWS || w.dim(1)? != k {
            return Ok(None);
        }
        Ok(streaming_columns(self.policy.skinny, rows, n).map(|columns| (rows, k, n, columns)))
    }

    /// `residual + self.forward(x)` (`residual` shaped like the output): a residual connection
    /// closing with this layer. On CUDA the few-row kernels add it as they write, saving a pass.
    pub fn forward_add(&self, x: &Tensor, residual: &Tensor) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if let Some((y, added)) = self.forward_skinny(x, Some(residual), None)? {
            return Ok(if added { y } else { (residual + y)? });
        }
        Ok((residual + reference::linear(&self.inner, x)?)?)
    }

    /// The CUDA streaming kernel, when it applies ([`streaming_columns`], matching dtypes,
    /// 16-byte aligned rows; with `norm`, the normalising kernel's conditions too): the output and
    /// whether `residual` was added into it; `None` for the matmul (and the separate norm).
    #[cfg(feature = "cuda")]
    fn forward_skinny(
        &self,
        x: &Tensor,
        residual: Option<&Tensor>,
        norm: Option<&RmsNorm>,
    ) -> Result<Option<(Tensor, bool)>> {
        let Some((rows, k, n, columns)) = self.skinny_operands(x)? else {
            return Ok(None);
        };
        let dims = out_dims(x, n);
        // The residual rides along when nothing else (a bias) comes between.
        let r2 = match residual {
            Some(r) if r.dims() != dims.as_slice() => {
                return Err(Error::Shape {
                    op: "Linear::forward_add",
                    msg: format!("residual {:?} for an output {dims:?}", r.dims()),
                })
            }
            Some(r) if self.bias().is_none() => Some(r.contiguous()?.reshape((rows, n))?),
            _ => None,
        };
        let x2 = x.contiguous()?.reshape((rows, k))?;
        let what = cuda::Skinny::Linear {
            res: r2.as_ref(),
            columns,
        };
        let Some(y) = cuda::skinny_linear(&x2, self.weight(), what, norm.map(RmsNorm::parts), &self.policy)?
        else {
            return Ok(None);
        };
        let y = y.reshape(dims)?;
        Ok(Some(match self.bias() {
            Some(b) => (y.broadcast_add(b)?, false),
            None => (y, r2.is_some()),
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

    /// The one-row default measured on the H200 (2 columns per warp for 8k-32k wide outputs, else
    /// 1; cuBLAS from two rows on), and the other paths.
    #[test]
    fn streaming_columns_follow_the_measured_default_or_the_chosen_path() {
        use SkinnyPath::*;
        assert_eq!(streaming_columns(Auto, 1, 16480), Some(2));
        assert_eq!(streaming_columns(Auto, 1, 5120), Some(1));
        assert_eq!(streaming_columns(Auto, 1, 248320), Some(1));
        assert_eq!(streaming_columns(Auto, 2, 5120), None);
        assert_eq!(streaming_columns(Matmul, 1, 5120), None);
        assert_eq!(streaming_columns(Streaming(4), 3, 5120), Some(4));
        assert_eq!(streaming_columns(Multi(4), 1, 5120), Some(1));
        assert_eq!(streaming_columns(Multi(4), 4, 5120), Some(4));
    }

    /// A layer keeps its policy when fused (the first part's) and a fresh one has the default.
    #[test]
    fn fused_layers_keep_the_first_policy() -> Result<()> {
        let dev = Device::Cpu;
        let w = Tensor::zeros((2, 4), DType::F32, &dev)?;
        let policy = KernelPolicy {
            skinny: SkinnyPath::Matmul,
            ..KernelPolicy::DEFAULT
        };
        assert_eq!(Linear::new(w.clone(), None).policy(), &KernelPolicy::DEFAULT);
        let parts = vec![
            Linear::new(w.clone(), None).with_policy(policy),
            Linear::new(w, None),
        ];
        assert_eq!(Linear::fused(parts)?.policy(), &policy);
        Ok(())
    }

    /// The normalising kernel takes one row up to its bound (so the GPU suite's bit-identity test,
    /// `normalising_projection_equals_norm_then_projection`, compares the kernel, not the
    /// fallback with itself) and declines what it cannot do. Needs a GPU (the `cuda` suites).
    #[cfg(feature = "cuda")]
    #[test]
    fn normalising_kernel_takes_one_row_within_its_bound() -> Result<()> {
        let d = Device::new_cuda(0)?;
        let norm_for = |k: usize| RmsNorm::zero_centred(&Tensor::zeros(k, DType::F32, &d)?, 1e-6);
        for (rows, k, dt, takes) in [
            (1, 5120, DType::BF16, true),
            (1, 8192, DType::BF16, true),
            (1, 4096, DType::F32, true),
            (1, 8200, DType::BF16, false),
            (1, 5120, DType::F32, false),
            (2, 5120, DType::BF16, false),
        ] {
            let x = Tensor::zeros((rows, k), dt, &d)?;
            let w = Tensor::zeros((64, k), dt, &d)?;
            let norm = norm_for(k)?;
            for what in [
                cuda::Skinny::Linear {
                    res: None,
                    columns: 2,
                },
                cuda::Skinny::SwiGlu,
            ] {
                if rows > 1 && matches!(what, cuda::Skinny::SwiGlu) {
                    continue;
                }
                let got = cuda::skinny_linear(&x, &w, what, Some(norm.parts()), &KernelPolicy::DEFAULT)?;
                assert_eq!(got.is_some(), takes, "rows {rows} k {k} {dt:?}");
            }
        }
        Ok(())
    }

    #[test]
    fn fused_layer_equals_its_parts() -> Result<()> {
        let dev = Device::Cpu;
        let x = qwen36_testutil::randn(401, 1.0, (2, 3, 16), &dev)?;
        let parts: Vec<Linear> = [5usize, 7, 1]
            .iter()
            .map(|&o| -> Result<Linear> {
                Ok(Linear::new(
                    qwen36_testutil::randn(402, 1.0, (o, 16), &dev)?,
                    Some(qwen36_testutil::randn(403, 1.0, o, &dev)?),
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

    /// `forward_add` is the residual plus the layer's output, with or without a bias; a residual
    /// of another shape is an error.
    #[test]
    fn forward_add_adds_the_residual() -> Result<()> {
        let dev = Device::Cpu;
        let x = qwen36_testutil::randn(404, 1.0, (1, 2, 16), &dev)?;
        let r = qwen36_testutil::randn(405, 1.0, (1, 2, 5), &dev)?;
        let w = qwen36_testutil::randn(406, 1.0, (5, 16), &dev)?;
        for bias in [None, Some(qwen36_testutil::randn(407, 1.0, 5, &dev)?)] {
            let lin = Linear::new(w.clone(), bias);
            let want = (lin.forward(&x)? + &r)?;
            let diff = (lin.forward_add(&x, &r)? - want)?
                .abs()?
                .max_all()?
                .to_scalar::<f32>()?;
            assert!(diff < 1e-6, "{diff}");
            assert!(lin.forward_add(&x, &r.narrow(2, 0, 4)?).is_err());
        }
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
