// SiLU-and-mul (the SwiGLU gate): out = silu(x[:, :I]) * x[:, I:], one CTA per token row.
#include "common.cuh"

namespace llmserve {

__device__ __forceinline__ float silu(float x) { return x / (1.f + __expf(-x)); }

template <typename T, int VEC>
__global__ void silu_and_mul_kernel(  // grid = (num_tokens, column chunks)
    T* __restrict__ out,       // [num_tokens, inter]
    const T* __restrict__ x,   // [num_tokens, 2 * inter]
    const int inter) {
  const T* __restrict__ gate = x + (long long)blockIdx.x * 2 * inter;
  const T* __restrict__ up = gate + inter;
  T* __restrict__ dst = out + (long long)blockIdx.x * inter;
  // Columns are spread over gridDim.y CTAs too, so a small decode batch still fills the GPU.
  for (int i = (blockIdx.y * blockDim.x + threadIdx.x) * VEC; i < inter; i += gridDim.y * blockDim.x * VEC) {
    float g[VEC], u[VEC];
    if constexpr (VEC == 8) {
      load8(gate + i, g);
      load8(up + i, u);
    } else {
#pragma unroll
      for (int e = 0; e < VEC; ++e) { g[e] = to_float(gate[i + e]); u[e] = to_float(up[i + e]); }
    }
    // silu is rounded to T before the product, as the torch reference computes it in two ops.
#pragma unroll
    for (int e = 0; e < VEC; ++e) g[e] = round_to<T>(silu(g[e])) * u[e];
    if constexpr (VEC == 8) {
      store8(dst + i, g);
    } else {
#pragma unroll
      for (int e = 0; e < VEC; ++e) dst[i + e] = from_float<T>(g[e]);
    }
  }
}

}  // namespace llmserve
