//! The CPU references of attention: f32 loops over every (batch, head, row) with a softmax over
//! the visible keys; candle's scatter for the KV write and its softmax for the masked scores.

use candle_core::{DType, Device, Tensor, D};

use super::AttentionInputs;
use crate::Result;

/// [`super::decode_attention`] on the host (arguments checked by the caller).
pub fn decode_attention(x: AttentionInputs, len: &Tensor, t: usize) -> Result<Tensor> {
    let AttentionInputs { q, k, v, gate, scale } = x;
    let (b, h, r, d) = q.dims4()?;
    let heads = h * r / t;
    let out = rows_at_len(q, k, v, len, t, scale)?
        .reshape((b, h, r / t, t, d))?
        .permute((0, 3, 1, 2, 4))?
        .reshape((b, t, heads, d))?;
    Ok(match gate {
        Some(g) => (out * candle_nn::ops::sigmoid(g)?)?,
        None => out,
    })
}

/// [`super::write_kv`] through candle's scatter (arguments checked by the caller; a position past
/// the buffer is an error).
pub fn write_kv(
    k: &Tensor,
    v: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    positions: &Tensor,
) -> Result<()> {
    let (b, h, t, d) = k.dims4()?;
    let index = positions
        .reshape((1, 1, t, 1))?
        .broadcast_as((b, h, t, d))?
        .contiguous()?;
    k_cache.scatter_set(&index, &k.contiguous()?, 2)?;
    v_cache.scatter_set(&index, &v.contiguous()?, 2)?;
    Ok(())
}

/// [`super::write_kv_rows`] through candle's scatter along the pool's rows (arguments checked by
/// the caller; a row past the pool is an error).
pub fn write_kv_rows(k: &Tensor, v: &Tensor, k_pool: &Tensor, v_pool: &Tensor, rows: &Tensor) -> Result<()> {
    let (h, n, d) = k.dims3()?;
    let index = rows.reshape((n, 1, 1))?.broadcast_as((n, h, d))?.contiguous()?;
    k_pool.scatter_set(&index, &k.transpose(0, 1)?.contiguous()?, 0)?;
    v_pool.scatter_set(&index, &v.transpose(0, 1)?.contiguous()?, 0)?;
    Ok(())
}

/// [`super::paged_decode_attention`] on the host (arguments checked by the caller): each
/// sequence's keys and values gathered from the pools through its block table, then
/// [`decode_attention`] on them. A block past the pool is an error.
pub fn paged_decode_attention(x: AttentionInputs, pages: super::Pages, t: usize) -> Result<Tensor> {
    let AttentionInputs { q, k, v, gate, scale } = x;
    let cpu = Device::Cpu;
    let tables = pages.tables.to_device(&cpu)?.to_vec2::<u32>()?;
    let lens = pages.lens.to_device(&cpu)?.to_vec1::<u32>()?;
    let bs = pages.block_size;
    let mut outs = Vec::with_capacity(lens.len());
    for (i, (table, &len)) in tables.iter().zip(&lens).enumerate() {
        let len = (len as usize).min(table.len() * bs);
        let rows: Vec<u32> = (0..len)
            .map(|p| table[p / bs] * bs as u32 + (p % bs) as u32)
            .collect();
        let rows = Tensor::new(rows.as_slice(), k.device())?;
        // [len, kv_heads, hd] → [1, kv_heads, len, hd]
        let gather = |pool: &Tensor| -> Result<Tensor> {
            Ok(pool
                .index_select(&rows, 0)?
                .transpose(0, 1)?
                .unsqueeze(0)?
                .contiguous()?)
        };
        let (ks, vs) = (gather(k)?, gather(v)?);
        let gate = gate.map(|g| g.narrow(0, i, 1)).transpose()?;
        let qi = q.narrow(0, i, 1)?;
        let lt = Tensor::new(&[len as u32], &cpu)?;
        outs.push(decode_attention(
            AttentionInputs::new(&qi, &ks, &vs, gate.as_ref(), scale),
            &lt,
            t,
        )?);
    }
    Ok(Tensor::cat(&outs, 0)?)
}

/// [`super::prefill_attention`] on the host (arguments checked by the caller): the f32 loops, then
/// the gate in `q`'s dtype.
pub fn prefill_attention(x: AttentionInputs, pos0: usize) -> Result<Tensor> {
    let AttentionInputs { q, k, v, gate, scale } = x;
    let (b, h, t, d) = q.dims4()?;
    let kh = k.dim(1)?;
    // Rows r = member·t + token of each KV head's group, as the reference takes them.
    let qg = q.contiguous()?.reshape((b, kh, h / kh * t, d))?;
    let out = reference_rows(&qg, k, v, pos0 + t, t, scale)?.reshape((b, h, t, d))?;
    Ok(match gate {
        Some(g) => (out * candle_nn::ops::sigmoid(&g.transpose(1, 2)?.to_dtype(q.dtype())?)?)?,
        None => out,
    })
}

/// [`super::causal_softmax`]: the scale, an additive mask and candle's softmax (whole blocks,
/// checked by the caller).
pub fn causal_softmax(scores: &Tensor, scale: f64, pos0: usize, block: usize) -> Result<Tensor> {
    let keys = scores.dim(D::Minus1)?;
    let rows = scores.elem_count() / keys.max(1);
    let dev = scores.device();
    let x = (scores.to_dtype(DType::F32)?.reshape((rows, keys))? * scale)?;
    let pos = Tensor::arange(pos0 as u32, (pos0 + block) as u32, dev)?
        .repeat(rows / block)?
        .reshape((rows, 1))?;
    let key = Tensor::arange(0u32, keys as u32, dev)?.reshape((1, keys))?;
    // A large finite negative rather than -inf: exp underflows to exactly 0 either way, and
    // 0 * -inf would be NaN.
    let mask = (key.broadcast_gt(&pos)?.to_dtype(DType::F32)? * -1e30)?;
    let probs = candle_nn::ops::softmax_last_dim(&x.broadcast_add(&mask)?)?;
    Ok(probs.to_dtype(scores.dtype())?.reshape(scores.dims())?)
}

/// The CPU reference: f32 loops over every (batch, head, row), softmax over the visible keys.
fn rows_at_len(q: &Tensor, k: &Tensor, v: &Tensor, len: &Tensor, t: usize, scale: f64) -> Result<Tensor> {
    let l = len.to_device(&Device::Cpu)?.to_vec1::<u32>()?[0] as usize;
    reference_rows(q, k, v, l, t, scale)
}

/// [`rows_at_len`] with the valid length `l` as a host number (clamped to the buffer).
fn reference_rows(q: &Tensor, k: &Tensor, v: &Tensor, l: usize, t: usize, scale: f64) -> Result<Tensor> {
    let (b, h, r, d) = q.dims4()?;
    let cap = k.dim(2)?;
    let l = l.min(cap);
    let (qh, kh, vh) = (crate::host_f32(q)?, crate::host_f32(k)?, crate::host_f32(v)?);
    let mut out = vec![0f32; b * h * r * d];
    let mut p = vec![0f32; l];
    for bh in 0..b * h {
        for row in 0..r {
            let qr = &qh[(bh * r + row) * d..][..d];
            // Visible keys: 0..=position of this row's token.
            let seen = (l + 1 + row % t).saturating_sub(t).min(l);
            let mut m = f32::NEG_INFINITY;
            for (j, pj) in p[..seen].iter_mut().enumerate() {
                let kr = &kh[(bh * cap + j) * d..][..d];
                *pj = qr.iter().zip(kr).map(|(a, b)| a * b).sum::<f32>() * scale as f32;
                m = m.max(*pj);
            }
            let mut sum = 0f32;
            for pj in &mut p[..seen] {
                *pj = (*pj - m).exp();
                sum += *pj;
            }
            let o = &mut out[(bh * r + row) * d..][..d];
            for (j, pj) in p[..seen].iter().enumerate() {
                let vr = &vh[(bh * cap + j) * d..][..d];
                for (oe, ve) in o.iter_mut().zip(vr) {
                    *oe += pj / sum * ve;
                }
            }
        }
    }
    Ok(Tensor::from_vec(out, (b, h, r, d), &Device::Cpu)?
        .to_dtype(q.dtype())?
        .to_device(q.device())?)
}
