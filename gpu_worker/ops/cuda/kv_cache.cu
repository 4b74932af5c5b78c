// KV cache write: token t's K/V rows go to flat cache slot slot_mapping[t]
// (= block * block_size + offset, so the row offset is slot * num_kv_heads * head_dim); -1 skips.
// One CTA per token; VEC = 8 moves 8-element chunks with 16-byte accesses (head_dim % 8 == 0, aligned rows).
#include "common.cuh"

namespace llmserve {

template <typename T, int VEC>
__device__ __forceinline__ void copy_vec(T* __restrict__ dst, const T* __restrict__ src) {
  if constexpr (VEC == 8) {
    const Chunk8<T> c = load_chunk(src);
#pragma unroll
    for (int i = 0; i < Chunk8<T>::VECS; ++i) reinterpret_cast<uint4*>(dst)[i] = c.r[i];
  } else {
#pragma unroll
    for (int e = 0; e < VEC; ++e) dst[e] = src[e];
  }
}

template <typename T, int VEC>
__global__ void write_kv_cache_kernel(
    T* __restrict__ k_cache,                 // [num_blocks, block_size, num_kv_heads, head_dim]
    T* __restrict__ v_cache,                 // [num_blocks, block_size, num_kv_heads, head_dim]
    const T* __restrict__ k,                 // [num_tokens, num_kv_heads, head_dim] (strided)
    const T* __restrict__ v,                 // [num_tokens, num_kv_heads, head_dim] (strided)
    const long long* __restrict__ slot_mapping,  // [num_tokens]
    const long long k_token_stride, const long long k_head_stride,
    const long long v_token_stride, const long long v_head_stride,
    const int num_kv_heads, const int head_dim) {
  const int t = blockIdx.x;
  const long long slot = slot_mapping[t];
  if (slot < 0) return;  // padding token: nothing to cache
  const int row = num_kv_heads * head_dim;
  T* __restrict__ kd = k_cache + slot * row;
  T* __restrict__ vd = v_cache + slot * row;
  for (int i = threadIdx.x * VEC; i < row; i += blockDim.x * VEC) {
    const int h = i / head_dim, d = i % head_dim;
    copy_vec<T, VEC>(kd + i, k + t * k_token_stride + h * k_head_stride + d);
    copy_vec<T, VEC>(vd + i, v + t * v_token_stride + h * v_head_stride + d);
  }
}

}  // namespace llmserve
