//! Launchers of cuda/attention.cu: the KV write, decode attention (tensor cores, the splits merged
//! by each row block's last block, or split-K partials and the merge kernels), FlashAttention-2
//! prefill and the causal softmax of the matmul path.

use candle_core::cuda::WrapErr;
use candle_core::{DType, Tensor};

use super::{decode_attention_fits, AttentionInputs, PREFILL_HEAD_DIMS};
use crate::consts::{
    ATTENTION_GROUP, ATTENTION_KEYS_PER_SPAN as KEYS_PER_SPAN, ATTENTION_THREADS, FLASH_QUERY_TILE,
    FLASH_TILE, FLASH_WARPS, SOFTMAX_THREADS,
};
use crate::cuda::{
    at16, device, dtype_suffix, err, for_float_dtype, in_place, span_view, view, wrap, KernelCall,
    LaunchConfig, ATTENTION,
};
use crate::{KernelPolicy, Result};

/// Most splits per KV head of the tensor-core decode kernel: one sequence's 4 KV heads at 32k keys
/// or more fill 256 blocks (two one-tile blocks an SM), each walking consecutive tiles.
const FLASH_DECODE_SPLITS: usize = 64;

/// A row of the tensor-core decode kernel with `n` key tiles takes splits of at least
/// min(ceil(n / FLASH_DECODE_CUT_DIV), FLASH_DECODE_CUT_MAX) tiles: one tile a split at 1k keys
/// (a lone sequence's work spread over the GPU), 4 at 8k, 8 from 16k (a block's fixed costs,
/// its Q load, first tile and merge, weigh less when many sequences fill the GPU).
const FLASH_DECODE_CUT_DIV: usize = 32;
const FLASH_DECODE_CUT_MAX: usize = 8;

/// Most tiles of 16 query rows a block of the tensor-core decode kernel takes (`_g1` .. `_g3`;
/// four would cap a thread at 128 registers, and head dim 256 would spill).
const FLASH_DECODE_GROUPS: usize = 3;

/// CUDA twin of [`super::write_kv`] (shapes checked by the caller): one kernel writes the new rows of both
/// buffers at the positions `positions` holds.
pub(crate) fn write_kv(
    k: &Tensor,
    v: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    positions: &Tensor,
    policy: &KernelPolicy,
) -> Result<()> {
    let (_, h, _, d) = k.dims4()?;
    let cap = k_cache.dim(2)?;
    let strides = [h * cap * d, cap * d, d].map(|s| s as i64);
    kv_write(
        "write_kv",
        k,
        v,
        (k_cache, v_cache),
        (cap, strides),
        positions,
        policy,
    )
}

/// CUDA twin of [`super::write_kv_rows`] (shapes checked by the caller): the KV write kernel with
/// the pool's layout, `[rows, h, d]`.
pub(crate) fn write_kv_rows(
    k: &Tensor,
    v: &Tensor,
    k_pool: &Tensor,
    v_pool: &Tensor,
    rows: &Tensor,
    policy: &KernelPolicy,
) -> Result<()> {
    let (h, _, d) = k.dims3()?;
    let cap = k_pool.dim(0)?;
    let strides = [0, d, h * d].map(|s| s as i64);
    let (k, v) = (k.unsqueeze(0)?, v.unsqueeze(0)?);
    kv_write(
        "write_kv_rows",
        &k,
        &v,
        (k_pool, v_pool),
        (cap, strides),
        rows,
        policy,
    )
}

/// The KV write kernel: row `i` of `k, v: [b, h, t, d]` to position `positions[i]` of each
/// cache, whose position rows (`cap` of them per head) sit at the given (batch, head, position)
/// element strides.
fn kv_write(
    op: &'static str,
    k: &Tensor,
    v: &Tensor,
    (k_cache, v_cache): (&Tensor, &Tensor),
    (cap, cache_strides): (usize, [i64; 3]),
    positions: &Tensor,
    policy: &KernelPolicy,
) -> Result<()> {
    let (b, h, t, d) = k.dims4()?;
    let ((k, ks), (v, vs)) = (strided_rows(k)?, strided_rows(v)?);
    let positions = positions.contiguous()?;
    let dt = k.dtype();
    let dev = device(op, &k)?;
    let name = format!("kv_write_b{}", dt.size_in_bytes());
    macro_rules! go {
        ($t:ty) => {
            // Both buffers are written: one in-place op inside the other.
            in_place(op, v_cache, |vst, vrange| {
                let mut vc = vst.as_cuda_slice_mut::<$t>()?.slice_mut(vrange);
                in_place(op, k_cache, |kst, krange| {
                    let mut kc = kst.as_cuda_slice_mut::<$t>()?.slice_mut(krange);
                    let (kg, kl) = k.storage_and_layout();
                    let (vg, vl) = v.storage_and_layout();
                    let (pg, pl) = positions.storage_and_layout();
                    let kv = span_view::<$t>(op, &kg, kl)?;
                    let vv = span_view::<$t>(op, &vg, vl)?;
                    let pv = view::<u32>(op, &pg, pl)?;
                    let f = ATTENTION.func(&dev, &name)?;
                    let mut lb = KernelCall::new(&dev, &f, policy);
                    lb.arg(&kv).arg(&vv);
                    for s in ks.iter().chain(&vs) {
                        lb.arg(s);
                    }
                    let (cap32, d32) = (cap as i32, d as i32);
                    lb.arg(&pv).arg(&mut kc).arg(&mut vc);
                    for s in &cache_strides {
                        lb.arg(s);
                    }
                    lb.arg(&cap32).arg(&d32);
                    let cfg = LaunchConfig {
                        grid_dim: (t as u32, h as u32, b as u32),
                        block_dim: (d.min(256) as u32, 1, 1),
                        shared_mem_bytes: 0,
                    };
                    // SAFETY: arguments match `kv_write_b{2,4}` in cuda/attention.cu for this
                    // dtype's size: k and v [b, h, t, d] with contiguous rows, each view spanning
                    // every element its three i64 strides address, positions [t] u32, the cache
                    // buffers contiguous (checked by the caller; distinct storages, checked too)
                    // with the three i64 strides of their layout ([b, h, cap, d], or a [cap, h, d]
                    // pool with b = 1), i32 cap, d; grid (t, h, b); positions ≥ cap are skipped,
                    // so every write stays inside the buffers.
                    if b * h * t * d > 0 {
                        unsafe { lb.launch(cfg) }.w()?;
                    }
                    Ok(())
                })
            })
        };
    }
    for_float_dtype!(op, dt)
}

/// A `[d0, d1, d2, n]` tensor as the kernels read it through strides: rows of `n` contiguous
/// elements (a strided view stays in place, anything else is copied) and the strides of its
/// first three dims.
fn strided_rows(t: &Tensor) -> Result<(Tensor, [i64; 3])> {
    let t = if t.stride()[3] == 1 {
        t.clone()
    } else {
        t.contiguous()?
    };
    let st = t.stride();
    let strides = [st[0], st[1], st[2]].map(|s| s as i64);
    Ok((t, strides))
}

/// An attention output gate `[b, t, heads, hd]` through [`strided_rows`]; `(None, zeros)` without
/// one.
fn gate_rows(gate: Option<&Tensor>) -> Result<(Option<Tensor>, [i64; 3])> {
    Ok(match gate.map(strided_rows).transpose()? {
        Some((g, strides)) => (Some(g), strides),
        None => (None, [0; 3]),
    })
}

/// CUDA twin of [`super::decode_attention`] (shapes checked by the caller): the tensor-core kernel,
/// whose last block of each row block merges the splits, or the split-K partial kernel over spans
/// of `KEYS_PER_SPAN` keys and then the merge kernels; the merge writes the output token-major and
/// applies the gate. Grids cover the whole buffer (`cap`); spans past the device-side length
/// return at once, so a recorded graph stays valid as `len` grows.
pub(crate) fn decode_attention(
    x: AttentionInputs,
    len: &Tensor,
    t: usize,
    policy: &KernelPolicy,
) -> Result<Tensor> {
    let cap = x.k.dim(2)?;
    decode("decode_attention", x, len, t, None, cap, policy)
}

/// CUDA twin of [`super::paged_decode_attention`] (shapes checked by the caller): the decode
/// kernels reading keys and values through the block tables, a length per sequence, and a fixed
/// number of splits per KV head (so a sequence's reduction order depends on its length alone).
pub(crate) fn paged_decode_attention(
    x: AttentionInputs,
    pages: super::Pages,
    t: usize,
    policy: &KernelPolicy,
) -> Result<Tensor> {
    let cap = pages.tables.dim(1)? * pages.block_size;
    let blocks = x.k.dim(0)? / pages.block_size;
    let paging = Paging {
        tables: pages.tables.contiguous()?,
        maxb: pages.tables.dim(1)?,
        block_size: pages.block_size,
        blocks,
    };
    decode(
        "paged_decode_attention",
        x,
        pages.lens,
        t,
        Some(paging),
        cap,
        policy,
    )
}

/// Block tables of a paged decode launch: `[b, maxb]` u32, positions per block, pool blocks.
struct Paging {
    tables: Tensor,
    maxb: usize,
    block_size: usize,
    blocks: usize,
}

/// The decode kernels over `cap` key positions per KV head: a `[b, h, cap, d]` buffer with one
/// shared length, or with `paging` the pools through the block tables, a length per sequence.
fn decode(
    op: &'static str,
    x: AttentionInputs,
    len: &Tensor,
    t: usize,
    paging: Option<Paging>,
    cap: usize,
    policy: &KernelPolicy,
) -> Result<Tensor> {
    let AttentionInputs { q, k, v, gate, scale } = x;
    let dt = q.dtype();
    let dev = device(op, q)?;
    let (b, h, r, d) = q.dims4()?;
    if !decode_attention_fits(r, d, dt) || k.dtype() != dt || v.dtype() != dt {
        return Err(err(
            op,
            format!(
                "{r} rows of head dim {d} in {dt:?} (k {:?}, v {:?}) do not fit the kernel",
                k.dtype(),
                v.dtype()
            ),
        ));
    }
    // The tensor-core kernel (bf16/f16, its head dims; any number of rows, 16 per block) or the
    // general one. Their partials (one per split of a KV head: `spans` of them, each over
    // `unit`-key units) go through the same merge kernels.
    let tensor_cores = matches!(dt, DType::BF16 | DType::F16) && PREFILL_HEAD_DIMS.contains(&d);
    // The tensor-core kernel's partials are cut by `split_tiles` (cuda/attention.cu) of FLASH_TILE
    // keys; the general kernel's are one KEYS_PER_SPAN span each.
    let fc = (FLASH_DECODE_CUT_DIV, FLASH_DECODE_CUT_MAX);
    let (spans, unit, cut) = if tensor_cores && paging.is_some() {
        (FLASH_DECODE_SPLITS, FLASH_TILE, fc)
    } else if tensor_cores {
        let spans = cap.div_ceil(FLASH_TILE).clamp(1, FLASH_DECODE_SPLITS);
        (spans, FLASH_TILE, fc)
    } else {
        (cap.div_ceil(KEYS_PER_SPAN).max(1), KEYS_PER_SPAN, (1, 1))
    };
    if spans * 4 > 48 * 1024 {
        return Err(err(
            op,
            format!("a buffer of {cap} keys is longer than the merge kernel takes"),
        ));
    }
    let (q, k, v, len) = (
        q.contiguous()?,
        k.contiguous()?,
        v.contiguous()?,
        len.contiguous()?,
    );
    let (gate, g_strides) = gate_rows(gate)?;
    macro_rules! go {
        ($t:ty) => {{
            let (qs, ql) = q.storage_and_layout();
            let (ks, kl) = k.storage_and_layout();
            let (vs, vl) = v.storage_and_layout();
            let (ls, ll) = len.storage_and_layout();
            let qv = view::<$t>(op, &qs, ql)?;
            let kv = view::<$t>(op, &ks, kl)?;
            let vv = view::<$t>(op, &vs, vl)?;
            let lv = view::<u32>(op, &ls, ll)?;
            let table_guard = paging.as_ref().map(|p| p.tables.storage_and_layout());
            let table_view = table_guard
                .as_ref()
                .map(|(ts, tl)| view::<u32>(op, ts, tl))
                .transpose()?;
            // The paging arguments every partial kernel takes after its own: table (or null),
            // i32 maxb, block size, pool blocks, KV heads; and the merges' length selector.
            let null_table = 0u64;
            let (maxb32, bs32, nb32, h32) = match &paging {
                Some(p) => (p.maxb as i32, p.block_size as i32, p.blocks as i32, h as i32),
                None => (0, 1, 0, h as i32),
            };
            let push_paging = |lb: &mut KernelCall| {
                match &table_view {
                    Some(tv) => lb.arg(tv),
                    None => lb.arg(&null_table),
                };
                lb.arg(&maxb32).arg(&bs32).arg(&nb32).arg(&h32);
            };
            let paged32 = i32::from(paging.is_some());
            let len_h = paged32 * h32;
            let gate_guard = gate.as_ref().map(|g| g.storage_and_layout());
            let gv = gate_guard
                .as_ref()
                .map(|(gs, gl)| span_view::<$t>(op, gs, gl))
                .transpose()?;
            // Both merges take the gate (or null) and its three strides.
            let null = 0u64;
            let push_gate = |lb: &mut KernelCall| {
                match &gv {
                    Some(g) => lb.arg(g),
                    None => lb.arg(&null),
                };
                for s in &g_strides {
                    lb.arg(s);
                }
            };
            let bh = b * h;
            // SAFETY: uninitialised scratch and output. The partial kernel writes every span below
            // the device-side length, which is all the merge reads; the merge writes every output.
            let part_o = unsafe { dev.alloc::<f32>(bh * spans * r * d)? };
            let part_ml = unsafe { dev.alloc::<f32>(bh * spans * r * 2)? };
            let out = unsafe { dev.alloc::<$t>(bh * r * d)? };
            let sfx = dtype_suffix(op, dt)?;
            let (r32, d32, cap32, t32, s32, scale32) = (
                r as i32,
                d as i32,
                cap as i32,
                t as i32,
                spans as i32,
                scale as f32,
            );
            let (unit32, s0) = (unit as i32, spans as i32);
            let (div32, max32) = (cut.0 as i32, cut.1 as i32);
            if tensor_cores {
                // Up to FLASH_DECODE_GROUPS tiles of 16 query rows a block, sharing its K and V.
                let groups = r.div_ceil(16).min(FLASH_DECODE_GROUPS);
                // Only the splits a row of at most `cap` keys can take get blocks.
                let used = super::splits_used(cap.div_ceil(FLASH_TILE), spans, cut);
                let name = format!("flash_decode_{sfx}_d{d}_g{groups}");
                // 16·groups Q rows, one K and one V tile of FLASH_TILE rows, the tile's weights
                // (16·groups rows of FLASH_TILE + 8), the warps' maxima (16·groups · FLASH_WARPS f32).
                let rows = 16 * groups;
                let smem = ((rows + 2 * FLASH_TILE) * (d + 8) + rows * (FLASH_TILE + 8)) * dt.size_in_bytes()
                    + rows * FLASH_WARPS * 4;
                let zs = r.div_ceil(rows);
                // The merge reuses it: per row, a (max, sum) per split, three per group, a count.
                let merge_smem = rows * (2 * spans + 3 * spans.div_ceil(ATTENTION_GROUP) + 1) * 4;
                let in_kernel =
                    super::merges_in_kernel(op, policy.decode_merge, bh * zs, (merge_smem, smem))?;
                let f = ATTENTION.func_with_smem(&dev, &name, smem)?;
                let mut lb = KernelCall::new(&dev, &f, policy);
                let sl2 = (scale * std::f64::consts::LOG2_E) as f32;
                lb.arg(&qv).arg(&kv).arg(&vv).arg(&lv).arg(&part_o).arg(&part_ml);
                lb.arg(&r32).arg(&cap32).arg(&t32).arg(&sl2);
                lb.arg(&s0).arg(&div32).arg(&max32);
                push_paging(&mut lb);
                // The merge in the kernel (its row blocks' last blocks): their arrival counters
                // (null: the merge kernels below merge), the output and the gate, and whether the
                // splits merge in groups first.
                let arrivals = if in_kernel {
                    Some(dev.alloc_zeros::<u32>(bh * zs)?)
                } else {
                    None
                };
                match &arrivals {
                    Some(a) => lb.arg(a),
                    None => lb.arg(&null),
                };
                lb.arg(&out);
                push_gate(&mut lb);
                let grouped32 = i32::from(spans > ATTENTION_GROUP || paging.is_some());
                lb.arg(&grouped32);
                let cfg = LaunchConfig {
                    grid_dim: ((used * zs) as u32, bh as u32, 1),
                    block_dim: ((FLASH_WARPS * 32 * groups) as u32, 1, 1),
                    shared_mem_bytes: smem as u32,
                };
                // SAFETY: arguments match `flash_decode_*_g{groups}` in cuda/attention.cu: q
                // [bh·r·d] (blocks of 16·groups rows, 128·groups threads; the grid's x is `used` ≤
                // spans splits, every split a row of at most cap keys takes, times r's zs blocks),
                // k and v [bh·cap·d] contiguous or (paged) pools of `blocks` blocks read through
                // tables [b·maxb] u32 (block ids past the pool read block 0), len [1] or (paged)
                // [b] u32 (clamped to cap by the kernel), scratch of bh·spans·r·(d | 2) f32, i32
                // r, cap, t, f32 scale·log2 e, i32 spans, cut_div and cut_max, the paging
                // arguments, bh·zs zeroed u32 counters (one per row block, counted once by each
                // of its `used` blocks) or null (the kernel then stops after the partials, out
                // untouched), out [bh·r·d] (written as [b, t, h·r/t, d]), the gate [b,
                // t, h·r/t, d] with contiguous rows (its view spans every element its three i64
                // strides address) or null and zeros, the i32 grouped flag; the shared memory the
                // kernel lays out (the merge's fits in it: checked above).
                unsafe { lb.launch(cfg) }.w()?;
                if in_kernel {
                    return Ok(wrap(out, &dev, (b, t, h * r / t, d)));
                }
            } else {
                let partial = ATTENTION.func(&dev, &format!("attn_decode_partial_{sfx}"))?;
                let mut lb = KernelCall::new(&dev, &partial, policy);
                lb.arg(&qv).arg(&kv).arg(&vv).arg(&lv).arg(&part_o).arg(&part_ml);
                lb.arg(&r32).arg(&d32).arg(&cap32).arg(&t32).arg(&scale32);
                push_paging(&mut lb);
                let cfg = LaunchConfig {
                    grid_dim: (spans as u32, bh as u32, 1),
                    block_dim: (ATTENTION_THREADS as u32, 1, 1),
                    shared_mem_bytes: (r * (d + KEYS_PER_SPAN) * 4) as u32,
                };
                // SAFETY: arguments match `attn_decode_partial_*` in cuda/attention.cu: q [bh·r·d],
                // k and v [bh·cap·d] contiguous (16-byte rows: `decode_attention_fits`) or pools
                // read through the tables as above, len [1] or [b] u32 (the kernel clamps it to
                // cap), scratch of bh·spans·r·(d | 2) f32, i32 r, d, cap, t, f32 scale, the paging
                // arguments; shared memory r·(d + KEYS_PER_SPAN) f32 ≤ 48 KiB (checked above).
                unsafe { lb.launch(cfg) }.w()?;
            }
            // The merge kernels. Long buffers: merge groups of ATTENTION_GROUP spans
            // first, in parallel, so that the final merge reads few entries. Paged launches always
            // do (the tensor-core kernel's merge too), so that a sequence's sums do not depend on
            // how long its batch's longest table is.
            let grouped = if spans > ATTENTION_GROUP || paging.is_some() {
                let groups = spans.div_ceil(ATTENTION_GROUP);
                // SAFETY: uninitialised; the group kernel writes every group below the
                // device-side length, which is all the final merge reads.
                let o2 = unsafe { dev.alloc::<f32>(bh * groups * r * d)? };
                let ml2 = unsafe { dev.alloc::<f32>(bh * groups * r * 2)? };
                let f = ATTENTION.func(&dev, "attn_decode_merge_group")?;
                let mut lb = KernelCall::new(&dev, &f, policy);
                let one = 1i32;
                lb.arg(&part_o).arg(&part_ml).arg(&lv).arg(&o2).arg(&ml2);
                lb.arg(&r32).arg(&d32).arg(&s32).arg(&one);
                lb.arg(&unit32).arg(&s0).arg(&div32).arg(&max32);
                lb.arg(&len_h).arg(&cap32);
                lb.arg(&t32);
                let cfg = LaunchConfig {
                    grid_dim: (r as u32, bh as u32, groups as u32),
                    block_dim: (ATTENTION_THREADS as u32, 1, 1),
                    shared_mem_bytes: 0,
                };
                // SAFETY: arguments match `attn_decode_merge_group`: the scratch written above,
                // len [1] or [b] u32, outputs of bh·groups·r·(d | 2) f32, i32 r, d, spans, 1 span
                // per input entry, the partial kernel's unit, split count, cut_div and cut_max,
                // the KV heads per length (0: one shared length), i32 cap (the length clamped to
                // it, as the partial kernels clamp it), i32 t (row r is token r % t); grid (r,
                // bh, groups).
                unsafe { lb.launch(cfg) }.w()?;
                Some((o2, ml2, groups))
            } else {
                None
            };
            let (o_in, ml_in, entries, per) = match &grouped {
                Some((o2, ml2, groups)) => (o2, ml2, *groups, ATTENTION_GROUP),
                None => (&part_o, &part_ml, spans, 1),
            };
            let merge = ATTENTION.func(&dev, &format!("attn_decode_merge_{sfx}"))?;
            let mut lb = KernelCall::new(&dev, &merge, policy);
            let (e32, per32) = (entries as i32, per as i32);
            lb.arg(o_in)
                .arg(ml_in)
                .arg(&lv)
                .arg(&out)
                .arg(&r32)
                .arg(&d32)
                .arg(&e32)
                .arg(&per32)
                .arg(&unit32)
                .arg(&s0)
                .arg(&div32)
                .arg(&max32);
            push_gate(&mut lb);
            lb.arg(&h32).arg(&t32).arg(&paged32).arg(&cap32);
            let cfg = LaunchConfig {
                grid_dim: (r as u32, bh as u32, 1),
                block_dim: (ATTENTION_THREADS as u32, 1, 1),
                shared_mem_bytes: (entries * 4) as u32,
            };
            // SAFETY: arguments match `attn_decode_merge_*`: entries written above (spans, or
            // groups of ATTENTION_GROUP spans), len [1] or (paged, flag 1) [b] u32, out [bh·r·d]
            // (written as [b, t, h·r/t, d]: the same elements), i32 r, d, entries, spans per entry,
            // unit, split count, cut_div and cut_max, the gate [b, t, h·r/t, d] with contiguous
            // rows (its view spans every element its three i64 strides address) or null and zeros,
            // i32 h, t (r % t == 0: checked by the caller), the paged flag and i32 cap (the merge
            // reads only the entries of the length clamped to cap, all written above); shared
            // memory one f32 per entry (≤ 48 KiB: checked above).
            unsafe { lb.launch(cfg) }.w()?;
            Ok(wrap(out, &dev, (b, t, h * r / t, d)))
        }};
    }
    for_float_dtype!(op, dt)
}

/// CUDA twin of [`super::causal_softmax`] (shapes checked by the caller): one block per score row.
pub(crate) fn causal_softmax(
    scores: &Tensor,
    scale: f64,
    pos0: usize,
    block: usize,
    policy: &KernelPolicy,
) -> Result<Tensor> {
    let op = "causal_softmax";
    let dt = scores.dtype();
    let dev = device(op, scores)?;
    let keys = scores.dim(candle_core::D::Minus1)?;
    let rows = scores.elem_count() / keys.max(1);
    let x = scores.contiguous()?;
    let to_i32 = |v: usize| i32::try_from(v).map_err(|_| err(op, format!("{v} does not fit in i32")));
    let (keys32, block32, pos32) = (to_i32(keys)?, to_i32(block)?, to_i32(pos0)?);
    macro_rules! go {
        ($t:ty) => {{
            let (xs, xl) = x.storage_and_layout();
            let xv = view::<$t>(op, &xs, xl)?;
            // SAFETY: uninitialised; the kernel writes every element (one block per row, its
            // threads stride over every key).
            let y = unsafe { dev.alloc::<$t>(rows * keys)? };
            if rows * keys > 0 {
                // 16-byte vectors when every row starts 16-byte aligned.
                let vec = (keys * dt.size_in_bytes()) % 16 == 0 && at16(xl, dt.size_in_bytes());
                let name = format!(
                    "causal_softmax{}_{}",
                    if vec { "_vec" } else { "" },
                    dtype_suffix(op, dt)?
                );
                let f = ATTENTION.func(&dev, &name)?;
                let mut lb = KernelCall::new(&dev, &f, policy);
                let sc = scale as f32;
                lb.arg(&xv)
                    .arg(&y)
                    .arg(&keys32)
                    .arg(&block32)
                    .arg(&pos32)
                    .arg(&sc);
                let cfg = LaunchConfig {
                    grid_dim: (rows as u32, 1, 1),
                    block_dim: (SOFTMAX_THREADS as u32, 1, 1),
                    shared_mem_bytes: 0,
                };
                // SAFETY: arguments match `causal_softmax[_vec]_*` in cuda/attention.cu: x and y
                // [rows, keys] contiguous, i32 keys, block, pos0, f32 scale; the vector variant
                // only with 16-byte aligned rows (checked above).
                unsafe { lb.launch(cfg) }.w()?;
            }
            Ok(wrap(y, &dev, scores.dims()))
        }};
    }
    for_float_dtype!(op, dt)
}

/// `t` itself when its rows (last dim) are contiguous and `t.dim(2)` steps over one row, else a
/// contiguous copy: the layout the prefill kernel reads through batch and head strides.
fn with_row_layout(t: &Tensor) -> Result<Tensor> {
    let (st, d) = (t.stride(), t.dim(3)?);
    Ok(if st[3] == 1 && st[2] == d {
        t.clone()
    } else {
        t.contiguous()?
    })
}

/// CUDA twin of [`super::prefill_attention`] for bf16/f16 and the head dims of
/// [`super::prefill_attention_fits`] (checked by the caller): one FlashAttention-2 kernel, tiles
/// of `FLASH_QUERY_TILE` queries per (head, batch).
pub(crate) fn prefill_attention(x: AttentionInputs, pos0: usize, policy: &KernelPolicy) -> Result<Tensor> {
    let AttentionInputs { q, k, v, gate, scale } = x;
    let op = "prefill_attention";
    let dt = q.dtype();
    let dev = device(op, q)?;
    let (b, h, t, d) = q.dims4()?;
    let kh = k.dim(1)?;
    let (q, mut k, mut v) = (with_row_layout(q)?, with_row_layout(k)?, with_row_layout(v)?);
    if k.stride() != v.stride() {
        (k, v) = (k.contiguous()?, v.contiguous()?);
    }
    let to_i32 = |x: usize| i32::try_from(x).map_err(|_| err(op, format!("{x} does not fit in i32")));
    let (t32, h32, kh32, pos32) = (to_i32(t)?, to_i32(h)?, to_i32(kh)?, to_i32(pos0)?);
    let strides = [q.stride()[0], q.stride()[1], k.stride()[0], k.stride()[1]].map(|s| s as i64);
    let (gate, g_strides) = gate_rows(gate)?;
    // A Q tile and K and V tiles of rows of d + 8 elements.
    let smem = (FLASH_QUERY_TILE + 2 * FLASH_TILE) * (d + 8) * dt.size_in_bytes();
    let sl2 = (scale * std::f64::consts::LOG2_E) as f32;
    macro_rules! go {
        ($t:ty) => {{
            let (qs, ql) = q.storage_and_layout();
            let (ks, kl) = k.storage_and_layout();
            let (vs, vl) = v.storage_and_layout();
            let qv = span_view::<$t>(op, &qs, ql)?;
            let kv = span_view::<$t>(op, &ks, kl)?;
            let vv = span_view::<$t>(op, &vs, vl)?;
            let gate_guard = gate.as_ref().map(|g| g.storage_and_layout());
            let gv = gate_guard
                .as_ref()
                .map(|(gs, gl)| span_view::<$t>(op, gs, gl))
                .transpose()?;
            let null = 0u64;
            // SAFETY: uninitialised; the kernel writes every (row < t, head, batch) output row.
            let out = unsafe { dev.alloc::<$t>(b * t * h * d)? };
            if b * t * h > 0 {
                let name = format!("flash_prefill_{}_d{d}", dtype_suffix(op, dt)?);
                let f = ATTENTION.func_with_smem(&dev, &name, smem)?;
                let mut lb = KernelCall::new(&dev, &f, policy);
                lb.arg(&qv).arg(&kv).arg(&vv);
                match &gv {
                    Some(g) => lb.arg(g),
                    None => lb.arg(&null),
                };
                lb.arg(&out);
                lb.arg(&t32).arg(&h32).arg(&kh32);
                for s in strides.iter().chain(&g_strides) {
                    lb.arg(s);
                }
                lb.arg(&pos32).arg(&sl2);
                let cfg = LaunchConfig {
                    grid_dim: (t.div_ceil(FLASH_QUERY_TILE) as u32, h as u32, b as u32),
                    block_dim: ((FLASH_WARPS * 32) as u32, 1, 1),
                    shared_mem_bytes: smem as u32,
                };
                // SAFETY: arguments match `flash_prefill_*_d*` in cuda/attention.cu: q [b, h, t,
                // d] and k, v [b, kh, ≥ pos0 + t, d] with rows of d contiguous elements d apart
                // (`with_row_layout`) and the batch/head strides passed (k and v share them), each
                // view spanning every element its layout addresses; the gate [b, t, h, d] with
                // contiguous rows and its three strides (or null and zeros); out [b, t, h, d]
                // contiguous; i32 t, h, kh, i64 strides, i32 pos0, f32 scale·log2 e. The caller
                // checked h % kh
                // == 0 and pos0 + t ≤ the key count, so every key row read exists; 128 threads and
                // the kernel's (64 + 2·64)·(d + 8) elements of shared memory, its limit raised above.
                unsafe { lb.launch(cfg) }.w()?;
            }
            Ok(wrap(out, &dev, (b, t, h, d)).transpose(1, 2)?)
        }};
    }
    match dt {
        DType::BF16 => go!(half::bf16),
        DType::F16 => go!(half::f16),
        other => Err(err(op, format!("unsupported dtype {other:?}"))),
    }
}
