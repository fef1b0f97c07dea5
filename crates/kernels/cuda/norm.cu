// CUDA twins of the RMSNorm variants in src/norm/: one block per row, sums in f32, one rounding
// at the output (the reference rounds the same way: f32 math, then a cast). Built to PTX by build.rs.
#include "common.cuh"

// NORM_VECS (src/consts.rs): vectors of 16 bytes each thread keeps in registers in the vectorised
// path: rows up to NORM_THREADS · NORM_VECS · 16 bytes (8192 bf16, 4096 f32) take it.

// y = s * rsqrt(mean(s^2) + eps) * scale, s = x (+ res, rounded to T and written to sum when res
// is given). Rows of D elements, contiguous. When D fits the registers and rows are 16-byte
// vectors (`vec`, checked by the launcher), every load is issued before the reduction and the row
// stays in registers: a decode step has one row, so the block's latency is the step's.
template <typename T>
__device__ void rms_norm(const T* __restrict__ x, const T* __restrict__ res, T* __restrict__ sum,
                         const float* __restrict__ scale, T* __restrict__ y, int D, float eps, int vec) {
    const size_t row = (size_t)blockIdx.x * D;
    x += row;
    y += row;
    if (res) {
        res += row;
        sum += row;
    }
    if (vec) {
        constexpr int V = Vec16<T>::N;
        const int nv = D / V;
        Vec16<T> xv[NORM_VECS], rv[NORM_VECS];
#pragma unroll
        for (int j = 0; j < NORM_VECS; ++j) {
            const int i = threadIdx.x + j * NORM_THREADS;
            if (i < nv) {
                xv[j].raw = reinterpret_cast<const uint4*>(x)[i];
                if (res) rv[j].raw = reinterpret_cast<const uint4*>(res)[i];
            }
        }
        if (res) {
#pragma unroll
            for (int j = 0; j < NORM_VECS; ++j) {
                const int i = threadIdx.x + j * NORM_THREADS;
                if (i < nv) {
#pragma unroll
                    for (int e = 0; e < V; ++e) xv[j].e[e] = from_f<T>(to_f(xv[j].e[e]) + to_f(rv[j].e[e]));
                    reinterpret_cast<uint4*>(sum)[i] = xv[j].raw;
                }
            }
        }
        float acc = 0.f;
#pragma unroll
        for (int j = 0; j < NORM_VECS; ++j)
            if (threadIdx.x + j * NORM_THREADS < nv) acc = add_squares(acc, xv[j]);
        const float inv = rms_inv(block_sum<NORM_THREADS>(acc), D, eps);
#pragma unroll
        for (int j = 0; j < NORM_VECS; ++j) {
            const int i = threadIdx.x + j * NORM_THREADS;
            if (i < nv) reinterpret_cast<uint4*>(y)[i] = rms_scale(xv[j], inv, scale + i * V).raw;
        }
        return;
    }
    float acc = 0.f;
    for (int i = threadIdx.x; i < D; i += NORM_THREADS) {
        float v = to_f(x[i]);
        if (res) {
            const T s = from_f<T>(v + to_f(res[i]));
            sum[i] = s;
            v = to_f(s);
        }
        acc += v * v;
    }
    const float inv = rms_inv(block_sum<NORM_THREADS>(acc), D, eps);
    for (int i = threadIdx.x; i < D; i += NORM_THREADS) {
        // Re-read what this thread wrote (or read) above: same thread, so no barrier is needed.
        const float v = res ? to_f(sum[i]) : to_f(x[i]);
        y[i] = from_f<T>(v * inv * scale[i]);
    }
}

// Short rows without a residual (the per-head q/k norms): D·sizeof(T) a multiple of 16 and at
// most 1024 bytes, one warp per row (each lane at most two 16-byte vectors), NORM_THREADS / 32 rows
// per block; x rows are xs elements apart (a view of wider rows), y is contiguous. Same math as
// rms_norm.
template <typename T>
__device__ void rms_norm_warp(const T* __restrict__ x, long xs, const float* __restrict__ scale,
                              T* __restrict__ y, int rows, int D, float eps) {
    const long r = (long)blockIdx.x * (NORM_THREADS / 32) + (threadIdx.x >> 5);
    if (r >= rows) return;
    const int lane = threadIdx.x & 31;
    constexpr int V = Vec16<T>::N;
    const int nv = D / V;
    x += r * xs;
    y += r * D;
    Vec16<T> v[2];
    float acc = 0.f;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        const int i = lane + 32 * j;
        if (i < nv) {
            v[j].raw = reinterpret_cast<const uint4*>(x)[i];
#pragma unroll
            for (int e = 0; e < V; ++e) acc += to_f(v[j].e[e]) * to_f(v[j].e[e]);
        }
    }
    const float inv = rms_inv(warp_sum(acc), D, eps);
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        const int i = lane + 32 * j;
        if (i < nv) {
            Vec16<T> out;
#pragma unroll
            for (int e = 0; e < V; ++e) out.e[e] = from_f<T>(to_f(v[j].e[e]) * inv * scale[i * V + e]);
            reinterpret_cast<uint4*>(y)[i] = out.raw;
        }
    }
}

// y = (x * rsqrt(mean(x^2) + eps) * w) * silu(z): GDN's gated norm; x is the f32 delta-rule output
// [rows, D]. One warp per row, GATED_ROWS rows per block. Row r of z starts at
// (r / zh)·zs + (r % zh)·D: z is x-shaped (zh = 1, zs = D) or a projection's [tokens, zh·D] slice
// whose token rows are zs apart.
constexpr int GATED_ROWS = NORM_THREADS / 32;
template <typename T>
__device__ void gated_rms_norm(const float* __restrict__ x, const T* __restrict__ z, const float* __restrict__ w,
                               T* __restrict__ y, int rows, int D, float eps, int zh, long zs) {
    const long r = (long)blockIdx.x * GATED_ROWS + (threadIdx.x >> 5);
    if (r >= rows) return;
    const int lane = threadIdx.x & 31;
    x += r * D;
    y += r * D;
    z += (r / zh) * zs + (r % zh) * D;
    float acc = 0.f;
    for (int i = lane; i < D; i += 32) acc += x[i] * x[i];
    const float inv = rms_inv(warp_sum(acc), D, eps);
    for (int i = lane; i < D; i += 32) {
        const float g = to_f(z[i]);
        y[i] = from_f<T>(x[i] * inv * w[i] * (g / (1.f + expf(-g))));
    }
}

// Per-head (1 + w) RMSNorm, then rotate-half RoPE on the first `rd` dims, written head-major: the
// q and k preparation of a gated-attention layer in one pass (the CUDA twin of
// `rope::norm_rope_heads`). x: token rows `bt` (= b·T + t) `xs` elements apart, head h at h·hs
// within the row, hd contiguous elements per head (16-byte aligned). scale: [hd] f32 (1 + w), or
// null for no norm. cos, sin: [T, rd/2] in T (rd = 0: no rotation). y: [B, H, T, hd]. One warp per
// (token, head) row; the normalised row passes through shared memory for the rotation's partner
// dims. Like the composition it replaces, the norm's output is rounded to T before the rotation.
// ROPE_MAX_VECS: 16-byte vectors per lane, hd ≤ 64 vectors.

template <typename T>
__device__ void norm_rope_heads(const T* __restrict__ x, long xs, int hs, const float* __restrict__ scale,
                                const T* __restrict__ cosv, const T* __restrict__ sinv, T* __restrict__ y,
                                int T_, int H, int hd, int rd, float eps, int rows) {
    __shared__ float row[ROPE_WARPS][ROPE_MAX_VECS * 32 * 8];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const long r = (long)blockIdx.x * ROPE_WARPS + warp;
    if (r >= rows) return;  // whole warps leave together
    const long bt = r / H;
    const int h = (int)(r % H), t = (int)(bt % T_);
    const long b = bt / T_;
    constexpr int V = Vec16<T>::N;
    const int nv = hd / V;
    const T* src = x + bt * xs + (long)h * hs;
    Vec16<T> v[ROPE_MAX_VECS];
    float acc = 0.f;
#pragma unroll
    for (int j = 0; j < ROPE_MAX_VECS; ++j) {
        const int i = lane + 32 * j;
        if (i < nv) {
            v[j].raw = reinterpret_cast<const uint4*>(src)[i];
#pragma unroll
            for (int e = 0; e < V; ++e) acc += to_f(v[j].e[e]) * to_f(v[j].e[e]);
        }
    }
    const float inv = rms_inv(warp_sum(acc), hd, eps);
    float* rw = row[warp];
#pragma unroll
    for (int j = 0; j < ROPE_MAX_VECS; ++j) {
        const int i = lane + 32 * j;
        if (i < nv) {
#pragma unroll
            for (int e = 0; e < V; ++e) {
                const float xe = to_f(v[j].e[e]);
                rw[i * V + e] = scale ? to_f(from_f<T>(xe * inv * scale[i * V + e])) : xe;
            }
        }
    }
    __syncwarp();
    const int half = rd / 2;
    const T* c = cosv + (long)t * half;
    const T* s = sinv + (long)t * half;
    T* dst = y + ((b * H + h) * T_ + t) * hd;
#pragma unroll
    for (int j = 0; j < ROPE_MAX_VECS; ++j) {
        const int i = lane + 32 * j;
        if (i < nv) {
            Vec16<T> out;
#pragma unroll
            for (int e = 0; e < V; ++e) {
                const int d = i * V + e;
                float o = rw[d];
                if (d < half) o = rw[d] * to_f(c[d]) - rw[d + half] * to_f(s[d]);
                else if (d < rd) o = rw[d] * to_f(c[d - half]) + rw[d - half] * to_f(s[d - half]);
                out.e[e] = from_f<T>(o);
            }
            reinterpret_cast<uint4*>(dst)[i] = out.raw;
        }
    }
}

#define NORM_KERNELS(SUFFIX, T)                                                                          \
    extern "C" __global__ void __launch_bounds__(NORM_THREADS)                                           \
        rms_norm_##SUFFIX(const T* x, const T* res, T* sum, const float* scale, T* y, int D, float eps,  \
                          int vec) { pdl_enter();                                                                     \
        rms_norm<T>(x, res, sum, scale, y, D, eps, vec);                                                 \
    }                                                                                                    \
    extern "C" __global__ void __launch_bounds__(NORM_THREADS)                                           \
        rms_norm_warp_##SUFFIX(const T* x, long xs, const float* scale, T* y, int rows, int D, float eps) { pdl_enter(); \
        rms_norm_warp<T>(x, xs, scale, y, rows, D, eps);                                                 \
    }                                                                                                    \
    extern "C" __global__ void __launch_bounds__(NORM_THREADS)                                           \
        gated_rms_norm_##SUFFIX(const float* x, const T* z, const float* w, T* y, int rows, int D,       \
                                float eps, int zh, long zs) { pdl_enter();                                            \
        gated_rms_norm<T>(x, z, w, y, rows, D, eps, zh, zs);                                             \
    }                                                                                                    \
    extern "C" __global__ void __launch_bounds__(ROPE_WARPS * 32)                                        \
        norm_rope_heads_##SUFFIX(const T* x, long xs, int hs, const float* scale, const T* cosv,         \
                                 const T* sinv, T* y, int T_, int H, int hd, int rd, float eps,          \
                                 int rows) { pdl_enter();                                                             \
        norm_rope_heads<T>(x, xs, hs, scale, cosv, sinv, y, T_, H, hd, rd, eps, rows);                   \
    }
NORM_KERNELS(f32, float)
NORM_KERNELS(bf16, __nv_bfloat16)
NORM_KERNELS(f16, __half)
