//! Launchers of the causal conv1d kernels in cuda/gdn.cu: the prefill kernels (a thread takes
//! `CONV_TOKENS` tokens of one channel or, for long prompts, `CONV_VEC_TOKENS` tokens of 16 bytes
//! of channels) and the few-token one that updates the state in place.

use candle_core::cuda::WrapErr;
use candle_core::Tensor;

use crate::consts::{CONV_TOKENS, CONV_VEC_THREADS, CONV_VEC_TOKENS};
use crate::cuda::{
    at16, device, dtype_suffix, err, for_float_dtype, in_place, row_stride, rows_view, view, with_out_buffer,
    wrap, KernelCall, LaunchConfig, GDN,
};
use crate::{KernelPolicy, Result};

/// Tokens from which a prefill conv takes a vector of channels a thread.
const VEC_CONV_MIN_TOKENS: usize = 16 * CONV_TOKENS;

/// CUDA twin of [`super::causal_conv1d`]: `x: [b, t, c]`, `weight: [c, k]`, `state: [b, c, k-1]`.
pub(crate) fn conv1d(
    x: &Tensor,
    weight: &Tensor,
    state: Option<&Tensor>,
    k: usize,
    policy: &KernelPolicy,
) -> Result<(Tensor, Tensor)> {
    let op = "causal_conv1d";
    if k > 8 {
        return Err(err(op, format!("kernel width {k} > 8 is not supported on CUDA")));
    }
    let dt = x.dtype();
    let dev = device(op, x)?;
    let (b, t, c) = x.dims3()?;
    // Rows of a wider projection are read in place.
    let (x, xs) = match row_stride(x) {
        Some(rs) => (x.clone(), rs),
        None => (x.contiguous()?, c),
    };
    let w = weight.reshape((c, k))?.to_dtype(dt)?.contiguous()?;
    let state = state.map(|s| s.to_dtype(dt)?.contiguous()).transpose()?;
    // Qwen3.6's width 4 over 16-byte rows of a prompt: a thread takes `lanes` channels, one
    // vector a token (for a few tokens, a thread a channel keeps more threads at work: at one
    // token the vector kernel took 7.4 µs against 4.0).
    let size = dt.size_in_bytes();
    let lanes = 16 / size;
    let vec = k == 4
        && t >= VEC_CONV_MIN_TOKENS
        && c % lanes == 0
        && xs % lanes == 0
        && at16(x.layout(), size)
        && at16(w.layout(), size);
    macro_rules! go {
        ($t:ty) => {{
            let (xst, xl) = x.storage_and_layout();
            let (ws, wl) = w.storage_and_layout();
            let xv = rows_view::<$t>(op, &xst, xl, b * t, c, xs)?;
            let wv = view::<$t>(op, &ws, wl)?;
            let st = state.as_ref().map(|s| s.storage_and_layout());
            let stv = st.as_ref().map(|(s, l)| view::<$t>(op, s, l)).transpose()?;
            // SAFETY: uninitialised; the kernel writes every element of y and of the new state.
            let y = unsafe { dev.alloc::<$t>(b * t * c)? };
            let st_out = unsafe { dev.alloc::<$t>(b * c * (k - 1))? };
            let suffix = dtype_suffix(op, dt)?;
            let name = if vec {
                format!("conv1d_{suffix}_vec4")
            } else {
                format!("conv1d_{suffix}")
            };
            let func = GDN.func(&dev, &name)?;
            let mut lb = KernelCall::new(&dev, &func, policy);
            let null = 0u64;
            let xs64 = xs as i64;
            lb.arg(&xv).arg(&xs64).arg(&wv);
            match &stv {
                Some(s) => lb.arg(s),
                None => lb.arg(&null),
            };
            lb.arg(&y).arg(&st_out);
            let dims = [b as i32, t as i32, c as i32, k as i32];
            for v in &dims[..if vec { 3 } else { 4 }] {
                lb.arg(v);
            }
            let (tokens, threads, per_thread) = if vec {
                (CONV_VEC_TOKENS, CONV_VEC_THREADS, lanes)
            } else {
                (CONV_TOKENS, 256, 1)
            };
            let cfg = LaunchConfig {
                grid_dim: (
                    (b * t.div_ceil(tokens) + b) as u32,
                    c.div_ceil(threads * per_thread) as u32,
                    1,
                ),
                block_dim: (threads as u32, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: arguments match `conv1d_*` (or, for k = 4 without the last i32,
            // `conv1d_*_vec4`) in cuda/gdn.cu: x as b·t rows of c elements xs apart (the view spans
            // exactly them; for the vector kernel rows and w 16-byte aligned, xs and c multiples of
            // its `lanes` channels, checked above), i64 xs, w [c·k], state [b·c·(k-1)] or null, fresh
            // outputs of the sizes it writes, then i32 dims; one block row per tile of
            // `tokens` tokens of a sequence (y), then one per sequence (the new state), one
            // thread per channel (vector kernel: per `lanes` channels).
            unsafe { lb.launch(cfg) }.w()?;
            Ok((wrap(y, &dev, (b, t, c)), wrap(st_out, &dev, (b, c, k - 1))))
        }};
    }
    for_float_dtype!(op, dt)
}

/// Threads per block of the few-token conv kernel: small blocks spread its one thread per
/// channel over many SMs (a decode step has ~10k channels, a latency-bound handful of loads each).
const CONV_SEQ_THREADS: u32 = 128;

/// CUDA twin of [`super::causal_conv1d_in_place`] (shapes checked by the caller; `state` and `window`
/// contiguous in `x`'s dtype, `window` `[b, c, k-1+t]`): `x: [b, t, c]`, `weight: [c, k]`;
/// returns y, overwrites `state` and writes the window into `window`.
pub(crate) fn conv1d_in_place(
    x: &Tensor,
    weight: &Tensor,
    state: &Tensor,
    slots: Option<&Tensor>,
    k: usize,
    window: Option<&Tensor>,
    policy: &KernelPolicy,
) -> Result<Tensor> {
    let op = "causal_conv1d_in_place";
    let slots = slots.map(Tensor::contiguous).transpose()?;
    let pool = state.dim(0)? as i32;
    if k > 8 {
        return Err(err(op, format!("kernel width {k} > 8 is not supported on CUDA")));
    }
    let (b, t, c) = x.dims3()?;
    let (x, xs) = match row_stride(x) {
        Some(rs) => (x.clone(), rs),
        None => (x.contiguous()?, c),
    };
    let dt = x.dtype();
    let w = weight.reshape((c, k))?.to_dtype(dt)?.contiguous()?;
    let dev = device(op, &x)?;
    let name = format!("conv1d_{}_in_place", dtype_suffix(op, dt)?);
    macro_rules! go {
        ($t:ty) => {
            with_out_buffer::<$t, _>(op, window, |win| {
                let mut y = None;
                in_place(op, state, |st, range| {
                    let mut state = st.as_cuda_slice_mut::<$t>()?.slice_mut(range);
                    let (xst, xl) = x.storage_and_layout();
                    let (ws, wl) = w.storage_and_layout();
                    let xv = rows_view::<$t>(op, &xst, xl, b * t, c, xs)?;
                    let wv = view::<$t>(op, &ws, wl)?;
                    // SAFETY: uninitialised; the kernel writes every element of y.
                    let out = unsafe { dev.alloc::<$t>(b * t * c)? };
                    let func = GDN.func(&dev, &name)?;
                    let mut lb = KernelCall::new(&dev, &func, policy);
                    let (xs64, null) = (xs as i64, 0u64);
                    lb.arg(&xv).arg(&xs64).arg(&wv).arg(&out).arg(&mut state);
                    match win {
                        Some(wb) => lb.arg(wb),
                        None => lb.arg(&null),
                    };
                    let dims = [b as i32, t as i32, c as i32, k as i32];
                    for v in &dims {
                        lb.arg(v);
                    }
                    let slot_guard = slots.as_ref().map(|s| s.storage_and_layout());
                    let slot_view = slot_guard
                        .as_ref()
                        .map(|(ss, sl)| view::<u32>(op, ss, sl))
                        .transpose()?;
                    match &slot_view {
                        Some(sv) => lb.arg(sv),
                        None => lb.arg(&null),
                    };
                    // No deferred commits: replay counts, stash, tmax and the verify flag.
                    let zero = 0i32;
                    lb.arg(&pool).arg(&null).arg(&null).arg(&zero).arg(&zero);
                    let cfg = LaunchConfig {
                        grid_dim: ((b * c).div_ceil(CONV_SEQ_THREADS as usize) as u32, 1, 1),
                        block_dim: (CONV_SEQ_THREADS, 1, 1),
                        shared_mem_bytes: 0,
                    };
                    // SAFETY: arguments match `conv1d_*_in_place` in cuda/gdn.cu: x as b·t rows of
                    // c elements xs apart (the view spans exactly them), i64 xs, w [c·k], a fresh
                    // y [b·t·c], the state [pool·c·(k-1)] (pool = b without slots; checked by the
                    // caller), the caller's window [b·c·(k-1+t)] (checked by the caller, disjoint
                    // from the state) or null, i32 dims, the slots [b] u32 or null and i32 pool
                    // (the kernel touches no row at or past pool), no stash; one thread per (sequence,
                    // channel), each reading its state entries before writing them (distinct
                    // slots give distinct rows; the caller's duty).
                    unsafe { lb.launch(cfg) }.w()?;
                    y = Some(wrap(out, &dev, (b, t, c)));
                    Ok(())
                })?;
                y.ok_or_else(|| err(op, "the in-place launch did not run"))
            })
        };
    }
    for_float_dtype!(op, dt)
}

/// CUDA twin of [`super::causal_conv1d_pooled`] (`x` and `weight` given) and of
/// [`super::replay_pooled`] (neither: no new tokens), shapes checked by the caller: `pool: [rows,
/// c, k-1]`, the stash `[rows, tokens, c]`, both contiguous in the pool's dtype. Returns y `[b,
/// t, c]` (empty for a replay).
pub(crate) fn conv1d_pooled(
    x: Option<&Tensor>,
    weight: Option<&Tensor>,
    pool: &Tensor,
    deferred: &crate::Deferred,
    k: usize,
    policy: &KernelPolicy,
) -> Result<Tensor> {
    let op = "causal_conv1d_pooled";
    if k > 8 {
        return Err(err(op, format!("kernel width {k} > 8 is not supported on CUDA")));
    }
    let (rows, c, _) = pool.dims3()?;
    let b = deferred.slots.dim(0)?;
    let dt = pool.dtype();
    let dev = device(op, pool)?;
    let t = x.map_or(Ok(0), |x| x.dim(1))?;
    let x = match x {
        Some(x) => Some(match row_stride(x) {
            Some(rs) => (x.clone(), rs),
            None => (x.contiguous()?, c),
        }),
        None => None,
    };
    let w = weight
        .map(|w| w.reshape((c, k))?.to_dtype(dt)?.contiguous())
        .transpose()?;
    let slots = deferred.slots.contiguous()?;
    let replay = deferred.replay.contiguous()?;
    let tmax = deferred.stash.dim(1)? as i32;
    let stash_new = i32::from(deferred.verify);
    let name = format!("conv1d_{}_in_place", dtype_suffix(op, dt)?);
    macro_rules! go {
        ($t:ty) => {
            with_out_buffer::<$t, _>(op, Some(deferred.stash), |stash| {
                let stash = stash.expect("a stash buffer");
                let mut y = None;
                in_place(op, pool, |st, range| {
                    let mut state = st.as_cuda_slice_mut::<$t>()?.slice_mut(range);
                    let xg = x.as_ref().map(|(x, _)| x.storage_and_layout());
                    let wg = w.as_ref().map(|w| w.storage_and_layout());
                    let (ss, sl) = slots.storage_and_layout();
                    let (rs, rl) = replay.storage_and_layout();
                    let null = 0u64;
                    // SAFETY: uninitialised; the kernel writes every element of y.
                    let out = unsafe { dev.alloc::<$t>((b * t * c).max(1))? };
                    let func = GDN.func(&dev, &name)?;
                    let mut lb = KernelCall::new(&dev, &func, policy);
                    let xs64 = x.as_ref().map_or(c, |(_, xs)| *xs) as i64;
                    let xv = match (&xg, &x) {
                        (Some((xst, xl)), Some((_, xs))) => {
                            Some(rows_view::<$t>(op, xst, xl, b * t, c, *xs)?)
                        }
                        _ => None,
                    };
                    let wv = wg
                        .as_ref()
                        .map(|(ws, wl)| view::<$t>(op, ws, wl))
                        .transpose()?;
                    match &xv {
                        Some(v) => lb.arg(v),
                        None => lb.arg(&null),
                    };
                    lb.arg(&xs64);
                    match &wv {
                        Some(v) => lb.arg(v),
                        None => lb.arg(&null),
                    };
                    lb.arg(&out).arg(&mut state).arg(&null);
                    let dims = [b as i32, t as i32, c as i32, k as i32];
                    for v in &dims {
                        lb.arg(v);
                    }
                    let sv = view::<u32>(op, &ss, sl)?;
                    let rv = view::<u32>(op, &rs, rl)?;
                    let pool_rows = rows as i32;
                    lb.arg(&sv)
                        .arg(&pool_rows)
                        .arg(&rv)
                        .arg(stash)
                        .arg(&tmax)
                        .arg(&stash_new);
                    let cfg = LaunchConfig {
                        grid_dim: (
                            (b * c).div_ceil(CONV_SEQ_THREADS as usize).max(1) as u32,
                            1,
                            1,
                        ),
                        block_dim: (CONV_SEQ_THREADS, 1, 1),
                        shared_mem_bytes: 0,
                    };
                    // SAFETY: arguments match `conv1d_*_in_place` in cuda/gdn.cu: x as b·t rows
                    // of c elements xs apart, or null with t = 0 (then neither x, w nor y is
                    // read or written), i64 xs, w [c·k] or null, y [b·t·c] (fresh), the pool
                    // [rows·c·(k-1)], a null window, i32 dims, the slots and replay counts [b]
                    // u32, i32 rows (the kernel touches no row at or past it), the stash
                    // [rows·tmax·c] (checked by the caller: replay counts and t at most tmax;
                    // disjoint from the pool), i32 tmax and the verify flag. One thread per
                    // (sequence, channel) reads its stash entries before writing them; distinct
                    // slots give distinct rows (the caller's duty).
                    unsafe { lb.launch(cfg) }.w()?;
                    y = Some(wrap(out, &dev, (b * t * c).max(1)));
                    Ok(())
                })?;
                y.ok_or_else(|| err(op, "the in-place launch did not run"))
            })
        };
    }
    let y = for_float_dtype!(op, dt)?;
    Ok(y.narrow(0, 0, b * t * c)?.reshape((b, t, c))?)
}
