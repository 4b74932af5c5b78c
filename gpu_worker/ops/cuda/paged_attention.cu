// Paged decode attention: one query token per sequence over its paged K/V cache.
//
// Work split (flash-decoding):
//   grid = (num_kv_heads * group_chunks, num_seqs, num_partitions)
//   one CTA = one kv head x up to GROUP_MAX of its query heads x one partition of the context,
//   so each K/V byte is read once for the whole GQA group.
//   num_partitions == 1: the CTA covers the whole context and writes the normalised output.
//   num_partitions  > 1: each CTA writes an unnormalised partial (acc, max, sum) and
//                        paged_decode_reduce_kernel merges the partitions.
//
// Inside a CTA, warps take tiles of up to 16 tokens of its KV blocks round robin (a 32- or 64-token
// block is 2 or 4 tiles, so every block size holds the registers of a 16-token one). Inside a warp, L = LANES_PER_TOKEN lanes share a
// token: each lane holds VECS_PER_LANE 8-element chunks (16 bytes in fp16/bf16) of its K/V row (coalesced: the L lanes read
// the token's HEAD_DIM contiguous elements), so a warp covers TOKENS_PER_WARP tokens per load.
//
//   lane:   0 .. L-1 | L .. 2L-1 | ...        chunk of head_dim held by lane: (lane % L) + v * L
//   token:  t        | t+1       | ...
//
// Softmax is online (running max m, sum l, acc rescaled on a new max) in the log2 domain, with
// state kept per token group; groups, then warps, are merged at the end.
#include "common.cuh"

namespace llmserve {

template <int HEAD_DIM, int GROUP_MAX>
struct DecodeLayout {
  static constexpr int CHUNKS = HEAD_DIM / 8;  // 8-element chunks per K/V row
  // Two chunks per lane halve the shuffle reduction, but cost registers; use them while
  // GROUP_MAX * HEAD_DIM stays small enough to avoid spills.
  static constexpr int VECS_PER_LANE = (GROUP_MAX * HEAD_DIM < 256) ? 2 : 1;
  static constexpr int LANES_PER_TOKEN = CHUNKS / VECS_PER_LANE;
  static constexpr int TOKENS_PER_WARP = WARP_SIZE / LANES_PER_TOKEN;
  static_assert(LANES_PER_TOKEN * TOKENS_PER_WARP == WARP_SIZE, "head_dim must be 64 or 128");
};

// Online-softmax state of one lane for its query heads.
template <int GROUP_MAX, int VPL>
struct SoftmaxState {
  float m[GROUP_MAX];              // running max of scores (log2 domain)
  float l[GROUP_MAX];              // running sum of exp2(score - m)
  float acc[GROUP_MAX][VPL][8];    // running sum of exp2(score - m) * v, this lane's chunks
};

// Merge another state (of the same lane slice) into s: both rescaled to the larger max.
template <int GROUP_MAX, int VPL>
__device__ __forceinline__ void merge_from_lane(SoftmaxState<GROUP_MAX, VPL>& s, int mask) {
#pragma unroll
  for (int g = 0; g < GROUP_MAX; ++g) {
    const float m_o = __shfl_xor_sync(0xffffffffu, s.m[g], mask);
    const float l_o = __shfl_xor_sync(0xffffffffu, s.l[g], mask);
    const float m_new = fmaxf(s.m[g], m_o);
    const float a = exp2f(s.m[g] - m_new), b = exp2f(m_o - m_new);
    s.l[g] = s.l[g] * a + l_o * b;
    s.m[g] = m_new;
#pragma unroll
    for (int v = 0; v < VPL; ++v)
#pragma unroll
      for (int e = 0; e < 8; ++e)
        s.acc[g][v][e] = s.acc[g][v][e] * a + __shfl_xor_sync(0xffffffffu, s.acc[g][v][e], mask) * b;
  }
}

// This lane's 16-byte chunks of its TPL token rows of one tile; rows past the context read as 0.
template <typename T, int TPL, int VPL, int TPW, int L>
__device__ __forceinline__ void load_block_rows(
    Chunk8<T> (&dst)[TPL][VPL],
    const T* __restrict__ cache,     // [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM]
    const long long base,            // element offset of (block, first token of the tile, kv head)
    const long long token_stride,    // num_kv_heads * HEAD_DIM
    const int first_token, const int context_len, const int tg, const int sub) {
#pragma unroll
  for (int j = 0; j < TPL; ++j) {
    const int t = tg + j * TPW;
    const bool valid = first_token + t < context_len;
#pragma unroll
    for (int v = 0; v < VPL; ++v)
      dst[j][v] = valid ? load_chunk(cache + base + t * token_stride + (sub + v * L) * 8) : zero_chunk<T>();
  }
}

template <typename T, int HEAD_DIM, int BLOCK_SIZE, int GROUP_MAX, int NUM_WARPS>
__global__ void __launch_bounds__(NUM_WARPS * WARP_SIZE) paged_decode_kernel(
    T* __restrict__ out,                   // [num_seqs, num_heads, HEAD_DIM]            (1 partition)
    float* __restrict__ part_acc,          // [num_seqs, num_heads, num_partitions, HEAD_DIM] (split-K)
    float* __restrict__ part_max,          // [num_seqs, num_heads, num_partitions]        (split-K)
    float* __restrict__ part_sum,          // [num_seqs, num_heads, num_partitions]        (split-K)
    const T* __restrict__ q,               // [num_seqs, num_heads, HEAD_DIM]
    const T* __restrict__ k_cache,         // [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM]
    const T* __restrict__ v_cache,         // [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM]
    const int* __restrict__ block_tables,  // [num_seqs, max_blocks]
    const int* __restrict__ context_lens,  // [num_seqs]
    const int max_blocks,
    const int num_kv_heads,
    const int group_size,                  // query heads per kv head
    const int partition_blocks,            // KV blocks per partition
    const int num_partitions,
    const float scale_log2) {              // softmax scale * log2(e)
  using Layout = DecodeLayout<HEAD_DIM, GROUP_MAX>;
  constexpr int VPL = Layout::VECS_PER_LANE;
  constexpr int L = Layout::LANES_PER_TOKEN;
  constexpr int TPW = Layout::TOKENS_PER_WARP;
  constexpr int TILE = BLOCK_SIZE < 16 ? BLOCK_SIZE : 16;  // tokens per loop step of a warp
  constexpr int TILES = BLOCK_SIZE / TILE;                 // tiles per KV block
  constexpr int TPL = TILE / TPW;                          // tokens per lane per tile
  static_assert(BLOCK_SIZE % TILE == 0 && TILE % TPW == 0, "block_size must be 8, 16, 32 or 64");
  // Loading V together with K keeps the most bytes in flight; with many heads x tokens the
  // scores need those registers, so V is then loaded once the scores are done.
  constexpr bool EARLY_V = GROUP_MAX * TPL < 32;

  __shared__ float smem_m[NUM_WARPS][GROUP_MAX];
  __shared__ float smem_l[NUM_WARPS][GROUP_MAX];
  __shared__ float smem_acc[NUM_WARPS][GROUP_MAX][HEAD_DIM];

  const int group_chunks = (group_size + GROUP_MAX - 1) / GROUP_MAX;
  const int kv_head = blockIdx.x / group_chunks;
  const int g_first = (blockIdx.x % group_chunks) * GROUP_MAX;
  const int n_heads = min(GROUP_MAX, group_size - g_first);
  const int head0 = kv_head * group_size + g_first;  // first query head of this CTA
  const int num_heads = num_kv_heads * group_size;
  const int seq = blockIdx.y, part = blockIdx.z;
  const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
  const int tg = lane / L, sub = lane % L;

  // Stage 0: this CTA's range of KV blocks; a split-K CTA past the context has nothing to do.
  const int context_len = context_lens[seq];
  const int ctx_blocks = (context_len + BLOCK_SIZE - 1) / BLOCK_SIZE;
  const int blk_begin = part * partition_blocks;
  const int blk_end = min(blk_begin + partition_blocks, ctx_blocks);
  if (num_partitions > 1 && blk_begin >= blk_end) return;

  // Stage 1: this lane's slice of every query head, pre-scaled so scores land in the log2 domain.
  float qf[GROUP_MAX][VPL][8];
#pragma unroll
  for (int g = 0; g < GROUP_MAX; ++g)
#pragma unroll
    for (int v = 0; v < VPL; ++v) {
      if (g < n_heads) {
        load8(q + ((long long)seq * num_heads + head0 + g) * HEAD_DIM + (sub + v * L) * 8, qf[g][v]);
#pragma unroll
        for (int e = 0; e < 8; ++e) qf[g][v][e] *= scale_log2;
      } else {
#pragma unroll
        for (int e = 0; e < 8; ++e) qf[g][v][e] = 0.f;
      }
    }

  SoftmaxState<GROUP_MAX, VPL> st;
#pragma unroll
  for (int g = 0; g < GROUP_MAX; ++g) {
    st.m[g] = NEG_BIG;
    st.l[g] = 0.f;
#pragma unroll
    for (int v = 0; v < VPL; ++v)
#pragma unroll
      for (int e = 0; e < 8; ++e) st.acc[g][v][e] = 0.f;
  }

  const long long token_stride = (long long)num_kv_heads * HEAD_DIM;
  const long long block_stride = token_stride * BLOCK_SIZE;
  const int* __restrict__ table = block_tables + (long long)seq * max_blocks;
  const float neg_inf = __int_as_float(0xff800000);

  // Stage 2: stream this warp's tiles through the online softmax. The next tile's block id is read
  // one iteration ahead, so the table -> K dependency does not serialise two memory latencies.
  const int tile_end = blk_end * TILES;  // tiles of the last block past the context are masked
  int phys_next = (blk_begin * TILES + warp < tile_end) ? table[(blk_begin * TILES + warp) / TILES] : 0;
  for (int tile = blk_begin * TILES + warp; tile < tile_end; tile += NUM_WARPS) {
    const int phys = phys_next;
    if (tile + NUM_WARPS < tile_end) phys_next = table[(tile + NUM_WARPS) / TILES];
    const int first_token = tile * TILE;
    const long long base =
        (long long)phys * block_stride + (first_token % BLOCK_SIZE) * token_stride + kv_head * HEAD_DIM;

    // 2a: issue the tile's K (and V) loads before the first use (memory-level parallelism).
    Chunk8<T> k_raw[TPL][VPL], v_raw[TPL][VPL];
    load_block_rows<T, TPL, VPL, TPW, L>(k_raw, k_cache, base, token_stride, first_token, context_len, tg, sub);
    if (EARLY_V)
      load_block_rows<T, TPL, VPL, TPW, L>(v_raw, v_cache, base, token_stride, first_token, context_len, tg, sub);

    // 2b: q.k for each token and head, reduced over the L lanes that hold the token.
    float s[TPL][GROUP_MAX];
#pragma unroll
    for (int j = 0; j < TPL; ++j) {
      float kf[VPL][8];
#pragma unroll
      for (int v = 0; v < VPL; ++v) widen8<T>(k_raw[j][v], kf[v]);
#pragma unroll
      for (int g = 0; g < GROUP_MAX; ++g) {
        float dot = 0.f;
#pragma unroll
        for (int v = 0; v < VPL; ++v)
#pragma unroll
          for (int e = 0; e < 8; ++e) dot = fmaf(qf[g][v][e], kf[v][e], dot);
        dot = warp_sum<L>(dot);
        s[j][g] = (first_token + tg + j * TPW < context_len) ? dot : neg_inf;
      }
    }

    if (!EARLY_V)
      load_block_rows<T, TPL, VPL, TPW, L>(v_raw, v_cache, base, token_stride, first_token, context_len, tg, sub);

    // 2c: online softmax update, then accumulate p * v.
#pragma unroll
    for (int g = 0; g < GROUP_MAX; ++g) {
      float m_new = st.m[g];
#pragma unroll
      for (int j = 0; j < TPL; ++j) m_new = fmaxf(m_new, s[j][g]);
      const float alpha = exp2f(st.m[g] - m_new);
      st.m[g] = m_new;
      st.l[g] *= alpha;
#pragma unroll
      for (int v = 0; v < VPL; ++v)
#pragma unroll
        for (int e = 0; e < 8; ++e) st.acc[g][v][e] *= alpha;
#pragma unroll
      for (int j = 0; j < TPL; ++j) s[j][g] = exp2f(s[j][g] - m_new);  // masked: exp2(-inf) = 0
    }
#pragma unroll
    for (int j = 0; j < TPL; ++j) {
      float vf[VPL][8];
#pragma unroll
      for (int v = 0; v < VPL; ++v) widen8<T>(v_raw[j][v], vf[v]);
#pragma unroll
      for (int g = 0; g < GROUP_MAX; ++g) {
        st.l[g] += s[j][g];
#pragma unroll
        for (int v = 0; v < VPL; ++v)
#pragma unroll
          for (int e = 0; e < 8; ++e) st.acc[g][v][e] = fmaf(s[j][g], vf[v][e], st.acc[g][v][e]);
      }
    }
  }

  // Stage 3: merge the token groups of the warp (lanes with equal `sub` hold the same slice).
#pragma unroll
  for (int mask = L; mask < WARP_SIZE; mask *= 2) merge_from_lane(st, mask);

  // Stage 4: merge the warps through shared memory.
  if (tg == 0) {
#pragma unroll
    for (int g = 0; g < GROUP_MAX; ++g) {
#pragma unroll
      for (int v = 0; v < VPL; ++v)
#pragma unroll
        for (int e = 0; e < 8; ++e) smem_acc[warp][g][(sub + v * L) * 8 + e] = st.acc[g][v][e];
      if (sub == 0) {
        smem_m[warp][g] = st.m[g];
        smem_l[warp][g] = st.l[g];
      }
    }
  }
  __syncthreads();

  // Stage 5: each thread finishes some (head, dim) outputs: normalised, or a split-K partial.
  for (int i = threadIdx.x; i < n_heads * HEAD_DIM; i += NUM_WARPS * WARP_SIZE) {
    const int g = i / HEAD_DIM, d = i % HEAD_DIM;
    float m_all = NEG_BIG;
#pragma unroll
    for (int w = 0; w < NUM_WARPS; ++w) m_all = fmaxf(m_all, smem_m[w][g]);
    float l_all = 0.f, a_all = 0.f;
#pragma unroll
    for (int w = 0; w < NUM_WARPS; ++w) {
      const float f = exp2f(smem_m[w][g] - m_all);
      l_all += smem_l[w][g] * f;
      a_all += smem_acc[w][g][d] * f;
    }
    const long long row = (long long)seq * num_heads + head0 + g;  // (seq, head)
    if (num_partitions == 1) {
      out[row * HEAD_DIM + d] = from_float<T>(l_all > 0.f ? a_all / l_all : 0.f);
    } else {
      const long long prow = row * num_partitions + part;
      part_acc[prow * HEAD_DIM + d] = a_all;
      if (d == 0) {
        part_max[prow] = m_all;
        part_sum[prow] = l_all;
      }
    }
  }
}

// Merge the split-K partials of one (sequence, query head): out = sum_p w_p acc_p / sum_p w_p l_p,
// with w_p = exp2(max_p - max_all). grid = (num_heads, num_seqs), block = HEAD_DIM threads.
template <typename T, int HEAD_DIM>
__global__ void __launch_bounds__(HEAD_DIM) paged_decode_reduce_kernel(
    T* __restrict__ out,                   // [num_seqs, num_heads, HEAD_DIM]
    const float* __restrict__ part_acc,    // [num_seqs, num_heads, num_partitions, HEAD_DIM]
    const float* __restrict__ part_max,    // [num_seqs, num_heads, num_partitions]
    const float* __restrict__ part_sum,    // [num_seqs, num_heads, num_partitions]
    const int* __restrict__ context_lens,  // [num_seqs]
    const int num_partitions,
    const int partition_tokens) {
  const int head = blockIdx.x, seq = blockIdx.y, d = threadIdx.x;
  const long long row = (long long)seq * gridDim.x + head;
  // Stage 1: only partitions that hold context tokens were written.
  const int used = min(num_partitions, (context_lens[seq] + partition_tokens - 1) / partition_tokens);
  const float* __restrict__ pm = part_max + row * num_partitions;
  const float* __restrict__ ps = part_sum + row * num_partitions;
  const float* __restrict__ pa = part_acc + row * num_partitions * HEAD_DIM + d;
  // Stage 2: global max, then the rescaled sums.
  float m_all = NEG_BIG;
  for (int p = 0; p < used; ++p) m_all = fmaxf(m_all, pm[p]);
  float l_all = 0.f, a_all = 0.f;
  for (int p = 0; p < used; ++p) {
    const float w = exp2f(pm[p] - m_all);
    l_all += ps[p] * w;
    a_all += pa[(long long)p * HEAD_DIM] * w;
  }
  out[row * HEAD_DIM + d] = from_float<T>(l_all > 0.f ? a_all / l_all : 0.f);
}

}  // namespace llmserve
