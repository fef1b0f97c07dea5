//! Which CUDA kernel variants the ops run where there is a choice: a value chosen once (when a
//! model loads) and passed to every op that launches a kernel, so that two models, or two tests,
//! in one process can run different variants side by side. The default is what measured fastest
//! on an H200 (docs/BENCHMARKS.md); the other variants exist for benchmarks and tests. On the CPU
//! the policy changes nothing: there is one reference per op.

/// The kernels of the chunked delta rule (prefill).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ChunkPath {
    /// bf16 activations on tensor cores with the widest scan block the device's shared memory
    /// holds (on sm_90 64 state columns that also form the outputs, on sm_80 64 columns and on
    /// sm_86 and sm_89 32, each followed by the output kernel); other dtypes on the f32 CUDA-core
    /// kernels with 32 columns per scan block.
    #[default]
    Auto,
    /// The f32 CUDA-core kernels with 16 or 32 state columns per scan block, for every dtype.
    CudaCores(usize),
    /// For bf16 activations, the tensor-core kernels with 32 or 64 state columns per scan block
    /// (64 only where it fits, else 32) and the separate output kernel.
    TensorCores(usize),
}

/// The kernel of a linear layer called with at most
/// [`SKINNY_MAX_ROWS`](crate::linear::SKINNY_MAX_ROWS) rows (decode, drafts, verify).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SkinnyPath {
    /// The default, batch-invariant where that costs under 5% (issue 22's rule): 16-bit
    /// activations with dense weights of their dtype take the tile kernel for every row count
    /// 1..8, so a row's outputs are the same bits alone, in a batch or in a verify (the 27B's
    /// bf16 decode 4% slower than [`SkinnyPath::Fastest`], its MTP cycle 1%); FP8 weights with
    /// 16-bit activations take the tile kernel for 1..8 rows, invariant over them, and from
    /// [`fp8_gemm_min_rows`](crate::linear::fp8_gemm_min_rows) (9 rows for large weights, 17
    /// for small ones) the FP8 GEMM where the device has it ([`Fp8GemmPath`]; else the tile
    /// kernel to 48 rows, past 8 rows with fewer warps per tile on wide layers, which sum in
    /// another order); dense f32 the streaming kernel for one row and
    /// cuBLAS from two; FP8 with f32, or with column blocks not a multiple of 64 wide, the
    /// CUDA-core FP8 kernel for up to 8 rows. (docs/BENCHMARKS.md §1, §1b.)
    #[default]
    Auto,
    /// candle's matmul (cuBLAS).
    Matmul,
    /// The streaming kernel computing 1, 2 or 4 output columns per warp, for every row count.
    Streaming(usize),
    /// One dense row as [`SkinnyPath::Fastest`]; two rows and more (a verify pass) through the
    /// streaming kernel with 1, 2 or 4 columns per warp; FP8 rows through the CUDA-core kernel.
    Multi(usize),
    /// [`SkinnyPath::Auto`], with dense 16-bit weights' 9..=
    /// [`TILE_MAX_ROWS`](crate::linear::TILE_MAX_ROWS) rows through the tile kernel too and FP8
    /// tiles of every row count up to that with 8 warps: every row count up to that of 16-bit
    /// activations batch-invariant, FP8 included (dense layers of 16 to 48 rows 6-60% slower than
    /// cuBLAS, FP8 ones of 32 to 48 up to 3× slower than the FP8 GEMM).
    Uniform,
    /// The fastest measured at one row, not batch-invariant: one dense row through the
    /// weight-streaming kernel (with the block's norm or the MLP's SwiGLU fused in); FP8 rows and
    /// from two rows as [`SkinnyPath::Auto`]. A verify's rows then
    /// sum in another order than a decode step's, so half-precision speculation may part from
    /// plain decoding at a near-tie.
    Fastest,
}

/// How an FP8 layer multiplies more rows than its few-row kernels take (prefill, batched
/// verifies past [`TILE_MAX_ROWS`](crate::linear::TILE_MAX_ROWS) rows).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Fp8GemmPath {
    /// On sm_90 devices, for 16-bit activations, 128×128 weight blocks, an input width that is a
    /// multiple of 512 and an output width a multiple of 128: the activations quantized to e4m3 per row and
    /// 128-element group
    /// (as transformers' FineGrainedFP8 does on GPU), then cuBLASLt's block-scaled FP8 GEMM on
    /// FP8 tensor cores (on the H200 1.4-1.6× the dense bf16 GEMM's rate at 8k rows, 1.3-3.9×
    /// dequantizing at 16..128 rows: docs/BENCHMARKS.md §4b). Elsewhere, or where cuBLASLt has
    /// no kernel for the shape, as [`Fp8GemmPath::Dequantize`].
    #[default]
    Auto,
    /// [`Fp8GemmPath::Auto`] from this many rows for every weight, under the paths that
    /// otherwise take it from [`fp8_gemm_min_rows`](crate::linear::fp8_gemm_min_rows) (for A/B
    /// runs of the threshold; past 49, the rows between the tile kernel's 48 and it dequantize).
    FromRows(usize),
    /// The weight dequantized to the activations' dtype, then candle's matmul: the CPU
    /// reference's numerics (the activations unquantized), at 2.5× the weight traffic.
    Dequantize,
}

/// Where the tensor-core decode attention merges its splits (the key ranges its blocks share out).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DecodeMergePath {
    /// In the kernel from [`DECODE_MERGE_IN_KERNEL_ROW_BLOCKS`](crate::attention::DECODE_MERGE_IN_KERNEL_ROW_BLOCKS)
    /// row blocks (KV heads × blocks of query rows: 4 sequences of the 27B), else by the merge
    /// kernels: with fewer, the last blocks' merges can outlast the merge kernels' launches
    /// (docs/BENCHMARKS.md §5). Both give the same bits.
    #[default]
    Auto,
    /// The last block of each row block to finish merges its splits: no merge launches.
    InKernel,
    /// The merge kernels after the partial kernel (a group merge, then the final one).
    Kernels,
}

/// The kernel variants a model's ops run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelPolicy {
    /// The chunked delta rule's kernels.
    pub chunk: ChunkPath,
    /// Linear layers of a few rows.
    pub skinny: SkinnyPath,
    /// FP8 layers of many rows.
    pub fp8_gemm: Fp8GemmPath,
    /// The decode attention's merge of its splits.
    pub decode_merge: DecodeMergePath,
    /// Programmatic dependent launch: on sm_90+ devices (with PTX built for them) a kernel may
    /// start while the one before it finishes (0.3-0.7 ms off an eager decode step of Qwen3.6-27B,
    /// nothing measurable inside a CUDA graph: docs/history/BENCHMARKS-log.md, the PDL A/B runs).
    /// Ignored where unsupported.
    pub pdl: bool,
    /// The FP8 tile kernel of narrow layers (1..8 rows) issues each warp's next round of weight
    /// loads before this round's products: twice the bytes in flight, the same bits (on by
    /// default: measured on an H100, docs/BENCHMARKS.md §1b).
    pub tile_prefetch: bool,
    /// A residual stream of 1..8 rows written by a tile kernel leaves the next block's RMSNorm
    /// to the tile kernels that read it (one norm launch fewer a block: see
    /// [`crate::norm::DeferredNorm`]).
    pub defer_norm: bool,
}

impl Default for KernelPolicy {
    fn default() -> Self {
        Self::DEFAULT
    }
}

impl KernelPolicy {
    /// The measured defaults: every path `Auto`, PDL and the tile prefetch on (a constant, for
    /// `&KernelPolicy::DEFAULT`).
    pub const DEFAULT: Self = Self {
        chunk: ChunkPath::Auto,
        skinny: SkinnyPath::Auto,
        fp8_gemm: Fp8GemmPath::Auto,
        decode_merge: DecodeMergePath::Auto,
        pdl: true,
        tile_prefetch: true,
        defer_norm: true,
    };

    /// The default with what the environment asks for A/B benchmarks: `QWEN36_PDL=0` turns
    /// programmatic dependent launch off, `QWEN36_SKINNY=uniform` sets [`SkinnyPath::Uniform`],
    /// `QWEN36_SKINNY=fastest` [`SkinnyPath::Fastest`], `QWEN36_FP8_GEMM=dequantize`
    /// [`Fp8GemmPath::Dequantize`], `QWEN36_FP8_GEMM=from:N` [`Fp8GemmPath::FromRows`]`(N)`,
    /// `QWEN36_DECODE_MERGE=in-kernel` [`DecodeMergePath::InKernel`], `=kernels`
    /// [`DecodeMergePath::Kernels`], `QWEN36_TILE_PREFETCH=0` turns `tile_prefetch` off,
    /// `QWEN36_DEFER_NORM=0` `defer_norm`.
    /// Read when called (at load), never during a launch.
    pub fn from_env() -> Self {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// [`Self::from_env`] over the variables `var` gives.
    fn from_vars(var: impl Fn(&str) -> Option<String>) -> Self {
        Self {
            pdl: var("QWEN36_PDL").as_deref() != Some("0"),
            tile_prefetch: var("QWEN36_TILE_PREFETCH").as_deref() != Some("0"),
            defer_norm: var("QWEN36_DEFER_NORM").as_deref() != Some("0"),
            fp8_gemm: fp8_gemm_from(var("QWEN36_FP8_GEMM").as_deref()),
            skinny: match var("QWEN36_SKINNY").as_deref() {
                Some("uniform") => SkinnyPath::Uniform,
                Some("fastest") => SkinnyPath::Fastest,
                _ => SkinnyPath::Auto,
            },
            decode_merge: match var("QWEN36_DECODE_MERGE").as_deref() {
                Some("in-kernel") => DecodeMergePath::InKernel,
                Some("kernels") => DecodeMergePath::Kernels,
                _ => DecodeMergePath::Auto,
            },
            ..Self::DEFAULT
        }
    }
}

/// The FP8 GEMM path a `QWEN36_FP8_GEMM` value names (anything else: the default).
fn fp8_gemm_from(v: Option<&str>) -> Fp8GemmPath {
    match v {
        Some("dequantize") => Fp8GemmPath::Dequantize,
        Some(v) => match v.strip_prefix("from:").map(str::parse) {
            Some(Ok(rows)) => Fp8GemmPath::FromRows(rows),
            _ => Fp8GemmPath::Auto,
        },
        None => Fp8GemmPath::Auto,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fp8_gemm_paths_from_the_environment() {
        assert_eq!(fp8_gemm_from(None), Fp8GemmPath::Auto);
        assert_eq!(fp8_gemm_from(Some("dequantize")), Fp8GemmPath::Dequantize);
        assert_eq!(fp8_gemm_from(Some("from:9")), Fp8GemmPath::FromRows(9));
        assert_eq!(fp8_gemm_from(Some("from:x")), Fp8GemmPath::Auto);
        assert_eq!(fp8_gemm_from(Some("auto")), Fp8GemmPath::Auto);
    }

    /// Each variable of `from_env` sets its own field; none set gives the defaults.
    #[test]
    fn the_environment_sets_each_field() {
        let vars = |set: &'static [(&'static str, &'static str)]| {
            KernelPolicy::from_vars(move |name| {
                set.iter().find(|(n, _)| *n == name).map(|(_, v)| v.to_string())
            })
        };
        assert_eq!(vars(&[]), KernelPolicy::DEFAULT);
        let all = vars(&[
            ("QWEN36_PDL", "0"),
            ("QWEN36_FP8_GEMM", "from:9"),
            ("QWEN36_SKINNY", "uniform"),
            ("QWEN36_DECODE_MERGE", "kernels"),
            ("QWEN36_TILE_PREFETCH", "0"),
            ("QWEN36_DEFER_NORM", "0"),
        ]);
        assert_eq!(
            all,
            KernelPolicy {
                pdl: false,
                fp8_gemm: Fp8GemmPath::FromRows(9),
                skinny: SkinnyPath::Uniform,
                decode_merge: DecodeMergePath::Kernels,
                tile_prefetch: false,
                defer_norm: false,
                ..KernelPolicy::DEFAULT
            }
        );
        assert!(vars(&[("QWEN36_TILE_PREFETCH", "1")]).tile_prefetch);
        assert!(vars(&[("QWEN36_DEFER_NORM", "1")]).defer_norm);
        assert_eq!(vars(&[("QWEN36_SKINNY", "fastest")]).skinny, SkinnyPath::Fastest);
        assert!(vars(&[("QWEN36_PDL", "1")]).pdl);
        let in_kernel = vars(&[("QWEN36_DECODE_MERGE", "in-kernel")]);
        assert_eq!(in_kernel.decode_merge, DecodeMergePath::InKernel);
        assert_eq!(vars(&[("QWEN36_DECODE_MERGE", "x")]), KernelPolicy::DEFAULT);
    }
}
