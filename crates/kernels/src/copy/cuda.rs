//! Launcher of the row copies in cuda/copy.cu.

use candle_core::cuda::WrapErr;
use candle_core::Tensor;

use crate::consts::{COPY_THREADS, COPY_TILE};
use crate::cuda::{device, err, for_float_dtype, in_place, view, KernelCall, LaunchConfig, COPY};
use crate::{KernelPolicy, Result};

/// CUDA twin of [`super::copy_rows`] (shapes checked by the caller): one kernel, a block per
/// (row, tile of COPY_TILE elements).
pub(crate) fn copy_rows(
    dst: &Tensor,
    src: &Tensor,
    dst_rows: &Tensor,
    src_rows: &Tensor,
    src_cols: Option<&Tensor>,
    policy: &KernelPolicy,
) -> Result<()> {
    let op = "copy_rows";
    let dev = device(op, dst)?;
    let n = dst_rows.dim(0)?;
    let last = dst.rank() - 1;
    let (w, src_w) = (dst.dim(last)?, src.dim(last)?);
    let m = dst.dims()[1..last].iter().product::<usize>();
    let elems = m * w;
    let sizes = [src.dim(0)?, dst.dim(0)?, m, src_w, w];
    if sizes.iter().any(|&s| s > i32::MAX as usize) {
        return Err(err(
            op,
            format!("pools of {sizes:?} are too large for the kernel"),
        ));
    }
    let name = format!("copy_rows_b{}", dst.dtype().size_in_bytes());
    let (dst_rows, src_rows) = (dst_rows.contiguous()?, src_rows.contiguous()?);
    let src_cols = src_cols.map(Tensor::contiguous).transpose()?;
    macro_rules! go {
        ($t:ty) => {
            in_place(op, dst, |ds, range| {
                let mut dv = ds.as_cuda_slice_mut::<$t>()?.slice_mut(range);
                let (ss, sl) = src.storage_and_layout();
                let sv = view::<$t>(op, &ss, sl)?;
                let (drs, drl) = dst_rows.storage_and_layout();
                let (srs, srl) = src_rows.storage_and_layout();
                let drv = view::<u32>(op, &drs, drl)?;
                let srv = view::<u32>(op, &srs, srl)?;
                let cols_guard = src_cols.as_ref().map(|c| c.storage_and_layout());
                let cv = match &cols_guard {
                    Some((cs, cl)) => Some(view::<u32>(op, cs, cl)?),
                    None => None,
                };
                let f = COPY.func(&dev, &name)?;
                let mut lb = KernelCall::new(&dev, &f, policy);
                let null = 0u64;
                lb.arg(&sv).arg(&mut dv).arg(&srv).arg(&drv);
                match &cv {
                    Some(c) => lb.arg(c),
                    None => lb.arg(&null),
                };
                let dims = sizes.map(|s| s as i32);
                for d in &dims {
                    lb.arg(d);
                }
                let cfg = LaunchConfig {
                    grid_dim: (n as u32, elems.div_ceil(COPY_TILE).max(1) as u32, 1),
                    block_dim: (COPY_THREADS as u32, 1, 1),
                    shared_mem_bytes: 0,
                };
                // SAFETY: arguments match `copy_rows_b{2,4}` in cuda/copy.cu for this element
                // size: src and dst contiguous (checked by the caller, distinct storages, checked
                // too) of src_n·m·src_w and dst_n·m·dst_w elements, the u32 [n] indices (the
                // columns or null), i32 src_n, dst_n, m, src_w, dst_w; the kernel skips a block
                // whose rows or window fall outside, so every access stays inside the pools.
                unsafe { lb.launch(cfg) }.w()?;
                Ok(())
            })
        };
    }
    for_float_dtype!(op, dst.dtype())
}
