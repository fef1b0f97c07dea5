// Skinny linear layer y = x · wᵀ (+ res) for few rows (decode: 1 row; MTP verify: k+1 rows), the CUDA
// twin of the matmul in src/linear/. cuBLAS reaches ~84% of copy bandwidth on these shapes; a
// weight-streaming kernel does better: one warp per output column n streams row n of w once in
// 16-byte loads and keeps the M dot products in registers (f32), one rounding at the output.
// By default rows of 16-bit types go through the tile kernel (tile_linear, below), on tensor
// cores, for dense and FP8 weights; skinny_linear_tc, the older tensor-core twin of skinny_linear,
// runs where a policy asks for the streaming kernel. Built to PTX by build.rs.
#include <cuda_fp8.h>

#include "common.cuh"
#include "mma.cuh"

// Independent 16-byte weight loads in flight per lane.
constexpr int UNROLL = 4;

// x: [M, K] (row stride K), w: [N, K], y and res (optional: may be null, else added as y is
// written; a residual connection): [M, N]; K a multiple of 16 / sizeof(T), x and w 16-byte
// aligned (the launcher checks both). Each warp computes NR consecutive columns: the x vectors it
// loads (and converts) serve NR weight rows, which keeps the kernel memory-bound for M up to 8.
// SWIGLU: w holds [gate; up] (2N rows); warp n reads gate row n and up row N + n and writes
// y[m, n] = silu(x·gate_n) · (x·up_n), the MLP's activation, with no rounding of the halves (NR = 2,
// no residual).
// NORM (one row): x is the residual stream before the block's (1 + w) RMSNorm (scale: [K] f32 =
// 1 + w): every block normalises it into shared memory (K elements of dynamic shared memory) with
// the RMSNorm kernel's arithmetic (same threads per block, same order), so the product is the one
// of the separate norm and GEMV, bit for bit, without the norm's kernel between them.
template <typename T, int M, int NR, bool SWIGLU = false, bool NORM = false>
__device__ void skinny_linear(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ res,
                              T* __restrict__ y, int N, int K, const float* __restrict__ scale = nullptr,
                              float eps = 0.f) {
    constexpr int V = Vec16<T>::N;
    static_assert(!SWIGLU || NR == 2, "the SwiGLU epilogue pairs two rows");
    static_assert(!NORM || M == 1, "the normalising prologue takes one row");
    extern __shared__ __align__(16) unsigned char linear_smem[];
    const int lane = threadIdx.x & 31;
    const int warp_id = (int)((blockIdx.x * (size_t)LINEAR_THREADS + threadIdx.x) >> 5);
    const int n0 = SWIGLU ? warp_id : warp_id * NR;
    // Whole warps leave together (n0 is uniform in a warp), but not before the block's prologue.
    const bool active = n0 < N;
    if (!NORM && !active) return;
    const int nc = active ? n0 : N - 1;  // idle warps of a normalising block read a valid row
    const int kv = K / V;  // 16-byte vectors per row
    const uint4* wr[NR];
#pragma unroll
    for (int r = 0; r < NR; ++r)
        wr[r] = reinterpret_cast<const uint4*>(w + (size_t)(SWIGLU ? nc + r * N : min(nc + r, N - 1)) * K);
    float acc[M][NR];
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
        for (int r = 0; r < NR; ++r) acc[m][r] = 0.f;
    // Weights are read once per call: stream them past L1 (evict-first).
    auto load_weights = [&](int base, Vec16<T> (&wv)[UNROLL][NR]) {
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int i = base + u * 32 + lane;
#pragma unroll
            for (int r = 0; r < NR; ++r) wv[u][r].raw = i < kv ? __ldcs(wr[r] + i) : make_uint4(0, 0, 0, 0);
        }
    };
    Vec16<T> wv[UNROLL][NR];
    pdl_launch_dependents();
    // The first weights do not depend on the previous kernel: load them while it finishes.
    load_weights(0, wv);
    pdl_wait();
    if constexpr (NORM) {
        // The RMSNorm kernel's arithmetic on the row, vector for vector in its order (each thread
        // vectors t, t + LINEAR_THREADS, ...), staged through shared memory, not registers (the
        // first weights already hold 4·NR of them).
        uint4* xs = reinterpret_cast<uint4*>(linear_smem);
        for (int i = threadIdx.x; i < kv; i += LINEAR_THREADS)
            cp_async16(xs + i, reinterpret_cast<const uint4*>(x) + i);
        cp_async_commit();
        cp_async_wait<0>();  // each thread reads back only its own vectors until the barrier
        float acc = 0.f;
        for (int i = threadIdx.x; i < kv; i += LINEAR_THREADS) {
            Vec16<T> v;
            v.raw = xs[i];
            acc = add_squares(acc, v);
        }
        const float inv = rms_inv(block_sum<LINEAR_THREADS>(acc), K, eps);
        for (int i = threadIdx.x; i < kv; i += LINEAR_THREADS) {
            Vec16<T> v;
            v.raw = xs[i];
            xs[i] = rms_scale(v, inv, scale + i * V).raw;
        }
        __syncthreads();
        if (!active) return;
        x = reinterpret_cast<const T*>(xs);
    }
    for (int base = 0; base < kv; base += 32 * UNROLL) {
        if (base > 0) load_weights(base, wv);
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int i = base + u * 32 + lane;
            if (i >= kv) break;
#pragma unroll
            for (int m = 0; m < M; ++m) {
                Vec16<T> xv;
                const uint4* xr = reinterpret_cast<const uint4*>(x + (size_t)m * K);
                xv.raw = NORM ? xr[i] : __ldg(xr + i);  // NORM: x is in shared memory
#pragma unroll
                for (int e = 0; e < V; ++e) {
                    const float xe = to_f(xv.e[e]);
#pragma unroll
                    for (int r = 0; r < NR; ++r) acc[m][r] += to_f(wv[u][r].e[e]) * xe;
                }
            }
        }
    }
    if constexpr (SWIGLU) {
#pragma unroll
        for (int m = 0; m < M; ++m) {
            const float g = warp_sum(acc[m][0]), u = warp_sum(acc[m][1]);
            if (lane == 0) y[(size_t)m * N + n0] = from_f<T>(g / (1.f + expf(-g)) * u);
        }
    } else {
#pragma unroll
        for (int m = 0; m < M; ++m)
#pragma unroll
            for (int r = 0; r < NR; ++r) {
                const float s = warp_sum(acc[m][r]);
                const size_t o = (size_t)m * N + n0 + r;
                if (lane == 0 && n0 + r < N) y[o] = from_f<T>(res ? s + to_f(res[o]) : s);
            }
    }
}

// Few rows (2..8: a speculative verify) in 16-bit types on tensor cores, reading the weights as
// the kernel above does: lane l of a warp loads 16 bytes (elements 8l..8l+7) of each 256-element
// chunk of its weight row. The kernel above converts each weight once and multiplies it M times,
// and from two rows on that arithmetic, not the memory, set its pace. Here one m16n8k16 product
// takes a lane's 16 bytes in two k steps (j = 0, 1), with the chunk's eight 32-element segments
// (lanes 4s..4s+3: segment s) as its columns:
//   B (16x8): column s = segment s; lane (s, t) holds its elements e = 8t + 4j + r, r = 0, 1 in
//     k slots 2t, 2t+1 (b0) and r = 2, 3 in slots 2t+8, 2t+9 (b1);
//   A (16x16): row s + 8p = token 2q + p over segment s (product set q), the same slots: lane
//     (g, t) holds segment g of tokens 2q and 2q+1, the 16 bytes at its own vector index.
// D[s + 8p][s] is then token 2q+p's dot product over segment s; the rest of each product (7/8) is
// discarded, which the tensor cores' rate affords. The diagonal is summed over the segments at
// the end. Every lane takes part in every product (mma.sync is warp-wide): lanes past the row
// end feed zeros.
template <typename T, int M, int NR>
__device__ void skinny_linear_tc(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ res,
                                 T* __restrict__ y, int N, int K) {
    static_assert(sizeof(T) == 2, "16-bit operands");
    constexpr int SETS = (M + 1) / 2;  // products per k step: two tokens each
    const int lane = threadIdx.x & 31;
    const int warp_id = (int)((blockIdx.x * (size_t)LINEAR_THREADS + threadIdx.x) >> 5);
    const int n0 = warp_id * NR;
    if (n0 >= N) return;  // n0 is uniform in a warp: whole warps leave
    const int kv = K / 8;  // 16-byte vectors per row
    const uint4* wr[NR];
#pragma unroll
    for (int r = 0; r < NR; ++r) wr[r] = reinterpret_cast<const uint4*>(w + (size_t)min(n0 + r, N - 1) * K);
    float acc[NR][SETS][4];
#pragma unroll
    for (int r = 0; r < NR; ++r)
#pragma unroll
        for (int q = 0; q < SETS; ++q)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[r][q][c] = 0.f;
    auto load_weights = [&](int base, uint4 (&wv)[UNROLL][NR]) {
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int i = base + u * 32 + lane;
#pragma unroll
            for (int r = 0; r < NR; ++r) wv[u][r] = i < kv ? __ldcs(wr[r] + i) : make_uint4(0, 0, 0, 0);
        }
    };
    uint4 wv[UNROLL][NR];
    pdl_launch_dependents();
    load_weights(0, wv);
    pdl_wait();
    for (int base = 0; base < kv; base += 32 * UNROLL) {
        if (base > 0) load_weights(base, wv);
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            if (base + u * 32 >= kv) break;  // uniform in the warp
            const int i = base + u * 32 + lane;
            uint4 xv[2 * SETS];
#pragma unroll
            for (int m = 0; m < 2 * SETS; ++m)
                xv[m] = (m < M && i < kv) ? __ldg(reinterpret_cast<const uint4*>(x + (size_t)m * K) + i)
                                          : make_uint4(0, 0, 0, 0);
#pragma unroll
            for (int q = 0; q < SETS; ++q) {
                const uint4 &x0 = xv[2 * q], &x1 = xv[2 * q + 1];
                const uint32_t a0[4] = {x0.x, x1.x, x0.y, x1.y}, a1[4] = {x0.z, x1.z, x0.w, x1.w};
#pragma unroll
                for (int r = 0; r < NR; ++r) {
                    mma16816<T>(acc[r][q], a0, wv[u][r].x, wv[u][r].y);
                    mma16816<T>(acc[r][q], a1, wv[u][r].z, wv[u][r].w);
                }
            }
        }
    }
    // Lane (g, t) with t = g / 2 holds column g's diagonal: D[g][g] in c0 or c1, D[g+8][g] in c2
    // or c3 (g even or odd).
    const int g = lane >> 2;
    const bool diag = (lane & 3) == (g >> 1);
#pragma unroll
    for (int r = 0; r < NR; ++r) {
        const int n = n0 + r;
#pragma unroll
        for (int q = 0; q < SETS; ++q) {
#pragma unroll
            for (int p = 0; p < 2; ++p) {
                const float d = (g & 1) ? acc[r][q][2 * p + 1] : acc[r][q][2 * p];
                const float s = warp_sum(diag ? d : 0.f);
                const int m = 2 * q + p;
                const size_t o = (size_t)m * N + n;
                if (lane == 0 && m < M && n < N) y[o] = from_f<T>(res ? s + to_f(res[o]) : s);
            }
        }
    }
}

// `FN`_`SUFFIX`_m`M`_r`NR` calls FN<T, M, NR>: the CUDA-core kernels (skinny_linear, 1..8 rows,
// every dtype) and their tensor-core twins (skinny_linear_tc, 2..8 rows, 16-bit types).
#define LINEAR_KERNEL(FN, SUFFIX, T, M, NR)                                                          \
    extern "C" __global__ void __launch_bounds__(LINEAR_THREADS)                                     \
        FN##_##SUFFIX##_m##M##_r##NR(const T* x, const T* w, const T* res, T* y, int N, int K) {     \
        FN<T, M, NR>(x, w, res, y, N, K);                                                            \
    }
#define LINEAR_KERNELS_M(FN, SUFFIX, T, M)                                                           \
    LINEAR_KERNEL(FN, SUFFIX, T, M, 1)                                                               \
    LINEAR_KERNEL(FN, SUFFIX, T, M, 2)                                                               \
    LINEAR_KERNEL(FN, SUFFIX, T, M, 4)
#define LINEAR_KERNELS_FROM_2(FN, SUFFIX, T)                                                         \
    LINEAR_KERNELS_M(FN, SUFFIX, T, 2)                                                               \
    LINEAR_KERNELS_M(FN, SUFFIX, T, 3)                                                               \
    LINEAR_KERNELS_M(FN, SUFFIX, T, 4)                                                               \
    LINEAR_KERNELS_M(FN, SUFFIX, T, 5)                                                               \
    LINEAR_KERNELS_M(FN, SUFFIX, T, 6)                                                               \
    LINEAR_KERNELS_M(FN, SUFFIX, T, 7)                                                               \
    LINEAR_KERNELS_M(FN, SUFFIX, T, 8)
#define LINEAR_KERNELS(SUFFIX, T)                                                                    \
    LINEAR_KERNELS_M(skinny_linear, SUFFIX, T, 1)                                                    \
    LINEAR_KERNELS_FROM_2(skinny_linear, SUFFIX, T)
LINEAR_KERNELS(f32, float)
LINEAR_KERNELS(bf16, __nv_bfloat16)
LINEAR_KERNELS(f16, __half)
LINEAR_KERNELS_FROM_2(skinny_linear_tc, bf16, __nv_bfloat16)
LINEAR_KERNELS_FROM_2(skinny_linear_tc, f16, __half)

// One row through [gate; up] with the SwiGLU epilogue (N = the intermediate size).
#define SWIGLU_KERNEL(SUFFIX, T)                                                                     \
    extern "C" __global__ void __launch_bounds__(LINEAR_THREADS)                                     \
        skinny_swiglu_##SUFFIX(const T* x, const T* w, T* y, int N, int K) {                         \
        skinny_linear<T, 1, 2, true>(x, w, nullptr, y, N, K);                                        \
    }
SWIGLU_KERNEL(f32, float)
SWIGLU_KERNEL(bf16, __nv_bfloat16)
SWIGLU_KERNEL(f16, __half)

// One row normalised on the way in (NORM above): the projections that open a pre-norm block (the
// mixer's input projection; with the SwiGLU epilogue, the MLP's gate|up).
#define LINEAR_NORM_KERNEL(SUFFIX, T, NR)                                                            \
    extern "C" __global__ void __launch_bounds__(LINEAR_THREADS)                                     \
        skinny_linear_norm_##SUFFIX##_r##NR(const T* x, const float* scale, float eps, const T* w,   \
                                            const T* res, T* y, int N, int K) {                      \
        skinny_linear<T, 1, NR, false, true>(x, w, res, y, N, K, scale, eps);                        \
    }
#define NORM_KERNELS(SUFFIX, T)                                                                      \
    LINEAR_NORM_KERNEL(SUFFIX, T, 1)                                                                 \
    LINEAR_NORM_KERNEL(SUFFIX, T, 2)                                                                 \
    LINEAR_NORM_KERNEL(SUFFIX, T, 4)                                                                 \
    extern "C" __global__ void __launch_bounds__(LINEAR_THREADS)                                     \
        skinny_swiglu_norm_##SUFFIX(const T* x, const float* scale, float eps, const T* w, T* y,     \
                                    int N, int K) {                                                  \
        skinny_linear<T, 1, 2, true, true>(x, w, nullptr, y, N, K, scale, eps);                      \
    }
NORM_KERNELS(f32, float)
NORM_KERNELS(bf16, __nv_bfloat16)
NORM_KERNELS(f16, __half)

// ---------------------------------------------------------------------------------------------
// FP8 weights (Qwen's -FP8 checkpoints): w is float8 e4m3 [N, K] (one byte each), scale the f32
// multiplier of each [bo, bi] block, [ceil(N/bo), kb = ceil(K/bi)]; the real weight is
// e4m3(w) · scale. K and bi are multiples of 16, so each 16-byte vector of a weight row lies in one
// block (the launchers check).

// Four e4m3 bytes of a word as 16-bit pairs (elements 0, 1 in hl; 2, 3 in hh): byte b becomes
// ((b & 0x80) << 8) | ((b & 0x7F) << (8 - SHIFT)), its sign, exponent and mantissa moved into the
// fields of a 16-bit float whose exponent field is SHIFT - 3 bits wider than e4m3's 4.
template <int SHIFT> __device__ __forceinline__ void e4m3x4_bits(uint32_t w, uint32_t& hl, uint32_t& hh) {
    const uint32_t lo = __byte_perm(w, 0u, 0x1404), hi = __byte_perm(w, 0u, 0x3424);  // b << 8 per half
    hl = (lo & 0x80008000u) | ((lo & 0x7F007F00u) >> SHIFT);
    hh = (hi & 0x80008000u) | ((hi & 0x7F007F00u) >> SHIFT);
}
// As f16 pairs, or as floats, divided by 256: the f16 bits ((b & 0x80) << 8) | ((b & 0x7F) << 7)
// are exactly e4m3(b) / 256 for every finite value, subnormals included (the exponent fields'
// biases, 7 and 15, differ by 8). The 256 goes into the block scale. (The NaN bytes 0x7F/0xFF
// decode as ±480/256; loading refuses NaN weights.)
__device__ __forceinline__ void e4m3x4_h2(uint32_t w, uint32_t& hl, uint32_t& hh) { e4m3x4_bits<1>(w, hl, hh); }
__device__ __forceinline__ void e4m3x4(uint32_t w, float* f) {
    uint32_t hl, hh;
    e4m3x4_h2(w, hl, hh);
    const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&hl));
    const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&hh));
    f[0] = a.x;
    f[1] = a.y;
    f[2] = b.x;
    f[3] = b.y;
}

// Sixteen e4m3 bytes as eight f16 pairs (element 2j in the low half of h[j]) of e4m3 · F8_UNIT⁻¹:
// sm_89+ converts in hardware (exact: every e4m3 value is an f16), older devices with the bit
// trick above (e4m3 / 256).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
constexpr float F8_UNIT = 1.f;
__device__ __forceinline__ uint32_t e4m3x2_f16x2(uint32_t two) {
    uint32_t d;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(d) : "h"((unsigned short)two));
    return d;
}
__device__ __forceinline__ void e4m3x16_h2(const uint4& v, uint32_t (&h)[8]) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        h[2 * i] = e4m3x2_f16x2(w[i] & 0xFFFFu);
        h[2 * i + 1] = e4m3x2_f16x2(w[i] >> 16);
    }
}
#else
constexpr float F8_UNIT = 256.f;
__device__ __forceinline__ void e4m3x16_h2(const uint4& v, uint32_t (&h)[8]) {
    e4m3x4_h2(v.x, h[0], h[1]);
    e4m3x4_h2(v.y, h[2], h[3]);
    e4m3x4_h2(v.z, h[4], h[5]);
    e4m3x4_h2(v.w, h[6], h[7]);
}
#endif

// 16 consecutive elements of row x (T) as floats.
template <typename T> __device__ __forceinline__ void load_x16(const T* __restrict__ x, float* f) {
    constexpr int V = Vec16<T>::N;
#pragma unroll
    for (int v = 0; v < 16 / V; ++v) {
        Vec16<T> xv;
        xv.raw = __ldg(reinterpret_cast<const uint4*>(x) + v);
#pragma unroll
        for (int e = 0; e < V; ++e) f[v * V + e] = to_f(xv.e[e]);
    }
}

// The FP8 weight rows a warp streams: NR rows from n0 (past N: row N - 1 again, never written)
// with their block-scale rows; lane l loads 16-byte vectors l, l + 32, ... of each, UNROLL at a
// time, past L1 (each weight is read once per call).
template <int NR> struct Fp8Rows {
    const uint4* w[NR];
    const float* s[NR];
    uint4 v[UNROLL][NR];

    __device__ __forceinline__ Fp8Rows(const uint8_t* __restrict__ q, const float* __restrict__ scale, int n0, int N,
                                       int K, int bo, int kb) {
#pragma unroll
        for (int r = 0; r < NR; ++r) {
            const int n = min(n0 + r, N - 1);
            w[r] = reinterpret_cast<const uint4*>(q + (size_t)n * K);
            s[r] = scale + (size_t)(n / bo) * kb;
        }
    }

    // Vectors base + 32u + lane (u < UNROLL) of every row, zeros past the row's kv vectors.
    __device__ __forceinline__ void load(int base, int lane, int kv) {
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int i = base + u * 32 + lane;
#pragma unroll
            for (int r = 0; r < NR; ++r) v[u][r] = i < kv ? __ldcs(w[r] + i) : make_uint4(0, 0, 0, 0);
        }
    }
};

// y = x · e4m3(w)ᵀ·scale (+ res): the weight-streaming GEMV of skinny_linear for FP8 weights, half
// the bytes of bf16. One warp per NR columns; lane l reads 16-byte vectors l, l + 32, ... of each
// weight row (16 weights), converts them once, and for each of the M rows forms the vector's dot
// product in f32 and adds it, times the vector's block scale, to its sum.
template <typename T, int M, int NR>
__device__ void fp8_linear(const T* __restrict__ x, const uint8_t* __restrict__ w, const float* __restrict__ scale,
                           const T* __restrict__ res, T* __restrict__ y, int N, int K, int bo, int bi) {
    const int lane = threadIdx.x & 31;
    const int warp_id = (int)((blockIdx.x * (size_t)LINEAR_THREADS + threadIdx.x) >> 5);
    const int n0 = warp_id * NR;
    if (n0 >= N) return;
    const int kv = K / 16, kb = (K + bi - 1) / bi;
    Fp8Rows<NR> rows(w, scale, n0, N, K, bo, kb);
    float acc[M][NR];
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
        for (int r = 0; r < NR; ++r) acc[m][r] = 0.f;
    pdl_launch_dependents();
    // The weights and scales do not depend on the previous kernel: load while it finishes.
    rows.load(0, lane, kv);
    pdl_wait();
    for (int base = 0; base < kv; base += 32 * UNROLL) {
        if (base > 0) rows.load(base, lane, kv);
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int i = base + u * 32 + lane;
            if (i >= kv) break;
            const int blk = i * 16 / bi;
            float wf[NR][16], s[NR];
#pragma unroll
            for (int r = 0; r < NR; ++r) {
                s[r] = __ldg(rows.s[r] + blk) * 256.f;
                e4m3x4(rows.v[u][r].x, wf[r]);
                e4m3x4(rows.v[u][r].y, wf[r] + 4);
                e4m3x4(rows.v[u][r].z, wf[r] + 8);
                e4m3x4(rows.v[u][r].w, wf[r] + 12);
            }
#pragma unroll
            for (int m = 0; m < M; ++m) {
                float xf[16];
                load_x16(x + (size_t)m * K + i * 16, xf);
#pragma unroll
                for (int r = 0; r < NR; ++r) {
                    float p = 0.f;
#pragma unroll
                    for (int e = 0; e < 16; ++e) p = fmaf(wf[r][e], xf[e], p);
                    acc[m][r] = fmaf(p, s[r], acc[m][r]);
                }
            }
        }
    }
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
        for (int r = 0; r < NR; ++r) {
            const float sum = warp_sum(acc[m][r]);
            const size_t o = (size_t)m * N + n0 + r;
            if (lane == 0 && n0 + r < N) y[o] = from_f<T>(res ? sum + to_f(res[o]) : sum);
        }
}

// fp8_linear_`SUFFIX`_m`M`_r`NR`: the FP8 GEMVs on CUDA cores (1..8 rows, every dtype).
#define FP8_KERNEL(SUFFIX, T, M, NR)                                                                 \
    extern "C" __global__ void __launch_bounds__(LINEAR_THREADS)                                     \
        fp8_linear_##SUFFIX##_m##M##_r##NR(const T* x, const uint8_t* w, const float* scale,         \
                                           const T* res, T* y, int N, int K, int bo, int bi) {       \
        fp8_linear<T, M, NR>(x, w, scale, res, y, N, K, bo, bi);                                     \
    }
#define FP8_KERNELS_M(SUFFIX, T, M)                                                                  \
    FP8_KERNEL(SUFFIX, T, M, 1)                                                                      \
    FP8_KERNEL(SUFFIX, T, M, 2)
#define FP8_LINEAR_KERNELS(SUFFIX, T)                                                                \
    FP8_KERNELS_M(SUFFIX, T, 1)                                                                      \
    FP8_KERNELS_M(SUFFIX, T, 2)                                                                      \
    FP8_KERNELS_M(SUFFIX, T, 3)                                                                      \
    FP8_KERNELS_M(SUFFIX, T, 4)                                                                      \
    FP8_KERNELS_M(SUFFIX, T, 5)                                                                      \
    FP8_KERNELS_M(SUFFIX, T, 6)                                                                      \
    FP8_KERNELS_M(SUFFIX, T, 7)                                                                      \
    FP8_KERNELS_M(SUFFIX, T, 8)
FP8_LINEAR_KERNELS(f32, float)
FP8_LINEAR_KERNELS(bf16, __nv_bfloat16)
FP8_LINEAR_KERNELS(f16, __half)

// Sixteen e4m3 bytes as eight pairs in T's 16-bit format (element 2j in the low half of h[j]),
// each e4m3 · F8_UNIT⁻¹ exactly: f16 as e4m3x16_h2 gives them; bf16 on sm_89+ from those f16
// pairs through f32 (exact: e4m3 has 4 significant bits, both formats hold its range; four
// instructions a pair, half of them on the FMA pipe: with the tile kernel's multiply-high block
// index, one row 9% faster than the bit trick and a division, docs/BENCHMARKS.md §1b), before
// sm_89 with e4m3x4_bits in bf16's fields (((b & 0x80) << 8) | ((b & 0x7F) << 4) is
// e4m3(b) · 2⁻¹²⁰, subnormals included: the biases, 7 and 127, differ by 120) times
// 2¹²⁰ / F8_UNIT, a power of two (exact; bf16 keeps subnormals). Both give the same values.
template <typename T> __device__ __forceinline__ void e4m3x16_pairs(const uint4& v, uint32_t (&h)[8]);
template <> __device__ __forceinline__ void e4m3x16_pairs<__half>(const uint4& v, uint32_t (&h)[8]) {
    e4m3x16_h2(v, h);
}
template <> __device__ __forceinline__ void e4m3x16_pairs<__nv_bfloat16>(const uint4& v, uint32_t (&h)[8]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    e4m3x16_h2(v, h);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h[j]));
        const __nv_bfloat162 b = __floats2bfloat162_rn(f.x, f.y);
        h[j] = *reinterpret_cast<const uint32_t*>(&b);
    }
#else
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
    const __nv_bfloat162 unit = __float2bfloat162_rn(0x1p120f / F8_UNIT);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        uint32_t p[2];
        e4m3x4_bits<4>(w[i], p[0], p[1]);
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const __nv_bfloat162 b = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&p[j]), unit);
            h[2 * i + j] = *reinterpret_cast<const uint32_t*>(&b);
        }
    }
#endif
}

// A weight vector streamed once: past L1 (evict-first), with the L2 fetching the whole 256-byte
// span around it from DRAM (the tile kernel below reads 64 bytes per row and step; its
// neighbouring steps, taken by the same or the next warp, read the rest).
__device__ __forceinline__ uint4 ld_stream256(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.cs.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

// Weights on tensor cores in the products' own layout, for 1..8·NT rows of 16-bit activations: FP8
// weights (W8) or weights of x's type. A block of WARPS warps makes 16 output columns (weight rows
// n0..n0+15) for all M rows of x, the weights as m16n8k16's A (16 weight rows by 16 k) and x as
// its B, one n-tile per 8 rows of x (rows 8j..8j+7 in n-tile j, rows past M zero). A k step
// covers 64 elements: lane (g, t) loads elements 16(4s + t)..+15 of weight rows n0 + g and
// n0 + g + 8 (one 16-byte vector of FP8, two of 16-bit weights) and the same 16 elements of x's
// rows g + 8j, and its four products per n-tile take elements 4i..4i+3 of them (i = 0..3) as
// its A and B k slots 2t, 2t+1, 2t+8, 2t+9: both operands list the same elements in the same
// slots, so each product sums 16 of the step's elements and the four products all 64. Each weight
// byte is loaded (and decoded) once; x's bytes once per 16 weight rows. FP8: a step lies in one
// column block (bi a multiple of 64), so its products start from zero and join the f32 sums times
// the block's scales; 16-bit weights accumulate in the products. Warp w takes U = 16 / WARPS
// consecutive steps from step U·w, then the same 16 steps further, and so on; the warps' sums are
// added in warp order at the end. The rows of x are batch-invariant: each sees the same
// operations in the same order whatever M and NT are (the tensor cores compute each column of a
// product on its own, the zero columns add nothing to the others, and an n-tile's products do
// not depend on the other n-tiles).
// `tile` is the block's 16-column tile (blockIdx.x, but for a launch that runs two layers).
// SWIGLU: w holds [gate; up] (2N rows, y [M, N]): the block's 16 weight rows are gate rows
// n0..n0+7 (its A rows g) and up rows N + n0..N + n0 + 7 (rows g + 8), n0 = 8·tile, and it writes
// y[m, n] = silu(gate) · up of the halves rounded to T as the two-step path rounds them (the
// layer's output, then the SwiGLU kernel): the same bits, no intermediate in memory, one kernel
// fewer (no residual).
// PREFETCH: each warp issues its next round's weight loads before this round's products (two
// register buffers): the same loads, products and sums in the same order, so the same bits, with
// twice the bytes in flight.
// DEFERRED NORM (the residual stream's RMSNorm left to the projections that read it; both
// optional, null pointers for neither). Out: with `ng` (the next block's norm scale, f32 [N]), a
// block writing rows of the stream also writes yg = y·ng (rounded to T) and each row's sum of
// squares of its 16 columns of y (as rounded), ss [M, ⌈N/16⌉] f32, summed in a fixed order. In:
// x holds rows scaled so (yg), `ssi` [M, tiles_in] their parts' sums of squares: each row's sums
// are multiplied by rms_inv(Σ parts, K, eps) before the epilogue (each lane sums the parts
// p ≡ lane mod 32 in order, then the lanes a fixed butterfly: one order whatever M), so the output is the
// projection of the stream's RMSNorm, rounded at x·g where the norm kernel rounds x·inv·g.
template <typename T, bool W8, int NT, int WARPS, bool SWIGLU = false, bool PREFETCH = false>
__device__ void tile_linear(const T* __restrict__ x, const void* __restrict__ w, const float* __restrict__ scale,
                            const T* __restrict__ res, T* __restrict__ y, int M, int N, int K, int bo, int bi,
                            int tile, const float* __restrict__ ng = nullptr, T* __restrict__ yg = nullptr,
                            float* __restrict__ ss = nullptr, const float* __restrict__ ssi = nullptr,
                            int tiles_in = 0, float eps = 0.f) {
    static_assert(sizeof(T) == 2 && NT >= 1 && NT <= TILE_MAX_NT, "16-bit activations, 1..8·TILE_MAX_NT rows");
    static_assert(WARPS == 4 || WARPS == 8, "16 steps per block and round");
    static_assert(WARPS * NT * 32 * 4 * 4 <= 48 * 1024, "static shared memory");
    constexpr int U = 16 / WARPS;
    constexpr int V = W8 ? 1 : 2;  // 16-byte weight vectors per lane, row and step
    __shared__ __align__(16) float part[WARPS][NT][32][4];
    __shared__ float rinv[8 * NT];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int n0 = tile * (SWIGLU ? 8 : 16);
    const int kv = K / 16, steps = (kv + 3) / 4;  // kv: 16-element groups per row
    // Weight rows n0 + g and n0 + g + 8 (past N: row N - 1 again, never written); SWIGLU: gate
    // row n0 + g and its up row.
    const int ra = min(n0 + g, N - 1), rb = SWIGLU ? N + ra : min(n0 + g + 8, N - 1);
    const size_t row_bytes = (size_t)K * (W8 ? 1 : sizeof(T));
    const uint4* wa = reinterpret_cast<const uint4*>(static_cast<const uint8_t*>(w) + ra * row_bytes);
    const uint4* wb = reinterpret_cast<const uint4*>(static_cast<const uint8_t*>(w) + rb * row_bytes);
    const int kb = W8 ? (K + bi - 1) / bi : 0;
    // Step s's column block 64·s / bi as a multiply-high by the rounded-up reciprocal 2³² / bi:
    // exact while K · bi < 2³² (its error, under 64·s / 2³², stays below 1 / bi; the launcher
    // checks).
    const uint32_t bi_inv = W8 ? 0xFFFFFFFFu / (uint32_t)bi + 1u : 0u;
    const float* sa = W8 ? scale + (size_t)(ra / bo) * kb : nullptr;
    const float* sb = W8 ? scale + (size_t)(rb / bo) * kb : nullptr;
    uint4 va[U][V], vb[U][V];
    uint4 pa[PREFETCH ? U : 1][V], pb[PREFETCH ? U : 1][V];
    auto load = [&](uint4(&A)[U][V], uint4(&B)[U][V], int s0) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int i = 4 * (s0 + u) + t;
            const bool in = i < kv;
#pragma unroll
            for (int v = 0; v < V; ++v) {
                A[u][v] = in ? ld_stream256(wa + V * i + v) : make_uint4(0, 0, 0, 0);
                B[u][v] = in ? ld_stream256(wb + V * i + v) : make_uint4(0, 0, 0, 0);
            }
        }
    };
    float acc[NT][4];
#pragma unroll
    for (int j = 0; j < NT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
    pdl_launch_dependents();
    // The weights do not depend on the previous kernel: load them while it finishes.
    load(va, vb, U * warp);
    pdl_wait();
    if (ssi) {
        // Row m's 1/rms from its parts' sums (warp m % WARPS): every load issued, then summed in
        // order, then across the lanes.
        for (int m = warp; m < M; m += WARPS) {
            float v[NORM_PARTS_PER_LANE];
#pragma unroll
            for (int i = 0; i < NORM_PARTS_PER_LANE; ++i) {
                const int p = lane + 32 * i;
                v[i] = p < tiles_in ? ssi[(size_t)m * tiles_in + p] : 0.f;
            }
            float sum = 0.f;
#pragma unroll
            for (int i = 0; i < NORM_PARTS_PER_LANE; ++i) sum += v[i];
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
            if (lane == 0) rinv[m] = rms_inv(sum, K, eps);
        }
    }
    for (int s0 = U * warp; s0 < steps; s0 += 16) {
        if constexpr (PREFETCH) {
            // Past the last step, `load` fills zeros without reading memory.
            load(pa, pb, s0 + 16);
        } else if (s0 != U * warp) {
            load(va, vb, s0);
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int s = s0 + u;
            if (s >= steps) break;  // uniform in the warp
            const int i = 4 * s + t;
            uint32_t ha[8], hb[8];
            if constexpr (W8) {
                e4m3x16_pairs<T>(va[u][0], ha);
                e4m3x16_pairs<T>(vb[u][0], hb);
            } else {
#pragma unroll
                for (int v = 0; v < V; ++v) {
                    ha[4 * v] = va[u][v].x, ha[4 * v + 1] = va[u][v].y, ha[4 * v + 2] = va[u][v].z;
                    ha[4 * v + 3] = va[u][v].w;
                    hb[4 * v] = vb[u][v].x, hb[4 * v + 1] = vb[u][v].y, hb[4 * v + 2] = vb[u][v].z;
                    hb[4 * v + 3] = vb[u][v].w;
                }
            }
            float fa = 0.f, fb = 0.f;
            if constexpr (W8) {
                const int blk = (int)__umulhi(64u * (uint32_t)s, bi_inv);
                fa = __ldg(sa + blk), fb = __ldg(sb + blk);
            }
#pragma unroll
            for (int j = 0; j < NT; ++j) {
                const int r = g + 8 * j;
                uint32_t xb[8] = {0, 0, 0, 0, 0, 0, 0, 0};
                if (r < M && i < kv) {
                    const uint4* xr = reinterpret_cast<const uint4*>(x + (size_t)r * K);
                    const uint4 x0 = __ldg(xr + 2 * i), x1 = __ldg(xr + 2 * i + 1);
                    xb[0] = x0.x, xb[1] = x0.y, xb[2] = x0.z, xb[3] = x0.w;
                    xb[4] = x1.x, xb[5] = x1.y, xb[6] = x1.z, xb[7] = x1.w;
                }
                if constexpr (W8) {
                    float d[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
                    for (int q = 0; q < 4; ++q) {
                        const uint32_t a[4] = {ha[2 * q], hb[2 * q], ha[2 * q + 1], hb[2 * q + 1]};
                        mma16816<T>(d, a, xb[2 * q], xb[2 * q + 1]);
                    }
                    acc[j][0] = fmaf(d[0], fa, acc[j][0]);
                    acc[j][1] = fmaf(d[1], fa, acc[j][1]);
                    acc[j][2] = fmaf(d[2], fb, acc[j][2]);
                    acc[j][3] = fmaf(d[3], fb, acc[j][3]);
                } else {
#pragma unroll
                    for (int q = 0; q < 4; ++q) {
                        const uint32_t a[4] = {ha[2 * q], hb[2 * q], ha[2 * q + 1], hb[2 * q + 1]};
                        mma16816<T>(acc[j], a, xb[2 * q], xb[2 * q + 1]);
                    }
                }
            }
        }
        if constexpr (PREFETCH) {
#pragma unroll
            for (int u = 0; u < U; ++u)
#pragma unroll
                for (int v = 0; v < V; ++v) va[u][v] = pa[u][v], vb[u][v] = pb[u][v];
        }
    }
    // One 16-byte store per lane and n-tile (scalar stores would conflict four ways on the banks).
#pragma unroll
    for (int j = 0; j < NT; ++j)
        *reinterpret_cast<float4*>(part[warp][j][lane]) = make_float4(acc[j][0], acc[j][1], acc[j][2], acc[j][3]);
    __syncthreads();
    // Warp v sums n-tiles v, v + WARPS, ...: lane (g, t) holds columns n0 + g (c = 0, 1) and
    // n0 + g + 8 (c = 2, 3) of the n-tile's rows 2t, 2t + 1.
    for (int j = warp; j < NT; j += WARPS) {
        float sums[4];
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            float sum = part[0][j][lane][c];
#pragma unroll
            for (int v = 1; v < WARPS; ++v) sum += part[v][j][lane][c];
            if constexpr (W8) sum *= F8_UNIT;
            if (ssi) {
                const int m = 8 * j + 2 * t + (c & 1);
                sum *= m < M ? rinv[m] : 0.f;
            }
            sums[c] = sum;
        }
        if constexpr (SWIGLU) {
            // c = 0, 1: gate of rows 2t, 2t + 1 at column n0 + g; c + 2: their up.
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                const int m = 8 * j + 2 * t + c, n = n0 + g;
                if (m < M && n < N) {
                    const float ge = to_f(from_f<T>(sums[c])), ue = to_f(from_f<T>(sums[c + 2]));
                    y[(size_t)m * N + n] = from_f<T>(ge / (1.f + expf(-ge)) * ue);
                }
            }
        } else {
            float sq[2] = {0.f, 0.f};  // rows 2t, 2t + 1: squares of this lane's two columns
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const int m = 8 * j + 2 * t + (c & 1), n = n0 + g + 8 * (c >> 1);
                if (m < M && n < N) {
                    const size_t o = (size_t)m * N + n;
                    const T v = from_f<T>(res ? sums[c] + to_f(res[o]) : sums[c]);
                    y[o] = v;
                    if (ng) {
                        const float f = to_f(v);
                        yg[o] = from_f<T>(f * ng[n]);
                        sq[c & 1] += f * f;
                    }
                }
            }
            if (ng) {
                // A row's 16 columns are in the 8 lanes of its t: summed over g, in a fixed order.
                const int tiles = (N + 15) / 16;
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    float v = sq[r];
                    v += __shfl_xor_sync(0xffffffffu, v, 4);
                    v += __shfl_xor_sync(0xffffffffu, v, 8);
                    v += __shfl_xor_sync(0xffffffffu, v, 16);
                    const int m = 8 * j + 2 * t + r;
                    if (g == 0 && m < M) ss[(size_t)m * tiles + tile] = v;
                }
            }
        }
    }
}
// The deferred norm's arguments of the tile kernels (tile_linear above): out (ng, yg, ss) and in
// (ssi, tiles_in, eps), null pointers for none; the SwiGLU and pair kernels take the `in` part.
#define NORM_ARGS(T) const float *ng, T *yg, float *ss, const float *ssi, int tiles_in, float eps
#define NORM_PASS ng, yg, ss, ssi, tiles_in, eps
#define NORM_IN_ARGS const float *ssi, int tiles_in, float eps
#define NORM_IN_PASS nullptr, nullptr, nullptr, ssi, tiles_in, eps
// fp8_linear_mma_`SUFFIX`_t`NT`_w`WARPS` (FP8 weights) and tile_linear_`SUFFIX`_t`NT`_w`WARPS`
// (weights of x's type): M rows in NT n-tiles (M ≤ 8·NT), 4 or 8 warps per 16 columns.
#define TILE_KERNELS(SUFFIX, T, NT, WARPS)                                                           \
    extern "C" __global__ void __launch_bounds__(32 * WARPS)                                         \
        fp8_linear_mma_##SUFFIX##_t##NT##_w##WARPS(const T* x, const uint8_t* w, const float* scale, \
                                                   const T* res, T* y, int M, int N, int K, int bo,  \
                                                   int bi, NORM_ARGS(T)) {                           \
        tile_linear<T, true, NT, WARPS>(x, w, scale, res, y, M, N, K, bo, bi, blockIdx.x, NORM_PASS); \
    }                                                                                                \
    extern "C" __global__ void __launch_bounds__(32 * WARPS) tile_linear_##SUFFIX##_t##NT##_w##WARPS( \
        const T* x, const T* w, const T* res, T* y, int M, int N, int K, NORM_ARGS(T)) {             \
        tile_linear<T, false, NT, WARPS>(x, w, nullptr, res, y, M, N, K, 1, 1, blockIdx.x, NORM_PASS); \
    }
#define TILE_KERNELS_NT(SUFFIX, T, NT)                                                               \
    TILE_KERNELS(SUFFIX, T, NT, 4)                                                                   \
    TILE_KERNELS(SUFFIX, T, NT, 8)
#define TILE_KERNELS_ALL(SUFFIX, T)                                                                  \
    TILE_KERNELS_NT(SUFFIX, T, 1)                                                                    \
    TILE_KERNELS_NT(SUFFIX, T, 2)                                                                    \
    TILE_KERNELS_NT(SUFFIX, T, 3)                                                                    \
    TILE_KERNELS_NT(SUFFIX, T, 4)                                                                    \
    TILE_KERNELS_NT(SUFFIX, T, 5)                                                                    \
    TILE_KERNELS_NT(SUFFIX, T, 6)
TILE_KERNELS_ALL(bf16, __nv_bfloat16)
TILE_KERNELS_ALL(f16, __half)

// fp8_linear_mma_`SUFFIX`_t1_w8p: the FP8 tile kernel for 1..8 rows with 8 warps and the next
// round prefetched (the same bits), bounded to 3 blocks an SM (77 registers, no spills on sm_90).
// For narrow layers, whose few blocks all run at once: their loads in flight set the pace.
#define TILE_KERNEL_PREFETCH(SUFFIX, T)                                                              \
    extern "C" __global__ void __launch_bounds__(32 * 8, 3)                                          \
        fp8_linear_mma_##SUFFIX##_t1_w8p(const T* x, const uint8_t* w, const float* scale,           \
                                         const T* res, T* y, int M, int N, int K, int bo, int bi,    \
                                         NORM_ARGS(T)) {                                             \
        tile_linear<T, true, 1, 8, false, true>(x, w, scale, res, y, M, N, K, bo, bi, blockIdx.x,    \
                                                NORM_PASS);                                          \
    }
TILE_KERNEL_PREFETCH(bf16, __nv_bfloat16)
TILE_KERNEL_PREFETCH(f16, __half)

// fp8_pair_mma_`SUFFIX`: an FP8 layer (w8 [N8, K], y8 [M, N8]) and a layer of x's type (w16
// [N16, K], y16 [M, N16]) on the same x [M, K], 1..8 rows, in one launch: blocks 0..⌈N16/16⌉ make
// the dense layer's tiles (first: each streams twice an FP8 block's bytes), the rest the FP8
// layer's, each as its own tile kernel with 8 warps makes them, so each output has the bits of
// its separate launch. The FP8 checkpoints' GDN input projection (FP8 qkv|z beside bf16 b|a),
// whose small dense part alone fills a few SMs and waits for its own launch.
#define PAIR_KERNEL(SUFFIX, T)                                                                       \
    extern "C" __global__ void __launch_bounds__(32 * 8)                                             \
        fp8_pair_mma_##SUFFIX(const T* x, const uint8_t* w8, const float* scale, T* y8, int N8, int bo, \
                              int bi, const T* w16, T* y16, int N16, int M, int K, NORM_IN_ARGS) {   \
        const int dense_tiles = (N16 + 15) / 16;                                                     \
        if ((int)blockIdx.x < dense_tiles)                                                           \
            tile_linear<T, false, 1, 8>(x, w16, nullptr, nullptr, y16, M, N16, K, 1, 1, blockIdx.x,  \
                                        NORM_IN_PASS);                                               \
        else                                                                                         \
            tile_linear<T, true, 1, 8>(x, w8, scale, nullptr, y8, M, N8, K, bo, bi,                  \
                                       blockIdx.x - dense_tiles, NORM_IN_PASS);                      \
    }
PAIR_KERNEL(bf16, __nv_bfloat16)
PAIR_KERNEL(f16, __half)

// tile_swiglu_`SUFFIX`_w`WARPS` (weights of x's type) and fp8_swiglu_mma_`SUFFIX`_w8 (FP8
// [gate; up]: 1..8 rows take 8 warps): the tile kernels with the SwiGLU epilogue for 1..8 rows
// (one n-tile), y [M, N] from a weight of 2N rows; one block per 8 output columns.
#define SWIGLU_TILE_KERNEL(SUFFIX, T, WARPS)                                                         \
    extern "C" __global__ void __launch_bounds__(32 * WARPS)                                         \
        tile_swiglu_##SUFFIX##_w##WARPS(const T* x, const T* w, T* y, int M, int N, int K,           \
                                        NORM_IN_ARGS) {                                              \
        tile_linear<T, false, 1, WARPS, true>(x, w, nullptr, nullptr, y, M, N, K, 1, 1, blockIdx.x,  \
                                              NORM_IN_PASS);                                         \
    }
#define SWIGLU_TILE_KERNELS(SUFFIX, T)                                                               \
    SWIGLU_TILE_KERNEL(SUFFIX, T, 4)                                                                 \
    SWIGLU_TILE_KERNEL(SUFFIX, T, 8)                                                                 \
    extern "C" __global__ void __launch_bounds__(32 * 8)                                             \
        fp8_swiglu_mma_##SUFFIX##_w8(const T* x, const uint8_t* w, const float* scale, T* y, int M,  \
                                     int N, int K, int bo, int bi, NORM_IN_ARGS) {                   \
        tile_linear<T, true, 1, 8, true>(x, w, scale, nullptr, y, M, N, K, bo, bi, blockIdx.x,       \
                                         NORM_IN_PASS);                                              \
    }
SWIGLU_TILE_KERNELS(bf16, __nv_bfloat16)
SWIGLU_TILE_KERNELS(f16, __half)

// The dequantized weight out [N, K] in T (for the matmul of many rows): each element e4m3(w) ·
// scale in f32, rounded once, as the CPU reference rounds it. One thread per element, any K and
// block (candle has no CUDA cast from e4m3 that this could use instead).
template <typename T>
__device__ void fp8_dequant(const uint8_t* __restrict__ w, const float* __restrict__ scale, T* __restrict__ out,
                            int N, int K, int bo, int bi) {
    pdl_launch_dependents();
    pdl_wait();
    const int kb = (K + bi - 1) / bi;
    const size_t total = (size_t)N * K;
    for (size_t e = blockIdx.x * (size_t)blockDim.x + threadIdx.x; e < total; e += (size_t)gridDim.x * blockDim.x) {
        const int n = (int)(e / K), k = (int)(e % K);
        const float s = scale[(size_t)(n / bo) * kb + k / bi] * 256.f;
        float f[4];
        e4m3x4((uint32_t)w[e], f);  // the byte in the word's lowest lane
        out[e] = from_f<T>(f[0] * s);
    }
}
// The same 16 elements per thread (one 16-byte vector of w, in one column block: K and bi
// multiples of 16), the bytes decoded as the GEMV kernels do; the same f32 products, rounded once.
template <typename T>
__device__ void fp8_dequant16(const uint8_t* __restrict__ w, const float* __restrict__ scale, T* __restrict__ out,
                              int N, int K, int bo, int bi) {
    pdl_launch_dependents();
    pdl_wait();
    const int kb = (K + bi - 1) / bi, kv = K / 16;
    const size_t total = (size_t)N * kv;
    for (size_t v = blockIdx.x * (size_t)blockDim.x + threadIdx.x; v < total; v += (size_t)gridDim.x * blockDim.x) {
        const int n = (int)(v / kv), c = (int)(v - (size_t)n * kv);
        const float s = scale[(size_t)(n / bo) * kb + c * 16 / bi] * F8_UNIT;
        uint32_t h[8];
        e4m3x16_h2(__ldcs(reinterpret_cast<const uint4*>(w) + v), h);
        Vec16<T> o[16 / Vec16<T>::N];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h[j]));
            const int e = 2 * j;
            o[e / Vec16<T>::N].e[e % Vec16<T>::N] = from_f<T>(f.x * s);
            o[(e + 1) / Vec16<T>::N].e[(e + 1) % Vec16<T>::N] = from_f<T>(f.y * s);
        }
        uint4* dst = reinterpret_cast<uint4*>(out + (size_t)v * 16);
#pragma unroll
        for (int i = 0; i < 16 / Vec16<T>::N; ++i) dst[i] = o[i].raw;
    }
}
#define FP8_DEQUANT_KERNEL(SUFFIX, T)                                                                \
    extern "C" __global__ void fp8_dequant_##SUFFIX(const uint8_t* w, const float* scale, T* out, int N, \
                                                    int K, int bo, int bi) {                          \
        fp8_dequant<T>(w, scale, out, N, K, bo, bi);                                                 \
    }                                                                                                \
    extern "C" __global__ void fp8_dequant16_##SUFFIX(const uint8_t* w, const float* scale, T* out,  \
                                                      int N, int K, int bo, int bi) {                \
        fp8_dequant16<T>(w, scale, out, N, K, bo, bi);                                               \
    }
FP8_DEQUANT_KERNEL(f32, float)
FP8_DEQUANT_KERNEL(bf16, __nv_bfloat16)
FP8_DEQUANT_KERNEL(f16, __half)

// FP8 activations for the block-scaled FP8 GEMM (cuBLASLt, src/linear/fp8_gemm.rs), as transformers'
// FineGrainedFP8 quantizes them on GPU: each row of x [M, K] (K a multiple of FP8_ACT_GROUP) in
// groups of FP8_ACT_GROUP elements, one warp per group: s = amax / 448 (1 for a group of zeros,
// where transformers divides 0 by 0), q = e4m3(x / s) rounded to nearest even and saturated, both
// in f32 with IEEE division, as the CPU reference (linear::reference::fp8_quantize_activations)
// does. Rows M..LD-1 (padding: the GEMM runs a multiple of 16 rows) get zeros and scale 1.
// q: [LD, K] bytes; s: [K / FP8_ACT_GROUP, LD] f32, rows contiguous per group, the layout of
// cuBLASLt's VEC128 scales for the GEMM's B operand.
template <typename T>
__device__ void fp8_act_quant(const T* __restrict__ x, uint8_t* __restrict__ q, float* __restrict__ s, int M, int K,
                              int LD) {
    static_assert(FP8_ACT_GROUP == 4 * 32, "four elements per lane");
    pdl_enter();
    const int groups = K / FP8_ACT_GROUP;
    const size_t warp = (blockIdx.x * (size_t)blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (warp >= (size_t)LD * groups) return;
    const int row = (int)(warp / groups), g = (int)(warp % groups);
    const size_t at = (size_t)row * K + (size_t)g * FP8_ACT_GROUP + lane * 4;
    if (row >= M) {
        *reinterpret_cast<uint32_t*>(q + at) = 0u;
        if (lane == 0) s[(size_t)g * LD + row] = 1.f;
        return;
    }
    // Four elements in one 8-byte load (x is 16-byte aligned, K a multiple of 128).
    union {
        uint2 raw;
        T e[4];
    } in;
    in.raw = *reinterpret_cast<const uint2*>(x + at);
    float v[4];
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        v[i] = to_f(in.e[i]);
        amax = fmaxf(amax, fabsf(v[i]));
    }
    amax = warp_max(amax);
    const float scale = amax > 0.f ? amax / 448.f : 1.f;
    uint32_t packed = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const uint32_t b = (uint32_t)__nv_cvt_float_to_fp8(v[i] / scale, __NV_SATFINITE, __NV_E4M3);
        packed |= b << (8 * i);
    }
    *reinterpret_cast<uint32_t*>(q + at) = packed;
    if (lane == 0) s[(size_t)g * LD + row] = scale;
}
#define FP8_ACT_QUANT_KERNEL(SUFFIX, T)                                                                       \
    extern "C" __global__ void fp8_act_quant_##SUFFIX(const T* x, uint8_t* q, float* s, int M, int K, \
                                                      int LD) {                                       \
        fp8_act_quant<T>(x, q, s, M, K, LD);                                                          \
    }
FP8_ACT_QUANT_KERNEL(bf16, __nv_bfloat16)
FP8_ACT_QUANT_KERNEL(f16, __half)
