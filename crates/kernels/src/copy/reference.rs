//! The CPU form of the row copies: one `slice_set` per row.

use candle_core::{Device, Tensor};

use crate::{Error, Result};

/// [`super::copy_rows`] on the host (shapes checked by the caller; indices outside the pools,
/// and a destination row named twice, are errors).
pub fn copy_rows(
    dst: &Tensor,
    src: &Tensor,
    dst_rows: &Tensor,
    src_rows: &Tensor,
    src_cols: Option<&Tensor>,
) -> Result<()> {
    let op = "copy_rows";
    let host = |t: &Tensor| t.to_device(&Device::Cpu)?.to_vec1::<u32>();
    let (dr, sr) = (host(dst_rows)?, host(src_rows)?);
    let cols = match src_cols {
        Some(c) => host(c)?,
        None => vec![0; dr.len()],
    };
    let last = dst.rank() - 1;
    let (width, src_width) = (dst.dim(last)?, src.dim(last)?);
    let bad = |msg: String| Err(Error::Shape { op, msg });
    for (i, ((&d, &s), &c)) in dr.iter().zip(&sr).zip(&cols).enumerate() {
        if d as usize >= dst.dim(0)? {
            return bad(format!("destination row {d} is outside the {} rows", dst.dim(0)?));
        }
        if dr[..i].contains(&d) {
            return bad(format!("destination row {d} is named twice"));
        }
        if s as usize >= src.dim(0)? {
            return bad(format!("source row {s} is outside the {} rows", src.dim(0)?));
        }
        if c as usize + width > src_width {
            return bad(format!(
                "a window of {width} from column {c} is outside rows of {src_width}"
            ));
        }
        let row = src.get(s as usize)?.narrow(last - 1, c as usize, width)?;
        dst.slice_set(&row.contiguous()?.unsqueeze(0)?, 0, d as usize)?;
    }
    Ok(())
}
