//! Launcher of the weight-streaming GEMV kernels in cuda/linear.cu (one to
//! `LINEAR_MAX_ROWS` rows; a residual, SwiGLU or RMSNorm fused in).

use candle_core::cuda::WrapErr;
use candle_core::{DType, Tensor};

use candle_core::cuda::cudarc::driver::{CudaSlice, DevicePtr, DeviceRepr};
use candle_core::cuda::CudaDType;
use candle_core::CudaDevice;

use crate::consts::{
    LINEAR_MAX_ROWS, LINEAR_THREADS, NORM_PARTS_PER_LANE, NORM_THREADS, NORM_VECS, TILE_MAX_ROWS,
};
use crate::cuda::{
    at16, contiguous16, device, dtype_suffix, err, view, wrap, KernelCall, LaunchConfig, LINEAR,
};
use crate::{KernelPolicy, Result, SkinnyPath};

/// A tile kernel's part in a deferred RMSNorm ([`crate::norm::DeferredNorm`]; `tile_linear` in
/// cuda/linear.cu).
#[derive(Clone, Copy, Default)]
pub(crate) struct NormIo<'a> {
    /// Writing the stream: the next block's norm scale (f32 `[n]`); the kernel also returns the
    /// output times it and the rows' sums of squares by 16-column part ([`NormOut`]).
    pub(crate) out: Option<&'a Tensor>,
    /// Reading it: `x` holds rows of a stream times its norm's scale; their parts' sums of
    /// squares (f32 `[m, ⌈k/16⌉]`) and the norm's eps.
    pub(crate) input: Option<(&'a Tensor, f64)>,
}

/// What a kernel writing a stream gives for its deferred norm: the output times the norm's scale
/// `[m, n]` (x's dtype) and the sums of squares `[m, ⌈n/16⌉]` f32.
pub(crate) type NormOut = (Tensor, Tensor);

/// The deferred norm's buffers and argument words for a tile kernel of `m` rows, `k` inputs and
/// `n` outputs: the six words (`ng, yg, ss, ssi, tiles_in, eps`; zeros for the part `io` leaves
/// out) and the output buffers it allocated. Checks the shapes (an error names the mismatch).
#[allow(clippy::type_complexity)]
fn norm_words<T: CudaDType + DeviceRepr>(
    op: &'static str,
    dev: &CudaDevice,
    io: NormIo,
    (m, k, n): (usize, usize, usize),
) -> Result<([u64; 6], Option<(CudaSlice<T>, CudaSlice<f32>)>)> {
    let stream = dev.cuda_stream();
    let mut words = [0u64; 6];
    let mut bufs = None;
    if let Some(g) = io.out {
        if g.dims() != [n] || g.dtype() != DType::F32 || !g.is_contiguous() {
            return Err(err(
                op,
                format!("norm scale {:?} {:?} for {n} outputs", g.dims(), g.dtype()),
            ));
        }
        let (gs, gl) = g.storage_and_layout();
        words[0] = view::<f32>(op, &gs, gl)?.device_ptr(&stream).0;
        // SAFETY: uninitialised; the kernel writes every element of both (each block its 16
        // columns of every row, and that part's sum of squares).
        let (yg, ss) = unsafe { (dev.alloc::<T>(m * n)?, dev.alloc::<f32>(m * n.div_ceil(16))?) };
        words[1] = yg.device_ptr(&stream).0;
        words[2] = ss.device_ptr(&stream).0;
        bufs = Some((yg, ss));
    }
    if let Some((ss, eps)) = io.input {
        let parts = k.div_ceil(16);
        if ss.dims() != [m, parts] || ss.dtype() != DType::F32 || !ss.is_contiguous() {
            return Err(err(
                op,
                format!(
                    "sums of squares {:?} {:?} for [{m}, {parts}] f32",
                    ss.dims(),
                    ss.dtype()
                ),
            ));
        }
        if parts > 32 * NORM_PARTS_PER_LANE {
            return Err(err(
                op,
                format!(
                    "a deferred norm over rows of {k} (at most {})",
                    32 * 16 * NORM_PARTS_PER_LANE
                ),
            ));
        }
        let (ssg, ssl) = ss.storage_and_layout();
        words[3] = view::<f32>(op, &ssg, ssl)?.device_ptr(&stream).0;
        words[4] = parts as u64;
        words[5] = (eps as f32).to_bits() as u64;
    }
    Ok((words, bufs))
}

/// What the skinny kernel writes: `x·wᵀ (+ res)` with `columns` ∈ {1, 2, 4} outputs per warp,
/// or, for `w = [gate; up]`, the MLP activation `silu(x·gateᵀ) · (x·upᵀ)` (one row).
#[derive(Clone, Copy)]
pub(crate) enum Skinny<'a> {
    Linear { res: Option<&'a Tensor>, columns: usize },
    SwiGlu,
}

/// Rows the normalising skinny kernels take: at most `NORM_THREADS · NORM_VECS` 16-byte vectors
/// (cuda/norm.cu), the rows of the RMSNorm kernel's register path, whose bits they repeat (the
/// kernel's other path sums in another order), with the same thread to vector map
/// (`LINEAR_THREADS` is `NORM_THREADS`, src/consts.rs).
const NORM_MAX_VECS: usize = NORM_THREADS * NORM_VECS;

/// CUDA weight-streaming `x·wᵀ` for `x: [m, k]` (contiguous, 1 ≤ m ≤ 8) and `w: [n, k]` of the
/// same dtype, with the epilogue of `what`: `res: [m, n]` (same dtype) added as the output is
/// written when given, or the SwiGLU of the two halves (`[1, n / 2]`). With `norm` (the RMSNorm's
/// f32 `[k]` scale `1 + w` and eps), `x` is normalised on the way in: the product equals the
/// RMSNorm kernel's output times `wᵀ`, bit for bit. `None` when the kernel cannot take the
/// operands (rows not 16-byte multiples or not 16-byte aligned, `w` or `res` not contiguous; with
/// `norm`, more than one row, rows past the RMSNorm kernel's register path, a strided or non-f32
/// scale):
/// the caller falls back to the matmul (after the separate norm).
pub(crate) fn skinny_linear(
    x: &Tensor,
    w: &Tensor,
    what: Skinny,
    norm: Option<(&Tensor, f64)>,
    policy: &KernelPolicy,
) -> Result<Option<Tensor>> {
    let op = "skinny_linear";
    let dt = x.dtype();
    let (m, k) = x.dims2()?;
    let (n, kw) = w.dims2()?;
    let (res, columns) = match what {
        Skinny::Linear { res, columns } => (res, columns),
        Skinny::SwiGlu => (None, 2),
    };
    let swiglu = matches!(what, Skinny::SwiGlu);
    if kw != k
        || w.dtype() != dt
        || !(1..=LINEAR_MAX_ROWS).contains(&m)
        || ![1, 2, 4].contains(&columns)
        || (swiglu && (m != 1 || n % 2 != 0))
    {
        return Err(err(
            op,
            format!(
                "x {:?} {dt:?} and w {:?} {:?} do not fit ({columns} columns per warp)",
                x.dims(),
                w.dims(),
                w.dtype()
            ),
        ));
    }
    if let Some(r) = res {
        if r.dims() != [m, n] || r.dtype() != dt {
            return Err(err(
                op,
                format!(
                    "residual {:?} {:?}, expected [{m}, {n}] {dt:?}",
                    r.dims(),
                    r.dtype()
                ),
            ));
        }
    }
    let size = dt.size_in_bytes();
    if (k * size) % 16 != 0
        || !contiguous16(x.layout(), size)
        || !contiguous16(w.layout(), size)
        || res.is_some_and(|r| !r.is_contiguous())
    {
        return Ok(None);
    }
    if let Some((scale, _)) = norm {
        if m != 1
            || k * size > NORM_MAX_VECS * 16
            || scale.dims() != [k]
            || scale.dtype() != DType::F32
            || !scale.is_contiguous()
        {
            return Ok(None);
        }
    }
    let dev = device(op, x)?;
    let null: u64 = 0;
    let norm_guard = norm.map(|(s, eps)| (s.storage_and_layout(), eps as f32));
    macro_rules! go {
        ($t:ty) => {{
            let (xs, xl) = x.storage_and_layout();
            let (ws, wl) = w.storage_and_layout();
            let xv = view::<$t>(op, &xs, xl)?;
            let wv = view::<$t>(op, &ws, wl)?;
            let res_guard = res.map(|r| r.storage_and_layout());
            let rv = res_guard
                .as_ref()
                .map(|(rs, rl)| view::<$t>(op, rs, rl))
                .transpose()?;
            // Output columns: the SwiGLU epilogue writes one per gate/up pair.
            let out_n = if swiglu { n / 2 } else { n };
            // SAFETY: uninitialised; the kernel writes every element (each warp its `columns`
            // columns, or its one pair, for every row m).
            let y = unsafe { dev.alloc::<$t>(m * out_n)? };
            let sfx = dtype_suffix(op, dt)?;
            let name = match (swiglu, &norm_guard) {
                (true, None) => format!("skinny_swiglu_{sfx}"),
                (true, Some(_)) => format!("skinny_swiglu_norm_{sfx}"),
                // Two rows and more in 16-bit types: the tensor-core twin (same arguments).
                (false, None) if m > 1 && dt != DType::F32 => {
                    format!("skinny_linear_tc_{sfx}_m{m}_r{columns}")
                }
                (false, None) => format!("skinny_linear_{sfx}_m{m}_r{columns}"),
                (false, Some(_)) => format!("skinny_linear_norm_{sfx}_r{columns}"),
            };
            let func = LINEAR.func(&dev, &name)?;
            let mut lb = KernelCall::new(&dev, &func, policy);
            let (n32, k32) = (out_n as i32, k as i32);
            lb.arg(&xv);
            let scale_view = match &norm_guard {
                Some(((ss, sl), eps)) => Some((view::<f32>(op, ss, sl)?, *eps)),
                None => None,
            };
            if let Some((sv, eps)) = &scale_view {
                lb.arg(sv).arg(eps);
            }
            lb.arg(&wv);
            if !swiglu {
                match &rv {
                    Some(rv) => lb.arg(rv),
                    None => lb.arg(&null),
                };
            }
            lb.arg(&y).arg(&n32).arg(&k32);
            let warps = if swiglu { out_n } else { n.div_ceil(columns) };
            let cfg = LaunchConfig {
                grid_dim: ((warps * 32).div_ceil(LINEAR_THREADS) as u32, 1, 1),
                block_dim: (LINEAR_THREADS as u32, 1, 1),
                // The normalised row.
                shared_mem_bytes: if scale_view.is_some() {
                    (k * size) as u32
                } else {
                    0
                },
            };
            if n > 0 {
                // SAFETY: arguments match `skinny_linear_*_m{m}_r{columns}` or its tensor-core
                // twin `skinny_linear_tc_*` (the same signature; res [m·n] contiguous
                // or a null pointer, 0u64) or `skinny_swiglu_*` (no res; m = 1, n even) in
                // cuda/linear.cu, or their `_norm_` twins, which also take the f32 scale [k]
                // (contiguous) and eps after x, one row of at most NORM_MAX_VECS vectors and k·size
                // bytes of dynamic shared memory (≤ 16 KiB, under the default 48 KiB): x [m·k] and
                // w [n·k] contiguous and 16-byte aligned with k·size a multiple of 16 (checked
                // above), y [m·out_n], i32 out_n and k; one warp per `columns` columns or per
                // gate/up pair.
                unsafe { lb.launch(cfg) }.w()?;
            }
            Ok(Some(wrap(y, &dev, (m, out_n))))
        }};
    }
    match dt {
        DType::F32 => go!(f32),
        DType::BF16 => go!(half::bf16),
        DType::F16 => go!(half::f16),
        _ => Ok(None),
    }
}

/// Below this many 16-column tiles (`n` ≤ 10224) the tile kernels give each tile 8 warps
/// instead of 4: the Qwen3.6-27B projections onto the 5120-wide residual stream have 320 tiles,
/// too few to keep the H200's memory busy with 4 warps each (docs/BENCHMARKS.md §1b).
const FEW_TILES: usize = 640;

/// Warps per 16 output columns of the tile kernels (`tile_linear`, `fp8_linear_mma`) for `n`
/// columns.
fn tile_warps(n: usize) -> usize {
    if n.div_ceil(16) < FEW_TILES {
        8
    } else {
        4
    }
}

/// The n-tiles of 8 rows the dense tile kernel runs `m` rows in (rows past `m` are zeros, so a
/// row's bits do not depend on it): at least two with 8 warps per 16 columns, which measured
/// 11-36% faster than one for 1..8 rows on the 27B's narrow projections, and as many as `m` needs
/// with 4 (one n-tile 2-3% faster there): H200, docs/BENCHMARKS.md §4b.
fn tile_ntiles(m: usize, warps: usize) -> usize {
    let least = if warps == 8 { 2 } else { 1 };
    m.div_ceil(8).max(least)
}

/// Warps per 16 columns and n-tiles of the FP8 tile kernel for `m` rows of `n` columns: 8 warps
/// and one n-tile for 1..8 rows (the 27B's FP8 decode 5% and its MTP k = 3 cycle 11% faster than
/// with 4 warps on wide layers and two n-tiles, or the diagonal one-row kernel it replaced: H200,
/// docs/BENCHMARKS.md §1b), past 8 rows [`tile_warps`] and ⌈m/8⌉ n-tiles. A row's bits depend
/// on the warps (each sums its own steps before the block adds them), not on the n-tiles: under
/// [`SkinnyPath::Uniform`] every row count keeps 8 warps, batch-invariant up to `TILE_MAX_ROWS`
/// rows; by default 1..8 rows are (and so are 9..16 of the 27B's narrow layers, which take 8;
/// from `fp8_gemm_min_rows` its layers run the FP8 GEMM on sm_90).
fn fp8_tile_shape(m: usize, n: usize, policy: &KernelPolicy) -> (usize, usize) {
    let warps = if m <= LINEAR_MAX_ROWS || policy.skinny == SkinnyPath::Uniform {
        8
    } else {
        tile_warps(n)
    };
    (warps, m.div_ceil(8))
}

/// Whether the FP8 tile kernel for `n` columns in `nt` n-tiles of `warps` warps is the one that
/// prefetches its next round: under [`KernelPolicy::tile_prefetch`], for 1..8 rows (8 warps, one
/// n-tile) of layers of fewer than [`FEW_TILES`] tiles, whose blocks all run at once, so that the
/// loads each keeps in flight set their pace (the 27B's 5120-wide projections 17-21% faster at
/// 1..4 rows on an H100; the wider layers slower with it, at 3 or 4 blocks an SM:
/// docs/BENCHMARKS.md §1b).
fn fp8_prefetches(policy: &KernelPolicy, n: usize, warps: usize, nt: usize) -> bool {
    policy.tile_prefetch && n.div_ceil(16) < FEW_TILES && warps == 8 && nt == 1
}

/// The launch of a tile kernel (dense or FP8) over `n` columns: one block of `warps` warps per
/// 16 columns, static shared memory only.
fn tile_launch(n: usize, warps: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(16) as u32, 1, 1),
        block_dim: (32 * warps as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// CUDA `x·wᵀ (+ res)` on tensor cores for `x: [m, k]` (contiguous, 1 ≤ m ≤ `TILE_MAX_ROWS`) and `w: [n, k]`,
/// both bf16 or both f16, with `res: [m, n]` added as the output is written: the tile kernel, whose
/// rows are batch-invariant (each row the same bits whatever `m`), with its part in a deferred
/// norm (`io`; the output's, returned beside it). `None` when it cannot take the operands (f32,
/// `k` not a multiple of 16, a strided or misaligned operand); an error when the shapes or dtypes
/// do not match.
pub(crate) fn tile_linear(
    x: &Tensor,
    w: &Tensor,
    res: Option<&Tensor>,
    io: NormIo,
    policy: &KernelPolicy,
) -> Result<Option<(Tensor, Option<NormOut>)>> {
    let op = "tile_linear";
    let dt = x.dtype();
    let (m, k) = x.dims2()?;
    let (n, kw) = w.dims2()?;
    if kw != k || w.dtype() != dt || !(1..=TILE_MAX_ROWS).contains(&m) || n > i32::MAX as usize {
        return Err(err(
            op,
            format!("x {:?} {dt:?} and w {:?} {:?}", x.dims(), w.dims(), w.dtype()),
        ));
    }
    if res.is_some_and(|r| r.dims() != [m, n] || r.dtype() != dt) {
        return Err(err(
            op,
            format!("residual {:?}, expected [{m}, {n}] {dt:?}", res.map(Tensor::dims)),
        ));
    }
    if !matches!(dt, DType::BF16 | DType::F16)
        || k % 16 != 0
        || k > i32::MAX as usize
        || !contiguous16(x.layout(), 2)
        || !contiguous16(w.layout(), 2)
        || res.is_some_and(|r| !r.is_contiguous())
    {
        return Ok(None);
    }
    let dev = device(op, x)?;
    let null: u64 = 0;
    let warps = tile_warps(n);
    macro_rules! go {
        ($t:ty) => {{
            let (xs, xl) = x.storage_and_layout();
            let (ws, wl) = w.storage_and_layout();
            let xv = view::<$t>(op, &xs, xl)?;
            let wv = view::<$t>(op, &ws, wl)?;
            let res_guard = res.map(|r| r.storage_and_layout());
            let rv = res_guard
                .as_ref()
                .map(|(rs, rl)| view::<$t>(op, rs, rl))
                .transpose()?;
            // SAFETY: uninitialised; the kernel writes every element (each block its 16 columns
            // of every row).
            let y = unsafe { dev.alloc::<$t>(m * n)? };
            let name = format!(
                "tile_linear_{}_t{}_w{warps}",
                dtype_suffix(op, dt)?,
                tile_ntiles(m, warps)
            );
            let func = LINEAR.func(&dev, &name)?;
            let mut lb = KernelCall::new(&dev, &func, policy);
            let (m32, n32, k32) = (m as i32, n as i32, k as i32);
            lb.arg(&xv).arg(&wv);
            match &rv {
                Some(rv) => lb.arg(rv),
                None => lb.arg(&null),
            };
            lb.arg(&y).arg(&m32).arg(&n32).arg(&k32);
            let (words, bufs) = norm_words::<$t>(op, &dev, io, (m, k, n))?;
            for word in &words {
                lb.arg(word);
            }
            let cfg = tile_launch(n, warps);
            if n > 0 {
                // SAFETY: arguments match `tile_linear_{sfx}_t{nt}_w{warps}` in cuda/linear.cu:
                // x [m·k] and w [n·k] of T, contiguous and 16-byte aligned with k a multiple of 16
                // (checked above), res [m·n] contiguous or a null pointer (0u64), y [m·n], i32 m
                // (at most 8 per n-tile: nt ≥ ⌈m/8⌉), n and k, then the deferred norm's ng [n],
                // yg [m·n], ss [m·⌈n/16⌉], ssi [m·⌈k/16⌉] (null pointers or tensors alive through
                // this call, shapes checked by `norm_words`), i32 tiles_in, f32 eps; one block of
                // `warps` warps per 16 columns (static shared memory).
                unsafe { lb.launch(cfg) }.w()?;
            }
            let out = bufs.map(|(yg, ss)| (wrap(yg, &dev, (m, n)), wrap(ss, &dev, (m, n.div_ceil(16)))));
            Ok(Some((wrap(y, &dev, (m, n)), out)))
        }};
    }
    match dt {
        DType::BF16 => go!(half::bf16),
        _ => go!(half::f16),
    }
}

/// The kernel's requirements on an FP8 weight: `in` and the column block multiples of 16 (each
/// 16-byte vector of a row in one block), contiguous operands.
fn fp8_fits(w: &super::Fp8Weight) -> bool {
    let (_, k) = w.dims();
    let [_, bi] = w.block();
    k % 16 == 0 && bi % 16 == 0 && w.q().is_contiguous() && w.scale().is_contiguous()
}

/// Whether 16-bit activations of `dtype` go through the FP8 tile kernel under `policy` (column
/// blocks holding whole 64-element steps, `in · bi` below 2³² for its block index, the policy not
/// asking for the CUDA-core kernel): then it takes up to `TILE_MAX_ROWS` rows a call, else the
/// CUDA-core kernel 8.
fn fp8_tensor(dtype: DType, w: &super::Fp8Weight, policy: &KernelPolicy) -> bool {
    let bi = w.block()[1];
    matches!(dtype, DType::BF16 | DType::F16)
        && bi % 64 == 0
        && (w.dims().1 as u64) * (bi as u64) < 1 << 32
        && !matches!(policy.skinny, SkinnyPath::Streaming(_) | SkinnyPath::Multi(_))
}

/// The most rows one [`fp8_linear`] call takes for activations of `dtype`.
pub(crate) fn fp8_max_rows(dtype: DType, w: &super::Fp8Weight, policy: &KernelPolicy) -> usize {
    fp8_rows_for(fp8_tensor(dtype, w, policy))
}

/// The most rows of the tile kernel (`tiles`) or of the CUDA-core FP8 kernel.
fn fp8_rows_for(tiles: bool) -> usize {
    if tiles {
        TILE_MAX_ROWS
    } else {
        LINEAR_MAX_ROWS
    }
}

/// CUDA `x·(e4m3(w)·scale)ᵀ (+ res)` for `x: [m, k]` (contiguous, 1 ≤ m ≤ [`fp8_max_rows`],
/// f32/bf16/f16) and an FP8 weight `[n, k]`, streaming the weight bytes once (half of bf16's), with
/// `res: [m, n]` (x's dtype) added as the output is written, and the tile kernel's part in a
/// deferred norm (`io`, as [`tile_linear`]'s). `None` when the kernel cannot take the operands
/// (`k` or the column block not multiples of 16, a strided or misaligned operand, a deferred norm
/// outside the tile kernel): the caller dequantizes and multiplies.
pub(crate) fn fp8_linear(
    x: &Tensor,
    w: &super::Fp8Weight,
    res: Option<&Tensor>,
    io: NormIo,
    policy: &KernelPolicy,
) -> Result<Option<(Tensor, Option<NormOut>)>> {
    let op = "fp8_linear";
    let dt = x.dtype();
    let (m, k) = x.dims2()?;
    let (n, kw) = w.dims();
    // 16-bit activations through the tile kernel ([`fp8_tensor`]), f32 (or a policy asking for
    // the streaming kernels) through the CUDA-core kernel.
    let tiles = fp8_tensor(dt, w, policy);
    if kw != k || !(1..=fp8_rows_for(tiles)).contains(&m) || n * k > i32::MAX as usize * 4 {
        return Err(err(op, format!("x {:?} for an FP8 weight [{n}, {kw}]", x.dims())));
    }
    if let Some(r) = res {
        if r.dims() != [m, n] || r.dtype() != dt {
            return Err(err(
                op,
                format!(
                    "residual {:?} {:?}, expected [{m}, {n}] {dt:?}",
                    r.dims(),
                    r.dtype()
                ),
            ));
        }
    }
    let size = dt.size_in_bytes();
    if !fp8_fits(w)
        || !contiguous16(x.layout(), size)
        || !contiguous16(w.q().layout(), 1)
        || res.is_some_and(|r| !r.is_contiguous())
        || !matches!(dt, DType::F32 | DType::BF16 | DType::F16)
        || (!tiles && (io.out.is_some() || io.input.is_some()))
    {
        return Ok(None);
    }
    let dev = device(op, x)?;
    let null: u64 = 0;
    let [bo, bi] = w.block();
    let (tile_warps, tile_nt) = fp8_tile_shape(m, n, policy);
    // The CUDA-core kernel: two columns per warp while few rows leave registers to spare.
    let columns = if m <= 2 { 2 } else { 1 };
    macro_rules! go {
        ($t:ty) => {{
            let (xs, xl) = x.storage_and_layout();
            let (qs, ql) = w.q().storage_and_layout();
            let (ss, sl) = w.scale().storage_and_layout();
            let xv = view::<$t>(op, &xs, xl)?;
            let qv = view::<float8::F8E4M3>(op, &qs, ql)?;
            let sv = view::<f32>(op, &ss, sl)?;
            let res_guard = res.map(|r| r.storage_and_layout());
            let rv = res_guard
                .as_ref()
                .map(|(rs, rl)| view::<$t>(op, rs, rl))
                .transpose()?;
            // SAFETY: uninitialised; the kernel writes every element (each warp its columns of
            // every row).
            let y = unsafe { dev.alloc::<$t>(m * n)? };
            let sfx = dtype_suffix(op, dt)?;
            let name = if tiles {
                let p = if fp8_prefetches(policy, n, tile_warps, tile_nt) {
                    "p"
                } else {
                    ""
                };
                format!("fp8_linear_mma_{sfx}_t{tile_nt}_w{tile_warps}{p}")
            } else {
                format!("fp8_linear_{sfx}_m{m}_r{columns}")
            };
            let func = LINEAR.func(&dev, &name)?;
            let mut lb = KernelCall::new(&dev, &func, policy);
            let (m32, n32, k32, bo32, bi32) = (m as i32, n as i32, k as i32, bo as i32, bi as i32);
            lb.arg(&xv).arg(&qv).arg(&sv);
            match &rv {
                Some(rv) => lb.arg(rv),
                None => lb.arg(&null),
            };
            lb.arg(&y);
            if tiles {
                lb.arg(&m32);
            }
            lb.arg(&n32).arg(&k32).arg(&bo32).arg(&bi32);
            let (words, bufs) = norm_words::<$t>(op, &dev, io, (m, k, n))?;
            if tiles {
                for word in &words {
                    lb.arg(word);
                }
            }
            let cfg = if tiles {
                tile_launch(n, tile_warps)
            } else {
                LaunchConfig {
                    grid_dim: ((n.div_ceil(columns) * 32).div_ceil(LINEAR_THREADS) as u32, 1, 1),
                    block_dim: (LINEAR_THREADS as u32, 1, 1),
                    shared_mem_bytes: 0,
                }
            };
            if n > 0 {
                // SAFETY: arguments match `name` in cuda/linear.cu (every FP8 GEMV takes the
                // same, the tile kernel with i32 m before n): x [m·k] (16-byte aligned), w [n·k]
                // bytes (16-byte aligned, k a multiple of 16) and scale [⌈n/bo⌉·⌈k/bi⌉] f32, all
                // contiguous (checked above), res [m·n] contiguous or a null pointer (0u64),
                // y [m·n], m at most 8 (the tile kernel: at most 8 per n-tile, `fp8_tile_shape`),
                // i32 n, k, bo, bi with bi a multiple of 16 (for the tile kernel, with x 16-bit,
                // of 64 and k·bi below 2³², `fp8_tensor`), then for the tile kernel the deferred
                // norm's six (as `tile_linear`'s, checked by `norm_words`; none elsewhere, which
                // `io` then leaves empty, checked above); one warp per `columns` columns, or one
                // block of `tile_warps` warps per 16 columns for the tile kernel (its shared
                // memory is static).
                unsafe { lb.launch(cfg) }.w()?;
            }
            let out = bufs.map(|(yg, ss)| (wrap(yg, &dev, (m, n)), wrap(ss, &dev, (m, n.div_ceil(16)))));
            Ok(Some((wrap(y, &dev, (m, n)), out)))
        }};
    }
    match dt {
        DType::F32 => go!(f32),
        DType::BF16 => go!(half::bf16),
        _ => go!(half::f16),
    }
}

/// The weight of a `[gate; up]` layer (`2·i` rows) for [`tile_swiglu`].
#[derive(Clone, Copy)]
pub(crate) enum SwiGluWeight<'a> {
    /// Of x's dtype.
    Dense(&'a Tensor),
    /// FP8 with block scales.
    Fp8(&'a super::Fp8Weight),
}

/// CUDA `silu(x·gateᵀ) · (x·upᵀ)`, `[m, i]`, for `x: [m, k]` (contiguous, bf16 or f16, 1 ≤ m ≤ 8)
/// and a `[gate; up]` weight of `2·i` rows, in one launch of the tile kernel with the SwiGLU in
/// its epilogue: the bits of the layer's tile kernel ([`tile_linear`] or [`fp8_linear`], with
/// the warps it would take, reading a deferred norm's rows with `norm`) followed by the SwiGLU
/// kernel. `None` when that kernel cannot take the operands (the caller then runs the two steps).
pub(crate) fn tile_swiglu(
    x: &Tensor,
    w: SwiGluWeight,
    norm: Option<(&Tensor, f64)>,
    policy: &KernelPolicy,
) -> Result<Option<Tensor>> {
    let op = "tile_swiglu";
    let dt = x.dtype();
    let (m, k) = x.dims2()?;
    let (rows, kw) = match w {
        SwiGluWeight::Dense(w) => w.dims2()?,
        SwiGluWeight::Fp8(w) => w.dims(),
    };
    if kw != k || matches!(w, SwiGluWeight::Dense(w) if w.dtype() != dt) {
        return Err(err(
            op,
            format!("x {:?} {dt:?} for a weight [{rows}, {kw}]", x.dims()),
        ));
    }
    let fits = match w {
        SwiGluWeight::Dense(w) => contiguous16(w.layout(), 2) && rows <= i32::MAX as usize,
        SwiGluWeight::Fp8(w) => {
            fp8_tensor(dt, w, policy)
                && fp8_fits(w)
                && contiguous16(w.q().layout(), 1)
                && rows * k <= i32::MAX as usize * 4
        }
    };
    if !fits
        || !matches!(dt, DType::BF16 | DType::F16)
        || !(1..=LINEAR_MAX_ROWS).contains(&m)
        || rows % 2 != 0
        || k % 16 != 0
        || k > i32::MAX as usize
        || !contiguous16(x.layout(), 2)
    {
        return Ok(None);
    }
    let n = rows / 2;
    // The warps the layer's own tile kernel takes for its `rows` columns (FP8, 1..=8 rows: 8,
    // `fp8_tile_shape`; the only FP8 SwiGLU kernel).
    let warps = match w {
        SwiGluWeight::Dense(_) => tile_warps(rows),
        SwiGluWeight::Fp8(_) => fp8_tile_shape(m, rows, policy).0,
    };
    let dev = device(op, x)?;
    macro_rules! go {
        ($t:ty) => {{
            let (xs, xl) = x.storage_and_layout();
            let xv = view::<$t>(op, &xs, xl)?;
            // SAFETY: uninitialised; the kernel writes every element (each block its 8 columns of
            // every row).
            let y = unsafe { dev.alloc::<$t>(m * n)? };
            let sfx = dtype_suffix(op, dt)?;
            let (m32, n32, k32) = (m as i32, n as i32, k as i32);
            let input = NormIo {
                out: None,
                input: norm,
            };
            let (words, _) = norm_words::<$t>(op, &dev, input, (m, k, 2 * n))?;
            let cfg = LaunchConfig {
                grid_dim: (n.div_ceil(8) as u32, 1, 1),
                block_dim: (32 * warps as u32, 1, 1),
                shared_mem_bytes: 0,
            };
            match w {
                SwiGluWeight::Dense(w) => {
                    let (ws, wl) = w.storage_and_layout();
                    let wv = view::<$t>(op, &ws, wl)?;
                    let func = LINEAR.func(&dev, &format!("tile_swiglu_{sfx}_w{warps}"))?;
                    let mut lb = KernelCall::new(&dev, &func, policy);
                    lb.arg(&xv).arg(&wv).arg(&y).arg(&m32).arg(&n32).arg(&k32);
                    for word in &words[3..] {
                        lb.arg(word);
                    }
                    if n > 0 {
                        // SAFETY: arguments match `tile_swiglu_{sfx}_w{warps}` in cuda/linear.cu:
                        // x [m·k] and w [2n·k] of T, contiguous and 16-byte aligned with k a
                        // multiple of 16 (checked above), y [m·n], i32 m (1..=8: one n-tile), n,
                        // k, then a deferred norm's ssi [m·⌈k/16⌉] (null or checked by
                        // `norm_words`), i32 tiles_in, f32 eps; one block of `warps` (4 or 8)
                        // warps per 8 output columns (static shared memory).
                        unsafe { lb.launch(cfg) }.w()?;
                    }
                }
                SwiGluWeight::Fp8(w) => {
                    let (qs, ql) = w.q().storage_and_layout();
                    let (ss, sl) = w.scale().storage_and_layout();
                    let qv = view::<float8::F8E4M3>(op, &qs, ql)?;
                    let sv = view::<f32>(op, &ss, sl)?;
                    let [bo, bi] = w.block();
                    let (bo32, bi32) = (bo as i32, bi as i32);
                    let func = LINEAR.func(&dev, &format!("fp8_swiglu_mma_{sfx}_w{warps}"))?;
                    let mut lb = KernelCall::new(&dev, &func, policy);
                    lb.arg(&xv)
                        .arg(&qv)
                        .arg(&sv)
                        .arg(&y)
                        .arg(&m32)
                        .arg(&n32)
                        .arg(&k32);
                    lb.arg(&bo32).arg(&bi32);
                    for word in &words[3..] {
                        lb.arg(word);
                    }
                    if n > 0 {
                        // SAFETY: arguments match `fp8_swiglu_mma_{sfx}_w{warps}` in
                        // cuda/linear.cu: x [m·k] of T (16-byte aligned), w [2n·k] bytes (16-byte
                        // aligned, k a multiple of 16) and scale [⌈2n/bo⌉·⌈k/bi⌉] f32, contiguous,
                        // bi a multiple of 64 with k·bi below 2³² (`fp8_fits`, `fp8_tensor`,
                        // checked above), y [m·n], i32 m (1..=8), n, k, bo, bi, then the deferred
                        // norm's three (as above); one block of `warps` warps per 8 output
                        // columns (static shared memory).
                        unsafe { lb.launch(cfg) }.w()?;
                    }
                }
            }
            Ok(Some(wrap(y, &dev, (m, n))))
        }};
    }
    match dt {
        DType::BF16 => go!(half::bf16),
        _ => go!(half::f16),
    }
}

/// The FP8 layer `w8` and the dense layer `w16` (x's dtype, no biases) on the same `x: [m, k]`
/// (contiguous, bf16 or f16, 1 ≤ m ≤ 8) in one launch of the tile kernels (`fp8_pair_mma_*`):
/// `(x·(e4m3(w8)·scale)ᵀ, x·w16ᵀ)`, each the bits of its own launch ([`fp8_linear`],
/// [`tile_linear`]), which the pair repeats: 8 warps per 16 columns, the FP8 tile path; with
/// `norm`, both reading a deferred norm's rows. `None` when one of them would not take that path
/// (then the caller runs them apart).
pub(crate) fn fp8_dense_pair(
    x: &Tensor,
    w8: &super::Fp8Weight,
    w16: &Tensor,
    norm: Option<(&Tensor, f64)>,
    policy: &KernelPolicy,
) -> Result<Option<(Tensor, Tensor)>> {
    let op = "fp8_dense_pair";
    let dt = x.dtype();
    let (m, k) = x.dims2()?;
    let (n8, k8) = w8.dims();
    let (n16, k16) = w16.dims2()?;
    if k8 != k || k16 != k || w16.dtype() != dt {
        return Err(err(
            op,
            format!(
                "x {:?} {dt:?}, FP8 w [{n8}, {k8}], w {:?} {:?}",
                x.dims(),
                w16.dims(),
                w16.dtype()
            ),
        ));
    }
    // (1..=8 rows: the FP8 tile kernel takes 8 warps, `fp8_tile_shape`.)
    if !(1..=LINEAR_MAX_ROWS).contains(&m)
        || !fp8_tensor(dt, w8, policy)
        || tile_warps(n16) != 8
        || !fp8_fits(w8)
        || k > i32::MAX as usize
        || n8 * k > i32::MAX as usize * 4
        || !contiguous16(x.layout(), 2)
        || !contiguous16(w8.q().layout(), 1)
        || !contiguous16(w16.layout(), 2)
    {
        return Ok(None);
    }
    let dev = device(op, x)?;
    let [bo, bi] = w8.block();
    macro_rules! go {
        ($t:ty) => {{
            let (xs, xl) = x.storage_and_layout();
            let (qs, ql) = w8.q().storage_and_layout();
            let (ss, sl) = w8.scale().storage_and_layout();
            let (ws, wl) = w16.storage_and_layout();
            let xv = view::<$t>(op, &xs, xl)?;
            let qv = view::<float8::F8E4M3>(op, &qs, ql)?;
            let sv = view::<f32>(op, &ss, sl)?;
            let wv = view::<$t>(op, &ws, wl)?;
            // SAFETY: uninitialised; the kernel writes every element of both (each block its 16
            // columns of every row of its layer).
            let (y8, y16) = unsafe { (dev.alloc::<$t>(m * n8)?, dev.alloc::<$t>(m * n16)?) };
            let func = LINEAR.func(&dev, &format!("fp8_pair_mma_{}", dtype_suffix(op, dt)?))?;
            let mut lb = KernelCall::new(&dev, &func, policy);
            let (m32, k32, n8_32, n16_32) = (m as i32, k as i32, n8 as i32, n16 as i32);
            let (bo32, bi32) = (bo as i32, bi as i32);
            lb.arg(&xv)
                .arg(&qv)
                .arg(&sv)
                .arg(&y8)
                .arg(&n8_32)
                .arg(&bo32)
                .arg(&bi32);
            lb.arg(&wv).arg(&y16).arg(&n16_32).arg(&m32).arg(&k32);
            let input = NormIo {
                out: None,
                input: norm,
            };
            let (words, _) = norm_words::<$t>(op, &dev, input, (m, k, n8 + n16))?;
            for word in &words[3..] {
                lb.arg(word);
            }
            let cfg = tile_launch(n8.div_ceil(16) * 16 + n16.div_ceil(16) * 16, 8);
            if n8 + n16 > 0 {
                // SAFETY: arguments match `fp8_pair_mma_{sfx}` in cuda/linear.cu: x [m·k] of T,
                // w8 [n8·k] bytes and w16 [n16·k] of T, contiguous and 16-byte aligned, with
                // scale [⌈n8/bo⌉·⌈k/bi⌉] f32 contiguous, k a multiple of 16, bi of 64 and k·bi
                // below 2³² (`fp8_fits`, `fp8_tensor`, checked above), y8 [m·n8] and y16 [m·n16], i32
                // n8, bo, bi, n16, m (1..=8: one n-tile) and k, then a deferred norm's ssi
                // [m·⌈k/16⌉] (null or checked by `norm_words`), i32 tiles_in, f32 eps; one block
                // of 8 warps per 16 columns of either layer, the dense layer's first (static
                // shared memory).
                unsafe { lb.launch(cfg) }.w()?;
            }
            Ok(Some((wrap(y8, &dev, (m, n8)), wrap(y16, &dev, (m, n16)))))
        }};
    }
    match dt {
        DType::BF16 => go!(half::bf16),
        _ => go!(half::f16),
    }
}

/// The dequantized FP8 weight `[n, k]` in `dtype` (one kernel: each element times its block's
/// scale in f32, rounded once, as the CPU reference does); `None` when the kernel cannot take it.
pub(crate) fn fp8_dequantize(
    w: &super::Fp8Weight,
    dtype: DType,
    policy: &KernelPolicy,
) -> Result<Option<Tensor>> {
    let op = "fp8_dequantize";
    if !w.q().is_contiguous()
        || !w.scale().is_contiguous()
        || !matches!(dtype, DType::F32 | DType::BF16 | DType::F16)
    {
        return Ok(None);
    }
    let (n, k) = w.dims();
    let [bo, bi] = w.block();
    let dev = device(op, w.q())?;
    macro_rules! go {
        ($t:ty) => {{
            let (qs, ql) = w.q().storage_and_layout();
            let (ss, sl) = w.scale().storage_and_layout();
            let qv = view::<float8::F8E4M3>(op, &qs, ql)?;
            let sv = view::<f32>(op, &ss, sl)?;
            // SAFETY: uninitialised; the kernel writes every element (one thread per element,
            // grid-stride).
            let out = unsafe { dev.alloc::<$t>(n * k)? };
            // Whole 16-byte vectors in one column block: a thread per vector.
            let vec16 = k % 16 == 0 && bi % 16 == 0 && at16(ql, 1);
            let kind = if vec16 { "fp8_dequant16" } else { "fp8_dequant" };
            let func = LINEAR.func(&dev, &format!("{kind}_{}", dtype_suffix(op, dtype)?))?;
            let mut lb = KernelCall::new(&dev, &func, policy);
            let (n32, k32, bo32, bi32) = (n as i32, k as i32, bo as i32, bi as i32);
            lb.arg(&qv)
                .arg(&sv)
                .arg(&out)
                .arg(&n32)
                .arg(&k32)
                .arg(&bo32)
                .arg(&bi32);
            let total = n * k;
            let threads = if vec16 { total / 16 } else { total };
            let cfg = LaunchConfig {
                grid_dim: (threads.div_ceil(256).clamp(1, 65535) as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            if total > 0 {
                // SAFETY: arguments match `{kind}_{sfx}` in cuda/linear.cu: w [n·k] bytes
                // and scale [⌈n/bo⌉·⌈k/bi⌉] f32, contiguous (checked above), out [n·k], i32 n,
                // k, bo, bi (below 2^31: Fp8Weight::new); a grid-stride loop over the elements,
                // or over w's 16-byte vectors (16-byte aligned, checked) when k and bi are
                // multiples of 16.
                unsafe { lb.launch(cfg) }.w()?;
            }
            Ok(Some(wrap(out, &dev, (n, k))))
        }};
    }
    match dtype {
        DType::F32 => go!(f32),
        DType::BF16 => go!(half::bf16),
        _ => go!(half::f16),
    }
}
