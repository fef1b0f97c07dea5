// Tensor-core helpers (sm_80+) shared by the kernels in this directory: mma.sync m16n8k16 with
// f32 accumulation, ldmatrix fragment loads and the 16-bit pair packing of their operands.
// Fragment layouts (lane l, g = l / 4, t = l % 4): A (16x16, row-major) a0 = (g, 2t..2t+1),
// a1 = (g+8, 2t..), a2 = (g, 2t+8..), a3 = (g+8, 2t+8..); B (16x8, by column) b0 = rows 2t..2t+1 of
// column g, b1 = rows 2t+8..; C (16x8) c0,c1 = (g, 2t..2t+1), c2,c3 = (g+8, 2t..).
#pragma once
#include "common.cuh"

template <typename T> __device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <> __device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
}
template <> __device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
}

// c += a · b for one m16n8k16 tile (a: 16x16 row-major fragment, b: 16x8 column fragment).
template <typename T> __device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);
template <>
__device__ __forceinline__ void mma16816<__nv_bfloat16>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma16816<__half>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// c[2j] += a · b[0..1] and c[2j+1] += a · b[2..3]: the two adjacent n-tiles of a load_b2 or
// load_b2_nk fragment pair (columns 16j.. of the accumulators' n-tiles).
template <typename T, int N>
__device__ __forceinline__ void mma_b2(float (&c)[N][4], int j, const uint32_t (&a)[4], const uint32_t (&b)[4]) {
    mma16816<T>(c[2 * j], a, b[0], b[1]);
    mma16816<T>(c[2 * j + 1], a, b[2], b[3]);
}

// Four 8x8 b16 matrices from shared memory; lane l gives the address of row l % 8 of matrix l / 8.
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void* p) {
    const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}
// The same, each matrix transposed.
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], const void* p) {
    const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

// Fragments of 16 x 16 operand blocks from shared-memory tiles of 16-bit elements (row stride xs
// elements, rows 16-byte aligned; a stride of 8 elements past a multiple of 64 keeps the 8 rows of
// each ldmatrix in distinct banks).
// The A fragment of rows m0..m0+15, columns kk..kk+15 of a row-major [m][k] tile.
template <typename T> __device__ __forceinline__ void load_a(uint32_t (&a)[4], const T* X, int xs, int m0, int kk) {
    const int lane = threadIdx.x & 31;
    ldsm_x4(a, &X[(m0 + (lane & 15)) * xs + kk + 8 * (lane >> 4)]);
}
// The A fragment of rows m0..m0+15 of the transpose of a row-major [k][m] tile.
template <typename T>
__device__ __forceinline__ void load_a_trans(uint32_t (&a)[4], const T* X, int xs, int m0, int kk) {
    const int lane = threadIdx.x & 31;
    ldsm_x4_trans(a, &X[(kk + (lane & 7) + 8 * (lane >> 4)) * xs + m0 + 8 * ((lane >> 3) & 1)]);
}
// B fragments of two adjacent n-tiles (columns n0..n0+15) for k rows kk..kk+15 of a row-major
// [k][n] tile: b[0], b[1] for columns n0.., b[2], b[3] for n0+8...
template <typename T> __device__ __forceinline__ void load_b2(uint32_t (&b)[4], const T* X, int xs, int kk, int n0) {
    const int lane = threadIdx.x & 31;
    ldsm_x4_trans(b, &X[(kk + (lane & 7) + 8 * ((lane >> 3) & 1)) * xs + n0 + 8 * (lane >> 4)]);
}
// The same two B fragments from a row-major [n][k] tile (B is its transpose: columns n0..n0+15
// of B are rows n0..n0+15 of the tile).
template <typename T>
__device__ __forceinline__ void load_b2_nk(uint32_t (&b)[4], const T* X, int xs, int kk, int n0) {
    const int lane = threadIdx.x & 31;
    ldsm_x4(b, &X[(n0 + (lane & 7) + 8 * (lane >> 4)) * xs + kk + 8 * ((lane >> 3) & 1)]);
}
