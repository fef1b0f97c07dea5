// Argmax over the last dim (greedy decoding over a 248k-entry vocabulary), the CUDA twin of
// `argmax_last_dim` in src/argmax/: candle's kernel gives each row to one block, which takes
// ~250 µs for one row of 248320 logits on an H200; here chunks of a row reduce in parallel, then
// one block per row merges them. Ties go to the lowest index; NaN never wins. Built by build.rs.
#include "common.cuh"


// (value, index) pair max: larger value, then lower index.
__device__ __forceinline__ void better(float& v, int& i, float ov, int oi) {
    if (ov > v || (ov == v && oi < i)) {
        v = ov;
        i = oi;
    }
}

__device__ __forceinline__ void block_argmax(float& v, int& i) {
    __shared__ float sv[ARGMAX_THREADS / 32];
    __shared__ int si[ARGMAX_THREADS / 32];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) better(v, i, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, i, o));
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) {
        sv[warp] = v;
        si[warp] = i;
    }
    __syncthreads();
    if (warp == 0) {
        v = lane < ARGMAX_THREADS / 32 ? sv[lane] : -INFINITY;
        i = lane < ARGMAX_THREADS / 32 ? si[lane] : 0x7fffffff;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) better(v, i, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, i, o));
    }
}

// Stage 1: block (c, row) reduces elements [c·chunk, (c+1)·chunk) of row `row` (rows of n).
template <typename T>
__device__ void argmax_chunks(const T* __restrict__ x, float* __restrict__ pv, int* __restrict__ pi, int n,
                              int chunk) {
    const int c = blockIdx.x, row = blockIdx.y, chunks = gridDim.x;
    const T* xr = x + (size_t)row * n;
    float v = -INFINITY;
    int i = 0x7fffffff;
    const int end = min(n, (c + 1) * chunk);
    for (int j = c * chunk + threadIdx.x; j < end; j += ARGMAX_THREADS) better(v, i, to_f(xr[j]), j);
    block_argmax(v, i);
    if (threadIdx.x == 0) {
        pv[row * chunks + c] = v;
        pi[row * chunks + c] = i;
    }
}

// Stage 2: one block per row merges its chunks' winners.
__device__ void merge_chunks(const float* __restrict__ pv, const int* __restrict__ pi, unsigned* __restrict__ out,
                             int chunks) {
    const int row = blockIdx.x;
    float v = -INFINITY;
    int i = 0x7fffffff;
    for (int c = threadIdx.x; c < chunks; c += ARGMAX_THREADS) better(v, i, pv[row * chunks + c], pi[row * chunks + c]);
    block_argmax(v, i);
    // A row of NaN (or -inf) only: index 0, like a scan that never finds a larger value.
    if (threadIdx.x == 0) out[row] = i == 0x7fffffff ? 0u : (unsigned)i;
}

#define ARGMAX_KERNELS(SUFFIX, T)                                                                    \
    extern "C" __global__ void __launch_bounds__(ARGMAX_THREADS)                                     \
        argmax_chunks_##SUFFIX(const T* x, float* pv, int* pi, int n, int chunk) { pdl_enter();                   \
        argmax_chunks<T>(x, pv, pi, n, chunk);                                                       \
    }
ARGMAX_KERNELS(f32, float)
ARGMAX_KERNELS(bf16, __nv_bfloat16)
ARGMAX_KERNELS(f16, __half)
extern "C" __global__ void __launch_bounds__(ARGMAX_THREADS)
    argmax_merge(const float* pv, const int* pi, unsigned* out, int chunks) { pdl_enter();
    merge_chunks(pv, pi, out, chunks);
}
