// RMSNorm and fused residual-add + RMSNorm: one CTA per token row, fp32 statistics.
// VEC = 8 moves 8-element chunks with 16-byte accesses (needs hidden % 8 == 0); VEC = 1 is scalar.
#include "common.cuh"

namespace llmserve {

// Load VEC elements of row `x` at `i` as fp32.
template <typename T, int VEC>
__device__ __forceinline__ void load_vec(const T* __restrict__ x, int i, float (&dst)[VEC]) {
  if constexpr (VEC == 8) {
    load8(x + i, dst);
  } else {
#pragma unroll
    for (int e = 0; e < VEC; ++e) dst[e] = to_float(x[i + e]);
  }
}

template <typename T, int VEC>
__device__ __forceinline__ void store_vec(T* __restrict__ y, int i, const float (&src)[VEC]) {
  if constexpr (VEC == 8) {
    store8(y + i, src);
  } else {
#pragma unroll
    for (int e = 0; e < VEC; ++e) y[i + e] = from_float<T>(src[e]);
  }
}

// y = (x * inv_rms) * w, in the reference's order of operations.
template <typename T, typename W, int VEC>
__device__ __forceinline__ void scale_store(T* __restrict__ y, const W* __restrict__ weight, int i,
                                            float (&v)[VEC], float inv_rms) {
#pragma unroll
  for (int e = 0; e < VEC; ++e) v[e] = (v[e] * inv_rms) * to_float(weight[i + e]);
  store_vec<T, VEC>(y, i, v);
}

template <typename T, typename W, int VEC, int NUM_WARPS>
__global__ void __launch_bounds__(NUM_WARPS * WARP_SIZE) rms_norm_kernel(
    T* __restrict__ out,            // [num_tokens, hidden]
    const T* __restrict__ x,        // [num_tokens, hidden]
    const W* __restrict__ weight,   // [hidden]
    const int hidden, const float eps) {
  __shared__ float red[NUM_WARPS];
  const T* __restrict__ row = x + (long long)blockIdx.x * hidden;
  T* __restrict__ dst = out + (long long)blockIdx.x * hidden;
  // Stage 1: sum of squares over the row.
  float sq = 0.f;
  for (int i = threadIdx.x * VEC; i < hidden; i += blockDim.x * VEC) {
    float v[VEC];
    load_vec<T, VEC>(row, i, v);
#pragma unroll
    for (int e = 0; e < VEC; ++e) sq = fmaf(v[e], v[e], sq);
  }
  const float inv_rms = rsqrtf(block_sum<NUM_WARPS>(sq, red) / hidden + eps);
  // Stage 2: normalise and scale.
  for (int i = threadIdx.x * VEC; i < hidden; i += blockDim.x * VEC) {
    float v[VEC];
    load_vec<T, VEC>(row, i, v);
    scale_store<T, W, VEC>(dst, weight, i, v, inv_rms);
  }
}

template <typename T, typename W, int VEC, int NUM_WARPS>
__global__ void __launch_bounds__(NUM_WARPS * WARP_SIZE) fused_add_rms_norm_kernel(
    T* __restrict__ out,            // [num_tokens, hidden]  rms_norm(x + residual)
    T* __restrict__ residual_out,   // [num_tokens, hidden]  x + residual (rounded to T)
    const T* __restrict__ x,        // [num_tokens, hidden]
    const T* __restrict__ residual, // [num_tokens, hidden]
    const W* __restrict__ weight,   // [hidden]
    const int hidden, const float eps) {
  __shared__ float red[NUM_WARPS];
  const long long row = (long long)blockIdx.x * hidden;
  // Stage 1: r = x + residual, stored rounded to T; statistics over the rounded r (as the reference).
  float sq = 0.f;
  for (int i = threadIdx.x * VEC; i < hidden; i += blockDim.x * VEC) {
    float a[VEC], b[VEC];
    load_vec<T, VEC>(x + row, i, a);
    load_vec<T, VEC>(residual + row, i, b);
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      a[e] = round_to<T>(a[e] + b[e]);
      sq = fmaf(a[e], a[e], sq);
    }
    store_vec<T, VEC>(residual_out + row, i, a);
  }
  const float inv_rms = rsqrtf(block_sum<NUM_WARPS>(sq, red) / hidden + eps);
  // Stage 2: normalise r (each thread re-reads only what it wrote itself).
  for (int i = threadIdx.x * VEC; i < hidden; i += blockDim.x * VEC) {
    float v[VEC];
    load_vec<T, VEC>(residual_out + row, i, v);
    scale_store<T, W, VEC>(out + row, weight, i, v, inv_rms);
  }
}

}  // namespace llmserve
