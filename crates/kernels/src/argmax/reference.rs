//! The CPU reference of the argmax: candle's.

use candle_core::{DType, Tensor, D};

use crate::Result;

/// [`super::argmax_last_dim`] through candle's argmax (ties to the lowest index).
pub fn argmax_last_dim(x: &Tensor) -> Result<Tensor> {
    Ok(x.argmax(D::Minus1)?.to_dtype(DType::U32)?)
}
