//! Causal attention of a few new queries (a decode step, an MTP verify pass) over a KV cache
//! buffer whose valid length is a tensor, not a host number: on CUDA the kernels read it from
//! device memory, so one recorded graph serves every position (tensor cores for bf16/f16 and head
//! dims 64/128/256, a split-K CUDA-core kernel otherwise). The CPU function is the plain
//! reference (f32 loops). Prefill: [`prefill_attention`] (a FlashAttention-2 kernel on CUDA for
//! bf16/f16, see [`prefill_attention_fits`]); elsewhere the model's matmul path, with
//! [`causal_softmax`] between its two matmuls.
//!
//! [`reference`](mod@reference) holds the CPU forms (f32 loops, candle's softmax and scatter); `cuda.rs` the
//! launchers of cuda/attention.cu.

#[cfg(feature = "cuda")]
mod cuda;
pub mod reference;

use candle_core::{DType, Device, Tensor, D};

use crate::{expect_rank, DecodeMergePath, Error, KernelPolicy, Result};

/// Keys per span of the CUDA split-K kernel (one per lane in its softmax step).
pub const KEYS_PER_SPAN: usize = crate::consts::ATTENTION_KEYS_PER_SPAN;
/// Row blocks (KV heads × blocks of 16 to 48 query rows) from which the tensor-core decode
/// attention merges its splits in the kernel under [`DecodeMergePath::Auto`]: 16 is 4 sequences
/// of the 27B (4 KV heads), from where every measured shape gains; one sequence's verify can lose
/// (its few last blocks merge alone; docs/BENCHMARKS.md §5).
pub const DECODE_MERGE_IN_KERNEL_ROW_BLOCKS: usize = 16;
/// Shared memory the CUDA kernel may use per block without opting in.
const SHARED_BYTES: usize = 48 * 1024;

/// True when the CUDA kernel takes `rows` query rows per KV head of `head_dim` in `dtype` (its
/// shared memory holds the rows in f32 and their scores over one span; rows are 16-byte vectors).
pub fn decode_attention_fits(rows: usize, head_dim: usize, dtype: DType) -> bool {
    rows > 0
        && (head_dim * dtype.size_in_bytes()) % 16 == 0
        && rows * (head_dim + KEYS_PER_SPAN) * 4 + KEYS_PER_SPAN * 8 <= SHARED_BYTES
}

/// The operands of an attention call: queries, keys and values (shapes at each op), the output
/// gate of gated attention (multiplied in as `sigmoid(gate)`) and the score scale.
#[derive(Debug, Clone, Copy)]
pub struct AttentionInputs<'a> {
    pub q: &'a Tensor,
    pub k: &'a Tensor,
    pub v: &'a Tensor,
    pub gate: Option<&'a Tensor>,
    pub scale: f64,
}

impl<'a> AttentionInputs<'a> {
    /// `softmax(scale · q·kᵀ)·v`, times `sigmoid(gate)` when given.
    pub fn new(q: &'a Tensor, k: &'a Tensor, v: &'a Tensor, gate: Option<&'a Tensor>, scale: f64) -> Self {
        Self { q, k, v, gate, scale }
    }
}

/// `q: [b, kv_heads, g·t, hd]` (row `r` is query head `kv·g + r / t` at new token `r % t`),
/// `k, v: [b, kv_heads, cap, hd]` (the cache buffers), `len`: u32 `[1]`, the valid keys including
/// the `t` new ones, `len ≤ cap`. New token `i` sits at position `len − t + i` and attends to
/// keys `0..=len − t + i`, scaled by `x.scale`. With `gate: [b, t, kv_heads·g, hd]` (any strides;
/// gated attention) the output is multiplied by `sigmoid(gate)` (on CUDA as it is written).
/// Returns `[b, t, kv_heads·g, hd]` in `q`'s dtype: token-major, the layout the output projection
/// reads.
pub fn decode_attention(
    x: AttentionInputs,
    len: &Tensor,
    new_tokens: usize,
    policy: &KernelPolicy,
) -> Result<Tensor> {
    let AttentionInputs { q, k, v, gate, .. } = x;
    let op = "decode_attention";
    for (arg, t) in [("q", q), ("k", k), ("v", v)] {
        expect_rank(op, arg, t, 4)?;
    }
    let (b, h, r, d) = q.dims4()?;
    let (kb, kh, _, kd) = k.dims4()?;
    let t = new_tokens;
    let fits = (kb, kh, kd) == (b, h, d) && v.dims() == k.dims() && t > 0 && r % t == 0;
    let heads = h * r / t.max(1);
    let gate_fits = gate.is_none_or(|g| g.dims() == [b, t, heads, d] && g.dtype() == q.dtype());
    if !fits || !gate_fits {
        return Err(Error::Shape {
            op,
            msg: format!(
                "q {:?}, k {:?}, v {:?}, gate {:?} and {t} new tokens do not fit",
                q.dims(),
                k.dims(),
                v.dims(),
                gate.map(|g| (g.dims(), g.dtype()))
            ),
        });
    }
    if len.dims() != [1] || len.dtype() != DType::U32 {
        return Err(Error::Shape {
            op,
            msg: format!("len must be u32 [1], found {:?} {:?}", len.dtype(), len.dims()),
        });
    }
    if q.device().is_cuda() {
        #[cfg(feature = "cuda")]
        return cuda::decode_attention(x, len, t, policy);
    }
    let _ = (heads, policy);
    reference::decode_attention(x, len, t)
}

/// Writes a step's new keys and values into the cache buffers: row `i` of `k, v: [b, kv_heads,
/// t, hd]` (any strides) goes to position `positions[i]` of `k_cache, v_cache: [b, kv_heads,
/// cap, hd]` (contiguous, updated in place). `positions` is a u32 `[t]` device tensor, so a
/// recorded CUDA graph replays at any position once it is rewritten; positions must be below
/// `cap` (on CUDA a position past the buffer is skipped rather than read back to check). CUDA:
/// one kernel for both buffers; elsewhere candle's scatter.
pub fn write_kv(
    k: &Tensor,
    v: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    positions: &Tensor,
    policy: &KernelPolicy,
) -> Result<()> {
    let op = "write_kv";
    for (arg, t) in [("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)] {
        expect_rank(op, arg, t, 4)?;
    }
    let (b, h, t, d) = k.dims4()?;
    let cache_dims = k_cache.dims();
    let fits = v.dims() == k.dims()
        && v_cache.dims() == cache_dims
        && cache_dims[..2] == [b, h]
        && cache_dims[3] == d
        && [v, k_cache, v_cache].iter().all(|x| x.dtype() == k.dtype())
        && positions.dims() == [t]
        && positions.dtype() == DType::U32;
    if !fits {
        return Err(Error::Shape {
            op,
            msg: format!(
                "k {:?}, v {:?}, caches {:?} / {:?} and positions {:?} {:?} do not fit",
                k.dims(),
                v.dims(),
                k_cache.dims(),
                v_cache.dims(),
                positions.dtype(),
                positions.dims()
            ),
        });
    }
    crate::expect_out_buffer(
        op,
        "k_cache",
        k_cache,
        k.dtype(),
        cache_dims,
        ("v_cache", v_cache),
    )?;
    crate::expect_out_buffer(
        op,
        "v_cache",
        v_cache,
        k.dtype(),
        cache_dims,
        ("k_cache", k_cache),
    )?;
    if k.device().is_cuda() {
        #[cfg(feature = "cuda")]
        return cuda::write_kv(k, v, k_cache, v_cache, positions, policy);
    }
    let _ = (b, h, t, d, policy);
    reference::write_kv(k, v, k_cache, v_cache, positions)
}

/// Writes new keys and values into paged pools: row `i` of `k, v: [kv_heads, n, hd]` (any
/// strides with contiguous rows) goes to pool row `rows[i]` of `k_pool, v_pool: [pool rows,
/// kv_heads, hd]` (contiguous, updated in place). `rows` is a u32 `[n]` device tensor (a recorded
/// CUDA graph replays once it is rewritten); rows must be below the pool's (on CUDA a row past
/// it is skipped rather than read back to check). CUDA: one kernel for both pools; elsewhere
/// candle's scatter.
pub fn write_kv_rows(
    k: &Tensor,
    v: &Tensor,
    k_pool: &Tensor,
    v_pool: &Tensor,
    rows: &Tensor,
    policy: &KernelPolicy,
) -> Result<()> {
    let op = "write_kv_rows";
    for (arg, t, rank) in [
        ("k", k, 3),
        ("v", v, 3),
        ("k_pool", k_pool, 3),
        ("v_pool", v_pool, 3),
    ] {
        expect_rank(op, arg, t, rank)?;
    }
    let (h, n, d) = k.dims3()?;
    let pool_dims = k_pool.dims();
    let fits = v.dims() == k.dims()
        && v_pool.dims() == pool_dims
        && pool_dims[1..] == [h, d]
        && [v, k_pool, v_pool].iter().all(|x| x.dtype() == k.dtype())
        && rows.dims() == [n]
        && rows.dtype() == DType::U32;
    if !fits {
        return Err(Error::Shape {
            op,
            msg: format!(
                "k {:?}, v {:?}, pools {:?} / {:?} and rows {:?} {:?} do not fit",
                k.dims(),
                v.dims(),
                k_pool.dims(),
                v_pool.dims(),
                rows.dtype(),
                rows.dims()
            ),
        });
    }
    crate::expect_out_buffer(op, "k_pool", k_pool, k.dtype(), pool_dims, ("v_pool", v_pool))?;
    crate::expect_out_buffer(op, "v_pool", v_pool, k.dtype(), pool_dims, ("k_pool", k_pool))?;
    if n == 0 {
        return Ok(());
    }
    if k.device().is_cuda() {
        #[cfg(feature = "cuda")]
        return cuda::write_kv_rows(k, v, k_pool, v_pool, rows, policy);
    }
    let _ = policy;
    reference::write_kv_rows(k, v, k_pool, v_pool, rows)
}

/// Where [`paged_decode_attention`] finds each sequence's keys: `tables: [batch, max_blocks]`
/// u32 (sequence `i`'s position `p` is pool row `tables[i][p / block_size] · block_size + p %
/// block_size`; entries past its length are not read) and `lens: [batch]` u32, its valid
/// positions once the new ones are written (device tensors: a recorded graph replays once they
/// are rewritten).
#[derive(Debug, Clone, Copy)]
pub struct Pages<'a> {
    pub tables: &'a Tensor,
    pub lens: &'a Tensor,
    pub block_size: usize,
}

/// [`decode_attention`] for a batch of sequences of different lengths whose keys and values
/// live in paged pools: `x.q: [batch, kv_heads, g·t, hd]` (rows member·t + token, as
/// [`decode_attention`] takes them), `x.k, x.v: [pool rows, kv_heads, hd]` (contiguous), the
/// gate `[batch, t, g·kv_heads, hd]`; sequence `i`'s new tokens sit at positions `lens[i] - t..`.
/// Returns `[batch, t, g·kv_heads, hd]`. On CUDA each sequence's reduction order depends only on
/// its own length (a fixed split of its keys), so a sequence gets the same result in any batch.
pub fn paged_decode_attention(
    x: AttentionInputs,
    pages: Pages,
    new_tokens: usize,
    policy: &KernelPolicy,
) -> Result<Tensor> {
    let AttentionInputs { q, k, v, gate, .. } = x;
    let op = "paged_decode_attention";
    expect_rank(op, "q", q, 4)?;
    expect_rank(op, "k", k, 3)?;
    let (b, h, r, d) = q.dims4()?;
    let t = new_tokens;
    let bs = pages.block_size;
    let fits = k.dims()[1..] == [h, d]
        && v.dims() == k.dims()
        && [k, v].iter().all(|x| x.dtype() == q.dtype() && x.is_contiguous())
        && t > 0
        && r % t == 0
        && bs > 0
        && k.dim(0)? % bs == 0
        && pages.tables.rank() == 2
        && pages.tables.dim(0)? == b
        && pages.tables.dtype() == DType::U32
        && pages.lens.dims() == [b]
        && pages.lens.dtype() == DType::U32;
    let heads = h * r / t.max(1);
    let gate_fits = gate.is_none_or(|g| g.dims() == [b, t, heads, d] && g.dtype() == q.dtype());
    if !fits || !gate_fits {
        return Err(Error::Shape {
            op,
            msg: format!(
                "q {:?}, pools {:?} / {:?} (contiguous {}), blocks of {bs}, tables {:?} {:?}, lens                  {:?} {:?}, gate {:?} and {t} new tokens do not fit",
                q.dims(),
                k.dims(),
                v.dims(),
                k.is_contiguous() && v.is_contiguous(),
                pages.tables.dtype(),
                pages.tables.dims(),
                pages.lens.dtype(),
                pages.lens.dims(),
                gate.map(|g| (g.dims(), g.dtype()))
            ),
        });
    }
    if q.device().is_cuda() {
        #[cfg(feature = "cuda")]
        return cuda::paged_decode_attention(x, pages, t, policy);
    }
    let _ = policy;
    reference::paged_decode_attention(x, pages, t)
}

/// Head dims the CUDA tensor-core attention kernels (prefill and decode) are built for.
pub(crate) const PREFILL_HEAD_DIMS: [usize; 3] = [64, 128, 256];

/// Units per split of a row of `units` key units cut into at most `s0` splits, at least
/// min(⌈units / cut.0⌉, cut.1) each: `split_units` in cuda/attention.cu, which cuts the rows.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn split_units(units: usize, s0: usize, cut: (usize, usize)) -> usize {
    units.div_ceil(s0).max(units.div_ceil(cut.0).min(cut.1)).max(1)
}

/// The most splits a row of at most `units` key units takes: the width a decode launch's grid
/// needs (past s0 · cut.1 units every row takes all s0 splits).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn splits_used(units: usize, s0: usize, cut: (usize, usize)) -> usize {
    if units >= s0 * cut.1 {
        return s0;
    }
    (1..=units)
        .map(|n| n.div_ceil(split_units(n, s0, cut)))
        .max()
        .unwrap_or(1)
}

/// True when a tensor-core decode launch (`op`) of `row_blocks` row blocks merges its splits in
/// the kernel under `path` rather than by the merge kernels. `staging`: the bytes the merge stages
/// and the kernel's shared memory; where they do not fit, `Auto` takes the merge kernels and
/// `InKernel` is an error naming both.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn merges_in_kernel(
    op: &'static str,
    path: DecodeMergePath,
    row_blocks: usize,
    (merge, smem): (usize, usize),
) -> Result<bool> {
    let fits = merge <= smem;
    match path {
        DecodeMergePath::Auto => Ok(fits && row_blocks >= DECODE_MERGE_IN_KERNEL_ROW_BLOCKS),
        DecodeMergePath::InKernel if fits => Ok(true),
        DecodeMergePath::InKernel => Err(Error::Shape {
            op,
            msg: format!(
                "the in-kernel merge stages {merge} bytes, more than the kernel's {smem} bytes of shared memory"
            ),
        }),
        DecodeMergePath::Kernels => Ok(false),
    }
}

/// True when [`prefill_attention`] runs its tensor-core kernel for `head_dim` and `dtype` on
/// `device` (CUDA, bf16 or f16, head dim 64, 128 or 256); elsewhere it is the f32 reference, slow
/// but exact, so callers keep their own matmul path for those cases.
pub fn prefill_attention_fits(head_dim: usize, dtype: DType, device: &Device) -> bool {
    device.is_cuda() && matches!(dtype, DType::BF16 | DType::F16) && PREFILL_HEAD_DIMS.contains(&head_dim)
}

/// Causal attention of a prompt block: `q: [b, heads, t, hd]` at positions `pos0..pos0 + t` over
/// `k, v: [b, kv_heads, L, hd]` with `L ≥ pos0 + t` (views into a longer cache buffer are read in
/// place); query head `h` uses KV head `h / (heads / kv_heads)` and sees keys `0..=its position`.
/// With `gate: [b, t, heads, hd]` (any strides; gated attention) the output is multiplied by
/// `sigmoid(gate)` (on CUDA as it is written). Returns `[b, heads, t, hd]` in `q`'s dtype (on CUDA
/// a transposed view of a `[b, t, heads, hd]` buffer, the layout the output projection reads). CPU
/// and unsupported CUDA cases: the f32 reference, then the gate in `q`'s dtype.
pub fn prefill_attention(x: AttentionInputs, pos0: usize, policy: &KernelPolicy) -> Result<Tensor> {
    let AttentionInputs { q, k, v, gate, .. } = x;
    let op = "prefill_attention";
    for (arg, t) in [("q", q), ("k", k), ("v", v)] {
        expect_rank(op, arg, t, 4)?;
    }
    let (b, h, t, d) = q.dims4()?;
    let (kb, kh, len, kd) = k.dims4()?;
    let gate_fits = gate.is_none_or(|g| g.dims() == [b, t, h, d]);
    if (kb, kd) != (b, d) || v.dims() != k.dims() || kh == 0 || h % kh != 0 || len < pos0 + t || !gate_fits {
        return Err(Error::Shape {
            op,
            msg: format!(
                "q {:?}, k {:?}, v {:?}, gate {:?} at position {pos0} do not fit",
                q.dims(),
                k.dims(),
                v.dims(),
                gate.map(|g| g.dims())
            ),
        });
    }
    let same_dtype = [Some(k), Some(v), gate]
        .iter()
        .flatten()
        .all(|x| x.dtype() == q.dtype());
    if prefill_attention_fits(d, q.dtype(), q.device()) && same_dtype {
        #[cfg(feature = "cuda")]
        return cuda::prefill_attention(x, pos0, policy);
    }
    let _ = (same_dtype, policy);
    reference::prefill_attention(x, pos0)
}

/// Causal softmax of a prefill block's attention scores `[..., rows, keys]`: row `r` (counted over
/// all leading dims) is the query at position `pos0 + r % block` and sees keys `0..=pos0 + r %
/// block`. Returns `softmax(scale · scores)` over those keys and 0 past them, in the scores' dtype
/// (computed in f32). CPU: the scale, an additive mask and candle's softmax; CUDA: one kernel.
pub fn causal_softmax(
    scores: &Tensor,
    scale: f64,
    pos0: usize,
    block: usize,
    policy: &KernelPolicy,
) -> Result<Tensor> {
    let op = "causal_softmax";
    let keys = scores.dim(D::Minus1)?;
    let rows = scores.elem_count() / keys.max(1);
    if block == 0 || rows % block != 0 {
        return Err(Error::Shape {
            op,
            msg: format!(
                "{rows} score rows of {:?} are not whole blocks of {block}",
                scores.dims()
            ),
        });
    }
    if scores.device().is_cuda() {
        #[cfg(feature = "cuda")]
        return cuda::causal_softmax(scores, scale, pos0, block, policy);
    }
    let _ = policy;
    reference::causal_softmax(scores, scale, pos0, block)
}

#[cfg(test)]
mod tests {
    /// The default merges in the kernel from the threshold on; the other paths always or never.
    #[test]
    fn decode_merge_paths() {
        use super::{merges_in_kernel, DecodeMergePath::*, DECODE_MERGE_IN_KERNEL_ROW_BLOCKS as T};
        let at = |path, blocks, fits: bool| {
            merges_in_kernel("decode", path, blocks, (if fits { 8 } else { 9 }, 8)).unwrap()
        };
        assert!(!at(Auto, T - 1, true));
        assert!(at(Auto, T, true));
        assert!(at(InKernel, 1, true));
        assert!(!at(Kernels, 1000, true));
        // Where the merge's staging does not fit: Auto falls back, InKernel is an error.
        assert!(!at(Auto, T, false));
        assert!(!at(Kernels, T, false));
        let e = merges_in_kernel("paged_decode", InKernel, T, (9, 8))
            .unwrap_err()
            .to_string();
        assert!(e.contains("paged_decode") && e.contains("9 bytes"), "{e}");
    }

    /// The grid width against every length up to the buffer's: a row at a length under the
    /// buffer never takes more splits than the width (the widest case included).
    #[test]
    fn splits_used_is_the_most_any_shorter_row_takes() {
        for (s0, cut) in [
            (64, (32, 8)),
            (64, (16, 8)),
            (64, (1, 1)),
            (16, (32, 8)),
            (7, (3, 5)),
        ] {
            let mut most = 1;
            for units in 1usize..2000 {
                most = most.max(units.div_ceil(split_units(units, s0, cut)));
                assert_eq!(
                    splits_used(units, s0, cut),
                    most,
                    "{units} units, {s0} splits, {cut:?}"
                );
                assert!(most <= s0);
            }
        }
        // The 27B's 8k keys: 128 tiles of at least 4 → 32 splits of the 64.
        assert_eq!(splits_used(128, 64, (32, 8)), 32);
        assert_eq!(splits_used(16, 64, (32, 8)), 16);
    }

    use super::*;

    const P: &KernelPolicy = &KernelPolicy::DEFAULT;

    /// The reference against softmax(q·kᵀ·scale + causal mask)·v built from candle ops, for a
    /// verify of 3 new tokens with 2 query heads per KV head over a buffer longer than `len`.
    #[test]
    fn reference_matches_masked_softmax() -> Result<()> {
        let dev = Device::Cpu;
        let (b, h, g, t, d, cap, len) = (2, 2, 2, 3, 8, 20, 11);
        let q = qwen36_testutil::randn(201, 1.0, (b, h, g * t, d), &dev)?;
        let k = qwen36_testutil::randn(202, 1.0, (b, h, cap, d), &dev)?;
        let v = qwen36_testutil::randn(203, 1.0, (b, h, cap, d), &dev)?;
        let lt = Tensor::new(&[len as u32], &dev)?;
        let got = decode_attention(AttentionInputs::new(&q, &k, &v, None, 0.3), &lt, t, P)?;
        let (kv, vv) = (k.narrow(2, 0, len)?, v.narrow(2, 0, len)?);
        let scores = (q.matmul(&kv.t()?)? * 0.3)?; // [b, h, g·t, len]
        let mask: Vec<f32> = (0..g * t)
            .flat_map(|row| (0..len).map(move |j| if j + t > len + row % t { -1e30 } else { 0.0 }))
            .collect();
        let mask = Tensor::from_vec(mask, (g * t, len), &dev)?;
        let probs = candle_nn::ops::softmax(&scores.broadcast_add(&mask)?, D::Minus1)?;
        // [b, h, g·t, d] rows member·t + token, token-major like the op's output.
        let want = probs
            .matmul(&vv)?
            .reshape((b, h, g, t, d))?
            .permute((0, 3, 1, 2, 4))?
            .reshape((b, t, h * g, d))?;
        let diff = (&got - &want)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
        assert!(diff < 1e-5, "max diff {diff}");
        // A gate (read through its strides) multiplies by its sigmoid.
        let wide = qwen36_testutil::randn(204, 1.0, (b, t, h * g, 2 * d), &dev)?;
        let gate = wide.narrow(3, d, d)?;
        let gated = decode_attention(AttentionInputs::new(&q, &k, &v, Some(&gate), 0.3), &lt, t, P)?;
        let want = (want * candle_nn::ops::sigmoid(&gate)?)?;
        let diff = (gated - want)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
        assert!(diff < 1e-5, "gated: max diff {diff}");
        Ok(())
    }

    /// The prefill reference against softmax(q·kᵀ·scale + causal mask)·v from candle ops, per
    /// query head: three query heads per KV head, a block at position 5 over a cache view longer
    /// than the keys it sees (so reading past `pos0 + t` would show).
    #[test]
    fn prefill_reference_matches_masked_softmax() -> Result<()> {
        let dev = Device::Cpu;
        let (b, h, kh, t, d, pos0, cap) = (2, 6, 2, 4, 8, 5, 12);
        let q = qwen36_testutil::randn(205, 1.0, (b, h, t, d), &dev)?;
        let kbuf = qwen36_testutil::randn(206, 1.0, (b, kh, cap + 3, d), &dev)?;
        let vbuf = qwen36_testutil::randn(207, 1.0, (b, kh, cap + 3, d), &dev)?;
        let (k, v) = (kbuf.narrow(2, 0, cap)?, vbuf.narrow(2, 0, cap)?);
        let got = prefill_attention(AttentionInputs::new(&q, &k, &v, None, 0.4), pos0, P)?;
        assert_eq!(got.dims(), [b, h, t, d]);
        let seen = pos0 + t;
        let mask: Vec<f32> = (0..t)
            .flat_map(|i| (0..seen).map(move |j| if j > pos0 + i { -1e30 } else { 0.0 }))
            .collect();
        let mask = Tensor::from_vec(mask, (t, seen), &dev)?;
        for head in 0..h {
            let kv = head / (h / kh);
            let qh = q.narrow(1, head, 1)?;
            let (kk, vv) = (
                k.narrow(1, kv, 1)?.narrow(2, 0, seen)?,
                v.narrow(1, kv, 1)?.narrow(2, 0, seen)?,
            );
            let scores = (qh.matmul(&kk.t()?)? * 0.4)?.broadcast_add(&mask)?;
            let want = candle_nn::ops::softmax(&scores, D::Minus1)?.matmul(&vv)?;
            let diff = (got.narrow(1, head, 1)? - want)?
                .abs()?
                .flatten_all()?
                .max(0)?
                .to_scalar::<f32>()?;
            assert!(diff < 1e-5, "head {head}: max diff {diff}");
        }
        let e = prefill_attention(
            AttentionInputs::new(&q, &k.narrow(2, 0, 8)?, &v.narrow(2, 0, 8)?, None, 0.4),
            pos0,
            P,
        )
        .unwrap_err();
        assert!(e.to_string().contains("at position 5"), "{e}");
        let e = prefill_attention(
            AttentionInputs::new(&q, &k.narrow(1, 0, 1)?.repeat((1, 4, 1, 1))?, &k, None, 0.4),
            0,
            P,
        )
        .unwrap_err();
        assert!(e.to_string().contains("do not fit"), "{e}");
        // The gate multiplies each output element by its sigmoid; a gate of the wrong shape is named.
        let gate = qwen36_testutil::randn(208, 1.0, (b, t, h, d), &dev)?;
        let gated = prefill_attention(AttentionInputs::new(&q, &k, &v, Some(&gate), 0.4), pos0, P)?;
        let want = (&got * candle_nn::ops::sigmoid(&gate.transpose(1, 2)?)?)?;
        let diff = (gated - want)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
        assert!(diff < 1e-6, "gated: max diff {diff}");
        let e = prefill_attention(
            AttentionInputs::new(&q, &k, &v, Some(&gate.narrow(1, 0, 2)?), 0.4),
            pos0,
            P,
        )
        .unwrap_err();
        assert!(e.to_string().contains("do not fit"), "{e}");
        Ok(())
    }

    /// Rows of 2 blocks of 3 queries at positions 4..7 over 7 keys: each row sums to 1 over its
    /// visible keys, matches a softmax of just those keys, and is 0 past them.
    #[test]
    fn causal_softmax_masks_future_keys() -> Result<()> {
        let dev = Device::Cpu;
        let x = qwen36_testutil::randn(209, 1.0, (2, 6, 7), &dev)?;
        let y = causal_softmax(&x, 0.5, 4, 3, P)?.to_vec3::<f32>()?;
        let xs = x.to_vec3::<f32>()?;
        for (xb, yb) in xs.iter().zip(&y) {
            for (r, (xr, yr)) in xb.iter().zip(yb).enumerate() {
                let vis = 4 + r % 3 + 1;
                let e: Vec<f32> = xr[..vis].iter().map(|v| (v * 0.5).exp()).collect();
                let sum: f32 = e.iter().sum();
                for j in 0..7 {
                    let want = if j < vis { e[j] / sum } else { 0.0 };
                    assert!(
                        (yr[j] - want).abs() < 1e-6,
                        "row {r} key {j}: {} vs {want}",
                        yr[j]
                    );
                }
            }
        }
        let e = causal_softmax(&x, 1.0, 0, 5, P).unwrap_err();
        assert!(e.to_string().contains("whole blocks"), "{e}");
        Ok(())
    }

    /// The new rows land at their positions and nowhere else; bad shapes, one buffer for both
    /// caches and a position past the buffer are errors.
    #[test]
    fn write_kv_writes_rows_at_positions() -> Result<()> {
        let dev = Device::Cpu;
        let (b, h, t, d, cap) = (2, 3, 2, 4, 6);
        let k = qwen36_testutil::randn(210, 1.0, (b, h, t, d), &dev)?;
        let v = qwen36_testutil::randn(211, 1.0, (b, t, h, d), &dev)?.transpose(1, 2)?;
        let (kc, vc) = (
            Tensor::zeros((b, h, cap, d), DType::F32, &dev)?,
            Tensor::ones((b, h, cap, d), DType::F32, &dev)?,
        );
        let pos = Tensor::new(&[3u32, 4], &dev)?;
        write_kv(&k, &v, &kc, &vc, &pos, P)?;
        let max = |x: Tensor| -> Result<f32> { Ok(x.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?) };
        assert_eq!(max((kc.narrow(2, 3, 2)? - &k)?)?, 0.0);
        assert_eq!(max((vc.narrow(2, 3, 2)? - &v)?)?, 0.0);
        assert_eq!(max(kc.narrow(2, 0, 3)?)?, 0.0);
        assert_eq!(max((vc.narrow(2, 5, 1)? - 1.0)?)?, 0.0);
        let e = write_kv(&k, &v, &kc, &vc, &Tensor::new(&[3u32], &dev)?, P).unwrap_err();
        assert!(e.to_string().contains("do not fit"), "{e}");
        let e = write_kv(&k, &v, &kc, &kc, &pos, P).unwrap_err();
        assert!(e.to_string().contains("shares its buffer"), "{e}");
        // A position past the buffer: candle's scatter refuses it on the CPU (CUDA skips it).
        let e = write_kv(&k, &v, &kc, &vc, &Tensor::new(&[5u32, 6], &dev)?, P).unwrap_err();
        assert!(e.to_string().contains("invalid index 6"), "{e}");
        Ok(())
    }

    /// Rows land at their pool rows (keys and values, from strided views) and nowhere else; bad
    /// shapes, one buffer for both pools and a row past the pool are errors.
    #[test]
    fn write_kv_rows_writes_pool_rows() -> Result<()> {
        let dev = Device::Cpu;
        let (h, n, d, rows) = (2, 3, 4, 8);
        let k = qwen36_testutil::randn(220, 1.0, (h, n, d), &dev)?;
        let v = qwen36_testutil::randn(221, 1.0, (n, h, d), &dev)?.transpose(0, 1)?;
        let (kp, vp) = (
            Tensor::zeros((rows, h, d), DType::F32, &dev)?,
            Tensor::ones((rows, h, d), DType::F32, &dev)?,
        );
        let at = [6u32, 1, 2];
        write_kv_rows(&k, &v, &kp, &vp, &Tensor::new(&at, &dev)?, P)?;
        let max = |x: Tensor| -> Result<f32> { Ok(x.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?) };
        for (i, &row) in at.iter().enumerate() {
            let row = row as usize;
            assert_eq!(max((kp.get(row)? - k.narrow(1, i, 1)?.squeeze(1)?)?)?, 0.0);
            assert_eq!(max((vp.get(row)? - v.narrow(1, i, 1)?.squeeze(1)?)?)?, 0.0);
        }
        for row in [0, 3, 4, 5, 7] {
            assert_eq!(max(kp.get(row)?)?, 0.0);
            assert_eq!(max((vp.get(row)? - 1.0)?)?, 0.0);
        }
        let e = write_kv_rows(&k, &v, &kp, &vp, &Tensor::new(&[1u32, 2], &dev)?, P).unwrap_err();
        assert!(e.to_string().contains("do not fit"), "{e}");
        let e = write_kv_rows(&k, &v, &kp, &kp, &Tensor::new(&at, &dev)?, P).unwrap_err();
        assert!(e.to_string().contains("shares its buffer"), "{e}");
        let e = write_kv_rows(&k, &v, &kp, &vp, &Tensor::new(&[1u32, 2, 8], &dev)?, P).unwrap_err();
        assert!(e.to_string().contains("invalid index 8"), "{e}");
        Ok(())
    }

    /// Sequences of different lengths whose positions sit in shuffled blocks of a pool attend as
    /// each does over its own contiguous buffer (positions mapped to pool rows by hand), gated
    /// or not; bad tables are named.
    #[test]
    fn paged_decode_reads_each_sequence_through_its_table() -> Result<()> {
        let dev = Device::Cpu;
        let (h, g, t, d, bs) = (2, 3, 2, 8, 4);
        // Sequence lengths (new tokens included) and their blocks in a pool of 9.
        let lens = [7usize, 11, 2];
        let tables: [Vec<u32>; 3] = [vec![5, 0], vec![8, 2, 6], vec![3]];
        let maxb = 3;
        let kp = qwen36_testutil::randn(230, 1.0, (9 * bs, h, d), &dev)?;
        let vp = qwen36_testutil::randn(231, 1.0, (9 * bs, h, d), &dev)?;
        let q = qwen36_testutil::randn(232, 1.0, (3, h, g * t, d), &dev)?;
        let gate = qwen36_testutil::randn(233, 1.0, (3, t, h * g, d), &dev)?;
        let flat: Vec<u32> = tables
            .iter()
            .flat_map(|tb| (0..maxb).map(move |j| tb.get(j).copied().unwrap_or(0)))
            .collect();
        let table_t = Tensor::from_vec(flat, (3, maxb), &dev)?;
        let lens_t = Tensor::new(lens.map(|l| l as u32).as_slice(), &dev)?;
        let pages = Pages {
            tables: &table_t,
            lens: &lens_t,
            block_size: bs,
        };
        for gate in [None, Some(&gate)] {
            let got = paged_decode_attention(AttentionInputs::new(&q, &kp, &vp, gate, 0.4), pages, t, P)?;
            assert_eq!(got.dims(), [3, t, h * g, d]);
            for (i, (&len, table)) in lens.iter().zip(&tables).enumerate() {
                // The sequence's own [1, h, len, d] buffer, position by position.
                let own = |pool: &Tensor| -> Result<Tensor> {
                    let rows: Vec<Tensor> = (0..len)
                        .map(|p| pool.get(table[p / bs] as usize * bs + p % bs))
                        .collect::<std::result::Result<_, _>>()?;
                    Ok(Tensor::stack(&rows, 1)?.unsqueeze(0)?)
                };
                let gi = gate.map(|g| g.narrow(0, i, 1)).transpose()?;
                let want = decode_attention(
                    AttentionInputs::new(&q.narrow(0, i, 1)?, &own(&kp)?, &own(&vp)?, gi.as_ref(), 0.4),
                    &Tensor::new(&[len as u32], &dev)?,
                    t,
                    P,
                )?;
                let diff = (got.narrow(0, i, 1)? - want)?
                    .abs()?
                    .flatten_all()?
                    .max(0)?
                    .to_scalar::<f32>()?;
                assert_eq!(diff, 0.0, "sequence {i}");
            }
        }
        let short = Tensor::new(&[7u32, 11], &dev)?;
        let bad = Pages {
            lens: &short,
            ..pages
        };
        let e = paged_decode_attention(AttentionInputs::new(&q, &kp, &vp, None, 0.4), bad, t, P).unwrap_err();
        assert!(e.to_string().contains("do not fit"), "{e}");
        let odd = Pages {
            block_size: 5,
            ..pages
        };
        let e = paged_decode_attention(AttentionInputs::new(&q, &kp, &vp, None, 0.4), odd, t, P).unwrap_err();
        assert!(e.to_string().contains("blocks of 5"), "{e}");
        Ok(())
    }

    #[test]
    fn bad_shapes_are_named() {
        let dev = Device::Cpu;
        let q = Tensor::zeros((1, 2, 3, 8), DType::F32, &dev).unwrap();
        let k = Tensor::zeros((1, 2, 5, 8), DType::F32, &dev).unwrap();
        let len = Tensor::new(&[4u32], &dev).unwrap();
        let e = decode_attention(AttentionInputs::new(&q, &k, &k, None, 1.0), &len, 2, P).unwrap_err();
        assert!(e.to_string().contains("new tokens"), "{e}");
        let e = decode_attention(
            AttentionInputs::new(&q, &k, &k, None, 1.0),
            &Tensor::new(&[4f32], &dev).unwrap(),
            1,
            P,
        )
        .unwrap_err();
        assert!(e.to_string().contains("len must be u32"), "{e}");
    }
}
