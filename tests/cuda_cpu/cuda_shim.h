// CUDA built-ins for running the unchanged gpu_worker/ops/cuda/*.cu on the CPU (tests only).
//
// Every CUDA thread of a block is a fiber: its own stack, switched cooperatively by a six-register
// context switch. Blocks run one after another; the threads of a block run until they reach a
// collective and wait there:
//
//   __syncthreads()      a barrier of the block's fibers, every live thread at the same call site
//   __shfl_xor_sync()    a rendezvous of the lanes named in the mask, all with that mask and site
//
// The block and thread orders (forward, reverse, random) are the launch's choice: a result that
// changes with them is a race. __shared__ arrays live in one section, filled with 0xff (NaN in
// every float type) before each block. Misuse a GPU would punish (misaligned vector access, mask
// mismatch, divergent barrier, deadlock, more threads than __launch_bounds__) ends the launch with
// an error message naming the .cu line. x86-64 only (the context switch is written for it).
#pragma once

#include <sys/mman.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

#if !defined(__x86_64__)
#error "cuda_shim.h: the fiber context switch is written for x86-64"
#endif

// ---------------------------------------------------------------- CUDA keywords and types

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __restrict__ __restrict
#define __launch_bounds__(...)  // read from the source by the Python builder, checked at launch
#define __shared__ __attribute__((section("cudashim_shared"))) static

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
};
struct alignas(16) uint4 {  // CUDA aligns it to 16 bytes: a misaligned uint4 access is an error
  unsigned x, y, z, w;
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return uint4{x, y, z, w}; }

template <typename T>
inline T min(T a, T b) { return b < a ? b : a; }
template <typename T>
inline T max(T a, T b) { return a < b ? b : a; }

inline float __uint_as_float(unsigned u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float __int_as_float(int i) {
  float f;
  std::memcpy(&f, &i, 4);
  return f;
}
inline unsigned __float_as_uint(float f) {
  unsigned u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float __expf(float x) { return expf(x); }
inline float rsqrtf(float x) { return 1.f / sqrtf(x); }

// ---------------------------------------------------------------- 16-bit conversions (bit-exact)
// The PTX cvt instructions common.cuh uses for fp16 on the GPU, in software: round to nearest even;
// NaN maps to the canonical quiet NaN as cvt does. (bf16 is integer code in common.cuh itself.)

#define LLMSERVE_HOST_CONVERSIONS
namespace llmserve {

inline float f16_bits_to_float(unsigned short h) {
  const unsigned sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ffu;
  if (exp == 0x1f) return __uint_as_float(sign | 0x7f800000u | (man << 13));  // inf / NaN
  if (exp != 0) return __uint_as_float(sign | ((exp + 112) << 23) | (man << 13));
  const float mag = static_cast<float>(man) * 5.9604644775390625e-8f;  // subnormal: man * 2^-24
  return sign ? -mag : mag;
}

inline unsigned short float_to_f16_bits(float x) {
  const unsigned u = __float_as_uint(x), sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return 0x7fff;                              // NaN
  if (a >= 0x477ff000u) return static_cast<unsigned short>(sign | 0x7c00u);  // rounds to inf
  if (a < 0x38800000u) {                                           // f16 subnormal or zero
    const unsigned man = (a & 0x7fffffu) | 0x800000u, shift = 126 - (a >> 23);
    if (shift > 24) return static_cast<unsigned short>(sign);
    const unsigned q = man >> shift, rem = man & ((1u << shift) - 1), half = 1u << (shift - 1);
    return static_cast<unsigned short>(sign | (q + (rem > half || (rem == half && (q & 1)))));
  }
  const unsigned r = a + 0xfffu + ((a >> 13) & 1);                 // round the 13 dropped bits
  return static_cast<unsigned short>(sign | ((r - 0x38000000u) >> 13));
}

}  // namespace llmserve

// ---------------------------------------------------------------- fiber runtime

extern "C" void cudashim_switch(void** save_sp, void* load_sp);
extern "C" void cudashim_fiber_entry();
extern "C" __attribute__((visibility("hidden"))) void cudashim_fiber_main();

// Save the callee-saved registers on this stack, store its pointer, load the other one's, return there.
asm(R"(
  .text
  .p2align 4
  .globl cudashim_switch
  .hidden cudashim_switch
  .type cudashim_switch, @function
cudashim_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size cudashim_switch, .-cudashim_switch

  .p2align 4
  .globl cudashim_fiber_entry
  .hidden cudashim_fiber_entry
  .type cudashim_fiber_entry, @function
cudashim_fiber_entry:
  andq $-16, %rsp
  call cudashim_fiber_main
  ud2
  .size cudashim_fiber_entry, .-cudashim_fiber_entry
)");

extern "C" char __start_cudashim_shared[] __attribute__((weak));
extern "C" char __stop_cudashim_shared[] __attribute__((weak));

namespace cudashim {

enum class Wait { RUNNING, BARRIER, SHUFFLE, DONE };
enum class Order : int { FORWARD = 0, REVERSE = 1, RANDOM = 2 };

struct Site {
  const char* file = "";
  int line = 0;
  bool operator==(const Site& o) const { return line == o.line && std::strcmp(file, o.file) == 0; }
  std::string str() const {
    const char* base = std::strrchr(file, '/');
    return std::string(base ? base + 1 : file) + ":" + std::to_string(line);
  }
};

struct Fiber {
  void* sp = nullptr;
  dim3 tid;
  int linear = 0;
  Wait wait = Wait::RUNNING;
  Site site;
  unsigned shfl_mask = 0;   // this lane's pending shuffle
  int shfl_src = 0;
  uint64_t shfl_value = 0;
  int shuffles = 0;         // shuffles completed, and the mask and site of the last one
  unsigned last_mask = 0;
  Site last_site;
  void* fake_stack = nullptr;  // AddressSanitizer's bookkeeping of the switched-out stack
};

// One pending rendezvous of a warp: lanes with the same mask (disjoint masks may wait side by side).
struct ShuffleGroup {
  unsigned mask;
  Site site;
  int arrived;
};

// What Python passes to a launch (ctypes.Structure LaunchConfig in cpu_backend.py).
struct LaunchConfig {
  unsigned grid[3];
  unsigned block[3];
  int order;
  unsigned seed;
};

struct Runtime {
  dim3 grid_dim, block_dim, block_idx;
  std::vector<Fiber> fibers;
  std::vector<int> schedule;  // fiber indices in the order they are resumed
  std::vector<std::vector<ShuffleGroup>> warp_shuffles;  // pending rendezvous per warp
  Fiber* current = nullptr;
  void* sched_sp = nullptr;
  const void* sched_stack_bottom = nullptr;
  size_t sched_stack_size = 0;
  char* stacks = nullptr;
  size_t stacks_bytes = 0;
  size_t stack_size = 0;
  void (*body)(void*) = nullptr;
  void* body_ctx = nullptr;
  std::string error;
  int live = 0;       // fibers not DONE
  int at_barrier = 0;
  Site barrier_site;
  uint64_t rng = 1;
};

inline Runtime rt;

inline const dim3& thread_idx() { return rt.current->tid; }

#if defined(__SANITIZE_ADDRESS__)
constexpr size_t STACK_SIZE = 512 * 1024;  // instrumented frames are several times larger
#else
constexpr size_t STACK_SIZE = 64 * 1024;
#endif
constexpr size_t GUARD = 4096;  // an inaccessible page below each stack: an overflow faults

inline uint64_t next_random() {  // xorshift64*
  rt.rng ^= rt.rng >> 12;
  rt.rng ^= rt.rng << 25;
  rt.rng ^= rt.rng >> 27;
  return rt.rng * 2685821657736338717ull;
}

template <typename V>
inline void shuffle_in_place(V& v) {
  for (size_t i = v.size(); i > 1; --i) std::swap(v[i - 1], v[next_random() % i]);
}

inline void order_in_place(std::vector<int>& v, Order order) {
  if (order == Order::REVERSE) std::reverse(v.begin(), v.end());
  if (order == Order::RANDOM) shuffle_in_place(v);
}

inline char* stack_base(int i) { return rt.stacks + i * (rt.stack_size + GUARD) + GUARD; }

inline bool ensure_stacks(int n) {
  const size_t need = n * (STACK_SIZE + GUARD);
  if (need <= rt.stacks_bytes) return true;
  if (rt.stacks) munmap(rt.stacks, rt.stacks_bytes);
  void* p = mmap(nullptr, need, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return false;
  rt.stacks = static_cast<char*>(p);
  rt.stacks_bytes = need;
  rt.stack_size = STACK_SIZE;
  for (int i = 0; i < n; ++i) mprotect(stack_base(i) - GUARD, GUARD, PROT_NONE);
  return true;
}

// A fresh stack whose first switch-in "returns" into cudashim_fiber_entry.
inline void reset_fiber_stack(Fiber& f, int i) {
  char* base = stack_base(i);
#if defined(__SANITIZE_ADDRESS__)
  __asan_unpoison_memory_region(base, rt.stack_size);  // frames of an aborted block stay poisoned
#endif
  uint64_t* s = reinterpret_cast<uint64_t*>(base + rt.stack_size);
  *--s = 0;
  *--s = reinterpret_cast<uint64_t>(&cudashim_fiber_entry);
  for (int r = 0; r < 6; ++r) *--s = 0;  // rbp rbx r12 r13 r14 r15
  f.sp = s;
}

// ---- switching, with AddressSanitizer told which stack is live

inline void switch_to_fiber(Fiber& f) {
  rt.current = &f;
#if defined(__SANITIZE_ADDRESS__)
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(&fake, stack_base(&f - rt.fibers.data()), rt.stack_size);
  cudashim_switch(&rt.sched_sp, f.sp);
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#else
  cudashim_switch(&rt.sched_sp, f.sp);
#endif
}

inline void switch_to_scheduler(bool final_switch = false) {
  Fiber& f = *rt.current;
#if defined(__SANITIZE_ADDRESS__)
  __sanitizer_start_switch_fiber(final_switch ? nullptr : &f.fake_stack, rt.sched_stack_bottom,
                                 rt.sched_stack_size);
  cudashim_switch(&f.sp, rt.sched_sp);
  __sanitizer_finish_switch_fiber(f.fake_stack, nullptr, nullptr);
#else
  (void)final_switch;
  cudashim_switch(&f.sp, rt.sched_sp);
#endif
}

// End the block with an error: this fiber never runs again, the scheduler abandons the rest.
[[noreturn]] inline void fail(const std::string& message) {
  if (rt.error.empty()) rt.error = message;
  for (;;) switch_to_scheduler(true);
}

inline std::string thread_name(const Fiber& f) {
  return "thread (" + std::to_string(f.tid.x) + "," + std::to_string(f.tid.y) + "," + std::to_string(f.tid.z) +
         ") of block (" + std::to_string(rt.block_idx.x) + "," + std::to_string(rt.block_idx.y) + "," +
         std::to_string(rt.block_idx.z) + ")";
}

inline char hex_digit(unsigned v) { return "0123456789abcdef"[v & 15]; }
inline std::string hex(unsigned v) {
  std::string s = "0x";
  for (int i = 7; i >= 0; --i) s += hex_digit(v >> (4 * i));
  return s;
}

// ---- __syncthreads: every live fiber of the block, at one call site

inline void release_barrier() {
  for (Fiber& f : rt.fibers)
    if (f.wait == Wait::BARRIER) f.wait = Wait::RUNNING;
  rt.at_barrier = 0;
}

inline void syncthreads(const char* file, int line) {
  Fiber& me = *rt.current;
  const Site site{file, line};
  if (rt.at_barrier == 0) rt.barrier_site = site;
  else if (!(rt.barrier_site == site))
    fail("__syncthreads() reached from different places: " + rt.barrier_site.str() + " and " + site.str() +
         " (" + thread_name(me) + ")");
  if (rt.live < static_cast<int>(rt.fibers.size()))
    fail("__syncthreads() at " + site.str() + " after some threads of the block exited (" + thread_name(me) + ")");
  me.wait = Wait::BARRIER;
  me.site = site;
  if (++rt.at_barrier == rt.live) release_barrier();
  switch_to_scheduler();
}

// ---- __shfl_xor_sync: a rendezvous of the lanes in `mask`

inline Fiber* warp_lanes(const Fiber& me) { return &rt.fibers[me.linear / 32 * 32]; }

inline int warp_width(const Fiber& me) {
  const int first = me.linear / 32 * 32;
  return min(32, static_cast<int>(rt.fibers.size()) - first);
}

inline std::vector<ShuffleGroup>& warp_groups(const Fiber& me) { return rt.warp_shuffles[me.linear / 32]; }

[[noreturn]] inline void fail_mismatch(unsigned mask_a, const Site& a, unsigned mask_b, const Site& b, int lane) {
  fail("__shfl_xor_sync: mismatched masks in one warp: " + hex(mask_a) + " at " + a.str() + " vs " + hex(mask_b) +
       " at " + b.str() + " (lane " + std::to_string(lane) + ")");
}

// The first lane of a new rendezvous: every lane the mask names must be able to join it.
inline void check_new_group(const Fiber& me, unsigned mask, const Site& site) {
  const Fiber* lanes = warp_lanes(me);
  const int width = warp_width(me), lane = me.linear % 32;
  for (int l = 0; l < 32; ++l) {
    if (!((mask >> l) & 1u)) continue;
    if (l >= width) fail("__shfl_xor_sync at " + site.str() + ": mask " + hex(mask) + " names lane " +
                         std::to_string(l) + " beyond the block (" + thread_name(me) + ")");
    const Fiber& o = lanes[l];
    if (o.wait == Wait::DONE)
      fail("__shfl_xor_sync at " + site.str() + ": lane " + std::to_string(l) + " of the mask has exited");
    if (o.shuffles > me.shuffles && o.last_site == site && o.last_mask != mask)  // it went on without us
      fail_mismatch(o.last_mask, o.last_site, mask, site, lane);
  }
}

// Join (or open) this lane's rendezvous; returns it.
inline ShuffleGroup& arrive_at_shuffle(const Fiber& me, unsigned mask, const Site& site) {
  const int lane = me.linear % 32;
  if (!((mask >> lane) & 1u))
    fail("__shfl_xor_sync at " + site.str() + ": mask " + hex(mask) + " excludes the calling lane " +
         std::to_string(lane) + " (" + thread_name(me) + ")");
  std::vector<ShuffleGroup>& groups = warp_groups(me);
  for (ShuffleGroup& g : groups) {
    if (g.mask == mask && !(g.site == site)) fail_mismatch(g.mask, g.site, mask, site, lane);
    if (g.mask == mask) {
      ++g.arrived;
      return g;
    }
    if (g.mask & mask) fail_mismatch(g.mask, g.site, mask, site, lane);
  }
  check_new_group(me, mask, site);
  groups.push_back(ShuffleGroup{mask, site, 1});
  return groups.back();
}

// All lanes of the mask have arrived: each gets its partner's value (its own past the width).
inline void complete_shuffle(Fiber* lanes, const ShuffleGroup& g) {
  uint64_t got[32];
  for (int l = 0; l < 32; ++l) {
    if (!((g.mask >> l) & 1u)) continue;
    const int src = lanes[l].shfl_src;
    if (!((g.mask >> src) & 1u))
      fail("__shfl_xor_sync at " + g.site.str() + ": lane " + std::to_string(l) + " reads lane " +
           std::to_string(src) + ", which is not in the mask " + hex(g.mask));
    got[l] = lanes[src].shfl_value;
  }
  for (int l = 0; l < 32; ++l) {
    if (!((g.mask >> l) & 1u)) continue;
    lanes[l].shfl_value = got[l];
    lanes[l].wait = Wait::RUNNING;
    lanes[l].last_mask = g.mask;
    lanes[l].last_site = g.site;
    ++lanes[l].shuffles;
  }
}

template <typename T>
inline T shfl_xor(const char* file, int line, unsigned mask, T var, int lane_mask, int width = 32) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>, "shuffle of a register-sized value");
  Fiber& me = *rt.current;
  const Site site{file, line};
  ShuffleGroup& group = arrive_at_shuffle(me, mask, site);
  const int lane = me.linear % 32, src = lane ^ lane_mask;
  me.wait = Wait::SHUFFLE;
  me.site = site;
  me.shfl_mask = mask;
  me.shfl_src = (src / width == lane / width && src < 32) ? src : lane;
  me.shfl_value = 0;
  std::memcpy(&me.shfl_value, &var, sizeof(T));
  if (group.arrived == __builtin_popcount(mask)) {
    complete_shuffle(warp_lanes(me), group);
    std::vector<ShuffleGroup>& groups = warp_groups(me);
    groups.erase(groups.begin() + (&group - groups.data()));
  }
  switch_to_scheduler();
  T out;
  std::memcpy(&out, &me.shfl_value, sizeof(T));
  return out;
}

// ---- one block

inline std::string describe_waits() {
  std::string s;
  for (const Fiber& f : rt.fibers) {
    if (f.wait == Wait::DONE || f.wait == Wait::RUNNING) continue;
    s += "\n  " + thread_name(f) + (f.wait == Wait::BARRIER ? " waits at __syncthreads() " : " waits at __shfl_xor_sync() ") +
         f.site.str();
    if (s.size() > 2000) return s + "\n  ...";
  }
  return s;
}

inline bool run_block(Order order) {
  const int n = static_cast<int>(rt.fibers.size());
  for (int i = 0; i < n; ++i) {
    rt.fibers[i].wait = Wait::RUNNING;
    reset_fiber_stack(rt.fibers[i], i);
  }
  rt.live = n;
  rt.at_barrier = 0;
  rt.warp_shuffles.assign((n + 31) / 32, {});
  if (__start_cudashim_shared != __stop_cudashim_shared)  // poison: NaN in every float type
    std::memset(__start_cudashim_shared, 0xff, __stop_cudashim_shared - __start_cudashim_shared);
  for (;;) {
    bool progressed = false;
    if (order == Order::RANDOM) shuffle_in_place(rt.schedule);
    for (int i : rt.schedule) {
      if (rt.fibers[i].wait != Wait::RUNNING) continue;
      switch_to_fiber(rt.fibers[i]);
      if (!rt.error.empty()) return false;
      progressed = true;
    }
    if (rt.live == 0) return true;
    if (!progressed) {
      rt.error = "deadlock: no thread can proceed" + describe_waits();
      return false;
    }
  }
}

}  // namespace cudashim

extern "C" __attribute__((visibility("hidden"))) void cudashim_fiber_main() {
  using namespace cudashim;
#if defined(__SANITIZE_ADDRESS__)
  __sanitizer_finish_switch_fiber(nullptr, &rt.sched_stack_bottom, &rt.sched_stack_size);
#endif
  rt.body(rt.body_ctx);
  Fiber& me = *rt.current;
  me.wait = Wait::DONE;
  --rt.live;
  if (rt.at_barrier > 0)
    fail("__syncthreads() at " + rt.barrier_site.str() + " is waited at while " + thread_name(me) + " exited");
  for (const ShuffleGroup& g : warp_groups(me))
    if ((g.mask >> (me.linear % 32)) & 1u)
      fail("__shfl_xor_sync at " + g.site.str() + " with mask " + hex(g.mask) + " is waited at while its lane " +
           std::to_string(me.linear % 32) + " exited");
  for (;;) switch_to_scheduler(true);
}

#define threadIdx (::cudashim::thread_idx())
#define blockIdx (static_cast<const dim3&>(::cudashim::rt.block_idx))
#define blockDim (static_cast<const dim3&>(::cudashim::rt.block_dim))
#define gridDim (static_cast<const dim3&>(::cudashim::rt.grid_dim))
#define __syncthreads() ::cudashim::syncthreads(__FILE__, __LINE__)
#define __shfl_xor_sync(...) ::cudashim::shfl_xor(__FILE__, __LINE__, __VA_ARGS__)

// ---------------------------------------------------------------- misaligned accesses
// The kernels are compiled with -fsanitize=alignment but linked without the UBSan runtime: its
// report hook is this function, which ends the launch with the access, the alignment and the line.

namespace cudashim {
struct UbsanLocation {
  const char* file;
  unsigned line, column;
};
struct UbsanType {
  unsigned short kind, info;
  char name[1];
};
struct UbsanMismatch {
  UbsanLocation loc;
  const UbsanType* type;
  unsigned char log_alignment;
  unsigned char check_kind;
};
}  // namespace cudashim

extern "C" void __ubsan_handle_type_mismatch_v1(cudashim::UbsanMismatch* d, uintptr_t ptr) {
  static const char* const kinds[] = {"load of", "store to", "reference binding to", "member access within"};
  const char* what = d->check_kind < 4 ? kinds[d->check_kind] : "use of";
  const cudashim::Site site{d->loc.file, static_cast<int>(d->loc.line)};
  cudashim::fail(std::string("misaligned ") + what + " " + d->type->name + " (needs " +
                 std::to_string(1u << d->log_alignment) + "-byte alignment) at address offset " +
                 std::to_string(ptr % (1u << d->log_alignment)) + ", " + site.str() + " (" +
                 cudashim::thread_name(*cudashim::rt.current) + ")");
}

// ---------------------------------------------------------------- launch

namespace cudashim {

template <typename A>
inline std::string check_arg(int i, char kind, int size) {
  using P = std::remove_cv_t<A>;
  const std::string where = "argument " + std::to_string(i) + ": ";
  if constexpr (std::is_pointer_v<P>) {
    if (kind != 'p') return where + "kernel takes a pointer, got a scalar";
    if (sizeof(std::remove_pointer_t<P>) != static_cast<size_t>(size))
      return where + "kernel takes " + std::to_string(sizeof(std::remove_pointer_t<P>)) +
             "-byte elements, got a tensor of " + std::to_string(size) + "-byte elements";
  } else {
    const char want = std::is_floating_point_v<P> ? 'f' : sizeof(P) == 8 ? 'l' : 'i';
    if (kind != want || sizeof(P) != static_cast<size_t>(size))
      return where + "kernel takes a " + std::to_string(sizeof(P)) + "-byte " +
             (want == 'f' ? "float" : "integer") + ", got kind '" + kind + "' of " + std::to_string(size) + " bytes";
  }
  return "";
}

template <typename... A, size_t... I>
inline std::string check_args(const char* kinds, const int* sizes, std::index_sequence<I...>) {
  if (std::strlen(kinds) != sizeof...(A))
    return "kernel takes " + std::to_string(sizeof...(A)) + " arguments, got " + std::to_string(std::strlen(kinds));
  std::string err;
  ((err.empty() ? (void)(err = check_arg<A>(static_cast<int>(I), kinds[I], sizes[I])) : (void)0), ...);
  return err;
}

template <typename... A>
struct BoundKernel {
  void (*kernel)(A...);
  void** args;
  template <size_t... I>
  void call(std::index_sequence<I...>) { kernel(*static_cast<std::remove_cv_t<A>*>(args[I])...); }
  static void run(void* self) { static_cast<BoundKernel*>(self)->call(std::index_sequence_for<A...>{}); }
};

inline std::string check_config(const LaunchConfig& c, int max_threads, const char* name) {
  const unsigned threads = c.block[0] * c.block[1] * c.block[2];
  if (threads == 0 || c.grid[0] * c.grid[1] * c.grid[2] == 0) return "empty grid or block";
  if (threads > 1024) return std::to_string(threads) + " threads per block: CUDA allows 1024";
  if (static_cast<int>(threads) > max_threads)
    return std::to_string(threads) + " threads per block exceed __launch_bounds__(" + std::to_string(max_threads) +
           ") of " + name;
  if (c.grid[1] > 65535 || c.grid[2] > 65535) return "grid y/z above 65535";
  return "";
}

inline void setup_block_fibers(const LaunchConfig& c, Order order) {
  const int n = static_cast<int>(c.block[0] * c.block[1] * c.block[2]);
  rt.block_dim = dim3{c.block[0], c.block[1], c.block[2]};
  rt.fibers.assign(n, Fiber{});
  rt.schedule.resize(n);
  for (int i = 0; i < n; ++i) {
    rt.fibers[i].linear = i;
    rt.fibers[i].tid = dim3{i % c.block[0], (i / c.block[0]) % c.block[1], i / (c.block[0] * c.block[1])};
    rt.schedule[i] = i;
  }
  order_in_place(rt.schedule, order);
}

inline std::vector<int> block_order(const LaunchConfig& c, Order order) {
  std::vector<int> blocks(c.grid[0] * c.grid[1] * c.grid[2]);
  for (size_t i = 0; i < blocks.size(); ++i) blocks[i] = static_cast<int>(i);
  order_in_place(blocks, order);
  return blocks;
}

// Run kernel over the grid. 0 on success; otherwise the error is in rt.error (cudashim_error()).
template <typename... A>
int launch(const LaunchConfig& c, void (*kernel)(A...), int max_threads, const char* name, void** args,
           const char* kinds, const int* sizes) {
  rt.error = check_args<A...>(kinds, sizes, std::index_sequence_for<A...>{});
  if (rt.error.empty()) rt.error = check_config(c, max_threads, name);
  if (!rt.error.empty()) return 1;
  const Order order = static_cast<Order>(c.order);
  rt.rng = c.seed * 2654435761ull + 88172645463325252ull;
  if (!ensure_stacks(static_cast<int>(c.block[0] * c.block[1] * c.block[2]))) {
    rt.error = "cannot map fiber stacks";
    return 1;
  }
  BoundKernel<A...> bound{kernel, args};
  rt.body = &BoundKernel<A...>::run;
  rt.body_ctx = &bound;
  rt.grid_dim = dim3{c.grid[0], c.grid[1], c.grid[2]};
  setup_block_fibers(c, order);
  for (int b : block_order(c, order)) {
    rt.block_idx = dim3{b % c.grid[0], (b / c.grid[0]) % c.grid[1], b / (c.grid[0] * c.grid[1])};
    if (!run_block(order)) {
      rt.error = std::string(name) + ": " + rt.error;
      return 1;
    }
  }
  return 0;
}

}  // namespace cudashim

#define CUDASHIM_EXPORT extern "C" __attribute__((visibility("default")))
CUDASHIM_EXPORT const char* cudashim_error() { return cudashim::rt.error.c_str(); }
