/* One decode step of a dense decoder on the CPU, in a single call (miles.kernels.cpu_decode).
 *
 * Why: at the sizes an RL job runs on a CPU (a tiny policy, batch 1-64), a decode step
 * through torch ops is bound by per-op dispatch (~35 ops a layer, a few microseconds each),
 * not by arithmetic. Here the whole step runs in one call: the GEMMs go to the BLAS that
 * torch itself links (its `sgemm_`, handed in as a function pointer, so the maths and the
 * threads are torch's, small GEMMs on one thread), and everything between them (RMSNorm, q/k-norm, RoPE, the KV-cache
 * write, attention over each row's own length, SiLU-gating, residuals) is a plain loop.
 *
 * Numerics follow the torch path (miles.models.fused, miles.engines.kv_cache): float32
 * throughout, RMSNorm as w * (x * rsqrt(mean(x^2) + eps)), RoPE as x * cos + roll(x, D/2) *
 * signed_sin, softmax with the row maximum subtracted. Sums run in a different order than
 * torch's kernels, and exp is a Cephes-style polynomial (<= 2 ulp), so results agree with the
 * torch path to float32 round-off, not bitwise (the engine's --deterministic mode keeps the
 * torch path). NaN propagates: a non-finite weight or activation shows up in the logits.
 *
 * Layouts (row-major): hidden [n, E]; weights as nn.Linear stores them, [out, in]; the
 * fused q/k/v weight [(H + 2 KV) D, E] and gate/up weight [2 I, E]; KV cache
 * [layers, slots, KV, cache_len, D], row b in slot b; rope tables [rope_len, D].
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

typedef void (*sgemm_fn)(const char *transa, const char *transb, const int *m, const int *n, const int *k,
                         const float *alpha, const float *a, const int *lda, const float *b, const int *ldb,
                         const float *beta, float *c, const int *ldc);
/* MKL's MKL_Set_Num_Threads_Local: the calling thread's BLAS thread count (0: the global one);
 * returns the previous value. NULL where torch's BLAS has none. */
typedef int (*set_threads_fn)(int nthreads);

/* The BLAS calls: GEMMs below `one_thread_below` multiply-adds run on one BLAS thread
 * (miles.utils.blas.ONE_THREAD_GEMM says why). */
typedef struct {
    sgemm_fn sgemm;
    set_threads_fn set_threads;
    int64_t one_thread_below;
} blas;

/* dims[] */
enum { D_LAYERS, D_EMBED, D_HEADS, D_KV_HEADS, D_HEAD_DIM, D_INTER, D_VOCAB, D_SLOTS, D_CACHE_LEN, D_ROPE_LEN,
       D_COUNT };
/* ptrs[]: the model-wide pointers, then P_PER_LAYER per layer */
enum { G_EMBED, G_FINAL_NORM, G_LM_HEAD, G_K_CACHE, G_V_CACHE, G_COS, G_SIN, G_COUNT };
enum { P_IN_NORM, P_QKV_W, P_QKV_B, P_Q_NORM, P_K_NORM, P_O_W, P_O_B, P_POST_NORM, P_GATE_UP_W, P_DOWN_W,
       P_PER_LAYER };

/* exp(x) for x in float range: 2^n * p(r), r = x - n ln2 (Cephes expf). Clamped so 2^n stays a
 * normal float; written without branches so the loops that call it vectorize. */
static inline float exp_approx(float x) {
    x = x < -87.0f ? -87.0f : x; /* NaN compares false: it stays NaN */
    x = x > 88.0f ? 88.0f : x;
    /* round to nearest by adding and removing 1.5 * 2^23 (|x log2 e| < 2^22; no libm call) */
    float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { int32_t i; float f; } scale;
    scale.i = ((int32_t)n + 127) << 23;
    return p * scale.f;
}

static void rms_norm(const float *x, const float *w, float *y, int64_t rows, int64_t d, float eps) {
    for (int64_t b = 0; b < rows; b++) {
        const float *xr = x + b * d;
        float *yr = y + b * d;
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < d; i++) ss += xr[i] * xr[i];
        float r = 1.0f / sqrtf(ss / (float)d + eps);
#pragma omp simd
        for (int64_t i = 0; i < d; i++) yr[i] = w[i] * (xr[i] * r);
    }
}

/* y[n, out] = beta * y + x[n, in] @ w[out, in]^T (+ bias): column-major y^T = w^T(T) . x^T. */
static void linear(const blas *gemm, const float *x, int64_t n, int64_t in, const float *w, int64_t out,
                   const float *bias, float *y, float beta) {
    if (n == 0) return;
    int m_ = (int)out, n_ = (int)n, k_ = (int)in;
    float one = 1.0f;
    const int alone = gemm->set_threads != NULL && n * in * out < gemm->one_thread_below;
    const int before = alone ? gemm->set_threads(1) : 0;
    gemm->sgemm("T", "N", &m_, &n_, &k_, &one, w, &k_, x, &k_, &beta, y, &m_);
    if (alone) gemm->set_threads(before);
    if (bias != NULL) {
        for (int64_t b = 0; b < n; b++) {
            float *yr = y + b * out;
#pragma omp simd
            for (int64_t i = 0; i < out; i++) yr[i] += bias[i];
        }
    }
}

/* x[h, D] for heads h: x * cos + roll(x, D/2) * signed_sin, in place. */
static void rope(float *x, int64_t heads, int64_t D, const float *cos, const float *sin, float *tmp) {
    int64_t half = D / 2;
    for (int64_t h = 0; h < heads; h++) {
        float *xh = x + h * D;
        memcpy(tmp, xh, (size_t)D * sizeof(float));
#pragma omp simd
        for (int64_t d = 0; d < half; d++) xh[d] = tmp[d] * cos[d] + tmp[d + half] * sin[d];
#pragma omp simd
        for (int64_t d = half; d < D; d++) xh[d] = tmp[d] * cos[d] + tmp[d - half] * sin[d];
    }
}

#if defined(__AVX512F__)
/* Lane j of the result: the sum of the 16 lanes of v[j]. A per-position horizontal sum costs
 * ~9 instructions against two for the position's whole dot product (head_dim 32); summing 16
 * positions together by a transpose-add tree costs ~3 a position. */
static inline __m512 sum_lanes_16(const __m512 *v) {
    __m512 t[8], u[4], w[2];
    for (int i = 0; i < 8; i++) /* per 128-bit lane: a0+a2, b0+b2, a1+a3, b1+b3 */
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) /* per 128-bit lane: the lane's sums of a, b, c, d */
        u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int i = 0; i < 2; i++) /* pairs of 128-bit lanes summed */
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/* s[j] = scale * q . k[j] for j < len, 16 positions at a time (D a multiple of 16). */
static inline __attribute__((always_inline)) int64_t scores_avx512(const float *q, const float *kc, int64_t len,
                                                                   const int64_t D, float scale, float *s) {
    const __m512 sc = _mm512_set1_ps(scale);
    int64_t j = 0;
    for (; j + 16 <= len; j += 16) {
        __m512 v[16];
        for (int jj = 0; jj < 16; jj++) {
            const float *k = kc + (j + jj) * D;
            __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(q), _mm512_loadu_ps(k));
            for (int64_t d = 16; d < D; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), _mm512_loadu_ps(k + d), acc);
            v[jj] = acc;
        }
        _mm512_storeu_ps(s + j, _mm512_mul_ps(sum_lanes_16(v), sc));
    }
    return j; /* the caller does the rest */
}

/* o = inv * sum_j s[j] v[j] (D a multiple of 16): four independent accumulators per 16
 * outputs, where one would wait on each FMA's latency in turn. */
static inline __attribute__((always_inline)) void weighted_sum_avx512(const float *s, const float *vc, int64_t len,
                                                                      const int64_t D, float inv, float *o) {
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        const float *v = vc + d0;
        int64_t j = 0;
        for (; j + 4 <= len; j += 4) {
            a0 = _mm512_fmadd_ps(_mm512_set1_ps(s[j]), _mm512_loadu_ps(v + j * D), a0);
            a1 = _mm512_fmadd_ps(_mm512_set1_ps(s[j + 1]), _mm512_loadu_ps(v + (j + 1) * D), a1);
            a2 = _mm512_fmadd_ps(_mm512_set1_ps(s[j + 2]), _mm512_loadu_ps(v + (j + 2) * D), a2);
            a3 = _mm512_fmadd_ps(_mm512_set1_ps(s[j + 3]), _mm512_loadu_ps(v + (j + 3) * D), a3);
        }
        for (; j < len; j++) a0 = _mm512_fmadd_ps(_mm512_set1_ps(s[j]), _mm512_loadu_ps(v + j * D), a0);
        __m512 sum = _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3));
        _mm512_storeu_ps(o + d0, _mm512_mul_ps(sum, _mm512_set1_ps(inv)));
    }
}
#endif

/* One query row's attention for the G heads sharing a KV head, over cache positions [0, len).
 * Inlined into a copy per common head size (attend below), so that each position's dot
 * product and weighted add are a few unrolled vector instructions with the accumulators in
 * registers; the generic copy serves other sizes. */
static inline __attribute__((always_inline)) void attend_d(const float *q, const float *kc, const float *vc,
                                                           int64_t len, int64_t G, const int64_t D, float scale,
                                                           float *scores, float *out) {
    for (int64_t i = 0; i < G; i++) {
        const float *qi = q + i * D;
        float *s = scores + i * len;
        int64_t j0 = 0;
#if defined(__AVX512F__)
        if (D % 16 == 0) j0 = scores_avx512(qi, kc, len, D, scale, s);
#endif
        for (int64_t j = j0; j < len; j++) {
            const float *kj = kc + j * D;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < D; d++) dot += qi[d] * kj[d];
            s[j] = dot * scale;
        }
        float top = s[0];
#pragma omp simd reduction(max : top)
        for (int64_t j = 1; j < len; j++) top = s[j] > top ? s[j] : top;
        float total = 0.0f;
#pragma omp simd reduction(+ : total)
        for (int64_t j = 0; j < len; j++) {
            s[j] = exp_approx(s[j] - top);
            total += s[j];
        }
        float inv = 1.0f / total;
        float *o = out + i * D;
#if defined(__AVX512F__)
        if (D % 16 == 0) {
            weighted_sum_avx512(s, vc, len, D, inv, o);
            continue;
        }
#endif
        for (int64_t d0 = 0; d0 < D; d0 += 16) { /* 16 outputs at a time, summed over positions */
            const int64_t w = D - d0 < 16 ? D - d0 : 16;
            float acc[16] = {0};
            for (int64_t j = 0; j < len; j++) {
                const float *vj = vc + j * D + d0;
                const float p = s[j];
#pragma omp simd
                for (int64_t d = 0; d < w; d++) acc[d] += p * vj[d];
            }
            for (int64_t d = 0; d < w; d++) o[d0 + d] = acc[d] * inv;
        }
    }
}

static void attend(const float *q, const float *kc, const float *vc, int64_t len, int64_t G, int64_t D,
                   float scale, float *scores, float *out) {
    switch (D) {
    case 32: attend_d(q, kc, vc, len, G, 32, scale, scores, out); break;
    case 64: attend_d(q, kc, vc, len, G, 64, scale, scores, out); break;
    case 128: attend_d(q, kc, vc, len, G, 128, scale, scores, out); break;
    default: attend_d(q, kc, vc, len, G, D, scale, scores, out);
    }
}

/* A layer's per-row work between the q/k/v and the o projections (q/k-norm, RoPE, the cache
 * write, attention over the row's own length) for rows [b0, b1), with its own scratch. Rows are
 * independent, so threads may split them: each row's result is the same whoever computes it. */
typedef struct {
    int64_t l, b0, b1, H, KV, D, S, T, QKV;
    const int64_t *positions;
    void *const *p;
    const float *cos_t, *sin_t;
    float *k_cache, *v_cache, *qkv, *attn, *scores, *tmp;
    float eps, scale;
} rows_job;

static void attend_rows(const rows_job *j) {
    const int64_t H = j->H, KV = j->KV, D = j->D, G = H / KV, S = j->S, T = j->T;
    for (int64_t b = j->b0; b < j->b1; b++) {
        float *q = j->qkv + b * j->QKV, *k = q + H * D, *v = k + KV * D;
        if (j->p[P_Q_NORM] != NULL) {
            rms_norm(q, j->p[P_Q_NORM], q, H, D, j->eps);
            rms_norm(k, j->p[P_K_NORM], k, KV, D, j->eps);
        }
        const int64_t pos = j->positions[b];
        rope(q, H, D, j->cos_t + pos * D, j->sin_t + pos * D, j->tmp);
        rope(k, KV, D, j->cos_t + pos * D, j->sin_t + pos * D, j->tmp);
        for (int64_t g = 0; g < KV; g++) {
            int64_t base = ((j->l * S + b) * KV + g) * T * D;
            memcpy(j->k_cache + base + pos * D, k + g * D, (size_t)D * sizeof(float));
            memcpy(j->v_cache + base + pos * D, v + g * D, (size_t)D * sizeof(float));
            attend(q + g * G * D, j->k_cache + base, j->v_cache + base, pos + 1, G, D, j->scale, j->scores,
                   j->attn + b * H * D + g * G * D);
        }
    }
}

static void *attend_rows_thread(void *job) {
    attend_rows(job);
    return NULL;
}

/* Below this many multiply-adds of attention a layer (Σ positions × heads × head dim, each
 * for the scores and again for the weighted sum), one thread attends: starting and joining a
 * thread costs tens of microseconds a layer (on 2 cores the split lost up to 2x at 2^20 and
 * paid 1.3-1.7x from 2^22). Above it the rows are split between up to `threads` threads
 * (torch's count: the GEMMs between layers use the same cores), balanced by positions. */
#define PARALLEL_WORK (1 << 22)
#define MAX_THREADS 16

/* Workspace floats for n rows and up to `threads` attending threads (the caller allocates it
 * once for its largest batch). */
int64_t miles_decode_workspace(const int64_t *dims, int64_t n, int64_t threads) {
    int64_t E = dims[D_EMBED], H = dims[D_HEADS], KV = dims[D_KV_HEADS], D = dims[D_HEAD_DIM];
    int64_t I = dims[D_INTER], G = H / KV;
    threads = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads;
    return n * (2 * E + (H + 2 * KV) * D + H * D + 3 * I) + threads * (G * dims[D_CACHE_LEN] + D);
}

/* Returns 0; 1 when a token id is outside the vocabulary; 2 when a position is outside the
 * cache or the rope tables (nothing is written to the cache then). */
int miles_decode(const int64_t *dims, void *const *ptrs, float eps, sgemm_fn sgemm,
                 set_threads_fn set_threads, int64_t one_thread_below, int64_t n,
                 const int64_t *tokens, const int64_t *positions, float *hidden_out, float *logits, float *ws,
                 int64_t threads) {
    const int64_t L = dims[D_LAYERS], E = dims[D_EMBED], H = dims[D_HEADS], KV = dims[D_KV_HEADS];
    const int64_t D = dims[D_HEAD_DIM], I = dims[D_INTER], V = dims[D_VOCAB], S = dims[D_SLOTS];
    const int64_t T = dims[D_CACHE_LEN], G = H / KV, QKV = (H + 2 * KV) * D;
    const int64_t limit = T < dims[D_ROPE_LEN] ? T : dims[D_ROPE_LEN];
    for (int64_t b = 0; b < n; b++) {
        if (tokens[b] < 0 || tokens[b] >= V) return 1;
        if (positions[b] < 0 || positions[b] >= limit) return 2;
    }
    if (n > S) return 2;
    const float *embed = ptrs[G_EMBED], *cos_t = ptrs[G_COS], *sin_t = ptrs[G_SIN];
    float *k_cache = ptrs[G_K_CACHE], *v_cache = ptrs[G_V_CACHE];
    float *h = ws, *x = h + n * E, *qkv = x + n * E, *attn = qkv + n * QKV, *gu = attn + n * H * D;
    float *act = gu + n * 2 * I, *scratch = act + n * I; /* per thread: scores [G T], tmp [D] */
    const float scale = 1.0f / sqrtf((float)D);
    const blas gemm = {sgemm, set_threads, one_thread_below};
    threads = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads;
    threads = threads > n ? n : threads;
    int64_t total = 0; /* Σ (positions + 1): the attention's length over the rows */
    for (int64_t b = 0; b < n; b++) total += positions[b] + 1;
    if (threads > 1 && 2 * total * H * D < PARALLEL_WORK) threads = 1;
    int64_t bounds[MAX_THREADS + 1]; /* thread t attends rows [bounds[t], bounds[t + 1]) */
    bounds[0] = 0;
    for (int64_t t = 1, b = 0, seen = 0; t <= threads; t++) {
        while (b < n && (t == threads || seen * threads < total * t)) seen += positions[b++] + 1;
        bounds[t] = b;
    }

    for (int64_t b = 0; b < n; b++) memcpy(h + b * E, embed + tokens[b] * E, (size_t)E * sizeof(float));
    for (int64_t l = 0; l < L; l++) {
        void *const *p = ptrs + G_COUNT + l * P_PER_LAYER;
        rms_norm(h, p[P_IN_NORM], x, n, E, eps);
        linear(&gemm, x, n, E, p[P_QKV_W], QKV, p[P_QKV_B], qkv, 0.0f);
        rows_job jobs[MAX_THREADS];
        pthread_t ids[MAX_THREADS];
        int started[MAX_THREADS] = {0};
        for (int64_t t = 0; t < threads; t++) {
            float *mine = scratch + t * (G * T + D);
            jobs[t] = (rows_job){l, bounds[t], bounds[t + 1], H, KV, D, S, T, QKV, positions, p, cos_t, sin_t,
                                 k_cache, v_cache, qkv, attn, mine, mine + G * T, eps, scale};
        }
        for (int64_t t = 1; t < threads; t++) /* a thread that cannot start runs inline below */
            started[t] = pthread_create(&ids[t], NULL, attend_rows_thread, &jobs[t]) == 0;
        attend_rows(&jobs[0]);
        for (int64_t t = 1; t < threads; t++) {
            if (started[t])
                pthread_join(ids[t], NULL);
            else
                attend_rows(&jobs[t]);
        }
        linear(&gemm, attn, n, H * D, p[P_O_W], E, p[P_O_B], h, 1.0f); /* h += o_proj(attn) */
        rms_norm(h, p[P_POST_NORM], x, n, E, eps);
        linear(&gemm, x, n, E, p[P_GATE_UP_W], 2 * I, NULL, gu, 0.0f);
        for (int64_t b = 0; b < n; b++) {
            const float *gate = gu + b * 2 * I, *up = gate + I;
            float *a = act + b * I;
#pragma omp simd
            for (int64_t i = 0; i < I; i++) a[i] = gate[i] / (1.0f + exp_approx(-gate[i])) * up[i];
        }
        linear(&gemm, act, n, I, p[P_DOWN_W], E, NULL, h, 1.0f); /* h += down_proj(act) */
    }
    rms_norm(h, ptrs[G_FINAL_NORM], hidden_out, n, E, eps);
    linear(&gemm, hidden_out, n, E, ptrs[G_LM_HEAD], V, NULL, logits, 0.0f);
    return 0;
}

/* miles.engines.sampling.counter_uniform for n keys: out[b, v] = (k + 0.5) * scale where k is
 * the top bits (>> shift) of splitmix64's finaliser on keys[b] + v * golden, all in wrapping
 * 64-bit arithmetic and float32: bitwise the torch ops' result, in one pass instead of their
 * ~15 passes over [n, V] int64 tensors. The constants come from miles.kernels.constants. */
void miles_hashed_uniform(int64_t n, int64_t V, const int64_t *keys, uint64_t golden, uint64_t mix1,
                          uint64_t mix2, int64_t shift, float scale, float *out) {
    for (int64_t b = 0; b < n; b++) {
        const uint64_t key = (uint64_t)keys[b];
        float *u = out + b * V;
        for (int64_t v = 0; v < V; v++) {
            uint64_t z = key + (uint64_t)v * golden;
            z = (z ^ (z >> 30)) * mix1;
            z = (z ^ (z >> 27)) * mix2;
            z ^= z >> 31;
            u[v] = ((float)(z >> shift) + 0.5f) * scale;
        }
    }
}

/* Sample one token per row from logits [n, V] the way miles.engines.sampling does without
 * top-k / top-p, so that the tokens are the same: a row with temperature <= 0 (greedy) takes
 * the argmax; the k-th sampled row takes argmax(logits / t - noise[k]) (Gumbel-max, noise =
 * log(-log(u)) computed by torch from the row's uniforms). Writes tokens, and rows of
 * `host` [3, n] (float64): token, log-prob under the distribution sampled from, finite. */
void miles_sample(int64_t n, int64_t V, const float *logits, const float *temperature, const float *noise,
                  int64_t *tokens, double *host) {
    int64_t k = 0;
    for (int64_t b = 0; b < n; b++) {
        const float *x = logits + b * V;
        const float t = temperature[b];
        const int greedy = !(t > 0.0f);
        const float *g = greedy ? NULL : noise + (k++) * V;
        int finite = 1;
        float top = -INFINITY;
        for (int64_t i = 0; i < V; i++) {
            float s = greedy ? x[i] : x[i] / t;
            finite &= isfinite(x[i]) != 0;
            top = s > top ? s : top;
        }
        int64_t best = 0;
        float best_v = -INFINITY;
        for (int64_t i = 0; i < V; i++) { /* first maximum, as torch's argmax */
            float s = greedy ? x[i] : x[i] / t - g[i];
            if (s > best_v) {
                best_v = s;
                best = i;
            }
        }
        float total = 0.0f;
        if (greedy) {
#pragma omp simd reduction(+ : total)
            for (int64_t i = 0; i < V; i++) total += exp_approx(x[i] - top);
        } else {
#pragma omp simd reduction(+ : total)
            for (int64_t i = 0; i < V; i++) total += exp_approx(x[i] / t - top);
        }
        const float chosen = greedy ? x[best] : x[best] / t;
        tokens[b] = best;
        host[b] = (double)best;
        host[n + b] = finite ? (double)(chosen - top - logf(total)) : NAN;
        host[2 * n + b] = finite ? 1.0 : 0.0;
    }
}
