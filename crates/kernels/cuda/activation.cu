// SwiGLU on a fused gate|up projection, the CUDA twin of `swiglu` in src/activation/: one
// kernel instead of SiLU, a slice copy and a multiply. Built to PTX by build.rs.
#include "common.cuh"

// x: [rows, 2·I] (gate then up), y: [rows, I] = silu(gate) · up in f32, one rounding. VEC: each
// step takes 16 bytes of gate, of up and of y (I·sizeof(T) a multiple of 16, 16-byte aligned
// rows: checked by the launcher); otherwise one element.
template <typename T, bool VEC>
__device__ void swiglu(const T* __restrict__ x, T* __restrict__ y, int rows, int I) {
    constexpr int V = VEC ? Vec16<T>::N : 1;
    const int per_row = I / V;  // steps per row
    const size_t n = (size_t)rows * per_row;
    for (size_t j = blockIdx.x * (size_t)blockDim.x + threadIdx.x; j < n; j += (size_t)gridDim.x * blockDim.x) {
        const size_t r = j / per_row, i = (j % per_row) * V;
        const T* g = x + r * 2 * I + i;
        const T* u = g + I;
        T* o = y + r * I + i;
        if constexpr (VEC) {
            Vec16<T> gv, uv, ov;
            gv.raw = *reinterpret_cast<const uint4*>(g);
            uv.raw = *reinterpret_cast<const uint4*>(u);
#pragma unroll
            for (int e = 0; e < V; e++) {
                const float ge = to_f(gv.e[e]);
                ov.e[e] = from_f<T>(ge / (1.f + expf(-ge)) * to_f(uv.e[e]));
            }
            *reinterpret_cast<uint4*>(o) = ov.raw;
        } else {
            const float ge = to_f(*g);
            *o = from_f<T>(ge / (1.f + expf(-ge)) * to_f(*u));
        }
    }
}

#define SWIGLU_KERNEL(SUFFIX, T)                                                                          \
    extern "C" __global__ void swiglu_##SUFFIX(const T* x, T* y, int rows, int I) { pdl_enter();                      \
        swiglu<T, false>(x, y, rows, I);                                                                  \
    }                                                                                                     \
    extern "C" __global__ void swiglu_vec_##SUFFIX(const T* x, T* y, int rows, int I) { pdl_enter();                  \
        swiglu<T, true>(x, y, rows, I);                                                                   \
    }
SWIGLU_KERNEL(f32, float)
SWIGLU_KERNEL(bf16, __nv_bfloat16)
SWIGLU_KERNEL(f16, __half)
