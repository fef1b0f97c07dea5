// The one table of the sizes the CUDA sources and their Rust launchers share: block sizes, tiles
// and shared-memory layouts. build.rs includes this file to write `qwen36_consts.cuh` (one
// `constexpr int` per entry, included by cuda/common.cuh), and the crate includes it as
// `crate::consts`, so the two sides cannot drift. The kernels `static_assert` that their shared
// memory layouts fit the sizes given here; the launchers pass these sizes.
//
// Each entry is `NAME = expression;` over integers and earlier entries. `kernel_consts!` is defined
// by whoever includes the file.

kernel_consts! {
    // Delta rule (cuda/gdn.cu), token by token: state columns per block (8 groups of four, each
    // spread over 16 row groups: half a warp) and warps.
    GDN_BV = 32;
    GDN_WARPS = 4;
    GDN_THREADS = 32 * GDN_WARPS;
    // The largest key head dim of the recurrent kernels (16 register rows per thread, 16 row
    // groups).
    GDN_MAX_DK = 256;
    // Chunked form: chunk length and largest key dim.
    GDN_CHUNK = 64;
    GDN_CHUNK_MAX_DK = 128;
    // f32 prep: transposed q and k tiles [dk, CHUNK + 4], A [CHUNK, CHUNK], six row vectors.
    GDN_PREP_SMEM = 4 * (2 * GDN_CHUNK_MAX_DK * (GDN_CHUNK + 4) + GDN_CHUNK * GDN_CHUNK + 6 * GDN_CHUNK);
    // f32 scan with 16 or 32 state columns: W and Kt [CHUNK, dk + 4], the state tile, Vt.
    GDN_SCAN_SMEM_C16 = 4 * (2 * GDN_CHUNK * (GDN_CHUNK_MAX_DK + 4) + GDN_CHUNK_MAX_DK * 16 + GDN_CHUNK * 16);
    GDN_SCAN_SMEM_C32 = 4 * (2 * GDN_CHUNK * (GDN_CHUNK_MAX_DK + 4) + GDN_CHUNK_MAX_DK * 32 + GDN_CHUNK * 32);
    // f32 outputs: columns per block; Qt, a [dk, 32] state tile, P [CHUNK, CHUNK + 4], Vt.
    GDN_OUT_COLS = 32;
    GDN_OUT_SMEM = 4 * (GDN_CHUNK * (GDN_CHUNK_MAX_DK + 4) + GDN_CHUNK_MAX_DK * GDN_OUT_COLS
        + GDN_CHUNK * (GDN_CHUNK + 4) + GDN_CHUNK * GDN_OUT_COLS);
    // Tensor-core kernels (bf16 tiles, rows padded by 8 elements): the [rows, dk] row stride,
    // output columns per output block.
    GDN_TC_S = GDN_CHUNK_MAX_DK + 8;
    GDN_TC_OV = 64;
    // Tensor-core prep (bytes): raw k and v, a region for raw q and A then the two bf16 inverse
    // pairs [2, CHUNK, CHUNK + 8], six f32 row vectors.
    GDN_TC_PREP_SMEM = 2 * 2 * GDN_CHUNK * GDN_TC_S + 2 * 4 * GDN_CHUNK * (GDN_CHUNK + 8) + 4 * 6 * GDN_CHUNK;
    // Tensor-core scan with 32 or 64 state columns (bytes): W and raw k [2, CHUNK, TC_S], U
    // [2, CHUNK, bv + 8], the bf16 state [dk, bv + 8], Vt and fk Vt [CHUNK, bv + 8]; the scan that
    // forms the outputs also holds raw q [2, CHUNK, TC_S] and P [2, CHUNK, TC_OV + 8].
    GDN_TC_SCAN_SMEM_BV32 = 2 * (4 * GDN_CHUNK * GDN_TC_S + (4 * GDN_CHUNK + GDN_CHUNK_MAX_DK) * (32 + 8));
    GDN_TC_SCAN_SMEM_BV64 = 2 * (4 * GDN_CHUNK * GDN_TC_S + (4 * GDN_CHUNK + GDN_CHUNK_MAX_DK) * (64 + 8));
    GDN_TC_SCAN_OUT_SMEM_BV64 = GDN_TC_SCAN_SMEM_BV64 + 2 * 2 * GDN_CHUNK * (GDN_TC_S + GDN_TC_OV + 8);
    // Tensor-core outputs (bytes): raw q [CHUNK, TC_S], the hs tile [dk, TC_OV + 8], P and Vt.
    GDN_TC_OUT_SMEM = 2 * (GDN_CHUNK * GDN_TC_S + (GDN_CHUNK_MAX_DK + 2 * GDN_CHUNK) * (GDN_TC_OV + 8));
    // Causal conv1d: tokens per thread of the prefill kernel; tokens per thread and threads per
    // block of its 16-byte-vector form (at 1024 tokens 128 threads of 8 tokens took 24 µs on an
    // H100 against 37 µs with 256 of 16: more, smaller blocks spread over the SMs).
    CONV_TOKENS = 16;
    CONV_VEC_TOKENS = 8;
    CONV_VEC_THREADS = 128;

    // Norms (cuda/norm.cu): threads per block, 16-byte vectors per thread of the register path.
    NORM_THREADS = 256;
    NORM_VECS = 4;
    // Fused q/k norm + RoPE: rows (warps) per block, most 16-byte vectors per lane.
    ROPE_WARPS = 4;
    ROPE_MAX_VECS = 2;

    // Weight-streaming GEMV (cuda/linear.cu): threads per block (the normalising variants repeat
    // the norm's thread-to-vector map) and the most rows it is built for.
    LINEAR_THREADS = NORM_THREADS;
    LINEAR_MAX_ROWS = 8;
    // Tile kernels (cuda/linear.cu): the most n-tiles of 8 rows of x, so the most rows they take
    // (FP8 layers run the FP8 GEMM from 9 or 17 rows where it takes them: docs/BENCHMARKS.md §4b).
    TILE_MAX_NT = 6;
    TILE_MAX_ROWS = 8 * TILE_MAX_NT;
    // A deferred norm (tile kernels): the 16-column parts' sums of squares a lane of the reading
    // kernel loads at once, so rows of up to 32 · 16 · this many elements (8192) defer theirs.
    NORM_PARTS_PER_LANE = 16;
    // FP8 activations for the FP8 tensor-core GEMM (more rows than the tile kernels take):
    // elements per quantization group of a row, one scale each (cuBLASLt's 1×128 blocks).
    FP8_ACT_GROUP = 128;

    // Attention (cuda/attention.cu): threads per block of the CUDA-core kernels, keys per span of
    // the split-K decode kernel (one per lane), spans one block of the first merge level combines,
    // keys per tile of the tensor-core kernels.
    ATTENTION_THREADS = 128;
    ATTENTION_KEYS_PER_SPAN = 32;
    ATTENTION_GROUP = 32;
    FLASH_TILE = 64;
    // The tensor-core kernels' query rows per prefill block and warps per block.
    FLASH_QUERY_TILE = 64;
    FLASH_WARPS = 4;
    // Threads per row of the causal softmax.
    SOFTMAX_THREADS = 256;

    // Argmax (cuda/argmax.cu): threads per block, elements of a row one block reduces first.
    ARGMAX_THREADS = 256;
    ARGMAX_CHUNK = 4096;
}
