// CUDA twins of the GDN reference ops in src/{delta_rule,conv1d}/ and src/gating.rs.
// Every kernel computes in f32; inputs may be f32, bf16 or f16. Built to PTX by build.rs.
#include "common.cuh"
#include "mma.cuh"

// torch's softplus (threshold 20).
__device__ __forceinline__ float softplus(float x) { return x > 20.f ? x : log1pf(expf(x)); }

constexpr int BV = GDN_BV;  // state columns per block
constexpr int NW = GDN_WARPS;  // warps per block
constexpr int MAXDK = GDN_MAX_DK;

// Tokens staged in shared memory at a time by the recurrent kernel.
constexpr int TB = 8;

// Gated delta rule, one token at a time (decode, speculative verify, and prefill until the chunked
// kernel lands). Block = (batch b, value head hv, tile of BV state columns); thread t keeps
// columns CPT·(t / RG) .. + CPT - 1 of the tile, rows r = t % RG + RG·i (i < ROWS), in registers:
// each staged k and q element it reads from shared memory serves its CPT columns, and a token's
// sums over a column's rows are a butterfly of shuffles within half a warp, with no barrier in the
// token loop (at the 27B shape on an H100, 16 sequences: a 6-token verify 104 -> 77 µs, a decode
// step 48 -> 44 µs against one column a thread and 4 row groups, docs/BENCHMARKS.md §7).
//   S <- exp(g) S;  delta = beta (v - S^T k);  S <- S + k delta^T;  o = S^T (scale q)
// FUSED: q, k are raw (L2-normalised here, eps), ga/gb are the a/b projections (g and beta computed
// here from a_log, dt_bias); otherwise q, k are normalised and ga = g, gb = beta.
// q/k/v rows: token row `bt` (= b*T + t) starts at bt*stride; head h at h*dk (q, k) or h*dv (v);
// ga/gb rows (Hv values each) start at bt*g_stride. With `slots` ([B] u32, a pool of `pool`
// states) sequence b's state is row slots[b] of s0 / s_final: a batch over a state pool, in place.
// The inputs of up to TB tokens (q, k, this tile's v, gates, norms) are staged in shared memory
// before their loop, so a token's step waits on no global load: a verify pass of T tokens costs
// about one load latency, not T.
// Asks L2 for the block's state tile (row r of its BV columns: one 128-byte line per thread)
// before the kernel waits for the previous one: the state was written a whole step ago, and a
// prefetch into L2 (the point of coherence) cannot observe a stale copy, so it is safe before the
// wait, and the loads after it hit L2 instead of DRAM.
__device__ __forceinline__ void gdn_prefetch_state(const float* state, int Hv, int dk, int dv, int sb) {
    const int tiles = (dv + BV - 1) / BV;
    const int hv = (blockIdx.x / tiles) % Hv, tile = blockIdx.x % tiles;
    for (int r = threadIdx.x; state != nullptr && sb >= 0 && r < dk; r += blockDim.x)
        prefetch_l2(state + (((long)sb * Hv + hv) * dk + r) * dv + tile * BV);
}

// The state row of sequence b: b itself, or with a slot table (a pool of `pool` states) slots[b];
// -1 for a slot outside the pool (the sequence then runs from a zero state and keeps nothing).
__device__ __forceinline__ int state_slot(const unsigned* slots, int pool, int b) {
    if (slots == nullptr) return b;
    const unsigned s = slots[b];
    return s < (unsigned)pool ? (int)s : -1;
}

// Deferred commits (a pool's speculative verifies, `stash` non-null): a verify leaves each
// sequence's state as it was before its tokens and keeps, per block and token, what the update
// reads (the normalised k row, this tile's v, decay and beta: a record of dk + BV + 2 floats) in
// the block's own rows of `stash` ([pool, tmax, Hv·tiles, dk + BV + 2]); once the sequence's
// accepted count is known, the next pass over its slot first applies that many records
// (`replay[b]`), with the same arithmetic as the pass that made them, so the state after them is
// the one the accepted tokens left, bit for bit. With `stash_new` the pass keeps its own tokens
// so (a verify: the state is written once, after the replayed records, and not after its own
// tokens); otherwise it writes the state after all of them (a decode step, or T = 0: a replay
// alone). Each block reads and writes only its own records: record j is read at combined token j
// (< P) and rewritten at P + j, never earlier, so the reads of a pass see the previous pass's.
constexpr int CPT = 4;                  // state columns per thread
constexpr int RG = NW * 32 * CPT / BV;  // row groups: the threads of a column group
static_assert(BV == 32 && RG == 16, "a tile's 8 column groups of 16 row groups: half a warp each");
template <typename TQ, typename TG, bool FUSED, int ROWS>
__device__ void gdn_recurrent(const TQ* __restrict__ q, const TQ* __restrict__ k, const TQ* __restrict__ v,
                              long qk_stride, long v_stride, const TG* __restrict__ ga, const TG* __restrict__ gb,
                              long g_stride,
                              const float* __restrict__ a_log, const float* __restrict__ dt_bias,
                              const float* s0, float* __restrict__ out, float* s_final,
                              float* __restrict__ s_all, int in_place, int T, int Hk, int Hv, int dk, int dv,
                              float scale, float eps, int sb, const unsigned* __restrict__ replay,
                              float* __restrict__ stash, int tmax, int stash_new) {
    const int tiles = (dv + BV - 1) / BV;
    const int bh = blockIdx.x / tiles, tile = blockIdx.x % tiles;
    const int b = bh / Hv, hv = bh % Hv, hk = hv / (Hv / Hk);
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    // This thread's column group c of the tile (columns CPT·c ..) and row group g (rows g + RG·i).
    const int c = threadIdx.x / RG, g = threadIdx.x % RG;
    const int j0 = tile * BV + c * CPT;
    // Staged q and k rows are scaled once staged (L2 norm, attention scale), v is this tile's.
    __shared__ float sq[TB][MAXDK], sk[TB][MAXDK], sv[TB][BV];
    // Per staged token: decay exp(g), beta, and the q and k scales (L2 norm, attention scale).
    __shared__ float coef[TB][4];

    float s[ROWS][CPT];
    // The state's row: sb (the sequence's slot; -1: none, start from zeros and keep nothing).
    const long head = (long)(max(sb, 0) * Hv + hv) * dk * dv;
    // In place: the state starts in s_final. Each thread reads and later writes only its own
    // elements, so the buffers may alias (hence no __restrict__ on s0 and s_final).
    const float* init = in_place ? s_final : s0;
    // Four whole columns in 16-byte vectors where the rows keep them aligned.
    const bool vec = dv % 4 == 0 && j0 + 3 < dv &&
                     ((reinterpret_cast<uintptr_t>(init) | reinterpret_cast<uintptr_t>(s_final) |
                       reinterpret_cast<uintptr_t>(s_all)) & 15) == 0;
#pragma unroll
    for (int i = 0; i < ROWS; i++) {
        const int r = g + RG * i;
        if (vec) {
            const float4 v4 = (init != nullptr && sb >= 0 && r < dk)
                                  ? *reinterpret_cast<const float4*>(init + head + (long)r * dv + j0)
                                  : make_float4(0.f, 0.f, 0.f, 0.f);
            s[i][0] = v4.x, s[i][1] = v4.y, s[i][2] = v4.z, s[i][3] = v4.w;
            continue;
        }
#pragma unroll
        for (int x = 0; x < CPT; x++)
            s[i][x] = (init != nullptr && sb >= 0 && j0 + x < dv && r < dk) ? init[head + (long)r * dv + j0 + x] : 0.f;
    }
    // Deferred commits: P stashed tokens run first (no outputs), then the T new ones.
    const bool deferred = stash != nullptr && sb >= 0;
    const int P = deferred && replay != nullptr ? (int)replay[b] : 0;
    const int rec = dk + BV + 2;
    // Record t of this block: the slot's token t, this (value head, tile).
    auto record = [&](int t) { return stash + (((long)sb * tmax + t) * Hv * tiles + hv * tiles + tile) * rec; };
    // This thread's state elements into the [dk, dv] state at `dst`.
    auto store_state = [&](float* dst) {
#pragma unroll
        for (int i = 0; i < ROWS; i++) {
            const int r = g + RG * i;
            if (vec) {
                if (r < dk)
                    *reinterpret_cast<float4*>(dst + (long)r * dv + j0) = make_float4(s[i][0], s[i][1], s[i][2], s[i][3]);
                continue;
            }
#pragma unroll
            for (int x = 0; x < CPT; x++)
                if (r < dk && j0 + x < dv) dst[(long)r * dv + j0 + x] = s[i][x];
        }
    };
    auto write_state = [&]() {
        if (sb >= 0) store_state(s_final + head);
    };
    // The sums over the 16 row groups (lanes xor 8, 4, 2, 1) of each of the thread's four
    // columns' partials p: a butterfly that halves the columns each lane carries at its first two
    // levels, so lane g ends with column mine = 2·bit3(g) + bit2(g), the same bits in the four
    // lanes that hold it (each level adds two values that both lanes add, in either order). Every
    // lane of the warp takes part.
    const int mine = 2 * ((g >> 3) & 1) + ((g >> 2) & 1);
    auto column_sums = [&](const float (&p)[CPT]) {
        const bool hi = g & 8, mid = g & 4;
        const float a0 = __shfl_xor_sync(0xffffffffu, hi ? p[0] : p[2], 8);
        const float a1 = __shfl_xor_sync(0xffffffffu, hi ? p[1] : p[3], 8);
        const float k0 = (hi ? p[2] : p[0]) + a0, k1 = (hi ? p[3] : p[1]) + a1;
        float z = (mid ? k1 : k0) + __shfl_xor_sync(0xffffffffu, mid ? k0 : k1, 4);
        z += __shfl_xor_sync(0xffffffffu, z, 2);
        z += __shfl_xor_sync(0xffffffffu, z, 1);
        return z;
    };
    // Of a column_sums result z: the four columns' sums in column order, gathered from the lanes
    // that hold the others.
    auto all_columns = [&](float z, float (&sums)[CPT]) {
        const float z4 = __shfl_xor_sync(0xffffffffu, z, 4), z8 = __shfl_xor_sync(0xffffffffu, z, 8),
                    z12 = __shfl_xor_sync(0xffffffffu, z, 12);
#pragma unroll
        for (int x = 0; x < CPT; x++) {  // selects, not an indexed (local-memory) store
            const int d = x ^ mine;
            sums[x] = d == 0 ? z : d == 1 ? z4 : d == 2 ? z8 : z12;
        }
    };
    const int total = P + T;
    // One group of nt staged tokens from combined token t0 (all replayed or all new).
    auto group = [&](int t0, int nt) {
        // Staged token tt is combined token t0 + tt: a stashed record below P, else new token
        // t0 + tt - P (row b*T + that).
        for (int e = threadIdx.x; e < nt * dk; e += blockDim.x) {
            const int tt = e / dk, r = e % dk, gt = t0 + tt;
            if (gt < P) {
                sq[tt][r] = 0.f;
                sk[tt][r] = record(gt)[r];
            } else {
                const long bt = (long)b * T + gt - P;
                sq[tt][r] = to_f(q[bt * qk_stride + hk * dk + r]);
                sk[tt][r] = to_f(k[bt * qk_stride + hk * dk + r]);
            }
        }
        for (int e = threadIdx.x; e < nt * BV; e += blockDim.x) {
            const int tt = e / BV, jj = tile * BV + e % BV, gt = t0 + tt;
            if (gt < P)
                sv[tt][e % BV] = record(gt)[dk + e % BV];
            else
                sv[tt][e % BV] = jj < dv ? to_f(v[((long)b * T + gt - P) * v_stride + (long)hv * dv + jj]) : 0.f;
        }
        if (threadIdx.x < nt) {
            const int gt = t0 + threadIdx.x;
            if (gt < P) {
                coef[threadIdx.x][0] = record(gt)[dk + BV];
                coef[threadIdx.x][1] = record(gt)[dk + BV + 1];
            } else {
                const long bt = (long)b * T + gt - P;
                const float a = to_f(ga[bt * g_stride + hv]), bb = to_f(gb[bt * g_stride + hv]);
                coef[threadIdx.x][0] = FUSED ? expf(-expf(a_log[hv]) * softplus(a + dt_bias[hv])) : expf(a);
                coef[threadIdx.x][1] = FUSED ? 1.f / (1.f + expf(-bb)) : bb;
            }
        }
        __syncthreads();
        // Warp w finds the q and k scales of tokens w, w + NW, ... (a record's k is normalised).
        for (int tt = w; tt < nt; tt += NW) {
            const bool stashed = t0 + tt < P;
            float pq = 0.f, pk = 0.f;
            if (FUSED && !stashed) {
                for (int r = lane; r < dk; r += 32) {
                    pq += sq[tt][r] * sq[tt][r];
                    pk += sk[tt][r] * sk[tt][r];
                }
                pq = warp_sum(pq);
                pk = warp_sum(pk);
            }
            if (lane == 0) {
                coef[tt][2] = FUSED && !stashed ? scale / sqrtf(pq + eps) : scale;
                coef[tt][3] = FUSED && !stashed ? 1.f / sqrtf(pk + eps) : 1.f;
            }
        }
        __syncthreads();
        // The staged rows scaled once, for every thread's products below.
        for (int e = threadIdx.x; e < nt * dk; e += blockDim.x) {
            const int tt = e / dk, r = e % dk;
            sq[tt][r] *= coef[tt][2];
            sk[tt][r] *= coef[tt][3];
        }
        __syncthreads();
        // A verify keeps its new tokens' records (after this group's reads of older ones).
        if (deferred && stash_new) {
            for (int e = threadIdx.x; e < nt * rec; e += blockDim.x) {
                const int tt = e / rec, x = e % rec, gt = t0 + tt;
                if (gt < P) continue;
                float val;
                if (x < dk)
                    val = sk[tt][x];
                else if (x < dk + BV)
                    val = sv[tt][x - dk];
                else
                    val = coef[tt][x - dk - BV == 0 ? 0 : 1];
                record(gt - P)[x] = val;
            }
        }
        for (int tt = 0; tt < nt; tt++) {
            const int gt = t0 + tt;
            const float decay = coef[tt][0], beta = coef[tt][1];
            float m[CPT];
#pragma unroll
            for (int x = 0; x < CPT; x++) m[x] = 0.f;
#pragma unroll
            for (int i = 0; i < ROWS; i++) {
                const int r = g + RG * i;
                if (r < dk) {
                    const float kr = sk[tt][r];
#pragma unroll
                    for (int x = 0; x < CPT; x++) {
                        s[i][x] *= decay;
                        m[x] += s[i][x] * kr;
                    }
                }
            }
            float delta[CPT];
            all_columns(column_sums(m), delta);  // S^T k, then delta in place
#pragma unroll
            for (int x = 0; x < CPT; x++) delta[x] = beta * (sv[tt][c * CPT + x] - delta[x]);
            if (gt < P) {
                // A replayed token: the state's update alone, the same operations as below.
#pragma unroll
                for (int i = 0; i < ROWS; i++) {
                    const int r = g + RG * i;
                    if (r < dk) {
                        const float kr = sk[tt][r];
#pragma unroll
                        for (int x = 0; x < CPT; x++) s[i][x] += kr * delta[x];
                    }
                }
                continue;
            }
            float o[CPT];
#pragma unroll
            for (int x = 0; x < CPT; x++) o[x] = 0.f;
#pragma unroll
            for (int i = 0; i < ROWS; i++) {
                const int r = g + RG * i;
                if (r < dk) {
                    const float kr = sk[tt][r], qr = sq[tt][r];
#pragma unroll
                    for (int x = 0; x < CPT; x++) {
                        s[i][x] += kr * delta[x];
                        o[x] += s[i][x] * qr;
                    }
                }
            }
            const float ot = column_sums(o);
            const long bt = (long)b * T + gt - P;
            // The first of the four lanes holding a column writes its output.
            if ((g & 3) == 0 && j0 + mine < dv) out[(bt * Hv + hv) * dv + j0 + mine] = ot;
            if (s_all != nullptr) store_state(s_all + (bt * Hv + hv) * (long)dk * dv);
        }
        __syncthreads();  // before the next group overwrites the staged inputs
    };
    // The replayed tokens, then the new ones, in groups that never mix them: the state a verify's
    // commit keeps (after the replayed tokens) is written between the two loops, outside any
    // loop, so that no state address stays live in registers through the token steps.
    for (int t0 = 0; t0 < P; t0 += TB) group(t0, min(TB, P - t0));
    if (deferred && stash_new && P > 0) write_state();
    for (int t0 = P; t0 < total; t0 += TB) group(t0, min(TB, total - t0));
    if (!(deferred && stash_new)) write_state();
}

#define GDN_KERNEL(NAME, TQ, TG, FUSED, ROWS, MINB)                                                            \
    extern "C" __global__ void __launch_bounds__(NW * 32, MINB)                                                  \
        NAME(const TQ* q, const TQ* k, const TQ* v, long qk_stride, long v_stride, const TG* ga, const TG* gb, \
             long g_stride,                                                                                    \
             const float* a_log, const float* dt_bias, const float* s0, float* out, float* s_final,          \
             float* s_all, int in_place, int T, int Hk, int Hv, int dk, int dv, float scale, float eps,          \
             const unsigned* slots, int pool, const unsigned* replay, float* stash, int tmax, int stash_new) { \
        pdl_launch_dependents();                                                                               \
        const int tiles_ = (dv + BV - 1) / BV;                                                                 \
        const int sb = state_slot(slots, pool, blockIdx.x / tiles_ / Hv);                                      \
        gdn_prefetch_state(in_place ? s_final : s0, Hv, dk, dv, sb);                                          \
        pdl_wait();                                                                                            \
        gdn_recurrent<TQ, TG, FUSED, ROWS>(q, k, v, qk_stride, v_stride, ga, gb, g_stride, a_log, dt_bias, s0, out,     \
                                           s_final, MINB == 1 ? s_all : nullptr, in_place, T, Hk, Hv, dk, dv, \
                                           scale, eps, sb, replay, \
                                           stash, tmax, stash_new);                                            \
    }

// `NAME`_r`ROWS`: ROWS register rows per thread, dk ≤ 16·ROWS.
#define GDN_ROWS(NAME, TQ, TG, FUSED) \
    GDN_KERNEL(NAME##_r1, TQ, TG, FUSED, 1, 1)  \
    GDN_KERNEL(NAME##_r2, TQ, TG, FUSED, 2, 1)  \
    GDN_KERNEL(NAME##_r4, TQ, TG, FUSED, 4, 1)  \
    GDN_KERNEL(NAME##_r8, TQ, TG, FUSED, 8, 1)  \
    GDN_KERNEL(NAME##_r16, TQ, TG, FUSED, 16, 1)

// Unfused: normalised f32 q/k/v, f32 g/beta (the reference op's signature).
GDN_ROWS(gdn_recurrent_f32, float, float, false)
// Fused gating + L2 norm: q/k/v and a/b in the activation dtype.
GDN_ROWS(gdn_fused_f32, float, float, true)
GDN_ROWS(gdn_fused_bf16, __nv_bfloat16, __nv_bfloat16, true)
GDN_ROWS(gdn_fused_f16, __half, __half, true)
// Batches (many blocks): the fused kernels held to 64 registers, so 8 blocks fit an SM instead of
// 4 and more state loads are in flight (decode B=64 at the 27B shape: 174 -> 149 µs); one
// sequence's 192 blocks run slower so (7.4 -> 9.7 µs), so the launcher picks these by grid size.
// They keep no per-token states (s_all is ignored, its stores compiled out to hold the registers):
// the launcher takes the others for that.
#define GDN_WIDE(NAME, TQ, TG)                   \
    GDN_KERNEL(NAME##_r2_wide, TQ, TG, true, 2, 8) \
    GDN_KERNEL(NAME##_r4_wide, TQ, TG, true, 4, 8) \
    GDN_KERNEL(NAME##_r8_wide, TQ, TG, true, 8, 8)
GDN_WIDE(gdn_fused_f32, float, float)
GDN_WIDE(gdn_fused_bf16, __nv_bfloat16, __nv_bfloat16)
GDN_WIDE(gdn_fused_f16, __half, __half)

// Causal depthwise conv1d + SiLU. The window of token t is concat(state, x)[t .. t+K) where
// concat = [K-1 state | T inputs]; state positions before a fresh sequence are zero (st == null).
// x: [B, T, C] rows of C elements xs apart (a view into a wider projection); w: [C, K] (K <= 8);
// st: [B, C, K-1]; y: [B, T, C]; st_out: [B, C, K-1] = the last K-1 entries of concat. One thread
// per (b, c, tile of CONV_TT tokens) keeps its window in registers and reads each input once
// (one block per output element was mostly block launches: 0.65 ms at 8k tokens). Grid: x =
// B·ceil(T / CONV_TT) token tiles, then B rows for st_out; y = blocks of channels.
constexpr int CONV_TT = CONV_TOKENS;

template <typename T>
__device__ __forceinline__ float conv_in(const T* x, const T* st, int b, int i, int c, int Tn, int C, int H,
                                         long xs) {
    // concat index i: state for i < H, else x[t = i - H]
    if (i < H) return st != nullptr ? to_f(st[((long)b * C + c) * H + i]) : 0.f;
    return to_f(x[((long)b * Tn + (i - H)) * xs + c]);
}

// One token of a channel's conv with the window in registers: returns silu(Σ_j wt[j]·concat[j])
// for the K-1 previous inputs win[0..H) and this input xt (the sums in j order), then shifts xt
// into the window. K <= 8.
__device__ __forceinline__ float conv_step(const float (&wt)[8], float (&win)[8], float xt, int K) {
    const int H = K - 1;
    float acc = 0.f;
#pragma unroll
    for (int j = 0; j < 8; j++)
        if (j < K) acc += wt[j] * (j < H ? win[j] : xt);
#pragma unroll
    for (int j = 0; j < 7; j++)
        if (j + 1 < H) win[j] = win[j + 1];
        else if (j + 1 == H) win[j] = xt;
    return acc / (1.f + expf(-acc));
}

template <typename T>
__device__ void conv1d(const T* __restrict__ x, long xs, const T* __restrict__ w, const T* __restrict__ st,
                       T* __restrict__ y, T* __restrict__ st_out, int B, int Tn, int C, int K) {
    const int c = blockIdx.y * blockDim.x + threadIdx.x;
    if (c >= C) return;
    const int H = K - 1;
    const int tiles = (Tn + CONV_TT - 1) / CONV_TT;
    const long blk = blockIdx.x;
    if (blk < (long)B * tiles) {
        const int b = blk / tiles, t0 = (blk % tiles) * CONV_TT, t1 = min(t0 + CONV_TT, Tn);
        float wt[8], win[8];  // win[0..H): the H inputs before the current token, oldest first
#pragma unroll
        for (int j = 0; j < 8; j++) {
            wt[j] = j < K ? to_f(w[(long)c * K + j]) : 0.f;
            win[j] = j < H ? conv_in(x, st, b, t0 + j, c, Tn, C, H, xs) : 0.f;
        }
        for (int t = t0; t < t1; t++) {
            const long row = (long)b * Tn + t;
            y[row * C + c] = from_f<T>(conv_step(wt, win, to_f(x[row * xs + c]), K));
        }
    } else {
        const int b = blk - (long)B * tiles;
        for (int j = 0; j < H; j++)
            st_out[((long)b * C + c) * H + j] = from_f<T>(conv_in(x, st, b, Tn + j, c, Tn, C, H, xs));
    }
}

// conv1d for the width K = 4 with V = 16 / sizeof(T) channels a thread: one 16-byte load of x and
// one store of y per token, the weights and the window's inputs in vectors too (the launcher
// checks that x's rows, xs, C and w allow them). Each channel runs conv_step as conv1d does, so y
// and st_out have its bits. Grid: x as conv1d's with tiles of CONV_VEC_TOKENS tokens, y = blocks of
// CONV_VEC_THREADS·V channels.
template <typename T>
__device__ void conv1d_vec4(const T* __restrict__ x, long xs, const T* __restrict__ w, const T* __restrict__ st,
                            T* __restrict__ y, T* __restrict__ st_out, int B, int Tn, int C) {
    constexpr int V = Vec16<T>::N, K = 4, H = K - 1;
    const int c0 = (blockIdx.y * blockDim.x + threadIdx.x) * V;
    if (c0 >= C) return;
    const int tiles = (Tn + CONV_VEC_TOKENS - 1) / CONV_VEC_TOKENS;
    const long blk = blockIdx.x;
    if (blk >= (long)B * tiles) {
        const int b = blk - (long)B * tiles;
        for (int e = 0; e < V; e++)
            for (int j = 0; j < H; j++)
                st_out[((long)b * C + c0 + e) * H + j] = from_f<T>(conv_in(x, st, b, Tn + j, c0 + e, Tn, C, H, xs));
        return;
    }
    const int b = blk / tiles, t0 = (blk % tiles) * CONV_VEC_TOKENS, t1 = min(t0 + CONV_VEC_TOKENS, Tn);
    // The V channels' K weights are K vectors; a window input past the state is a vector of x.
    Vec16<T> wv[K], xv[H];
#pragma unroll
    for (int q = 0; q < K; q++) wv[q].raw = reinterpret_cast<const uint4*>(w + (long)c0 * K)[q];
#pragma unroll
    for (int j = 0; j < H; j++)
        if (t0 + j >= H) xv[j].raw = *reinterpret_cast<const uint4*>(x + ((long)b * Tn + t0 + j - H) * xs + c0);
    float wt[V][8], win[V][8];
#pragma unroll
    for (int e = 0; e < V; e++)
#pragma unroll
        for (int j = 0; j < 8; j++) {
            wt[e][j] = j < K ? to_f(wv[(e * K + j) / V].e[(e * K + j) % V]) : 0.f;
            win[e][j] = j >= H ? 0.f : t0 + j >= H ? to_f(xv[j].e[e]) : conv_in(x, st, b, t0 + j, c0 + e, Tn, C, H, xs);
        }
#pragma unroll 4
    for (int t = t0; t < t1; t++) {
        const long row = (long)b * Tn + t;
        Vec16<T> in, out;
        in.raw = *reinterpret_cast<const uint4*>(x + row * xs + c0);
#pragma unroll
        for (int e = 0; e < V; e++) out.e[e] = from_f<T>(conv_step(wt[e], win[e], to_f(in.e[e]), K));
        *reinterpret_cast<uint4*>(y + row * C + c0) = out.raw;
    }
}

// Few tokens (decode, verify) with the state updated in place: one thread per channel (b, c) walks
// the Tn tokens in order with its window in registers (K <= 8), reading its K-1 entries of st (the
// state in and out) before writing them. Same y as conv1d, the same sums in the same order.
// win_out (optional, [B, C, K-1+Tn]): the raw window concat(state before, x) a speculative verify
// keeps for its commit. slots (optional, [B] of a pool of `pool` states): sequence b's state is
// row slots[b] of st, so a batch runs over a state pool with no gather or scatter.
// Deferred commits (stash non-null, [pool, tmax, C]: a slot's raw inputs of its last verify, as
// gdn_recurrent's records): the window first takes the replay[b] stashed inputs of the slot; with
// stash_new (a verify) the window after them is the state kept and the Tn new inputs replace the
// stash (each thread reads its channel's stashed inputs before it writes them), otherwise the
// state is the window after the new inputs too.
template <typename T>
__device__ void conv1d_seq(const T* __restrict__ x, long xs, const T* __restrict__ w, T* __restrict__ y,
                           T* __restrict__ st, T* __restrict__ win_out, int B, int Tn, int C, int K,
                           const unsigned* __restrict__ slots, int pool, const unsigned* __restrict__ replay,
                           T* __restrict__ stash, int tmax, int stash_new) {
    const long idx = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (idx >= (long)B * C) return;
    const int b = idx / C, c = idx % C, H = K - 1;
    // The state row: b, or its slot in a pool (-1 outside it: zeros in, nothing kept).
    const int sb = state_slot(slots, pool, b);
    T* wo = win_out != nullptr ? win_out + ((long)b * C + c) * (H + Tn) : nullptr;
    float wt[8], win[8];  // win[0..H): the last H inputs, oldest first
#pragma unroll
    for (int j = 0; j < 8; j++) {
        wt[j] = j < K && w != nullptr ? to_f(w[(long)c * K + j]) : 0.f;  // no weights: a replay alone
        const T held = (j < H && sb >= 0) ? st[((long)sb * C + c) * H + j] : from_f<T>(0.f);
        win[j] = j < H ? to_f(held) : 0.f;
        if (wo != nullptr && j < H) wo[j] = held;
    }
    const bool deferred = stash != nullptr && sb >= 0;
    const int P = deferred && replay != nullptr ? (int)replay[b] : 0;
    T* own = deferred ? stash + (long)sb * tmax * C + c : nullptr;  // stashed input t: own[t * C]
    auto write_state = [&]() {
#pragma unroll
        for (int j = 0; j < 7; j++)
            if (j < H && sb >= 0) st[((long)sb * C + c) * H + j] = from_f<T>(win[j]);
    };
    for (int t = 0; t < P; t++) {
        const float xt = to_f(own[(long)t * C]);
#pragma unroll
        for (int j = 0; j < 7; j++)
            if (j + 1 < H) win[j] = win[j + 1];
            else if (j + 1 == H) win[j] = xt;
    }
    if (deferred && stash_new && P > 0) write_state();
    for (int t = 0; t < Tn; t++) {
        const long row = (long)b * Tn + t;
        if (wo != nullptr) wo[H + t] = x[row * xs + c];
        if (deferred && stash_new) own[(long)t * C] = x[row * xs + c];
        y[row * C + c] = from_f<T>(conv_step(wt, win, to_f(x[row * xs + c]), K));
    }
    if (!(deferred && stash_new)) write_state();
}

#define CONV_KERNEL(NAME, T)                                                                                  \
    extern "C" __global__ void NAME(const T* x, long xs, const T* w, const T* st, T* y, T* st_out, int B,     \
                                    int Tn, int C, int K) { pdl_enter();                                                  \
        conv1d<T>(x, xs, w, st, y, st_out, B, Tn, C, K);                                                     \
    }                                                                                                         \
    extern "C" __global__ void NAME##_vec4(const T* x, long xs, const T* w, const T* st, T* y, T* st_out,     \
                                           int B, int Tn, int C) {                                            \
        pdl_enter();                                                                                          \
        conv1d_vec4<T>(x, xs, w, st, y, st_out, B, Tn, C);                                                   \
    }                                                                                                         \
    extern "C" __global__ void NAME##_in_place(const T* x, long xs, const T* w, T* y, T* st, T* win, int B,   \
                                               int Tn, int C, int K, const unsigned* slots, int pool,         \
                                               const unsigned* replay, T* stash, int tmax, int stash_new) {   \
        pdl_enter();                                                                                          \
        conv1d_seq<T>(x, xs, w, y, st, win, B, Tn, C, K, slots, pool, replay, stash, tmax, stash_new);       \
    }
CONV_KERNEL(conv1d_f32, float)
CONV_KERNEL(conv1d_bf16, __nv_bfloat16)
CONV_KERNEL(conv1d_f16, __half)

// ---------------------------------------------------------------------------------------------
// Chunked (WY / UT transform) gated delta rule for prefill, chunk C = 64, dk <= 128, dk % 4 == 0.
// Kernel 1 (`gdn_chunk_prep_*`, one block of 256 threads per (b, hv, chunk), all chunks in
// parallel) turns a chunk into
//   U  = (I + A)^-1 diag(beta) V           [C, dv]     ("new values")
//   W  = (I + A)^-1 diag(beta e^gamma) K   [C, dk]
//   Qt = scale e^gamma_r q_r               [C, dk]     (reads the chunk-entry state)
//   Kt = e^(gamma_L - gamma_s) k_s          [C, dk]     (writes the exit state)
//   P  = scale e^(gamma_r - gamma_s) q_r.k_s, s <= r   [C, C]
//   gL = e^gamma_L
// with A_rs = beta_r e^(gamma_r - gamma_s) k_r.k_s (s < r), q and k L2-normalised; rows past the
// sequence end are zero. Kernel 2 (`gdn_chunk_scan_c*`, one block per (b, hv, SBV state columns))
// walks the chunks in order with the state tile in shared memory, keeping each chunk's entry
// state hs:  Vt = U - W S;  hs = S;  S = gL S + Kt^T Vt.  Kernel 3 (`gdn_chunk_out`) then forms
// every chunk's output in parallel:  o = Qt hs + P Vt.
// Both stage their tiles in (dynamic) shared memory and give each thread a 4x4 or 4x2 register
// tile of every product, so the inner loops do 4 FMAs per shared-memory load.
constexpr int CH = GDN_CHUNK;
constexpr int CHUNK_DK = GDN_CHUNK_MAX_DK;
constexpr int KS = CH + 4;        // row stride of the transposed [dk][C] tiles (16-byte rows)
constexpr int XS = CHUNK_DK + 4;  // row stride of the [C][dk] tiles
constexpr int PS = CH + 4;        // row stride of the [C][C] tile

// Where a block of the per-chunk kernels (prep, outputs) works: chunk c (of nc) of sequence b,
// value head hv (key head hk), its L rows inside the sequence, and its index blk = (b·Hv + hv)·nc
// + c, whose rows start at base = blk·CH in the scratch.
struct ChunkBlock {
    int nc, c, b, hv, hk, L;
    long blk, bh, base;
    __device__ ChunkBlock(long blk_, int T, int Hk, int Hv) : blk(blk_) {
        nc = (T + CH - 1) / CH;
        c = blk % nc;
        bh = blk / nc;
        b = bh / Hv;
        hv = bh % Hv;
        hk = hv / (Hv / Hk);
        L = min(CH, T - c * CH);
        base = blk * CH;
    }
};

// Shared memory of the prep kernel: 2 CHUNK_DK KS + CH CH + 6 CH floats.
static_assert(4 * (2 * CHUNK_DK * KS + CH * CH + 6 * CH) <= GDN_PREP_SMEM, "the prep's tiles fit");

__device__ __forceinline__ float f4(const float4& v, int i) {
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// The gates and row factors of a chunk, by all 256 threads of a prep block (thread 4r + part
// holds part of row r's sums of squares of raw q and k, sq and sk): into the six per-row vectors
// at rows (gam, bet, inq, ink, eg, egl, CH floats each) the cumulative log decay gamma, beta,
// scale / |q| and 1 / |k| (or beta, g as given and unnormalised rows when not FUSED),
// e^gamma and e^(gamma_L - gamma). Rows past L get g = 0 and beta = 0. Returns gamma_L; the
// vectors are visible to the whole block on return. `row0`: the chunk's first token row.
template <typename TG, bool FUSED>
__device__ float chunk_gates(float sq, float sk, const TG* __restrict__ ga, const TG* __restrict__ gb,
                             long g_stride, const float* __restrict__ a_log, const float* __restrict__ dt_bias,
                             long row0, int hv, int L, float scale, float eps, float* rows) {
    float *gam = rows, *bet = rows + CH, *inq = rows + 2 * CH, *ink = rows + 3 * CH, *eg = rows + 4 * CH,
          *egl = rows + 5 * CH;
    const int tid = threadIdx.x, r = tid >> 2;
    sq += __shfl_xor_sync(0xffffffffu, sq, 1);
    sq += __shfl_xor_sync(0xffffffffu, sq, 2);
    sk += __shfl_xor_sync(0xffffffffu, sk, 1);
    sk += __shfl_xor_sync(0xffffffffu, sk, 2);
    if ((tid & 3) == 0) {
        const long row = row0 + r;
        float g = 0.f, be = 0.f, iq = scale, ik = 1.f;
        if (r < L) {
            if (FUSED) {
                const float a = to_f(ga[row * g_stride + hv]), bb = to_f(gb[row * g_stride + hv]);
                g = -expf(a_log[hv]) * softplus(a + dt_bias[hv]);
                be = 1.f / (1.f + expf(-bb));
                iq = scale / sqrtf(sq + eps);
                ik = 1.f / sqrtf(sk + eps);
            } else {
                g = to_f(ga[row * g_stride + hv]);
                be = to_f(gb[row * g_stride + hv]);
            }
        }
        gam[r] = g;  // cumulated below; rows past L add g = 0, so gamma stays at gamma_L
        bet[r] = be;
        inq[r] = iq;
        ink[r] = ik;
    }
    __syncthreads();
    // Inclusive scan of gamma in warp 0 (two rows per lane).
    if (tid < 32) {
        const float g0 = gam[2 * tid], g1 = gam[2 * tid + 1];
        float sum = g0 + g1;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const float n = __shfl_up_sync(0xffffffffu, sum, o);
            if (tid >= o) sum += n;
        }
        gam[2 * tid] = sum - g1;
        gam[2 * tid + 1] = sum;
    }
    __syncthreads();
    const float gl = gam[L - 1];
    if (tid < CH) {
        eg[tid] = expf(gam[tid]);
        egl[tid] = expf(gl - gam[tid]);
    }
    __syncthreads();
    return gl;
}

template <typename TQ, typename TG, bool FUSED>
__device__ void gdn_chunk_prep(const TQ* __restrict__ q, const TQ* __restrict__ k, const TQ* __restrict__ v,
                               long qk_stride, long v_stride, const TG* __restrict__ ga, const TG* __restrict__ gb,
                               long g_stride,
                               const float* __restrict__ a_log, const float* __restrict__ dt_bias,
                               float* __restrict__ U, float* __restrict__ W, float* __restrict__ Qt,
                               float* __restrict__ Kt, float* __restrict__ P, float* __restrict__ gL, int T,
                               int Hk, int Hv, int dk, int dv, float scale, float eps) {
    const ChunkBlock cb(blockIdx.x, T, Hk, Hv);
    const long blk = cb.blk;
    const int b = cb.b, hv = cb.hv, hk = cb.hk, t0 = cb.c * CH, L = cb.L;
    const int tid = threadIdx.x, nt = blockDim.x;
    extern __shared__ float4 smem4[];
    float* kT = reinterpret_cast<float*>(smem4);  // [CHUNK_DK][KS]: raw k, transposed
    float* qT = kT + CHUNK_DK * KS;               // [CHUNK_DK][KS]: raw q, transposed
    float* A = qT + CHUNK_DK * KS;                // [CH][CH]: strictly lower A, zeros elsewhere
    float* gam = A + CH * CH;                     // cumulative log decay gamma
    float* bet = gam + CH;
    float* inq = bet + CH;                        // q row factor (scale / |q|)
    float* ink = inq + CH;                        // k row factor (1 / |k|)
    float* eg = ink + CH;                         // e^gamma_r
    float* egl = eg + CH;                         // e^(gamma_L - gamma_r)

    // Raw q and k rows, transposed (rows past L and columns past dk are zero); 8 loads per
    // thread in flight.
#pragma unroll 8
    for (int e = tid; e < CH * CHUNK_DK; e += 256) {
        const int r = e / CHUNK_DK, i = e % CHUNK_DK;
        const long off = ((long)b * T + t0 + r) * qk_stride + hk * dk + i;
        const bool ok = r < L && i < dk;
        kT[i * KS + r] = ok ? to_f(k[off]) : 0.f;
        qT[i * KS + r] = ok ? to_f(q[off]) : 0.f;
    }
    __syncthreads();
    // Row statistics and gates: 4 threads per row (256 threads, 64 rows). The L2-norm factors
    // are applied where the rows are used (products, outputs), not to the tiles.
    float sq = 0.f, sk = 0.f;
    if (FUSED) {
        const int r = tid >> 2;
#pragma unroll 8
        for (int i = tid & 3; i < CHUNK_DK; i += 4) {
            const float qq = qT[i * KS + r], kk = kT[i * KS + r];
            sq += qq * qq;
            sk += kk * kk;
        }
    }
    const float gl = chunk_gates<TG, FUSED>(sq, sk, ga, gb, g_stride, a_log, dt_bias, (long)b * T + t0, hv, L,
                                            scale, eps, gam);
    // K K^T and Q K^T, a 4x4 tile per thread: rows 4tr.., columns 4ts...
    const long base = blk * CH;
    {
        const int tr = tid >> 4, ts = tid & 15;
        float kk[4][4] = {}, qk[4][4] = {};
#pragma unroll 4
        for (int i = 0; i < CHUNK_DK; i++) {
            const float4 kr = *reinterpret_cast<const float4*>(&kT[i * KS + 4 * tr]);
            const float4 qr = *reinterpret_cast<const float4*>(&qT[i * KS + 4 * tr]);
            const float4 ks = *reinterpret_cast<const float4*>(&kT[i * KS + 4 * ts]);
#pragma unroll
            for (int x = 0; x < 4; x++)
#pragma unroll
                for (int y = 0; y < 4; y++) {
                    kk[x][y] += f4(kr, x) * f4(ks, y);
                    qk[x][y] += f4(qr, x) * f4(ks, y);
                }
        }
#pragma unroll
        for (int x = 0; x < 4; x++) {
            const int r = 4 * tr + x;
            float4 pa, aa;
            float* pp = &pa.x;
            float* ap = &aa.x;
#pragma unroll
            for (int y = 0; y < 4; y++) {
                const int s = 4 * ts + y;
                const float d = r < L ? expf(gam[r] - gam[s]) * ink[s] : 0.f;
                pp[y] = s <= r ? d * inq[r] * qk[x][y] : 0.f;
                ap[y] = s < r ? bet[r] * d * ink[r] * kk[x][y] : 0.f;
            }
            *reinterpret_cast<float4*>(&P[(base + r) * CH + 4 * ts]) = pa;
            *reinterpret_cast<float4*>(&A[r * CH + 4 * ts]) = aa;
        }
    }
    __syncthreads();
    // Forward substitution, one column of [U | W] per thread, 64 rows in registers: x starts as
    // the right-hand side and row r is finished from the rows above it, four A_rs at a time.
    for (int j = tid; j < dv + dk; j += nt) {
        float x[CH];
        if (j < dv) {
            const TQ* src = v + ((long)b * T + t0) * v_stride + (long)hv * dv + j;
#pragma unroll
            for (int r = 0; r < CH; r++, src += v_stride) x[r] = r < L ? bet[r] * to_f(*src) : 0.f;
        } else {
#pragma unroll
            for (int r = 0; r < CH; r++) x[r] = bet[r] * eg[r] * ink[r] * kT[(j - dv) * KS + r];  // 0 past L
        }
#pragma unroll
        for (int r = 1; r < CH; r++) {
            float acc = x[r];
#pragma unroll
            for (int s = 0; s < r; s += 4) {
                const float4 a = *reinterpret_cast<const float4*>(&A[r * CH + s]);
                acc -= a.x * x[s];
                if (s + 1 < r) acc -= a.y * x[s + 1];
                if (s + 2 < r) acc -= a.z * x[s + 2];
                if (s + 3 < r) acc -= a.w * x[s + 3];
            }
            x[r] = acc;
        }
        if (j < dv) {
            float* dst = U + base * dv + j;
#pragma unroll
            for (int r = 0; r < CH; r++, dst += dv) *dst = x[r];
        } else {
            const int i = j - dv;
            float* dw = W + base * dk + i;
            float* dkt = Kt + base * dk + i;
#pragma unroll
            for (int r = 0; r < CH; r++, dw += dk, dkt += dk) {
                *dw = x[r];
                *dkt = kT[i * KS + r] * ink[r] * egl[r];
            }
        }
    }
    for (int e = tid; e < CH * dk; e += nt) {
        const int r = e / dk, i = e % dk;
        Qt[(base + r) * dk + i] = qT[i * KS + r] * inq[r] * eg[r];
    }
    if (tid == 0) gL[blk] = expf(gl);
}

#define CHUNK_PREP(NAME, TQ, TG, FUSED)                                                                       \
    extern "C" __global__ void __launch_bounds__(256, 2)                                                      \
        NAME(const TQ* q, const TQ* k, const TQ* v, long qk_stride, long v_stride, const TG* ga, const TG* gb,  \
             long g_stride, const float* a_log, const float* dt_bias, float* U, float* W, float* Qt, float* Kt, \
             float* P, float* gL, int T, int Hk, int Hv, int dk, int dv, float scale, float eps) {             \
        pdl_enter();                                                                                          \
        gdn_chunk_prep<TQ, TG, FUSED>(q, k, v, qk_stride, v_stride, ga, gb, g_stride, a_log, dt_bias, U, W,   \
                                      Qt, Kt, P, gL, T, Hk, Hv, dk, dv, scale, eps);                          \
    }
CHUNK_PREP(gdn_chunk_prep_f32, float, float, false)
CHUNK_PREP(gdn_chunk_prep_fused_f32, float, float, true)
CHUNK_PREP(gdn_chunk_prep_fused_bf16, __nv_bfloat16, __nv_bfloat16, true)
CHUNK_PREP(gdn_chunk_prep_fused_f16, __half, __half, true)

// Starts copying a [CH][dk] f32 tile (16-byte aligned rows, dk % 4 == 0) into X[CH][XS];
// columns dk..CHUNK_DK keep the zeros written once at the start.
template <int NT>
__device__ __forceinline__ void load_rows_async(float* X, const float* __restrict__ src, int dk) {
    const int q4 = dk / 4;
    for (int e = threadIdx.x; e < CH * q4; e += NT) {
        const int r = e / q4, c4 = 4 * (e % q4);
        cp_async16(&X[r * XS + c4], &src[(long)r * dk + c4]);
    }
}

// acc[x][y] += SIGN · sum over k < K of A[4tr + x][k] · B[k][2tc + y]: a thread's 4x2 register tile
// of an [rows, K] x [K, cols] product of shared-memory tiles (row strides as and bs, K a multiple
// of 4; 4 FMAs per shared load). Used by the scan (Vt = U - W S) and the output kernel.
template <int SIGN>
__device__ __forceinline__ void tile4x2_madd(float (&acc)[4][2], const float* A, int as, const float* B, int bs,
                                             int tr, int tc, int K) {
#pragma unroll 2
    for (int i = 0; i < K; i += 4) {
        float2 s[4];
#pragma unroll
        for (int z = 0; z < 4; z++) s[z] = *reinterpret_cast<const float2*>(&B[(i + z) * bs + 2 * tc]);
#pragma unroll
        for (int x = 0; x < 4; x++) {
            const float4 w = *reinterpret_cast<const float4*>(&A[(4 * tr + x) * as + i]);
            const float p0 = w.x * s[0].x + w.y * s[1].x + w.z * s[2].x + w.w * s[3].x;
            const float p1 = w.x * s[0].y + w.y * s[1].y + w.z * s[2].y + w.w * s[3].y;
            if (SIGN > 0) {
                acc[x][0] += p0;
                acc[x][1] += p1;
            } else {
                acc[x][0] -= p0;
                acc[x][1] -= p1;
            }
        }
    }
}

// Shared memory of the scan kernel with SBV state columns: 2 CH XS + CHUNK_DK SBV + CH SBV floats
// (the W and Kt tiles, the state tile, Vt).

// The scan: NT = 8 SBV threads. Phase 1 gives thread (tr, tc) rows 4tr..4tr+3 and columns 2tc,
// 2tc+1 of Vt [C, SBV]; phase 3 gives thread (ti, tq) state rows 4ti..4ti+3 and columns
// 4tq..4tq+3. Each chunk's Kt lands while phase 1 runs, the next chunk's W while phase 3 runs.
// Vt overwrites U in place (each thread reads and writes the same elements), and the state at
// each chunk's entry goes to hs for the output kernel.
template <int SBV>
__device__ void gdn_chunk_scan(float* U, const float* __restrict__ W, const float* __restrict__ Kt,
                               const float* __restrict__ gL, const float* __restrict__ s0,
                               float* __restrict__ hs, float* __restrict__ s_final, int B, int T, int Hv,
                               int dk, int dv) {
    constexpr int NT = 8 * SBV;
    static_assert(4 * (2 * CH * XS + CHUNK_DK * SBV + CH * SBV) <= (SBV == 16 ? GDN_SCAN_SMEM_C16 : GDN_SCAN_SMEM_C32),
                  "the scan's tiles fit");
    const int nc = (T + CH - 1) / CH;
    const int tiles = (dv + SBV - 1) / SBV;
    const int bh = blockIdx.x / tiles, j0 = (blockIdx.x % tiles) * SBV;
    const int tid = threadIdx.x;
    extern __shared__ float4 smem4[];
    float* XW = reinterpret_cast<float*>(smem4);  // [CH][XS]: W of the chunk
    float* XK = XW + CH * XS;                      // [CH][XS]: Kt of the chunk
    float* S = XK + CH * XS;                       // [CHUNK_DK][SBV]: the state tile
    float* Vt = S + CHUNK_DK * SBV;                // [CH][SBV]
    const long head = (long)bh * dk * dv;
    for (int e = tid; e < CHUNK_DK * SBV; e += NT) {
        const int r = e / SBV, j = j0 + e % SBV;
        S[e] = (s0 != nullptr && r < dk && j < dv) ? s0[head + (long)r * dv + j] : 0.f;
    }
    if (dk < CHUNK_DK)
        for (int e = tid; e < 2 * CH * XS; e += NT) XW[e] = 0.f;
    __syncthreads();
    const long first = (long)bh * nc * CH;  // row of this head's first chunk
    load_rows_async<NT>(XW, W + first * dk, dk);
    cp_async_commit();
    load_rows_async<NT>(XK, Kt + first * dk, dk);
    cp_async_commit();
    const int tr = tid / (SBV / 2), tc = tid % (SBV / 2);
    const int ti = tid / (SBV / 4), tq = tid % (SBV / 4);
    const int ja = j0 + 2 * tc;
    for (int c = 0; c < nc; c++) {
        const long base = first + (long)c * CH;
        const int L = min(CH, T - c * CH);
        cp_async_wait<1>();  // W of this chunk (its Kt may still be in flight)
        __syncthreads();
        // Phase 1: Vt = U - W S.
        float acc[4][2];
#pragma unroll
        for (int x = 0; x < 4; x++)
#pragma unroll
            for (int y = 0; y < 2; y++)
                acc[x][y] = ja + y < dv ? U[(base + 4 * tr + x) * dv + ja + y] : 0.f;
        tile4x2_madd<-1>(acc, XW, XS, S, SBV, tr, tc, CHUNK_DK);
#pragma unroll
        for (int x = 0; x < 4; x++) {
            *reinterpret_cast<float2*>(&Vt[(4 * tr + x) * SBV + 2 * tc]) = make_float2(acc[x][0], acc[x][1]);
#pragma unroll
            for (int y = 0; y < 2; y++)
                if (ja + y < dv) U[(base + 4 * tr + x) * dv + ja + y] = acc[x][y];
        }
        __syncthreads();  // Vt complete, XW free
        if (c + 1 < nc) load_rows_async<NT>(XW, W + (base + CH) * dk, dk);
        cp_async_commit();   // (an empty group on the last chunk keeps the counting uniform)
        cp_async_wait<1>();  // Kt of this chunk
        __syncthreads();
        // Phase 3: hs = S; S = gL S + Kt^T Vt (Kt and Vt rows past L are zero).
        const float g = gL[(long)bh * nc + c];
        const bool col_ok = j0 + 4 * tq < dv;  // dv % 4 == 0: all four columns or none
        float4 sv[4];
#pragma unroll
        for (int x = 0; x < 4; x++) {
            const int r = 4 * ti + x;
            sv[x] = *reinterpret_cast<const float4*>(&S[r * SBV + 4 * tq]);
            if (col_ok && r < dk)
                *reinterpret_cast<float4*>(&hs[((long)bh * nc + c) * dk * dv + (long)r * dv + j0 + 4 * tq]) =
                    sv[x];
            sv[x].x *= g;
            sv[x].y *= g;
            sv[x].z *= g;
            sv[x].w *= g;
        }
#pragma unroll 4
        for (int s = 0; s < L; s++) {
            const float4 kk = *reinterpret_cast<const float4*>(&XK[s * XS + 4 * ti]);
            const float4 vv = *reinterpret_cast<const float4*>(&Vt[s * SBV + 4 * tq]);
#pragma unroll
            for (int x = 0; x < 4; x++) {
                const float kx = f4(kk, x);
                sv[x].x += kx * vv.x;
                sv[x].y += kx * vv.y;
                sv[x].z += kx * vv.z;
                sv[x].w += kx * vv.w;
            }
        }
#pragma unroll
        for (int x = 0; x < 4; x++) *reinterpret_cast<float4*>(&S[(4 * ti + x) * SBV + 4 * tq]) = sv[x];
        __syncthreads();  // XK and S are done with
        if (c + 1 < nc) load_rows_async<NT>(XK, Kt + (base + CH) * dk, dk);
        cp_async_commit();
    }
    cp_async_wait<0>();
    __syncthreads();
    for (int e = tid; e < CHUNK_DK * SBV; e += NT) {
        const int r = e / SBV, j = j0 + e % SBV;
        if (r < dk && j < dv) s_final[head + (long)r * dv + j] = S[e];
    }
}

#define CHUNK_SCAN(NAME, SBV)                                                                                 \
    extern "C" __global__ void __launch_bounds__(8 * SBV)                                                     \
        NAME(float* U, const float* W, const float* Kt, const float* gL, const float* s0, float* hs,          \
             float* s_final, int B, int T, int Hv, int dk, int dv) { pdl_enter();                                          \
        gdn_chunk_scan<SBV>(U, W, Kt, gL, s0, hs, s_final, B, T, Hv, dk, dv);                                 \
    }
CHUNK_SCAN(gdn_chunk_scan_c16, 16)
CHUNK_SCAN(gdn_chunk_scan_c32, 32)

// Kernel 3: the outputs of every chunk in parallel, o = Qt hs + P Vt, one block of 256 threads
// per (b, hv, chunk, 32 output columns); thread (tr, tc) computes rows 4tr..4tr+3, columns
// 2tc, 2tc+1. Shared memory (floats): Qt [CH][XS], hs tile [CHUNK_DK][32], P [CH][PS], Vt [CH][32].
constexpr int OUT_COLS = GDN_OUT_COLS;
static_assert(4 * (CH * XS + CHUNK_DK * OUT_COLS + CH * PS + CH * OUT_COLS) <= GDN_OUT_SMEM, "the tiles fit");

extern "C" __global__ void __launch_bounds__(256)
    gdn_chunk_out(const float* __restrict__ Vt_all, const float* __restrict__ Qt, const float* __restrict__ P,
                  const float* __restrict__ hs, float* __restrict__ out, int B, int T, int Hv, int dk, int dv) { pdl_enter();
    const int tiles = (dv + OUT_COLS - 1) / OUT_COLS;
    const int j0 = (blockIdx.x % tiles) * OUT_COLS;
    const ChunkBlock cb(blockIdx.x / tiles, T, Hv, Hv);  // (the key head is not needed)
    const long blk = cb.blk, base = cb.base;
    const int c = cb.c, b = cb.b, hv = cb.hv, L = cb.L;
    const int tid = threadIdx.x;
    extern __shared__ float4 out_smem[];
    float* XQ = reinterpret_cast<float*>(out_smem);
    float* Hs = XQ + CH * XS;
    float* Ps = Hs + CHUNK_DK * OUT_COLS;
    float* Vs = Ps + CH * PS;
    const int ncol = min(OUT_COLS, dv - j0);  // a multiple of 4
    if (dk < CHUNK_DK)
        for (int e = tid; e < CH * XS; e += 256) XQ[e] = 0.f;
    if (dk < CHUNK_DK || ncol < OUT_COLS) {
        for (int e = tid; e < CHUNK_DK * OUT_COLS; e += 256) Hs[e] = 0.f;
        for (int e = tid; e < CH * OUT_COLS; e += 256) Vs[e] = 0.f;
    }
    __syncthreads();
    load_rows_async<256>(XQ, Qt + base * dk, dk);
    for (int e = tid; e < CH * CH / 4; e += 256) {
        const int r = e / (CH / 4), s4 = 4 * (e % (CH / 4));
        cp_async16(&Ps[r * PS + s4], &P[(base + r) * CH + s4]);
    }
    const int q4 = ncol / 4;
    for (int e = tid; e < dk * q4; e += 256) {
        const int r = e / q4, c4 = 4 * (e % q4);
        cp_async16(&Hs[r * OUT_COLS + c4], &hs[blk * dk * dv + (long)r * dv + j0 + c4]);
    }
    for (int e = tid; e < CH * q4; e += 256) {
        const int r = e / q4, c4 = 4 * (e % q4);
        cp_async16(&Vs[r * OUT_COLS + c4], &Vt_all[(base + r) * dv + j0 + c4]);
    }
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    const int tr = tid / (OUT_COLS / 2), tc = tid % (OUT_COLS / 2);
    float o[4][2] = {};
    tile4x2_madd<1>(o, XQ, XS, Hs, OUT_COLS, tr, tc, CHUNK_DK);
    // P_rs = 0 for s > r: the sum stops at the tile's last row.
    tile4x2_madd<1>(o, Ps, PS, Vs, OUT_COLS, tr, tc, 4 * tr + 4);
    const int ja = j0 + 2 * tc;
#pragma unroll
    for (int x = 0; x < 4; x++) {
        const int r = 4 * tr + x;
        if (r < L && ja < dv)
            *reinterpret_cast<float2*>(&out[(((long)b * T + c * CH + r) * Hv + hv) * dv + ja]) =
                make_float2(o[x][0], o[x][1]);
    }
}

// ---------------------------------------------------------------------------------------------
// The chunked kernels on tensor cores, for bf16 activations (fla's precision): U, W, P, Vt and hs
// are bf16, every product runs as mma.sync m16n8k16 with f32 accumulation, and the state itself
// stays f32 in the scan's registers: only its copy used as an operand (W S, and hs for the
// outputs) is rounded to bf16. The raw q, k, v rows enter the products as they are; the L2 norms,
// gates and decays are applied in f32 to the other operand or to the result.
// Tiles sit in shared memory with rows padded by 8 elements, so the 8 rows of an ldmatrix fall in
// distinct banks. dk <= 128 and dk, dv multiples of 8 (16-byte rows); columns past dk and dv and
// rows past dk are zero-filled.
using bf16 = __nv_bfloat16;
constexpr int TC_S = GDN_TC_S;  // row stride of [rows][dk] tiles: CHUNK_DK + 8
static_assert(TC_S == CHUNK_DK + 8, "padded rows");
constexpr int TC_OV = GDN_TC_OV;    // output columns per output block
constexpr int TC_OS = TC_OV + 8;    // row stride of the output kernel's [rows][64] tiles and of P

// Shared memory of the tensor-core prep (bytes): raw k and v [CH][TC_S] bf16; a region that
// first holds raw q [CH][TC_S] and A [CH][CH + 4] f32, then the column-scaled inverses
// T diag(beta) and T diag(beta e^gamma / |k|), each a bf16 pair (hi, lo) [2][CH][CH + 8]; the six
// per-row vectors. 72 KB: three blocks per SM.
constexpr int TC_TS = CH + 8;
constexpr int TC_PREP_REGION = 2 * 4 * CH * TC_TS;
static_assert(2 * CH * TC_S + 4 * CH * PS <= TC_PREP_REGION, "q and A fit where the inverses go");
constexpr int TC_PREP_SMEM = 2 * 2 * CH * TC_S + TC_PREP_REGION + 4 * 6 * CH;
static_assert(TC_PREP_SMEM <= 227 * 1024 / 3, "three blocks per SM");
static_assert(TC_PREP_SMEM <= GDN_TC_PREP_SMEM, "the launcher gives the prep its layout");

// The prep of the tensor-core path, one block of 8 warps per (b, hv, chunk): U, W and P as
// gdn_chunk_prep_fused_* forms them, in bf16, and gL; instead of Qt and Kt, their row factors
// fq = scale e^gamma / |q| and fk = e^(gamma_L - gamma) / |k| ([chunk rows] f32), applied to the
// raw rows by the kernels that read them. Raw bf16 q, k, v rows are exact tensor-core operands,
// so K K^T and Q K^T run as m16n8k16 products with only the f32 summation order changed; the
// norms and gates scale them afterwards. T = (I + A)^-1 comes from a blocked forward substitution
// in f32, and U = T diag(beta) V, W = T diag(beta e^gamma / |k|) K run on tensor cores with the
// f32 factor split into two bf16 parts (hi + lo: 16 significant bits), so U and W are accurate to
// about 2^-16 before their one rounding to bf16. q, k, v rows 16-byte aligned (row strides and
// offsets multiples of 8 elements: delta_rule/cuda.rs checks).
extern "C" __global__ void __launch_bounds__(256, 3)
    gdn_chunk_prep_tc(const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v,
                      long qk_stride, long v_stride, const bf16* __restrict__ ga, const bf16* __restrict__ gb,
                      long g_stride, const float* __restrict__ a_log, const float* __restrict__ dt_bias,
                      bf16* __restrict__ U, bf16* __restrict__ W, bf16* __restrict__ P, float* __restrict__ gL,
                      float* __restrict__ fq, float* __restrict__ fk, int T, int Hk, int Hv, int dk, int dv,
                      float scale, float eps) {
    pdl_enter();
    const ChunkBlock cb(blockIdx.x, T, Hk, Hv);
    const long blk = cb.blk;
    const int b = cb.b, hv = cb.hv, hk = cb.hk, t0 = cb.c * CH, L = cb.L;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, tg = lane & 3;
    extern __shared__ float4 tc_smem[];
    bf16* Ks = reinterpret_cast<bf16*>(tc_smem);
    bf16* Vs = Ks + CH * TC_S;
    bf16* Qs = Vs + CH * TC_S;                            // until T is formed:
    float* A = reinterpret_cast<float*>(Qs + CH * TC_S);  // [CH][PS]: strictly lower A
    bf16* Tu = Qs;                                        // then [2][CH][TC_TS]: T diag(beta), hi and lo
    bf16* Tw = Tu + 2 * CH * TC_TS;                       // [2][CH][TC_TS]: T diag(beta e^gamma / |k|)
    float* rows = reinterpret_cast<float*>(reinterpret_cast<char*>(Qs) + TC_PREP_REGION);
    const float *gam = rows, *bet = rows + CH, *inq = rows + 2 * CH, *ink = rows + 3 * CH, *eg = rows + 4 * CH,
                *egl = rows + 5 * CH;
    const long row0 = (long)b * T + t0;
    cp_async_tile<CH, CHUNK_DK / 8, 256>(Ks, TC_S, k + row0 * qk_stride + hk * dk, qk_stride, 0, L, dk / 8);
    cp_async_tile<CH, CHUNK_DK / 8, 256>(Qs, TC_S, q + row0 * qk_stride + hk * dk, qk_stride, 0, L, dk / 8);
    cp_async_tile<CH, CHUNK_DK / 8, 256>(Vs, TC_S, v + row0 * v_stride + (long)hv * dv, v_stride, 0, L, dv / 8);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    float sq = 0.f, sk = 0.f;
    {
        const int r = tid >> 2;
#pragma unroll 4
        for (int i = 2 * (tid & 3); i < CHUNK_DK; i += 8) {
            const float2 qq = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&Qs[r * TC_S + i]));
            const float2 kk = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&Ks[r * TC_S + i]));
            sq += qq.x * qq.x + qq.y * qq.y;
            sk += kk.x * kk.x + kk.y * kk.y;
        }
    }
    const float gl =
        chunk_gates<bf16, true>(sq, sk, ga, gb, g_stride, a_log, dt_bias, row0, hv, L, scale, eps, rows);
    const long base = blk * CH;
    // The row factors that make raw q and k rows Qt = scale e^gamma q^ and Kt = e^(gamma_L - gamma)
    // k^ for the scan and output kernels, which read the raw rows (exact bf16 operands).
    if (tid < CH) {
        fq[base + tid] = inq[tid] * eg[tid];
        fk[base + tid] = ink[tid] * egl[tid];
    }
    // K K^T and Q K^T of the raw rows: warp w forms rows 16(w % 4).., columns 32(w / 4).., then
    // A_rs = beta_r e^(gamma_r - gamma_s) k^_r.k^_s (s < r) into shared memory and
    // P_rs = scale e^(gamma_r - gamma_s) q^_r.k^_s (s <= r) to global memory.
    {
        const int m0 = 16 * (warp & 3), n0 = 32 * (warp >> 2);
        float G[4][4] = {}, H[4][4] = {};
#pragma unroll
        for (int kk = 0; kk < CHUNK_DK; kk += 16) {
            uint32_t ak[4], aq[4];
            load_a(ak, Ks, TC_S, m0, kk);
            load_a(aq, Qs, TC_S, m0, kk);
#pragma unroll
            for (int jp = 0; jp < 2; jp++) {
                uint32_t bk[4];
                load_b2_nk(bk, Ks, TC_S, kk, n0 + 16 * jp);
                mma_b2<bf16>(G, jp, ak, bk);
                mma_b2<bf16>(H, jp, aq, bk);
            }
        }
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int r = m0 + g + 8 * h, s0 = n0 + 8 * j + 2 * tg;
                float p[2];
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const int s = s0 + e;
                    const float d = s <= r ? expf(gam[r] - gam[s]) * ink[s] : 0.f;
                    A[r * PS + s] = s < r ? bet[r] * ink[r] * d * G[j][2 * h + e] : 0.f;
                    p[e] = inq[r] * d * H[j][2 * h + e];
                }
                *reinterpret_cast<uint32_t*>(&P[(base + r) * CH + s0]) = pack2<bf16>(p[0], p[1]);
            }
    }
    __syncthreads();
    // T = (I + A)^-1 in 16 x 16 blocks, every thread busy (the first solve is 16 rows deep, not 64):
    // the diagonal blocks T_ii = (I + A_ii)^-1 by forward substitution (a column per thread of the
    // first two warps), then At_ik = T_ii A_ik in place of A_ik, then the blocks below the
    // diagonal by their distance from it, T_ij = -sum over j <= k < i of At_ik T_kj (each block
    // needs only blocks nearer the diagonal). T (f32) goes where q was.
    float* Tm = reinterpret_cast<float*>(Qs);  // [CH][PS]
    {
        const int r = tid >> 4, cc = tid & 15;  // this thread's element of a 16 x 16 block
        if (tid < CH) {
            const int i0 = 16 * (tid >> 4), jj = tid & 15;
            float x[16];
#pragma unroll
            for (int rr = 0; rr < 16; rr++) x[rr] = rr == jj ? 1.f : 0.f;
#pragma unroll
            for (int rr = 1; rr < 16; rr++) {
                float acc[2] = {x[rr], 0.f};
#pragma unroll
                for (int ss = 0; ss < rr; ss++) acc[ss & 1] -= A[(i0 + rr) * PS + i0 + ss] * x[ss];
                x[rr] = acc[0] + acc[1];
            }
#pragma unroll
            for (int rr = 0; rr < 16; rr++) Tm[(i0 + rr) * PS + i0 + jj] = x[rr];
        } else {
            // Zeros in the six blocks above the diagonal, (0, 1..3), (1, 2..3), (2, 3): 64 float4
            // each, two per thread.
            const int e = tid - CH;
#pragma unroll
            for (int pass = 0; pass < 2; pass++) {
                const int q = e + 192 * pass;
                if (q < 6 * 64) {
                    const int blkid = q / 64, rem = q % 64;
                    const int bi = blkid < 3 ? 0 : blkid < 5 ? 1 : 2;
                    const int bj = blkid < 3 ? blkid + 1 : blkid < 5 ? blkid - 1 : 3;
                    const int rr = rem >> 2, c4 = 4 * (rem & 3);
                    *reinterpret_cast<float4*>(&Tm[(16 * bi + rr) * PS + 16 * bj + c4]) =
                        make_float4(0.f, 0.f, 0.f, 0.f);
                }
            }
        }
        __syncthreads();
        // At_ik = T_ii A_ik for the six blocks below the diagonal (T_ii unit lower triangular).
        constexpr int BI[6] = {1, 2, 2, 3, 3, 3}, BK[6] = {0, 0, 1, 0, 1, 2};
        float at[6];
#pragma unroll
        for (int n = 0; n < 6; n++) {
            const int i0 = 16 * BI[n], k0 = 16 * BK[n];
            float acc = 0.f;
#pragma unroll
            for (int m = 0; m < 16; m++) acc += Tm[(i0 + r) * PS + i0 + m] * A[(i0 + m) * PS + k0 + cc];
            at[n] = acc;
        }
        __syncthreads();
#pragma unroll
        for (int n = 0; n < 6; n++) A[(16 * BI[n] + r) * PS + 16 * BK[n] + cc] = at[n];
        __syncthreads();
        // Distance 1, 2, 3 from the diagonal: blocks (j + dist, j).
#pragma unroll
        for (int dist = 1; dist < 4; dist++) {
#pragma unroll
            for (int j = 0; j + dist < 4; j++) {
                const int i0 = 16 * (j + dist), j0 = 16 * j;
                float acc = 0.f;
#pragma unroll
                for (int k = j; k < j + dist; k++)
#pragma unroll
                    for (int m = 0; m < 16; m++)
                        acc -= A[(i0 + r) * PS + 16 * k + m] * Tm[(16 * k + m) * PS + j0 + cc];
                Tm[(i0 + r) * PS + j0 + cc] = acc;
            }
            __syncthreads();
        }
    }
    // Its column-scaled copies as bf16 pairs (hi, lo = the rounding error of hi), where q and A
    // were: each thread first reads its 16 elements (column tid % 64, rows tid / 64 + 4n).
    {
        const int j = tid & 63, r0 = tid >> 6;
        float x[16];
#pragma unroll
        for (int n = 0; n < 16; n++) x[n] = Tm[(r0 + 4 * n) * PS + j];
        __syncthreads();
        const float fu = bet[j], fw = bet[j] * eg[j] * ink[j];
#pragma unroll
        for (int n = 0; n < 16; n++) {
            const int r = r0 + 4 * n;
            const float xu = x[n] * fu, xw = x[n] * fw;
            const bf16 hu = __float2bfloat16(xu), hw = __float2bfloat16(xw);
            Tu[r * TC_TS + j] = hu;
            Tu[CH * TC_TS + r * TC_TS + j] = __float2bfloat16(xu - __bfloat162float(hu));
            Tw[r * TC_TS + j] = hw;
            Tw[CH * TC_TS + r * TC_TS + j] = __float2bfloat16(xw - __bfloat162float(hw));
        }
    }
    __syncthreads();
    // U = (T diag(beta)) V and W = (T diag(beta e^gamma / |k|)) K: warp w forms rows 16(w % 4)..,
    // columns 64(w / 4).. of each; the hi and lo parts accumulate into one f32 sum.
    const int m0 = 16 * (warp & 3), n0 = 64 * (warp >> 2);
#pragma unroll
    for (int which = 0; which < 2; which++) {
        const bf16* Tx = which == 0 ? Tu : Tw;
        const bf16* X = which == 0 ? Vs : Ks;
        bf16* dst = which == 0 ? U : W;
        const int n = which == 0 ? dv : dk;
        float o[8][4] = {};
#pragma unroll
        for (int kk = 0; kk < CH; kk += 16) {
            uint32_t ah[4], al[4];
            load_a(ah, Tx, TC_TS, m0, kk);
            load_a(al, Tx + CH * TC_TS, TC_TS, m0, kk);
#pragma unroll
            for (int jp = 0; jp < 4; jp++) {
                uint32_t bb[4];
                load_b2(bb, X, TC_S, kk, n0 + 16 * jp);
                mma_b2<bf16>(o, jp, ah, bb);
                mma_b2<bf16>(o, jp, al, bb);
            }
        }
        // Through the tile just read (every warp is done with it) to 16-byte global rows.
        __syncthreads();
        bf16* stage = const_cast<bf16*>(X);
#pragma unroll
        for (int j = 0; j < 8; j++)
#pragma unroll
            for (int h = 0; h < 2; h++)
                *reinterpret_cast<uint32_t*>(&stage[(m0 + g + 8 * h) * TC_S + n0 + 8 * j + 2 * tg]) =
                    pack2<bf16>(o[j][2 * h], o[j][2 * h + 1]);
        __syncthreads();
#pragma unroll
        for (int i = 0; i < CH / 16; i++) {
            const int r = (tid >> 4) + 16 * i, seg = tid & 15;
            if (8 * seg < n)
                *reinterpret_cast<uint4*>(&dst[(base + r) * n + 8 * seg]) =
                    *reinterpret_cast<const uint4*>(&stage[r * TC_S + 8 * seg]);
        }
    }
    if (tid == 0) gL[blk] = expf(gl);
}

// The end of a warp's tile of chunk outputs, shared by the output kernel and the scan that forms
// the outputs: o holds q hs for rows m0..m0+15, columns n0..n0+8NT of the tile; this makes it
// o = fq (q hs) + P Vt (the row factors f0, f1 of rows m0 + g and m0 + g + 8 in f32 on the
// accumulators; P lower triangular, so K stops at the tile's last row; P and Vt bf16 tiles in
// shared memory, row strides ps and vs) and writes the rows below L and columns below `cols` to
// dst (the tile's first row and column; rows rs floats apart).
template <int NT>
__device__ __forceinline__ void chunk_out_tile(float (&o)[NT][4], float f0, float f1, const bf16* Ps, int ps,
                                               const bf16* Vs, int vs, int m0, int n0, float* dst, long rs, int L,
                                               int cols) {
    const int lane = threadIdx.x & 31, g = lane >> 2, tg = lane & 3;
#pragma unroll
    for (int j = 0; j < NT; j++) {
        o[j][0] *= f0;
        o[j][1] *= f0;
        o[j][2] *= f1;
        o[j][3] *= f1;
    }
    for (int kk = 0; kk <= m0; kk += 16) {
        uint32_t a[4];
        load_a(a, Ps, ps, m0, kk);
#pragma unroll
        for (int jp = 0; jp < NT / 2; jp++) {
            uint32_t b[4];
            load_b2(b, Vs, vs, kk, n0 + 16 * jp);
            mma_b2<bf16>(o, jp, a, b);
        }
    }
#pragma unroll
    for (int j = 0; j < NT; j++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int r = m0 + g + 8 * h, col = n0 + 8 * j + 2 * tg;
            if (r < L && col < cols)
                *reinterpret_cast<float2*>(&dst[r * rs + col]) = make_float2(o[j][2 * h], o[j][2 * h + 1]);
        }
}

// Shared memory of a scan with BV state columns per block (bytes): W and raw k [2][CH][TC_S]
// (double-buffered), this tile's U [2][CH][BV + 8], the bf16 state [CHUNK_DK][BV + 8], Vt and
// fk Vt [CH][BV + 8]; with the outputs (OUT) also raw q [2][CH][TC_S] and P [2][CH][TC_OS].
__host__ __device__ constexpr int tc_scan_smem(int bv, bool out) {
    return 2 * (4 * CH * TC_S + (2 * CH + CHUNK_DK + 2 * CH) * (bv + 8) + (out ? 2 * CH * (TC_S + TC_OS) : 0));
}
static_assert(tc_scan_smem(32, false) <= GDN_TC_SCAN_SMEM_BV32 && tc_scan_smem(64, false) <= GDN_TC_SCAN_SMEM_BV64 &&
                  tc_scan_smem(64, true) <= GDN_TC_SCAN_OUT_SMEM_BV64,
              "the launcher gives each scan its layout");

// The scan, one block of WARPS warps per (b, hv, BV state columns). Warp w keeps state rows
// 16(w % 8).. and columns SC(w / 8).. (f32 accumulators, SC = 8 BV / WARPS) for the whole
// sequence; per chunk it forms a 16 x VC tile of Vt = U - W bf16(S), then its part of
// S = gL S + Kt^T Vt with Kt^T Vt = k^T (fk Vt) from the raw k rows. The next chunk's W, k and U
// load while this one is computed on, and bf16(S) at each chunk's entry goes to hs for the
// output kernel; Vt goes back over U. The chain of dependent steps per chunk is what bounds this
// kernel (few blocks: B·Hv·dv/BV), so each thread's copies use offsets computed once, the global
// writes go out as 16-byte rows of the shared tiles, and the products accumulate in two
// independent halves. Wider blocks read W and k once for more columns (measured on an H200,
// docs/history/BENCHMARKS-log.md, GDN kernels: BV 64 took the scan from 362 to 290-306 µs at 8k;
// 16 warps instead of 8 did no better) but need more shared memory than sm_86/89 give a block:
// the launcher picks BV by the device.
// OUT: the block also forms its columns of every chunk's outputs, o = fq (q hs) + P Vt (what
// gdn_chunk_out_tc does from global copies), while hs and Vt are still in shared memory: q hs
// shares the B fragments of W hs, and neither hs nor Vt goes to global memory (~600 MB of
// writes and reads fewer at 8k tokens). q, fq, P, out: as gdn_chunk_out_tc takes them; hs unused.
// Without OUT, q, fq, P and out are unused.
template <int BV, int WARPS, bool OUT>
__device__ void gdn_chunk_scan_tc(bf16* U, const bf16* __restrict__ W, const bf16* __restrict__ k,
                                  const bf16* __restrict__ q, long qk_stride, const float* __restrict__ fk,
                                  const float* __restrict__ fq, const bf16* __restrict__ P,
                                  const float* __restrict__ gL, const float* __restrict__ s0, bf16* __restrict__ hs,
                                  float* __restrict__ out, float* __restrict__ s_final, int T, int Hk, int Hv, int dk,
                                  int dv) {
    constexpr int THREADS = 32 * WARPS, VS = BV + 8;
    constexpr int SC = BV * 8 / WARPS, SNT = SC / 8;  // a warp's state columns, n-tiles
    constexpr int VC = BV * 4 / WARPS;                // a warp's Vt columns
    constexpr int WK_ROWS = THREADS / 16;             // W / k tile rows per copy pass
    constexpr int UPR = BV / 8, UROWS = THREADS / UPR;  // 16-byte pieces per U row; rows per pass
    static_assert(WARPS % 8 == 0 && SC % 16 == 0 && VC % 16 == 0 && CH % UROWS == 0, "tile split");
    static_assert(tc_scan_smem(BV, OUT) <= 227 * 1024, "fits an SM");
    pdl_enter();
    const int nc = (T + CH - 1) / CH;
    const int tiles = (dv + BV - 1) / BV;
    const int bh = blockIdx.x / tiles, j0 = (blockIdx.x % tiles) * BV;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, tg = lane & 3;
    extern __shared__ float4 scan_smem[];
    bf16* Wb = reinterpret_cast<bf16*>(scan_smem);
    bf16* Kb = Wb + 2 * CH * TC_S;
    bf16* Ub = Kb + 2 * CH * TC_S;
    bf16* Sb = Ub + 2 * CH * VS;
    bf16* Vb = Sb + CHUNK_DK * VS;
    bf16* Vf = Vb + CH * VS;
    bf16* Qb = Vf + CH * VS;        // OUT: [2][CH][TC_S]
    bf16* Pb = Qb + 2 * CH * TC_S;  // OUT: [2][CH][TC_OS]
    const long head = (long)bh * dk * dv;
    const long first = (long)bh * nc * CH;  // row of this head's first chunk
    // Raw k rows of this sequence and key head.
    const long qk_head = (long)(bh / Hv) * T * qk_stride + (long)((bh % Hv) / (Hv / Hk)) * dk;
    const bf16* kh = k + qk_head;
    // This thread's 16-byte pieces: of the W and k tiles rows wr + WK_ROWS i, segment ws (zeros
    // past dk and, for k, past the sequence); of the U tile rows ur + UROWS i, segment us (zeros
    // past dv); the same pieces of the Vt tile and of the bf16 state's rows go back to global
    // memory.
    const int wr = tid >> 4, ws = tid & 15, ur = tid / UPR, us = tid % UPR;
    const bool w_ok = 8 * ws < dk, u_ok = j0 + 8 * us < dv;
    // Running source pointers of those pieces (advanced a chunk per call of issue).
    const bf16* w_src = W + (first + wr) * dk + 8 * ws;
    const bf16* k_src = kh + (long)wr * qk_stride + 8 * ws;
    const bf16* u_src = U + (first + ur) * dv + j0 + 8 * us;
    // OUT: q pieces as k's; P rows pr + PROWS i, segment ps.
    constexpr int PROWS = THREADS / (CH / 8);
    const int pr = tid / (CH / 8), ps = tid % (CH / 8);
    const bf16* q_src = OUT ? q + qk_head + (long)wr * qk_stride + 8 * ws : nullptr;
    const bf16* p_src = OUT ? P + (first + pr) * CH + 8 * ps : nullptr;
    auto issue = [&](int c) {
        bf16* wd = Wb + ((c & 1) * CH + wr) * TC_S + 8 * ws;
        bf16* kd = Kb + ((c & 1) * CH + wr) * TC_S + 8 * ws;
        bf16* qd = Qb + ((c & 1) * CH + wr) * TC_S + 8 * ws;
        const int k_rows = T - c * CH - wr;  // piece i of k is inside the sequence while WK_ROWS i < k_rows
#pragma unroll
        for (int i = 0; i < CH / WK_ROWS; i++) {
            const bool k_ok = w_ok && WK_ROWS * i < k_rows;
            cp_async16_or_zero(wd + WK_ROWS * i * TC_S, w_ok ? w_src + (long)WK_ROWS * i * dk : W, w_ok);
            cp_async16_or_zero(kd + WK_ROWS * i * TC_S, k_ok ? k_src + WK_ROWS * i * qk_stride : k, k_ok);
            if constexpr (OUT)
                cp_async16_or_zero(qd + WK_ROWS * i * TC_S, k_ok ? q_src + WK_ROWS * i * qk_stride : q, k_ok);
        }
#pragma unroll
        for (int i = 0; i < CH / UROWS; i++)
            cp_async16_or_zero(Ub + ((c & 1) * CH + ur + UROWS * i) * VS + 8 * us,
                               u_ok ? u_src + (long)UROWS * i * dv : U, u_ok);
        if constexpr (OUT) {
#pragma unroll
            for (int i = 0; i < CH / PROWS; i++)
                cp_async16(Pb + ((c & 1) * CH + pr + PROWS * i) * TC_OS + 8 * ps, p_src + (long)PROWS * i * CH);
            q_src += (long)CH * qk_stride;
            p_src += (long)CH * CH;
        }
        cp_async_commit();
        w_src += (long)CH * dk;
        k_src += (long)CH * qk_stride;
        u_src += (long)CH * dv;
    };
    issue(0);
    // Element e of fragment j: state row 16(w % 8) + g + 8(e / 2), column sc + 8j + 2tg + e % 2.
    const int sr = 16 * (warp & 7) + g, sc = SC * (warp >> 3);
    float S[SNT][4];
#pragma unroll
    for (int j = 0; j < SNT; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int r = sr + 8 * (e >> 1), col = j0 + sc + 8 * j + 2 * tg + (e & 1);
            S[j][e] = (s0 != nullptr && r < dk && col < dv) ? s0[head + (long)r * dv + col] : 0.f;
        }
    auto round_state = [&]() {
#pragma unroll
        for (int j = 0; j < SNT; j++)
#pragma unroll
            for (int h = 0; h < 2; h++)
                *reinterpret_cast<uint32_t*>(&Sb[(sr + 8 * h) * VS + sc + 8 * j + 2 * tg]) =
                    pack2<bf16>(S[j][2 * h], S[j][2 * h + 1]);
    };
    // hs of chunk c from the shared bf16 state: rows ur + UROWS i, segment us.
    auto write_hs = [&](int c) {
        bf16* dst = hs + ((long)bh * nc + c) * dk * dv + j0 + 8 * us;
#pragma unroll
        for (int i = 0; i < CHUNK_DK / UROWS; i++) {
            const int r = ur + UROWS * i;
            if (r < dk && u_ok)
                *reinterpret_cast<uint4*>(dst + (long)r * dv) = *reinterpret_cast<const uint4*>(&Sb[r * VS + 8 * us]);
        }
    };
    round_state();
    const int vr = 16 * (warp & 3), vc = VC * (warp >> 2);  // this warp's Vt tile
    float gl_next = gL[(long)bh * nc];
    // fk (and with OUT fq) of this warp's two Vt rows, loaded a chunk ahead like gL.
    float fk_next[2] = {fk[first + vr + g], fk[first + vr + g + 8]};
    float fq_next[2] = {OUT ? fq[first + vr + g] : 0.f, OUT ? fq[first + vr + g + 8] : 0.f};
    for (int c = 0; c < nc; c++) {
        const int o = (c & 1) * CH;
        const long base = first + (long)c * CH;
        const float gl = gl_next, fk0 = fk_next[0], fk1 = fk_next[1], fq0 = fq_next[0], fq1 = fq_next[1];
        cp_async_wait<0>();  // this chunk's W, k and U (issued a chunk ago)
        __syncthreads();     // ... visible to all, with bf16(S); the buffers refilled next are free
        // Vt = U - W bf16(S): a 16 x VC tile, K = CHUNK_DK in two independent halves; with OUT
        // also the same tile of q bf16(S), in gdn_chunk_out_tc's order.
        float v[2][VC / 8][4] = {}, ot[VC / 8][4] = {};
#pragma unroll
        for (int kk = 0; kk < CHUNK_DK; kk += 16) {
            uint32_t a[4], aq[4];
            load_a(a, Wb + o * TC_S, TC_S, vr, kk);
            if constexpr (OUT) load_a(aq, Qb + o * TC_S, TC_S, vr, kk);
            const int p = (kk >> 4) & 1;
#pragma unroll
            for (int jp = 0; jp < VC / 16; jp++) {
                uint32_t b[4];
                load_b2(b, Sb, VS, kk, vc + 16 * jp);
                mma_b2<bf16>(v[p], jp, a, b);
                if constexpr (OUT) mma_b2<bf16>(ot, jp, aq, b);
            }
        }
        // The next chunk's loads (and this chunk's hs) go out while the products run.
        if (c + 1 < nc) {
            issue(c + 1);
            gl_next = gL[(long)bh * nc + c + 1];
            fk_next[0] = fk[base + CH + vr + g];
            fk_next[1] = fk[base + CH + vr + g + 8];
            if constexpr (OUT) {
                fq_next[0] = fq[base + CH + vr + g];
                fq_next[1] = fq[base + CH + vr + g + 8];
            }
        }
        if constexpr (!OUT) write_hs(c);
        // Vt (bf16) for the outputs, and fk Vt (bf16) for the state update: Kt^T Vt = k^T (fk Vt).
        const bf16* Ut = Ub + o * VS;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int r = vr + g + 8 * h;
            const float f = h == 0 ? fk0 : fk1;
#pragma unroll
            for (int j = 0; j < VC / 8; j++) {
                const int col = vc + 8 * j + 2 * tg;
                const __nv_bfloat162 u = *reinterpret_cast<const __nv_bfloat162*>(&Ut[r * VS + col]);
                const float x0 = __low2float(u) - v[0][j][2 * h] - v[1][j][2 * h];
                const float x1 = __high2float(u) - v[0][j][2 * h + 1] - v[1][j][2 * h + 1];
                *reinterpret_cast<uint32_t*>(&Vb[r * VS + col]) = pack2<bf16>(x0, x1);
                *reinterpret_cast<uint32_t*>(&Vf[r * VS + col]) = pack2<bf16>(f * x0, f * x1);
            }
        }
        __syncthreads();  // Vt complete; the reads of bf16(S) done
        if constexpr (OUT) {
            const int b = bh / Hv, hv = bh % Hv;
            chunk_out_tile(ot, fq0, fq1, Pb + o * TC_OS, TC_OS, Vb, VS, vr, vc,
                           out + (((long)b * T + c * CH) * Hv + hv) * dv + j0, (long)Hv * dv, min(CH, T - c * CH),
                           dv - j0);
        } else {
#pragma unroll
            for (int i = 0; i < CH / UROWS; i++)
                if (u_ok)
                    *reinterpret_cast<uint4*>(&U[(base + ur + UROWS * i) * dv + j0 + 8 * us]) =
                        *reinterpret_cast<const uint4*>(&Vb[(ur + UROWS * i) * VS + 8 * us]);
        }
        // S = gL S + Kt^T Vt (Kt and Vt rows past the sequence end are zero), K = CH in two
        // independent halves.
        float d[2][SNT][4] = {};
#pragma unroll
        for (int kk = 0; kk < CH; kk += 16) {
            uint32_t a[4];
            load_a_trans(a, Kb + o * TC_S, TC_S, 16 * (warp & 7), kk);
            const int p = (kk >> 4) & 1;
#pragma unroll
            for (int jp = 0; jp < SNT / 2; jp++) {
                uint32_t b[4];
                load_b2(b, Vf, VS, kk, sc + 16 * jp);
                mma_b2<bf16>(d[p], jp, a, b);
            }
        }
#pragma unroll
        for (int j = 0; j < SNT; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) S[j][e] = S[j][e] * gl + (d[0][j][e] + d[1][j][e]);
        if (c + 1 < nc) round_state();
    }
#pragma unroll
    for (int j = 0; j < SNT; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int r = sr + 8 * (e >> 1), col = j0 + sc + 8 * j + 2 * tg + (e & 1);
            if (r < dk && col < dv) s_final[head + (long)r * dv + col] = S[j][e];
        }
}

#define TC_SCAN_KERNEL(BV, WARPS)                                                                              \
    extern "C" __global__ void __launch_bounds__(32 * WARPS) gdn_chunk_scan_tc_bv##BV(                        \
        bf16* U, const bf16* W, const bf16* k, long qk_stride, const float* fk, const float* gL, const float* s0, \
        bf16* hs, float* s_final, int B, int T, int Hk, int Hv, int dk, int dv) {                             \
        gdn_chunk_scan_tc<BV, WARPS, false>(U, W, k, nullptr, qk_stride, fk, nullptr, nullptr, gL, s0, hs,    \
                                            nullptr, s_final, T, Hk, Hv, dk, dv);                             \
    }
TC_SCAN_KERNEL(32, 8)
TC_SCAN_KERNEL(64, 8)
// The scan with the outputs (the 64-column blocks: 174 KiB of shared memory, so sm_90 only).
extern "C" __global__ void __launch_bounds__(256)
    gdn_chunk_scan_out_tc_bv64(bf16* U, const bf16* W, const bf16* k, const bf16* q, long qk_stride, const float* fk,
                               const float* fq, const bf16* P, const float* gL, const float* s0, float* out,
                               float* s_final, int B, int T, int Hk, int Hv, int dk, int dv) {
    gdn_chunk_scan_tc<64, 8, true>(U, W, k, q, qk_stride, fk, fq, P, gL, s0, nullptr, out, s_final, T, Hk, Hv, dk,
                                   dv);
}

// Shared memory of the output kernel (bf16 elements): raw q [CH][TC_S], the hs tile
// [CHUNK_DK][TC_OS], P [CH][TC_OS], Vt [CH][TC_OS].
constexpr int TC_OUT_SMEM = 2 * (CH * TC_S + CHUNK_DK * TC_OS + 2 * CH * TC_OS);
static_assert(TC_OUT_SMEM <= 227 * 1024 / 4, "four blocks per SM");
static_assert(TC_OUT_SMEM <= GDN_TC_OUT_SMEM, "the launcher gives the output kernel its layout");

// The outputs, o = Qt hs + P Vt = fq (q hs) + P Vt from the raw q rows, one block of 4 warps per
// (b, hv, chunk, TC_OV output columns);
// warp w computes rows 16w..16w+15 (P is lower triangular: its K loop stops at the warp's last row).
extern "C" __global__ void __launch_bounds__(128)
    gdn_chunk_out_tc(const bf16* __restrict__ Vt_all, const bf16* __restrict__ q, long qk_stride,
                     const float* __restrict__ fq, const bf16* __restrict__ P, const bf16* __restrict__ hs,
                     float* __restrict__ out, int B, int T, int Hk, int Hv, int dk, int dv) {
    pdl_enter();
    const int tiles = (dv + TC_OV - 1) / TC_OV;
    const int j0 = (blockIdx.x % tiles) * TC_OV;
    const ChunkBlock cb(blockIdx.x / tiles, T, Hk, Hv);
    const long blk = cb.blk, base = cb.base;
    const int c = cb.c, b = cb.b, hv = cb.hv, hk = cb.hk, L = cb.L;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2;
    extern __shared__ float4 tc_smem[];
    bf16* Qs = reinterpret_cast<bf16*>(tc_smem);
    bf16* Hs = Qs + CH * TC_S;
    bf16* Ps = Hs + CHUNK_DK * TC_OS;
    bf16* Vs = Ps + CH * TC_OS;
    const int oseg = min(TC_OV, dv - j0) / 8;
    cp_async_tile<CH, CHUNK_DK / 8, 128>(Qs, TC_S, q + ((long)b * T + c * CH) * qk_stride + (long)hk * dk, qk_stride,
                                         0, L, dk / 8);
    cp_async_tile<CHUNK_DK, TC_OV / 8, 128>(Hs, TC_OS, hs + blk * dk * dv + j0, dv, 0, dk, oseg);
    cp_async_tile<CH, CH / 8, 128>(Ps, TC_OS, P + base * CH, CH, 0, CH, CH / 8);
    cp_async_tile<CH, TC_OV / 8, 128>(Vs, TC_OS, Vt_all + base * dv + j0, dv, 0, CH, oseg);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    float o[8][4] = {};
#pragma unroll
    for (int kk = 0; kk < CHUNK_DK; kk += 16) {
        uint32_t a[4];
        load_a(a, Qs, TC_S, 16 * warp, kk);
#pragma unroll
        for (int jp = 0; jp < 4; jp++) {
            uint32_t bb[4];
            load_b2(bb, Hs, TC_OS, kk, 16 * jp);
            mma_b2<bf16>(o, jp, a, bb);
        }
    }
    chunk_out_tile(o, fq[base + 16 * warp + g], fq[base + 16 * warp + g + 8], Ps, TC_OS, Vs, TC_OS, 16 * warp, 0,
                   out + (((long)b * T + c * CH) * Hv + hv) * dv + j0, (long)Hv * dv, L, dv - j0);
}
