//! Tensor kernels for Qwen3.6 hybrid models.
//!
//! Every op has a plain CPU reference written for readability (f32 math, loops or candle ops);
//! a CUDA twin with the same signature lives behind the `cuda` feature. Layouts follow fla:
//! token-major `[batch, len, heads, dim]`, so projection outputs need no transpose.

pub mod activation;
pub mod argmax;
pub mod attention;
pub mod conv1d;
#[cfg(feature = "cuda")]
mod cuda;
pub mod delta_rule;
pub mod error;
pub mod gating;
pub mod linear;
pub mod norm;
pub mod rope;

pub use error::{Error, Result};

/// Checks that `t` has exactly `want` dims; names the op and the argument otherwise.
pub(crate) fn expect_rank(
    op: &'static str,
    arg: &'static str,
    t: &candle_core::Tensor,
    want: usize,
) -> Result<()> {
    if t.rank() != want {
        return Err(Error::Shape {
            op,
            msg: format!("{arg} must have {want} dims, found {:?}", t.dims()),
        });
    }
    Ok(())
}

/// Flattens `t` to a contiguous `Vec<f32>` on the host (the CPU reference path works in f32).
pub(crate) fn host_f32(t: &candle_core::Tensor) -> Result<Vec<f32>> {
    Ok(t.to_dtype(candle_core::DType::F32)?
        .flatten_all()?
        .to_device(&candle_core::Device::Cpu)?
        .to_vec1::<f32>()?)
}
