/* Rows of uniform [0, 1) floats, each the very stream torch.rand(n, generator=g) gives on the CPU
 * after g.manual_seed(seed): MT19937 seeded with the seed's low 32 bits (the reference
 * init_genrand, as ATen's at::mt19937 does), each float the low 24 bits of one 32-bit output
 * times 2^-24 (ATen's uniform_real_distribution<float>).
 *
 * Built by gpu_worker/ops/cpu/build.py, called through ctypes by uniform.py. torch draws
 * one float per call of its serial kernel; the sampler's noise is a row of
 * vocab size per sampled sequence and step, 49k floats for SmolLM2. Here the state is twisted
 * 624 words at a time in loops the compiler vectorizes, and rows run on several threads.
 */
#include <stdint.h>

#define MT_N 624
#define MT_M 397
#define MT_MATRIX_A 0x9908b0dfu
#define MT_UPPER 0x80000000u
#define MT_LOWER 0x7fffffffu

static inline uint32_t twist(uint32_t upper_of, uint32_t lower_of, uint32_t far) {
    const uint32_t y = (upper_of & MT_UPPER) | (lower_of & MT_LOWER);
    return far ^ (y >> 1) ^ ((y & 1u) ? MT_MATRIX_A : 0u);
}

/* The next MT_N words of the state, in place (three loops: the word MT_M ahead is old, then new). */
static void next_state(uint32_t *__restrict__ mt) {
    int i = 0;
    for (; i < MT_N - MT_M; i++) mt[i] = twist(mt[i], mt[i + 1], mt[i + MT_M]);
    for (; i < MT_N - 1; i++) mt[i] = twist(mt[i], mt[i + 1], mt[i + MT_M - MT_N]);
    mt[MT_N - 1] = twist(mt[MT_N - 1], mt[0], mt[MT_M - 1]);
}

static inline float tempered_uniform(uint32_t y) {
    y ^= y >> 11;
    y ^= (y << 7) & 0x9d2c5680u;
    y ^= (y << 15) & 0xefc60000u;
    y ^= y >> 18;
    return (float)(y & 0xffffffu) * (1.0f / 16777216.0f);
}

static void uniform_row(uint64_t seed, long n, float *__restrict__ out) {
    uint32_t mt[MT_N];
    mt[0] = (uint32_t)seed;
    for (int i = 1; i < MT_N; i++) mt[i] = 1812433253u * (mt[i - 1] ^ (mt[i - 1] >> 30)) + (uint32_t)i;
    for (long start = 0; start < n; start += MT_N) {
        next_state(mt);
        const int count = n - start < MT_N ? (int)(n - start) : MT_N;
        for (int i = 0; i < count; i++) out[start + i] = tempered_uniform(mt[i]);
    }
}

/* seeds [rows] -> out [rows, n] */
void uniform_rows_f32(const uint64_t *__restrict__ seeds, int rows, long n, float *__restrict__ out,
                      int num_threads) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int r = 0; r < rows; r++) uniform_row(seeds[r], n, out + (long)r * n);
}
