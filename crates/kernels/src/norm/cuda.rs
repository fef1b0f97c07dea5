//! Launchers of the RMSNorm kernels in cuda/norm.cu: a block per row (with the residual sum, or
//! in registers for rows that fit), a warp per short row, and the gated norm.

use candle_core::cuda::WrapErr;
use candle_core::{DType, Tensor};

use crate::consts::{NORM_THREADS, NORM_VECS};
use crate::cuda::{
    at16, device, dtype_suffix, err, for_float_dtype, row_stride, rows_view, view, wrap, KernelCall,
    LaunchConfig, NORM,
};
use crate::{KernelPolicy, Result};

/// Whether rows of `d` elements of `size` bytes take the warp kernel (`rms_norm_warp`: at most
/// 1024 bytes in 16-byte vectors), where their layout allows.
fn warp_rows(d: usize, size: usize) -> bool {
    (d * size) % 16 == 0 && d * size <= 1024
}

/// Whether rows of `d` elements of `size` bytes fit the block kernel's registers in 16-byte
/// vectors (its vectorised path: at most NORM_THREADS · NORM_VECS vectors), where their layout
/// allows.
fn vector_rows(d: usize, size: usize) -> bool {
    (d * size) % 16 == 0 && d * size <= NORM_THREADS * NORM_VECS * 16
}

fn norm_launch(rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (NORM_THREADS as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// CUDA twin of [`super::RmsNorm::forward`] (`residual: None`) and
/// [`super::RmsNorm::forward_residual`]: rows of `x` (plus `residual`, same shape and dtype), f32
/// `scale: [D]`. Returns `(y, Some(x + residual))`.
pub(crate) fn rms_norm(
    x: &Tensor,
    residual: Option<&Tensor>,
    scale: &Tensor,
    eps: f64,
    policy: &KernelPolicy,
) -> Result<(Tensor, Option<Tensor>)> {
    let op = "rms_norm";
    let dt = x.dtype();
    let dev = device(op, x)?;
    let d = x.dim(candle_core::D::Minus1)?;
    let rows = x.elem_count() / d.max(1);
    if let Some(r) = residual {
        if r.dims() != x.dims() || r.dtype() != dt {
            return Err(err(
                op,
                format!(
                    "residual {:?} {:?} must match x {:?} {dt:?}",
                    r.dims(),
                    r.dtype(),
                    x.dims()
                ),
            ));
        }
    }
    let scale = scale.to_dtype(DType::F32)?.contiguous()?;
    if scale.elem_count() != d {
        return Err(err(
            op,
            format!("scale has {} elements for rows of {d}", scale.elem_count()),
        ));
    }
    if residual.is_none() {
        // Short rows (per-head norms): a warp per row, reading a view of wider rows in place.
        let size = dt.size_in_bytes();
        if let Some(rs) =
            row_stride(x).filter(|&rs| warp_rows(d, size) && (rs * size) % 16 == 0 && at16(x.layout(), size))
        {
            return Ok((rms_norm_warp(x, rs, &scale, eps, rows, d, policy)?, None));
        }
    }
    let x = x.contiguous()?;
    let res = residual.map(|r| r.contiguous()).transpose()?;
    if let Some(r) = &res {
        // The sum's normalisation has the bits of `rms_norm(x + residual)`: where that would
        // take another kernel (rows short enough for a warp) or the vectors below would not
        // (x or the residual off a 16-byte boundary), the two steps.
        let size = dt.size_in_bytes();
        let aligned = at16(x.layout(), size) && at16(r.layout(), size);
        if warp_rows(d, size) || (vector_rows(d, size) && !aligned) {
            let sum = (&x + r)?;
            let (y, _) = rms_norm(&sum, None, &scale, eps, policy)?;
            return Ok((y, Some(sum)));
        }
    }
    macro_rules! go {
        ($t:ty) => {{
            let (xs, xl) = x.storage_and_layout();
            let (ss, sl) = scale.storage_and_layout();
            let xv = view::<$t>(op, &xs, xl)?;
            let sv = view::<f32>(op, &ss, sl)?;
            let rs = res.as_ref().map(|r| r.storage_and_layout());
            let rv = rs.as_ref().map(|(s, l)| view::<$t>(op, s, l)).transpose()?;
            // SAFETY: uninitialised; the kernel writes every element of y (and of sum).
            let y = unsafe { dev.alloc::<$t>(rows * d)? };
            let sum = match rv {
                Some(_) => Some(unsafe { dev.alloc::<$t>(rows * d)? }),
                None => None,
            };
            let func = NORM.func(&dev, &format!("rms_norm_{}", dtype_suffix(op, dt)?))?;
            let mut lb = KernelCall::new(&dev, &func, policy);
            let null = 0u64;
            lb.arg(&xv);
            match (&rv, &sum) {
                (Some(r), Some(s)) => lb.arg(r).arg(s),
                _ => lb.arg(&null).arg(&null),
            };
            // The vectorised path: 16-byte rows (fresh buffers and contiguous views at a
            // 16-byte offset) of at most NORM_THREADS · NORM_VECS vectors (cuda/norm.cu).
            let size = dt.size_in_bytes();
            let vec =
                vector_rows(d, size) && at16(xl, size) && rs.as_ref().is_none_or(|(_, l)| at16(l, size));
            let (d32, eps32, vec32) = (d as i32, eps as f32, vec as i32);
            lb.arg(&sv).arg(&y).arg(&d32).arg(&eps32).arg(&vec32);
            if rows > 0 {
                // SAFETY: arguments match `rms_norm_*` in cuda/norm.cu: x [rows·d], residual and
                // sum [rows·d] (or both null), scale [d] f32, y [rows·d], i32 d, f32 eps, i32
                // vec (set only for 16-byte aligned rows that fit the registers, checked above;
                // y and sum are fresh allocations); one block per row.
                unsafe { lb.launch(norm_launch(rows)) }.w()?;
            }
            let shape = x.shape().clone();
            Ok((wrap(y, &dev, shape.clone()), sum.map(|s| wrap(s, &dev, shape))))
        }};
    }
    for_float_dtype!(op, dt)
}

/// [`rms_norm`] without a residual for rows of at most 1024 bytes in 16-byte vectors: `x` as `rows`
/// rows of `d` elements `rs` apart (16-byte aligned), one warp per row.
fn rms_norm_warp(
    x: &Tensor,
    rs: usize,
    scale: &Tensor,
    eps: f64,
    rows: usize,
    d: usize,
    policy: &KernelPolicy,
) -> Result<Tensor> {
    let op = "rms_norm";
    let dt = x.dtype();
    let dev = device(op, x)?;
    macro_rules! go {
        ($t:ty) => {{
            let (xs, xl) = x.storage_and_layout();
            let (ss, sl) = scale.storage_and_layout();
            let xv = rows_view::<$t>(op, &xs, xl, rows, d, rs)?;
            let sv = view::<f32>(op, &ss, sl)?;
            // SAFETY: uninitialised; the kernel writes every element of y (a warp per row).
            let y = unsafe { dev.alloc::<$t>(rows * d)? };
            if rows > 0 {
                let func = NORM.func(&dev, &format!("rms_norm_warp_{}", dtype_suffix(op, dt)?))?;
                let mut lb = KernelCall::new(&dev, &func, policy);
                let (rs64, r32, d32, eps32) = (rs as i64, rows as i32, d as i32, eps as f32);
                lb.arg(&xv)
                    .arg(&rs64)
                    .arg(&sv)
                    .arg(&y)
                    .arg(&r32)
                    .arg(&d32)
                    .arg(&eps32);
                let cfg = LaunchConfig {
                    grid_dim: (rows.div_ceil(NORM_THREADS / 32) as u32, 1, 1),
                    block_dim: (NORM_THREADS as u32, 1, 1),
                    shared_mem_bytes: 0,
                };
                // SAFETY: arguments match `rms_norm_warp_*` in cuda/norm.cu: x as rows rows of d
                // elements rs apart (the view spans exactly them; rows 16-byte aligned and at most
                // 1024 bytes, checked by the caller), i64 rs, scale [d] f32, y [rows·d], i32 rows
                // and d, f32 eps.
                unsafe { lb.launch(cfg) }.w()?;
            }
            Ok(wrap(y, &dev, x.shape().clone()))
        }};
    }
    for_float_dtype!(op, dt)
}

/// CUDA twin of [`super::GatedRmsNorm::forward`] for an f32 `x` and a gate `z` (same shape) already in the
/// output dtype; `weight: [D]` f32.
pub(crate) fn gated_rms_norm(
    x: &Tensor,
    z: &Tensor,
    weight: &Tensor,
    eps: f64,
    policy: &KernelPolicy,
) -> Result<Tensor> {
    let op = "gated_rms_norm";
    let dt = z.dtype();
    let dev = device(op, x)?;
    let d = x.dim(candle_core::D::Minus1)?;
    let rows = x.elem_count() / d.max(1);
    let zw = z.dim(candle_core::D::Minus1)?;
    if x.dtype() != DType::F32
        || z.elem_count() != x.elem_count()
        || zw % d.max(1) != 0
        || weight.elem_count() != d
    {
        return Err(err(
            op,
            format!(
                "x {:?} {:?} must be f32, z {:?} the same shape or [..., heads·{d}], weight [{d}]",
                x.dims(),
                x.dtype(),
                z.dims()
            ),
        ));
    }
    let x = x.contiguous()?;
    // z rows: `zh` rows of x per row of z (a projection's token row), `zs` apart, read in place.
    let zh = zw / d.max(1);
    let (z, zs) = match row_stride(z) {
        Some(rs) => (z.clone(), rs),
        None => (z.contiguous()?, zw),
    };
    let w = weight.to_dtype(DType::F32)?.contiguous()?;
    macro_rules! go {
        ($t:ty) => {{
            let (xs, xl) = x.storage_and_layout();
            let (zst, zl) = z.storage_and_layout();
            let (ws, wl) = w.storage_and_layout();
            let xv = view::<f32>(op, &xs, xl)?;
            let zv = rows_view::<$t>(op, &zst, zl, rows / zh.max(1), zw, zs)?;
            let wv = view::<f32>(op, &ws, wl)?;
            // SAFETY: uninitialised; the kernel writes every element.
            let y = unsafe { dev.alloc::<$t>(rows * d)? };
            let func = NORM.func(&dev, &format!("gated_rms_norm_{}", dtype_suffix(op, dt)?))?;
            let mut lb = KernelCall::new(&dev, &func, policy);
            let (r32, d32, eps32, zh32, zs64) = (rows as i32, d as i32, eps as f32, zh as i32, zs as i64);
            lb.arg(&xv)
                .arg(&zv)
                .arg(&wv)
                .arg(&y)
                .arg(&r32)
                .arg(&d32)
                .arg(&eps32)
                .arg(&zh32)
                .arg(&zs64);
            if rows > 0 {
                let warps = NORM_THREADS / 32;
                let cfg = LaunchConfig {
                    grid_dim: (rows.div_ceil(warps) as u32, 1, 1),
                    block_dim: (NORM_THREADS as u32, 1, 1),
                    shared_mem_bytes: 0,
                };
                // SAFETY: arguments match `gated_rms_norm_*` in cuda/norm.cu: x [rows·d] f32, z as
                // rows/zh rows of zh·d elements zs apart (the view spans exactly them), w [d] f32,
                // y [rows·d], i32 rows and d, f32 eps, i32 zh, i64 zs; one warp per row.
                unsafe { lb.launch(cfg) }.w()?;
            }
            Ok(wrap(y, &dev, x.shape().clone()))
        }};
    }
    for_float_dtype!(op, dt)
}
