/* Linear layers over GGUF's K types (Q2_K..Q6_K; ops/weights/gguf_blocks.py), losslessly repacked:
 * fp32 activations in, fp32 out, integer dot products inside, as block_linear.c does for the legacy types.
 *
 * A weight [N, K] (K a multiple of 256) is N rows of P = K/64 pairs of 32-weight blocks A and B,
 * w = scale * code + offset per sub-block of 16. The codes of a pair are b bits a weight, in bit
 * planes that join into two vectors of 32 byte codes [A 0..15 | B 0..15], [A 16..31 | B 16..31]
 * (kquant_linear.py packs them):
 *   nibble plane, 32 bytes: the low 4 bits as block_linear.c's Q4_1 codes
 *   crumb plane, 16 bytes: A's 8 bytes, then B's; byte i holds 2 bits of weight 8c + i at bits 2c
 *   bit plane, 8 bytes: block_linear.c's Q5_1 fifth bits
 *   b = 2: crumbs; 3: crumbs, bits (x4); 4: nibbles; 5: nibbles, bits (x16); 6: nibbles, crumbs (x16)
 * Scales: per row and super-block of 256 d and dmin [N, K/256] fp32, per 16 weights sc and mn [N, K/16]
 * int8: scale = d * sc, offset = dmin * mn (exact).
 *
 * The input rows are quantized to block_linear.c's 8-bit codes per block of 32 (llama.cpp takes 8-bit
 * codes per 256). A pair's dot product is two byte dot products (dot_bytes, one vector each): int32
 * lanes 0-3 of the first belong to A's first 16 weights and lanes 4-7 to B's, of the second to their
 * second 16, so each is scaled lane-wise by its own sub-block scale (16-weight sub-blocks cost
 * nothing extra). The offsets add sum over sub-blocks of offset * xd * sum(xcodes), a 4-lane fma a
 * pair. Q3's third bit, Q5's fifth and Q6's top two join the low bits as bytes. Without VNNI a 16-bit
 * lane holds 2 products of at most 63 * 127, an int32 lane 4, so nothing saturates and the int32 ->
 * fp32 conversion is exact.
 *
 * Blocking, threading and the prefetch are block_linear.c's, so a row's output is the same bits
 * alone, in a decode batch or in a prefill chunk, for any thread count.
 */
#include "block_linear.c"
LINEARS_BEGIN /* block_linear.c says why */

/* per input row and pair, xd * sum(codes) of its sub-blocks [A 0-15, A 16-31, B 0-15, B 16-31] */
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

/* A weight pair: its codes, the lane scales of its first and second 16 weights of each block
 * ([A x4 | B x4]) and its four sub-block offsets [A0, A1, B0, B1]. */
typedef struct {
    __m256i c[2];
    __m256 lo, hi;
    __m128 off;
} SubPair;

/* The scales of one weight row: fp32 d and dmin per 256, int8 sc and mn per 16. */
typedef struct {
    const float *d, *offset;
    const int8_t *sc, *mn;
} RowScales;

static inline void spread(SubPair *w, __m128 s4) {
    const __m256 s = _mm256_castps128_ps256(s4);
    w->lo = _mm256_permutevar8x32_ps(s, _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2));
    w->hi = _mm256_permutevar8x32_ps(s, _mm256_setr_epi32(1, 1, 1, 1, 3, 3, 3, 3));
}

static inline __m128 int8x4(const int8_t *p) {
    int32_t four;
    __builtin_memcpy(&four, p, 4);
    return _mm_cvtepi32_ps(_mm_cvtepi8_epi32(_mm_cvtsi32_si128(four)));
}

static inline void k_scales(SubPair *w, RowScales s, int p) {
    const int g = p / 4; /* 4 pairs a super-block */
    spread(w, _mm_mul_ps(_mm_set1_ps(s.d[g]), int8x4(s.sc + 4 * p)));
    w->off = _mm_mul_ps(_mm_set1_ps(s.offset[g]), int8x4(s.mn + 4 * p));
}

static inline __m256 sub_accumulate(__m256 acc, const SubPair *w, const int8_t *x, const float *lane_scale) {
    const __m256i lo = dot_byte_vector(w->c[0], _mm256_loadu_si256((const __m256i *)x));
    const __m256i hi = dot_byte_vector(w->c[1], _mm256_loadu_si256((const __m256i *)(x + 32)));
    const __m256 xd = _mm256_loadu_ps(lane_scale);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), _mm256_mul_ps(w->lo, xd), acc);
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), _mm256_mul_ps(w->hi, xd), acc);
}

/* fixed-order sum of 4 lanes */
static inline float hsum4(__m128 s) {
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* One pair of a weight row, its codes as bytes and its sub-block scales. */
#define DEFINE_SUB_LOAD(NAME, CODES, SCALES, PAIR_BYTES)                                                             \
    static inline __attribute__((always_inline)) SubPair NAME(const uint8_t *__restrict__ codes, RowScales s, int p) { \
        SubPair w;                                                                                                   \
        CODES(codes + (long)p * PAIR_BYTES, w.c);                                                                    \
        SCALES(&w, s, p);                                                                                            \
        return w;                                                                                                    \
    }

/* out[r * N] for `rows` (1 to ROW_TILE, a constant after inlining) input rows from `row` and one weight
 * row: its pairs as loaded (`unpacked`, where the caller unpacked them once for every row tile), else
 * its codes and scales, loaded here */
#define DEFINE_SUB_TILE(NAME, LOAD, ACCUMULATE, PAIR_BYTES)                                                          \
    static inline __attribute__((always_inline)) void NAME(ByteRows q, const float *sums, long row, int rows,       \
                                                           int pairs, const SubPair *__restrict__ unpacked,          \
                                                           const uint8_t *__restrict__ codes,                        \
                                                           RowScales s, float *__restrict__ out, long N) {           \
        __m256 acc[ROW_TILE];                                                                                        \
        __m128 off[ROW_TILE];                                                                                        \
        for (int r = 0; r < ROW_TILE; r++) acc[r] = _mm256_setzero_ps(), off[r] = _mm_setzero_ps();                  \
        for (int p = 0; p < pairs; p++) {                                                                            \
            SubPair w;                                                                                               \
            if (unpacked) {                                                                                          \
                w = unpacked[p];                                                                                     \
            } else {                                                                                                 \
                _mm_prefetch((const char *)(codes + (long)p * PAIR_BYTES) + PREFETCH_BYTES, _MM_HINT_T0);            \
                w = LOAD(codes, s, p);                                                                               \
            }                                                                                                        \
            for (int r = 0; r < rows; r++) {                                                                         \
                const long xp = (row + r) * pairs + p;                                                               \
                acc[r] = ACCUMULATE(acc[r], &w, q.codes + xp * PAIR, q.lane_scale + xp * 8);                         \
                off[r] = _mm_fmadd_ps(w.off, _mm_loadu_ps(sums + xp * 4), off[r]);                                   \
            }                                                                                                        \
        }                                                                                                            \
        for (int r = 0; r < rows; r++) out[r * N] = hsum(acc[r]) + hsum4(off[r]);                                    \
    }

/* The scales of weight row n: per super-block and per 16 weights. */
static inline RowScales row_scales(const float *d, const float *offset, const int8_t *sc, const int8_t *mn,
                                   long n, int pairs) {
    return (RowScales){d + n * (pairs / 4), offset + n * (pairs / 4), sc + n * 4 * pairs, mn + n * 4 * pairs};
}

/* a K-quant weight's pair p of row n, and its tile against row n (block_linear.c's SWEEP_GROUPS, asked
 * for one weight row a tile: wrows is always 1) */
#define SUB_PAIR(LOAD, TILE, PAIR_BYTES, n, p)                                                             \
    LOAD(codes + (long)(n) * pairs * PAIR_BYTES, row_scales(d, offset, sc, mn, n, pairs), p)
#define SUB_TILE(LOAD, TILE, PAIR_BYTES, rows, wrows, w, n, r, o)                                         \
    TILE(q, sums, r, rows, pairs, w, codes + (long)(n) * pairs * PAIR_BYTES, row_scales(d, offset, sc, mn, n, pairs), \
         o, N)

/* x [M, K] fp32; codes [N, P * 8 bits]; d, offset [N, K/256] fp32 and sc, mn [N, K/16] int8 as above;
 * out [M, N] fp32. Returns 0, or -1 without memory for the activation codes or a thread's unpacked
 * pairs. */
#define DEFINE_SUB_LINEAR(NAME, TILE, LOAD, PAIR_BYTES)                                                      \
    int NAME(const float *__restrict__ x, const uint8_t *__restrict__ codes, const float *d, const float *offset, \
             const int8_t *__restrict__ sc, const int8_t *__restrict__ mn,                                    \
             float *__restrict__ out, int M, int N, int K, int num_threads) {                                \
        const int pairs = (K / BLOCK + 1) / 2;                                                               \
        ByteRows q = {aligned_alloc(64, sizeof(int8_t) * (size_t)M * pairs * PAIR),                          \
                      aligned_alloc(64, sizeof(float) * (size_t)M * pairs * 8), NULL};                       \
        float *sums = malloc(sizeof(float) * (size_t)M * pairs * 4);                                         \
        q.scaled_sum = malloc(sizeof(float) * (size_t)M * pairs * 2);                                        \
        if (!q.codes || !q.lane_scale || !q.scaled_sum || !sums) {                                           \
            free(q.codes), free(q.lane_scale), free(q.scaled_sum), free(sums);                               \
            return -1;                                                                                       \
        }                                                                                                    \
        quantize_rows_8bit(x, M, K, q, num_threads);                                                         \
        sub_block_sums(q, M, pairs, sums, num_threads);                                                      \
        SWEEP_GROUPS(SubPair, SUB_PAIR, SUB_TILE, LOAD, TILE, PAIR_BYTES, 1)                                 \
        free(q.codes), free(q.lane_scale), free(q.scaled_sum), free(sums);                                   \
        return failed ? -1 : 0;                                                                              \
    }

#define DEFINE_KIND(BITS)                                                           \
    DEFINE_SUB_LOAD(k##BITS##_load, CODES_##BITS, k_scales, 8 * BITS)                \
    DEFINE_SUB_TILE(k##BITS##_tile, k##BITS##_load, sub_accumulate, 8 * BITS)        \
    DEFINE_SUB_LINEAR(k##BITS##_linear_f32, k##BITS##_tile, k##BITS##_load, 8 * BITS)

DEFINE_KIND(2)
DEFINE_KIND(3)
DEFINE_KIND(4)
DEFINE_KIND(5)
DEFINE_KIND(6)
LINEARS_END
