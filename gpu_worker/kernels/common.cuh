// Shared device helpers for the llmserve kernels: element types, 16-byte vector
// loads/stores, warp reductions. NVRTC-safe: no host or C++ standard headers,
// only cuda_fp16.h / cuda_bf16.h, which NVRTC ships built in.
#pragma once

#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace llmserve {

constexpr int WARP_SIZE = 32;
constexpr float NEG_BIG = -3.0e38f;  // finite "-inf": exp2(NEG_BIG - NEG_BIG) = 1, never NaN
constexpr float LOG2E = 1.4426950408889634f;

// ---- scalar conversions (fp32 is the compute type of every kernel) ----
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// Round-trip through T: the value a T store followed by a load would give.
template <typename T> __device__ __forceinline__ float round_to(float x) { return to_float(from_float<T>(x)); }

// ---- 8-element chunks moved with 16-byte accesses (LDG.128/STG.128) ----
// A chunk is 8 elements: one 16-byte vector for fp16/bf16, two for fp32. Pointers must be
// 16-byte aligned (row sizes divisible by 8 elements).
template <typename T>
struct Chunk8 {
  static constexpr int VECS = sizeof(T) * 8 / 16;
  uint4 r[VECS];
};

// Raw load, widened later: lets several loads be in flight before first use.
template <typename T>
__device__ __forceinline__ Chunk8<T> load_chunk(const T* __restrict__ src) {
  Chunk8<T> c;
#pragma unroll
  for (int i = 0; i < Chunk8<T>::VECS; ++i) c.r[i] = reinterpret_cast<const uint4*>(src)[i];
  return c;
}

template <typename T>
__device__ __forceinline__ Chunk8<T> zero_chunk() {
  Chunk8<T> c;
#pragma unroll
  for (int i = 0; i < Chunk8<T>::VECS; ++i) c.r[i] = make_uint4(0, 0, 0, 0);
  return c;
}

template <typename T>
__device__ __forceinline__ void widen8(const Chunk8<T>& c, float (&dst)[8]) {
  const T* e = reinterpret_cast<const T*>(c.r);
#pragma unroll
  for (int i = 0; i < 8; ++i) dst[i] = to_float(e[i]);
}

// Load 8 elements and widen them to fp32.
template <typename T>
__device__ __forceinline__ void load8(const T* __restrict__ src, float (&dst)[8]) {
  widen8<T>(load_chunk(src), dst);
}

// Narrow 8 fp32 values to T and store them with 16-byte accesses.
template <typename T>
__device__ __forceinline__ void store8(T* __restrict__ dst, const float (&src)[8]) {
  Chunk8<T> c;
  T* e = reinterpret_cast<T*>(c.r);
#pragma unroll
  for (int i = 0; i < 8; ++i) e[i] = from_float<T>(src[i]);
#pragma unroll
  for (int i = 0; i < Chunk8<T>::VECS; ++i) reinterpret_cast<uint4*>(dst)[i] = c.r[i];
}

// ---- reductions ----
template <int WIDTH>
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int mask = WIDTH / 2; mask >= 1; mask /= 2) x += __shfl_xor_sync(0xffffffffu, x, mask);
  return x;
}

template <int WIDTH>
__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int mask = WIDTH / 2; mask >= 1; mask /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, mask));
  return x;
}

// Sum over the whole thread block; every thread gets the result. red: NUM_WARPS floats of shared memory.
template <int NUM_WARPS>
__device__ __forceinline__ float block_sum(float x, float* __restrict__ red) {
  const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
  x = warp_sum<WARP_SIZE>(x);
  if (lane == 0) red[warp] = x;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < NUM_WARPS; ++w) total += red[w];
  __syncthreads();  // red may be reused right after
  return total;
}

}  // namespace llmserve
