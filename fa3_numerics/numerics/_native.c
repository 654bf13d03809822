/* Compiled fast paths of the emulator's hot loops; each computes exactly what a PyTorch
 * reference in the package computes (the tests compare them):
 *
 *   fa3n_mma_fp22       the Hopper FP8 MMA model (numerics/mma.py)
 *   fa3n_softmax_step   one KV tile of the FA3 online softmax (numerics/emulator.py, _flash)
 *   fa3n_round_f64      float64 -> a narrow format, one rounding (numerics/formats.py, cast)
 *
 * ---- the Hopper FP8 MMA model, in exact integer arithmetic ----
 *
 * Built on first use by native.py (gcc -O3 -march=native -fopenmp) and checked bit for bit
 * against the PyTorch reference by tests/test_mma.py. Operands arrive pre-split as
 * x = S * 2^(E - 7): E int32 (ZERO_EXP for zeros), S int32 with |S| < 256.
 *
 * For every output (l, i, j) and every k-step of 32 products:
 *   emax = max(E(a_ik) + E(b_kj) over non-zero products, E(C) if C != 0)
 *   term = trunc(S(a) S(b) / 2^(1 + emax - E(a) - E(b)))      (|term| < 2^15)
 *   Cterm = trunc(C / 2^(emax - 13))
 *   D = (sum of terms + Cterm) truncated toward zero to 14 significant bits, times 2^(emax - 13)
 *
 * Speed: the model is elementwise over every product, so the kernel keeps a block of
 * 2 rows x 16 columns of (emax, sum) in AVX2 registers while it walks the 32 products of a
 * step, and loads each B element once for both rows. A product with a zero operand needs no
 * special case: its S is 0, and a shift count outside [0, 31] gives 0 in vpsrlvd. Machines
 * without AVX2 run the plain loop, which computes the same integers.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#define K_STEP 32
#define LIVE_MIN (-2048) /* emax above this: at least one non-zero product or C (ZERO_EXP = -4096) */
#define ZERO_EXP (-4096)

static inline int float_exp(float x) {
    /* floor(log2|x|) of a finite non-zero float, subnormals included */
    uint32_t bits;
    memcpy(&bits, &x, 4);
    int ex = (int)((bits >> 23) & 0xff);
    uint32_t mant = bits & 0x7fffff;
    if (ex == 0) return (31 - __builtin_clz(mant)) - 149;
    return ex - 127;
}

static inline int32_t c_term(float c, int emax) {
    /* trunc(c * 2^(13 - emax)) as an integer; |result| < 2^14 because E(c) <= emax */
    if (c == 0.0f) return 0;
    uint32_t bits;
    memcpy(&bits, &c, 4);
    int ex = (int)((bits >> 23) & 0xff);
    uint32_t sig = bits & 0x7fffff;
    int se;
    if (ex == 0) {
        se = -149;
    } else {
        sig |= 0x800000u;
        se = ex - 150;
    }
    int sh = se + 13 - emax; /* c * 2^(13 - emax) = sig * 2^sh */
    uint32_t mag;
    if (sh >= 0) mag = sig << sh;
    else if (sh <= -31) mag = 0;
    else mag = sig >> (-sh);
    return (bits >> 31) ? -(int32_t)mag : (int32_t)mag;
}

static inline float finish(int32_t tot, int emax) {
    if (emax <= LIVE_MIN || tot == 0) return 0.0f;
    uint32_t u = tot < 0 ? (uint32_t)(-(int64_t)tot) : (uint32_t)tot;
    int nb = 32 - __builtin_clz(u);
    if (nb > 14) u &= ~((1u << (nb - 14)) - 1u);
    /* times 2^(emax - 13), built from the bits: exact, and no libm call in the hot path */
    uint64_t sbits = (uint64_t)(emax - 13 + 1023) << 52;
    double scale;
    memcpy(&scale, &sbits, 8);
    double v = (double)u * scale;
    return (float)(tot < 0 ? -v : v);
}

static inline int32_t term(int32_t p, int32_t d) {
    /* trunc(p / 2^d) for d >= 0; 0 once d > 31 */
    uint32_t m = p < 0 ? (uint32_t)(-p) : (uint32_t)p;
    uint32_t t = (d < 0 || d > 31) ? 0u : (m >> d);
    return p < 0 ? -(int32_t)t : (int32_t)t;
}

/* One k-step for rows [EA, SA] x columns [j0, j1) of B, scalar. */
static void step_scalar(int64_t k0, int64_t k1, int64_t N, int64_t j0, int64_t j1, const int32_t *EA,
                        const int32_t *SA, const int32_t *EB, const int32_t *SB, float *acc) {
    for (int64_t j = j0; j < j1; j++) {
        int32_t em = acc[j] != 0.0f ? float_exp(acc[j]) : ZERO_EXP;
        for (int64_t k = k0; k < k1; k++) {
            if (SA[k] == 0 || SB[k * N + j] == 0) continue;
            int32_t t = EA[k] + EB[k * N + j];
            em = t > em ? t : em;
        }
        int32_t tot = c_term(acc[j], em);
        for (int64_t k = k0; k < k1; k++)
            tot += term(SA[k] * SB[k * N + j], em + 1 - EA[k] - EB[k * N + j]);
        acc[j] = finish(tot, em);
    }
}

#ifdef __AVX2__
#define JB 16 /* columns per register block: two ymm of int32 */

/* The per-output work of a step, vectorised (it is done once per 32 products, but in scalar code
 * it cost more than the products): the same integers as float_exp, c_term and finish above. */
static inline __m256i exp_v(__m256 x) {
    /* floor(log2|x|); ZERO_EXP for zeros; subnormals through the exponent of float(mantissa) */
    __m256i bits = _mm256_castps_si256(x);
    __m256i ex = _mm256_and_si256(_mm256_srli_epi32(bits, 23), _mm256_set1_epi32(0xff));
    __m256i mant = _mm256_and_si256(bits, _mm256_set1_epi32(0x7fffff));
    __m256i norm = _mm256_sub_epi32(ex, _mm256_set1_epi32(127));
    __m256i mf = _mm256_castps_si256(_mm256_cvtepi32_ps(mant)); /* exact: mant < 2^23 */
    __m256i sub = _mm256_sub_epi32(_mm256_and_si256(_mm256_srli_epi32(mf, 23), _mm256_set1_epi32(0xff)),
                                   _mm256_set1_epi32(127 + 149));
    __m256i iszero_ex = _mm256_cmpeq_epi32(ex, _mm256_setzero_si256());
    __m256i e = _mm256_blendv_epi8(norm, sub, iszero_ex);
    __m256i iszero = _mm256_and_si256(iszero_ex, _mm256_cmpeq_epi32(mant, _mm256_setzero_si256()));
    return _mm256_blendv_epi8(e, _mm256_set1_epi32(ZERO_EXP), iszero);
}

static inline __m256i c_term_v(__m256 x, __m256i emax) {
    __m256i bits = _mm256_castps_si256(x);
    __m256i ex = _mm256_and_si256(_mm256_srli_epi32(bits, 23), _mm256_set1_epi32(0xff));
    __m256i mant = _mm256_and_si256(bits, _mm256_set1_epi32(0x7fffff));
    __m256i isnorm = _mm256_cmpgt_epi32(ex, _mm256_setzero_si256());
    __m256i sig = _mm256_or_si256(mant, _mm256_and_si256(isnorm, _mm256_set1_epi32(0x800000)));
    __m256i se = _mm256_blendv_epi8(_mm256_set1_epi32(-149), _mm256_sub_epi32(ex, _mm256_set1_epi32(150)), isnorm);
    __m256i sh = _mm256_sub_epi32(_mm256_add_epi32(se, _mm256_set1_epi32(13)), emax); /* x * 2^(13-emax) = sig * 2^sh */
    /* AVX2 variable shifts give 0 for counts above 31 (and for "negative" counts, read unsigned) */
    __m256i right = _mm256_srlv_epi32(sig, _mm256_sub_epi32(_mm256_setzero_si256(), sh));
    __m256i left = _mm256_sllv_epi32(sig, sh);
    __m256i mag = _mm256_blendv_epi8(right, left, _mm256_cmpgt_epi32(sh, _mm256_set1_epi32(-1)));
    __m256i neg = _mm256_srai_epi32(bits, 31);
    return _mm256_sub_epi32(_mm256_xor_si256(mag, neg), neg);
}

static inline __m128 finish_half(__m128i tot, __m128i emax) {
    /* tot * 2^(emax - 13), |tot| truncated to 14 significant bits, rounded to float32 (RNE) */
    __m256d d = _mm256_cvtepi32_pd(tot); /* exact */
    __m256i db = _mm256_and_si256(_mm256_castpd_si256(d), _mm256_set1_epi64x(~((1LL << 39) - 1)));
    __m256i e64 = _mm256_cvtepi32_epi64(emax);
    e64 = _mm256_add_epi64(e64, _mm256_set1_epi64x(1023 - 13));
    __m256i live = _mm256_cmpgt_epi64(e64, _mm256_setzero_si256()); /* dead lanes: emax near ZERO_EXP */
    e64 = _mm256_blendv_epi8(_mm256_set1_epi64x(1023), e64, live);
    __m256d scale = _mm256_castsi256_pd(_mm256_slli_epi64(e64, 52));
    d = _mm256_mul_pd(_mm256_castsi256_pd(_mm256_and_si256(db, live)), scale);
    return _mm256_cvtpd_ps(d);
}

static inline __m256 finish_v(__m256i tot, __m256i emax) {
    __m128 lo = finish_half(_mm256_castsi256_si128(tot), _mm256_castsi256_si128(emax));
    __m128 hi = finish_half(_mm256_extracti128_si256(tot, 1), _mm256_extracti128_si256(emax, 1));
    return _mm256_insertf128_ps(_mm256_castps128_ps256(lo), hi, 1);
}

/* One k-step for two rows (r0, r1; r1 may equal r0) x columns [j, j + JB). */
static inline void step_avx2(int64_t k0, int64_t k1, int64_t N, int64_t j, const int32_t *EA0, const int32_t *SA0,
                             const int32_t *EA1, const int32_t *SA1, const int32_t *EB, const int32_t *SB,
                             float *acc0, float *acc1) {
    const __m256 c0a = _mm256_loadu_ps(acc0 + j), c0b = _mm256_loadu_ps(acc0 + j + 8);
    const __m256 c1a = _mm256_loadu_ps(acc1 + j), c1b = _mm256_loadu_ps(acc1 + j + 8);
    __m256i m0a = exp_v(c0a), m0b = exp_v(c0b), m1a = exp_v(c1a), m1b = exp_v(c1b);
    for (int64_t k = k0; k < k1; k++) {
        const int32_t *ebk = EB + k * N + j, *sbk = SB + k * N + j;
        __m256i eba = _mm256_loadu_si256((const __m256i *)ebk), ebb = _mm256_loadu_si256((const __m256i *)(ebk + 8));
        /* a zero B element carries ZERO_EXP: e + ZERO_EXP stays far below any live emax */
        __m256i e0 = _mm256_set1_epi32(SA0[k] ? EA0[k] : ZERO_EXP), e1 = _mm256_set1_epi32(SA1[k] ? EA1[k] : ZERO_EXP);
        m0a = _mm256_max_epi32(m0a, _mm256_add_epi32(e0, eba));
        m0b = _mm256_max_epi32(m0b, _mm256_add_epi32(e0, ebb));
        m1a = _mm256_max_epi32(m1a, _mm256_add_epi32(e1, eba));
        m1b = _mm256_max_epi32(m1b, _mm256_add_epi32(e1, ebb));
    }
    /* a dead lane (no product, C = 0) may have emax a little above ZERO_EXP: finish_v keeps it 0 */
    __m256i s0a = c_term_v(c0a, m0a), s0b = c_term_v(c0b, m0b), s1a = c_term_v(c1a, m1a), s1b = c_term_v(c1b, m1b);
    const __m256i one = _mm256_set1_epi32(1);
    __m256i x0a = _mm256_add_epi32(m0a, one), x0b = _mm256_add_epi32(m0b, one);
    __m256i x1a = _mm256_add_epi32(m1a, one), x1b = _mm256_add_epi32(m1b, one);
    for (int64_t k = k0; k < k1; k++) {
        const int32_t *ebk = EB + k * N + j, *sbk = SB + k * N + j;
        __m256i eba = _mm256_loadu_si256((const __m256i *)ebk), ebb = _mm256_loadu_si256((const __m256i *)(ebk + 8));
        __m256i sba = _mm256_loadu_si256((const __m256i *)sbk), sbb = _mm256_loadu_si256((const __m256i *)(sbk + 8));
#define ACC(X, S, EAk, SAk, EBV, SBV)                                                      \
    do {                                                                                  \
        __m256i p = _mm256_mullo_epi32(_mm256_set1_epi32(SAk), SBV);                     \
        __m256i d = _mm256_sub_epi32(_mm256_sub_epi32(X, _mm256_set1_epi32(EAk)), EBV); \
        __m256i t = _mm256_srlv_epi32(_mm256_abs_epi32(p), d);                            \
        S = _mm256_add_epi32(S, _mm256_sign_epi32(t, p));                                 \
    } while (0)
        if (SA0[k]) {
            ACC(x0a, s0a, EA0[k], SA0[k], eba, sba);
            ACC(x0b, s0b, EA0[k], SA0[k], ebb, sbb);
        }
        if (SA1[k]) {
            ACC(x1a, s1a, EA1[k], SA1[k], eba, sba);
            ACC(x1b, s1b, EA1[k], SA1[k], ebb, sbb);
        }
#undef ACC
    }
    /* both rows are written (the second may be the first again, for an odd last row: same values) */
    _mm256_storeu_ps(acc0 + j, finish_v(s0a, m0a));
    _mm256_storeu_ps(acc0 + j + 8, finish_v(s0b, m0b));
    _mm256_storeu_ps(acc1 + j, finish_v(s1a, m1a));
    _mm256_storeu_ps(acc1 + j + 8, finish_v(s1b, m1b));
}
#endif

void fa3n_mma_fp22(int64_t L, int64_t M, int64_t K, int64_t N, const int32_t *restrict ea, const int32_t *restrict sa,
                   const int32_t *restrict eb, const int32_t *restrict sb, const float *restrict c, float *restrict out,
                   int nthreads) {
    const int64_t pairs = (M + 1) / 2;
#pragma omp parallel for collapse(2) schedule(static) num_threads(nthreads)
    for (int64_t l = 0; l < L; l++) {
        for (int64_t ip = 0; ip < pairs; ip++) {
            const int64_t i0 = 2 * ip, i1 = (2 * ip + 1 < M) ? 2 * ip + 1 : 2 * ip;
            const int32_t *EA0 = ea + (l * M + i0) * K, *SA0 = sa + (l * M + i0) * K;
            const int32_t *EA1 = ea + (l * M + i1) * K, *SA1 = sa + (l * M + i1) * K;
            const int32_t *EB = eb + l * K * N, *SB = sb + l * K * N;
            float *acc0 = out + (l * M + i0) * N, *acc1 = out + (l * M + i1) * N;
            for (int64_t r = 0; r < (i1 != i0 ? 2 : 1); r++) {
                float *acc = r ? acc1 : acc0;
                const int64_t i = r ? i1 : i0;
                if (c) memcpy(acc, c + (l * M + i) * N, sizeof(float) * (size_t)N);
                else memset(acc, 0, sizeof(float) * (size_t)N);
            }
            for (int64_t k0 = 0; k0 < K; k0 += K_STEP) {
                const int64_t k1 = k0 + K_STEP < K ? k0 + K_STEP : K;
                int64_t j = 0;
#ifdef __AVX2__
                /* with a single last row, both register rows compute it: the second write wins and is identical */
                for (; j + JB <= N; j += JB) step_avx2(k0, k1, N, j, EA0, SA0, EA1, SA1, EB, SB, acc0, acc1);
#endif
                step_scalar(k0, k1, N, j, N, EA0, SA0, EB, SB, acc0);
                if (i1 != i0) step_scalar(k0, k1, N, j, N, EA1, SA1, EB, SB, acc1);
            }
        }
    }
}

/* Split float32 values holding FP8 numbers into (E, S) with x = S * 2^(E - 7), as mma.py's
 * operand_parts does; returns the number of non-finite inputs (then the caller falls back to the
 * PyTorch reference, which propagates them). */
static int64_t split_operands(int64_t n, const float *restrict x, int min_exp, int32_t *restrict e_out,
                              int32_t *restrict s_out, int nthreads) {
    int64_t bad = 0;
#pragma omp parallel for schedule(static) reduction(+ : bad) num_threads(nthreads)
    for (int64_t i = 0; i < n; i++) {
        uint32_t bits;
        memcpy(&bits, &x[i], 4);
        int32_t field = (int32_t)((bits >> 23) & 0xff);
        bad += field == 0xff;
        int32_t et = field - 127;
        int32_t e = et > min_exp ? et : min_exp;
        uint32_t sig = (bits & 0x7fffffu) | 0x800000u;
        int32_t sh = 16 + e - et;
        int32_t mag = sh > 31 ? 0 : (int32_t)(sig >> sh);
        int zero = field == 0; /* +-0: no FP8 value is a float32 subnormal */
        e_out[i] = zero ? ZERO_EXP : e;
        s_out[i] = zero ? 0 : ((bits >> 31) ? -mag : mag);
    }
    return bad;
}

static int64_t count_nonfinite(int64_t n, const float *x, int nthreads) {
    int64_t bad = 0;
#pragma omp parallel for schedule(static) reduction(+ : bad) num_threads(nthreads)
    for (int64_t i = 0; i < n; i++) bad += !__builtin_isfinite(x[i]);
    return bad;
}

/* The MMA model on float32 operands: the split into (E, S) happens here, in one pass, rather than
 * in PyTorch (which cost three times the model itself). Returns 1 (and computes nothing) when an
 * operand or the accumulator is not finite. */
int fa3n_mma_fp22_f32(int64_t L, int64_t M, int64_t K, int64_t N, const float *a, const float *b, const float *c,
                      float *out, int a_min_exp, int b_min_exp, int nthreads) {
    int32_t *ea = (int32_t *)malloc(sizeof(int32_t) * (size_t)(L * M * K));
    int32_t *sa = (int32_t *)malloc(sizeof(int32_t) * (size_t)(L * M * K));
    int32_t *eb = (int32_t *)malloc(sizeof(int32_t) * (size_t)(L * K * N));
    int32_t *sb = (int32_t *)malloc(sizeof(int32_t) * (size_t)(L * K * N));
    int rc = 0;
    if (!ea || !sa || !eb || !sb) {
        rc = 2;
    } else if (split_operands(L * M * K, a, a_min_exp, ea, sa, nthreads) ||
               split_operands(L * K * N, b, b_min_exp, eb, sb, nthreads) || (c && count_nonfinite(L * M * N, c, nthreads))) {
        rc = 1;
    } else {
        fa3n_mma_fp22(L, M, K, N, ea, sa, eb, sb, c, out, nthreads);
    }
    free(ea);
    free(sa);
    free(eb);
    free(sb);
    return rc;
}

/* ---- exp2 in double, for float32 results ----
 * 2^x = 2^n * 2^f with n = rint(x), |f| <= 1/2, 2^f by its Taylor series to degree 13 (truncation
 * error < 1e-17) evaluated with FMA: within 2 ulp of double, so its rounding to float32 is the
 * correctly rounded value except when 2^x lies within ~2^-51 of a float32 rounding boundary
 * (never for x = 0 or an integer: the result is then exact). A plain loop, so gcc vectorises it
 * (libm's exp2 would be a scalar call per element). */
static inline double exp2_d(double x) {
    /* branch-free so that loops over it vectorise */
    double xc = x < -1022.0 ? -1022.0 : (x > 1023.0 ? 1023.0 : x);
    double n = __builtin_rint(xc);
    double f = (xc - n) * 0.6931471805599453094; /* |f| <= ln2 / 2; x - n is exact */
    double p = 1.0 / 6227020800.0;                /* 1/13! */
    p = __builtin_fma(p, f, 1.0 / 479001600.0);
    p = __builtin_fma(p, f, 1.0 / 39916800.0);
    p = __builtin_fma(p, f, 1.0 / 3628800.0);
    p = __builtin_fma(p, f, 1.0 / 362880.0);
    p = __builtin_fma(p, f, 1.0 / 40320.0);
    p = __builtin_fma(p, f, 1.0 / 5040.0);
    p = __builtin_fma(p, f, 1.0 / 720.0);
    p = __builtin_fma(p, f, 1.0 / 120.0);
    p = __builtin_fma(p, f, 1.0 / 24.0);
    p = __builtin_fma(p, f, 1.0 / 6.0);
    p = __builtin_fma(p, f, 0.5);
    p = __builtin_fma(p, f, 1.0);
    p = __builtin_fma(p, f, 1.0);
    /* 2^n from the bits; n + 1023 is read off the low bits of (n + 1023) + 1.5 * 2^52, because
     * AVX2 has no double -> int64 conversion and the cast would stop the loop vectorising */
    double t = (n + 1023.0) + 0x1.8p52;
    int64_t bits;
    memcpy(&bits, &t, 8);
    bits <<= 52;
    double scale;
    memcpy(&scale, &bits, 8);
    double y = p * scale;
    y = x < -1022.0 ? 0.0 : y;     /* below every float32, subnormals included: 0 */
    y = x > 1023.0 ? INFINITY : y; /* beyond every float */
    return x != x ? x : y;         /* NaN stays NaN */
}

static inline float flush32(float x, int ftz) {
    return (ftz & (__builtin_fabsf(x) < 0x1p-126f)) ? 0.0f * x : x;
}

static inline float exp2_rz32(float x) {
    /* float32 2^x rounded toward zero (the emulator's model of the tile rescale factor) */
    double r = exp2_d((double)x);
    float y = (float)r;
    if ((double)__builtin_fabsf(y) > __builtin_fabs(r)) y = __builtin_nextafterf(y, 0.0f);
    return y;
}

/* Round a float (finite or not) to a format with `mbits` mantissa bits and smallest normal
 * exponent `emin`, ties to even; `sat`: clamp to +-fmax, else overflow to +-inf past fmax plus
 * half an ulp of the top binade. Exact: the rounding is done by rint on a power-of-two scaled
 * double. */
static inline double pow2d(int64_t e) {
    /* 2^e for -1022 <= e <= 1023, from the bits */
    int64_t bits = (e + 1023) << 52;
    double s;
    memcpy(&s, &bits, 8);
    return s;
}

static inline double round_fmt(double x, int mbits, int emin, double fmax, double ovf, int sat) {
    /* branch-free: the exponent from the bits, a power-of-two scale (exact), rint (ties to even) */
    uint64_t bits;
    memcpy(&bits, &x, 8);
    int64_t e = (int64_t)((bits >> 52) & 0x7ff) - 1023; /* floor(log2|x|) for normal x; -1023 for 0 */
    int64_t qe = (e > emin ? e : emin) - mbits;
    double y = __builtin_rint(x * pow2d(-qe)) * pow2d(qe);
    double a = __builtin_fabs(x);
    /* saturating formats clamp; IEEE ones overflow to inf (ovf is +inf for the former) */
    double lim = sat ? fmax : INFINITY;
    y = y > lim ? lim : y;
    y = y < -lim ? -lim : y;
    y = (!sat & (a >= ovf)) ? __builtin_copysign(INFINITY, x) : y;
    return x != x ? x : y;
}

void fa3n_round_f64(int64_t n, const double *restrict x, float *restrict out, int mbits, int emin, double fmax,
                    double ovf, int sat, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t i = 0; i < n; i++) out[i] = (float)round_fmt(x[i], mbits, emin, fmax, ovf, sat);
}

void fa3n_round_f32(int64_t n, const float *x, float *out, int mbits, int emin, double fmax, double ovf, int sat,
                    int nthreads) {
    /* float32 -> a narrower format, ties to even (out may alias x) */
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t i = 0; i < n; i++) out[i] = (float)round_fmt((double)x[i], mbits, emin, fmax, ovf, sat);
}

/* One KV tile of the flash algorithm for L x R rows (L = batch x heads) and N keys.
 *
 * s [L, R, N]: in, S = Q K^T of the tile (float32; descales not yet applied when qd/kd are
 * given); out, P~ cast to P's format (as float32). Per row it updates m (running max), rs4
 * (the four partial row sums of the kernel's quad of threads) and writes rescale, exactly as
 * numerics/emulator.py's PyTorch path:
 *   m_new = max(m, max visible s); m_cur = m_new if finite else 0
 *   rescale = flush(exp2_rz(float((m - m_cur) * sl2)))
 *   max_scaled = float(m_cur * sl2 - offset)            (one rounding: an FFMA)
 *   P~ = flush(float(exp2(float(s * sl2 - max_scaled)))) (FFMA, then ex2)
 *   rs4[t] = flush(rs4[t] * rescale) + P~ over thread t's columns {8j + 2t, 8j + 2t + 1}, in order
 * With qd/kd (per-row and per-key descales, block or token granularity) S is first scaled by
 * float(float(qd * kd) * base) and sl2 is 1. lim[r] is the last visible key of row r (causal),
 * or NULL for all keys. fmt_kind 0 leaves P~ in float32. */
void fa3n_softmax_step(int64_t L, int64_t R, int64_t N, float *restrict s, const float *restrict sl2,
                       const float *restrict qd, const float *restrict kd, float base, const int64_t *restrict lim,
                       float *restrict m, float *restrict rs4, float *restrict rescale, double offset, int ftz,
                       int fmt_kind, int mbits, int emin, double fmax, double ovf, int sat, int nthreads) {
#pragma omp parallel for collapse(2) schedule(static) num_threads(nthreads)
    for (int64_t l = 0; l < L; l++) {
        for (int64_t r = 0; r < R; r++) {
            float *row = s + (l * R + r) * N;
            const int64_t last = lim ? lim[r] : N - 1; /* keys 0..last are visible */
            const int64_t nv = last + 1 < 0 ? 0 : (last + 1 > N ? N : last + 1);
            const float a = sl2 ? sl2[l] : 1.0f;
            if (qd) {
                const float qv = qd[l * R + r];
                const float *kl = kd + l * N;
                for (int64_t c = 0; c < N; c++) row[c] = row[c] * ((qv * kl[c]) * base);
            }
            /* eight partial maxima so that the loop vectorises (max is exact in any order) */
            float mx8[8] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY};
            int nan8[8] = {0};
            int64_t c = 0;
            for (; c + 8 <= nv; c += 8)
                for (int u = 0; u < 8; u++) {
                    float v = row[c + u];
                    nan8[u] |= v != v;
                    mx8[u] = v > mx8[u] ? v : mx8[u];
                }
            float mx = -INFINITY;
            int nan = 0;
            for (; c < nv; c++) {
                float v = row[c];
                nan |= v != v;
                mx = v > mx ? v : mx;
            }
            for (int u = 0; u < 8; u++) {
                nan |= nan8[u];
                mx = mx8[u] > mx ? mx8[u] : mx;
            }
            const float mo = m[l * R + r];
            float mn = mo > mx ? mo : mx;
            if (nan || mo != mo) mn = NAN;
            const int fin = __builtin_isfinite(mn);
            const float mc = fin ? mn : 0.0f;
            const float resc = flush32(exp2_rz32((mo - mc) * a), ftz);
            const float ms = fin ? (float)((double)mc * (double)a - offset) : 0.0f;
            const double nms = -(double)ms;
            for (int64_t c = 0; c < nv; c++) {
                float x = (float)((double)row[c] * (double)a + nms); /* the FFMA: one rounding */
                row[c] = flush32((float)exp2_d((double)x), ftz);
            }
            for (int64_t c = nv; c < N; c++) row[c] = 0.0f; /* masked: exp2(-inf) */
            float *t4 = rs4 + (l * R + r) * 4;
            for (int t = 0; t < 4; t++) {
                float acc = flush32(t4[t] * resc, ftz);
                /* non-negative normal addends: no sum here is ever subnormal, so no flush */
                for (int64_t j = 0; 8 * j + 2 * t < N; j++) {
                    int64_t c0 = 8 * j + 2 * t;
                    acc = acc + row[c0];
                    if (c0 + 1 < N) acc = acc + row[c0 + 1];
                }
                t4[t] = acc;
            }
            if (fmt_kind)
                for (int64_t c = 0; c < N; c++) row[c] = (float)round_fmt((double)row[c], mbits, emin, fmax, ovf, sat);
            m[l * R + r] = mn;
            rescale[l * R + r] = resc;
        }
    }
}

/* ---- random Hadamard rotation: out = fwht(x * signs) / sqrt(d) for power-of-two d ----
 * The same butterflies, in the same order, as rotation.fwht in PyTorch (stage h pairs element i
 * of each 2h block with element i + h: a + b first, a - b second), so the results are
 * bit-identical; one row at a time in a stack buffer instead of seven full-size temporaries. */
void fa3n_fwht(int64_t rows, int64_t d, const double *restrict x, const double *restrict signs, double root,
               double *restrict out, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t r = 0; r < rows; r++) {
        double buf[1024];
        const double *xr = x + r * d;
        for (int64_t i = 0; i < d; i++) buf[i] = xr[i] * signs[i];
        for (int64_t h = 1; h < d; h *= 2) {
            for (int64_t blk = 0; blk < d; blk += 2 * h) {
                for (int64_t i = 0; i < h; i++) {
                    double a = buf[blk + i], b = buf[blk + h + i];
                    buf[blk + i] = a + b;
                    buf[blk + h + i] = a - b;
                }
            }
        }
        double *o = out + r * d;
        for (int64_t i = 0; i < d; i++) o[i] = buf[i] / root;
    }
}

/* ---- one-byte formats (FP8) to float32 by table lookup: exact, ~20x torch's conversion ---- */
void fa3n_decode_u8(int64_t n, const uint8_t *restrict x, const float *restrict lut, float *restrict out,
                    int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t i = 0; i < n; i++) out[i] = lut[x[i]];
}

/* ---- O *= rescale per row, in place, with the kernel's flush of subnormal products ---- */
void fa3n_rescale_rows(int64_t rows, int64_t d, float *restrict acc, const float *restrict scale, int ftz,
                       int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t r = 0; r < rows; r++) {
        const float s = scale[r];
        float *a = acc + r * d;
        for (int64_t j = 0; j < d; j++) a[j] = flush32(a[j] * s, ftz);
    }
}

/* ---- |x| statistics of an input tensor in one pass: histogram over sorted edges, amax, and
 * the count of non-finite values (NaN/Inf are left out of the histogram and amax). Bin b
 * holds edges[b] <= |x| < edges[b+1]; the last bin is open above, as torch.bucketize(right=True)
 * - 1 gives. The bin is found by binary search (exact at the edges). ---- */
void fa3n_abs_stats(int64_t n, const double *restrict x, const double *restrict edges, int nedges,
                    int64_t *restrict counts, double *restrict amax_out, int64_t *restrict nonfinite_out,
                    int nthreads) {
    int64_t nonfinite = 0;
    double amax = 0.0;
    /* edges padded with +inf to a power of two: a branch-free binary search (no mispredicts) */
    int pw = 1;
    while (pw < nedges) pw <<= 1;
    double *pad = (double *)malloc(sizeof(double) * (size_t)pw);
    for (int b = 0; b < pw; b++) pad[b] = b < nedges ? edges[b] : INFINITY;
#pragma omp parallel num_threads(nthreads)
    {
        int64_t *local = (int64_t *)calloc((size_t)nedges, sizeof(int64_t));
        int64_t nf = 0;
        double am = 0.0;
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n; i++) {
            double a = __builtin_fabs(x[i]);
            if (!__builtin_isfinite(a)) {
                nf++;
                continue;
            }
            am = a > am ? a : am;
            int lo = 0; /* pad[lo] <= a (pad[0] = edges[0] <= |x| by contract) */
            for (int step = pw >> 1; step > 0; step >>= 1) lo += (a >= pad[lo + step]) ? step : 0;
            local[lo]++;
        }
#pragma omp critical
        {
            for (int b = 0; b < nedges; b++) counts[b] += local[b];
            nonfinite += nf;
            amax = am > amax ? am : amax;
        }
        free(local);
    }
    free(pad);
    *amax_out = amax;
    *nonfinite_out = nonfinite;
}
