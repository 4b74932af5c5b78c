/* Linear layers over GGUF-style quantized blocks on the CPU: fp32 activations in, fp32 out,
 * integer dot products inside.
 *
 * Built by gpu_worker/ops/cpu_kernels.py with the system C compiler, called through ctypes.
 * A weight [N, K] is N rows of G = K/32 blocks of 32 weights, each row padded to P = ceil(G/2)
 * pairs of blocks (a padding block is all zero). Per row and pair, the codes of blocks A = 2p and
 * B = 2p + 1 are stored so that one 256-bit load widens into four vectors of 16 int16 codes
 * [A 8c..8c+7 | B 8c..8c+7], c = 0..3 (cpu_block_linear.py packs them):
 *   Q4_1: 32 bytes: A's 16 bytes, then B's; byte j holds code j (low nibble) and j + 16 (high), as
 *         a GGUF Q4_1 block has them; w = code * d + m
 *   Q8_0: 64 bytes: the four 16-byte chunks [A 8c..8c+7, B 8c..8c+7] of int8 codes; w = code * d
 * Beside them, per row and block: d [N, 2P] fp16 and, for Q4_1, m [N, 2P] fp16 (a GGUF block's own
 * scale and offset, exactly).
 *
 * Each call first quantizes its input rows to 16-bit codes in blocks of 32 (x ~ xcode * xd, xd =
 * max |x| / 32767: about 5 significant digits, finer than bf16), stored in the same pair order.
 * A pair's dot product is then four 16-bit integer multiply-adds (madd) whose int32 lanes 0-3
 * belong to block A and 4-7 to block B, scaled lane-wise by [d_A xd_A x4 | d_B xd_B x4] into one
 * fp32 accumulator. Q4_1 adds sum over blocks of m * xd * sum(xcode), one short dot product per
 * output. llama.cpp rounds activations to 8 bits instead; at 16 bits the greedy tokens of a Q4_1
 * file match fp32's (bench/quality.py, README).
 *
 * Blocking: a thread takes GROUP_ROWS weight rows (in L1 while it works on them) and sweeps the
 * input rows ROW_TILE at a time, so each widened weight pair serves ROW_TILE rows from registers
 * and each tile of input codes serves GROUP_ROWS weight rows from L1.
 *
 * out[r, n] is computed by one thread with the same sequence of operations whatever M, the row
 * tile it falls in, the thread count or which thread takes it: a row's codes depend only on that
 * row, one 8-lane fp32 accumulator takes the pairs in order, then a fixed horizontal sum. A row's
 * output is therefore the same bits alone, in a decode batch or in a prefill chunk.
 *
 * Needs AVX2, FMA and F16C (the build fails elsewhere and the caller falls back to torch).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "cpu_block_linear.c needs AVX2, FMA and F16C"
#endif

#define BLOCK 32
#define PAIR 64         /* weights per pair of blocks */
#define Q4_1_PAIR_BYTES 32
#define Q8_0_PAIR_BYTES 64
#define ROW_TILE 4      /* input rows sharing one widened weight pair (the calls below name 1-3) */
#define GROUP_ROWS 16   /* weight rows one thread takes at a time */
#define CODE_MAX 32767  /* activation codes are 16-bit */
/* How far ahead of the pair in hand a thread asks for its weights. The hardware prefetchers stop
 * at each 4 KiB page, so a thread streaming a decode step's weights waited on every page
 * (docs/performance.md, "Figures behind the CPU kernels' settings"). */
#define PREFETCH_BYTES 4096

/* the input rows: codes [M, P * 64] in pair order; per pair the lane scales [M, P * 8]
 * (xd_A x4, xd_B x4); per block [M, 2P] xd * sum(codes) */
typedef struct {
    int16_t *codes;
    float *lane_scale;
    float *scaled_sum;
} QuantRows;

/* fixed-order sum of 8 lanes: (0+4, 1+5, 2+6, 3+7), then pairs, then the last two */
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* dot of n fp16 values (widened to fp32 exactly) with n fp32 ones in a fixed order: 8-lane fma
 * chunks, hsum, then the tail */
static inline float dot_f16(const uint16_t *__restrict__ a, const float *__restrict__ b, int n) {
    __m256 acc = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8)
        acc = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(a + i))), _mm256_loadu_ps(b + i), acc);
    float s = hsum(acc);
    for (; i < n; i++) s = fmaf(_cvtsh_ss(a[i]), b[i], s);
    return s;
}

/* rows [M, K] fp32 -> QuantRows (symmetric per block of 32, round to nearest even; padding zero) */
static void quantize_rows(const float *__restrict__ x, int M, int K, QuantRows q) {
    const int blocks = K / BLOCK, pairs = (blocks + 1) / 2;
    for (long r = 0; r < M; r++) {
        for (int b = 0; b < 2 * pairs; b++) {
            const long slot = r * 2 * pairs + b;
            int16_t *pair_codes = q.codes + (r * pairs + b / 2) * PAIR;
            float *lanes = q.lane_scale + (r * pairs + b / 2) * 8 + (b % 2) * 4;
            const float *v = b < blocks ? x + r * K + (long)b * BLOCK : NULL; /* NULL: the padding block */
            float amax = 0.f;
            for (int i = 0; v && i < BLOCK; i++) amax = fmaxf(amax, fabsf(v[i]));
            const float d = amax / (float)CODE_MAX;
            const float inv = d > 0.f ? 1.f / d : 0.f;
            int sum = 0;
            for (int i = 0; i < BLOCK; i++) {
                const int c = v ? (int)nearbyintf(v[i] * inv) : 0;
                /* weight i of block A/B: chunk i / 8, half b % 2, place i % 8 */
                pair_codes[(i / 8) * 16 + (b % 2) * 8 + i % 8] = (int16_t)c;
                sum += c;
            }
            for (int i = 0; i < 4; i++) lanes[i] = d;
            q.scaled_sum[slot] = d * (float)sum;
        }
    }
}

/* A weight pair widened to four vectors of 16 int16 codes (the layout above) and its lane
 * scales [d_A x4 | d_B x4] in fp32. */
typedef struct {
    __m256i c[4];
    __m256 d;
} Pair;

static inline __m256 lane_scales(const uint16_t *d) {
    uint32_t two;
    __builtin_memcpy(&two, d, 4);
    const __m128 ab = _mm_cvtph_ps(_mm_cvtsi32_si128((int)two)); /* d_A, d_B, 0, 0 */
    return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(ab), _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
}

static inline Pair load_q4_1(const uint8_t *codes, const uint16_t *d) {
    const __m256i raw = _mm256_loadu_si256((const __m256i *)codes);
    const __m256i low4 = _mm256_set1_epi8(0x0F), zero = _mm256_setzero_si256();
    const __m256i lo = _mm256_and_si256(raw, low4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
    return (Pair){{_mm256_unpacklo_epi8(lo, zero), _mm256_unpackhi_epi8(lo, zero), _mm256_unpacklo_epi8(hi, zero),
                   _mm256_unpackhi_epi8(hi, zero)},
                  lane_scales(d)};
}

static inline Pair load_q8_0(const uint8_t *codes, const uint16_t *d) {
    Pair p;
    for (int c = 0; c < 4; c++) p.c[c] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(codes + 16 * c)));
    p.d = lane_scales(d);
    return p;
}

/* acc += (w . x) * [d xd] for one pair of one input row. Every partial integer sum is below 2^24
 * (|w| <= 127, |x| <= 2^15 - 1, 16 products a lane), so the int32 -> fp32 conversion is exact. */
static inline __m256 accumulate(__m256 acc, const Pair *w, const int16_t *x, const float *lane_scale) {
    const __m256i s01 = _mm256_add_epi32(_mm256_madd_epi16(w->c[0], _mm256_loadu_si256((const __m256i *)x)),
                                         _mm256_madd_epi16(w->c[1], _mm256_loadu_si256((const __m256i *)(x + 16))));
    const __m256i s23 = _mm256_add_epi32(_mm256_madd_epi16(w->c[2], _mm256_loadu_si256((const __m256i *)(x + 32))),
                                         _mm256_madd_epi16(w->c[3], _mm256_loadu_si256((const __m256i *)(x + 48))));
    const __m256 scale = _mm256_mul_ps(w->d, _mm256_loadu_ps(lane_scale));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(s01, s23)), scale, acc);
}

/* out[r * N] for `rows` (1 to ROW_TILE, a constant after inlining) input rows from `row` and one
 * weight row (its codes, d and, for Q4_1, offsets m; else NULL). */
#define DEFINE_ROW_TILE(NAME, LOAD, PAIR_BYTES)                                                              \
    static inline __attribute__((always_inline)) void NAME(QuantRows q, long row, int rows, int pairs,       \
                                                           const uint8_t *__restrict__ codes,                \
                                                           const uint16_t *__restrict__ d,                   \
                                                           const uint16_t *__restrict__ offsets,             \
                                                           float *__restrict__ out, long N) {                \
        __m256 acc[ROW_TILE];                                                                                \
        for (int r = 0; r < ROW_TILE; r++) acc[r] = _mm256_setzero_ps();                                     \
        for (int p = 0; p < pairs; p++) {                                                                    \
            _mm_prefetch((const char *)(codes + (long)p * PAIR_BYTES) + PREFETCH_BYTES, _MM_HINT_T0);       \
            const Pair w = LOAD(codes + (long)p * PAIR_BYTES, d + 2 * p);                                    \
            for (int r = 0; r < rows; r++) {                                                                 \
                const long xp = (row + r) * pairs + p;                                                       \
                acc[r] = accumulate(acc[r], &w, q.codes + xp * PAIR, q.lane_scale + xp * 8);                 \
            }                                                                                                \
        }                                                                                                    \
        /* the scales and offsets: 4 bytes a pair against the codes' 32 or 64 */                             \
        _mm_prefetch((const char *)d + PREFETCH_BYTES / 8, _MM_HINT_T0);                                     \
        if (offsets) _mm_prefetch((const char *)offsets + PREFETCH_BYTES / 8, _MM_HINT_T0);                  \
        for (int r = 0; r < rows; r++) {                                                                     \
            float s = hsum(acc[r]);                                                                          \
            if (offsets) s += dot_f16(offsets, q.scaled_sum + (row + r) * 2 * pairs, 2 * pairs);             \
            out[r * N] = s;                                                                                  \
        }                                                                                                    \
    }

DEFINE_ROW_TILE(q4_1_tile, load_q4_1, Q4_1_PAIR_BYTES)
DEFINE_ROW_TILE(q8_0_tile, load_q8_0, Q8_0_PAIR_BYTES)

/* x [M, K] fp32; codes [N, P * pair bytes], d [N, 2P] fp16, offsets [N, 2P] fp16 (Q4_1) or NULL
 * (Q8_0); out [M, N] fp32. Returns 0, or -1 without memory for the activation codes. */
#define DEFINE_LINEAR(NAME, TILE, PAIR_BYTES)                                                                \
    int NAME(const float *__restrict__ x, const uint8_t *__restrict__ codes, const uint16_t *__restrict__ d,   \
             const uint16_t *__restrict__ offsets, float *__restrict__ out, int M, int N, int K, int num_threads) { \
        const int pairs = (K / BLOCK + 1) / 2;                                                               \
        QuantRows q = {malloc(sizeof(int16_t) * (size_t)M * pairs * PAIR),                                   \
                       malloc(sizeof(float) * (size_t)M * pairs * 8), malloc(sizeof(float) * (size_t)M * pairs * 2)}; \
        if (!q.codes || !q.lane_scale || !q.scaled_sum) {                                                    \
            free(q.codes), free(q.lane_scale), free(q.scaled_sum);                                           \
            return -1;                                                                                       \
        }                                                                                                    \
        quantize_rows(x, M, K, q);                                                                           \
        const int groups = (N + GROUP_ROWS - 1) / GROUP_ROWS;                                                \
        /* guided: a fetch takes the groups left over the thread count, down to one group, so the       \
         * threads finish together after a few fetches a call; a thread the OS preempts (other           \
         * services share the cores) leaves the rest to the others. One group per fetch (dynamic, 1)    \
         * made the fetches themselves the cost (docs/performance.md has the figures). */               \
        _Pragma("omp parallel for schedule(guided) num_threads(num_threads)")                                \
        for (int g = 0; g < groups; g++) {                                                                   \
            const int n0 = g * GROUP_ROWS, n1 = n0 + GROUP_ROWS < N ? n0 + GROUP_ROWS : N;                   \
            for (int r = 0; r < M; r += ROW_TILE) {                                                          \
                for (int n = n0; n < n1; n++) {                                                              \
                    const uint8_t *wc = codes + (long)n * pairs * PAIR_BYTES;                                \
                    const uint16_t *wd = d + (long)n * 2 * pairs;                                            \
                    const uint16_t *m = offsets ? offsets + (long)n * 2 * pairs : NULL;                      \
                    float *o = out + (long)r * N + n;                                                        \
                    /* a constant row count per call keeps the tile in registers */                          \
                    switch (M - r < ROW_TILE ? M - r : ROW_TILE) {                                           \
                    case 1: TILE(q, r, 1, pairs, wc, wd, m, o, N); break;                                    \
                    case 2: TILE(q, r, 2, pairs, wc, wd, m, o, N); break;                                    \
                    case 3: TILE(q, r, 3, pairs, wc, wd, m, o, N); break;                                    \
                    default: TILE(q, r, ROW_TILE, pairs, wc, wd, m, o, N);                                   \
                    }                                                                                        \
                }                                                                                            \
            }                                                                                                \
        }                                                                                                    \
        free(q.codes), free(q.lane_scale), free(q.scaled_sum);                                               \
        return 0;                                                                                            \
    }

DEFINE_LINEAR(q4_1_linear_f32, q4_1_tile, Q4_1_PAIR_BYTES)
DEFINE_LINEAR(q8_0_linear_f32, q8_0_tile, Q8_0_PAIR_BYTES)
