//! The CPU reference of SwiGLU: candle's SiLU, then the product, each rounded to the dtype.

use candle_core::{Tensor, D};

use crate::Result;

/// [`super::swiglu`] of `x: [..., 2·I]` (`gate | up`, an even last dim, checked by the caller).
pub fn swiglu(x: &Tensor) -> Result<Tensor> {
    let i = x.dim(D::Minus1)? / 2;
    let gate = candle_nn::ops::silu(&x.narrow(D::Minus1, 0, i)?)?;
    Ok((gate * x.narrow(D::Minus1, i, i)?)?)
}
