//! The CPU reference of a linear layer: candle's matmul, as `candle_nn::Linear` runs it.

use candle_core::{Module, Tensor};

use crate::Result;

/// `x·wᵀ (+ b)` for `x: [..., in]` through `layer` (`weight: [out, in]`), on a contiguous copy of
/// `x` where it is strided (candle's CUDA matmul rejects some strided inputs, a row view at an odd
/// offset say).
pub fn linear(layer: &candle_nn::Linear, x: &Tensor) -> Result<Tensor> {
    Ok(layer.forward(&x.contiguous()?)?)
}

/// The real weight of an FP8 block-scaled `q: [out, in]` (e4m3) with f32 `scale: [⌈out/bo⌉,
/// ⌈in/bi⌉]`: each value times its block's scale in f32 (the scales broadcast over their blocks,
/// the last ones cut to the weight), then rounded to `dtype`.
pub fn fp8_dequantize(
    q: &Tensor,
    scale: &Tensor,
    block: [usize; 2],
    dtype: candle_core::DType,
) -> Result<Tensor> {
    let (out, inp) = q.dims2()?;
    let (ob, ib) = scale.dims2()?;
    let [bo, bi] = block;
    let s = scale
        .reshape((ob, 1, ib, 1))?
        .broadcast_as((ob, bo, ib, bi))?
        .reshape((ob * bo, ib * bi))?
        .narrow(0, 0, out)?
        .narrow(1, 0, inp)?;
    Ok((q.to_dtype(candle_core::DType::F32)? * s)?.to_dtype(dtype)?)
}
