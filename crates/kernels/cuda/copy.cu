// Row copies between pools, the CUDA twin of `copy_rows` in src/copy/: block i copies row
// src_rows[i] of src (m inner rows of src_w elements each) into row dst_rows[i] of dst (m inner
// rows of dst_w elements), taking the dst_w elements from column src_cols[i] (0 when null) of each
// inner row. A block whose rows or columns fall outside the pools is skipped. Grid (n, element
// tiles of COPY_TILE); the element type only matters by its size (a plain copy). Built by build.rs.
#include "common.cuh"

template <typename T>
__device__ void copy_rows(const T* __restrict__ src, T* __restrict__ dst, const unsigned* __restrict__ src_rows,
                          const unsigned* __restrict__ dst_rows, const unsigned* __restrict__ src_cols, int src_n,
                          int dst_n, int m, int src_w, int dst_w) {
    const int i = blockIdx.x;
    const unsigned sr = src_rows[i], dr = dst_rows[i], c0 = src_cols != nullptr ? src_cols[i] : 0;
    // (dst_w <= src_w: checked by the launcher; the window test cannot wrap around.)
    if (sr >= (unsigned)src_n || dr >= (unsigned)dst_n || c0 > (unsigned)(src_w - dst_w)) return;
    const long total = (long)m * dst_w;
    const long e0 = (long)blockIdx.y * COPY_TILE, e1 = min(e0 + COPY_TILE, total);
    const T* s = src + (long)sr * m * src_w + c0;
    T* d = dst + (long)dr * total;
    for (long e = e0 + threadIdx.x; e < e1; e += COPY_THREADS) {
        const long r = e / dst_w, j = e % dst_w;
        d[e] = s[r * src_w + j];
    }
}

#define COPY_KERNEL(BYTES, T)                                                                          \
    extern "C" __global__ void __launch_bounds__(COPY_THREADS)                                         \
        copy_rows_b##BYTES(const T* src, T* dst, const unsigned* src_rows, const unsigned* dst_rows,   \
                           const unsigned* src_cols, int src_n, int dst_n, int m, int src_w, int dst_w) { \
        pdl_enter();                                                                                   \
        copy_rows<T>(src, dst, src_rows, dst_rows, src_cols, src_n, dst_n, m, src_w, dst_w);           \
    }
COPY_KERNEL(2, unsigned short)
COPY_KERNEL(4, unsigned int)
