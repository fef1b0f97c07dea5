// Skinny linear layer y = x · wᵀ (+ res) for few rows (decode: 1 row; MTP verify: k+1 rows), the CUDA
// twin of the matmul in src/linear.rs. cuBLAS reaches ~84% of copy bandwidth on these shapes; a
// weight-streaming kernel does better: one warp per output column n streams row n of w once in
// 16-byte loads and keeps the M dot products in registers (f32), one rounding at the output.
// Built to PTX by build.rs.
#include "common.cuh"

constexpr int LINEAR_THREADS = 256;
// Independent 16-byte weight loads in flight per lane.
constexpr int UNROLL = 4;

// x: [M, K] (row stride K), w: [N, K], y and res (optional: may be null, else added as y is
// written; a residual connection): [M, N]; K a multiple of 16 / sizeof(T), x and w 16-byte
// aligned (the launcher checks both). Each warp computes NR consecutive columns: the x vectors it
// loads (and converts) serve NR weight rows, which keeps the kernel memory-bound for M up to 8.
// SWIGLU: w holds [gate; up] (2N rows); warp n reads gate row n and up row N + n and writes
// y[m, n] = silu(x·gate_n) · (x·up_n), the MLP's activation, with no rounding of the halves (NR = 2,
// no residual).
template <typename T, int M, int NR, bool SWIGLU = false>
__device__ void skinny_linear(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ res,
                              T* __restrict__ y, int N, int K) {
    constexpr int V = Vec16<T>::N;
    static_assert(!SWIGLU || NR == 2, "the SwiGLU epilogue pairs two rows");
    const int lane = threadIdx.x & 31;
    const int warp_id = (int)((blockIdx.x * (size_t)LINEAR_THREADS + threadIdx.x) >> 5);
    const int n0 = SWIGLU ? warp_id : warp_id * NR;
    if (n0 >= N) return;  // whole warps leave together: n0 is uniform in a warp
    const int kv = K / V;  // 16-byte vectors per row
    const uint4* wr[NR];
#pragma unroll
    for (int r = 0; r < NR; ++r)
        wr[r] = reinterpret_cast<const uint4*>(w + (size_t)(SWIGLU ? n0 + r * N : min(n0 + r, N - 1)) * K);
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
    for (int base = 0; base < kv; base += 32 * UNROLL) {
        if (base > 0) load_weights(base, wv);
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int i = base + u * 32 + lane;
            if (i >= kv) break;
#pragma unroll
            for (int m = 0; m < M; ++m) {
                Vec16<T> xv;
                xv.raw = __ldg(reinterpret_cast<const uint4*>(x + (size_t)m * K) + i);
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

#define LINEAR_KERNEL(SUFFIX, T, M, NR)                                                              \
    extern "C" __global__ void __launch_bounds__(LINEAR_THREADS)                                     \
        skinny_linear_##SUFFIX##_m##M##_r##NR(const T* x, const T* w, const T* res, T* y, int N,     \
                                              int K) {                                               \
        skinny_linear<T, M, NR>(x, w, res, y, N, K);                                                 \
    }
#define LINEAR_KERNELS_M(SUFFIX, T, M)                                                               \
    LINEAR_KERNEL(SUFFIX, T, M, 1)                                                                   \
    LINEAR_KERNEL(SUFFIX, T, M, 2)                                                                   \
    LINEAR_KERNEL(SUFFIX, T, M, 4)
#define LINEAR_KERNELS(SUFFIX, T)                                                                    \
    LINEAR_KERNELS_M(SUFFIX, T, 1)                                                                   \
    LINEAR_KERNELS_M(SUFFIX, T, 2)                                                                   \
    LINEAR_KERNELS_M(SUFFIX, T, 3)                                                                   \
    LINEAR_KERNELS_M(SUFFIX, T, 4)                                                                   \
    LINEAR_KERNELS_M(SUFFIX, T, 5)                                                                   \
    LINEAR_KERNELS_M(SUFFIX, T, 6)                                                                   \
    LINEAR_KERNELS_M(SUFFIX, T, 7)                                                                   \
    LINEAR_KERNELS_M(SUFFIX, T, 8)
LINEAR_KERNELS(f32, float)
LINEAR_KERNELS(bf16, __nv_bfloat16)
LINEAR_KERNELS(f16, __half)

// One row through [gate; up] with the SwiGLU epilogue (N = the intermediate size).
#define SWIGLU_KERNEL(SUFFIX, T)                                                                     \
    extern "C" __global__ void __launch_bounds__(LINEAR_THREADS)                                     \
        skinny_swiglu_##SUFFIX(const T* x, const T* w, T* y, int N, int K) {                         \
        skinny_linear<T, 1, 2, true>(x, w, nullptr, y, N, K);                                        \
    }
SWIGLU_KERNEL(f32, float)
SWIGLU_KERNEL(bf16, __nv_bfloat16)
SWIGLU_KERNEL(f16, __half)
