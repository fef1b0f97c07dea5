//! Launcher of the fused per-head RMSNorm + RoPE kernel of gated attention (cuda/norm.cu).

use candle_core::cuda::WrapErr;
use candle_core::Tensor;

use crate::consts::{ROPE_MAX_VECS, ROPE_WARPS};
use crate::cuda::{
    at16, device, dtype_suffix, for_float_dtype, row_stride, rows_view, view, wrap, KernelCall, LaunchConfig,
    NORM,
};
use crate::{KernelPolicy, Result};

/// CUDA twin of [`super::norm_rope_heads`] (arguments checked there): `None` when the kernel cannot
/// take the rows (not 16-byte aligned, a head wider than 64 vectors, no single row stride).
#[allow(clippy::too_many_arguments)]
pub(crate) fn norm_rope_heads(
    x: &Tensor,
    heads: usize,
    head_stride: usize,
    head_dim: usize,
    scale: Option<&Tensor>,
    eps: f64,
    cos: &Tensor,
    sin: &Tensor,
    policy: &KernelPolicy,
) -> Result<Option<Tensor>> {
    let op = "norm_rope_heads";
    let dt = x.dtype();
    let (b, t, _) = x.dims3()?;
    let size = dt.size_in_bytes();
    let Some(xs) = row_stride(x) else {
        return Ok(None);
    };
    let fits = (head_dim * size) % 16 == 0
        && (head_stride * size) % 16 == 0
        && (xs * size) % 16 == 0
        && at16(x.layout(), size)
        && head_dim * size <= ROPE_MAX_VECS * 32 * 16
        && cos.dtype() == dt
        && sin.dtype() == dt;
    if !fits {
        return Ok(None);
    }
    let (cos, sin) = (cos.contiguous()?, sin.contiguous()?);
    let dev = device(op, x)?;
    let rows = b * t * heads;
    let null: u64 = 0;
    macro_rules! go {
        ($t:ty) => {{
            let (xst, xl) = x.storage_and_layout();
            let xv = rows_view::<$t>(op, &xst, xl, b * t, heads * head_stride, xs)?;
            let (cst, cl) = cos.storage_and_layout();
            let (sst, sl) = sin.storage_and_layout();
            let (cv, sv) = (view::<$t>(op, &cst, cl)?, view::<$t>(op, &sst, sl)?);
            let scale_guard = scale.map(|s| s.storage_and_layout());
            let scv = scale_guard
                .as_ref()
                .map(|(st, l)| view::<f32>(op, st, l))
                .transpose()?;
            // SAFETY: uninitialised; the kernel writes every element (a warp per row, every
            // 16-byte vector of it).
            let y = unsafe { dev.alloc::<$t>(rows * head_dim)? };
            if rows > 0 {
                let func = NORM.func(&dev, &format!("norm_rope_heads_{}", dtype_suffix(op, dt)?))?;
                let mut lb = KernelCall::new(&dev, &func, policy);
                let (xs64, hs32) = (xs as i64, head_stride as i32);
                lb.arg(&xv).arg(&xs64).arg(&hs32);
                match &scv {
                    Some(v) => lb.arg(v),
                    None => lb.arg(&null),
                };
                let dims = [t as i32, heads as i32, head_dim as i32, 2 * cos.dim(1)? as i32];
                lb.arg(&cv).arg(&sv).arg(&y);
                for d in &dims {
                    lb.arg(d);
                }
                let (eps32, rows32) = (eps as f32, rows as i32);
                lb.arg(&eps32).arg(&rows32);
                let cfg = LaunchConfig {
                    grid_dim: (rows.div_ceil(ROPE_WARPS) as u32, 1, 1),
                    block_dim: ((ROPE_WARPS * 32) as u32, 1, 1),
                    shared_mem_bytes: 0,
                };
                // SAFETY: arguments match `norm_rope_heads_*` in cuda/norm.cu: x as b·t rows of
                // heads·head_stride elements xs apart (the view spans exactly them; rows, heads and
                // head_dim 16-byte aligned, head_dim at most ROPE_MAX_VECS vectors per lane, checked
                // above), i64 xs, i32 head stride, scale [head_dim] f32 or null, cos/sin [t,
                // rotary/2] contiguous, y [rows·head_dim] fresh, i32 t, heads, head_dim, rotary
                // dims, f32 eps, i32 rows; one warp per row.
                unsafe { lb.launch(cfg) }.w()?;
            }
            Ok(Some(wrap(y, &dev, (b, heads, t, head_dim))))
        }};
    }
    for_float_dtype!(op, dt)
}
