// SwiGLU on a fused gate|up projection, the CUDA twin of `swiglu` in src/activation.rs: one
// kernel instead of SiLU, a slice copy and a multiply. Built to PTX by build.rs.
#include "common.cuh"

// x: [rows, 2·I] (gate then up), y: [rows, I] = silu(gate) · up in f32, one rounding.
template <typename T>
__device__ void swiglu(const T* __restrict__ x, T* __restrict__ y, int rows, int I) {
    const size_t n = (size_t)rows * I;
    for (size_t j = blockIdx.x * (size_t)blockDim.x + threadIdx.x; j < n; j += (size_t)gridDim.x * blockDim.x) {
        const size_t r = j / I, i = j % I;
        const float g = to_f(x[r * 2 * I + i]), u = to_f(x[r * 2 * I + I + i]);
        y[j] = from_f<T>(g / (1.f + expf(-g)) * u);
    }
}

#define SWIGLU_KERNEL(SUFFIX, T)                                                                     \
    extern "C" __global__ void swiglu_##SUFFIX(const T* x, T* y, int rows, int I) { swiglu<T>(x, y, rows, I); }
SWIGLU_KERNEL(f32, float)
SWIGLU_KERNEL(bf16, __nv_bfloat16)
SWIGLU_KERNEL(f16, __half)
