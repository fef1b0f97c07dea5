//! Row copies between state pools: one launch moves many sequences' rows (a speculative commit
//! puts each verified sequence's kept state into its slot), where a copy per row would cost a
//! launch each.
//!
//! [`reference`](mod@reference) holds the CPU form; `cuda.rs` the launcher of cuda/copy.cu.

#[cfg(feature = "cuda")]
mod cuda;
pub mod reference;

use candle_core::{DType, Tensor};

use crate::{Error, KernelPolicy, Result};

/// Copies row `src_rows[i]` of `src: [n_src, ..., w_src]` into row `dst_rows[i]` of `dst:
/// [n_dst, ..., w_dst]` for every `i` (both contiguous, one dtype, the same inner dims but the
/// last; `dst` updated in place), taking along the last dim the `w_dst` elements from column
/// `src_cols[i]` (0 without `src_cols`): a whole row when the widths are equal, a window of it
/// otherwise. The indices are u32 `[n]` tensors on the pools' device; the `dst_rows` must be
/// distinct. A row or window outside the pools is an error on the CPU; on CUDA (which does not
/// read the indices back) that copy is skipped.
pub fn copy_rows(
    dst: &Tensor,
    src: &Tensor,
    dst_rows: &Tensor,
    src_rows: &Tensor,
    src_cols: Option<&Tensor>,
    policy: &KernelPolicy,
) -> Result<()> {
    let op = "copy_rows";
    let n = dst_rows.dim(0).unwrap_or(0);
    let index_ok = |t: &Tensor| t.dtype() == DType::U32 && t.dims() == [n];
    let (dr, sr) = (dst.rank(), src.rank());
    let fits = dr >= 2
        && dr == sr
        && dst.dims()[1..dr - 1] == src.dims()[1..sr - 1]
        && dst.dims()[dr - 1] <= src.dims()[sr - 1]
        && dst.dtype() == src.dtype()
        && dst.is_contiguous()
        && src.is_contiguous()
        && index_ok(dst_rows)
        && index_ok(src_rows)
        && src_cols.is_none_or(index_ok);
    if !fits {
        return Err(Error::Shape {
            op,
            msg: format!(
                "dst {:?} {:?} (contiguous {}) and src {:?} {:?} (contiguous {}) with indices {:?} \
                 {:?} / {:?} {:?} / {:?} do not fit",
                dst.dtype(),
                dst.dims(),
                dst.is_contiguous(),
                src.dtype(),
                src.dims(),
                src.is_contiguous(),
                dst_rows.dtype(),
                dst_rows.dims(),
                src_rows.dtype(),
                src_rows.dims(),
                src_cols.map(|c| (c.dtype(), c.dims().to_vec()))
            ),
        });
    }
    crate::expect_out_buffer(op, "dst", dst, dst.dtype(), dst.dims(), ("src", src))?;
    if n == 0 {
        return Ok(());
    }
    if dst.device().is_cuda() {
        #[cfg(feature = "cuda")]
        return cuda::copy_rows(dst, src, dst_rows, src_rows, src_cols, policy);
    }
    let _ = policy;
    reference::copy_rows(dst, src, dst_rows, src_rows, src_cols)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    const P: &KernelPolicy = &KernelPolicy::DEFAULT;

    /// Whole rows and windows of the last dim land in their destination rows and nowhere else;
    /// bad shapes, shared buffers and indices outside the pools are named.
    #[test]
    fn rows_and_windows_land_in_their_rows() -> Result<()> {
        let dev = Device::Cpu;
        let src = qwen36_testutil::randn(240, 1.0, (4, 3, 5), &dev)?;
        let dst = Tensor::zeros((6, 3, 5), DType::F32, &dev)?;
        let idx = |v: &[u32]| Tensor::new(v, &dev);
        copy_rows(&dst, &src, &idx(&[5, 0])?, &idx(&[1, 3])?, None, P)?;
        let diff = |a: &Tensor, b: &Tensor| -> Result<f32> {
            Ok((a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?)
        };
        assert_eq!(diff(&dst.get(5)?, &src.get(1)?)?, 0.0);
        assert_eq!(diff(&dst.get(0)?, &src.get(3)?)?, 0.0);
        for r in 1..5 {
            assert_eq!(dst.get(r)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?, 0.0);
        }
        // Windows: 2 columns from column 3 of row 2, from column 0 of row 0.
        let narrow = Tensor::zeros((3, 3, 2), DType::F32, &dev)?;
        copy_rows(
            &narrow,
            &src,
            &idx(&[1, 2])?,
            &idx(&[2, 0])?,
            Some(&idx(&[3, 0])?),
            P,
        )?;
        assert_eq!(diff(&narrow.get(1)?, &src.get(2)?.narrow(1, 3, 2)?)?, 0.0);
        assert_eq!(diff(&narrow.get(2)?, &src.get(0)?.narrow(1, 0, 2)?)?, 0.0);
        assert_eq!(
            narrow.get(0)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?,
            0.0
        );

        for (cols, rows, msg) in [
            (Some(idx(&[4, 0])?), idx(&[2, 0])?, "column 4"),
            (None, idx(&[4, 0])?, "row 4"),
        ] {
            let e = copy_rows(&narrow, &src, &idx(&[1, 2])?, &rows, cols.as_ref(), P).unwrap_err();
            assert!(e.to_string().contains(msg), "{e}");
        }
        let e = copy_rows(&narrow, &src, &idx(&[3, 2])?, &idx(&[0, 0])?, None, P).unwrap_err();
        assert!(e.to_string().contains("row 3"), "{e}");
        let e = copy_rows(&narrow, &src, &idx(&[1, 1])?, &idx(&[0, 0])?, None, P).unwrap_err();
        assert!(e.to_string().contains("twice"), "{e}");
        let wide = Tensor::zeros((3, 3, 6), DType::F32, &dev)?;
        let e = copy_rows(&wide, &src, &idx(&[1])?, &idx(&[0])?, None, P).unwrap_err();
        assert!(e.to_string().contains("do not fit"), "{e}");
        let e = copy_rows(&src, &src, &idx(&[1])?, &idx(&[0])?, None, P).unwrap_err();
        assert!(e.to_string().contains("shares its buffer"), "{e}");
        Ok(())
    }
}
