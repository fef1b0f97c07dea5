//! Causal depthwise conv1d with a fused SiLU, the short convolution in front of GDN
//! (docs/MODEL.md §2.1 step 3).
//!
//! `y_t[c] = silu(Σ_j w[c, j] · x_{t-K+1+j}[c])`, tap `K-1` on the current token. The state is the
//! last `K-1` **raw** inputs per channel (before conv and SiLU), oldest first, zeros for a fresh
//! sequence; it is kept in the activation dtype like the reference.
//!
//! [`reference`](mod@reference) holds the CPU form; `cuda.rs` the launchers of cuda/gdn.cu's conv kernels.

#[cfg(feature = "cuda")]
mod cuda;
pub mod reference;

use candle_core::Tensor;

use crate::{expect_rank, Error, KernelPolicy, Result};

/// Checks shapes and returns `(batch, len, channels, kernel)`.
fn check(x: &Tensor, weight: &Tensor, state: Option<&Tensor>) -> Result<(usize, usize, usize, usize)> {
    expect_rank("causal_conv1d", "x", x, 3)?;
    let (b, t, c) = x.dims3()?;
    let (wc, k) = match weight.dims() {
        [wc, k] => (*wc, *k),
        [wc, 1, k] => (*wc, *k),
        d => {
            return Err(Error::Shape {
                op: "causal_conv1d",
                msg: format!("weight must be [channels, kernel] or [channels, 1, kernel], found {d:?}"),
            })
        }
    };
    if wc != c || k < 2 {
        return Err(Error::Shape {
            op: "causal_conv1d",
            msg: format!(
                "weight {:?} does not fit x {:?} (need {c} channels, kernel >= 2)",
                weight.dims(),
                x.dims()
            ),
        });
    }
    if let Some(s) = state {
        if s.dims() != [b, c, k - 1] {
            return Err(Error::Shape {
                op: "causal_conv1d",
                msg: format!("state must be [{b}, {c}, {}], found {:?}", k - 1, s.dims()),
            });
        }
    }
    Ok((b, t, c, k))
}

/// Causal conv1d + SiLU over `x: [batch, len, channels]` with `weight: [channels, (1,) kernel]`,
/// continuing from `state: [batch, channels, kernel-1]` (`None` = fresh sequence).
/// Returns `(y: [batch, len, channels], new_state: [batch, channels, kernel-1])`, both in `x`'s dtype.
pub fn causal_conv1d(
    x: &Tensor,
    weight: &Tensor,
    state: Option<&Tensor>,
    policy: &KernelPolicy,
) -> Result<(Tensor, Tensor)> {
    let (_, _, _, k) = check(x, weight, state)?;
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() {
        return cuda::conv1d(x, weight, state, k, policy);
    }
    let _ = (k, policy);
    reference::causal_conv1d(x, weight, state)
}

/// [`causal_conv1d`] with the state updated in place: `state: [batch, channels, kernel-1]`
/// (contiguous, in `x`'s dtype) holds the window before `x` and receives the one after it, so its
/// buffer (and any CUDA graph that recorded it) stays the same. Returns `y: [batch, len,
/// channels]`. `window`, when given (`[batch, channels, kernel-1+len]`, contiguous, `x`'s dtype,
/// another buffer than `state`), receives the raw window `concat(state before, xᵀ)`: what a
/// speculative verify keeps to commit any accepted prefix. On CUDA one thread per channel walks
/// the tokens in order: meant for a few tokens (decode, speculative verify), not for prefill.
///
/// With `slots` (u32 `[batch]`, distinct), `state` is a pool `[pool, channels, kernel-1]` and
/// sequence `i` reads and writes its row `slots[i]`: a batch over pooled states, with no gather
/// or scatter. A slot outside the pool is an error on the CPU; on CUDA (which does not read the
/// slots back) that sequence runs from a zero window and keeps nothing.
pub fn causal_conv1d_in_place(
    x: &Tensor,
    weight: &Tensor,
    state: &Tensor,
    slots: Option<&Tensor>,
    window: Option<&Tensor>,
    policy: &KernelPolicy,
) -> Result<Tensor> {
    let op = "causal_conv1d_in_place";
    let per_seq = crate::state_per_sequence(op, state, slots, x.dim(0)?)?;
    let (b, t, c, k) = check(x, weight, Some(&per_seq))?;
    if !state.is_contiguous() || state.dtype() != x.dtype() {
        return Err(Error::Shape {
            op,
            msg: format!(
                "the state must be contiguous {:?} to be updated in place, found {:?}",
                x.dtype(),
                state.dtype()
            ),
        });
    }
    if let Some(w) = window {
        crate::expect_out_buffer(
            op,
            "window",
            w,
            x.dtype(),
            &[b, c, k - 1 + t],
            ("the state", state),
        )?;
    }
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() {
        return cuda::conv1d_in_place(x, weight, state, slots, k, window, policy);
    }
    if let Some(slots) = slots {
        return crate::on_pool_rows(op, state, slots, |own| {
            causal_conv1d_in_place(x, weight, own, None, window, policy)
        });
    }
    let _ = policy;
    if let Some(w) = window {
        w.slice_set(
            &Tensor::cat(&[state, &x.transpose(1, 2)?], 2)?.contiguous()?,
            0,
            0,
        )?;
    }
    let (y, s) = reference::causal_conv1d(x, weight, Some(state))?;
    state.slice_set(&s, 0, 0)?;
    Ok(y)
}

/// The stash of a pool of conv windows for [`causal_conv1d_pooled`]: per slot, the raw inputs of
/// up to `tokens` verified tokens, `[pool, tokens, channels]` in the window's dtype.
pub fn new_stash(window_pool: &Tensor, tokens: usize) -> Result<Tensor> {
    let (pool, channels, _) = window_pool.dims3()?;
    Ok(Tensor::zeros(
        (pool, tokens, channels),
        window_pool.dtype(),
        window_pool.device(),
    )?)
}

/// [`causal_conv1d_in_place`] over rows of a pool of windows `[pool, channels, kernel-1]` with
/// deferred commits ([`crate::Deferred`]): each sequence's window first takes the raw inputs its
/// slot's last verify stashed (`replay` of them); a verify then keeps that window as the state and
/// stashes its own inputs, a decode step keeps the window after its inputs. Returns `y: [batch,
/// len, channels]`, the conv of `x` after the replayed inputs.
pub fn causal_conv1d_pooled(
    x: &Tensor,
    weight: &Tensor,
    pool: &Tensor,
    deferred: &crate::Deferred,
    policy: &KernelPolicy,
) -> Result<Tensor> {
    let op = "causal_conv1d_pooled";
    let (b, t, _) = x.dims3()?;
    check_pool(op, pool, x.dtype(), deferred, b, t)?;
    let per_seq = crate::state_per_sequence(op, pool, Some(deferred.slots), b)?;
    let (_, _, _, k) = check(x, weight, Some(&per_seq))?;
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() {
        return cuda::conv1d_pooled(Some(x), Some(weight), pool, deferred, k, policy);
    }
    let _ = (k, policy);
    let stash = deferred.stash;
    let slots = deferred.slots.to_vec1::<u32>()?;
    let replay = deferred.host_replay()?;
    crate::on_pool_rows(op, pool, deferred.slots, |own| {
        let own_after = replayed_windows(own, stash, &slots, &replay)?;
        let (y, after) = reference::causal_conv1d(x, weight, Some(&own_after))?;
        if deferred.verify {
            own.slice_set(&own_after, 0, 0)?;
            for (i, &slot) in slots.iter().enumerate() {
                crate::stash_tokens(stash, slot, &x.get(i)?)?;
            }
        } else {
            own.slice_set(&after, 0, 0)?;
        }
        Ok(y)
    })
}

/// Applies the deferred commits of `replay` (u32 `[batch]`) to pool rows `slots` alone (no new
/// tokens): each row's window takes that many of its slot's stashed inputs.
pub fn replay_pooled(
    pool: &Tensor,
    stash: &Tensor,
    slots: &Tensor,
    replay: &Tensor,
    policy: &KernelPolicy,
) -> Result<()> {
    let op = "conv1d::replay_pooled";
    let deferred = crate::Deferred::replay_only(slots, replay, stash);
    let b = slots.dims1()?;
    check_pool(op, pool, pool.dtype(), &deferred, b, 0)?;
    #[cfg(feature = "cuda")]
    if pool.device().is_cuda() {
        let k = pool.dim(2)? + 1;
        return cuda::conv1d_pooled(None, None, pool, &deferred, k, policy).map(|_| ());
    }
    let _ = policy;
    let ids = slots.to_vec1::<u32>()?;
    let counts = deferred.host_replay()?;
    crate::on_pool_rows(op, pool, slots, |own| {
        let after = replayed_windows(own, stash, &ids, &counts)?;
        own.slice_set(&after, 0, 0)?;
        Ok(())
    })
}

/// Checks a pool of windows and its stash for a pass of `tokens` new tokens per sequence.
fn check_pool(
    op: &'static str,
    pool: &Tensor,
    dtype: candle_core::DType,
    deferred: &crate::Deferred,
    batch: usize,
    tokens: usize,
) -> Result<()> {
    if pool.rank() != 3 || !pool.is_contiguous() || pool.dtype() != dtype {
        return Err(Error::Shape {
            op,
            msg: format!(
                "the pool must be a contiguous {dtype:?} [pool, channels, kernel-1], found {:?} {:?}",
                pool.dtype(),
                pool.dims()
            ),
        });
    }
    deferred.check(op, batch, pool.dim(0)?, tokens)?;
    let (rows, channels, _) = pool.dims3()?;
    let stash = deferred.stash;
    if stash.rank() != 3 || stash.dim(2)? != channels || stash.dtype() != dtype {
        return Err(Error::Shape {
            op,
            msg: format!(
                "the stash must be {dtype:?} [{rows}, tokens, {channels}], found {:?} {:?}",
                stash.dtype(),
                stash.dims()
            ),
        });
    }
    Ok(())
}

/// The CPU form's windows `own: [batch, channels, kernel-1]` after each row's `replay[i]`
/// stashed inputs of slot `slots[i]`.
fn replayed_windows(own: &Tensor, stash: &Tensor, slots: &[u32], replay: &[u32]) -> Result<Tensor> {
    let hist = own.dim(2)?;
    let rows = slots
        .iter()
        .zip(replay)
        .enumerate()
        .map(|(i, (&slot, &n))| {
            let w = own.narrow(0, i, 1)?;
            if n == 0 {
                return Ok(w);
            }
            // [1, channels, n] of the stashed inputs, after the window: its last kernel-1.
            let inputs = stash
                .narrow(0, slot as usize, 1)?
                .narrow(1, 0, n as usize)?
                .transpose(1, 2)?;
            let all = Tensor::cat(&[&w, &inputs], 2)?;
            Ok(all.narrow(2, all.dim(2)? - hist, hist)?)
        })
        .collect::<Result<Vec<_>>>()?;
    // A copy: the caller writes it back into `own`.
    Ok(Tensor::cat(&rows, 0)?.contiguous()?.copy()?)
}

/// One decode step: `x: [batch, channels]`, `state: [batch, channels, kernel-1]`.
/// Returns `(y: [batch, channels], new_state)`.
pub fn causal_conv1d_step(
    x: &Tensor,
    weight: &Tensor,
    state: &Tensor,
    policy: &KernelPolicy,
) -> Result<(Tensor, Tensor)> {
    expect_rank("causal_conv1d_step", "x", x, 2)?;
    let (y, s) = causal_conv1d(&x.unsqueeze(1)?, weight, Some(state), policy)?;
    Ok((y.squeeze(1)?, s))
}

#[cfg(test)]
mod tests {
    use super::reference::silu;
    use super::*;
    use candle_core::{DType, Device};

    const P: &KernelPolicy = &KernelPolicy::DEFAULT;

    fn rand_vec(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    #[test]
    fn prefill_matches_direct_sum_and_keeps_raw_inputs() -> Result<()> {
        let (b, t, c, k) = (2, 5, 3, 4);
        let x = rand_vec(b * t * c, 1);
        let w = rand_vec(c * k, 2);
        let dev = Device::Cpu;
        let xt = Tensor::from_vec(x.clone(), (b, t, c), &dev)?;
        let wt = Tensor::from_vec(w.clone(), (c, 1, k), &dev)?;
        let (y, s) = causal_conv1d(&xt, &wt, None, P)?;
        let y = y.flatten_all()?.to_vec1::<f32>()?;
        for bi in 0..b {
            for ti in 0..t {
                for ch in 0..c {
                    let mut acc = 0.0;
                    for j in 0..k {
                        let src = ti as isize - (k - 1) as isize + j as isize;
                        if src >= 0 {
                            acc += w[ch * k + j] * x[(bi * t + src as usize) * c + ch];
                        }
                    }
                    assert!((y[(bi * t + ti) * c + ch] - silu(acc)).abs() < 1e-6);
                }
            }
        }
        // The state holds the last k-1 raw inputs, oldest first.
        let s = s.to_vec3::<f32>()?;
        for bi in 0..b {
            for ch in 0..c {
                for j in 0..k - 1 {
                    assert_eq!(s[bi][ch][j], x[(bi * t + t - (k - 1) + j) * c + ch]);
                }
            }
        }
        Ok(())
    }

    #[test]
    fn prefill_then_steps_equals_one_prefill() -> Result<()> {
        let (b, t, c, k) = (1, 7, 4, 4);
        let dev = Device::Cpu;
        let x = Tensor::from_vec(rand_vec(b * t * c, 3), (b, t, c), &dev)?;
        let w = Tensor::from_vec(rand_vec(c * k, 4), (c, k), &dev)?;
        let (y_all, s_all) = causal_conv1d(&x, &w, None, P)?;
        // Short prompt (1 token < k-1) exercises the zero-filled state.
        let (y0, mut s) = causal_conv1d(&x.narrow(1, 0, 1)?, &w, None, P)?;
        let mut ys = vec![y0];
        for ti in 1..t {
            let (yt, st) = causal_conv1d_step(&x.narrow(1, ti, 1)?.squeeze(1)?, &w, &s, P)?;
            ys.push(yt.unsqueeze(1)?);
            s = st;
        }
        let y = Tensor::cat(&ys, 1)?;
        let diff = (y - y_all)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff < 1e-6, "{diff}");
        assert_eq!(s.to_vec3::<f32>()?, s_all.to_vec3::<f32>()?);
        Ok(())
    }

    #[test]
    fn bad_state_shape_is_an_error() -> Result<()> {
        let dev = Device::Cpu;
        let x = Tensor::zeros((1, 2, 3), DType::F32, &dev)?;
        let w = Tensor::zeros((3, 4), DType::F32, &dev)?;
        let s = Tensor::zeros((1, 3, 2), DType::F32, &dev)?;
        let err = causal_conv1d(&x, &w, Some(&s), P).unwrap_err().to_string();
        assert!(err.contains("state must be [1, 3, 3]"), "{err}");
        Ok(())
    }

    /// The in-place conv refuses a state it cannot update in place (another dtype, not
    /// contiguous); a good one ends as the fresh op's new state, and the window is the state
    /// before followed by the inputs.
    #[test]
    fn in_place_state_is_checked_and_updated() -> Result<()> {
        let dev = Device::Cpu;
        let x = Tensor::new(rand_vec(2 * 3 * 5, 7), &dev)?.reshape((2, 3, 5))?;
        let w = Tensor::new(rand_vec(5 * 4, 8), &dev)?.reshape((5, 4))?;
        let s0 = Tensor::new(rand_vec(2 * 5 * 3, 9), &dev)?.reshape((2, 5, 3))?;
        let err = causal_conv1d_in_place(&x, &w, &s0.to_dtype(DType::F16)?, None, None, P).unwrap_err();
        assert!(err.to_string().contains("contiguous"), "{err}");
        let strided = Tensor::zeros((2, 3, 5), DType::F32, &dev)?.transpose(1, 2)?;
        let err = causal_conv1d_in_place(&x, &w, &strided, None, None, P).unwrap_err();
        assert!(err.to_string().contains("contiguous"), "{err}");
        let (y_want, s_want) = causal_conv1d(&x, &w, Some(&s0), P)?;
        let state = s0.copy()?;
        // The window must fit and be a buffer of its own.
        let short = Tensor::zeros((2, 5, 5), DType::F32, &dev)?;
        let err = causal_conv1d_in_place(&x, &w, &state, None, Some(&short), P).unwrap_err();
        assert!(err.to_string().contains("window must be"), "{err}");
        let both = Tensor::zeros((2 * 5 * 3 + 2 * 5 * 6,), DType::F32, &dev)?;
        let (aliased_state, aliased_window) = (
            both.narrow(0, 0, 30)?.reshape((2, 5, 3))?,
            both.narrow(0, 30, 60)?.reshape((2, 5, 6))?,
        );
        let err = causal_conv1d_in_place(&x, &w, &aliased_state, None, Some(&aliased_window), P).unwrap_err();
        assert!(err.to_string().contains("shares its buffer"), "{err}");
        let window = Tensor::zeros((2, 5, 6), DType::F32, &dev)?;
        let y = causal_conv1d_in_place(&x, &w, &state, None, Some(&window), P)?;
        let diff = |a: &Tensor, b: &Tensor| -> Result<f32> {
            Ok((a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?)
        };
        assert_eq!(diff(&y, &y_want)?, 0.0);
        assert_eq!(diff(&state, &s_want)?, 0.0);
        let want_window = Tensor::cat(&[&s0, &x.transpose(1, 2)?], 2)?;
        assert_eq!(diff(&window, &want_window)?, 0.0);
        Ok(())
    }

    /// Over a pool, each sequence reads and writes only its slot's row, as the op on that row
    /// alone does; the other rows keep their values; bad slot tables are refused by name.
    #[test]
    fn pooled_state_updates_only_its_slots() -> Result<()> {
        let dev = Device::Cpu;
        let x = Tensor::new(rand_vec(2 * 3 * 5, 17), &dev)?.reshape((2, 3, 5))?;
        let w = Tensor::new(rand_vec(5 * 4, 18), &dev)?.reshape((5, 4))?;
        let pool0 = Tensor::new(rand_vec(4 * 5 * 3, 19), &dev)?.reshape((4, 5, 3))?;
        let slots = Tensor::new(&[3u32, 1], &dev)?;
        let pool = pool0.copy()?;
        let window = Tensor::zeros((2, 5, 6), DType::F32, &dev)?;
        let y = causal_conv1d_in_place(&x, &w, &pool, Some(&slots), Some(&window), P)?;
        let own = pool0.index_select(&slots, 0)?;
        let (y_want, s_want) = causal_conv1d(&x, &w, Some(&own), P)?;
        let diff = |a: &Tensor, b: &Tensor| -> Result<f32> {
            Ok((a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?)
        };
        assert_eq!(diff(&y, &y_want)?, 0.0);
        assert_eq!(diff(&pool.get(3)?, &s_want.get(0)?)?, 0.0);
        assert_eq!(diff(&pool.get(1)?, &s_want.get(1)?)?, 0.0);
        for untouched in [0, 2] {
            assert_eq!(diff(&pool.get(untouched)?, &pool0.get(untouched)?)?, 0.0);
        }
        let want_window = Tensor::cat(&[&own, &x.transpose(1, 2)?], 2)?;
        assert_eq!(diff(&window, &want_window)?, 0.0);
        for (bad, msg) in [
            (Tensor::new(&[3u32, 4], &dev)?, "outside the pool"),
            (Tensor::new(&[2u32, 2], &dev)?, "used twice"),
            (Tensor::new(&[1u32], &dev)?, "slots must be u32 [2]"),
            (Tensor::new(&[1i64, 2], &dev)?, "slots must be u32 [2]"),
        ] {
            let err = causal_conv1d_in_place(&x, &w, &pool, Some(&bad), None, P).unwrap_err();
            assert!(err.to_string().contains(msg), "{err}");
        }
        Ok(())
    }

    /// Deferred commits over a pool of windows (CPU): a verify gives the plain conv's outputs
    /// and leaves its slots' windows; the next pass, replaying `n` of each slot's stashed inputs,
    /// runs from the window after them, and so does a replay alone; other rows stay.
    #[test]
    fn deferred_commits_replay_exactly_the_accepted_inputs() -> Result<()> {
        let dev = Device::Cpu;
        let (b, t, c, k) = (2, 3, 5, 4);
        let x = Tensor::new(rand_vec(b * t * c, 27), &dev)?.reshape((b, t, c))?;
        let w = Tensor::new(rand_vec(c * k, 28), &dev)?.reshape((c, k))?;
        let pool0 = Tensor::new(rand_vec(4 * c * 3, 29), &dev)?.reshape((4, c, 3))?;
        let pool = pool0.copy()?;
        let slots = Tensor::new(&[3u32, 1], &dev)?;
        let stash = new_stash(&pool, 4)?;
        let pass = |x: &Tensor, replay: &[u32], verify: bool| {
            let replay = Tensor::new(replay, &dev)?;
            let d = crate::Deferred {
                slots: &slots,
                replay: &replay,
                stash: &stash,
                verify,
            };
            causal_conv1d_pooled(x, &w, &pool, &d, P)
        };
        let diff = |a: &Tensor, b: &Tensor| -> Result<f32> {
            Ok((a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?)
        };
        let own0 = pool0.index_select(&slots, 0)?;
        let (y_want, _) = causal_conv1d(&x, &w, Some(&own0), P)?;
        assert_eq!(diff(&pass(&x, &[0, 0], true)?, &y_want)?, 0.0);
        assert_eq!(diff(&pool, &pool0)?, 0.0, "a verify leaves the windows");
        let x2 = Tensor::new(rand_vec(b * c, 30), &dev)?.reshape((b, 1, c))?;
        let y2 = pass(&x2, &[1, 3], false)?;
        for (i, (keep, slot)) in [(1usize, 3usize), (3, 1)].into_iter().enumerate() {
            let (_, after) = causal_conv1d(
                &x.narrow(0, i, 1)?.narrow(1, 0, keep)?,
                &w,
                Some(&own0.narrow(0, i, 1)?),
                P,
            )?;
            let (y, s) = causal_conv1d(&x2.narrow(0, i, 1)?, &w, Some(&after), P)?;
            assert_eq!(diff(&y2.narrow(0, i, 1)?, &y)?, 0.0, "row {i}");
            assert_eq!(diff(&pool.get(slot)?, &s.get(0)?)?, 0.0, "slot {slot}");
        }
        for untouched in [0, 2] {
            assert_eq!(diff(&pool.get(untouched)?, &pool0.get(untouched)?)?, 0.0);
        }
        let before = pool.index_select(&slots, 0)?;
        pass(&x, &[0, 0], true)?;
        replay_pooled(&pool, &stash, &slots, &Tensor::new(&[2u32, 2], &dev)?, P)?;
        let (_, after) = causal_conv1d(&x.narrow(1, 0, 2)?, &w, Some(&before), P)?;
        assert_eq!(diff(&pool.index_select(&slots, 0)?, &after)?, 0.0);
        Ok(())
    }
}
