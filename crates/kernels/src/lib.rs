//! Tensor kernels for Qwen3.6 hybrid models.
//!
//! One folder per op: `mod.rs` is the public API (shape checks, then the CPU reference or the
//! CUDA launch), `reference.rs` the plain CPU reference written for reading (f32 math, loops or
//! candle ops; callable on its own, like fla's `naive.py`), and `cuda.rs` the launchers of the
//! op's kernels in `cuda/*.cu`, behind the `cuda` feature. What the launchers share lives in
//! `cuda/` (private), which imports no op; the sizes the kernels and launchers share come from
//! one table (`consts`, also compiled into the kernels by build.rs). Where a CUDA op has a choice
//! of kernels, the caller's [`KernelPolicy`] decides. Layouts follow fla: token-major `[batch, len,
//! heads, dim]`, so projection outputs need no transpose.

pub mod activation;
pub mod argmax;
pub mod attention;
pub mod collective;
pub mod conv1d;
pub mod copy;
#[cfg(feature = "cuda")]
mod cuda;
pub mod delta_rule;
pub mod error;
pub mod gating;
pub mod linear;
pub mod norm;
pub mod policy;
pub mod rope;

pub use error::{Error, Result};
pub use policy::{ChunkPath, KernelPolicy, SkinnyPath};

/// The sizes shared with the CUDA sources (src/consts.rs, compiled into them by build.rs).
#[allow(dead_code)]
pub(crate) mod consts {
    macro_rules! kernel_consts {
        ($($name:ident = $value:expr;)*) => {
            $(pub(crate) const $name: usize = $value;)*
        };
    }
    include!("consts.rs");

    // Sizes that must fit the hardware (the kernels check their own layouts against these).
    const _: () = assert!(
        GDN_TC_SCAN_OUT_SMEM_BV64 <= 227 * 1024,
        "an sm_90 block holds the scan with outputs"
    );
    const _: () = assert!(
        GDN_TC_PREP_SMEM * 3 <= 227 * 1024,
        "three tensor-core preps per SM"
    );
    const _: () = assert!(
        GDN_THREADS == 32 * GDN_WARPS && GDN_BV == 32,
        "a lane per state column"
    );
    const _: () = assert!(
        LINEAR_THREADS == NORM_THREADS,
        "the normalising GEMV repeats the norm's threads"
    );
}

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

/// The state an in-place op checks against its batch of `batch` sequences: `state` itself, or
/// with a slot table (checked: [`expect_slots`]) a view of the pool's first row as `[batch,
/// ...]`, so the op's per-sequence shape checks serve both.
pub(crate) fn state_per_sequence(
    op: &'static str,
    state: &candle_core::Tensor,
    slots: Option<&candle_core::Tensor>,
    batch: usize,
) -> Result<candle_core::Tensor> {
    let Some(slots) = slots else {
        return Ok(state.clone());
    };
    expect_slots(op, slots, batch, state.dim(0)?)?;
    let dims = [&[batch][..], &state.dims()[1..]].concat();
    Ok(state.narrow(0, 0, 1)?.broadcast_as(dims)?)
}

/// Checks a slot table for an op over a state pool: `slots` u32 `[batch]` for `batch` sequences
/// whose states are rows of a pool of `pool` rows.
pub(crate) fn expect_slots(
    op: &'static str,
    slots: &candle_core::Tensor,
    batch: usize,
    pool: usize,
) -> Result<()> {
    if slots.dtype() != candle_core::DType::U32 || slots.dims() != [batch] || pool == 0 {
        return Err(Error::Shape {
            op,
            msg: format!(
                "slots must be u32 [{batch}] over a pool of at least one state, found {:?} {:?} \
                 (pool {pool})",
                slots.dtype(),
                slots.dims()
            ),
        });
    }
    Ok(())
}

/// The CPU form of an in-place op over rows `slots` of a state `pool` (`[pool, ...]`): gathers
/// those rows into a state of their own, runs `f` on it (which updates it in place) and writes
/// each row back. A slot outside the pool or used twice is an error.
pub(crate) fn on_pool_rows<R>(
    op: &'static str,
    pool: &candle_core::Tensor,
    slots: &candle_core::Tensor,
    f: impl FnOnce(&candle_core::Tensor) -> Result<R>,
) -> Result<R> {
    let ids = slots.to_vec1::<u32>()?;
    let rows = pool.dim(0)?;
    for (i, &s) in ids.iter().enumerate() {
        let bad = if s as usize >= rows {
            Some(format!("slot {s} is outside the pool of {rows} states"))
        } else if ids[..i].contains(&s) {
            Some(format!("slot {s} is used twice"))
        } else {
            None
        };
        if let Some(msg) = bad {
            return Err(Error::Shape { op, msg });
        }
    }
    let own = pool.index_select(slots, 0)?.contiguous()?;
    let r = f(&own)?;
    for (i, &s) in ids.iter().enumerate() {
        pool.slice_set(&own.narrow(0, i, 1)?, 0, s as usize)?;
    }
    Ok(r)
}
