/* Linear layers over GGUF-style quantized blocks on the CPU: fp32 activations in, fp32 out,
 * integer dot products inside.
 *
 * Built by gpu_worker/ops/cpu_kernels.py with the system C compiler, called through ctypes.
 * A weight [N, K] is N rows of K/32 blocks of 32 weights:
 *   Q4_1: fp16 d, then 16 bytes of 4-bit codes, byte j holding weight j (low nibble) and j + 16
 *         (high), as a GGUF Q4_1 block has them; each block's offset m (fp32) in a separate
 *         array [N, K/32]; w = code * d + m
 *   Q8_0: fp16 d, 32 int8 codes (a GGUF Q8_0 block); w = code * d
 * Each call first quantizes its input rows to 16-bit codes in blocks of 32 (x ~ xcode * xd, xd =
 * max |x| / 32767: about 5 significant digits, finer than bf16), then a block's dot product is two
 * 16-bit integer multiply-adds (madd) scaled by d * xd; Q4_1 adds sum over blocks of
 * m * xd * sum(xcode), one short dot product per output. llama.cpp rounds activations to 8 bits
 * instead; at 16 bits the greedy tokens of a Q4_1 file match fp32's (bench/quality.py, README).
 *
 * out[r, n] is computed by one thread with the same sequence of operations whatever M, the row
 * tile it falls in, the thread count or which thread takes it: a row's codes depend only on that row, two 8-lane fp32
 * accumulators take the blocks in order, then fixed horizontal sums. A row's output is therefore
 * the same bits alone, in a decode batch or in a prefill chunk.
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
#define Q4_1_BYTES 18  /* 2 + 16 */
#define Q8_0_BYTES 34  /* 2 + 32 */
#define ROW_TILE 4     /* rows sharing one unpacked weight block */
#define ROW_CHUNK 64   /* rows whose activation codes stay in L2 while every output is computed */
#define CODE_MAX 32767 /* activation codes are 16-bit */

/* the input rows' blocks: codes [M, K], and per block [M, K/32] its scale xd and xd * sum(codes) */
typedef struct {
    int16_t *codes;
    float *scale;
    float *scaled_sum;
} QuantRows;

static inline float half_to_float(const uint8_t *p) {
    uint16_t h;
    __builtin_memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* fixed-order sum of 8 lanes: (0+4, 1+5, 2+6, 3+7), then pairs, then the last two */
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* dot of two fp32 arrays of length n in a fixed order: 8-lane fma chunks, hsum, then the tail */
static inline float dot(const float *__restrict__ a, const float *__restrict__ b, int n) {
    __m256 acc = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float s = hsum(acc);
    for (; i < n; i++) s = fmaf(a[i], b[i], s);
    return s;
}

/* rows [M, K] fp32 -> 16-bit codes, xd, xd * sum(codes) per block of 32 (symmetric, round to nearest even) */
static void quantize_rows(const float *__restrict__ x, int M, int K, QuantRows q) {
    for (long blk = 0; blk < (long)M * (K / BLOCK); blk++) {
        const float *v = x + blk * BLOCK;
        float amax = 0.f;
        for (int i = 0; i < BLOCK; i++) amax = fmaxf(amax, fabsf(v[i]));
        const float d = amax / (float)CODE_MAX;
        const float inv = d > 0.f ? 1.f / d : 0.f;
        int sum = 0;
        for (int i = 0; i < BLOCK; i++) {
            const int c = (int)nearbyintf(v[i] * inv);
            q.codes[blk * BLOCK + i] = (int16_t)c;
            sum += c;
        }
        q.scale[blk] = d;
        q.scaled_sum[blk] = d * (float)sum;
    }
}

/* A weight block's codes widened to 16-bit integers in weight order (lo: weights 0-15, hi: 16-31)
 * and its scale d in fp32. */
typedef struct {
    __m256i lo, hi;
    float d;
} Block;

static inline Block load_q4_1(const uint8_t *blk) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)(blk + 2));
    const __m128i low4 = _mm_set1_epi8(0x0F);
    return (Block){_mm256_cvtepu8_epi16(_mm_and_si128(raw, low4)),
                   _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), low4)), half_to_float(blk)};
}

static inline Block load_q8_0(const uint8_t *blk) {
    return (Block){_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 2))),
                   _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 18))), half_to_float(blk)};
}

/* acc += (w . x) * d * xd for one block of one row. Every partial integer sum is below 2^24
 * (|w| <= 127, |x| <= 2^15 - 1), so the int32 -> fp32 conversion is exact. */
static inline __m256 accumulate(__m256 acc, Block w, const int16_t *x, float xd) {
    const __m256i lo = _mm256_madd_epi16(w.lo, _mm256_loadu_si256((const __m256i *)x));
    const __m256i hi = _mm256_madd_epi16(w.hi, _mm256_loadu_si256((const __m256i *)(x + 16)));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(lo, hi)), _mm256_set1_ps(w.d * xd), acc);
}

/* out[r * N] for `rows` (1 or ROW_TILE, a constant after inlining) rows of q and one weight row;
 * `offsets` (Q4_1: the row's m per block) or NULL. Even and odd blocks go to separate
 * accumulators (two independent fma chains per row). */
#define DEFINE_ROW_TILE(NAME, LOAD, BYTES)                                                                 \
    static inline __attribute__((always_inline)) void NAME(QuantRows q, int rows, int K,                   \
                                                           const uint8_t *__restrict__ wrow,               \
                                                           const float *__restrict__ offsets,              \
                                                           float *__restrict__ out, long N) {              \
        const int blocks = K / BLOCK;                                                                      \
        __m256 acc0[ROW_TILE], acc1[ROW_TILE];                                                             \
        for (int r = 0; r < ROW_TILE; r++) acc0[r] = acc1[r] = _mm256_setzero_ps();                        \
        int b = 0;                                                                                         \
        for (; b + 1 < blocks; b += 2) {                                                                   \
            /* one block live at a time: with 2 * ROW_TILE accumulators that fits the 16 registers */     \
            const Block even = LOAD(wrow + (long)b * BYTES);                                               \
            for (int r = 0; r < rows; r++) {                                                               \
                const long xb = (long)r * blocks + b;                                                      \
                acc0[r] = accumulate(acc0[r], even, q.codes + xb * BLOCK, q.scale[xb]);                    \
            }                                                                                              \
            const Block odd = LOAD(wrow + (long)(b + 1) * BYTES);                                          \
            for (int r = 0; r < rows; r++) {                                                               \
                const long xb = (long)r * blocks + b + 1;                                                  \
                acc1[r] = accumulate(acc1[r], odd, q.codes + xb * BLOCK, q.scale[xb]);                     \
            }                                                                                              \
        }                                                                                                  \
        if (b < blocks) {                                                                                  \
            const Block last = LOAD(wrow + (long)b * BYTES);                                               \
            for (int r = 0; r < rows; r++) {                                                               \
                const long xb = (long)r * blocks + b;                                                      \
                acc0[r] = accumulate(acc0[r], last, q.codes + xb * BLOCK, q.scale[xb]);                    \
            }                                                                                              \
        }                                                                                                  \
        for (int r = 0; r < rows; r++) {                                                                   \
            float s = hsum(_mm256_add_ps(acc0[r], acc1[r]));                                               \
            if (offsets) s += dot(offsets, q.scaled_sum + (long)r * blocks, blocks);                       \
            out[r * N] = s;                                                                                \
        }                                                                                                  \
    }

DEFINE_ROW_TILE(q4_1_tile, load_q4_1, Q4_1_BYTES)
DEFINE_ROW_TILE(q8_0_tile, load_q8_0, Q8_0_BYTES)

static inline QuantRows rows_from(QuantRows q, long row, int K) {
    const long blocks = K / BLOCK;
    return (QuantRows){q.codes + row * K, q.scale + row * blocks, q.scaled_sum + row * blocks};
}

/* x [M, K] fp32, w [N, K/32 blocks], offsets [N, K/32] (Q4_1) or NULL (Q8_0), out [M, N] fp32;
 * returns 0, or -1 without memory for the activation codes */
#define DEFINE_LINEAR(NAME, TILE, BYTES)                                                                   \
    int NAME(const float *__restrict__ x, const uint8_t *__restrict__ w, const float *__restrict__ offsets, \
             float *__restrict__ out, int M, int N, int K, int num_threads) {                              \
        const long blocks = K / BLOCK, row_bytes = blocks * BYTES;                                         \
        QuantRows q = {malloc(sizeof(int16_t) * M * K), malloc(sizeof(float) * M * blocks),               \
                       malloc(sizeof(float) * M * blocks)};                                                \
        if (!q.codes || !q.scale || !q.scaled_sum) {                                                      \
            free(q.codes), free(q.scale), free(q.scaled_sum);                                             \
            return -1;                                                                                     \
        }                                                                                                  \
        quantize_rows(x, M, K, q);                                                                         \
        for (int r0 = 0; r0 < M; r0 += ROW_CHUNK) {                                                        \
            const int chunk = M - r0 < ROW_CHUNK ? M - r0 : ROW_CHUNK;                                     \
            /* dynamic: a thread the OS preempts (other services share the cores) leaves its outputs */ \
            _Pragma("omp parallel for schedule(dynamic, 32) num_threads(num_threads)")                     \
            for (int n = 0; n < N; n++) {                                                                  \
                const uint8_t *wrow = w + n * row_bytes;                                                   \
                const float *m = offsets ? offsets + n * blocks : NULL;                                    \
                for (int r = 0; r < chunk; r += ROW_TILE) {                                                \
                    float *o = out + (long)(r0 + r) * N + n;                                               \
                    if (chunk - r >= ROW_TILE)                                                             \
                        TILE(rows_from(q, r0 + r, K), ROW_TILE, K, wrow, m, o, N);                         \
                    else /* the last rows one at a time: constant row counts keep the tile in registers */ \
                        for (int i = 0; i < chunk - r; i++)                                                \
                            TILE(rows_from(q, r0 + r + i, K), 1, K, wrow, m, o + (long)i * N, N);          \
                }                                                                                          \
            }                                                                                              \
        }                                                                                                  \
        free(q.codes), free(q.scale), free(q.scaled_sum);                                                  \
        return 0;                                                                                          \
    }

DEFINE_LINEAR(q4_1_linear_f32, q4_1_tile, Q4_1_BYTES)
DEFINE_LINEAR(q8_0_linear_f32, q8_0_tile, Q8_0_BYTES)
