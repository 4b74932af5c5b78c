// Small kernels that break one CUDA rule each (or check one shim service): test_shim.py launches
// them through cpu_backend to show the CPU executor reports what a GPU would punish.
#include "common.cuh"

namespace probe {

// out[i] = bits of from_float<T>(x[i]); back[i] = to_float of those bits (the 16-bit conversions).
template <typename T>
__global__ void convert_kernel(unsigned short* __restrict__ out, float* __restrict__ back,
                               const float* __restrict__ x, const int n) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    const T h = llmserve::from_float<T>(x[i]);
    out[i] = h.bits;
    back[i] = llmserve::to_float(h);
  }
}

// out[i] = to_float(bits[i]): widening every 16-bit pattern.
template <typename T>
__global__ void widen_kernel(float* __restrict__ out, const unsigned short* __restrict__ bits, const int n) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    out[i] = llmserve::to_float(T{bits[i]});
}

// A 16-byte chunk load from src + offset elements: misaligned unless offset % 8 == 0 (fp16).
__global__ void chunk_load_kernel(float* __restrict__ out, const llmserve::f16* __restrict__ src, const int offset) {
  float v[8];
  llmserve::load8(src + offset, v);
  out[threadIdx.x] = v[0];
}

// Lanes 0..15 shuffle with a half-warp mask, lanes 16..31 with the full one.
__global__ void mismatched_mask_kernel(float* __restrict__ out) {
  const unsigned mask = threadIdx.x < 16 ? 0x0000ffffu : 0xffffffffu;
  out[threadIdx.x] = __shfl_xor_sync(mask, static_cast<float>(threadIdx.x), 1);
}

// A half-warp mask that is right for the lanes calling it, reading only partners inside it.
__global__ void half_warp_shuffle_kernel(float* __restrict__ out) {
  float v = static_cast<float>(threadIdx.x);
  if (threadIdx.x < 16) v = __shfl_xor_sync(0x0000ffffu, v, 1);
  out[threadIdx.x] = v;
}

// Warp 0 waits at one __syncthreads, the other warps at another.
__global__ void divergent_barrier_kernel(float* __restrict__ out) {
  if (threadIdx.x < 32) {
    __syncthreads();
  } else {
    __syncthreads();
  }
  out[threadIdx.x] = 1.f;
}

// Thread 0 leaves before the barrier the others wait at.
__global__ void early_exit_barrier_kernel(float* __restrict__ out) {
  if (threadIdx.x == 0) return;
  __syncthreads();
  out[threadIdx.x] = 1.f;
}

// Lane 0 leaves; the others shuffle with a full-warp mask that still names it.
__global__ void exited_lane_shuffle_kernel(float* __restrict__ out) {
  if (threadIdx.x == 0) return;
  out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1.f, 1);
}

// Reads shared memory nobody wrote (poisoned with NaN before the block).
__global__ void unwritten_shared_kernel(float* __restrict__ out) {
  __shared__ float buf[64];
  out[threadIdx.x] = buf[threadIdx.x];
}

// Each thread reads its neighbour's shared slot without a barrier between write and read: a race.
__global__ void racy_shared_kernel(float* __restrict__ out) {
  __shared__ float buf[64];
  buf[threadIdx.x] = static_cast<float>(threadIdx.x);
  out[threadIdx.x] = buf[(threadIdx.x + 1) % blockDim.x];
}

// The same exchange with the barrier: no race.
__global__ void synced_shared_kernel(float* __restrict__ out) {
  __shared__ float buf[64];
  buf[threadIdx.x] = static_cast<float>(threadIdx.x);
  __syncthreads();
  out[threadIdx.x] = buf[(threadIdx.x + 1) % blockDim.x];
}

// Declares room for 64 threads per block.
__global__ void __launch_bounds__(64) bounded_kernel(float* __restrict__ out) { out[threadIdx.x] = 1.f; }

// Writes one element past n: what the AddressSanitizer run must name by line.
__global__ void out_of_bounds_kernel(float* __restrict__ out, const int n) {
  out[n] = 1.f;
}

}  // namespace probe
