/* y = x @ w.T for a few rows of x: the fp32 products of decoding on a CPU.
 *
 * x [M, K], w [N, K] (nn.Linear's layout), y [M, N], all fp32 and packed; K a multiple of 8.
 * Built by dgemma/models/smallm.py with -O3 -mavx2 -mfma -fopenmp (no -ffast-math).
 *
 * Every output y[m, n] is the same sum whatever M, the blocking or the thread count: eight
 * fused multiply-add lanes over k = 0, 8, 16, ..., then the lanes added in one fixed order. So a
 * row's result never depends on which other rows share the call (batch-invariant, bit for bit).
 *
 * Rows of w are streamed from memory once per call (a block of 4 of them, prefetched one block
 * ahead) against up to 3 rows of x held in registers: 12 accumulators, 3 x loads and 4 w loads
 * per 12 FMAs. One row of x takes blocks of 8 rows of w instead (8 independent accumulators).
 */
#include <immintrin.h>

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* y[m + j, n + i] for i < NB, j < MB */
#define KERNEL(NB, MB)                                                                          \
static inline void k_##NB##_##MB(const float *x, const float *w, float *y, long K, long N,     \
                                 long n, long m) {                                             \
    __m256 acc[NB][MB];                                                                        \
    for (int i = 0; i < NB; i++)                                                               \
        for (int j = 0; j < MB; j++) acc[i][j] = _mm256_setzero_ps();                          \
    for (long k = 0; k < K; k += 8) {                                                          \
        __m256 xv[MB];                                                                         \
        for (int j = 0; j < MB; j++) xv[j] = _mm256_loadu_ps(x + (m + j) * K + k);             \
        for (int i = 0; i < NB; i++) {                                                         \
            if ((k & 15) == 0) /* this line of the next block's row (never faults) */          \
                _mm_prefetch((const char *)(w + (n + i + NB) * K + k), _MM_HINT_T0);           \
            __m256 wv = _mm256_loadu_ps(w + (n + i) * K + k);                                  \
            for (int j = 0; j < MB; j++) acc[i][j] = _mm256_fmadd_ps(wv, xv[j], acc[i][j]);    \
        }                                                                                      \
    }                                                                                          \
    for (int i = 0; i < NB; i++)                                                               \
        for (int j = 0; j < MB; j++) y[(m + j) * N + n + i] = hsum(acc[i][j]);                 \
}
KERNEL(8, 1)
KERNEL(4, 1)
KERNEL(4, 2)
KERNEL(4, 3)
KERNEL(1, 1)

/* Rows n .. n + 3 of w against every row of x. */
static void block4(const float *x, const float *w, float *y, long M, long K, long N, long n) {
    long m = 0;
    for (; m + 3 <= M; m += 3) k_4_3(x, w, y, K, N, n, m);
    if (M - m == 2) k_4_2(x, w, y, K, N, n, m);
    if (M - m == 1) k_4_1(x, w, y, K, N, n, m);
}

void smallm_linear(const float *x, const float *w, float *y, long M, long N, long K, int threads) {
    long nb = M == 1 ? 8 : 4, blocks = N / nb;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long b = 0; b < blocks; b++) {
        if (M == 1)
            k_8_1(x, w, y, K, N, b * 8, 0);
        else
            block4(x, w, y, M, K, N, b * 4);
    }
    for (long n = blocks * nb; n < N; n++) /* the last N % nb rows of w */
        for (long m = 0; m < M; m++) k_1_1(x, w, y, K, N, n, m);
}
