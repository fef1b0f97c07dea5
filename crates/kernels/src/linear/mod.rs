//! Linear layers `y = x·wᵀ (+ b)`. The reference is candle's matmul (what `candle_nn::Linear`
//! runs, [`reference::linear`]); on CUDA, 1..8 rows of bf16/f16 (decode, a verify) go to the tile
//! kernel on tensor cores (`cuda.rs`), whose rows are batch-invariant, and one f32 row (or one
//! row under [`SkinnyPath::Fastest`]) to a weight-streaming kernel: cuBLAS reads the weights at
//! only ~84% of the copy bandwidth on those shapes (PERF-ANCHORS) and decode is nothing but
//! reading weights. FP8 weights take the tile kernel for few rows and, for many on sm_90, an FP8
//! GEMM on FP8 tensor cores over activations quantized per 128-element group (`fp8_gemm.rs`).

#[cfg(feature = "cuda")]
mod cuda;
mod fp8;
#[cfg(feature = "cuda")]
mod fp8_gemm;
pub mod reference;

pub use fp8::{e4m3_to_f32, Fp8Weight};

/// Whether `dev` runs FP8 layers of many rows on FP8 tensor cores ([`Fp8GemmPath::Auto`]): a
/// CUDA device of compute capability 9.x in a build with the `cuda` feature.
///
/// [`Fp8GemmPath::Auto`]: crate::policy::Fp8GemmPath::Auto
pub fn fp8_gemm_available(dev: &candle_core::Device) -> bool {
    #[cfg(feature = "cuda")]
    return fp8_gemm::fp8_gemm_available(dev);
    #[cfg(not(feature = "cuda"))]
    {
        let _ = dev;
        false
    }
}

/// Activations `x: [m, k]` quantized as the FP8 GEMM does before it multiplies
/// ([`reference::fp8_quantize_activations`]; on CUDA, bf16/f16 by the GEMM's own kernel, other
/// dtypes by the reference): `q: [m, k]` e4m3 and `s: [m, k / FP8_ACT_GROUP]` f32 (from the
/// kernel a transposed view of the `[k / FP8_ACT_GROUP, m]` scales cuBLASLt reads).
pub fn fp8_quantize_activations(x: &Tensor, policy: &KernelPolicy) -> Result<(Tensor, Tensor)> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda()
        && matches!(x.dtype(), candle_core::DType::BF16 | candle_core::DType::F16)
        && x.dim(candle_core::D::Minus1)? % FP8_ACT_GROUP == 0
    {
        // A fresh copy: contiguous and 16-byte aligned, as the kernel reads it.
        let (q, s) = fp8_gemm::act_quant(&x.force_contiguous()?, policy)?;
        let m = x.dim(0)?;
        return Ok((q.narrow(0, 0, m)?, s.narrow(1, 0, m)?.t()?));
    }
    let _ = policy;
    reference::fp8_quantize_activations(x)
}

use candle_core::{Module, Tensor};

use crate::norm::{DeferredNorm, RmsNorm, Stream};
use crate::policy::SkinnyPath;
use crate::{Error, KernelPolicy, Result};

/// The most rows (`batch · len`) a call may have to use the CUDA weight-streaming kernel.
pub const SKINNY_MAX_ROWS: usize = crate::consts::LINEAR_MAX_ROWS;

/// The most rows one call of the CUDA tile kernels takes (dense 16-bit weights under
/// [`SkinnyPath::Uniform`], FP8 weights with 16-bit activations); an FP8 layer with more rows
/// runs the FP8 GEMM where the device has one ([`Fp8GemmPath`]), else dequantizes its weight.
///
/// [`Fp8GemmPath`]: crate::policy::Fp8GemmPath
pub const TILE_MAX_ROWS: usize = crate::consts::TILE_MAX_ROWS;

/// Elements per quantization group of an activation row for the FP8 GEMM (one f32 scale each).
pub const FP8_ACT_GROUP: usize = crate::consts::FP8_ACT_GROUP;

/// The fewest rows an FP8 layer smaller than [`FP8_GEMM_LARGE_WEIGHT`] multiplies through the FP8
/// GEMM under [`SkinnyPath::Auto`], `Fastest` and `Matmul` (where [`fp8_gemm_available`]; under
/// `Uniform` and the streaming paths, past the rows their few-row kernels take):
/// [`fp8_gemm_min_rows`].
pub const FP8_GEMM_MIN_ROWS: usize = 17;

/// The fewest rows a weight of at least [`FP8_GEMM_LARGE_WEIGHT`] elements multiplies through the
/// FP8 GEMM: [`fp8_gemm_min_rows`].
pub const FP8_GEMM_MIN_ROWS_LARGE: usize = 9;

/// The weights (in elements) from which the FP8 GEMM starts at [`FP8_GEMM_MIN_ROWS_LARGE`] rows.
pub const FP8_GEMM_LARGE_WEIGHT: usize = 48 << 20;

/// The fewest rows an FP8 weight `[n, k]` multiplies through the FP8 GEMM by default: on the
/// H200, with every call streaming its weight from memory as a model's layers do, the GEMM
/// beats the tile kernel on the 27B's large layers (gate|up, down, GDN in_proj, attention
/// q|k|v: 73-178 M weights, 2.4-2.8 TB/s against 1.7-2.2 at 12 and 16 rows; from 9 rows both
/// run as for 16: the GEMM pads to 16, the tile kernel runs two n-tiles) but not on its 31
/// M-weight output projections (1.0-1.3 against 1.9) until past 16 (docs/BENCHMARKS.md §4b;
/// 16 FP8 sequences decode a step 13% faster than with 17 rows for all, §7).
pub fn fp8_gemm_min_rows(n: usize, k: usize) -> usize {
    if n * k >= FP8_GEMM_LARGE_WEIGHT {
        FP8_GEMM_MIN_ROWS_LARGE
    } else {
        FP8_GEMM_MIN_ROWS
    }
}

/// Columns per warp of the streaming kernel for `rows` rows of outputs `columns` wide under `path`,
/// or `None` for the matmul. Measured on the H200 (docs/BENCHMARKS.md,
/// bench_linear): at one row the kernel beats cuBLAS by 0-10% with one column per warp, or two for
/// 8k-32k wide outputs. From two rows on cuBLAS (in f32; bf16/f16 layers take the tile kernel
/// before this is asked, `Linear::tiles`): the streaming kernel for 2..8 rows (on tensor cores in
/// bf16/f16) beats it in isolation at two rows but not inside the verify's graph, and from three
/// rows on not at all.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn streaming_columns(path: SkinnyPath, rows: usize, columns: usize) -> Option<usize> {
    match path {
        SkinnyPath::Auto | SkinnyPath::Uniform | SkinnyPath::Fastest | SkinnyPath::Multi(_)
            if rows == 1 && (8192..32768).contains(&columns) =>
        {
            Some(2)
        }
        SkinnyPath::Auto | SkinnyPath::Uniform | SkinnyPath::Fastest | SkinnyPath::Multi(_) if rows == 1 => {
            Some(1)
        }
        SkinnyPath::Streaming(c) | SkinnyPath::Multi(c) => Some(c),
        SkinnyPath::Auto | SkinnyPath::Uniform | SkinnyPath::Fastest | SkinnyPath::Matmul => None,
    }
}

/// A residual for an output of `dims` as `[rows, out]` (contiguous); an error when its shape
/// differs from the output's.
#[cfg(feature = "cuda")]
fn residual_rows(residual: Option<&Tensor>, dims: &[usize], rows: usize) -> Result<Option<Tensor>> {
    match residual {
        Some(r) if r.dims() != dims => Err(Error::Shape {
            op: "Linear::forward_add",
            msg: format!("residual {:?} for an output {dims:?}", r.dims()),
        }),
        Some(r) => Ok(Some(r.contiguous()?.reshape((rows, dims[dims.len() - 1]))?)),
        None => Ok(None),
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

/// A linear layer's weight as a checkpoint holds it: dense, or FP8 with block scales.
#[derive(Debug, Clone)]
pub enum LinearWeight {
    /// `[out, in]` in the activation dtype.
    Dense(Tensor),
    /// `[out, in]` e4m3 with its block scales.
    Fp8(Fp8Weight),
}

impl LinearWeight {
    /// `[out, in]`.
    pub fn dims(&self) -> Vec<usize> {
        match self {
            LinearWeight::Dense(t) => t.dims().to_vec(),
            LinearWeight::Fp8(w) => vec![w.dims().0, w.dims().1],
        }
    }
}

/// The stream after a residual connection: `y` when it holds the residual already (`added`),
/// else `residual + y`, normalised by `next` in the same kernel when given.
fn add_norm(y: Tensor, added: bool, residual: &Tensor, next: Option<&RmsNorm>) -> Result<Stream> {
    Ok(match (added, next) {
        (true, _) => Stream::new(y),
        (false, None) => Stream::new((residual + y)?),
        (false, Some(norm)) => {
            let (normed, sum) = norm.forward_residual(&y, residual)?;
            Stream::with_normed(sum, normed)
        }
    })
}

/// How a layer holds its weight.
#[derive(Debug, Clone)]
enum Kind {
    Dense(candle_nn::Linear),
    Fp8 {
        w: Fp8Weight,
        bias: Option<Tensor>,
    },
    /// Layers of different kinds fused: each runs on the input and their outputs are
    /// concatenated (a dense part beside FP8 ones, or FP8 parts whose row blocks do not line up).
    Parts(Vec<Linear>),
}

/// A linear layer; the weight is `[out, in]` as in checkpoints, dense or FP8.
#[derive(Debug, Clone)]
pub struct Linear {
    kind: Kind,
    policy: KernelPolicy,
    /// False for a tensor-parallel rank's row-parallel part other than the first: its output
    /// is a partial sum, and [`Self::forward_add`] leaves the residual to the first rank.
    adds_residual: bool,
}

impl Linear {
    /// `weight: [out, in]`, `bias: [out]`.
    pub fn new(weight: Tensor, bias: Option<Tensor>) -> Self {
        Self {
            kind: Kind::Dense(candle_nn::Linear::new(weight, bias)),
            policy: KernelPolicy::DEFAULT,
            adds_residual: true,
        }
    }

    /// A layer of a dense or FP8 weight, `bias: [out]` in the activation dtype.
    pub fn from_weight(weight: LinearWeight, bias: Option<Tensor>) -> Self {
        match weight {
            LinearWeight::Dense(w) => Self::new(w, bias),
            LinearWeight::Fp8(w) => Self {
                kind: Kind::Fp8 { w, bias },
                policy: KernelPolicy::DEFAULT,
                adds_residual: true,
            },
        }
    }

    /// The layer with its CUDA kernels chosen and launched under `policy`.
    pub fn with_policy(self, policy: KernelPolicy) -> Self {
        let kind = match self.kind {
            Kind::Parts(parts) => Kind::Parts(parts.into_iter().map(|p| p.with_policy(policy)).collect()),
            k => k,
        };
        Self {
            kind,
            policy,
            adds_residual: self.adds_residual,
        }
    }

    /// The layer as a tensor-parallel rank's row-parallel part other than the first: its
    /// output is one rank's partial sum, to which [`Self::forward_add`] adds no residual (the
    /// first rank's part carries it; the sum over ranks then holds it once).
    pub fn partial_sum(self) -> Self {
        Self {
            adds_residual: false,
            ..self
        }
    }

    /// The policy its CUDA calls run under.
    pub fn policy(&self) -> &KernelPolicy {
        &self.policy
    }

    /// Several layers with the same input as one: weights (and biases) stacked along `out` in the
    /// given order, so one pass reads every weight once (under the first layer's policy). Split the
    /// output with [`Tensor::narrow`] on the last dim at the running sums of [`Self::out_features`].
    /// FP8 weights stack when their row blocks line up; layers that cannot stack (dense beside
    /// FP8) run one after another and their outputs are concatenated.
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
        let dense: Option<Vec<&Tensor>> = parts.iter().map(Linear::dense_weight).collect();
        if let Some(weights) = dense {
            let bias = match has_bias {
                true => Some(Tensor::cat(
                    &parts.iter().filter_map(Linear::bias).collect::<Vec<_>>(),
                    0,
                )?),
                false => None,
            };
            return Ok(Self::new(Tensor::cat(&weights, 0)?, bias).with_policy(policy));
        }
        // Each layer joins the one before it where their weights stack (dense with dense, FP8
        // with FP8 whose row blocks line up); the rest stay apart.
        let mut out: Vec<Linear> = Vec::new();
        for p in parts {
            if let Some(last) = out.last_mut() {
                if let Some(merged) = last.stacked_with(&p)? {
                    *last = merged;
                    continue;
                }
            }
            out.push(p);
        }
        if out.len() == 1 {
            return Ok(out.pop().expect("one layer").with_policy(policy));
        }
        Ok(Self {
            kind: Kind::Parts(out),
            policy,
            adds_residual: true,
        }
        .with_policy(policy))
    }

    /// `self` and `next` as one layer with stacked weights, when their kinds allow.
    fn stacked_with(&self, next: &Linear) -> Result<Option<Linear>> {
        let bias = match (self.bias(), next.bias()) {
            (Some(a), Some(b)) => Some(Tensor::cat(&[a, b], 0)?),
            _ => None,
        };
        Ok(match (&self.kind, &next.kind) {
            (Kind::Dense(a), Kind::Dense(b)) => {
                Some(Self::new(Tensor::cat(&[a.weight(), b.weight()], 0)?, bias).with_policy(self.policy))
            }
            (Kind::Fp8 { w: a, .. }, Kind::Fp8 { w: b, .. }) => Fp8Weight::stack(&[a, b])?
                .map(|w| Self::from_weight(LinearWeight::Fp8(w), bias).with_policy(self.policy)),
            _ => None,
        })
    }

    /// The dense weight `[out, in]`; `None` for FP8 or fused mixed layers.
    pub fn dense_weight(&self) -> Option<&Tensor> {
        match &self.kind {
            Kind::Dense(l) => Some(l.weight()),
            _ => None,
        }
    }

    /// `[out]`, when the layer has one (for fused mixed layers: none).
    pub fn bias(&self) -> Option<&Tensor> {
        match &self.kind {
            Kind::Dense(l) => l.bias(),
            Kind::Fp8 { bias, .. } => bias.as_ref(),
            Kind::Parts(_) => None,
        }
    }

    /// Whether any of its weight is FP8.
    pub fn is_fp8(&self) -> bool {
        match &self.kind {
            Kind::Dense(_) => false,
            Kind::Fp8 { .. } => true,
            Kind::Parts(p) => p.iter().any(Linear::is_fp8),
        }
    }

    /// Output features (`out`).
    pub fn out_features(&self) -> usize {
        match &self.kind {
            Kind::Dense(l) => l.weight().dim(0).unwrap_or(0),
            Kind::Fp8 { w, .. } => w.dims().0,
            Kind::Parts(p) => p.iter().map(Linear::out_features).sum(),
        }
    }

    /// The layer of the output rows `ids` (`[n]` u32) of this one (a draft vocabulary's lm_head):
    /// a dense layer, FP8 rows dequantized to `dtype`.
    pub fn select_rows(&self, ids: &Tensor, dtype: candle_core::DType) -> Result<Self> {
        let weight = match &self.kind {
            Kind::Dense(l) => l.weight().index_select(ids, 0)?,
            Kind::Fp8 { w, .. } => w.dequantize(dtype)?.index_select(ids, 0)?,
            Kind::Parts(_) => {
                return Err(Error::Shape {
                    op: "Linear::select_rows",
                    msg: "a fused layer of mixed weights has no rows to select".into(),
                })
            }
        };
        let bias = self.bias().map(|b| b.index_select(ids, 0)).transpose()?;
        Ok(Self::new(weight, bias).with_policy(self.policy))
    }

    /// `x: [..., in]` → `[..., out]`, in `x`'s dtype (which must be the weight's; an FP8 weight
    /// takes any float activation dtype).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match &self.kind {
            Kind::Dense(l) => {
                #[cfg(feature = "cuda")]
                if let Some((y, _)) = self.forward_tiles(x, None)? {
                    return Ok(y);
                }
                #[cfg(feature = "cuda")]
                if let Some((y, _)) = self.forward_skinny(x, None, None)? {
                    return Ok(y);
                }
                reference::linear(l, x)
            }
            Kind::Fp8 { w, bias } => {
                #[cfg(feature = "cuda")]
                {
                    let y = match self.forward_fp8_gemm(w, x)? {
                        Some(y) => Some(y),
                        None => self.forward_fp8_skinny(w, x, None)?,
                    };
                    if let Some(y) = y {
                        return Ok(match bias {
                            Some(b) => y.broadcast_add(b)?,
                            None => y,
                        });
                    }
                }
                let dense = candle_nn::Linear::new(w.dequantize_with(x.dtype(), &self.policy)?, bias.clone());
                reference::linear(&dense, x)
            }
            Kind::Parts(_) => Ok(Tensor::cat(
                &self.forward_parts(x, None)?,
                candle_core::D::Minus1,
            )?),
        }
    }

    /// [`Self::forward`] as the parts of a fused layer of mixed weights give it, one output per
    /// part in order (their concatenation is `forward`'s output, the same bits), so that a
    /// caller narrowing the output needs no copy; one output for any other layer. With `norm`,
    /// of `norm.forward(x)` as [`Self::forward_normed`].
    pub fn forward_parts(&self, x: &Tensor, norm: Option<&RmsNorm>) -> Result<Vec<Tensor>> {
        match (&self.kind, norm) {
            (Kind::Parts(parts), norm) => {
                let normed = norm.map(|n| n.forward(x)).transpose()?;
                let x = normed.as_ref().unwrap_or(x);
                #[cfg(feature = "cuda")]
                if let Some(outs) = Self::forward_pair(parts, x, None)? {
                    return Ok(outs);
                }
                parts.iter().map(|p| p.forward(x)).collect()
            }
            (_, Some(norm)) => Ok(vec![self.forward_normed(x, norm)?]),
            (_, None) => Ok(vec![self.forward(x)?]),
        }
    }

    /// `self.forward(norm.forward(x))`: the projection that opens a pre-norm block. On CUDA one
    /// row goes through the streaming kernel that normalises `x` as it reads it (the same bits as
    /// the two steps, one kernel fewer) where the tile kernel does not take it (f32, or
    /// [`SkinnyPath::Fastest`]); otherwise the two steps.
    pub fn forward_normed(&self, x: &Tensor, norm: &RmsNorm) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if !self.tiles(x)? {
            if let Some((y, _)) = self.forward_skinny(x, None, Some(norm))? {
                return Ok(y);
            }
        }
        self.forward(&norm.forward(x)?)
    }

    /// `swiglu(self.forward(x))` for a layer whose outputs are `[gate | up]` halves (the MLP's
    /// fused gate and up projections): `silu(gate) · up`, `[..., out / 2]`. On CUDA 1..8 rows the
    /// layer's tile kernel takes (dense or FP8) go through it with the activation in its epilogue
    /// (the bits of the two steps, one kernel); one row the tile kernel does not take, through the
    /// streaming kernel with the activation in its epilogue (no rounding of the halves, no second
    /// pass); otherwise the two steps.
    pub fn forward_swiglu(&self, x: &Tensor) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if let Some(y) = self.forward_tile_swiglu(x, None)? {
            return Ok(y);
        }
        #[cfg(feature = "cuda")]
        if !self.tiles(x)? {
            if let Some(y) = self.forward_skinny_swiglu(x, None)? {
                return Ok(y);
            }
        }
        crate::activation::swiglu(&self.forward(x)?, &self.policy)
    }

    /// `self.forward_swiglu(norm.forward(x))`, on CUDA for one row in one kernel that normalises
    /// `x` as it reads it (as [`Self::forward_normed`]).
    pub fn forward_swiglu_normed(&self, x: &Tensor, norm: &RmsNorm) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if !self.tiles(x)? {
            if let Some(y) = self.forward_skinny_swiglu(x, Some(norm))? {
                return Ok(y);
            }
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
        let Some(w) = self.dense_weight() else {
            return Ok(None);
        };
        let x2 = x.contiguous()?.reshape((1, k))?;
        let what = cuda::Skinny::SwiGlu;
        let Some(y) = cuda::skinny_linear(&x2, w, what, norm.map(RmsNorm::parts), &self.policy)? else {
            return Ok(None);
        };
        Ok(Some(y.reshape(out_dims(x, n / 2))?))
    }

    /// `(rows, in, out, columns per warp)` when the CUDA streaming kernel takes `x` (a CUDA tensor
    /// of the weight's dtype, 1..=[`SKINNY_MAX_ROWS`] rows, the path not switched off by the
    /// policy); `None` for the matmul.
    #[cfg(feature = "cuda")]
    fn skinny_operands(&self, x: &Tensor) -> Result<Option<(usize, usize, usize, usize)>> {
        let Some(w) = self.dense_weight() else {
            return Ok(None);
        };
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
        Ok(self.forward_add_norm(x, residual, None)?.x)
    }

    /// [`Self::forward_add`] as the stream entering the block whose norm is `next`: where the
    /// residual is added by a pass of its own (the matmul path, the FP8 GEMM, a layer with a
    /// bias, the CPU), that pass is `next`'s kernel, which writes the sum and its normalisation
    /// (the same bits as the add, then the norm), so the block needs no norm pass; where the
    /// tile kernels add it (1..8 rows, [`KernelPolicy::defer_norm`]), they also leave `next`'s
    /// norm deferred ([`DeferredNorm`]) for the block's tile kernels; where the other few-row
    /// kernels add it, or `next` is `None`, the stream comes without its normalisation.
    pub fn forward_add_norm(&self, x: &Tensor, residual: &Tensor, next: Option<&RmsNorm>) -> Result<Stream> {
        if !self.adds_residual {
            return Ok(Stream::new(self.forward(x)?));
        }
        #[cfg(feature = "cuda")]
        if let Some(stream) = self.forward_add_deferred(x, residual, next)? {
            return Ok(stream);
        }
        #[cfg(feature = "cuda")]
        if let Some((y, added)) = self.forward_tiles(x, Some(residual))? {
            return add_norm(y, added, residual, next);
        }
        #[cfg(feature = "cuda")]
        if let Some((y, added)) = self.forward_skinny(x, Some(residual), None)? {
            return add_norm(y, added, residual, next);
        }
        #[cfg(feature = "cuda")]
        if let Kind::Fp8 { w, bias: None } = &self.kind {
            if let Some(y) = self.forward_fp8_gemm(w, x)? {
                return add_norm(y, false, residual, next);
            }
            if let Some(y) = self.forward_fp8_skinny(w, x, Some(residual))? {
                return Ok(Stream::new(y));
            }
        }
        add_norm(self.forward(x)?, false, residual, next)
    }

    /// Whether the CUDA tile kernel takes `x` through this dense layer: a CUDA tensor of the
    /// weight's 16-bit dtype with 1..=[`SKINNY_MAX_ROWS`] rows under [`SkinnyPath::Auto`]
    /// (then no one-row kernel fuses a norm or the SwiGLU in: every row count runs the same
    /// products, batch-invariant; the 27B's MTP verify as fast as through cuBLAS), 1..=
    /// [`TILE_MAX_ROWS`] under [`SkinnyPath::Uniform`] (batches of verifies invariant too, slower
    /// than cuBLAS past 8 rows), 2..=[`SKINNY_MAX_ROWS`] under [`SkinnyPath::Fastest`].
    #[cfg(feature = "cuda")]
    fn tiles(&self, x: &Tensor) -> Result<bool> {
        let Some(w) = self.dense_weight() else {
            return Ok(false);
        };
        if !x.device().is_cuda() || x.dtype() != w.dtype() || x.rank() == 0 {
            return Ok(false);
        }
        if !matches!(w.dtype(), candle_core::DType::BF16 | candle_core::DType::F16) {
            return Ok(false);
        }
        let k = x.dim(candle_core::D::Minus1)?;
        let rows = x.elem_count() / k.max(1);
        Ok(w.dim(1)? == k
            && k % 16 == 0
            && match self.policy.skinny {
                SkinnyPath::Auto => (1..=SKINNY_MAX_ROWS).contains(&rows),
                SkinnyPath::Uniform => (1..=TILE_MAX_ROWS).contains(&rows),
                SkinnyPath::Fastest => (2..=SKINNY_MAX_ROWS).contains(&rows),
                _ => false,
            })
    }

    /// The CUDA tile kernel when [`Self::tiles`]: the output and whether `residual` was added
    /// into it; `None` for the other paths.
    #[cfg(feature = "cuda")]
    fn forward_tiles(&self, x: &Tensor, residual: Option<&Tensor>) -> Result<Option<(Tensor, bool)>> {
        let (true, Some(w)) = (self.tiles(x)?, self.dense_weight()) else {
            return Ok(None);
        };
        let (n, k) = w.dims2()?;
        let rows = x.elem_count() / k;
        let dims = out_dims(x, n);
        let r2 = residual_rows(residual, &dims, rows)?.filter(|_| self.bias().is_none());
        let x2 = x.contiguous()?.reshape((rows, k))?;
        let Some((y, _)) = cuda::tile_linear(&x2, w, r2.as_ref(), cuda::NormIo::default(), &self.policy)?
        else {
            return Ok(None);
        };
        let y = y.reshape(dims)?;
        Ok(Some(match self.bias() {
            Some(b) => (y.broadcast_add(b)?, false),
            None => (y, r2.is_some()),
        }))
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
        let r2 = residual_rows(residual, &dims, rows)?.filter(|_| self.bias().is_none());
        let x2 = x.contiguous()?.reshape((rows, k))?;
        let what = cuda::Skinny::Linear {
            res: r2.as_ref(),
            columns,
        };
        let Some(w) = self.dense_weight() else {
            return Ok(None);
        };
        let Some(y) = cuda::skinny_linear(&x2, w, what, norm.map(RmsNorm::parts), &self.policy)? else {
            return Ok(None);
        };
        let y = y.reshape(dims)?;
        Ok(Some(match self.bias() {
            Some(b) => (y.broadcast_add(b)?, false),
            None => (y, r2.is_some()),
        }))
    }
}

impl Linear {
    /// `self.forward(block(x))` for the residual stream `x` entering the block opened by `norm`
    /// (`None`: a layer outside a block, `x` as it is): from the rows of its deferred norm where
    /// the tile kernels take them, else its normalisation when it comes with one, else
    /// normalising as the layer reads it ([`Self::forward_normed`]).
    pub fn forward_stream(&self, x: &Stream, norm: Option<&RmsNorm>) -> Result<Tensor> {
        if let Some(d) = x.deferred(norm) {
            if let Some(y) = self.forward_deferred(d)? {
                return Ok(y);
            }
        }
        match x.input(norm) {
            (x, Some(norm)) => self.forward_normed(x, norm),
            (x, None) => self.forward(x),
        }
    }

    /// [`Self::forward_stream`] as [`Self::forward_parts`] gives it: a fused layer of mixed
    /// weights in one launch where its parts allow, else each part from the stream as
    /// [`Self::forward_stream`] reads it (a part the deferred rows' kernels do not take normalises
    /// the stream itself; the others' launches stand).
    pub fn forward_parts_stream(&self, x: &Stream, norm: Option<&RmsNorm>) -> Result<Vec<Tensor>> {
        match (&self.kind, x.deferred(norm)) {
            (Kind::Parts(parts), Some(d)) => {
                #[cfg(feature = "cuda")]
                if let Some(outs) = Self::forward_pair(parts, &d.scaled, Some((&d.sumsq, d.eps)))? {
                    return Ok(outs);
                }
                let _ = d;
                parts.iter().map(|p| p.forward_stream(x, norm)).collect()
            }
            (Kind::Parts(_), None) => {
                let (x, norm) = x.input(norm);
                self.forward_parts(x, norm)
            }
            _ => Ok(vec![self.forward_stream(x, norm)?]),
        }
    }

    /// `self.forward_swiglu(block(x))` for the stream `x` entering the block opened by `norm`,
    /// read as [`Self::forward_stream`] reads it.
    pub fn forward_swiglu_stream(&self, x: &Stream, norm: Option<&RmsNorm>) -> Result<Tensor> {
        if let Some(d) = x.deferred(norm) {
            if let Some(y) = self.forward_swiglu_deferred(d)? {
                return Ok(y);
            }
        }
        match x.input(norm) {
            (x, Some(norm)) => self.forward_swiglu_normed(x, norm),
            (x, None) => self.forward_swiglu(x),
        }
    }

    /// `self.forward(norm(x))` for a stream `x` whose `norm` was deferred (`d`): through the
    /// tile kernels that read it, `None` where they do not take its rows.
    pub fn forward_deferred(&self, d: &DeferredNorm) -> Result<Option<Tensor>> {
        #[cfg(feature = "cuda")]
        {
            let io = cuda::NormIo {
                out: None,
                input: Some((&d.sumsq, d.eps)),
            };
            if let Some((y, _)) = self.tile_launch(&d.scaled, None, io)? {
                let y = y.reshape(out_dims(&d.scaled, self.out_features()))?;
                return Ok(Some(match self.bias() {
                    Some(b) => y.broadcast_add(b)?,
                    None => y,
                }));
            }
        }
        let _ = d;
        Ok(None)
    }

    /// `self.forward_swiglu(norm(x))` for a stream whose `norm` was deferred (`d`), as
    /// [`Self::forward_deferred`].
    pub fn forward_swiglu_deferred(&self, d: &DeferredNorm) -> Result<Option<Tensor>> {
        #[cfg(feature = "cuda")]
        if let Some(y) = self.forward_tile_swiglu(&d.scaled, Some((&d.sumsq, d.eps)))? {
            return Ok(Some(y));
        }
        let _ = d;
        Ok(None)
    }

    /// The layer's tile kernel (dense, or FP8 short of the FP8 GEMM) for the rows of `x`, adding
    /// `residual` (`[rows, out]`) as it writes, with its part `io` in a deferred norm: the output
    /// `[rows, out]` and what `io.out` asked for; `None` where the layer would not run `x`
    /// through its tile kernel (or the launcher declines the operands).
    #[cfg(feature = "cuda")]
    #[allow(clippy::type_complexity)]
    fn tile_launch(
        &self,
        x: &Tensor,
        residual: Option<&Tensor>,
        io: cuda::NormIo,
    ) -> Result<Option<(Tensor, Option<cuda::NormOut>)>> {
        if x.rank() == 0 {
            return Ok(None);
        }
        let k = x.dim(candle_core::D::Minus1)?;
        let rows = x.elem_count() / k.max(1);
        let x2 = || x.contiguous()?.reshape((rows, k));
        match &self.kind {
            Kind::Dense(_) if self.tiles(x)? => match self.dense_weight() {
                Some(w) => cuda::tile_linear(&x2()?, w, residual, io, &self.policy),
                None => Ok(None),
            },
            Kind::Fp8 { w, .. } if rows <= SKINNY_MAX_ROWS && self.fp8_tiles(w, x)? => {
                cuda::fp8_linear(&x2()?, w, residual, io, &self.policy)
            }
            _ => Ok(None),
        }
    }

    /// The residual connection through the tile kernel (1..=[`SKINNY_MAX_ROWS`] bf16 rows, no
    /// bias, [`KernelPolicy::defer_norm`] under [`SkinnyPath::Auto`]), which also leaves `next`'s
    /// norm deferred for the block it opens; `None` for the other paths. Only bf16: an f16
    /// stream times the norm's scale could overflow where its normalisation would not. Not
    /// under `Uniform`, whose tile kernels take rows past 8 (with the norm kernel) and must give
    /// each row the bits it has among 8.
    #[cfg(feature = "cuda")]
    fn forward_add_deferred(
        &self,
        x: &Tensor,
        residual: &Tensor,
        next: Option<&RmsNorm>,
    ) -> Result<Option<Stream>> {
        let Some(norm) = next.filter(|_| self.policy.defer_norm && self.policy.skinny == SkinnyPath::Auto)
        else {
            return Ok(None);
        };
        if self.bias().is_some()
            || !x.device().is_cuda()
            || x.rank() == 0
            || x.dtype() != candle_core::DType::BF16
        {
            return Ok(None);
        }
        // The reading kernels sum at most this many parts a row.
        if self.out_features().div_ceil(16) > 32 * crate::consts::NORM_PARTS_PER_LANE {
            return Ok(None);
        }
        let k = x.dim(candle_core::D::Minus1)?;
        let rows = x.elem_count() / k.max(1);
        if rows == 0 || rows > SKINNY_MAX_ROWS {
            return Ok(None);
        }
        let dims = out_dims(x, self.out_features());
        let Some(r2) = residual_rows(Some(residual), &dims, rows)? else {
            return Ok(None);
        };
        let (g, eps) = norm.parts();
        let io = cuda::NormIo {
            out: Some(g),
            input: None,
        };
        let got = self.tile_launch(x, Some(&r2), io)?;
        let Some((y, Some((scaled, sumsq)))) = got else {
            return Ok(None);
        };
        Ok(Some(Stream {
            x: y.reshape(dims.as_slice())?,
            normed: None,
            deferred: Some(DeferredNorm {
                scaled: scaled.reshape(dims)?,
                sumsq,
                eps,
            }),
        }))
    }
}

impl Linear {
    /// The CUDA FP8 kernels for 1..=[`TILE_MAX_ROWS`] rows with 16-bit activations, 1..=
    /// [`SKINNY_MAX_ROWS`] else (weights read as e4m3, scaled per block in registers), adding
    /// `residual` as it writes when given; `None` for the dequantize-then-matmul path. Callers try
    /// the FP8 GEMM first (`forward_fp8_gemm`), so that the rows it takes run it.
    #[cfg(feature = "cuda")]
    fn forward_fp8_skinny(
        &self,
        w: &Fp8Weight,
        x: &Tensor,
        residual: Option<&Tensor>,
    ) -> Result<Option<Tensor>> {
        if !x.device().is_cuda() || x.rank() == 0 || matches!(self.policy.skinny, SkinnyPath::Matmul) {
            return Ok(None);
        }
        let (n, k) = w.dims();
        if x.dim(candle_core::D::Minus1)? != k {
            return Ok(None);
        }
        let rows = x.elem_count() / k.max(1);
        if rows == 0 || rows > cuda::fp8_max_rows(x.dtype(), w, &self.policy) {
            return Ok(None);
        }
        let dims = out_dims(x, n);
        let r2 = residual_rows(residual, &dims, rows)?;
        let x2 = x.contiguous()?.reshape((rows, k))?;
        Ok(
            match cuda::fp8_linear(&x2, w, r2.as_ref(), cuda::NormIo::default(), &self.policy)? {
                Some((y, _)) => Some(y.reshape(dims)?),
                None => None,
            },
        )
    }
}

impl Linear {
    /// Whether `forward` runs the rows of `x` through this FP8 layer's (weight `w`) few-row
    /// kernels on CUDA, not the FP8 GEMM nor the matmul: the condition under which a fused launch
    /// of its tile kernel repeats its bits (the launchers check the rest: the tile kernel over
    /// the CUDA-core one, 1..8 rows, alignment).
    #[cfg(feature = "cuda")]
    fn fp8_tiles(&self, w: &Fp8Weight, x: &Tensor) -> Result<bool> {
        if !x.device().is_cuda() || x.rank() == 0 || matches!(self.policy.skinny, SkinnyPath::Matmul) {
            return Ok(false);
        }
        let k = x.dim(candle_core::D::Minus1)?;
        let rows = x.elem_count() / k.max(1);
        Ok(w.dims().1 == k && rows > 0 && !self.fp8_gemm_rows(w, x, rows))
    }

    /// `forward_swiglu` in one launch of the tile kernel with the SwiGLU in its epilogue, where
    /// the layer (no bias) would run `x` through its tile kernel (dense, or FP8 short of the FP8
    /// GEMM): the bits of the two steps; `None` for the two steps. With `norm`, `x` holds a
    /// deferred norm's rows and `norm` their sums of squares and eps.
    #[cfg(feature = "cuda")]
    fn forward_tile_swiglu(&self, x: &Tensor, norm: Option<(&Tensor, f64)>) -> Result<Option<Tensor>> {
        if self.bias().is_some() || x.rank() == 0 || !x.device().is_cuda() {
            return Ok(None);
        }
        let k = x.dim(candle_core::D::Minus1)?;
        let rows = x.elem_count() / k.max(1);
        let w = match &self.kind {
            Kind::Dense(_) if self.tiles(x)? => match self.dense_weight() {
                Some(w) => cuda::SwiGluWeight::Dense(w),
                None => return Ok(None),
            },
            Kind::Fp8 { w, bias: None } if self.fp8_tiles(w, x)? => cuda::SwiGluWeight::Fp8(w),
            _ => return Ok(None),
        };
        let x2 = x.contiguous()?.reshape((rows, k))?;
        Ok(match cuda::tile_swiglu(&x2, w, norm, &self.policy)? {
            Some(y) => Some(y.reshape(out_dims(x, self.out_features() / 2))?),
            None => None,
        })
    }
}

impl Linear {
    /// The two parts of a mixed layer, one FP8 and one dense (neither with a bias), in one launch
    /// of their tile kernels where each part would run its tile kernel alone (the same bits: one
    /// launch fewer, and the small dense part no longer waits for its own): their outputs in
    /// order; `None` for one launch a part. With `norm`, as [`Self::forward_tile_swiglu`].
    #[cfg(feature = "cuda")]
    fn forward_pair(
        parts: &[Linear],
        x: &Tensor,
        norm: Option<(&Tensor, f64)>,
    ) -> Result<Option<Vec<Tensor>>> {
        let (fp8_first, fp8_layer, dense) = match parts {
            [a, b] if matches!(b.kind, Kind::Dense(_)) => (true, a, b),
            [a, b] if matches!(a.kind, Kind::Dense(_)) => (false, b, a),
            _ => return Ok(None),
        };
        let (Kind::Fp8 { w: fp8, bias: None }, Some(w16)) = (&fp8_layer.kind, dense.dense_weight()) else {
            return Ok(None);
        };
        if dense.bias().is_some() || !dense.tiles(x)? || !fp8_layer.fp8_tiles(fp8, x)? {
            return Ok(None);
        }
        let k = x.dim(candle_core::D::Minus1)?;
        let x2 = x.contiguous()?.reshape((x.elem_count() / k.max(1), k))?;
        let Some((y8, y16)) = cuda::fp8_dense_pair(&x2, fp8, w16, norm, &fp8_layer.policy)? else {
            return Ok(None);
        };
        let y8 = y8.reshape(out_dims(x, fp8.dims().0))?;
        let y16 = y16.reshape(out_dims(x, w16.dim(0)?))?;
        Ok(Some(if fp8_first { vec![y8, y16] } else { vec![y16, y8] }))
    }
}

impl Linear {
    /// The FP8 GEMM ([`Fp8GemmPath::Auto`]) for more rows than the few-row FP8 kernels take,
    /// where the device and the operands allow it; `None` for the dequantize-then-matmul path.
    ///
    /// [`Fp8GemmPath::Auto`]: crate::policy::Fp8GemmPath::Auto
    #[cfg(feature = "cuda")]
    fn forward_fp8_gemm(&self, w: &Fp8Weight, x: &Tensor) -> Result<Option<Tensor>> {
        if !x.device().is_cuda() || x.rank() == 0 {
            return Ok(None);
        }
        let (n, k) = w.dims();
        if x.dim(candle_core::D::Minus1)? != k {
            return Ok(None);
        }
        let rows = x.elem_count() / k.max(1);
        if !self.fp8_gemm_rows(w, x, rows) {
            return Ok(None);
        }
        let x2 = x.contiguous()?.reshape((rows, k))?;
        Ok(match fp8_gemm::fp8_gemm(&x2, w, &self.policy)? {
            Some(y) => Some(y.reshape(out_dims(x, n))?),
            None => None,
        })
    }
}

impl Linear {
    /// Whether `rows` rows of `x` through the FP8 weight `w` take the FP8 GEMM: it takes the
    /// operands on this device, and the rows are at least [`fp8_gemm_min_rows`] (under
    /// [`SkinnyPath::Auto`], `Fastest` and `Matmul`), or more than the few-row kernels take
    /// (under `Uniform`, whose tiles are batch-invariant to [`TILE_MAX_ROWS`], and the streaming
    /// paths).
    #[cfg(feature = "cuda")]
    fn fp8_gemm_rows(&self, w: &Fp8Weight, x: &Tensor, rows: usize) -> bool {
        let least = match self.policy.skinny {
            SkinnyPath::Auto | SkinnyPath::Fastest | SkinnyPath::Matmul => match self.policy.fp8_gemm {
                crate::policy::Fp8GemmPath::FromRows(rows) => rows,
                _ => {
                    let (n, k) = w.dims();
                    fp8_gemm_min_rows(n, k)
                }
            },
            _ => cuda::fp8_max_rows(x.dtype(), w, &self.policy) + 1,
        };
        rows >= least && fp8_gemm::fp8_gemm_takes(x, w, &self.policy)
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
        assert!(Linear::new(w.clone(), None).dense_weight().is_some());
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

    /// The FP8 GEMM's row threshold at the 27B's FP8 layers (`[out, in]`): from 9 rows on the
    /// large ones, from 17 on the 6144 → 5120 output projections, as measured (BENCHMARKS §4b);
    /// the boundary weight itself is large.
    #[test]
    fn fp8_gemm_starts_earlier_on_large_weights() {
        for (n, k, rows) in [
            (34816, 5120, 9),
            (5120, 17408, 9),
            (16384, 5120, 9),
            (14336, 5120, 9),
            (5120, 6144, 17),
            (1, FP8_GEMM_LARGE_WEIGHT, 9),
            (1, FP8_GEMM_LARGE_WEIGHT - 1, 17),
        ] {
            assert_eq!(fp8_gemm_min_rows(n, k), rows, "[{n}, {k}]");
        }
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

    /// An FP8 layer computes with its dequantized weight; fused with dense and with FP8 layers
    /// whose row blocks do not line up, each part gives its own rows of the output (the GDN's
    /// qkv|z in FP8 beside dense b|a), and stacking keeps what lines up in one weight.
    #[test]
    fn fp8_layers_and_mixed_fusions_equal_their_parts() -> Result<()> {
        let dev = Device::Cpu;
        let x = qwen36_testutil::randn(408, 1.0, (2, 3, 40), &dev)?;
        let fp8 = |seed, rows: usize| -> Result<Linear> {
            let q = fp8::tests::random_q(seed, rows, 40, &dev)?;
            let s = qwen36_testutil::randn(seed + 1, 0.01, (rows.div_ceil(16), 3), &dev)?.abs()?;
            Ok(Linear::from_weight(
                LinearWeight::Fp8(Fp8Weight::new(q, s, [16, 16])?),
                None,
            ))
        };
        let dense =
            |seed, rows| Linear::new(qwen36_testutil::randn(seed, 0.2, (rows, 40), &dev).unwrap(), None);
        let a = fp8(410, 32)?;
        let Kind::Fp8 { w, .. } = &a.kind else {
            panic!("an FP8 layer")
        };
        let want = x.broadcast_matmul(&w.dequantize(DType::F32)?.t()?)?;
        let diff = (a.forward(&x)? - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff < 1e-5, "{diff}");
        assert!(a.is_fp8() && a.dense_weight().is_none());
        let parts = vec![
            a,
            fp8(412, 48)?,
            fp8(414, 20)?,
            dense(416, 6),
            dense(417, 5),
            fp8(418, 16)?,
        ];
        let fused = Linear::fused(parts.clone())?;
        // 32 and 48 rows stack with the 20 after them; the dense pair stacks; the last stands.
        let Kind::Parts(p) = &fused.kind else {
            panic!("mixed kinds stay apart")
        };
        assert_eq!(
            p.iter().map(Linear::out_features).collect::<Vec<_>>(),
            vec![100, 11, 16]
        );
        assert_eq!(fused.out_features(), 127);
        let y = fused.forward(&x)?;
        let mut at = 0;
        for part in &parts {
            let want = part.forward(&x)?;
            let diff = (y.narrow(2, at, part.out_features())? - want)?
                .abs()?
                .max_all()?
                .to_scalar::<f32>()?;
            assert!(diff < 1e-5, "part at {at}: {diff}");
            at += part.out_features();
        }
        // From a stream: one output a part (callers narrow them without a copy), those of
        // forward_parts, of the stream as it is or normalised.
        let norm = RmsNorm::zero_centred(&qwen36_testutil::randn(426, 0.3, 40, &dev)?, 1e-6)?;
        let stream = Stream::new(x.clone());
        for block in [None, Some(&norm)] {
            let got = fused.forward_parts_stream(&stream, block)?;
            let want = fused.forward_parts(&x, block)?;
            assert_eq!(got.len(), 3, "{}", block.is_some());
            for (g, w) in got.iter().zip(&want) {
                let diff = (g - w)?.abs()?.max_all()?.to_scalar::<f32>()?;
                assert_eq!(diff, 0.0, "{}", block.is_some());
            }
        }
        // A partial block before others: no stacking.
        let Kind::Parts(p) = Linear::fused(vec![fp8(420, 20)?, fp8(422, 32)?])?.kind else {
            panic!("20 rows are a partial block")
        };
        assert_eq!(p.len(), 2);
        // forward_add through the same path.
        let r = qwen36_testutil::randn(424, 1.0, (2, 3, 127), &dev)?;
        let diff = (fused.forward_add(&x, &r)? - (&y + &r)?)?
            .abs()?
            .max_all()?
            .to_scalar::<f32>()?;
        assert!(diff < 1e-6, "{diff}");
        // Selected rows of an FP8 layer are its dequantized rows.
        let ids = Tensor::new(&[3u32, 0, 31], &dev)?;
        let sel = parts[0].select_rows(&ids, DType::F32)?;
        let diff = (sel.forward(&x)? - parts[0].forward(&x)?.index_select(&ids, 2)?)?
            .abs()?
            .max_all()?
            .to_scalar::<f32>()?;
        assert!(diff < 1e-5, "{diff}");
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
