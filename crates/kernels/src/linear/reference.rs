//! The CPU reference of a linear layer: candle's matmul, as `candle_nn::Linear` runs it.

use candle_core::{Module, Tensor};

use crate::Result;

/// `x·wᵀ (+ b)` for `x: [..., in]` through `layer` (`weight: [out, in]`), on a contiguous copy of
/// `x` where it is strided (candle's CUDA matmul rejects some strided inputs, a row view at an odd
/// offset say).
pub fn linear(layer: &candle_nn::Linear, x: &Tensor) -> Result<Tensor> {
    Ok(layer.forward(&x.contiguous()?)?)
}
