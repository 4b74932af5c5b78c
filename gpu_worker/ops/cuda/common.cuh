// Shared device helpers for the llmserve kernels: element types, 8-element chunk loads/stores,
// warp and block reductions. Header-free on purpose: NVRTC (CuPy's RawModule) ships no
// cuda_fp16.h / cuda_bf16.h, and include paths differ between machines, so the two 16-bit types
// are plain storage structs converted with PTX cvt instructions (integer ops for bf16 below sm_80).
#pragma once

namespace llmserve {

inline constexpr int WARP_SIZE = 32;
inline constexpr float NEG_BIG = -3.0e38f;  // finite "-inf": exp2(NEG_BIG - NEG_BIG) = 1, never NaN
inline constexpr float LOG2E = 1.4426950408889634f;

// ---- 16-bit storage types (torch.float16 / torch.bfloat16 bit patterns) ----
struct alignas(2) f16 { unsigned short bits; };
struct alignas(2) bf16 { unsigned short bits; };

// ---- scalar conversions (fp32 is the compute type of every kernel) ----
// fp16 ones are PTX cvt instructions; tests/cuda_cpu/cuda_shim.h, which runs these kernels on the
// CPU, defines LLMSERVE_HOST_CONVERSIONS and bit-exact software versions of the two.
#ifndef LLMSERVE_HOST_CONVERSIONS
__device__ __forceinline__ float f16_bits_to_float(unsigned short bits) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(bits));
  return f;
}
__device__ __forceinline__ unsigned short float_to_f16_bits(float x) {  // round to nearest even
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
  return h;
}
#endif

// Round to nearest even, NaN to the canonical 0x7fff. cvt.rn.bf16.f32 needs sm_80; below that (and
// on the CPU) the same rounding in integer ops, so bf16 models run on older GPUs too.
__device__ __forceinline__ unsigned short float_to_bf16_bits(float x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  unsigned short h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x));
  return h;
#else
  const unsigned u = __float_as_uint(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fff;
  return static_cast<unsigned short>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
#endif
}

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(f16 x) { return f16_bits_to_float(x.bits); }
__device__ __forceinline__ float to_float(bf16 x) { return __uint_as_float(static_cast<unsigned>(x.bits) << 16); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ f16 from_float<f16>(float x) { return f16{float_to_f16_bits(x)}; }
template <> __device__ __forceinline__ bf16 from_float<bf16>(float x) { return bf16{float_to_bf16_bits(x)}; }

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
