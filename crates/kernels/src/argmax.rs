//! Argmax over the last dim: greedy decoding and MTP drafting pick tokens on the device. The CPU
//! path is candle's argmax (the reference); on CUDA a two-stage kernel replaces candle's, which
//! reduces each row in one block (~250 µs for one 248320-logit row on an H200, measured with ncu).

use candle_core::{DType, Tensor, D};

use crate::Result;

/// Elements of a row one block reduces in the CUDA kernel's first stage.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) const CHUNK: usize = 4096;

/// Index of the largest element along the last dim of `x: [..., n]` (f32, bf16 or f16), as u32
/// `[...]`. Ties go to the lowest index.
pub fn argmax_last_dim(x: &Tensor) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() && matches!(x.dtype(), DType::F32 | DType::BF16 | DType::F16) && x.rank() > 0 {
        return crate::cuda::argmax_last_dim(x);
    }
    Ok(x.argmax(D::Minus1)?.to_dtype(DType::U32)?)
}
