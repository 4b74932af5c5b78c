/* The small per-layer ops of a CPU forward in fp32, each one call instead of a handful of torch
 * ops: at one decoding sequence a layer's norms, rotary embedding and cache write were ~25 torch
 * dispatches, more time than their arithmetic (see gpu_worker/ops/cpu.py).
 *
 * Built by gpu_worker/ops/cpu/build.py with the system C compiler, called through ctypes.
 * Single-threaded but for silu_and_mul: a step's tensors here are at most a few MB. Every row is
 * computed by the same loop whatever T is, so a token's result does not depend on what it is
 * batched with.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* out[t] = rms_norm(x[t] (+ residual[t])) * weight; with `residual`, also residual_out[t] = the sum.
 * x, residual, residual_out: [T, H] with row strides; out [T, H] contiguous. */
void rms_norm_f32(const float *__restrict__ x, long x_stride, const float *__restrict__ residual, long residual_stride,
                  const float *__restrict__ weight, float *__restrict__ out, float *__restrict__ residual_out,
                  int T, int H, float eps) {
    for (int t = 0; t < T; t++) {
        const float *xt = x + (long)t * x_stride;
        float *ot = out + (long)t * H;
        const float *src = xt;
        if (residual) {
            const float *rt = residual + (long)t * residual_stride;
            float *st = residual_out + (long)t * H;
            for (int i = 0; i < H; i++) st[i] = xt[i] + rt[i];
            src = st;
        }
        float sq = 0.f;
#pragma omp simd reduction(+ : sq)
        for (int i = 0; i < H; i++) sq += src[i] * src[i];
        const float inv = 1.f / sqrtf(sq / (float)H + eps);
        for (int i = 0; i < H; i++) ot[i] = src[i] * inv * weight[i];
    }
}

/* one head's rotary embedding: pairs (2i, 2i+1) when interleaved (GGUF / Meta), else (i, i + D/2) */
static inline void rotate(const float *__restrict__ x, const float *__restrict__ cs, float *__restrict__ out,
                          int D, int interleaved) {
    const int half = D / 2;
    const float *cos = cs, *sin = cs + half;
    for (int i = 0; i < half; i++) {
        const int a = interleaved ? 2 * i : i, b = interleaved ? 2 * i + 1 : i + half;
        const float x1 = x[a], x2 = x[b];
        out[a] = x1 * cos[i] - x2 * sin[i];
        out[b] = x2 * cos[i] + x1 * sin[i];
    }
}

/* q [T, Hq, D] and k [T, Hk, D] (row strides q_stride, k_stride; heads contiguous) rotated by
 * cos_sin[positions[t]] ([max_pos, D]: cos | sin) into q_out [T, Hq, D], k_out [T, Hk, D] */
void rotary_f32(const float *__restrict__ q, long q_stride, const float *__restrict__ k, long k_stride,
                const int64_t *__restrict__ positions, const float *__restrict__ cos_sin, float *__restrict__ q_out,
                float *__restrict__ k_out, int T, int Hq, int Hk, int D, int interleaved) {
    for (int t = 0; t < T; t++) {
        const float *cs = cos_sin + positions[t] * D;
        for (int h = 0; h < Hq; h++)
            rotate(q + t * q_stride + (long)h * D, cs, q_out + ((long)t * Hq + h) * D, D, interleaved);
        for (int h = 0; h < Hk; h++)
            rotate(k + t * k_stride + (long)h * D, cs, k_out + ((long)t * Hk + h) * D, D, interleaved);
    }
}

/* k, v rows [T, row] (row strides) into the flat caches [slots, row] at slots[t]; slot -1 is skipped */
void write_kv_f32(const float *__restrict__ k, long k_stride, const float *__restrict__ v, long v_stride,
                  const int64_t *__restrict__ slots, float *__restrict__ k_cache, float *__restrict__ v_cache, int T,
                  int row) {
    for (int t = 0; t < T; t++) {
        if (slots[t] < 0) continue;
        memcpy(k_cache + slots[t] * row, k + t * k_stride, sizeof(float) * row);
        memcpy(v_cache + slots[t] * row, v + t * v_stride, sizeof(float) * row);
    }
}

/* out[t, i] = silu(x[t, i]) * x[t, I + i] for x [T, 2I] (gate | up) -> out [T, I]; silu(g) = g / (1 + e^-g).
 * The one threaded op here: a prefill chunk's MLP has T * I exponentials (a row per thread; the bits
 * do not depend on which). */
void silu_and_mul_f32(const float *__restrict__ x, int T, int I, float *__restrict__ out, int num_threads) {
#pragma omp parallel for schedule(dynamic, 4) num_threads(num_threads) if (T > 1)
    for (int t = 0; t < T; t++) {
        const float *gate = x + (long)t * 2 * I, *up = gate + I;
        float *o = out + (long)t * I;
        for (int i = 0; i < I; i++) o[i] = gate[i] / (1.f + expf(-gate[i])) * up[i];
    }
}
