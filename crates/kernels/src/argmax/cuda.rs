//! Launcher of the two-stage argmax in cuda/argmax.cu.

use candle_core::cuda::WrapErr;
use candle_core::Tensor;

use crate::consts::{ARGMAX_CHUNK, ARGMAX_THREADS};
use crate::cuda::{device, dtype_suffix, err, for_float_dtype, view, wrap, KernelCall, LaunchConfig, ARGMAX};
use crate::{KernelPolicy, Result};

/// CUDA twin of [`super::argmax_last_dim`]: chunks of each row in parallel, then one block per row.
pub(crate) fn argmax_last_dim(x: &Tensor, policy: &KernelPolicy) -> Result<Tensor> {
    let op = "argmax_last_dim";
    let dt = x.dtype();
    let dev = device(op, x)?;
    let n = x.dim(candle_core::D::Minus1)?;
    let rows = x.elem_count() / n.max(1);
    let out_shape: Vec<usize> = x.dims()[..x.rank() - 1].to_vec();
    if n == 0 || n > i32::MAX as usize {
        return Err(err(op, format!("rows of {n} elements")));
    }
    let chunks = n.div_ceil(ARGMAX_CHUNK);
    let x = x.contiguous()?;
    macro_rules! go {
        ($t:ty) => {{
            let (xs, xl) = x.storage_and_layout();
            let xv = view::<$t>(op, &xs, xl)?;
            // SAFETY: uninitialised; stage 1 writes every (row, chunk) pair, stage 2 every row.
            let pv = unsafe { dev.alloc::<f32>(rows * chunks)? };
            let pi = unsafe { dev.alloc::<i32>(rows * chunks)? };
            let out = unsafe { dev.alloc::<u32>(rows)? };
            if rows > 0 {
                let f = ARGMAX.func(&dev, &format!("argmax_chunks_{}", dtype_suffix(op, dt)?))?;
                let mut lb = KernelCall::new(&dev, &f, policy);
                let (n32, c32) = (n as i32, ARGMAX_CHUNK as i32);
                lb.arg(&xv).arg(&pv).arg(&pi).arg(&n32).arg(&c32);
                let cfg = LaunchConfig {
                    grid_dim: (chunks as u32, rows as u32, 1),
                    block_dim: (ARGMAX_THREADS as u32, 1, 1),
                    shared_mem_bytes: 0,
                };
                // SAFETY: arguments match `argmax_chunks_*` in cuda/argmax.cu: x [rows·n]
                // contiguous, pv and pi [rows·chunks], i32 n and chunk; grid (chunks, rows).
                unsafe { lb.launch(cfg) }.w()?;
                let f = ARGMAX.func(&dev, "argmax_merge")?;
                let mut lb = KernelCall::new(&dev, &f, policy);
                let c32 = chunks as i32;
                lb.arg(&pv).arg(&pi).arg(&out).arg(&c32);
                let cfg = LaunchConfig {
                    grid_dim: (rows as u32, 1, 1),
                    block_dim: (ARGMAX_THREADS as u32, 1, 1),
                    shared_mem_bytes: 0,
                };
                // SAFETY: arguments match `argmax_merge`: the pairs written above, out [rows] u32,
                // i32 chunks; one block per row.
                unsafe { lb.launch(cfg) }.w()?;
            }
            Ok(wrap(out, &dev, out_shape))
        }};
    }
    for_float_dtype!(op, dt)
}
