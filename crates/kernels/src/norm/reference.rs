//! The CPU references of the norms: candle ops in f32, one rounding to the output dtype.

use candle_core::{DType, Tensor, D};

use crate::Result;

/// `x / sqrt(mean(x²) + eps)` over the last dim, in f32.
fn rms_normalise_f32(x: &Tensor, eps: f64) -> Result<Tensor> {
    let x = x.to_dtype(DType::F32)?;
    let mean_sq = x.sqr()?.mean_keepdim(D::Minus1)?;
    Ok(x.broadcast_mul(&(mean_sq + eps)?.sqrt()?.recip()?)?)
}

/// L2 normalisation over the last dim: `x / sqrt(Σx² + eps)`, returned in f32.
/// GDN applies it to q and k per head with `eps = 1e-6`.
pub fn l2_norm(x: &Tensor, eps: f64) -> Result<Tensor> {
    let x = x.to_dtype(DType::F32)?;
    let sum_sq = x.sqr()?.sum_keepdim(D::Minus1)?;
    Ok(x.broadcast_mul(&(sum_sq + eps)?.sqrt()?.recip()?)?)
}

/// [`super::RmsNorm::forward`] given its stored `scale = 1 + w` (f32 `[dim]`): `x: [..., dim]`,
/// the output in `x`'s dtype.
pub fn rms_norm(x: &Tensor, scale: &Tensor, eps: f64) -> Result<Tensor> {
    let y = rms_normalise_f32(x, eps)?.broadcast_mul(scale)?;
    Ok(y.to_dtype(x.dtype())?)
}

/// [`super::GatedRmsNorm::forward`] given its plain f32 `weight: [dim]`: `(weight ⊙ norm(x)) ⊙
/// silu(z)` with `z` of `x`'s shape or `[..., heads·dim]`, in `out_dtype`.
pub fn gated_rms_norm(x: &Tensor, z: &Tensor, weight: &Tensor, eps: f64, out_dtype: DType) -> Result<Tensor> {
    let z = if z.dims() == x.dims() {
        z.clone()
    } else {
        z.reshape(x.dims())?
    };
    let n = rms_normalise_f32(x, eps)?.broadcast_mul(weight)?;
    let gate = candle_nn::ops::silu(&z.to_dtype(DType::F32)?)?;
    Ok((n * gate)?.to_dtype(out_dtype)?)
}
