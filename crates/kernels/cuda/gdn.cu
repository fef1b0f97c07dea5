// CUDA twins of the GDN reference ops in src/{delta_rule,conv1d,gating}.rs.
// Every kernel computes in f32; inputs may be f32, bf16 or f16. Built to PTX by build.rs.
#include "common.cuh"

// torch's softplus (threshold 20).
__device__ __forceinline__ float softplus(float x) { return x > 20.f ? x : log1pf(expf(x)); }

constexpr int BV = 32;  // state columns per block (one per lane)
constexpr int NW = 4;   // warps per block; warp w holds rows w, w+NW, ...
constexpr int MAXDK = 256;

// Gated delta rule, one token at a time (decode, speculative verify, and prefill until the chunked
// kernel lands). Block = (batch b, value head hv, tile of BV state columns); thread (w, lane) keeps
// column j = tile*BV + lane of rows r = w + NW*i (i < ROWS) in registers.
//   S <- exp(g) S;  delta = beta (v - S^T k);  S <- S + k delta^T;  o = S^T (scale q)
// FUSED: q, k are raw (L2-normalised here, eps), ga/gb are the a/b projections (g and beta computed
// here from a_log, dt_bias); otherwise q, k are normalised and ga = g, gb = beta.
// q/k/v rows: token row `bt` (= b*T + t) starts at bt*stride; head h at h*dk (q, k) or h*dv (v).
template <typename TQ, typename TG, bool FUSED, int ROWS>
__device__ void gdn_recurrent(const TQ* __restrict__ q, const TQ* __restrict__ k, const TQ* __restrict__ v,
                              long qk_stride, long v_stride, const TG* __restrict__ ga, const TG* __restrict__ gb,
                              const float* __restrict__ a_log, const float* __restrict__ dt_bias,
                              const float* __restrict__ s0, float* __restrict__ out, float* __restrict__ s_final,
                              float* __restrict__ s_all, int T, int Hk, int Hv, int dk, int dv, float scale,
                              float eps) {
    const int tiles = (dv + BV - 1) / BV;
    const int bh = blockIdx.x / tiles, tile = blockIdx.x % tiles;
    const int b = bh / Hv, hv = bh % Hv, hk = hv / (Hv / Hk);
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int j = tile * BV + lane;
    const bool col_ok = j < dv;
    __shared__ float sq[MAXDK], sk[MAXDK];
    __shared__ float red[NW][BV];
    __shared__ float nrm[2][NW];
    __shared__ float gate[2];

    float s[ROWS];
    const long head = (long)(b * Hv + hv) * dk * dv;
#pragma unroll
    for (int i = 0; i < ROWS; i++) {
        const int r = w + NW * i;
        s[i] = (s0 != nullptr && col_ok && r < dk) ? s0[head + (long)r * dv + j] : 0.f;
    }
    for (int t = 0; t < T; t++) {
        const long bt = (long)b * T + t;
        for (int r = threadIdx.x; r < dk; r += blockDim.x) {
            sq[r] = to_f(q[bt * qk_stride + hk * dk + r]);
            sk[r] = to_f(k[bt * qk_stride + hk * dk + r]);
        }
        __syncthreads();
        float iq = scale, ik = 1.f;
        if (FUSED) {
            float pq = 0.f, pk = 0.f;
            for (int r = threadIdx.x; r < dk; r += blockDim.x) {
                pq += sq[r] * sq[r];
                pk += sk[r] * sk[r];
            }
            pq = warp_sum(pq);
            pk = warp_sum(pk);
            if (lane == 0) {
                nrm[0][w] = pq;
                nrm[1][w] = pk;
            }
            if (threadIdx.x == 0) {
                const float a = to_f(ga[bt * Hv + hv]), bb = to_f(gb[bt * Hv + hv]);
                gate[0] = -expf(a_log[hv]) * softplus(a + dt_bias[hv]);
                gate[1] = 1.f / (1.f + expf(-bb));
            }
            __syncthreads();
            float nq = 0.f, nk = 0.f;
#pragma unroll
            for (int x = 0; x < NW; x++) {
                nq += nrm[0][x];
                nk += nrm[1][x];
            }
            iq = scale / sqrtf(nq + eps);
            ik = 1.f / sqrtf(nk + eps);
        } else {
            if (threadIdx.x == 0) {
                gate[0] = to_f(ga[bt * Hv + hv]);
                gate[1] = to_f(gb[bt * Hv + hv]);
            }
            __syncthreads();
        }
        const float decay = expf(gate[0]), beta = gate[1];
        float m = 0.f;
#pragma unroll
        for (int i = 0; i < ROWS; i++) {
            const int r = w + NW * i;
            if (r < dk) {
                s[i] *= decay;
                m += s[i] * (sk[r] * ik);
            }
        }
        red[w][lane] = m;
        __syncthreads();
        float mt = 0.f;
#pragma unroll
        for (int x = 0; x < NW; x++) mt += red[x][lane];
        const float vj = col_ok ? to_f(v[bt * v_stride + (long)hv * dv + j]) : 0.f;
        const float delta = beta * (vj - mt);
        float o = 0.f;
#pragma unroll
        for (int i = 0; i < ROWS; i++) {
            const int r = w + NW * i;
            if (r < dk) {
                s[i] += (sk[r] * ik) * delta;
                o += s[i] * (sq[r] * iq);
            }
        }
        __syncthreads();  // everyone has read red[] for m
        red[w][lane] = o;
        __syncthreads();
        if (w == 0 && col_ok) {
            float ot = 0.f;
#pragma unroll
            for (int x = 0; x < NW; x++) ot += red[x][lane];
            out[(bt * Hv + hv) * dv + j] = ot;
        }
        if (s_all != nullptr && col_ok) {
            const long base = (bt * Hv + hv) * (long)dk * dv;
#pragma unroll
            for (int i = 0; i < ROWS; i++) {
                const int r = w + NW * i;
                if (r < dk) s_all[base + (long)r * dv + j] = s[i];
            }
        }
        __syncthreads();  // before the next token overwrites sq, sk, red, gate
    }
    if (col_ok) {
#pragma unroll
        for (int i = 0; i < ROWS; i++) {
            const int r = w + NW * i;
            if (r < dk) s_final[head + (long)r * dv + j] = s[i];
        }
    }
}

#define GDN_KERNEL(NAME, TQ, TG, FUSED, ROWS)                                                                  \
    extern "C" __global__ void __launch_bounds__(NW * 32)                                                      \
        NAME(const TQ* q, const TQ* k, const TQ* v, long qk_stride, long v_stride, const TG* ga, const TG* gb, \
             const float* a_log, const float* dt_bias, const float* s0, float* out, float* s_final,          \
             float* s_all, int T, int Hk, int Hv, int dk, int dv, float scale, float eps) {                   \
        gdn_recurrent<TQ, TG, FUSED, ROWS>(q, k, v, qk_stride, v_stride, ga, gb, a_log, dt_bias, s0, out,     \
                                           s_final, s_all, T, Hk, Hv, dk, dv, scale, eps);                    \
    }

#define GDN_ROWS(NAME, TQ, TG, FUSED) \
    GDN_KERNEL(NAME##_r2, TQ, TG, FUSED, 2)  \
    GDN_KERNEL(NAME##_r4, TQ, TG, FUSED, 4)  \
    GDN_KERNEL(NAME##_r8, TQ, TG, FUSED, 8)  \
    GDN_KERNEL(NAME##_r16, TQ, TG, FUSED, 16) \
    GDN_KERNEL(NAME##_r32, TQ, TG, FUSED, 32) \
    GDN_KERNEL(NAME##_r64, TQ, TG, FUSED, 64)

// Unfused: normalised f32 q/k/v, f32 g/beta (the reference op's signature).
GDN_ROWS(gdn_recurrent_f32, float, float, false)
// Fused gating + L2 norm: q/k/v and a/b in the activation dtype.
GDN_ROWS(gdn_fused_f32, float, float, true)
GDN_ROWS(gdn_fused_bf16, __nv_bfloat16, __nv_bfloat16, true)
GDN_ROWS(gdn_fused_f16, __half, __half, true)

// Causal depthwise conv1d + SiLU, one thread per output element (b, t, c): fully parallel over
// time. The window of token t is concat(state, x)[t .. t+K) where concat = [K-1 state | T inputs];
// state positions before a fresh sequence are zero (st == null). x: [B, T, C]; w: [C, K];
// st: [B, C, K-1]; y: [B, T, C]; st_out: [B, C, K-1] = the last K-1 entries of concat.
template <typename T>
__device__ __forceinline__ float conv_in(const T* x, const T* st, int b, int i, int c, int Tn, int C, int H) {
    // concat index i: state for i < H, else x[t = i - H]
    if (i < H) return st != nullptr ? to_f(st[((long)b * C + c) * H + i]) : 0.f;
    return to_f(x[((long)b * Tn + (i - H)) * C + c]);
}

template <typename T>
__device__ void conv1d(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ st,
                       T* __restrict__ y, T* __restrict__ st_out, int B, int Tn, int C, int K) {
    const long idx = (long)blockIdx.x * blockDim.x + threadIdx.x;
    const int H = K - 1;
    const long n_y = (long)B * Tn * C;
    if (idx < n_y) {
        const int c = idx % C;
        const long bt = idx / C;
        const int t = bt % Tn, b = bt / Tn;
        float acc = 0.f;
        for (int j = 0; j < K; j++) acc += to_f(w[(long)c * K + j]) * conv_in(x, st, b, t + j, c, Tn, C, H);
        y[idx] = from_f<T>(acc / (1.f + expf(-acc)));
    } else if (idx < n_y + (long)B * C * H) {
        const long r = idx - n_y;  // (b, c, j) in st_out
        const int j = r % H;
        const long bc = r / H;
        const int c = bc % C, b = bc / C;
        st_out[r] = from_f<T>(conv_in(x, st, b, Tn + j, c, Tn, C, H));
    }
}

#define CONV_KERNEL(NAME, T)                                                                                  \
    extern "C" __global__ void NAME(const T* x, const T* w, const T* st, T* y, T* st_out, int B, int Tn, int C, \
                                    int K) {                                                                 \
        conv1d<T>(x, w, st, y, st_out, B, Tn, C, K);                                                         \
    }
CONV_KERNEL(conv1d_f32, float)
CONV_KERNEL(conv1d_bf16, __nv_bfloat16)
CONV_KERNEL(conv1d_f16, __half)

// ---------------------------------------------------------------------------------------------
// Chunked (WY / UT transform) gated delta rule for prefill, chunk C = 64, dk <= 128.
// Kernel 1 (`gdn_chunk_prep`, one block of 256 threads per (b, hv, chunk)) turns a chunk into
//   U  = (I + A)^-1 diag(beta) V           [C, dv]     ("new values")
//   W  = (I + A)^-1 diag(beta e^gamma) K   [C, dk]
//   Qt = scale e^gamma_r q_r               [C, dk]     (reads the chunk-entry state)
//   Kt = e^(gamma_L - gamma_s) k_s          [C, dk]     (writes the exit state)
//   P  = scale e^(gamma_r - gamma_s) q_r.k_s, s <= r   [C, C]
//   gL = e^gamma_L
// with A_rs = beta_r e^(gamma_r - gamma_s) k_r.k_s (s < r), q and k L2-normalised; rows past the
// sequence end are zero. Kernel 2 (`gdn_chunk_scan`, one block per (b, hv, 32 state columns), the
// state in registers like the recurrent kernel) walks the chunks in order:
//   Vt = U - W S;  o = Qt S + P Vt;  S = gL S + Kt^T Vt.
constexpr int CH = 64;
constexpr int CHUNK_DK = 128;

// Strictly-lower-triangular index of (r, s), s < r.
__device__ __forceinline__ int tri(int r, int s) { return r * (r - 1) / 2 + s; }

template <typename TQ, typename TG, bool FUSED>
__device__ void gdn_chunk_prep(const TQ* __restrict__ q, const TQ* __restrict__ k, const TQ* __restrict__ v,
                               long qk_stride, long v_stride, const TG* __restrict__ ga, const TG* __restrict__ gb,
                               const float* __restrict__ a_log, const float* __restrict__ dt_bias,
                               float* __restrict__ U, float* __restrict__ W, float* __restrict__ Qt,
                               float* __restrict__ Kt, float* __restrict__ P, float* __restrict__ gL, int T,
                               int Hk, int Hv, int dk, int dv, float scale, float eps) {
    const int nc = (T + CH - 1) / CH;
    const long blk = blockIdx.x;
    const int c = blk % nc;
    const int bh = blk / nc;
    const int b = bh / Hv, hv = bh % Hv, hk = hv / (Hv / Hk);
    const int t0 = c * CH;
    const int L = min(CH, T - t0);
    const int tid = threadIdx.x, nt = blockDim.x;
    __shared__ float kn[CH][CHUNK_DK];       // normalised k rows
    __shared__ float At[CH * (CH - 1) / 2];  // strictly lower A
    __shared__ float qb[8][CHUNK_DK];        // a batch of 8 normalised, scaled q rows (48 KiB budget)
    __shared__ float gam[CH], bet[CH], inq[CH];

    // Row statistics: 4 threads per row (256 threads, 64 rows).
    {
        const int r = tid >> 2, part = tid & 3;
        float sq = 0.f, sk = 0.f;
        const long row = (long)b * T + t0 + r;
        if (r < L) {
            for (int i = part; i < dk; i += 4) {
                const float qq = to_f(q[row * qk_stride + hk * dk + i]);
                const float kk = to_f(k[row * qk_stride + hk * dk + i]);
                sq += qq * qq;
                sk += kk * kk;
            }
        }
        sq += __shfl_xor_sync(0xffffffffu, sq, 1);
        sq += __shfl_xor_sync(0xffffffffu, sq, 2);
        sk += __shfl_xor_sync(0xffffffffu, sk, 1);
        sk += __shfl_xor_sync(0xffffffffu, sk, 2);
        float ik = 1.f;
        if (part == 0) {
            float g = 0.f, be = 0.f, iq = scale;
            if (r < L) {
                if (FUSED) {
                    const float a = to_f(ga[row * Hv + hv]), bb = to_f(gb[row * Hv + hv]);
                    g = -expf(a_log[hv]) * softplus(a + dt_bias[hv]);
                    be = 1.f / (1.f + expf(-bb));
                    iq = scale / sqrtf(sq + eps);
                } else {
                    g = to_f(ga[row * Hv + hv]);
                    be = to_f(gb[row * Hv + hv]);
                }
            }
            gam[r] = g;  // cumulated below
            bet[r] = be;
            inq[r] = iq;
        }
        if (FUSED) ik = 1.f / sqrtf(sk + eps);
        for (int i = part; i < dk; i += 4)
            kn[r][i] = r < L ? to_f(k[row * qk_stride + hk * dk + i]) * ik : 0.f;
    }
    __syncthreads();
    if (tid == 0) {
        float acc = 0.f;
        for (int r = 0; r < CH; r++) {
            acc += gam[r];
            gam[r] = acc;  // rows past L add g = 0: gamma stays at gamma_L
        }
    }
    __syncthreads();
    // A (strictly lower).
    for (int p = tid; p < CH * (CH - 1) / 2; p += nt) {
        // invert tri(r, s) = p
        int r = (int)((1.f + sqrtf(1.f + 8.f * p)) * 0.5f);
        while (tri(r, 0) > p) r--;
        while (tri(r + 1, 0) <= p) r++;
        const int s = p - tri(r, 0);
        float dot = 0.f;
        if (r < L)
            for (int i = 0; i < dk; i++) dot += kn[r][i] * kn[s][i];
        At[p] = r < L ? bet[r] * expf(gam[r] - gam[s]) * dot : 0.f;
    }
    const long base = blk * CH;
    // P and Qt, 8 q rows at a time.
    for (int r0 = 0; r0 < CH; r0 += 8) {
        __syncthreads();
        for (int e = tid; e < 8 * dk; e += nt) {
            const int rr = e / dk, i = e % dk, r = r0 + rr;
            const long row = (long)b * T + t0 + r;
            const float val = r < L ? to_f(q[row * qk_stride + hk * dk + i]) * inq[r] : 0.f;
            qb[rr][i] = val;
            Qt[(base + r) * dk + i] = val * expf(gam[r]);
        }
        __syncthreads();
        for (int e = tid; e < 8 * CH; e += nt) {
            const int rr = e / CH, s = e % CH, r = r0 + rr;
            float dot = 0.f;
            if (s <= r && r < L)
                for (int i = 0; i < dk; i++) dot += qb[rr][i] * kn[s][i];
            P[(base + r) * CH + s] = (s <= r && r < L) ? expf(gam[r] - gam[s]) * dot : 0.f;
        }
    }
    __syncthreads();
    // Forward substitution, one column of [U | W] per thread, 64 rows in registers.
    const float gl = gam[L - 1];
    for (int j = tid; j < dv + dk; j += nt) {
        float x[CH];
#pragma unroll
        for (int r = 0; r < CH; r++) {
            float rhs = 0.f;
            if (r < L) {
                if (j < dv) {
                    const long row = (long)b * T + t0 + r;
                    rhs = bet[r] * to_f(v[row * v_stride + (long)hv * dv + j]);
                } else {
                    rhs = bet[r] * expf(gam[r]) * kn[r][j - dv];
                }
            }
#pragma unroll
            for (int s = 0; s < r; s++) rhs -= At[tri(r, s)] * x[s];
            x[r] = rhs;
        }
        if (j < dv) {
#pragma unroll
            for (int r = 0; r < CH; r++) U[(base + r) * dv + j] = x[r];
        } else {
            const int i = j - dv;
#pragma unroll
            for (int r = 0; r < CH; r++) {
                W[(base + r) * dk + i] = x[r];
                Kt[(base + r) * dk + i] = r < L ? kn[r][i] * expf(gl - gam[r]) : 0.f;
            }
        }
    }
    if (tid == 0) gL[blk] = expf(gl);
}

#define CHUNK_PREP(NAME, TQ, TG, FUSED)                                                                       \
    extern "C" __global__ void __launch_bounds__(256)                                                         \
        NAME(const TQ* q, const TQ* k, const TQ* v, long qk_stride, long v_stride, const TG* ga, const TG* gb,  \
             const float* a_log, const float* dt_bias, float* U, float* W, float* Qt, float* Kt, float* P,    \
             float* gL, int T, int Hk, int Hv, int dk, int dv, float scale, float eps) {                       \
        gdn_chunk_prep<TQ, TG, FUSED>(q, k, v, qk_stride, v_stride, ga, gb, a_log, dt_bias, U, W, Qt, Kt, P,  \
                                      gL, T, Hk, Hv, dk, dv, scale, eps);                                      \
    }
CHUNK_PREP(gdn_chunk_prep_f32, float, float, false)
// Fused variants (raw q/k and a/b, like gdn_fused_*) are one line each once the scan is fast
// enough for the model to use the chunked path: CHUNK_PREP(gdn_chunk_prep_fused_bf16, ...).

template <int ROWS>
__device__ void gdn_chunk_scan(const float* __restrict__ U, const float* __restrict__ W,
                               const float* __restrict__ Qt, const float* __restrict__ Kt,
                               const float* __restrict__ P, const float* __restrict__ gL,
                               const float* __restrict__ s0, float* __restrict__ out,
                               float* __restrict__ s_final, int B, int T, int Hv, int dk, int dv) {
    const int nc = (T + CH - 1) / CH;
    const int tiles = (dv + BV - 1) / BV;
    const int bh = blockIdx.x / tiles, tile = blockIdx.x % tiles;
    const int b = bh / Hv, hv = bh % Hv;
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int j = tile * BV + lane;
    const bool col_ok = j < dv;
    __shared__ float red[CH][NW][BV];
    __shared__ float vt[CH][BV];
    float s[ROWS];
    const long head = (long)bh * dk * dv;
#pragma unroll
    for (int i = 0; i < ROWS; i++) {
        const int r = w + NW * i;
        s[i] = (s0 != nullptr && col_ok && r < dk) ? s0[head + (long)r * dv + j] : 0.f;
    }
    for (int c = 0; c < nc; c++) {
        const long blk = (long)bh * nc + c;
        const long base = blk * CH;
        const int L = min(CH, T - c * CH);
        // Vt = U - W S
        for (int r = 0; r < CH; r++) {
            float p = 0.f;
#pragma unroll
            for (int i = 0; i < ROWS; i++) {
                const int row = w + NW * i;
                if (row < dk) p += W[(base + r) * dk + row] * s[i];
            }
            red[r][w][lane] = p;
        }
        __syncthreads();
        for (int r = w; r < CH; r += NW) {
            float tot = 0.f;
#pragma unroll
            for (int x = 0; x < NW; x++) tot += red[r][x][lane];
            vt[r][lane] = col_ok ? U[(base + r) * dv + j] - tot : 0.f;
        }
        __syncthreads();
        // o = Qt S + P Vt
        for (int r = 0; r < CH; r++) {
            float p = 0.f;
#pragma unroll
            for (int i = 0; i < ROWS; i++) {
                const int row = w + NW * i;
                if (row < dk) p += Qt[(base + r) * dk + row] * s[i];
            }
            red[r][w][lane] = p;
        }
        __syncthreads();
        for (int r = w; r < L; r += NW) {
            float o = 0.f;
#pragma unroll
            for (int x = 0; x < NW; x++) o += red[r][x][lane];
            for (int s2 = 0; s2 <= r; s2++) o += P[(base + r) * CH + s2] * vt[s2][lane];
            if (col_ok) out[(((long)b * T + c * CH + r) * Hv + hv) * dv + j] = o;
        }
        // S = gL S + Kt^T Vt
        const float g = gL[blk];
#pragma unroll
        for (int i = 0; i < ROWS; i++) {
            const int row = w + NW * i;
            if (row < dk) {
                float acc = g * s[i];
                for (int s2 = 0; s2 < L; s2++) acc += Kt[(base + s2) * dk + row] * vt[s2][lane];
                s[i] = acc;
            }
        }
        __syncthreads();  // red and vt are rewritten by the next chunk
    }
    if (col_ok) {
#pragma unroll
        for (int i = 0; i < ROWS; i++) {
            const int r = w + NW * i;
            if (r < dk) s_final[head + (long)r * dv + j] = s[i];
        }
    }
}

#define CHUNK_SCAN(NAME, ROWS)                                                                                \
    extern "C" __global__ void __launch_bounds__(NW * 32)                                                     \
        NAME(const float* U, const float* W, const float* Qt, const float* Kt, const float* P,               \
             const float* gL, const float* s0, float* out, float* s_final, int B, int T, int Hv, int dk,      \
             int dv) {                                                                                        \
        gdn_chunk_scan<ROWS>(U, W, Qt, Kt, P, gL, s0, out, s_final, B, T, Hv, dk, dv);                        \
    }
CHUNK_SCAN(gdn_chunk_scan_r2, 2)
CHUNK_SCAN(gdn_chunk_scan_r4, 4)
CHUNK_SCAN(gdn_chunk_scan_r8, 8)
CHUNK_SCAN(gdn_chunk_scan_r16, 16)
CHUNK_SCAN(gdn_chunk_scan_r32, 32)
