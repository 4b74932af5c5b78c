// Weight-only int8 linear for decode: out[t, n] = scale[n] * sum_k x[t, k] * q[n, k].
//
// Decode is memory-bound: each step reads every weight once, so the weights stay int8 in memory
// (a quarter of fp32, half of fp16) and are widened in registers. One warp computes one output
// row n for the CTA's TOKENS tokens: each lane loads 16 int8 weights with one 16-byte access per
// step along K and multiplies them with the matching 16 activations of every token, so the row is
// read once for all of them. The per-token sum order (lane chunks in K order, then the warp's
// butterfly) does not depend on how many tokens the call has or which CTA takes a token, so a
// sequence's output is the same bits in any decode batch.
#include "common.cuh"

namespace llmserve {

template <typename T, int TOKENS, int WARPS>
__global__ void __launch_bounds__(WARPS * WARP_SIZE) int8_gemv_kernel(  // grid = (ceil(N / WARPS), ceil(T / TOKENS))
    T* __restrict__ out,                // [num_tokens, n_rows]
    const T* __restrict__ x,            // [num_tokens, k_cols]; rows 16-byte aligned
    const signed char* __restrict__ q,  // [n_rows, k_cols] int8; k_cols a multiple of 16
    const float* __restrict__ scale,    // [n_rows]
    const int num_tokens, const int n_rows, const int k_cols) {
  const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
  const int row = blockIdx.x * WARPS + warp;
  const int t0 = blockIdx.y * TOKENS;
  if (row >= n_rows) return;  // a whole warp leaves: the shuffles below stay full-warp
  float acc[TOKENS];
#pragma unroll
  for (int t = 0; t < TOKENS; ++t) acc[t] = 0.f;
  const signed char* __restrict__ wrow = q + (long long)row * k_cols;
  for (int k = lane * 16; k < k_cols; k += WARP_SIZE * 16) {
    const uint4 packed = *reinterpret_cast<const uint4*>(wrow + k);
    const signed char* w = reinterpret_cast<const signed char*>(&packed);
    float wf[16];
#pragma unroll
    for (int e = 0; e < 16; ++e) wf[e] = static_cast<float>(w[e]);
#pragma unroll
    for (int t = 0; t < TOKENS; ++t) {
      if (t0 + t < num_tokens) {
        const T* __restrict__ xr = x + (long long)(t0 + t) * k_cols + k;
        float lo[8], hi[8];
        load8(xr, lo);
        load8(xr + 8, hi);
        float s = 0.f;
#pragma unroll
        for (int e = 0; e < 8; ++e) s += wf[e] * lo[e];
#pragma unroll
        for (int e = 0; e < 8; ++e) s += wf[8 + e] * hi[e];
        acc[t] += s;
      }
    }
  }
#pragma unroll
  for (int t = 0; t < TOKENS; ++t) {
    const float total = warp_sum<WARP_SIZE>(acc[t]);
    if (lane == 0 && t0 + t < num_tokens) out[(long long)(t0 + t) * n_rows + row] = from_float<T>(total * scale[row]);
  }
}

}  // namespace llmserve
