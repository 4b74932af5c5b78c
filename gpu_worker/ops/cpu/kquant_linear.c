/* Linear layers over GGUF's K types (Q2_K..Q6_K; ops/weights/gguf_blocks.py), losslessly repacked:
 * fp32 activations in, fp32 out, integer dot products inside, as block_linear.c does for the legacy types.
 *
 * A weight [N, K] (K a multiple of 256) is N rows of P = K/64 pairs of 32-weight blocks A and B,
 * w = scale * code + offset per sub-block. The codes of a pair are b bits a weight, in bit
 * planes that join into two vectors of 32 byte codes [A 0..15 | B 0..15], [A 16..31 | B 16..31]
 * (kquant_linear.py packs them):
 *   nibble plane, 32 bytes: the low 4 bits as block_linear.c's Q4_1 codes
 *   crumb plane, 16 bytes: A's 8 bytes, then B's; byte i holds 2 bits of weight 8c + i at bits 2c
 *   bit plane, 8 bytes: block_linear.c's Q5_1 fifth bits
 *   b = 2: crumbs; 3: crumbs, bits (x4); 4: nibbles; 5: nibbles, bits (x16); 6: nibbles, crumbs (x16)
 * Scales, per sub-block s (S = K/16 of 16 weights for Q2_K, Q3_K and Q6_K; K/32 of 32 for Q4_K and Q5_K):
 * scale = d * sc and offset = dmin * mn (exact fp32 products), d [N, K/256] fp32 and sc [N, S] int8 by
 * weight row for the dot products, dmin [K/256, N] fp32 and mn [S, N] int8 by output for the offsets;
 * Q3_K's and Q6_K's offset is -zero * scale (zero 4 and 32), so they have neither.
 *
 * The input rows are quantized to block_linear.c's 8-bit codes per block of 32 (llama.cpp takes 8-bit
 * codes per 256). A pair's dot product is two byte dot products, one vector each: int32 lanes 0-3 of
 * the first belong to A's first 16 weights and lanes 4-7 to B's, of the second to their second 16.
 * With 16-weight sub-blocks each is scaled lane-wise by its own sub-block scale, then their sum by the
 * input's block scales (sub_accumulate); with 32-weight ones the two add as integers and take one
 * scale, as block_linear.c's Q4_1 (accumulate_bytes). The offsets of Q2_K, Q4_K and Q5_K add the sum
 * over sub-blocks of offset * xd * sum(xcodes) in block_linear.c's pass of their own (DEFINE_OFFSETS),
 * 8 outputs a vector: in the pair loop they cost a 4-lane fma and a load a pair and input row. Q3_K's
 * and Q6_K's start each lane's integer sum at -zero * the sum of its input codes (block_linear.c's
 * zero_code_bias, a bias a vector), so it ends at the dot product of the signed codes (code - zero).
 * Q3's third bit, Q5's fifth and Q6's top two join the low bits as bytes. Without VNNI a 16-bit lane
 * holds 2 products of at most 63 * 127 (4 of 31 * 127 for Q5_K), an int32 lane 4 or 8, so nothing
 * saturates and the int32 -> fp32 conversion is exact.
 *
 * Blocking, threading and the prefetch are block_linear.c's, so a row's output is the same bits
 * alone, in a decode batch or in a prefill chunk, for any thread count.
 */
#include "block_linear.c"
AVX512_BEGIN /* block_linear.c says why */

/* per input row and pair, xd * sum(codes) of its 16-weight sub-blocks [A 0-15, A 16-31, B 0-15, B 16-31]
 * (the 32-weight ones take quantize_rows_8bit's per block) */
static void sub_block_sums(const ByteRows q, int M, int pairs, float *__restrict__ sums, int num_threads) {
    _Pragma("omp parallel for num_threads(num_threads) if (M >= 2 * QUANTIZE_ROWS_A_THREAD)")
    for (long rp = 0; rp < (long)M * pairs; rp++) {
        const int8_t *c = q.codes + rp * PAIR;
        int s[4] = {0, 0, 0, 0};
        for (int v = 0; v < 2; v++)
            for (int half = 0; half < 2; half++)
                for (int i = 0; i < 16; i++) s[half * 2 + v] += c[v * 32 + half * 16 + i];
        const float xa = q.lane_scale[rp * 8], xb = q.lane_scale[rp * 8 + 4];
        sums[rp * 4 + 0] = xa * (float)s[0], sums[rp * 4 + 1] = xa * (float)s[1];
        sums[rp * 4 + 2] = xb * (float)s[2], sums[rp * 4 + 3] = xb * (float)s[3];
    }
}

/* The offsets, read by the offsets' pass (block_linear.c's DEFINE_OFFSETS): sub-block s of output n has
 * dmin[s / per, n] * mn[s, n], an exact fp32 product, per = the sub-blocks of a super-block. */
typedef struct {
    const int8_t *mn;
    const float *dmin;
    int per;
} SubOffsets;
#define SUB_OFFSETS_8(o, s, n, N)                                                                               \
    _mm256_mul_ps(_mm256_loadu_ps((o).dmin + (long)((s) / (o).per) * (N) + (n)),                               \
                  _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((o).mn + (long)(s) * (N) + (n))))))
#define SUB_OFFSETS_1(o, s, n, N) ((o).dmin[(long)((s) / (o).per) * (N) + (n)] * (float)(o).mn[(long)(s) * (N) + (n)])
DEFINE_OFFSETS(sub_offset_rows, add_sub_offsets, SubOffsets, SUB_OFFSETS_8, SUB_OFFSETS_1)

static inline void nibble_plane(const uint8_t *p, __m256i v[2]) {
    nibble_bytes(p, &v[0], &v[1]);
}

/* 5-bit codes: the fifth bit joins the nibbles */
static inline void nibble_bit_planes(const uint8_t *p, __m256i v[2]) {
    nibble_bytes(p, &v[0], &v[1]);
    join_bits(p + 32, 4, &v[0], &v[1]);
}

/* The crumb plane as byte codes laid out as nibble_bytes', each crumb at bit `at` (0 or 4): each lane
 * holds its block's 8 bytes twice, a 64-bit lane's mask picks crumb c and its shift moves it to bit 0. */
static inline void crumb_bytes(const uint8_t *p, int at, __m256i *lo, __m256i *hi) {
    const __m256i t = _mm256_permute4x64_epi64(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)p)), 0x50);
    const __m256i c01 = _mm256_setr_epi64x(0x0303030303030303LL, 0x0C0C0C0C0C0C0C0CLL,
                                           0x0303030303030303LL, 0x0C0C0C0C0C0C0C0CLL);
    const __m256i c23 = _mm256_slli_epi64(c01, 4); /* 0x30.., 0xC0.. */
    *lo = _mm256_slli_epi64(_mm256_srlv_epi64(_mm256_and_si256(t, c01), _mm256_setr_epi64x(0, 2, 0, 2)), at);
    *hi = _mm256_slli_epi64(_mm256_srlv_epi64(_mm256_and_si256(t, c23), _mm256_setr_epi64x(4, 6, 4, 6)), at);
}

static inline void crumb_planes(const uint8_t *p, __m256i v[2]) {
    crumb_bytes(p, 0, &v[0], &v[1]);
}

/* 3-bit codes: the bits join the crumbs (at bit 2) */
static inline void crumb_bit_planes(const uint8_t *p, __m256i v[2]) {
    crumb_bytes(p, 0, &v[0], &v[1]);
    join_bits(p + 16, 2, &v[0], &v[1]);
}

/* 6-bit codes: the crumbs join the nibbles (at bit 4) */
static inline void nibble_crumb_planes(const uint8_t *p, __m256i v[2]) {
    __m256i crumb_lo, crumb_hi;
    nibble_bytes(p, &v[0], &v[1]);
    crumb_bytes(p + 32, 4, &crumb_lo, &crumb_hi);
    v[0] = _mm256_or_si256(v[0], crumb_lo), v[1] = _mm256_or_si256(v[1], crumb_hi);
}

#define CODES_2(p, v) crumb_planes(p, v)
#define CODES_3(p, v) crumb_bit_planes(p, v)
#define CODES_4(p, v) nibble_plane(p, v)
#define CODES_5(p, v) nibble_bit_planes(p, v)
#define CODES_6(p, v) nibble_crumb_planes(p, v)

/* A weight pair of 16-weight sub-blocks: its codes and the lane scales of its first and second 16
 * weights of each block ([A x4 | B x4]). (32-weight sub-blocks take block_linear.c's BytePair.) */
typedef struct {
    __m256i c[2];
    __m256 lo, hi;
} SubPair;

/* The scales of one weight row: fp32 d per 256, int8 sc per sub-block. */
typedef struct {
    const float *d;
    const int8_t *sc;
} RowScales;

static inline __m128 int8x4(const int8_t *p) {
    int32_t four;
    __builtin_memcpy(&four, p, 4);
    return _mm_cvtepi32_ps(_mm_cvtepi8_epi32(_mm_cvtsi32_si128(four)));
}

/* pair p's codes and scales d * sc */
#define DEFINE_SUB_LOAD(NAME, CODES, PAIR_BYTES)                                                                    \
    static inline __attribute__((always_inline)) SubPair NAME(const uint8_t *__restrict__ codes, RowScales s, int p) { \
        SubPair w;                                                                                                   \
        CODES(codes + (long)p * PAIR_BYTES, w.c);                                                                    \
        const __m256 s4 = _mm256_castps128_ps256(_mm_mul_ps(_mm_set1_ps(s.d[p / 4]), int8x4(s.sc + 4 * p)));         \
        w.lo = _mm256_permutevar8x32_ps(s4, _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2));                              \
        w.hi = _mm256_permutevar8x32_ps(s4, _mm256_setr_epi32(1, 1, 1, 1, 3, 3, 3, 3));                              \
        return w;                                                                                                    \
    }
#define DEFINE_BLOCK_LOAD(NAME, CODES, PAIR_BYTES)                                                                  \
    static inline __attribute__((always_inline)) BytePair NAME(const uint8_t *__restrict__ codes, RowScales s, int p) { \
        BytePair w;                                                                                                  \
        CODES(codes + (long)p * PAIR_BYTES, w.c);                                                                    \
        uint16_t two;                                                                                                \
        __builtin_memcpy(&two, s.sc + 2 * p, 2);                                                                     \
        const __m128 ab = _mm_cvtepi32_ps(_mm_cvtepi8_epi32(_mm_cvtsi32_si128(two)));                                \
        w.d = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_mul_ps(_mm_set1_ps(s.d[p / 4]), ab)),               \
                                       _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));                                   \
        return w;                                                                                                    \
    }

/* acc += one input row's pair against a pair of 16-weight sub-blocks: each half's products scaled by its
 * sub-block's scale, their sum by the input's block scales. (A pair of 32-weight sub-blocks takes
 * block_linear.c's accumulate_bytes.) */
static inline __m256 sub_accumulate(__m256 acc, const SubPair *w, const int8_t *x, const float *lane_scale,
                                    const int32_t *bias) {
    const __m256i *b = (const __m256i *)bias;
    const __m256i lo = dot_byte_vector_from(bias ? _mm256_loadu_si256(b) : _mm256_setzero_si256(), w->c[0], _mm256_loadu_si256((const __m256i *)x));
    const __m256i hi = dot_byte_vector_from(bias ? _mm256_loadu_si256(b + 1) : _mm256_setzero_si256(), w->c[1], _mm256_loadu_si256((const __m256i *)(x + 32)));
    const __m256 t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), w->hi, _mm256_mul_ps(_mm256_cvtepi32_ps(lo), w->lo));
    return _mm256_fmadd_ps(t, _mm256_loadu_ps(lane_scale), acc);
}

/* out[r * N + j] for `rows` (1 to ROW_TILE) input rows from `row` and `wrows` (1 to WEIGHT_TILE) weight
 * rows from n, both constants after inlining: their pairs as loaded (`unpacked`, row j's from unpacked +
 * j * pairs, where the caller unpacked them once for every row tile), else their codes and scales, loaded
 * here. As block_linear.c's DEFINE_ROW_TILE, each output keeps its own accumulator. */
#define DEFINE_SUB_TILE(NAME, PAIR_T, LOAD, ACCUMULATE, PAIR_BYTES)                                                 \
    static inline __attribute__((always_inline)) void NAME(ByteRows q, const int32_t *bias, long row, int rows,     \
                                                           int wrows, int pairs,                                     \
                                                           const PAIR_T *__restrict__ unpacked,                      \
                                                           const uint8_t *__restrict__ codes, RowScales s,           \
                                                           int scales_a_row, float *__restrict__ out, long N) {      \
        __m256 acc[WEIGHT_TILE][ROW_TILE];                                                                           \
        for (int j = 0; j < WEIGHT_TILE; j++)                                                                        \
            for (int r = 0; r < ROW_TILE; r++) acc[j][r] = _mm256_setzero_ps();                                      \
        for (int p = 0; p < pairs; p++) {                                                                            \
            PAIR_T w[WEIGHT_TILE];                                                                                   \
            if (unpacked) {                                                                                          \
                for (int j = 0; j < wrows; j++) w[j] = unpacked[(long)j * pairs + p];                                \
            } else {                                                                                                 \
                for (int j = 0; j < wrows; j++) {                                                                    \
                    const uint8_t *c = codes + (long)j * pairs * PAIR_BYTES;                                         \
                    _mm_prefetch((const char *)(c + (long)p * PAIR_BYTES) + PREFETCH_BYTES, _MM_HINT_T0);            \
                    w[j] = LOAD(c, (RowScales){s.d + j * (pairs / 4), s.sc + j * scales_a_row}, p);                  \
                }                                                                                                    \
            }                                                                                                        \
            for (int r = 0; r < rows; r++) {                                                                         \
                const long xp = (row + r) * pairs + p;                                                               \
                for (int j = 0; j < wrows; j++)                                                                      \
                    acc[j][r] = ACCUMULATE(acc[j][r], &w[j], q.codes + xp * PAIR, q.lane_scale + xp * 8,            \
                                           bias ? bias + xp * 16 : NULL);                                            \
            }                                                                                                        \
        }                                                                                                            \
        for (int r = 0; r < rows; r++)                                                                               \
            for (int j = 0; j < wrows; j++) out[r * N + j] = hsum(acc[j][r]);                                        \
    }

/* The scales of weight row n. */
static inline RowScales row_scales(const float *d, const int8_t *sc, long n, int pairs, int scales_a_row) {
    return (RowScales){d + n * (pairs / 4), sc + n * scales_a_row};
}

/* a K-quant weight's pair p of row n, and its tile against input rows from r (block_linear.c's SWEEP_GROUPS) */
#define SUB_PAIR(LOAD, TILE, PAIR_BYTES, n, p) \
    LOAD(codes + (long)(n) * pairs * PAIR_BYTES, row_scales(d, sc, n, pairs, S), p)
#define SUB_TILE(LOAD, TILE, PAIR_BYTES, rows, wrows, w, n, r, o)                                                  \
    TILE(q, bias, r, rows, wrows, pairs, w, codes + (long)(n) * pairs * PAIR_BYTES, row_scales(d, sc, n, pairs, S), S, o, N)

/* x [M, K] fp32; codes [N, P * 8 bits]; d [N, K/256] fp32 and sc [N, S] int8 (S = K / SUB_BLOCK sub-blocks);
 * dmin [K/256, N] fp32 and mn [S, N] int8; out [M, N] fp32. Returns 0, or -1 without memory for the
 * activation codes or a thread's unpacked pairs. */
#define DEFINE_SUB_LINEAR(NAME, TILE, PAIR_T, LOAD, PAIR_BYTES, SUB_BLOCK, ZERO, WEIGHTS)                    \
    int NAME(const float *__restrict__ x, const uint8_t *__restrict__ codes, const float *d, const float *dmin, \
             const int8_t *__restrict__ sc, const int8_t *__restrict__ mn,                                    \
             float *__restrict__ out, int M, int N, int K, int num_threads) {                                \
        const int pairs = (K / BLOCK + 1) / 2, S = K / SUB_BLOCK;                                            \
        ByteRows q = {aligned_alloc(64, sizeof(int8_t) * (size_t)M * pairs * PAIR),                          \
                      aligned_alloc(64, sizeof(float) * (size_t)M * pairs * 8),                              \
                      malloc(sizeof(float) * (size_t)M * pairs * 2)};                                        \
        float *sums = SUB_BLOCK == BLOCK || ZERO ? q.scaled_sum : malloc(sizeof(float) * (size_t)M * S);     \
        int32_t *bias = ZERO ? aligned_alloc(64, sizeof(int32_t) * (size_t)M * pairs * 16) : NULL;           \
        if (!q.codes || !q.lane_scale || !q.scaled_sum || !sums || (ZERO && !bias)) {                        \
            if (sums != q.scaled_sum) free(sums);                                                            \
            free(q.codes), free(q.lane_scale), free(q.scaled_sum), free(bias);                               \
            return -1;                                                                                       \
        }                                                                                                    \
        quantize_rows_8bit(x, M, K, q, num_threads);                                                         \
        if (ZERO) zero_code_bias(q.codes, M, pairs, ZERO, 2, bias, num_threads);                             \
        else if (sums != q.scaled_sum) sub_block_sums(q, M, pairs, sums, num_threads);                       \
        SWEEP_GROUPS(PAIR_T, SUB_PAIR, SUB_TILE, LOAD, TILE, PAIR_BYTES, WEIGHTS)                            \
        if (!ZERO && !failed) add_sub_offsets(sums, (SubOffsets){mn, dmin, S / (K / 256)}, out, M, N, S, num_threads); \
        if (sums != q.scaled_sum) free(sums);                                                                \
        free(q.codes), free(q.lane_scale), free(q.scaled_sum), free(bias);                                   \
        return failed ? -1 : 0;                                                                              \
    }

/* Q2_K, Q3_K, Q6_K: 16-weight sub-blocks; Q3_K's and Q6_K's offsets in the dot products (ZERO 4, 32) */
#define DEFINE_SUB_KIND(BITS, ZERO)                                                                \
    DEFINE_SUB_LOAD(k##BITS##_load, CODES_##BITS, 8 * BITS)                                         \
    DEFINE_SUB_TILE(k##BITS##_tile, SubPair, k##BITS##_load, sub_accumulate, 8 * BITS)              \
    DEFINE_SUB_LINEAR(k##BITS##_linear_f32, k##BITS##_tile, SubPair, k##BITS##_load, 8 * BITS, 16, ZERO, WEIGHT_TILE)
/* Q4_K, Q5_K: 32-weight sub-blocks, so one scale a block as the legacy kinds */
#define DEFINE_BLOCK_KIND(BITS)                                                                    \
    DEFINE_BLOCK_LOAD(k##BITS##_load, CODES_##BITS, 8 * BITS)                                       \
    DEFINE_SUB_TILE(k##BITS##_tile, BytePair, k##BITS##_load, accumulate_bytes, 8 * BITS)           \
    DEFINE_SUB_LINEAR(k##BITS##_linear_f32, k##BITS##_tile, BytePair, k##BITS##_load, 8 * BITS, 32, 0, WEIGHT_TILE)

DEFINE_SUB_KIND(2, 0)
DEFINE_SUB_KIND(3, 4)
DEFINE_BLOCK_KIND(4)
DEFINE_BLOCK_KIND(5)
DEFINE_SUB_KIND(6, 32)
AVX512_END
