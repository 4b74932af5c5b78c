// Rotary position embedding, out of place, for q and k of one step. One CTA per token.
//   INTERLEAVED: rotates pairs (2i, 2i+1)  (GGUF / Meta layout)
//   otherwise:   rotates pairs (i, i + D/2) (Hugging Face rotate_half layout)
// cos_sin[p, :D/2] = cos(p * inv_freq), cos_sin[p, D/2:] = sin(p * inv_freq).
#include "common.cuh"

namespace llmserve {

// Indices of the two elements of rotation pair i in a head of size head_dim.
template <bool INTERLEAVED>
__device__ __forceinline__ void pair_index(int i, int half, int& a, int& b) {
  a = INTERLEAVED ? 2 * i : i;
  b = INTERLEAVED ? 2 * i + 1 : i + half;
}

// Rotate every pair of n_heads heads of one token: src rows are strided, dst rows are contiguous.
template <typename T, bool INTERLEAVED>
__device__ __forceinline__ void rotate_heads(
    T* __restrict__ dst,             // [n_heads, head_dim] of this token
    const T* __restrict__ src,       // this token's first head; heads src_head_stride apart
    const long long src_head_stride,
    const float* __restrict__ cs,    // [head_dim] this position's cos | sin
    const int n_heads, const int head_dim) {
  const int half = head_dim / 2;
  for (int w = threadIdx.x; w < n_heads * half; w += blockDim.x) {
    const int h = w / half, i = w % half;
    int a, b;
    pair_index<INTERLEAVED>(i, half, a, b);
    const T* __restrict__ x = src + h * src_head_stride;
    const float x1 = to_float(x[a]), x2 = to_float(x[b]);
    const float c = cs[i], s = cs[half + i];
    dst[h * head_dim + a] = from_float<T>(x1 * c - x2 * s);
    dst[h * head_dim + b] = from_float<T>(x2 * c + x1 * s);
  }
}

template <typename T, bool INTERLEAVED>
__global__ void rotary_kernel(
    T* __restrict__ q_out,               // [num_tokens, num_q_heads, head_dim]
    T* __restrict__ k_out,               // [num_tokens, num_kv_heads, head_dim]
    const T* __restrict__ q,             // [num_tokens, num_q_heads, head_dim] (strided)
    const T* __restrict__ k,             // [num_tokens, num_kv_heads, head_dim] (strided)
    const long long* __restrict__ positions,  // [num_tokens]
    const float* __restrict__ cos_sin,   // [max_pos, head_dim]
    const long long q_token_stride, const long long q_head_stride,
    const long long k_token_stride, const long long k_head_stride,
    const int num_q_heads, const int num_kv_heads, const int head_dim) {
  const int t = blockIdx.x;
  const float* __restrict__ cs = cos_sin + positions[t] * head_dim;
  rotate_heads<T, INTERLEAVED>(q_out + (long long)t * num_q_heads * head_dim, q + t * q_token_stride,
                               q_head_stride, cs, num_q_heads, head_dim);
  rotate_heads<T, INTERLEAVED>(k_out + (long long)t * num_kv_heads * head_dim, k + t * k_token_stride,
                               k_head_stride, cs, num_kv_heads, head_dim);
}

}  // namespace llmserve
