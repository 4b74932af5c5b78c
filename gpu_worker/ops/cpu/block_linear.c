/* Linear layers over GGUF's blocks of 32 on the CPU (Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0): fp32 activations
 * in, fp32 out, integer dot products inside.
 *
 * Built by gpu_worker/ops/cpu/build.py with the system C compiler, called through ctypes.
 * A weight [N, K] is N rows of G = K/32 blocks of 32 weights, each row padded to P = ceil(G/2)
 * pairs of blocks (a padding block is all zero). Per row and pair, the codes of blocks A = 2p and
 * B = 2p + 1 are stored as (block_linear.py and kquant_linear.py pack them):
 *   Q4_1: 32 bytes: A's 16 bytes, then B's; byte j holds code j (low nibble) and j + 16 (high), as
 *         a GGUF Q4_1 block has them; w = code * d + m
 *   Q5_1: those 32 bytes of the low four bits, then 8 bytes of fifth bits: A's 4, then B's; byte c
 *         holds the bit of weights 8c..8c+7 at bits 0..7; w = code * d + m
 *   Q4_0, Q5_0: Q4_1's and Q5_1's bytes; w = (code - zero) * d, zero 8 and 16
 *   Q8_0: 64 bytes: the four 16-byte chunks [A 8c..8c+7, B 8c..8c+7] of int8 codes; w = code * d
 * Beside them, per row and block: d [N, 2P] fp16 and, for Q4_1 and Q5_1, m [2P, N] fp16, a column a
 * row (a GGUF block's own scale and offset, exactly).
 *
 * Each call first quantizes its input rows in blocks of 32 (x ~ xcode * xd, xd = max |x| / code max)
 * into codes stored in the same pair order:
 *   - Q4_1 and Q5_1 take 8-bit codes, as llama.cpp's Q8_1 activations: a pair is two vectors of 32
 *     byte codes [A 0..15 | B 0..15], [A 16..31 | B 16..31], and one multiply-add (maddubs) takes 32
 *     pairs of an unsigned weight code and a signed input code. Their perplexity stays within 1 % of
 *     llama.cpp's on the same file (docs/models.md); 16-bit codes took twice the multiply-adds.
 *   - Q8_0 takes 8-bit codes too where the build has VNNI (load_q8_0 below says how). Without it,
 *     16-bit codes (about 5 significant digits), widened weight codes and 16-bit multiply-adds: for
 *     signed weights, 8-bit input codes need a sign instruction a vector on top, and were no faster.
 * Either way a pair's products sum into int32 lanes 0-3 for block A and 4-7 for block B, scaled
 * lane-wise by [d_A xd_A x4 | d_B xd_B x4] into one fp32 accumulator. For Q4_0 and Q5_0 (and Q8_0 with
 * VNNI, its codes + 128 as unsigned bytes) each lane's sum starts at -zero * the sum of its input codes
 * (zero_code_bias, once a call), so it ends at the dot product of the signed codes (code - zero): no
 * offsets and no pass for them. Q4_1 and Q5_1 then add the sum
 * over blocks of m * xd * sum(xcode) in a pass of their own (DEFINE_OFFSETS), 8 outputs a vector with
 * each output's operations those of its own short dot product: computed one output at a time after
 * its sums it was a third of a linear's time.
 *
 * Blocking: a thread takes GROUP_ROWS weight rows (in L1 while it works on them) and sweeps the
 * input rows ROW_TILE at a time, so each loaded weight pair serves ROW_TILE rows from registers
 * and each tile of input codes serves GROUP_ROWS weight rows from L1; where the weight pairs are
 * unpacked (more than ROW_TILE input rows), each load of a row's codes serves WEIGHT_TILE weight rows.
 * Reading a weight straight from memory (up to ROW_TILE input rows: a decode step of a few sequences, the
 * vocabulary head) a thread takes one weight row at a time, one sequential stream: WEIGHT_TILE rows'
 * interleaved streams took up to twice as long (docs/performance.md).
 *
 * out[r, n] is computed by one thread with the same sequence of operations whatever M, the row
 * tile it falls in, the thread count or which thread takes it: a row's codes depend only on that
 * row, one 8-lane fp32 accumulator takes the pairs in order, then a fixed horizontal sum. A row's
 * output is therefore the same bits alone, in a decode batch or in a prefill chunk.
 *
 * Where the build enables VNNI (build.py's variants), its dot products fuse the multiply-adds and the
 * sum into int32 lanes (dot_bytes, dot_words); the integer sums are the same, so are the outputs of
 * every kind but Q8_0, whose input codes are 8-bit there.
 *
 * Needs AVX2, FMA and F16C (the build fails elsewhere and the caller falls back to torch).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "block_linear.c needs AVX2, FMA and F16C"
#endif

/* build.py's avx512 variant defines AVX512_REGIONS: the linears here and in kquant_linear.c take
 * AVX-512 (VNNI, byte masks, 32 registers) in 256-bit vectors, each file in a region of its own, and
 * paged_attention.c its value rows alone; the rest of the build stays AVX2, as paged_attention.c ran
 * 1.6x slower compiled whole for AVX-512. */
#ifdef AVX512_REGIONS
#define AVX512_BEGIN                                                                                      \
    _Pragma("GCC push_options")                                                                            \
    _Pragma("GCC target(\"avx512f,avx512vl,avx512bw,avx512vnni,prefer-vector-width=256\")")
#define AVX512_END _Pragma("GCC pop_options")
#else
#define AVX512_BEGIN
#define AVX512_END
#endif
AVX512_BEGIN

#define BLOCK 32
#define PAIR 64         /* weights per pair of blocks */
#define Q4_1_PAIR_BYTES 32
#define Q5_1_PAIR_BYTES 40
#define Q8_0_PAIR_BYTES 64
#define ROW_TILE 4      /* input rows sharing one widened weight pair (the calls below name 1-3) */
#define GROUP_ROWS 16   /* weight rows one thread takes at a time */
/* Where AVX-512 gives 32 vector registers: weight rows sharing each load of an input row's codes in a
 * tile, their 3 x ROW_TILE accumulators and pairs in registers (2 and 4 were a little slower),
 * and rows sharing each converted vector of offsets in the offsets' pass, 8 partial sums each.
 * 1 and 1 elsewhere. */
#if defined(__AVX512VL__)
#define WEIGHT_TILE 3
#define OFFSET_ROWS 3
#else
#define WEIGHT_TILE 1
#define OFFSET_ROWS 1
#endif
#define CODE_MAX 32767  /* 16-bit activation codes */
#define BYTE_CODE_MAX 127 /* 8-bit activation codes */
/* How far ahead of the pair in hand a thread asks for its weights. The hardware prefetchers stop
 * at each 4 KiB page, so a thread streaming a decode step's weights waited on every page
 * (docs/performance.md, "Figures behind the CPU kernels' settings"). */
#define PREFETCH_BYTES 4096

#if defined(__AVXVNNI__)
#define DPBUSD _mm256_dpbusd_avx_epi32
#define DPWSSD _mm256_dpwssd_avx_epi32
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define DPBUSD _mm256_dpbusd_epi32
#define DPWSSD _mm256_dpwssd_epi32
#endif

/* int32 lane i = acc_i + the sum over bytes 4i..4i+3 of u * s: unsigned byte codes u, signed byte codes
 * s. Without VNNI a 16-bit lane holds 2 products first, so the caller keeps their sum below 2^15. */
static inline __m256i dot_byte_vector_from(__m256i acc, __m256i u, __m256i s) {
#ifdef DPBUSD
    return DPBUSD(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

static inline __m256i dot_byte_vector(__m256i u, __m256i s) { return dot_byte_vector_from(_mm256_setzero_si256(), u, s); }

/* the same over two vector pairs, acc + u0 * s0 + u1 * s1. Without VNNI a 16-bit lane holds 4 products. */
static inline __m256i dot_bytes_from(__m256i acc, __m256i u0, __m256i s0, __m256i u1, __m256i s1) {
#ifdef DPBUSD
    return DPBUSD(DPBUSD(acc, u0, s0), u1, s1);
#else
    const __m256i s = _mm256_add_epi16(_mm256_maddubs_epi16(u0, s0), _mm256_maddubs_epi16(u1, s1));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(s, _mm256_set1_epi16(1)));
#endif
}

/* int32 lane i = sum over words 2i, 2i+1 of a0 * b0 + a1 * b1 (int16 codes) */
static inline __m256i dot_words(__m256i a0, __m256i b0, __m256i a1, __m256i b1) {
#ifdef DPWSSD
    return DPWSSD(_mm256_madd_epi16(a0, b0), a1, b1);
#else
    return _mm256_add_epi32(_mm256_madd_epi16(a0, b0), _mm256_madd_epi16(a1, b1));
#endif
}

/* fixed-order sum of 8 lanes: (0+4, 1+5, 2+6, 3+7), then pairs, then the last two */
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* One block of 32 inputs (NULL: a padding block) -> codes c ~ v / d with |c| <= code_max, rounded
 * to nearest even (the default rounding mode's conversion, as nearbyintf); returns d (0 for an
 * all-zero block) and sets *sum to the sum of the codes. */
static inline float quantize_block(const float *__restrict__ v, float code_max, int codes[BLOCK], int *sum) {
    if (!v) {
        for (int i = 0; i < BLOCK; i++) codes[i] = 0;
        *sum = 0;
        return 0.f;
    }
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    __m256 amax8 = _mm256_setzero_ps();
    for (int i = 0; i < BLOCK; i += 8) amax8 = _mm256_max_ps(amax8, _mm256_and_ps(_mm256_loadu_ps(v + i), magnitude));
    __m128 amax4 = _mm_max_ps(_mm256_castps256_ps128(amax8), _mm256_extractf128_ps(amax8, 1));
    amax4 = _mm_max_ps(amax4, _mm_movehl_ps(amax4, amax4));
    const float amax = _mm_cvtss_f32(_mm_max_ss(amax4, _mm_movehdup_ps(amax4)));
    const float d = amax / code_max;
    const __m256 inv = _mm256_set1_ps(d > 0.f ? 1.f / d : 0.f);
    __m256i sum8 = _mm256_setzero_si256();
    for (int i = 0; i < BLOCK; i += 8) {
        const __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + i), inv));
        _mm256_storeu_si256((__m256i *)(codes + i), c);
        sum8 = _mm256_add_epi32(sum8, c);
    }
    __m128i sum4 = _mm_add_epi32(_mm256_castsi256_si128(sum8), _mm256_extracti128_si256(sum8, 1));
    sum4 = _mm_add_epi32(sum4, _mm_shuffle_epi32(sum4, 0x4E));
    *sum = _mm_cvtsi128_si32(_mm_add_epi32(sum4, _mm_shuffle_epi32(sum4, 0xB1)));
    return d;
}

/* The input rows as codes of one width: codes [M, P * 64] in pair order; per pair the lane scales
 * [M, P * 8] (xd_A x4, xd_B x4); per block [M, 2P] xd * sum(codes). */
#define DEFINE_ROWS(TYPE, CODE)                                                                            \
    typedef struct {                                                                                       \
        CODE *codes;                                                                                       \
        float *lane_scale;                                                                                 \
        float *scaled_sum;                                                                                 \
    } TYPE;
DEFINE_ROWS(QuantRows, int16_t)
DEFINE_ROWS(ByteRows, int8_t)

/* rows [M, K] fp32 -> TYPE (padding blocks zero); rows split over the
 * threads from QUANTIZE_ROWS_A_THREAD rows a thread (a row's codes depend on that row only) */
#define QUANTIZE_ROWS_A_THREAD 8
#define DEFINE_QUANT_ROWS(TYPE, CODE, QUANTIZE, MAX, PLACE)                                               \
    static void QUANTIZE(const float *__restrict__ x, int M, int K, TYPE q, int num_threads) {            \
        const int blocks = K / BLOCK, pairs = (blocks + 1) / 2;                                            \
        _Pragma("omp parallel for num_threads(num_threads) if (M >= 2 * QUANTIZE_ROWS_A_THREAD)")          \
        for (long r = 0; r < M; r++) {                                                                     \
            for (int b = 0; b < 2 * pairs; b++) {                                                          \
                int codes[BLOCK], sum;                                                                     \
                const float d = quantize_block(b < blocks ? x + r * K + (long)b * BLOCK : NULL, MAX, codes, &sum); \
                CODE *pair_codes = q.codes + (r * pairs + b / 2) * PAIR;                                   \
                PLACE(pair_codes, b % 2, codes);                                                           \
                float *lanes = q.lane_scale + (r * pairs + b / 2) * 8 + (b % 2) * 4;                       \
                for (int i = 0; i < 4; i++) lanes[i] = d;                                                  \
                q.scaled_sum[r * 2 * pairs + b] = d * (float)sum;                                          \
            }                                                                                              \
        }                                                                                                  \
    }

/* A block's codes into block A's (half 0) or B's (half 1) places of its pair: 16-bit codes in four
 * chunks of [A 8c..8c+7 | B 8c..8c+7], 8-bit ones in two vectors of [A 16v..16v+15 | B 16v..16v+15]
 * (the codes fit: saturating packs leave them as they are). */
static inline void place_words(int16_t *__restrict__ pair, int half, const int codes[BLOCK]) {
    for (int c = 0; c < 4; c++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(codes + 8 * c));
        _mm_storeu_si128((__m128i *)(pair + c * 16 + half * 8),
                         _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)));
    }
}

static inline void place_bytes(int8_t *__restrict__ pair, int half, const int codes[BLOCK]) {
    __m256i v[4];
    for (int c = 0; c < 4; c++) v[c] = _mm256_loadu_si256((const __m256i *)(codes + 8 * c));
    const __m256i w01 = _mm256_packs_epi32(v[0], v[1]), w23 = _mm256_packs_epi32(v[2], v[3]);
    /* per 128-bit lane, codes 0-3, 8-11, 16-19, 24-27, then 4-7, 12-15, 20-23, 28-31: put in order */
    const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w01, w23), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm_storeu_si128((__m128i *)(pair + half * 16), _mm256_castsi256_si128(bytes));
    _mm_storeu_si128((__m128i *)(pair + 32 + half * 16), _mm256_extracti128_si256(bytes, 1));
}

DEFINE_QUANT_ROWS(QuantRows, int16_t, quantize_rows, CODE_MAX, place_words)
DEFINE_QUANT_ROWS(ByteRows, int8_t, quantize_rows_8bit, BYTE_CODE_MAX, place_bytes)

/* For weights whose offset is -zero * scale (w = scale * (code - zero)): per input row and pair of 8-bit
 * codes [M, P * 64], -zero * the sum of the input codes in each int32 lane of the pair's two vectors of
 * dot products, so that a lane's sum starts there and ends at the dot product of the signed codes
 * (code - zero) with the input's. `vectors` 1: one 8-lane bias a pair, the two vectors' lanes added (all
 * 32 products of a block take its one scale: Q4_0, Q5_0); 2: one a vector (kquant_linear.c's 16-weight
 * sub-blocks, each scaled apart). */
static void zero_code_bias(const int8_t *codes, int M, int pairs, int zero, int vectors, int32_t *__restrict__ bias,
                           int num_threads) {
    _Pragma("omp parallel for num_threads(num_threads) if (M >= 2 * QUANTIZE_ROWS_A_THREAD)")
    for (long rp = 0; rp < (long)M * pairs; rp++) {
        const __m256i z = _mm256_set1_epi8((char)zero), none = _mm256_setzero_si256();
        const __m256i lo = dot_byte_vector(z, _mm256_loadu_si256((const __m256i *)(codes + rp * PAIR)));
        const __m256i hi = dot_byte_vector(z, _mm256_loadu_si256((const __m256i *)(codes + rp * PAIR + 32)));
        if (vectors == 1) {
            _mm256_storeu_si256((__m256i *)(bias + rp * 8), _mm256_sub_epi32(none, _mm256_add_epi32(lo, hi)));
        } else {
            _mm256_storeu_si256((__m256i *)(bias + rp * 16), _mm256_sub_epi32(none, lo));
            _mm256_storeu_si256((__m256i *)(bias + rp * 16 + 8), _mm256_sub_epi32(none, hi));
        }
    }
}

/* A weight pair widened to four vectors of 16 int16 codes (the layout above) and its lane
 * scales [d_A x4 | d_B x4] in fp32. */
typedef struct {
    __m256i c[4];
    __m256 d;
} Pair;

/* A weight pair as two vectors of 32 unsigned byte codes [A 0..15 | B 0..15], [A 16..31 | B 16..31] and
 * its lane scales. */
typedef struct {
    __m256i c[2];
    __m256 d;
} BytePair;

static inline __m256 lane_scales(const uint16_t *d) {
    uint32_t two;
    __builtin_memcpy(&two, d, 4);
    const __m128 ab = _mm_cvtph_ps(_mm_cvtsi32_si128((int)two)); /* d_A, d_B, 0, 0 */
    return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(ab), _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
}

/* the nibble plane as byte codes: lo holds c = 0, 1 in each lane's bytes 0-7, 8-15 (lane 0 A's weights
 * 8c..8c+7, lane 1 B's), hi c = 2, 3 */
static inline void nibble_bytes(const uint8_t *p, __m256i *lo, __m256i *hi) {
    const __m256i raw = _mm256_loadu_si256((const __m256i *)p);
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    *lo = _mm256_and_si256(raw, low4), *hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
}

/* The bit plane joined to byte codes laid out as nibble_bytes' (1 << at added where the bit is set;
 * that bit of the codes is clear). The plane's 8 bytes are A's 4, then B's; byte c holds the bits of
 * weights 8c..8c+7, so bit j of each block's 32 is weight j. */
#if defined(__AVX512BW__) && defined(__AVX512VL__)
/* AVX-512: the bits of lo's weights (A 0-15, B 0-15) and of hi's (A 16-31, B 16-31) are each a byte
 * mask, gathered by one pext */
static inline void join_bits(const uint8_t *p, int at, __m256i *lo, __m256i *hi) {
    uint64_t plane;
    __builtin_memcpy(&plane, p, 8);
    const __m256i value = _mm256_set1_epi8((char)(1 << at));
    *lo = _mm256_mask_add_epi8(*lo, (__mmask32)_pext_u64(plane, 0x0000FFFF0000FFFFULL), *lo, value);
    *hi = _mm256_mask_add_epi8(*hi, (__mmask32)_pext_u64(plane, 0xFFFF0000FFFF0000ULL), *hi, value);
}
#else
/* AVX2: both lanes hold the plane's 8 bytes (one broadcast load); lane 0 spreads A's byte c, lane 1 B's,
 * over the 8 bytes of weights 8c..8c+7, one bit each. (Placing A's 4 bytes in lane 0 and B's in lane 1
 * first, a cross-lane permute, made a one-row Q5_0 call 8-10 % slower on a Zen 3, one thread.) */
static inline void join_bits(const uint8_t *p, int at, __m256i *lo, __m256i *hi) {
    long long plane;
    __builtin_memcpy(&plane, p, 8);
    const __m256i t = _mm256_set1_epi64x(plane); /* [A's 4 bytes, B's 4] in each lane */
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i value = _mm256_set1_epi8((char)(1 << at));
    const __m256i c01 = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                         4, 4, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5, 5, 5);
    const __m256i c23 = _mm256_add_epi8(c01, _mm256_set1_epi8(2));
    const __m256i b01 = _mm256_and_si256(_mm256_shuffle_epi8(t, c01), bit);
    const __m256i b23 = _mm256_and_si256(_mm256_shuffle_epi8(t, c23), bit);
    *lo = _mm256_or_si256(*lo, _mm256_and_si256(_mm256_cmpeq_epi8(b01, bit), value));
    *hi = _mm256_or_si256(*hi, _mm256_and_si256(_mm256_cmpeq_epi8(b23, bit), value));
}
#endif

static inline BytePair load_q4_1(const uint8_t *codes, const uint16_t *d) {
    BytePair p;
    nibble_bytes(codes, &p.c[0], &p.c[1]);
    p.d = lane_scales(d);
    return p;
}

/* the fifth bits join the nibbles as bytes */
static inline BytePair load_q5_1(const uint8_t *codes, const uint16_t *d) {
    BytePair p;
    nibble_bytes(codes, &p.c[0], &p.c[1]);
    join_bits(codes + 32, 4, &p.c[0], &p.c[1]);
    p.d = lane_scales(d);
    return p;
}

/* acc += (w . x) * [d xd] for one pair of one input row's 16-bit codes. Every partial integer sum is
 * below 2^24 (|w| <= 127, |x| <= 2^15 - 1, 16 products a lane), so the int32 -> fp32 conversion is exact.
 * (`bias`: no zero code on this path, NULL.) */
static inline __m256 accumulate_words(__m256 acc, const Pair *w, const int16_t *x, const float *lane_scale,
                                      const int32_t *bias) {
    (void)bias;
    const __m256i *v = (const __m256i *)x;
    const __m256i s = _mm256_add_epi32(dot_words(w->c[0], _mm256_loadu_si256(v), w->c[1], _mm256_loadu_si256(v + 1)),
                                       dot_words(w->c[2], _mm256_loadu_si256(v + 2), w->c[3], _mm256_loadu_si256(v + 3)));
    const __m256 scale = _mm256_mul_ps(w->d, _mm256_loadu_ps(lane_scale));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), scale, acc);
}

/* The same for unsigned byte codes (at most 31; 255 with VNNI, which sums in int32 lanes directly: Q8_0)
 * and 8-bit input codes, each lane's sum from its zero code bias (NULL: none): without VNNI a 16-bit
 * lane of the two multiply-adds' sum holds 4 products of at most 31 * 127, and an int32 lane at most 8
 * products and the bias of 8 codes, each at most 255 * 127, so nothing saturates and the conversion is
 * exact. */
static inline __m256 accumulate_bytes(__m256 acc, const BytePair *w, const int8_t *x, const float *lane_scale,
                                      const int32_t *bias) {
    const __m256i start = bias ? _mm256_loadu_si256((const __m256i *)bias) : _mm256_setzero_si256();
    const __m256i s = dot_bytes_from(start, w->c[0], _mm256_loadu_si256((const __m256i *)x),
                                     w->c[1], _mm256_loadu_si256((const __m256i *)(x + 32)));
    const __m256 scale = _mm256_mul_ps(w->d, _mm256_loadu_ps(lane_scale));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), scale, acc);
}

/* out[r * N + j] for `rows` (1 to ROW_TILE) input rows from `row` and `wrows` (1 to WEIGHT_TILE) weight
 * rows from the one given, both constants after inlining: their pairs as loaded (`unpacked`, row j's from
 * unpacked + j * pairs, where the caller unpacked them once for every row tile), else their codes and
 * d, loaded here (SWEEP_GROUPS then passes one weight row); `bias` the input rows' zero code bias [M, P * 8]
 * or NULL. Each output keeps its own accumulator, so its operations do not depend on the tile it falls in. */
#define DEFINE_ROW_TILE(NAME, ROWS, PAIR_T, LOAD, ACCUMULATE, PAIR_BYTES)                               \
    static inline __attribute__((always_inline)) void NAME(ROWS q, const int32_t *bias, long row, int rows,   \
                                                           int wrows, int pairs,                             \
                                                           const PAIR_T *__restrict__ unpacked,              \
                                                           const uint8_t *__restrict__ codes,                \
                                                           const uint16_t *__restrict__ d,                   \
                                                           float *__restrict__ out, long N) {                \
        __m256 acc[WEIGHT_TILE][ROW_TILE];                                                                   \
        for (int j = 0; j < WEIGHT_TILE; j++)                                                                \
            for (int r = 0; r < ROW_TILE; r++) acc[j][r] = _mm256_setzero_ps();                              \
        for (int p = 0; p < pairs; p++) {                                                                    \
            PAIR_T w[WEIGHT_TILE];                                                                           \
            if (unpacked) {                                                                                  \
                for (int j = 0; j < wrows; j++) w[j] = unpacked[(long)j * pairs + p];                        \
            } else {                                                                                         \
                for (int j = 0; j < wrows; j++) {                                                            \
                    const uint8_t *c = codes + ((long)j * pairs + p) * PAIR_BYTES;                           \
                    _mm_prefetch((const char *)c + PREFETCH_BYTES, _MM_HINT_T0);                             \
                    w[j] = LOAD(c, d + (long)j * 2 * pairs + 2 * p);                                         \
                }                                                                                            \
            }                                                                                                \
            for (int r = 0; r < rows; r++) {                                                                 \
                const long xp = (row + r) * pairs + p;                                                       \
                for (int j = 0; j < wrows; j++)                                                              \
                    acc[j][r] = ACCUMULATE(acc[j][r], &w[j], q.codes + xp * PAIR, q.lane_scale + xp * 8,      \
                                           bias ? bias + xp * 8 : NULL);                                     \
            }                                                                                                \
        }                                                                                                    \
        /* the scales: 2 bytes a block against the codes' 16 or 32 */                                        \
        _mm_prefetch((const char *)d + PREFETCH_BYTES / 8, _MM_HINT_T0);                                     \
        for (int r = 0; r < rows; r++)                                                                       \
            for (int j = 0; j < wrows; j++) out[r * N + j] = hsum(acc[j][r]);                                \
    }

DEFINE_ROW_TILE(q4_1_tile, ByteRows, BytePair, load_q4_1, accumulate_bytes, Q4_1_PAIR_BYTES)
DEFINE_ROW_TILE(q5_1_tile, ByteRows, BytePair, load_q5_1, accumulate_bytes, Q5_1_PAIR_BYTES)
#define Q4_0_ZERO 8
#define Q5_0_ZERO 16

/* The body of a linear's call after its input is quantized: the weight rows in groups of GROUP_ROWS
 * over the threads, each group's row tiles in turn. Where the input has more than one row tile, a
 * thread unpacks its group's weight pairs once (GROUP_ROWS x P of them, in L1 or L2) for all its
 * row tiles: the same pairs, so the same bits, as unpacking them for every row tile, which a prefill
 * chunk did M / ROW_TILE times. UNPACK(A, B, C, n, p) gives row n's pair p as PAIR_T, CALL(A, B, C,
 * rows, wrows, w, n, r, o) runs the tile of `rows` input rows from r against `wrows` weight rows from
 * n (w: their unpacked pairs or NULL) into o; A, B, C are the kind's own (its loader, tile, pair bytes).
 * Weight rows go WEIGHTS at a time where unpacked (the group's last few one by one), else one by one.
 * Leaves `failed` set where a thread had no memory for its pairs. */
#define SWEEP_GROUPS(PAIR_T, UNPACK, CALL, A, B, C, WEIGHTS)                                             \
    const int groups = (N + GROUP_ROWS - 1) / GROUP_ROWS, unpack = M > ROW_TILE;                         \
    int failed = 0;                                                                                      \
    _Pragma("omp parallel num_threads(num_threads) reduction(| : failed)")                               \
    {                                                                                                    \
        PAIR_T *group_pairs = unpack ? aligned_alloc(64, sizeof(PAIR_T) * GROUP_ROWS * (size_t)pairs) : NULL; \
        /* guided: a fetch takes the groups left over the thread count, down to one group, so the        \
         * threads finish together after a few fetches a call; a thread the OS preempts (other           \
         * services share the cores) leaves the rest to the others. One group per fetch (dynamic, 1)     \
         * made the fetches themselves the cost (docs/performance.md has the figures). */                \
        _Pragma("omp for schedule(guided)")                                                              \
        for (int g = 0; g < groups; g++) {                                                               \
            const int n0 = g * GROUP_ROWS, n1 = n0 + GROUP_ROWS < N ? n0 + GROUP_ROWS : N;               \
            if (unpack && !group_pairs) {                                                                \
                failed = 1;                                                                              \
                continue;                                                                                \
            }                                                                                            \
            if (unpack)                                                                                  \
                for (int n = n0; n < n1; n++)                                                            \
                    for (int p = 0; p < pairs; p++) group_pairs[(n - n0) * pairs + p] = UNPACK(A, B, C, n, p); \
            for (int r = 0; r < M; r += ROW_TILE) {                                                      \
                const int rows = M - r < ROW_TILE ? M - r : ROW_TILE;                                    \
                for (int n = n0; n < n1;) {                                                              \
                    const PAIR_T *w = unpack ? group_pairs + (n - n0) * pairs : NULL;                    \
                    float *o = out + (long)r * N + n;                                                    \
                    /* constant row counts per call keep the tile in registers */                        \
                    if (WEIGHTS > 1 && unpack && n + WEIGHTS <= n1) {                                    \
                        switch (rows) {                                                                  \
                        case 1: CALL(A, B, C, 1, WEIGHTS, w, n, r, o); break;                            \
                        case 2: CALL(A, B, C, 2, WEIGHTS, w, n, r, o); break;                            \
                        case 3: CALL(A, B, C, 3, WEIGHTS, w, n, r, o); break;                            \
                        default: CALL(A, B, C, ROW_TILE, WEIGHTS, w, n, r, o);                           \
                        }                                                                                \
                        n += WEIGHTS;                                                                    \
                        continue;                                                                        \
                    }                                                                                    \
                    switch (rows) {                                                                      \
                    case 1: CALL(A, B, C, 1, 1, w, n, r, o); break;                                      \
                    case 2: CALL(A, B, C, 2, 1, w, n, r, o); break;                                      \
                    case 3: CALL(A, B, C, 3, 1, w, n, r, o); break;                                      \
                    default: CALL(A, B, C, ROW_TILE, 1, w, n, r, o);                                     \
                    }                                                                                    \
                    n++;                                                                                 \
                }                                                                                        \
            }                                                                                            \
        }                                                                                                \
        free(group_pairs);                                                                               \
    }

/* a block weight's pair p of row n, and its tile against row n */
#define BLOCK_PAIR(LOAD, TILE, PAIR_BYTES, n, p)                                                           \
    LOAD(codes + ((long)(n) * pairs + (p)) * PAIR_BYTES, d + (long)(n) * 2 * pairs + 2 * (p))
#define BLOCK_TILE(LOAD, TILE, PAIR_BYTES, rows, wrows, w, n, r, o)                                       \
    TILE(q, bias, r, rows, wrows, pairs, w, codes + (long)(n) * pairs * PAIR_BYTES, d + (long)(n) * 2 * pairs, o, N)

/* The offsets' pass: out[r, n] += the sum over s of m[s, n] * ss[r, s], ss a row's xd * sum(xcode) per
 * block (or per sub-block: kquant_linear.c's 16-weight scales), m the offsets as read by OFFSETS_T's
 * M8(o, s, n, N) (8 outputs from n, fp32) and M1(o, s, n, N) (one). Per call `rows` (1 to OFFSET_ROWS,
 * a constant after inlining) rows from ss and out, 8 outputs a vector, in the order of one output's
 * 8-lane dot product: the sums below the last whole 8 fma'd into 8 partial sums by s mod 8, those
 * added as hsum adds its lanes, then the rest one at a time. The rows share each converted vector of
 * offsets; each keeps its own partial sums. The outputs past the last whole vector take the same
 * operations one at a time, so an output's sum is the same wherever it falls. ADD_OFFSETS runs it
 * over out [M, N] with S sums a row, OFFSET_ROWS rows a call (its case 2 never more than OFFSET_ROWS: with
 * OFFSET_ROWS 1 it is never taken, yet an instance of 2 rows reads past `lane`, which gcc warns of). */
#define DEFINE_OFFSETS(OFFSET_ROWS_FN, ADD_OFFSETS, OFFSETS_T, M8, M1)                                           \
    static inline __attribute__((always_inline)) void OFFSET_ROWS_FN(const float *__restrict__ ss, OFFSETS_T m,   \
                                                                     float *__restrict__ out, int rows, int N,    \
                                                                     int S) {                                     \
        const int whole = S - S % 8;                                                                              \
        int n = 0;                                                                                                \
        for (; n + 8 <= N; n += 8) {                                                                              \
            __m256 lane[OFFSET_ROWS][8];                                                                          \
            for (int r = 0; r < OFFSET_ROWS; r++)                                                                 \
                for (int l = 0; l < 8; l++) lane[r][l] = _mm256_setzero_ps();                                     \
            for (int s0 = 0; s0 < whole; s0 += 8)                                                                 \
                for (int l = 0; l < 8; l++) {                                                                     \
                    const __m256 v = M8(m, s0 + l, n, N);                                                         \
                    for (int r = 0; r < rows; r++)                                                                \
                        lane[r][l] = _mm256_fmadd_ps(v, _mm256_set1_ps(ss[(long)r * S + s0 + l]), lane[r][l]);    \
                }                                                                                                 \
            for (int r = 0; r < rows; r++) {                                                                      \
                const __m256 *v = lane[r];                                                                        \
                __m256 t = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(v[0], v[4]), _mm256_add_ps(v[2], v[6])),     \
                                         _mm256_add_ps(_mm256_add_ps(v[1], v[5]), _mm256_add_ps(v[3], v[7])));    \
                for (int s = whole; s < S; s++) t = _mm256_fmadd_ps(M8(m, s, n, N), _mm256_set1_ps(ss[(long)r * S + s]), t); \
                float *o = out + (long)r * N + n;                                                                 \
                _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), t));                                        \
            }                                                                                                     \
        }                                                                                                         \
        for (; n < N; n++)                                                                                        \
            for (int r = 0; r < rows; r++) {                                                                      \
                const float *x = ss + (long)r * S;                                                                \
                float lane[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};                                         \
                for (int s = 0; s < whole; s++) lane[s % 8] = fmaf(M1(m, s, n, N), x[s], lane[s % 8]);            \
                float t = ((lane[0] + lane[4]) + (lane[2] + lane[6])) + ((lane[1] + lane[5]) + (lane[3] + lane[7])); \
                for (int s = whole; s < S; s++) t = fmaf(M1(m, s, n, N), x[s], t);                                \
                out[(long)r * N + n] += t;                                                                        \
            }                                                                                                     \
    }                                                                                                             \
    static void ADD_OFFSETS(const float *__restrict__ sums, OFFSETS_T m, float *__restrict__ out, int M, int N,    \
                            int S, int num_threads) {                                                             \
        _Pragma("omp parallel for num_threads(num_threads) if (M >= 2 * ROW_TILE)")                               \
        for (long r = 0; r < M; r += OFFSET_ROWS) {                                                               \
            const float *ss = sums + r * S;                                                                       \
            float *o = out + r * N;                                                                               \
            switch (M - r < OFFSET_ROWS ? M - r : OFFSET_ROWS) {                                                  \
            case 1: OFFSET_ROWS_FN(ss, m, o, 1, N, S); break;                                                     \
            case 2: OFFSET_ROWS_FN(ss, m, o, OFFSET_ROWS < 2 ? OFFSET_ROWS : 2, N, S); break;                   \
            default: OFFSET_ROWS_FN(ss, m, o, OFFSET_ROWS, N, S);                                                 \
            }                                                                                                     \
        }                                                                                                         \
    }

/* Q4_1 and Q5_1: fp16 offsets [2P, N], a block's m per output */
typedef struct {
    const uint16_t *m;
} HalfOffsets;
#define HALF_OFFSETS_8(o, s, n, N) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((o).m + (long)(s) * (N) + (n))))
#define HALF_OFFSETS_1(o, s, n, N) _cvtsh_ss((o).m[(long)(s) * (N) + (n)])
DEFINE_OFFSETS(half_offset_rows, add_half_offsets, HalfOffsets, HALF_OFFSETS_8, HALF_OFFSETS_1)

/* x [M, K] fp32; codes [N, P * pair bytes], d [N, 2P] fp16, offsets [2P, N] fp16 (Q4_1, Q5_1) or NULL
 * (Q4_0, Q5_0, Q8_0); out [M, N] fp32. ZERO: the kind's zero code (Q4_0, Q5_0, Q8_0 with VNNI), else 0.
 * Returns 0, or -1 without memory for the activation codes or a thread's unpacked pairs. */
#define DEFINE_LINEAR(NAME, TILE, ROWS, QUANTIZE, PAIR_T, LOAD, PAIR_BYTES, ZERO)                          \
    int NAME(const float *__restrict__ x, const uint8_t *__restrict__ codes, const uint16_t *__restrict__ d,   \
             const uint16_t *__restrict__ offsets, float *__restrict__ out, int M, int N, int K, int num_threads) { \
        const int pairs = (K / BLOCK + 1) / 2;                                                               \
        ROWS q = {aligned_alloc(64, sizeof(*q.codes) * (size_t)M * pairs * PAIR),                             \
                  aligned_alloc(64, sizeof(float) * (size_t)M * pairs * 8),                                  \
                  malloc(sizeof(float) * (size_t)M * pairs * 2)};                                            \
        int32_t *bias = ZERO ? aligned_alloc(64, sizeof(int32_t) * (size_t)M * pairs * 8) : NULL;            \
        if (!q.codes || !q.lane_scale || !q.scaled_sum || (ZERO && !bias)) {                                 \
            free(q.codes), free(q.lane_scale), free(q.scaled_sum), free(bias);                               \
            return -1;                                                                                       \
        }                                                                                                    \
        QUANTIZE(x, M, K, q, num_threads);                                                                   \
        if (ZERO) zero_code_bias((const int8_t *)q.codes, M, pairs, ZERO, 1, bias, num_threads);             \
        SWEEP_GROUPS(PAIR_T, BLOCK_PAIR, BLOCK_TILE, LOAD, TILE, PAIR_BYTES, WEIGHT_TILE)                    \
        if (offsets && !failed) add_half_offsets(q.scaled_sum, (HalfOffsets){offsets}, out, M, N, 2 * pairs, num_threads); \
        free(q.codes), free(q.lane_scale), free(q.scaled_sum), free(bias);                                   \
        return failed ? -1 : 0;                                                                              \
    }

DEFINE_LINEAR(q4_1_linear_f32, q4_1_tile, ByteRows, quantize_rows_8bit, BytePair, load_q4_1, Q4_1_PAIR_BYTES, 0)
DEFINE_LINEAR(q4_0_linear_f32, q4_1_tile, ByteRows, quantize_rows_8bit, BytePair, load_q4_1, Q4_1_PAIR_BYTES, Q4_0_ZERO)
DEFINE_LINEAR(q5_1_linear_f32, q5_1_tile, ByteRows, quantize_rows_8bit, BytePair, load_q5_1, Q5_1_PAIR_BYTES, 0)
DEFINE_LINEAR(q5_0_linear_f32, q5_1_tile, ByteRows, quantize_rows_8bit, BytePair, load_q5_1, Q5_1_PAIR_BYTES, Q5_0_ZERO)

#ifdef DPBUSD
/* Q8_0 on 8-bit codes where VNNI takes their products without saturating: the weight codes + 128 as
 * unsigned bytes, put in the byte pair order, against the signed input codes. Each lane's sum starts at
 * -128 * the sum of its input codes (zero_code_bias, as Q4_0's and Q5_0's), so it ends exactly at the
 * 16-bit path's integer dot product of 8-bit codes (at most 8 * 255 * 127 on the way). */
#define Q8_0_CODE_MAX BYTE_CODE_MAX
#define Q8_0_ZERO 128

static inline BytePair load_q8_0(const uint8_t *codes, const uint16_t *d) {
    const __m256i shift = _mm256_set1_epi8((char)128);
    BytePair p;
    for (int v = 0; v < 2; v++) /* [A 0-7, B 0-7 | A 8-15, B 8-15] -> [A 0-15 | B 0-15], by quarters */
        p.c[v] = _mm256_xor_si256(_mm256_permute4x64_epi64(_mm256_loadu_si256((const __m256i *)(codes + 32 * v)), 0xD8), shift);
    p.d = lane_scales(d);
    return p;
}

DEFINE_ROW_TILE(q8_0_tile, ByteRows, BytePair, load_q8_0, accumulate_bytes, Q8_0_PAIR_BYTES)
DEFINE_LINEAR(q8_0_linear_f32, q8_0_tile, ByteRows, quantize_rows_8bit, BytePair, load_q8_0, Q8_0_PAIR_BYTES, Q8_0_ZERO)
#else
#define Q8_0_CODE_MAX CODE_MAX
static inline Pair load_q8_0(const uint8_t *codes, const uint16_t *d) {
    Pair p;
    for (int c = 0; c < 4; c++) p.c[c] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(codes + 16 * c)));
    p.d = lane_scales(d);
    return p;
}

DEFINE_ROW_TILE(q8_0_tile, QuantRows, Pair, load_q8_0, accumulate_words, Q8_0_PAIR_BYTES)
DEFINE_LINEAR(q8_0_linear_f32, q8_0_tile, QuantRows, quantize_rows, Pair, load_q8_0, Q8_0_PAIR_BYTES, 0)
#endif
/* the largest input code of the Q8_0 linear in this build (for the tests' reference) */
const int q8_0_code_max = Q8_0_CODE_MAX;
AVX512_END
