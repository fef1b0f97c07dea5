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
pub use policy::{ChunkPath, DecodeMergePath, Fp8GemmPath, KernelPolicy, SkinnyPath};

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
        "8 groups of four state columns, each on 16 lanes"
    );
    const _: () = assert!(
        LINEAR_THREADS == NORM_THREADS,
        "the normalising GEMV repeats the norm's threads"
    );
}

/// A pass over pooled states with deferred commits (the serving engine's decode steps and
/// speculative verifies): a verify leaves each sequence's state as it was before its tokens and
/// keeps what its tokens' updates need in the pool's `stash`; when the sequence's accepted count
/// is known, the next pass over its slot first applies that many stashed tokens (`replay`), with
/// the arithmetic of the pass that stashed them, so the state after them is bit for bit the one
/// those tokens left. No state per token is ever written (a verify writes the state at most
/// once), and committing is bookkeeping. Each op makes its own stash (`conv1d::new_stash`,
/// `delta_rule::new_stash`: `[pool, tokens, ...]`, its layout the backend's).
#[derive(Debug, Clone, Copy)]
pub struct Deferred<'a> {
    /// u32 `[batch]`: each sequence's state row in the pool (distinct).
    pub slots: &'a candle_core::Tensor,
    /// u32 `[batch]`: the stashed tokens each sequence applies first (at most the stash's
    /// `tokens`, and what the slot's last verify stashed).
    pub replay: &'a candle_core::Tensor,
    /// The op's stash for the whole pool.
    pub stash: &'a candle_core::Tensor,
    /// A verify: the state is left as it is after the replayed tokens and this pass's tokens
    /// replace the slot's stash. Otherwise (a decode step) the state advances over them too.
    pub verify: bool,
}

impl<'a> Deferred<'a> {
    /// A pass of no new tokens over pool rows `slots`: each applies `replay` of its stashed
    /// tokens (the `replay_pooled` ops).
    pub fn replay_only(
        slots: &'a candle_core::Tensor,
        replay: &'a candle_core::Tensor,
        stash: &'a candle_core::Tensor,
    ) -> Self {
        Self {
            slots,
            replay,
            stash,
            verify: false,
        }
    }

    /// Checks the tables against a batch of `batch` sequences over a pool of `pool` rows and a
    /// pass of `tokens` new tokens; returns the stash's tokens per slot.
    pub(crate) fn check(&self, op: &'static str, batch: usize, pool: usize, tokens: usize) -> Result<usize> {
        expect_slots(op, self.slots, batch, pool)?;
        if self.replay.dtype() != candle_core::DType::U32 || self.replay.dims() != [batch] {
            return Err(Error::Shape {
                op,
                msg: format!(
                    "replay must be u32 [{batch}], found {:?} {:?}",
                    self.replay.dtype(),
                    self.replay.dims()
                ),
            });
        }
        let dims = self.stash.dims();
        if dims.len() < 3 || dims[0] != pool || !self.stash.is_contiguous() {
            return Err(Error::Shape {
                op,
                msg: format!("the stash must be a contiguous [{pool}, tokens, ...], found {dims:?}"),
            });
        }
        let held = dims[1];
        if self.verify && tokens > held {
            return Err(Error::Shape {
                op,
                msg: format!("a verify of {tokens} tokens does not fit a stash of {held}"),
            });
        }
        if !self.replay.device().is_cuda() {
            let replay = self.replay.to_vec1::<u32>()?;
            if let Some(&r) = replay.iter().find(|&&r| r as usize > held) {
                return Err(Error::Shape {
                    op,
                    msg: format!("cannot replay {r} tokens from a stash of {held}"),
                });
            }
        }
        Ok(held)
    }

    /// The replay counts on the host (the CPU forms).
    pub(crate) fn host_replay(&self) -> Result<Vec<u32>> {
        Ok(self.replay.to_vec1::<u32>()?)
    }
}

/// Writes `rows: [len, ...]` as the first `len` tokens of slot `slot`'s stash (`[pool, tokens,
/// ...]`), keeping the rest of the row.
pub(crate) fn stash_tokens(stash: &candle_core::Tensor, slot: u32, rows: &candle_core::Tensor) -> Result<()> {
    let s = slot as usize;
    let held = stash.dim(1)?;
    let len = rows.dim(0)?;
    let row = stash.narrow(0, s, 1)?.squeeze(0)?;
    let rows = rows.to_dtype(stash.dtype())?;
    let new = if len < held {
        candle_core::Tensor::cat(&[&rows, &row.narrow(0, len, held - len)?], 0)?
    } else {
        rows
    };
    stash.slice_set(&new.unsqueeze(0)?.contiguous()?, 0, s)?;
    Ok(())
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
