// Causal attention of a few new queries over a KV cache whose valid length lives in device memory
// (so one recorded CUDA graph serves every decode position): the CUDA twin of
// `decode_attention` in src/attention.rs. Split-K ("flash decoding"): each block scores one span of
// ATT_KEYS keys for every query row of one KV head and keeps unnormalised partial sums; a second
// kernel merges the spans. Built to PTX by build.rs.
#include "common.cuh"

constexpr int ATT_THREADS = 128;
constexpr int ATT_KEYS = 32;  // keys per span: one per lane in the softmax step

// q: [BH, R, D] (row r = group member · t + token), k, v: [BH, cap, D], len[0]: valid keys after
// the t new ones were written (token i sits at position len - t + i and sees keys 0..=that).
// part_o: [BH, S, R, D] f32 unnormalised sums, part_ml: [BH, S, R, 2] f32 (max, sum of exp).
// Shared memory: R·D + R·ATT_KEYS floats. D·sizeof(T) a multiple of 16 (checked by the launcher).
template <typename T>
__device__ void attn_partial(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                             const unsigned* __restrict__ len_p, float* __restrict__ part_o,
                             float* __restrict__ part_ml, int R, int D, int cap, int t, float scale) {
    extern __shared__ float sm[];
    float* qs = sm;
    float* sc = sm + R * D;
    const int s = blockIdx.x, bh = blockIdx.y, S = gridDim.x;
    const int L = min((int)len_p[0], cap);  // a length past the buffer reads no further
    const int key0 = s * ATT_KEYS;
    if (key0 >= L) return;  // spans past the length are never read by the merge
    q += (size_t)bh * R * D;
    k += (size_t)bh * cap * D;
    v += (size_t)bh * cap * D;
    for (int i = threadIdx.x; i < R * D; i += ATT_THREADS) qs[i] = to_f(q[i]);
    __syncthreads();

    // Scores: lane = key (one full dot product per lane, no reductions), warp w takes rows w,
    // w + WARPS, ... (up to RPW of them per pass, their sums in registers); the head dim streams in
    // 16-byte key vectors, the query rows are shared-memory broadcasts. The cost per block grows
    // with the rows only through the FMAs, not through a warp reduction per (row, key).
    constexpr int V = Vec16<T>::N;
    constexpr int WARPS = ATT_THREADS / 32;
    constexpr int RPW = 8;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nvec = D / V, first = L - t;
    // Keys past the length read the last valid key (memory that exists) and are masked below.
    const uint4* kr = reinterpret_cast<const uint4*>(k + (size_t)min(key0 + lane, L - 1) * D);
    for (int r0 = warp; r0 < R; r0 += WARPS * RPW) {
        float acc[RPW];
#pragma unroll
        for (int u = 0; u < RPW; ++u) acc[u] = 0.f;
        // KU key vectors in flight per lane (a tail past the head dim loads zeros).
        constexpr int KU = 4;
        for (int i0 = 0; i0 < nvec; i0 += KU) {
            Vec16<T> kv[KU];
#pragma unroll
            for (int j = 0; j < KU; ++j) kv[j].raw = i0 + j < nvec ? kr[i0 + j] : make_uint4(0, 0, 0, 0);
#pragma unroll
            for (int j = 0; j < KU; ++j) {
                const int i = min(i0 + j, nvec - 1);  // a masked vector is zero: adds nothing
#pragma unroll
                for (int u = 0; u < RPW; ++u) {
                    const int r = r0 + u * WARPS;
                    if (r < R) {
                        // V consecutive floats at a multiple of V: 16-byte aligned broadcasts.
                        const float4* qr = reinterpret_cast<const float4*>(qs + r * D + i * V);
#pragma unroll
                        for (int e4 = 0; e4 < V / 4; ++e4) {
                            const float4 qv = qr[e4];
                            acc[u] += qv.x * to_f(kv[j].e[4 * e4]) + qv.y * to_f(kv[j].e[4 * e4 + 1]) +
                                      qv.z * to_f(kv[j].e[4 * e4 + 2]) + qv.w * to_f(kv[j].e[4 * e4 + 3]);
                        }
                    }
                }
            }
        }
#pragma unroll
        for (int u = 0; u < RPW; ++u) {
            const int r = r0 + u * WARPS;
            if (r < R) sc[r * ATT_KEYS + lane] = acc[u];
        }
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < R * ATT_KEYS; idx += ATT_THREADS) {
        const int r = idx / ATT_KEYS, key = key0 + idx % ATT_KEYS;
        const bool seen = key < L && key <= first + r % t;
        sc[idx] = seen ? sc[idx] * scale : -INFINITY;
    }
    __syncthreads();

    for (int r = warp; r < R; r += WARPS) {
        const float x = sc[r * ATT_KEYS + lane];
        const float m = warp_max(x);
        const float p = m == -INFINITY ? 0.f : expf(x - m);  // a row may see no key of this span
        sc[r * ATT_KEYS + lane] = p;
        const float l = warp_sum(p);
        if (lane == 0) {
            float* ml = part_ml + (((size_t)bh * S + s) * R + r) * 2;
            ml[0] = m;
            ml[1] = l;
        }
    }
    __syncthreads();

    // Values: thread → head dims d, d + ATT_THREADS, ...; the span's value loads are issued
    // first (keys past the length read as zero, with zero weight).
    const int nk = min(ATT_KEYS, L - key0);
    for (int d = threadIdx.x; d < D; d += ATT_THREADS) {
        float vv[ATT_KEYS];
#pragma unroll
        for (int j = 0; j < ATT_KEYS; ++j) vv[j] = j < nk ? to_f(v[(size_t)(key0 + j) * D + d]) : 0.f;
        for (int r0 = 0; r0 < R; r0 += 8) {
            float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int j = 0; j < ATT_KEYS; ++j)
#pragma unroll
                for (int u = 0; u < 8; ++u)
                    if (r0 + u < R) acc[u] += sc[(r0 + u) * ATT_KEYS + j] * vv[j];
#pragma unroll
            for (int u = 0; u < 8; ++u)
                if (r0 + u < R) part_o[(((size_t)bh * S + s) * R + r0 + u) * D + d] = acc[u];
        }
    }
}

// Merges the partial results of `per` consecutive spans at a time (of the ceil(len / ATT_KEYS)
// spans that hold keys) for row r of head bh. Entry e of the input covers spans [e·per_in,
// (e+1)·per_in); the output entry g covers input entries [g·GROUP, (g+1)·GROUP).
constexpr int GROUP = 32;

__device__ __forceinline__ int entries(const unsigned* len_p, int per) {
    const int spans = ((int)len_p[0] + ATT_KEYS - 1) / ATT_KEYS;
    return (spans + per - 1) / per;
}

// First level for long buffers: block (r, bh, g) merges input entries [g·GROUP, (g+1)·GROUP) into
// one (max, sum, unnormalised o) entry, so that the final merge reads at most S / GROUP entries.
__device__ void attn_merge_group(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                                 const unsigned* __restrict__ len_p, float* __restrict__ out_o,
                                 float* __restrict__ out_ml, int R, int D, int S, int per_in) {
    const int r = blockIdx.x, bh = blockIdx.y, g = blockIdx.z, G = gridDim.z;
    const int n = min(entries(len_p, per_in), S) - g * GROUP;
    if (n <= 0) return;
    const float* ml = part_ml + (((size_t)bh * S + g * GROUP) * R + r) * 2;  // entry e at ml[e·R·2]
    float m[GROUP];
    float M = -INFINITY;
#pragma unroll
    for (int e = 0; e < GROUP; ++e) {
        m[e] = e < n ? ml[(size_t)e * R * 2] : -INFINITY;
        M = fmaxf(M, m[e]);
    }
    float l = 0.f;
#pragma unroll
    for (int e = 0; e < GROUP; ++e) {
        m[e] = m[e] == -INFINITY ? 0.f : expf(m[e] - M);  // now the entry's weight
        if (e < n) l += m[e] * ml[(size_t)e * R * 2 + 1];
    }
    const float* o = part_o + (((size_t)bh * S + g * GROUP) * R + r) * D;  // entry e at o[e·R·D]
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float acc = 0.f;
#pragma unroll
        for (int e = 0; e < GROUP; ++e)
            if (e < n) acc += m[e] * o[(size_t)e * R * D + d];
        out_o[(((size_t)bh * G + g) * R + r) * D + d] = acc;
    }
    if (threadIdx.x == 0) {
        out_ml[(((size_t)bh * G + g) * R + r) * 2] = M;
        out_ml[(((size_t)bh * G + g) * R + r) * 2 + 1] = l;
    }
}

// out[bh, r, :] = Σ_e e^(m_e − M) · o_e / Σ_e e^(m_e − M) · l_e over the entries that hold keys
// (each entry covers `per` spans). One block per (r, bh); shared memory: S floats.
template <typename T>
__device__ void attn_merge(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                           const unsigned* __restrict__ len_p, T* __restrict__ out, int R, int D, int S, int per) {
    extern __shared__ float wts[];
    const int r = blockIdx.x, bh = blockIdx.y;
    const int ns = min(entries(len_p, per), S);
    const float* ml = part_ml + ((size_t)bh * S * R + r) * 2;  // entry s at ml[s·R·2]
    float M = -INFINITY;
#pragma unroll 8
    for (int s = 0; s < ns; ++s) M = fmaxf(M, ml[(size_t)s * R * 2]);
    float den = 0.f;
#pragma unroll 8
    for (int s = 0; s < ns; ++s) {
        const float m = ml[(size_t)s * R * 2];
        den += (m == -INFINITY ? 0.f : expf(m - M)) * ml[(size_t)s * R * 2 + 1];
    }
    for (int s = threadIdx.x; s < ns; s += blockDim.x) {
        const float m = ml[(size_t)s * R * 2];
        wts[s] = (m == -INFINITY ? 0.f : expf(m - M)) / den;
    }
    __syncthreads();
    const float* o = part_o + ((size_t)bh * S * R + r) * D;  // entry s at o[s·R·D]
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float acc = 0.f;
#pragma unroll 8
        for (int s = 0; s < ns; ++s) acc += wts[s] * o[(size_t)s * R * D + d];
        out[((size_t)bh * R + r) * D + d] = from_f<T>(acc);
    }
}

#define ATTENTION_KERNELS(SUFFIX, T)                                                                 \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS)                                        \
        attn_decode_partial_##SUFFIX(const T* q, const T* k, const T* v, const unsigned* len,         \
                                     float* part_o, float* part_ml, int R, int D, int cap, int t,    \
                                     float scale) {                                                  \
        attn_partial<T>(q, k, v, len, part_o, part_ml, R, D, cap, t, scale);                         \
    }                                                                                                \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS)                                        \
        attn_decode_merge_##SUFFIX(const float* part_o, const float* part_ml, const unsigned* len,   \
                                   T* out, int R, int D, int S, int per) {                           \
        attn_merge<T>(part_o, part_ml, len, out, R, D, S, per);                                      \
    }
ATTENTION_KERNELS(f32, float)
ATTENTION_KERNELS(bf16, __nv_bfloat16)
ATTENTION_KERNELS(f16, __half)
extern "C" __global__ void __launch_bounds__(ATT_THREADS)
    attn_decode_merge_group(const float* part_o, const float* part_ml, const unsigned* len, float* out_o,
                            float* out_ml, int R, int D, int S, int per_in) {
    attn_merge_group(part_o, part_ml, len, out_o, out_ml, R, D, S, per_in);
}

// Causal scaled softmax over a prefill block's scores, the CUDA twin of `causal_softmax` in
// src/attention.rs: one kernel instead of a cast, a scale, a device-built mask, its add, the
// softmax and a cast back. x, y: [rows, keys]; row r is the query at position pos0 + r % tb and
// sees keys 0..=that position; y = softmax(scale·x) over those keys, 0 past them. One block of
// SM_THREADS per row: an online (max, sum) pass, then a normalising pass. VEC: 16-byte vectors
// (keys·sizeof(T) a multiple of 16 and 16-byte aligned rows, checked by the launcher).
constexpr int SM_THREADS = 256;

__device__ __forceinline__ void online_add(float& m, float& s, float v) {
    if (v > m) {
        s = s * expf(m - v) + 1.f;  // m = -inf at the start: expf(-inf) = 0
        m = v;
    } else {
        s += expf(v - m);
    }
}

__device__ __forceinline__ void online_merge(float& m, float& s, float m2, float s2) {
    if (m2 == -INFINITY) return;
    if (m == -INFINITY) {
        m = m2;
        s = s2;
        return;
    }
    const float mm = fmaxf(m, m2);
    s = s * expf(m - mm) + s2 * expf(m2 - mm);
    m = mm;
}

template <typename T, bool VEC>
__device__ void causal_softmax(const T* __restrict__ x, T* __restrict__ y, int keys, int tb, int pos0,
                               float scale) {
    __shared__ float red_m[SM_THREADS / 32], red_s[SM_THREADS / 32];
    const long row = blockIdx.x;
    const int vis = min(keys, pos0 + (int)(row % tb) + 1);
    x += row * keys;
    y += row * keys;
    constexpr int V = VEC ? Vec16<T>::N : 1;
    float m = -INFINITY, s = 0.f;
    for (int j0 = threadIdx.x * V; j0 < vis; j0 += SM_THREADS * V) {
        if (VEC) {
            Vec16<T> a;
            a.raw = *reinterpret_cast<const uint4*>(x + j0);
#pragma unroll
            for (int e = 0; e < V; ++e)
                if (j0 + e < vis) online_add(m, s, to_f(a.e[e]) * scale);
        } else {
            online_add(m, s, to_f(x[j0]) * scale);
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
        online_merge(m, s, m2, s2);
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) {
        red_m[warp] = m;
        red_s[warp] = s;
    }
    __syncthreads();
    m = red_m[0];
    s = red_s[0];
    for (int w = 1; w < SM_THREADS / 32; ++w) online_merge(m, s, red_m[w], red_s[w]);
    const float inv = 1.f / s;
    for (int j0 = threadIdx.x * V; j0 < keys; j0 += SM_THREADS * V) {
        if (VEC) {
            Vec16<T> a, b;
            a.raw = *reinterpret_cast<const uint4*>(x + j0);
#pragma unroll
            for (int e = 0; e < V; ++e)
                b.e[e] = from_f<T>(j0 + e < vis ? expf(to_f(a.e[e]) * scale - m) * inv : 0.f);
            *reinterpret_cast<uint4*>(y + j0) = b.raw;
        } else {
            y[j0] = from_f<T>(j0 < vis ? expf(to_f(x[j0]) * scale - m) * inv : 0.f);
        }
    }
}

#define CAUSAL_SOFTMAX(SUFFIX, T)                                                                    \
    extern "C" __global__ void __launch_bounds__(SM_THREADS)                                         \
        causal_softmax_##SUFFIX(const T* x, T* y, int keys, int tb, int pos0, float scale) {         \
        causal_softmax<T, false>(x, y, keys, tb, pos0, scale);                                       \
    }                                                                                                \
    extern "C" __global__ void __launch_bounds__(SM_THREADS)                                         \
        causal_softmax_vec_##SUFFIX(const T* x, T* y, int keys, int tb, int pos0, float scale) {     \
        causal_softmax<T, true>(x, y, keys, tb, pos0, scale);                                        \
    }
CAUSAL_SOFTMAX(f32, float)
CAUSAL_SOFTMAX(bf16, __nv_bfloat16)
CAUSAL_SOFTMAX(f16, __half)
