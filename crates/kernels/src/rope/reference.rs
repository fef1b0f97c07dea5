//! The CPU references of RoPE: candle's rotate-half `rope_thd` on the rotated dims, and the q/k
//! preparation of gated attention as the composition of the norm and the rotation.

use candle_core::{Tensor, D};

use crate::norm::RmsNorm;
use crate::{expect_rank, Result};

/// Rotate-half RoPE on the first `2 * cos.dim(1)` dims of `x: [batch, len, heads, head_dim]`,
/// with `cos, sin: [len, rotary_dim/2]` in `x`'s dtype.
pub fn apply_partial_rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    expect_rank("rope", "x", x, 4)?;
    let head_dim = x.dim(D::Minus1)?;
    let rotary_dim = 2 * cos.dim(D::Minus1)?;
    let rot = x.narrow(D::Minus1, 0, rotary_dim)?.contiguous()?;
    let rot = candle_nn::rotary_emb::rope_thd(&rot, cos, sin)?;
    if rotary_dim == head_dim {
        return Ok(rot);
    }
    let pass = x.narrow(D::Minus1, rotary_dim, head_dim - rotary_dim)?;
    Ok(Tensor::cat(&[&rot, &pass], D::Minus1)?)
}

/// [`super::norm_rope_heads`] as the composition of [`RmsNorm::forward`] and
/// [`apply_partial_rope`] (arguments as there, checked by the caller).
pub fn norm_rope_heads(
    x: &Tensor,
    heads: usize,
    head_stride: usize,
    head_dim: usize,
    norm: Option<&RmsNorm>,
    cos: &Tensor,
    sin: &Tensor,
) -> Result<Tensor> {
    let (b, t, _) = x.dims3()?;
    let half = cos.dim(D::Minus1)?;
    let xh = x
        .narrow(2, 0, heads * head_stride)?
        .reshape((b, t, heads, head_stride))?
        .narrow(3, 0, head_dim)?;
    let y = match norm {
        Some(nm) => nm.forward(&xh)?,
        None => xh,
    };
    let y = if half > 0 {
        apply_partial_rope(&y, cos, sin)?
    } else {
        y
    };
    Ok(y.transpose(1, 2)?.contiguous()?)
}
