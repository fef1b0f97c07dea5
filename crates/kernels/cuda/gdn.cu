// CUDA twins of the GDN reference ops in src/{delta_rule,conv1d,gating}.rs.
// Every kernel computes in f32; inputs may be f32, bf16 or f16. Built to PTX by build.rs.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16(x); }
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half(x); }

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

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
