/* The products of decoding on a CPU, for a few rows: in fp32, y = x @ w.T (smallm_linear: the
 * projections and the LM head) and y = p @ e (smallm_probs_embed: the signal); at the end, both
 * in bf16 for CPUs with AVX512-BF16 (smallm_linear_bf16, smallm_probs_embed_bf16).
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

/* The schedule both dtypes share (bf16 below): blocks of 8 rows of w for one row of x, else blocks
 * of 4 against every row of x, split statically over the threads; then the last N % nb rows of w. */
#define LINEAR(NAME, T, ONE_ROW, BLOCK4, TAIL)                                                  \
void NAME(const T *x, const T *w, T *y, long M, long N, long K, int threads) {                \
    long nb = M == 1 ? 8 : 4, blocks = N / nb;                                                 \
    _Pragma("omp parallel for schedule(static) num_threads(threads)")                          \
    for (long b = 0; b < blocks; b++) {                                                        \
        if (M == 1)                                                                            \
            ONE_ROW(x, w, y, K, N, b * 8, 0);                                                  \
        else                                                                                   \
            BLOCK4(x, w, y, M, K, N, b * 4);                                                   \
    }                                                                                          \
    for (long n = blocks * nb; n < N; n++)                                                     \
        for (long m = 0; m < M; m++) TAIL(x, w, y, K, N, n, m);                                \
}
LINEAR(smallm_linear, float, k_8_1, block4, k_1_1)

/* y = p @ e for a few rows of p: the self-conditioning signal, probabilities [M, V] times the
 * embedding e [V, D] (D a multiple of 8). The vocabulary is cut into fixed chunks of CHUNK rows;
 * each chunk's sums (one thread each, rows of e in order) go to part [chunks, M, D], and the chunks
 * are then added in order. So every output is the same sum whatever the thread count or the other
 * rows of p. Within a chunk, SUB rows of e at a time (160 KB for D = 640, kept in L2) are read
 * against up to 3 rows of p x 32 columns held in registers. */
#define CHUNK 4096
#define SUB 64

#define PKERNEL(MB, JB)                                                                         \
static inline void p_##MB##_##JB(const float *p, const float *e, float *acc, long V, long D,   \
                                 long m, long j, long lo, long hi) {                           \
    __m256 a[MB][JB];                                                                          \
    for (int i = 0; i < MB; i++)                                                               \
        for (int q = 0; q < JB; q++) a[i][q] = _mm256_loadu_ps(acc + (m + i) * D + j + 8 * q); \
    for (long v = lo; v < hi; v++) {                                                           \
        __m256 ev[JB];                                                                         \
        for (int q = 0; q < JB; q++) ev[q] = _mm256_loadu_ps(e + v * D + j + 8 * q);           \
        for (int i = 0; i < MB; i++) {                                                         \
            __m256 b = _mm256_set1_ps(p[(m + i) * V + v]);                                     \
            for (int q = 0; q < JB; q++) a[i][q] = _mm256_fmadd_ps(b, ev[q], a[i][q]);         \
        }                                                                                      \
    }                                                                                          \
    for (int i = 0; i < MB; i++)                                                               \
        for (int q = 0; q < JB; q++) _mm256_storeu_ps(acc + (m + i) * D + j + 8 * q, a[i][q]); \
}
PKERNEL(3, 4)
PKERNEL(2, 4)
PKERNEL(1, 4)
PKERNEL(3, 1)
PKERNEL(2, 1)
PKERNEL(1, 1)

static void probs_chunk(const float *p, const float *e, float *acc, long M, long V, long D, long lo, long hi) {
    for (long i = 0; i < M * D; i++) acc[i] = 0.0f;
    for (long s = lo; s < hi; s += SUB) {
        long t = s + SUB < hi ? s + SUB : hi;
        long j = 0;
        for (; j + 32 <= D; j += 32) {
            long m = 0;
            for (; m + 3 <= M; m += 3) p_3_4(p, e, acc, V, D, m, j, s, t);
            if (M - m == 2) p_2_4(p, e, acc, V, D, m, j, s, t);
            if (M - m == 1) p_1_4(p, e, acc, V, D, m, j, s, t);
        }
        for (; j < D; j += 8) {
            long m = 0;
            for (; m + 3 <= M; m += 3) p_3_1(p, e, acc, V, D, m, j, s, t);
            if (M - m == 2) p_2_1(p, e, acc, V, D, m, j, s, t);
            if (M - m == 1) p_1_1(p, e, acc, V, D, m, j, s, t);
        }
    }
}

long smallm_probs_chunks(long V) { return (V + CHUNK - 1) / CHUNK; }

void smallm_probs_embed(const float *p, const float *e, float *y, float *part, long M, long V, long D, int threads) {
    long chunks = smallm_probs_chunks(V);
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (long c = 0; c < chunks; c++)
            probs_chunk(p, e, part + c * M * D, M, V, D, c * CHUNK, c * CHUNK + CHUNK < V ? c * CHUNK + CHUNK : V);
#pragma omp for schedule(static)
        for (long i = 0; i < M * D; i += 8) {
            __m256 s = _mm256_loadu_ps(part + i);
            for (long c = 1; c < chunks; c++) s = _mm256_add_ps(s, _mm256_loadu_ps(part + c * M * D + i));
            _mm256_storeu_ps(y + i, s);
        }
    }
}

/* ---- bf16: y = x @ w.T with x [M, K], w [N, K], y [M, N] all bf16 (raw 16-bit words) and K a
 * multiple of 32, for CPUs with AVX512-BF16. Compiled for that target only here, and called only
 * where the CPU has it (smallm.py). Each vdpbf16ps adds, in each of 16 fp32 lanes, the products of
 * one adjacent pair of k; the lanes are summed at the end in one fixed order (as above, every output
 * is one sum whatever M or the thread count) and rounded to bf16 to nearest even, as PyTorch rounds. */
#if defined(__clang__) ? __clang_major__ >= 9 : __GNUC__ >= 10 /* the first to know AVX512-BF16 */
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512bf16")

static inline unsigned short bf16_of(float f) { /* round to nearest even, as PyTorch rounds */
    union { float f; unsigned int u; } v = {f};
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0; /* NaN */
    return (unsigned short)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

#define BKERNEL(NB, MB)                                                                         \
static inline void b_##NB##_##MB(const unsigned short *x, const unsigned short *w,             \
                                 unsigned short *y, long K, long N, long n, long m) {          \
    __m512 acc[NB][MB];                                                                        \
    for (int i = 0; i < NB; i++)                                                               \
        for (int j = 0; j < MB; j++) acc[i][j] = _mm512_setzero_ps();                          \
    for (long k = 0; k < K; k += 32) {                                                         \
        __m512bh xv[MB];                                                                       \
        for (int j = 0; j < MB; j++) xv[j] = (__m512bh)_mm512_loadu_si512(x + (m + j) * K + k); \
        for (int i = 0; i < NB; i++) {                                                         \
            _mm_prefetch((const char *)(w + (n + i + NB) * K + k), _MM_HINT_T0);               \
            __m512bh wv = (__m512bh)_mm512_loadu_si512(w + (n + i) * K + k);                   \
            for (int j = 0; j < MB; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wv, xv[j]);   \
        }                                                                                      \
    }                                                                                          \
    for (int i = 0; i < NB; i++)                                                               \
        for (int j = 0; j < MB; j++) y[(m + j) * N + n + i] = bf16_of(_mm512_reduce_add_ps(acc[i][j])); \
}
BKERNEL(8, 1)
BKERNEL(4, 1)
BKERNEL(4, 2)
BKERNEL(4, 3)
BKERNEL(4, 4)
BKERNEL(1, 1)

static void bblock4(const unsigned short *x, const unsigned short *w, unsigned short *y, long M, long K, long N,
                    long n) {
    long m = 0;
    for (; m + 4 <= M; m += 4) b_4_4(x, w, y, K, N, n, m);
    if (M - m == 3) b_4_3(x, w, y, K, N, n, m);
    if (M - m == 2) b_4_2(x, w, y, K, N, n, m);
    if (M - m == 1) b_4_1(x, w, y, K, N, n, m);
}

LINEAR(smallm_linear_bf16, unsigned short, b_8_1, bblock4, b_1_1)

/* y = p @ e in bf16 (the signal; D a multiple of 32): the scheme of smallm_probs_embed (fixed
 * chunks, summed apart, then in order), but a vdpbf16ps wants the two products it adds in one
 * 32-bit lane, so rows v and v + 1 of e are interleaved (unpacklo/hi of 16-bit words) against the
 * pair p[v], p[v + 1]. An unpack works within each 128-bit lane, so the 32 columns j .. j + 31 are
 * held, and kept in part, in the order of COL below; the final sum puts them back. Chunks and SUB
 * blocks are even, so the pairs are the same whatever the thread count; an odd V's last row pairs
 * with zero. */
#define COL(q) (((q) & 15) / 4 * 8 + ((q) >> 4) * 4 + ((q) & 3)) /* stored position q -> column */

static inline unsigned int pair_at(const unsigned short *p, long i, int both) {
    return p[i] | (both ? (unsigned int)p[i + 1] << 16 : 0u);
}

#define QKERNEL(MB)                                                                             \
static inline void q_##MB(const unsigned short *p, const unsigned short *e, float *acc, long V, \
                          long D, long m, long j, long lo, long hi) {                           \
    __m512 a[MB][2];                                                                           \
    for (int i = 0; i < MB; i++)                                                               \
        for (int h = 0; h < 2; h++) a[i][h] = _mm512_loadu_ps(acc + (m + i) * D + j + 16 * h); \
    for (long v = lo; v < hi; v += 2) {                                                        \
        int both = v + 1 < hi;                                                                 \
        __m512i r0 = _mm512_loadu_si512(e + v * D + j);                                        \
        __m512i r1 = both ? _mm512_loadu_si512(e + (v + 1) * D + j) : _mm512_setzero_si512();  \
        __m512bh ev[2] = {(__m512bh)_mm512_unpacklo_epi16(r0, r1), (__m512bh)_mm512_unpackhi_epi16(r0, r1)}; \
        for (int i = 0; i < MB; i++) {                                                         \
            __m512bh b = (__m512bh)_mm512_set1_epi32((int)pair_at(p, (m + i) * V + v, both));  \
            for (int h = 0; h < 2; h++) a[i][h] = _mm512_dpbf16_ps(a[i][h], ev[h], b);         \
        }                                                                                      \
    }                                                                                          \
    for (int i = 0; i < MB; i++)                                                               \
        for (int h = 0; h < 2; h++) _mm512_storeu_ps(acc + (m + i) * D + j + 16 * h, a[i][h]); \
}
QKERNEL(4)
QKERNEL(3)
QKERNEL(2)
QKERNEL(1)

static void qchunk(const unsigned short *p, const unsigned short *e, float *acc, long M, long V, long D, long lo,
                   long hi) {
    for (long i = 0; i < M * D; i++) acc[i] = 0.0f;
    for (long s = lo; s < hi; s += SUB) {
        long t = s + SUB < hi ? s + SUB : hi;
        for (long j = 0; j < D; j += 32) {
            long m = 0;
            for (; m + 4 <= M; m += 4) q_4(p, e, acc, V, D, m, j, s, t);
            if (M - m == 3) q_3(p, e, acc, V, D, m, j, s, t);
            if (M - m == 2) q_2(p, e, acc, V, D, m, j, s, t);
            if (M - m == 1) q_1(p, e, acc, V, D, m, j, s, t);
        }
    }
}

void smallm_probs_embed_bf16(const unsigned short *p, const unsigned short *e, unsigned short *y, float *part,
                             long M, long V, long D, int threads) {
    long chunks = smallm_probs_chunks(V);
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (long c = 0; c < chunks; c++)
            qchunk(p, e, part + c * M * D, M, V, D, c * CHUNK, c * CHUNK + CHUNK < V ? c * CHUNK + CHUNK : V);
#pragma omp for schedule(static)
        for (long i = 0; i < M * D; i++) {
            float s = part[i];
            for (long c = 1; c < chunks; c++) s += part[c * M * D + i];
            y[i - i % 32 + COL(i % 32)] = bf16_of(s);
        }
    }
}
#pragma GCC pop_options
#endif
