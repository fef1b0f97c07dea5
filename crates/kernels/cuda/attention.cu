// Causal attention of a few new queries over a KV cache whose valid length lives in device memory
// (so one recorded CUDA graph serves every decode position): the CUDA twin of
// `decode_attention` in src/attention/. Split-K ("flash decoding"): each block scores one span of
// ATT_KEYS keys for every query row of one KV head and keeps unnormalised partial sums; a second
// kernel merges the spans. Also the prefill kernels: a causal softmax over materialised scores
// (any dtype) and a tiled FlashAttention-2 kernel on tensor cores (bf16/f16). Built to PTX by
// build.rs.
#include "common.cuh"
#include "mma.cuh"

constexpr int ATT_THREADS = ATTENTION_THREADS;
constexpr int ATT_KEYS = ATTENTION_KEYS_PER_SPAN;  // keys per span: one per lane in the softmax step

// Where the decode kernels find key/value position `pos` of KV head bh = b·H + h, in rows of D
// elements: a contiguous run of `cap` rows per head (table null: a [B, H, cap, D] buffer), or a
// paged pool ([blocks · bs, H, D]) through sequence b's block table, table[b·maxb + pos / bs]
// (cap = maxb·bs). A block id at or past `nblocks` reads block 0 (memory that exists).
struct KvRows {
    const unsigned* table;
    int maxb, bs, nblocks, H;
    __device__ __forceinline__ long row(int bh, int cap, int pos) const {
        if (table == nullptr) return (long)bh * cap + pos;
        const int b = bh / H, h = bh % H;
        unsigned blk = table[(long)b * maxb + pos / bs];
        if (blk >= (unsigned)nblocks) blk = 0;
        return ((long)blk * bs + pos % bs) * H + h;
    }
    // The valid keys of head bh: the shared len[0], or sequence b's len[b] when paged.
    __device__ __forceinline__ int len_of(const unsigned* len_p, int bh) const {
        return (int)len_p[table == nullptr ? 0 : bh / H];
    }
};

// q: [BH, R, D] (row r = group member · t + token), k, v: [BH, cap, D], len[0]: valid keys after
// the t new ones were written (token i sits at position len - t + i and sees keys 0..=that).
// part_o: [BH, S, R, D] f32 unnormalised sums, part_ml: [BH, S, R, 2] f32 (max, sum of exp).
// Shared memory: R·D + R·ATT_KEYS floats. D·sizeof(T) a multiple of 16 (checked by the launcher).
template <typename T>
__device__ void attn_partial(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                             const unsigned* __restrict__ len_p, float* __restrict__ part_o,
                             float* __restrict__ part_ml, int R, int D, int cap, int t, float scale,
                             const KvRows kv) {
    extern __shared__ float sm[];
    float* qs = sm;
    float* sc = sm + R * D;
    __shared__ long rows[ATT_KEYS];  // the span's key rows
    const int s = blockIdx.x, bh = blockIdx.y, S = gridDim.x;
    const int L = min(kv.len_of(len_p, bh), cap);  // a length past the buffer reads no further
    const int key0 = s * ATT_KEYS;
    if (key0 >= L) return;  // spans past the length are never read by the merge
    q += (size_t)bh * R * D;
    for (int i = threadIdx.x; i < R * D; i += ATT_THREADS) qs[i] = to_f(q[i]);
    // Keys past the length read the last valid key (memory that exists) and are masked below.
    if (threadIdx.x < ATT_KEYS) rows[threadIdx.x] = kv.row(bh, cap, min(key0 + (int)threadIdx.x, L - 1));
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
    const uint4* kr = reinterpret_cast<const uint4*>(k + (size_t)rows[lane] * D);
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
        for (int j = 0; j < ATT_KEYS; ++j) vv[j] = j < nk ? to_f(v[(size_t)rows[j] * D + d]) : 0.f;
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
constexpr int GROUP = ATTENTION_GROUP;

// Units per split when a row's `units` are cut into at most s0 splits of consecutive units, at
// least min(ceil(units / cut_div), cut_max) each: a short row takes many small splits (parallel
// work for a lone sequence), a long one fewer and longer (a block's fixed costs weigh less).
// Grows by at most one as `units` does.
__device__ __forceinline__ int split_units(int units, int s0, int cut_div, int cut_max) {
    return max(max((units + s0 - 1) / s0, min((units + cut_div - 1) / cut_div, cut_max)), 1);
}

// Entries that hold keys at a merge level with `per` first-level partials per entry. The partial
// kernel ran s0 blocks per head over the ceil(len / unit) units of `unit` keys, each block taking
// split_units of them (one unit each when s0 covers the buffer and cut_max is 1).
__device__ __forceinline__ int entries(int len, int unit, int s0, int per, int cut_div, int cut_max) {
    const int units = (len + unit - 1) / unit;
    const int upb = split_units(units, s0, cut_div, cut_max);
    const int parts = (units + upb - 1) / upb;
    return (parts + per - 1) / per;
}

// The keys row r sees, of a pass of Tn new tokens with len keys after them (len clamped to the
// buffer as the partial kernels clamp it): its token r % Tn sits at position len - Tn + r % Tn.
// The partial kernels cut each row's keys by this length, as a decode step at that position
// does; entries past it hold no key of the row.
__device__ __forceinline__ int row_len(const unsigned* len_p, int sel, int cap, int r, int Tn) {
    return max(min((int)len_p[sel], cap) - Tn + r % Tn + 1, 0);
}

// First level for long buffers: block (r, bh, g) merges input entries [g·GROUP, (g+1)·GROUP) into
// one (max, sum, unnormalised o) entry, so that the final merge reads at most S / GROUP entries.
__device__ void attn_merge_group(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                                 const unsigned* __restrict__ len_p, float* __restrict__ out_o,
                                 float* __restrict__ out_ml, int R, int D, int S, int per_in, int unit,
                                 int s0, int cut_div, int cut_max, int len_h, int cap, int Tn) {
    const int r = blockIdx.x, bh = blockIdx.y, g = blockIdx.z, G = gridDim.z;
    // len_h > 0: a length per sequence (paged), len[bh / len_h]; else the shared len[0].
    const int len = row_len(len_p, len_h > 0 ? bh / len_h : 0, cap, r, Tn);
    const int n = min(entries(len, unit, s0, per_in, cut_div, cut_max), S) - g * GROUP;
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

// o = Σ_e e^(m_e − M) · o_e / Σ_e e^(m_e − M) · l_e over the entries that hold keys (each entry
// covers `per` spans) of row r = member·Tn + token of KV head kv = bh % H, batch bh / H, written
// token-major: out[b, token, kv·G + member, :] (G = R / Tn query heads per KV head), times
// sigmoid(gate[b, token, head, :]) when a gate is given (rows of D contiguous elements, strides
// gsb, gst, gsh). One block per (r, bh); shared memory: S floats.
template <typename T>
__device__ void attn_merge(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                           const unsigned* __restrict__ len_p, T* __restrict__ out, int R, int D, int S, int per,
                           int unit, int s0, int cut_div, int cut_max, const T* __restrict__ gate, long gsb,
                           long gst, long gsh, int H, int Tn, int paged, int cap) {
    extern __shared__ float wts[];
    const int r = blockIdx.x, bh = blockIdx.y;
    const int len = row_len(len_p, paged ? bh / H : 0, cap, r, Tn);
    const int ns = min(entries(len, unit, s0, per, cut_div, cut_max), S);
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
    const int b = bh / H, G = R / Tn, token = r % Tn, head = (bh % H) * G + r / Tn;
    T* orow = out + (((size_t)b * Tn + token) * H * G + head) * D;
    const T* grow = gate != nullptr ? gate + b * gsb + token * gst + head * gsh : nullptr;
    const float* o = part_o + ((size_t)bh * S * R + r) * D;  // entry s at o[s·R·D]
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float acc = 0.f;
#pragma unroll 8
        for (int s = 0; s < ns; ++s) acc += wts[s] * o[(size_t)s * R * D + d];
        if (grow != nullptr) acc /= 1.f + expf(-to_f(grow[d]));
        orow[d] = from_f<T>(acc);
    }
}

#define ATTENTION_KERNELS(SUFFIX, T)                                                                 \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS)                                        \
        attn_decode_partial_##SUFFIX(const T* q, const T* k, const T* v, const unsigned* len,         \
                                     float* part_o, float* part_ml, int R, int D, int cap, int t,    \
                                     float scale, const unsigned* table, int maxb, int bs,           \
                                     int nblocks, int H) {                                           \
        pdl_enter();                                                                                 \
        attn_partial<T>(q, k, v, len, part_o, part_ml, R, D, cap, t, scale,                          \
                        KvRows{table, maxb, bs, nblocks, H});                                        \
    }                                                                                                \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS)                                        \
        attn_decode_merge_##SUFFIX(const float* part_o, const float* part_ml, const unsigned* len,   \
                                   T* out, int R, int D, int S, int per, int unit, int s0,           \
                                   int cut_div, int cut_max, const T* gate, long gsb, long gst,      \
                                   long gsh, int H, int Tn, int paged, int cap) {                    \
        pdl_enter();                                                                                 \
        attn_merge<T>(part_o, part_ml, len, out, R, D, S, per, unit, s0, cut_div, cut_max, gate, gsb,  \
                      gst, gsh, H, Tn, paged, cap);                                                  \
    }
ATTENTION_KERNELS(f32, float)
ATTENTION_KERNELS(bf16, __nv_bfloat16)
ATTENTION_KERNELS(f16, __half)
extern "C" __global__ void __launch_bounds__(ATT_THREADS)
    attn_decode_merge_group(const float* part_o, const float* part_ml, const unsigned* len, float* out_o,
                            float* out_ml, int R, int D, int S, int per_in, int unit, int s0, int cut_div,
                            int cut_max, int len_h, int cap, int Tn) {
    pdl_enter();
    attn_merge_group(part_o, part_ml, len, out_o, out_ml, R, D, S, per_in, unit, s0, cut_div, cut_max, len_h,
                     cap, Tn);
}

// Causal scaled softmax over a prefill block's scores, the CUDA twin of `causal_softmax` in
// src/attention/: one kernel instead of a cast, a scale, a device-built mask, its add, the
// softmax and a cast back. x, y: [rows, keys]; row r is the query at position pos0 + r % tb and
// sees keys 0..=that position; y = softmax(scale·x) over those keys, 0 past them. One block of
// SM_THREADS per row: an online (max, sum) pass, then a normalising pass. VEC: 16-byte vectors
// (keys·sizeof(T) a multiple of 16 and 16-byte aligned rows, checked by the launcher).
constexpr int SM_THREADS = SOFTMAX_THREADS;

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
        causal_softmax_##SUFFIX(const T* x, T* y, int keys, int tb, int pos0, float scale) { pdl_enter();         \
        causal_softmax<T, false>(x, y, keys, tb, pos0, scale);                                       \
    }                                                                                                \
    extern "C" __global__ void __launch_bounds__(SM_THREADS)                                         \
        causal_softmax_vec_##SUFFIX(const T* x, T* y, int keys, int tb, int pos0, float scale) { pdl_enter();     \
        causal_softmax<T, true>(x, y, keys, tb, pos0, scale);                                        \
    }
CAUSAL_SOFTMAX(f32, float)
CAUSAL_SOFTMAX(bf16, __nv_bfloat16)
CAUSAL_SOFTMAX(f16, __half)

// ---------------------------------------------------------------------------------------------
// Causal prefill attention, FlashAttention-2 style on tensor cores (mma.sync m16n8k16, f32
// accumulate): the CUDA twin of `prefill_attention` in src/attention/ for bf16/f16.
// Block = (tile of FA_BQ query rows, query head h, batch b), 4 warps of 16 query rows each. The
// block walks the key tiles up to its last query's position: S = Q K^T (scaled by scale·log2 e),
// causal mask, online softmax (running row max m and sum l, base 2), O += P V with P rounded to the
// input dtype, as flash-attn does; O / l at the end. Q, K and V tiles sit in shared memory (rows
// padded by 8 elements: the ldmatrix rows of 16 bytes then fall in distinct banks); K and V of the
// next tile load (cp.async) while the current one is computed on.
// q: [b, nh, t, HD] (strides q_bs, q_hs; rows HD apart), k, v: [b, nkv, >= kv_len, HD] (strides
// k_bs, k_hs, shared by v; rows HD apart; head h reads KV head h / (nh / nkv)), query i sits at
// position pos0 + i and sees keys 0..=pos0 + i; out: [b, t, nh, HD] contiguous. gate (optional,
// gated attention): [b, t, nh, HD] with strides g_bs, g_ts, g_hs, rows contiguous; the output is
// multiplied by sigmoid(gate) as it is written.
constexpr int FA_BQ = FLASH_QUERY_TILE, FA_BK = FLASH_TILE, FA_WARPS = FLASH_WARPS;

// Starts copying rows [r0, r0 + 64) of a [rows][HD] matrix (rows `rs` elements apart) into a
// shared tile of row stride HD + 8; rows at or past `limit` are zero-filled.
template <typename T, int HD>
__device__ __forceinline__ void fa_load_tile(T* dst, const T* __restrict__ src, long rs, int r0, int limit) {
    constexpr int SEGS = HD * sizeof(T) / 16;
    cp_async_tile<64, SEGS, FA_WARPS * 32>(dst, HD + 8, src, rs, r0, limit, SEGS);
}

// The three steps of a flash-attention tile that flash_prefill and flash_decode share, for one
// warp's 16 query rows (m16 C fragments: element (j, e) of row half r is key 8j + 2c + e of the
// warp's keys, c = lane % 4).
// s[NJ][4] = Q K^T for 8·NJ keys: Q rows q0.. of Qs, keys key0.. of Ks, both [rows][HD] tiles of
// row stride ld.
template <typename T, int HD, int NJ>
__device__ __forceinline__ void fa_scores(float (&s)[NJ][4], const T* Qs, const T* Ks, int ld, int q0, int key0) {
#pragma unroll
    for (int j = 0; j < NJ; j++) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < HD / 16; kk++) {
        uint32_t a[4];
        load_a(a, Qs, ld, q0, kk * 16);
#pragma unroll
        for (int j2 = 0; j2 < NJ / 2; j2++) {
            uint32_t bf[4];
            load_b2_nk(bf, Ks, ld, kk * 16, key0 + j2 * 16);
            mma_b2<T>(s, j2, a, bf);
        }
    }
}
// One online-softmax step in base 2: scales the scores by scale_log2, masks keys past each row's
// position (key k0 + 8j + 2c + e > pos_r[r]; skipped when `mask` is false), updates the running
// max m and sum l, rescales the output o, and leaves the weights e^(x - m) in s. A row whose keys
// are all masked so far keeps weight 0 (no NaN).
template <int NJ, int NO>
__device__ __forceinline__ void fa_online_softmax(float (&s)[NJ][4], float (&o)[NO][4], float (&m)[2], float (&l)[2],
                                                  float scale_log2, bool mask, int k0, const int (&pos_r)[2]) {
    const int c = threadIdx.x % 4;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        float mx = m[r];
#pragma unroll
        for (int j = 0; j < NJ; j++) {
#pragma unroll
            for (int e = 0; e < 2; e++) {
                float x = s[j][2 * r + e] * scale_log2;
                if (mask && k0 + 8 * j + 2 * c + e > pos_r[r]) x = -INFINITY;
                s[j][2 * r + e] = x;
                mx = fmaxf(mx, x);
            }
        }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float corr = m[r] == -INFINITY ? 0.f : exp2f(m[r] - mx);
        m[r] = mx;
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < NJ; j++) {
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const float p = mx == -INFINITY ? 0.f : exp2f(s[j][2 * r + e] - mx);
                s[j][2 * r + e] = p;
                sum += p;
            }
        }
        l[r] = l[r] * corr + sum;
#pragma unroll
        for (int j = 0; j < NO; j++) {
            o[j][2 * r] *= corr;
            o[j][2 * r + 1] *= corr;
        }
    }
}
// o += P V: the weights' C fragments (rounded to T, as flash-attn does) are the A fragments of the
// product; V rows key0.. of Vs ([keys][HD], row stride ld).
template <typename T, int HD, int NJ>
__device__ __forceinline__ void fa_accumulate(float (&o)[HD / 8][4], const float (&p)[NJ][4], const T* Vs, int ld,
                                              int key0) {
#pragma unroll
    for (int kk = 0; kk < NJ / 2; kk++) {
        const uint32_t a[4] = {pack2<T>(p[2 * kk][0], p[2 * kk][1]), pack2<T>(p[2 * kk][2], p[2 * kk][3]),
                               pack2<T>(p[2 * kk + 1][0], p[2 * kk + 1][1]),
                               pack2<T>(p[2 * kk + 1][2], p[2 * kk + 1][3])};
#pragma unroll
        for (int j2 = 0; j2 < HD / 16; j2++) {
            uint32_t bf[4];
            load_b2(bf, Vs, ld, key0 + kk * 16, j2 * 16);
            mma_b2<T>(o, j2, a, bf);
        }
    }
}

template <typename T, int HD>
__device__ void flash_prefill(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                              const T* __restrict__ gate, T* __restrict__ out, int t, int nh, int nkv, long q_bs,
                              long q_hs, long k_bs, long k_hs, long g_bs, long g_ts, long g_hs, int pos0,
                              float scale_log2) {
    constexpr int LD = HD + 8;
    extern __shared__ __align__(16) unsigned char fa_smem[];
    T* Qs = reinterpret_cast<T*>(fa_smem);
    T* Ks = Qs + FA_BQ * LD;
    T* Vs = Ks + FA_BK * LD;
    // Heaviest tiles (most keys) first: the grid runs roughly in blockIdx order.
    const int tile = gridDim.x - 1 - blockIdx.x;
    const int h = blockIdx.y, b = blockIdx.z;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, c = lane % 4;
    const int q0 = tile * FA_BQ;
    const T* qb = q + b * q_bs + h * q_hs;
    const long kv_off = b * k_bs + (long)(h / (nh / nkv)) * k_hs;
    const T* kb = k + kv_off;
    const T* vb = v + kv_off;
    // Keys this tile sees: up to its last valid query's position.
    const int keys = pos0 + min(q0 + FA_BQ, t);
    const int ntiles = (keys + FA_BK - 1) / FA_BK;

    fa_load_tile<T, HD>(Qs, qb, HD, q0, t);
    cp_async_commit();
    fa_load_tile<T, HD>(Ks, kb, HD, 0, keys);
    cp_async_commit();
    fa_load_tile<T, HD>(Vs, vb, HD, 0, keys);
    cp_async_commit();

    float o[HD / 8][4];
#pragma unroll
    for (int j = 0; j < HD / 8; j++) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
    // Positions of this thread's two rows (g and g + 8 of the warp's 16).
    const int pos_r[2] = {pos0 + q0 + warp * 16 + g, pos0 + q0 + warp * 16 + g + 8};
    const int warp_last = pos0 + q0 + warp * 16 + 15;

    for (int kt = 0; kt < ntiles; kt++) {
        const int k0 = kt * FA_BK;
        cp_async_wait<1>();  // Q and this K tile (its V may still be in flight)
        __syncthreads();
        float s[FA_BK / 8][4] = {};
        if (k0 <= warp_last) fa_scores<T, HD>(s, Qs, Ks, LD, warp * 16, 0);
        __syncthreads();  // every warp is done with this K tile
        if (kt + 1 < ntiles) fa_load_tile<T, HD>(Ks, kb, HD, k0 + FA_BK, keys);
        cp_async_commit();  // (empty on the last tile: keeps the group count uniform)

        // Online softmax over this tile's keys; keys past a row's position are masked (only the
        // tiles on the diagonal have any).
        fa_online_softmax(s, o, m, l, scale_log2, k0 + FA_BK - 1 > pos0 + q0 + warp * 16, k0, pos_r);

        cp_async_wait<1>();  // this V tile (the next K tile may still be in flight)
        __syncthreads();
        if (k0 <= warp_last) fa_accumulate<T, HD>(o, s, Vs, LD, 0);
        __syncthreads();  // every warp is done with this V tile
        if (kt + 1 < ntiles) fa_load_tile<T, HD>(Vs, vb, HD, k0 + FA_BK, keys);
        cp_async_commit();
    }
    cp_async_wait<0>();

#pragma unroll
    for (int r = 0; r < 2; r++) {
        float sum = l[r];
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        const int row = q0 + warp * 16 + g + 8 * r;
        if (row >= t) continue;
        const float inv = 1.f / sum;
        T* orow = out + (((long)b * t + row) * nh + h) * HD;
        const T* grow = gate != nullptr ? gate + b * g_bs + row * g_ts + h * g_hs : nullptr;
#pragma unroll
        for (int j = 0; j < HD / 8; j++) {
            float o0 = o[j][2 * r] * inv, o1 = o[j][2 * r + 1] * inv;
            if (grow != nullptr) {
                o0 /= 1.f + expf(-to_f(grow[8 * j + 2 * c]));
                o1 /= 1.f + expf(-to_f(grow[8 * j + 2 * c + 1]));
            }
            *reinterpret_cast<uint32_t*>(&orow[8 * j + 2 * c]) = pack2<T>(o0, o1);
        }
    }
}

#define FLASH_PREFILL(SUFFIX, T, HD)                                                                       \
    extern "C" __global__ void __launch_bounds__(FA_WARPS * 32)                                            \
        flash_prefill_##SUFFIX##_d##HD(const T* q, const T* k, const T* v, const T* gate, T* out, int t,   \
                                       int nh, int nkv, long q_bs, long q_hs, long k_bs, long k_hs,         \
                                       long g_bs, long g_ts, long g_hs, int pos0, float sl2) { pdl_enter();              \
        flash_prefill<T, HD>(q, k, v, gate, out, t, nh, nkv, q_bs, q_hs, k_bs, k_hs, g_bs, g_ts, g_hs, pos0, \
                             sl2);                                                                         \
    }
FLASH_PREFILL(bf16, __nv_bfloat16, 64)
FLASH_PREFILL(bf16, __nv_bfloat16, 128)
FLASH_PREFILL(bf16, __nv_bfloat16, 256)
FLASH_PREFILL(f16, __half, 64)
FLASH_PREFILL(f16, __half, 128)
FLASH_PREFILL(f16, __half, 256)

// ---------------------------------------------------------------------------------------------
// Decode / verify attention on tensor cores: the partial results of attn_partial (then merged by
// the same kernels) for bf16/f16, head dims 64/128/256 and any number of query rows of one KV
// head (blocks of one to three 16-row tiles).
// The cache rows of key/value positions r0 + lane and r0 + 32 + lane of head bh (found through
// `kv`: two independent table reads when paged), positions at or past `limit` taking position 0's:
// a 64-position tile's rows, spread over a warp's lanes.
struct TileRows {
    long lo, hi;
};
__device__ __forceinline__ TileRows kv_tile_rows(const KvRows& kv, int bh, int cap, int r0, int limit) {
    const int lane = threadIdx.x % 32;
    return {kv.row(bh, cap, r0 + lane < limit ? r0 + lane : 0),
            kv.row(bh, cap, r0 + 32 + lane < limit ? r0 + 32 + lane : 0)};
}
// Starts copying key/value positions [r0, r0 + 64) (their rows `rows`, from kv_tile_rows) into a
// shared tile of row stride HD + 8; positions at or past `limit` are zero-filled. A copy takes its
// row from the lane that holds it: the rows that a warp's 32 segments of one step cover sit in the
// same half of the tile (steps of 32 / SEGS rows), so a lane's choice between lo and hi is the one
// its source lane makes.
template <typename T, int HD, int THREADS = FA_WARPS * 32>
__device__ __forceinline__ void kv_load_tile(T* dst, const T* __restrict__ src, const TileRows& rows, int r0,
                                             int limit) {
    constexpr int SEGS = HD * sizeof(T) / 16, E = 16 / sizeof(T);
    static_assert(32 % SEGS == 0 || SEGS % 32 == 0, "a warp's segments cover whole rows");
#pragma unroll
    for (int e = threadIdx.x; e < 64 * SEGS; e += THREADS) {
        const int r = e / SEGS, sg = e % SEGS;
        const long row = __shfl_sync(0xffffffffu, r < 32 ? rows.lo : rows.hi, r % 32);
        cp_async16_or_zero(&dst[r * (HD + 8) + E * sg], &src[row * HD + E * sg], r0 + r < limit);
    }
}

// Tiles of FA_BK keys per split of a row with L keys (the merge kernels' `entries` cuts them the
// same way).
__device__ __forceinline__ int split_tiles(int L, int S, int cut_div, int cut_max) {
    return split_units((L + FA_BK - 1) / FA_BK, S, cut_div, cut_max);
}

// Block (split s and row block z, bh) takes rows 16·NG·z.. (row r is token r % t, at position len -
// t + r % t), NG tiles of 16 rows, and the split's consecutive tiles of FA_BK keys (read from
// device memory: the grid is fixed by the buffer, so a recorded graph serves every length); blocks
// past the last tile return. Warp w works for row tile w / FA_WARPS: its scores are key part
// w % FA_WARPS (FA_BK / FA_WARPS keys) of every tile, and its outputs columns part w % FA_WARPS
// (HD / FA_WARPS columns) over all the tile's keys. The row tile's warps share each tile's max
// (through shared memory), so their weights form one P tile, which each warp multiplies by its
// columns of V; a warp holds a quarter of the row tile's outputs, which is what lets two blocks of
// two row tiles share an SM. The NG row tiles share each K and V tile,
// so the block reads them once (a verify's 4 tokens of 6 query heads: 24 rows, NG = 2). K and V
// tiles load as in flash_prefill. Batch-invariant: a row's sums depend on its own position alone,
// not on the other rows of its block nor on how many tokens its pass has. Row r's keys are cut as a
// decode step at its position cuts them (split_tiles of its own length), so a verify whose tokens
// straddle a change of that cut (where split_tiles grows) runs its split once per cut, each time
// keeping the rows of that cut; tiles past a row's position are masked whole, which leaves its sums
// exactly as they were (weights e^-inf = 0, running max unchanged). A row's sums do not depend on
// NG (its warps, key parts, column parts and summing order are the same).
template <typename T, int HD, int NG>
__device__ void flash_decode_partial(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                                     const unsigned* __restrict__ len_p, float* __restrict__ part_o,
                                     float* __restrict__ part_ml, int R, int cap, int t, float scale_log2,
                                     int S, int cut_div, int cut_max, const KvRows kv) {
    constexpr int LD = HD + 8, PLD = FA_BK + 8;
    constexpr int KW = FA_BK / FA_WARPS;  // keys per warp per tile (scores)
    constexpr int DW = HD / FA_WARPS;     // output columns per warp (P V)
    static_assert(DW % 16 == 0, "a warp's output columns are whole 16-column MMA pairs");
    constexpr int NT = FA_WARPS * 32 * NG, BR = 16 * NG;  // threads, rows per block
    extern __shared__ __align__(16) unsigned char fa_smem[];
    T* Qs = reinterpret_cast<T*>(fa_smem);
    T* Ks = Qs + BR * LD;
    T* Vs = Ks + FA_BK * LD;
    T* Ps = Vs + FA_BK * LD;                              // [BR][PLD] a tile's weights
    float* Mx = reinterpret_cast<float*>(Ps + BR * PLD);  // [BR][FA_WARPS] the warps' maxima (sums)
    const int zs = (R + BR - 1) / BR;  // row blocks
    const int s = blockIdx.x / zs, bh = blockIdx.y, r0 = BR * (blockIdx.x % zs);
    const int L = min(kv.len_of(len_p, bh), cap);
    const int nt = (L + FA_BK - 1) / FA_BK;
    // The cuts of the pass's first and last rows (split_tiles grows with the length).
    const int cut_lo = split_tiles(L - t + 1, S, cut_div, cut_max);
    const int cut_hi = split_tiles(L, S, cut_div, cut_max);
    if (s * cut_lo >= nt) return;  // past the keys under both cuts: the merge never reads it
    q += ((size_t)bh * R + r0) * HD;
    cp_async_tile<BR, HD / 8, NT>(Qs, LD, q, HD, 0, R - r0, HD / 8);
    cp_async_commit();

    // This warp's row tile (its first row rt of the block's) and key part.
    const int warp = threadIdx.x / 32 % FA_WARPS, rt = 16 * (threadIdx.x / 32 / FA_WARPS);
    const int lane = threadIdx.x % 32;
    const int g = lane / 4, c = lane % 4;
    const int pos_r[2] = {L - t + (r0 + rt + g) % t, L - t + (r0 + rt + g + 8) % t};
    // The cut of row r (of the pass's rows), and whether this block's rows take cut `cut`.
    auto row_cut = [&](int r) { return split_tiles(L - t + r % t + 1, S, cut_div, cut_max); };
    // Bit i of rows_of(cut): the block's row r0 + i takes cut (each lane finds rows lane and 32 +
    // lane once; every warp holds the masks).
    const int cut_a = lane < BR && r0 + lane < R ? row_cut(r0 + lane) : -1;
    const int cut_b = 32 + lane < BR && r0 + 32 + lane < R ? row_cut(r0 + 32 + lane) : -1;
    auto rows_of = [&](int cut) {
        return (unsigned long long)__ballot_sync(0xffffffffu, cut_a == cut) |
               (unsigned long long)__ballot_sync(0xffffffffu, cut_b == cut) << 32;
    };
    // The cuts of a pass's rows are consecutive (a length one longer moves a cut by at most one).
    for (int cut = cut_lo; cut <= cut_hi; cut++) {
        const int t0 = s * cut, t1 = min(t0 + cut, nt);
        const unsigned long long mine = rows_of(cut);
        if (t0 < t1 && mine != 0) {
            // A tile's rows serve its K and V copies; the next tile's are read a tile ahead.
            TileRows rows = kv_tile_rows(kv, bh, cap, t0 * FA_BK, L);
            kv_load_tile<T, HD, NT>(Ks, k, rows, t0 * FA_BK, L);
            cp_async_commit();
            kv_load_tile<T, HD, NT>(Vs, v, rows, t0 * FA_BK, L);
            cp_async_commit();
            if (t0 + 1 < t1) rows = kv_tile_rows(kv, bh, cap, (t0 + 1) * FA_BK, L);
            // This warp's output columns (a quarter of the head) for its row tile's rows, relative
            // to the row's running max m, which the row tile's warps share: each tile's max is
            // taken over all FA_BK keys through Mx. l: this lane's part of the row's sum of weights
            // over the warp's key parts (summed over the lanes and warps at the end).
            float o[DW / 8][4];
#pragma unroll
            for (int j = 0; j < DW / 8; j++) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
            float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
            for (int tile = t0; tile < t1; tile++) {
                const int k0 = tile * FA_BK + warp * KW;  // this warp's first key
                cp_async_wait<1>();
                __syncthreads();
                float sc[KW / 8][4];
                fa_scores<T, HD>(sc, Qs, Ks, LD, rt, warp * KW);
                // Scaled scores (base 2), keys past a row's position masked (every key at or past
                // L is past every row's), and the warp's max of each row into Mx.
#pragma unroll
                for (int r = 0; r < 2; r++) {
                    float mx = -INFINITY;
#pragma unroll
                    for (int j = 0; j < KW / 8; j++) {
#pragma unroll
                        for (int e = 0; e < 2; e++) {
                            float x = sc[j][2 * r + e] * scale_log2;
                            if (k0 + 8 * j + 2 * c + e > pos_r[r]) x = -INFINITY;
                            sc[j][2 * r + e] = x;
                            mx = fmaxf(mx, x);
                        }
                    }
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                    if (c == 0) Mx[(rt + g + 8 * r) * FA_WARPS + warp] = mx;
                }
                __syncthreads();  // Mx written; every warp is done with Ks
                if (tile + 1 < t1) kv_load_tile<T, HD, NT>(Ks, k, rows, (tile + 1) * FA_BK, L);
                cp_async_commit();

                // The tile's max over the row tile's warps (in warp order), the weights e^(x - m)
                // of this warp's keys into Ps (rounded to T, as flash-attn does), the running sums
                // and the output rescaled. A row with every key so far masked keeps weight 0.
#pragma unroll
                for (int r = 0; r < 2; r++) {
                    float mx = m[r];
#pragma unroll
                    for (int w = 0; w < FA_WARPS; w++) mx = fmaxf(mx, Mx[(rt + g + 8 * r) * FA_WARPS + w]);
                    const float corr = m[r] == -INFINITY ? 0.f : exp2f(m[r] - mx);
                    m[r] = mx;
                    float sum = 0.f;
#pragma unroll
                    for (int j = 0; j < KW / 8; j++) {
                        const float p0 = mx == -INFINITY ? 0.f : exp2f(sc[j][2 * r] - mx);
                        const float p1 = mx == -INFINITY ? 0.f : exp2f(sc[j][2 * r + 1] - mx);
                        sum += p0;
                        sum += p1;
                        *reinterpret_cast<uint32_t*>(&Ps[(rt + g + 8 * r) * PLD + warp * KW + 8 * j + 2 * c]) =
                            pack2<T>(p0, p1);
                    }
                    l[r] = l[r] * corr + sum;
#pragma unroll
                    for (int j = 0; j < DW / 8; j++) {
                        o[j][2 * r] *= corr;
                        o[j][2 * r + 1] *= corr;
                    }
                }

                cp_async_wait<1>();
                __syncthreads();  // V landed; Ps written
                // o += P V over all FA_BK keys of the tile, for this warp's columns.
#pragma unroll
                for (int kk = 0; kk < FA_BK; kk += 16) {
                    uint32_t a[4];
                    load_a(a, Ps, PLD, rt, kk);
#pragma unroll
                    for (int j2 = 0; j2 < DW / 16; j2++) {
                        uint32_t bf[4];
                        load_b2(bf, Vs, LD, kk, warp * DW + 16 * j2);
                        mma_b2<T>(o, j2, a, bf);
                    }
                }
                __syncthreads();  // every warp is done with Vs and Ps
                if (tile + 1 < t1) kv_load_tile<T, HD, NT>(Vs, v, rows, (tile + 1) * FA_BK, L);
                cp_async_commit();
                if (tile + 2 < t1) rows = kv_tile_rows(kv, bh, cap, (tile + 2) * FA_BK, L);
            }
            cp_async_wait<0>();

            // Each row's sum of weights: the lanes' parts, then the warps' through Mx in warp
            // order; the outputs of this cut's rows written where the merge kernels read them.
#pragma unroll
            for (int r = 0; r < 2; r++) {
                float sum = l[r];
                sum += __shfl_xor_sync(0xffffffffu, sum, 1);
                sum += __shfl_xor_sync(0xffffffffu, sum, 2);
                if (c == 0) Mx[(rt + g + 8 * r) * FA_WARPS + warp] = sum;
            }
            __syncthreads();
#pragma unroll
            for (int r = 0; r < 2; r++) {
                const int rr = rt + g + 8 * r, row = r0 + rr;
                // The rows of this cut only (the other cut's pass writes the rest).
                if ((mine >> rr & 1) == 0) continue;
                float* po = part_o + (((size_t)bh * S + s) * R + row) * HD + warp * DW + 2 * c;
#pragma unroll
                for (int j = 0; j < DW / 8; j++)
                    *reinterpret_cast<float2*>(po + 8 * j) = make_float2(o[j][2 * r], o[j][2 * r + 1]);
                if (warp == 0 && c == 0) {
                    float sum = 0.f;
#pragma unroll
                    for (int w = 0; w < FA_WARPS; w++) sum += Mx[rr * FA_WARPS + w];
                    // The merge kernels weigh entries by e^(m - M): the max in natural-log units.
                    part_ml[(((size_t)bh * S + s) * R + row) * 2] = m[r] * 0.69314718f;
                    part_ml[(((size_t)bh * S + s) * R + row) * 2 + 1] = sum;
                }
            }
            __syncthreads();  // before another cut's pass writes Mx
        }
    }
    // A block whose rows all take a cut with no tile in this split ran no tile: its Q copy must
    // land before the block's shared memory goes to another.
    cp_async_wait<0>();
}

// The merge of a row block's splits, by the last of its blocks to finish (flash_decode): rows r0 ..
// r0 + BR - 1 (those below R) of KV head bh, each over the splits that hold its keys, as
// attn_merge_group (groups of GROUP splits) and then attn_merge do when `grouped`, else as
// attn_merge alone: the same operations in the same order, so the same bits, without their
// launches or a second pass over the partials (read through L2: other blocks wrote them). The
// rows' (max, sum) pairs are staged in shared memory first, all loads in flight together. Output,
// gate and their layout as attn_merge's. sm: BR·(2·S + 3·⌈S / GROUP⌉ + 1) floats.
template <typename T, int HD, int NT, int BR>
__device__ void flash_decode_merge(const float* part_o, const float* part_ml, T* __restrict__ out,
                                   const T* __restrict__ gate, long gsb, long gst, long gsh, int R, int S,
                                   int cut_div, int cut_max, int t, int L, int H, int grouped, int bh, int r0,
                                   float* sm) {
    const int G = (S + GROUP - 1) / GROUP;
    float* ML = sm;             // [S][BR][2] each split's (max, sum); the max becomes its weight
    float* Mg = ML + 2 * S * BR;  // [BR][G] each group's max, sum and final weight
    float* Lg = Mg + BR * G;
    float* Wg = Lg + BR * G;
    int* Ns = reinterpret_cast<int*>(Wg + BR * G);  // [BR] the final merge's entries
    // The splits of a row with `len` keys that hold keys (the merge kernels' `entries`, one split
    // each). The rows' lengths are L - t + 1 .. L, and a longer row can have fewer splits (its cut
    // grows): np is the most of any.
    auto parts = [&](int len) { return min(entries(len, FA_BK, S, 1, cut_div, cut_max), S); };
    auto row_len = [&](int r) { return max(L - t + r % t + 1, 0); };
    const int rows = min(BR, R - r0);
    int np = 0;
    for (int i = 0; i < min(t, rows); ++i) np = max(np, parts(row_len(r0 + i)));
    for (int i = threadIdx.x; i < np * rows * 2; i += NT) {
        const int e = i / (rows * 2), j = i % (rows * 2);
        ML[(e * BR + j / 2) * 2 + j % 2] = __ldcg(&part_ml[(((size_t)bh * S + e) * R + r0) * 2 + j]);
    }
    __syncthreads();
    auto m_at = [&](int e, int rr) -> float& { return ML[(e * BR + rr) * 2]; };
    auto l_at = [&](int e, int rr) { return ML[(e * BR + rr) * 2 + 1]; };
    if (grouped) {
        // attn_merge_group: (row, group) by a thread.
        for (int i = threadIdx.x; i < rows * G; i += NT) {
            const int rr = i / G, g = i % G;
            const int n = parts(row_len(r0 + rr)) - g * GROUP;
            if (n <= 0) continue;
            float M = -INFINITY;
            for (int e = 0; e < GROUP; ++e) M = fmaxf(M, e < n ? m_at(g * GROUP + e, rr) : -INFINITY);
            float l = 0.f;
            for (int e = 0; e < min(n, GROUP); ++e) {
                float& m = m_at(g * GROUP + e, rr);
                const float w = m == -INFINITY ? 0.f : expf(m - M);
                l += w * l_at(g * GROUP + e, rr);
                m = w;
            }
            Mg[rr * G + g] = M;
            Lg[rr * G + g] = l;
        }
        __syncthreads();
    }
    // attn_merge's weights: a row by a thread, over its groups or its splits.
    for (int rr = threadIdx.x; rr < rows; rr += NT) {
        const int len = row_len(r0 + rr);
        const int ns = grouped ? min(entries(len, FA_BK, S, GROUP, cut_div, cut_max), G) : parts(len);
        auto m_of = [&](int e) { return grouped ? Mg[rr * G + e] : m_at(e, rr); };
        auto l_of = [&](int e) { return grouped ? Lg[rr * G + e] : l_at(e, rr); };
        float M = -INFINITY;
        for (int e = 0; e < ns; ++e) M = fmaxf(M, m_of(e));
        float den = 0.f;
        for (int e = 0; e < ns; ++e) {
            const float m = m_of(e);
            den += (m == -INFINITY ? 0.f : expf(m - M)) * l_of(e);
        }
        for (int e = 0; e < ns; ++e) {
            const float m = m_of(e);
            (grouped ? Wg[rr * G + e] : m_at(e, rr)) = (m == -INFINITY ? 0.f : expf(m - M)) / den;
        }
        Ns[rr] = ns;
    }
    __syncthreads();
    // The outputs, four columns a thread: each group's sum of its splits, then the groups' (or
    // the splits' alone), gated and written token-major as attn_merge writes them.
    const int b = bh / H, Gq = R / t;
    for (int i = threadIdx.x; i < rows * (HD / 4); i += NT) {
        const int rr = i / (HD / 4), d = 4 * (i % (HD / 4)), r = r0 + rr;
        const int ns = Ns[rr];
        auto o4 = [&](int e) {
            return __ldcg(reinterpret_cast<const float4*>(&part_o[(((size_t)bh * S + e) * R + r) * HD + d]));
        };
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
        if (grouped) {
            const int n_all = parts(row_len(r));
            for (int g = 0; g < ns; ++g) {
                float4 ga = make_float4(0.f, 0.f, 0.f, 0.f);
                const int n = min(n_all - g * GROUP, GROUP);
#pragma unroll 8
                for (int e = 0; e < n; ++e) {
                    const float w = m_at(g * GROUP + e, rr);
                    const float4 o = o4(g * GROUP + e);
                    ga.x += w * o.x;
                    ga.y += w * o.y;
                    ga.z += w * o.z;
                    ga.w += w * o.w;
                }
                const float w = Wg[rr * G + g];
                acc.x += w * ga.x;
                acc.y += w * ga.y;
                acc.z += w * ga.z;
                acc.w += w * ga.w;
            }
        } else {
#pragma unroll 8
            for (int e = 0; e < ns; ++e) {
                const float w = m_at(e, rr);
                const float4 o = o4(e);
                acc.x += w * o.x;
                acc.y += w * o.y;
                acc.z += w * o.z;
                acc.w += w * o.w;
            }
        }
        const int token = r % t, head = (bh % H) * Gq + r / t;
        T* orow = out + (((size_t)b * t + token) * H * Gq + head) * HD + d;
        const T* grow = gate != nullptr ? gate + b * gsb + token * gst + head * gsh + d : nullptr;
        const float a[4] = {acc.x, acc.y, acc.z, acc.w};
#pragma unroll
        for (int x = 0; x < 4; ++x) {
            float y = a[x];
            if (grow != nullptr) y /= 1.f + expf(-to_f(grow[x]));
            orow[x] = from_f<T>(y);
        }
    }
}

// Decode / verify attention by tensor cores, its merge included: every block computes its split's
// partials (flash_decode_partial), and the last block of a row block to arrive (a counter per
// (bh, row block) in `arrivals`, zero before the launch, counted to gridDim.x / row blocks, which
// is every split's block) merges its rows' splits into `out` (flash_decode_merge). With null
// `arrivals` the blocks stop after their partials, for the merge kernels.
template <typename T, int HD, int NG>
__device__ void flash_decode(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                             const unsigned* __restrict__ len_p, float* part_o, float* part_ml, int R, int cap,
                             int t, float scale_log2, int S, int cut_div, int cut_max, const KvRows kv,
                             unsigned* __restrict__ arrivals, T* __restrict__ out, const T* __restrict__ gate,
                             long gsb, long gst, long gsh, int grouped) {
    constexpr int NT = FA_WARPS * 32 * NG, BR = 16 * NG;
    flash_decode_partial<T, HD, NG>(q, k, v, len_p, part_o, part_ml, R, cap, t, scale_log2, S, cut_div, cut_max,
                                    kv);
    if (arrivals == nullptr) return;  // the merge kernels merge
    const int zs = (R + BR - 1) / BR, z = blockIdx.x % zs, bh = blockIdx.y;
    __shared__ bool last;
    // Each thread's partials visible to the whole GPU before the block counts itself; the block
    // that counts last then sees every other block's.
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();  // the block's writes, seen by thread 0 through the barrier, before its count
        last = atomicAdd(&arrivals[bh * zs + z], 1u) == gridDim.x / zs - 1;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    extern __shared__ __align__(16) unsigned char fa_smem[];
    flash_decode_merge<T, HD, NT, BR>(part_o, part_ml, out, gate, gsb, gst, gsh, R, S, cut_div, cut_max, t,
                                      min(kv.len_of(len_p, bh), cap), kv.H, grouped, bh, BR * z,
                                      reinterpret_cast<float*>(fa_smem));
}

#define FLASH_DECODE(SUFFIX, T, HD, NG)                                                                  \
    extern "C" __global__ void __launch_bounds__(FA_WARPS * 32 * NG, NG < 3 ? 2 : 1)                      \
        flash_decode_##SUFFIX##_d##HD##_g##NG(const T* q, const T* k, const T* v, const unsigned* len,    \
                                      float* part_o, float* part_ml, int R, int cap, int t, float sl2,    \
                                      int S, int cut_div, int cut_max, const unsigned* table, int maxb,   \
                                      int bs, int nblocks, int H, unsigned* arrivals, T* out,             \
                                      const T* gate, long gsb, long gst, long gsh, int grouped) {         \
        pdl_enter();                                                                                      \
        flash_decode<T, HD, NG>(q, k, v, len, part_o, part_ml, R, cap, t, sl2, S, cut_div, cut_max,       \
                                KvRows{table, maxb, bs, nblocks, H}, arrivals, out, gate, gsb, gst, gsh,  \
                                grouped);                                                                 \
    }
#define FLASH_DECODE_GROUPS(SUFFIX, T, HD) \
    FLASH_DECODE(SUFFIX, T, HD, 1)         \
    FLASH_DECODE(SUFFIX, T, HD, 2)         \
    FLASH_DECODE(SUFFIX, T, HD, 3)
#define FLASH_DECODE_DIMS(SUFFIX, T)  \
    FLASH_DECODE_GROUPS(SUFFIX, T, 64)  \
    FLASH_DECODE_GROUPS(SUFFIX, T, 128) \
    FLASH_DECODE_GROUPS(SUFFIX, T, 256)
FLASH_DECODE_DIMS(bf16, __nv_bfloat16)
FLASH_DECODE_DIMS(f16, __half)

// A step's new keys and values into the cache buffers, at positions read from device memory (so a
// recorded graph replays at any position), the CUDA twin of `write_kv` and `write_kv_rows` in
// src/attention/: row (b, h, i) of k and v (rows of D contiguous elements at b·sb + h·sh + i·st,
// k and v each with their own strides) goes to position pos[i] of kc, vc, whose rows of D sit at
// b·csb + h·csh + position·csp ([B, H, cap, D] caches, or a [cap, H, D] pool with B = 1). A
// position past the buffer is skipped. Grid (t, H, B); the element type only matters by its size
// (a plain copy).
template <typename T>
__device__ void kv_write(const T* __restrict__ k, const T* __restrict__ v, long ksb, long ksh, long kst,
                         long vsb, long vsh, long vst, const unsigned* __restrict__ pos, T* __restrict__ kc,
                         T* __restrict__ vc, long csb, long csh, long csp, int cap, int D) {
    const int i = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const unsigned p = pos[i];
    if (p >= (unsigned)cap) return;
    const T* kr = k + b * ksb + h * ksh + i * kst;
    const T* vr = v + b * vsb + h * vsh + i * vst;
    const size_t row = b * csb + h * csh + (long)p * csp;
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        kc[row + d] = kr[d];
        vc[row + d] = vr[d];
    }
}

#define KV_WRITE_KERNEL(BYTES, T)                                                                    \
    extern "C" __global__ void kv_write_b##BYTES(const T* k, const T* v, long ksb, long ksh, long kst, \
                                                 long vsb, long vsh, long vst, const unsigned* pos,    \
                                                 T* kc, T* vc, long csb, long csh, long csp, int cap,  \
                                                 int D) {                                              \
        pdl_enter();                                                                                   \
        kv_write<T>(k, v, ksb, ksh, kst, vsb, vsh, vst, pos, kc, vc, csb, csh, csp, cap, D);           \
    }
KV_WRITE_KERNEL(2, unsigned short)
KV_WRITE_KERNEL(4, unsigned int)
