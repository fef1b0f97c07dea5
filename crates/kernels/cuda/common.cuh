// Helpers shared by the kernels in this directory: f32 conversions and a warp sum.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "qwen36_consts.cuh"  // the sizes shared with the Rust launchers (src/consts.rs)

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16(x); }
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half(x); }

// Programmatic dependent launch (sm_90+; src/cuda/launch.rs launches every kernel with it): a
// kernel may start before the previous kernel in the stream has finished. `pdl_wait` blocks until
// that kernel has completed and its writes are visible; every kernel calls it before it touches
// global memory that another kernel reads or writes. `pdl_launch_dependents` lets the next
// kernel's blocks start (they then block in their own wait). Both compile to nothing before sm_90,
// where the launcher does not set the attribute.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
// Both, first thing in a kernel with nothing to do before its inputs are ready. The next kernel
// may start at once: it does nothing before its own wait but read weights, and its wait returns
// only after this kernel has completed, which in turn waited for the one before.
__device__ __forceinline__ void pdl_enter() {
    pdl_launch_dependents();
    pdl_wait();
}

// Asks L2 to fetch the 128-byte line holding p (no register, no wait).
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p)); }

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}

// 16 bytes of T, loaded or stored as one vector.
template <typename T> struct Vec16 {
    static constexpr int N = 16 / sizeof(T);
    union {
        uint4 raw;
        T e[N];
    };
};

// Sum of `v` over a block of THREADS threads; every thread gets the result.
template <int THREADS> __device__ __forceinline__ float block_sum(float v) {
    __shared__ float part[THREADS / 32];
    v = warp_sum(v);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) part[warp] = v;
    __syncthreads();
    float t = lane < THREADS / 32 ? part[lane] : 0.f;
    t = warp_sum(t);
    __syncthreads();  // `part` may be reused by a later call
    return t;
}

// The (1 + w) RMSNorm's arithmetic, shared by the RMSNorm kernel and the GEMV that normalises its
// input, so that the two give the same bits: each thread adds the squares of its 16-byte vectors
// in order (add_squares), the block sums them (block_sum), and each element becomes
// x · rms_inv · scale in f32 with one rounding (rms_scale).
template <typename T> __device__ __forceinline__ float add_squares(float acc, const Vec16<T>& v) {
#pragma unroll
    for (int e = 0; e < Vec16<T>::N; ++e) {
        const float f = to_f(v.e[e]);
        acc += f * f;
    }
    return acc;
}
__device__ __forceinline__ float rms_inv(float sum_squares, int D, float eps) {
    return 1.f / sqrtf(sum_squares / D + eps);
}
// `scale` points at the vector's first element's factor.
template <typename T>
__device__ __forceinline__ Vec16<T> rms_scale(const Vec16<T>& v, float inv, const float* __restrict__ scale) {
    Vec16<T> out;
#pragma unroll
    for (int e = 0; e < Vec16<T>::N; ++e) out.e[e] = from_f<T>(to_f(v.e[e]) * inv * scale[e]);
    return out;
}

// Asynchronous 16-byte global -> shared copies (sm_80+), so a tile's next load runs while the
// current one is computed on. Both addresses 16-byte aligned.
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
    const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src));
}
// As cp_async16, but zero-fills the 16 bytes instead when `valid` is false (src is not read).
__device__ __forceinline__ void cp_async16_or_zero(void* dst, const void* src, bool valid) {
    const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// Starts copying rows [r0, r0 + ROWS) of a row-major matrix (rows `rs` elements apart), SEGS
// 16-byte segments of each, into dst (row stride `ds` elements), by a block of THREADS threads;
// rows at or past `limit` and segments at or past `segs` are zero-filled.
template <int ROWS, int SEGS, int THREADS, typename T>
__device__ __forceinline__ void cp_async_tile(T* dst, int ds, const T* __restrict__ src, long rs, int r0, int limit,
                                              int segs) {
    constexpr int E = 16 / sizeof(T);  // elements per segment
    for (int e = threadIdx.x; e < ROWS * SEGS; e += THREADS) {
        const int r = e / SEGS, s = e % SEGS;
        const bool ok = r0 + r < limit && s < segs;
        cp_async16_or_zero(&dst[r * ds + E * s], &src[(long)(ok ? r0 + r : 0) * rs + E * s], ok);
    }
}

// Waits until at most N committed groups are still in flight.
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
