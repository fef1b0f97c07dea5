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

/// Checks a caller's buffer that an op writes into: contiguous, `dtype`, exactly `want` dims, and
/// not sharing its storage with `other` (named `other_arg`: another buffer the same op writes).
pub(crate) fn expect_out_buffer(
    op: &'static str,
    arg: &'static str,
    t: &candle_core::Tensor,
    dtype: candle_core::DType,
    want: &[usize],
    (other_arg, other): (&'static str, &candle_core::Tensor),
) -> Result<()> {
    if !t.is_contiguous() || t.dtype() != dtype || t.dims() != want {
        return Err(Error::Shape {
            op,
            msg: format!(
                "{arg} must be contiguous {dtype:?} {want:?}, found {:?} {:?}",
                t.dtype(),
                t.dims()
            ),
        });
    }
    // The storage's address, each read guard dropped before the next is taken (a second read
    // lock from one thread may deadlock); it is stable while the tensors live.
    let key = |t: &candle_core::Tensor| std::ptr::from_ref(&*t.storage_and_layout().0).addr();
    if key(t) == key(other) {
        return Err(Error::Shape {
            op,
            msg: format!("{arg} shares its buffer with {other_arg}"),
        });
    }
    Ok(())
}
