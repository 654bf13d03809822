/* Compiled fast paths of the emulator's hot loops; each computes exactly what a PyTorch
 * reference in the package computes (the tests compare them):
 *
 *   fa3n_mma_fp22_f32   the Hopper FP8 MMA model (numerics/mma.py)
 *   fa3n_softmax_step   one KV tile of the FA3 online softmax (numerics/emulator.py, _flash)
 *   fa3n_round_f64      float64 -> a narrow format, one rounding (numerics/formats.py, cast)
 *
 * ---- the Hopper FP8 MMA model, in float arithmetic ----
 *
 * Built on first use by native.py (gcc -O3 -march=native -fopenmp) and checked bit for bit
 * against the PyTorch reference by tests/numerics/test_mma.py and tests/numerics/test_native.py. For every output
 * (l, i, j) and every k-step of K_STEP = 32 products (numerics/mma.py):
 *
 *   emax = max(E(a_ik) + E(b_kj) over non-zero products, E(C) if C != 0),  s = 2^(13 - emax)
 *   D    = (trunc(C s) + sum_k trunc(a_ik b_kj s)) truncated toward zero to 14 significant bits,
 *          times 2^(emax - 13)
 *
 * Why floats (as kernels/triton_/mma_model.py on the GPU): for operands of at most 12
 * significant bits a b is exact in float32, and so is a b s (s is a power of two) unless it
 * underflows, and then it is below 1 and truncates to 0 all the same; vcvttps2dq truncates toward
 * zero whatever the rounding mode. That is four AVX2 instructions per 8 products (two
 * multiplies, the conversion, an integer add) where the integer-significand form took seven
 * (multiply, two shift-count subtractions, abs, variable shift, sign, add). |term| < 2^15, so a
 * step's sum (32 terms and C's, < 2^21) is exact in int32 and in float32, where masking the low
 * 10 mantissa bits truncates it toward zero to 14 significant bits.
 *
 * E(a) + E(b) is a max-plus product of exponents. It runs on bytes, 32 columns per instruction,
 * as a min-plus product of u = 31 - E (0..61), with wrapping adds and unsigned minima (both
 * issue four per cycle; the saturating forms two): a zero operand carries ZU = 125, so that a
 * sum with it (125..186, or 250) never wraps and stays above every real one (0..122). Hence
 * tiles of TM rows x TN = 32 columns.
 *
 * Exact domain: finite operands of at most 12 significant bits and true exponents in [-38, 31]
 * (every product a normal float32), clamp exponents in [-30, 31] (the byte codes): every FP8
 * value. For anything else the entry point returns 1 and the caller runs the reference, which
 * also propagates non-finite values. C may be any finite float32: when a step has no product
 * and |C| < 2^-100 (s would leave the float range) its result is C cut to 14 significant bits,
 * computed from the bits.
 *
 * Speed (2-core AMD EPYC, Zen 3, one thread, the emulator's calls: [8, 256, 128] x [8, 128, 224]
 * and [8, 256, 224] x [8, 224, 128] with C): 4.4 ms a call, 75 ps a product, where the integer
 * form took 16-18 ms. Three quarters of it are the products' loop, which issues its four vector
 * instructions per 8 products at ~75% of the 4 a cycle the core can take (vcvttps2dq alone
 * issues one a cycle); the rest is the byte pass, the per-output work of each step and the
 * operands' split (~8%).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#else
static inline int omp_get_thread_num(void) { return 0; }
#endif

#define K_STEP 32
#define TM 4   /* rows of an output tile */
#define TN 32  /* columns of an output tile: one ymm of byte exponent codes */
#define ZU 125 /* exponent code of a zero operand (see above) */
#define NO_PROD 122 /* a step's minimum code sum above this: no product */
#define TINY_EXP (-100) /* below it s = 2^(13 - emax) leaves float32: C alone, from its bits */

static inline int float_exp(float x) {
    /* floor(log2|x|) of a finite non-zero float, subnormals included */
    uint32_t bits;
    memcpy(&bits, &x, 4);
    int ex = (int)((bits >> 23) & 0xff);
    uint32_t mant = bits & 0x7fffff;
    if (ex == 0) return (31 - __builtin_clz(mant)) - 149;
    return ex - 127;
}

static inline float pow2f(int e) {
    /* 2^e for -126 <= e <= 127, from the bits */
    uint32_t bits = (uint32_t)(e + 127) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline int nonzero_bits(float x) {
    /* x != 0 from the bits: a float compare would see a subnormal as 0 under DAZ */
    uint32_t bits;
    memcpy(&bits, &x, 4);
    return (bits & 0x7fffffffu) != 0;
}

static inline float trunc_sig14(float c) {
    /* c truncated toward zero to 14 significant bits (a float32 subnormal has its own count) */
    uint32_t bits;
    memcpy(&bits, &c, 4);
    uint32_t mag = bits & 0x7fffffffu;
    if (mag >= 0x00800000u) {
        mag &= ~0x3ffu;
    } else if (mag) {
        int nb = 32 - __builtin_clz(mag);
        if (nb > 14) mag &= ~((1u << (nb - 14)) - 1u);
    }
    bits = (bits & 0x80000000u) | mag;
    memcpy(&c, &bits, 4);
    return c;
}

/* The exponent code u = 31 - E of an operand (E clamped at min_exp; ZU for zeros); sets *bad
 * outside the exact domain (non-finite, more than 12 significant bits, true exponent outside
 * [-38, 31]; min_exp in [-30, 31] is the caller's). */
static inline uint8_t exp_code(float x, int min_exp, int *bad) {
    uint32_t bits;
    memcpy(&bits, &x, 4);
    int t = (int)((bits >> 23) & 0xff) - 127; /* float32 subnormals: -127, outside the domain */
    int e = t > min_exp ? t : min_exp;
    int zero = (bits & 0x7fffffffu) == 0;
    *bad |= (!zero) & ((t == 128) | ((bits & 0xfffu) != 0) | (t < -38) | (e > 31));
    return zero ? (uint8_t)ZU : (uint8_t)(31 - e);
}

/* One step of a TM x TN tile, plain C: the same numbers as tile_step_avx2, for machines without
 * AVX2 (tests run it too, through the entry point's `portable`). av, ua: the tile's A rows at the
 * step's first k (row stride kp; ua holds each byte code four times); bv, ub: B at the step's
 * first k and the tile's first column (row stride np); acc: C in, D out. */
static void tile_step_portable(const float *av, const uint32_t *ua, int64_t kp, const float *bv, const uint8_t *ub,
                               int64_t np, float *acc) {
    for (int r = 0; r < TM; r++) {
        for (int j = 0; j < TN; j++) {
            int m = 255;
            for (int kk = 0; kk < K_STEP; kk++) {
                const int x = (int)(ua[r * kp + kk] & 0xff) + ub[kk * np + j];
                m = x < m ? x : m;
            }
            const int has_prod = m <= NO_PROD;
            int emax = has_prod ? 62 - m : -1000;
            const float c = acc[r * TN + j];
            if (nonzero_bits(c) && float_exp(c) > emax) emax = float_exp(c);
            float d = 0.0f;
            if (!has_prod && emax < TINY_EXP) {
                d = nonzero_bits(c) ? trunc_sig14(c) : 0.0f;
            } else {
                const float s = pow2f(13 - emax);
                int32_t tot = (int32_t)(c * s);
                for (int kk = 0; kk < K_STEP; kk++) tot += (int32_t)((av[r * kp + kk] * bv[kk * np + j]) * s);
                uint32_t tb;
                float f = (float)tot; /* exact: |tot| < 2^21 */
                memcpy(&tb, &f, 4);
                tb &= ~0x3ffu; /* 14 significant bits, toward zero (sign-magnitude) */
                memcpy(&f, &tb, 4);
                d = f / s;
            }
            acc[r * TN + j] = d;
        }
    }
}

#ifdef __AVX2__
/* s = 2^(13 - emax) for 8 outputs of one row, and C's term as the sum's start. Biased exponents
 * (emax + 127): ep, the products' from the byte pass (0: none), and C's exponent field (0 for
 * zeros and subnormals). Lanes below TINY_EXP (no product, and C zero or below 2^-100) are
 * flagged in *tiny: the vector result there is 0, right for C = 0 only, and the caller redoes
 * them from C's bits (the tile's padding holds C = 1 so as not to take that path). */
static inline __m256 step_start(const uint8_t *ep, const float *acc, __m256i *tot, int *tiny) {
    const __m256 c = _mm256_load_ps(acc);
    const __m256i fc = _mm256_srli_epi32(_mm256_slli_epi32(_mm256_castps_si256(c), 1), 24);
    __m256i e = _mm256_max_epi32(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)ep)), fc);
    *tiny = _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(TINY_EXP + 127), e)));
    e = _mm256_max_epi32(e, _mm256_set1_epi32(TINY_EXP + 127));
    const __m256 s = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_sub_epi32(_mm256_set1_epi32(140 + 127), e), 23));
    *tot = _mm256_cvttps_epi32(_mm256_mul_ps(c, s));
    return s;
}

static inline void step_end(float *acc, __m256i tot, __m256 s) {
    /* the sum cut to 14 significant bits, times 2^(emax - 13) = 1 / s: biased exponent 254 - that of s */
    const __m256 f = _mm256_and_ps(_mm256_cvtepi32_ps(tot), _mm256_castsi256_ps(_mm256_set1_epi32(-1024)));
    const __m256 scale = _mm256_castsi256_ps(_mm256_sub_epi32(_mm256_set1_epi32(254 << 23), _mm256_castps_si256(s)));
    _mm256_store_ps(acc, _mm256_mul_ps(f, scale));
}

/* The products of row r of a tile: its 4 sums and 4 scales (from and back to sv, tv, the tile's
 * 8-lane vectors, row-major) stay in registers while the step's products stream: one A broadcast
 * and four B vectors per k for 32 products. (2 rows x 16 columns ran 4% slower: the bound is the
 * four vector instructions per 8 products, so fewer loads per product buy little.) */
static inline void row_avx2(const float *av, int64_t kp, const float *bv, int64_t np, const __m256 *sv, __m256i *tv,
                            int r) {
    const float *a = av + r * kp;
    const int v = r * TN / 8;
    const __m256 s0 = sv[v], s1 = sv[v + 1], s2 = sv[v + 2], s3 = sv[v + 3];
    __m256i t0 = tv[v], t1 = tv[v + 1], t2 = tv[v + 2], t3 = tv[v + 3];
#pragma GCC unroll 4
    for (int kk = 0; kk < K_STEP; kk++) {
        const float *b = bv + kk * np;
        const __m256 x = _mm256_broadcast_ss(a + kk);
        t0 = _mm256_add_epi32(t0, _mm256_cvttps_epi32(_mm256_mul_ps(_mm256_mul_ps(x, _mm256_loadu_ps(b)), s0)));
        t1 = _mm256_add_epi32(t1, _mm256_cvttps_epi32(_mm256_mul_ps(_mm256_mul_ps(x, _mm256_loadu_ps(b + 8)), s1)));
        t2 = _mm256_add_epi32(t2, _mm256_cvttps_epi32(_mm256_mul_ps(_mm256_mul_ps(x, _mm256_loadu_ps(b + 16)), s2)));
        t3 = _mm256_add_epi32(t3, _mm256_cvttps_epi32(_mm256_mul_ps(_mm256_mul_ps(x, _mm256_loadu_ps(b + 24)), s3)));
    }
    tv[v] = t0, tv[v + 1] = t1, tv[v + 2] = t2, tv[v + 3] = t3;
}

/* One step of a TM x TN tile (arguments as tile_step_portable; acc 32-byte aligned). */
static void tile_step_avx2(const float *av, const uint32_t *ua, int64_t kp, const float *bv, const uint8_t *ub,
                           int64_t np, float *acc) {
    __m256i m[TM];
    for (int r = 0; r < TM; r++) m[r] = _mm256_set1_epi8(-1);
    for (int kk = 0; kk < K_STEP; kk++) {
        const __m256i eb = _mm256_loadu_si256((const __m256i *)(ub + kk * np));
        for (int r = 0; r < TM; r++)
            m[r] = _mm256_min_epu8(m[r], _mm256_add_epi8(eb, _mm256_set1_epi32((int)ua[r * kp + kk])));
    }
    /* biased emax of the products, 189 - m = 62 - m + 127, or 0 where there is none */
    uint8_t ep[TM * TN] __attribute__((aligned(32)));
    for (int r = 0; r < TM; r++) {
        const __m256i real = _mm256_cmpeq_epi8(_mm256_min_epu8(m[r], _mm256_set1_epi8(NO_PROD)), m[r]);
        _mm256_store_si256((__m256i *)(ep + r * TN),
                           _mm256_and_si256(_mm256_sub_epi8(_mm256_set1_epi8((char)189), m[r]), real));
    }
    /* the per-output work of the step, before and after the products */
    enum { NV = TM * TN / 8 };
    __m256 sv[NV];
    __m256i tv[NV];
    int tiny[NV], any_tiny = 0;
    for (int v = 0; v < NV; v++) {
        sv[v] = step_start(ep + 8 * v, acc + 8 * v, &tv[v], &tiny[v]);
        any_tiny |= tiny[v];
    }
    float saved[TM * TN];
    if (__builtin_expect(any_tiny, 0)) memcpy(saved, acc, sizeof saved);
    for (int r = 0; r < TM; r++) row_avx2(av, kp, bv, np, sv, tv, r);
    for (int v = 0; v < NV; v++) step_end(acc + 8 * v, tv[v], sv[v]);
    if (__builtin_expect(any_tiny, 0))
        for (int v = 0; v < NV; v++)
            for (int u = 0; u < 8; u++)
                if ((tiny[v] >> u) & 1) acc[8 * v + u] = nonzero_bits(saved[8 * v + u]) ? trunc_sig14(saved[8 * v + u]) : 0.0f;
}
#endif

#ifdef __AVX2__
/* exp_code of 8 values, as int32 lanes; ORs the lanes outside the domain into *bad */
static inline __m256i codes8(const float *x, __m256i lo, __m256i *bad) {
    const __m256i bits = _mm256_loadu_si256((const __m256i *)x), one = _mm256_set1_epi32(-1);
    const __m256i two = _mm256_slli_epi32(bits, 1), f = _mm256_srli_epi32(two, 24); /* biased exponent */
    const __m256i zero = _mm256_cmpeq_epi32(two, _mm256_setzero_si256()), e = _mm256_max_epi32(f, lo);
    __m256i out = _mm256_or_si256(_mm256_cmpeq_epi32(f, _mm256_set1_epi32(255)),
                                  _mm256_cmpgt_epi32(_mm256_set1_epi32(127 - 38), f));
    out = _mm256_or_si256(out, _mm256_cmpgt_epi32(e, _mm256_set1_epi32(127 + 31)));
    out = _mm256_or_si256(out, _mm256_xor_si256(_mm256_cmpeq_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0xfff)),
                                                                   _mm256_setzero_si256()), one));
    *bad = _mm256_or_si256(*bad, _mm256_andnot_si256(zero, out));
    return _mm256_blendv_epi8(_mm256_sub_epi32(_mm256_set1_epi32(31 + 127), e), _mm256_set1_epi32(ZU), zero);
}
#endif

/* Byte codes of n contiguous values (exp_code), into u8, or each four times into a uint32 of u32
 * (for a one-load broadcast); returns 1 for a value outside the exact domain. A pass over every
 * operand element per call: vectorised by hand (gcc's own version of the loop took 5% of a call);
 * `portable` takes the plain loop, as a CPU without AVX2 does. */
static int codes(const float *restrict x, int64_t n, int min_exp, uint8_t *restrict u8, uint32_t *restrict u32,
                 int portable) {
    int bad = 0;
    int64_t i = 0;
#ifdef __AVX2__
    if (portable) goto plain;
    const __m256i lo = _mm256_set1_epi32(min_exp + 127);
    __m256i vbad = _mm256_setzero_si256();
    if (u8) {
        for (; i + 32 <= n; i += 32) {
            const __m256i c0 = codes8(x + i, lo, &vbad), c1 = codes8(x + i + 8, lo, &vbad);
            const __m256i c2 = codes8(x + i + 16, lo, &vbad), c3 = codes8(x + i + 24, lo, &vbad);
            /* the packs work within 128-bit lanes: put the 32-bit groups back in order */
            const __m256i p = _mm256_packus_epi16(_mm256_packus_epi32(c0, c1), _mm256_packus_epi32(c2, c3));
            _mm256_storeu_si256((__m256i *)(u8 + i),
                                _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        }
    } else {
        const __m256i rep = _mm256_setr_epi8(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12, 0, 0, 0, 0, 4, 4, 4, 4,
                                             8, 8, 8, 8, 12, 12, 12, 12);
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_si256((__m256i *)(u32 + i), _mm256_shuffle_epi8(codes8(x + i, lo, &vbad), rep));
    }
    bad = !_mm256_testz_si256(vbad, vbad);
plain:
#else
    (void)portable;
#endif
    if (u8)
        for (; i < n; i++) u8[i] = exp_code(x[i], min_exp, &bad);
    else
        for (; i < n; i++) u32[i] = (uint32_t)exp_code(x[i], min_exp, &bad) * 0x01010101u;
    return bad;
}

/* rows x cols of a strided matrix into dst (row stride ld), padded with `pad` to prows x ld */
static void gather(const float *src, int64_t s_row, int64_t s_col, int64_t rows, int64_t cols, int64_t prows,
                   int64_t ld, float pad, float *restrict dst) {
    for (int64_t r = 0; r < prows; r++) {
        float *d = dst + r * ld;
        int64_t c = 0;
        if (r < rows) {
            const float *row = src + r * s_row;
            if (s_col == 1) {
                memcpy(d, row, sizeof(float) * (size_t)cols);
                c = cols;
            } else {
                for (; c < cols; c++) d[c] = row[c * s_col];
            }
        }
        for (; c < ld; c++) d[c] = pad;
    }
}

/* B [K, N] of one l -> values and byte codes, zero-padded to [kp, np] and stored by column tiles:
 * tile jt is B[0:kp, TN jt : TN (jt + 1)] as kp contiguous rows of TN, so that a step reads its
 * 4 KB of B as one stream (with rows np apart, a power-of-two np maps them onto few L1 sets).
 * Returns 1 outside the domain. */
static int prep_b(const float *b, const int64_t *bs, int64_t l, int64_t K, int64_t N, int64_t kp, int64_t np,
                  int min_exp, float *bv, uint8_t *ub, int portable) {
    for (int64_t n0 = 0; n0 < np; n0 += TN)
        gather(b + l * bs[0] + n0 * bs[2], bs[1], bs[2], K, N - n0 < TN ? N - n0 : TN, kp, TN, 0.0f, bv + n0 * kp);
    return codes(bv, kp * np, min_exp, ub, NULL, portable);
}

/* Rows [i0, i0 + TM) of A [M, K] of one l -> values and codes [TM, kp], zero-padded. */
static int prep_a(const float *a, const int64_t *as, int64_t l, int64_t i0, int64_t M, int64_t K, int64_t kp,
                  int min_exp, float *av, uint32_t *ua, int portable) {
    const int64_t rows = M - i0 < TM ? M - i0 : TM;
    gather(a + l * as[0] + i0 * as[1], as[1], as[2], rows, K, TM, kp, 0.0f, av);
    return codes(av, TM * kp, min_exp, NULL, ua, portable);
}

typedef void (*step_fn)(const float *, const uint32_t *, int64_t, const float *, const uint8_t *, int64_t, float *);

/* The shapes and operands of one call, shared by its threads. */
typedef struct {
    int64_t M, K, N, kp, np;
    const float *a, *b, *c;
    const int64_t *as, *bs, *cs;
    float *out;
    int a_min_exp, b_min_exp, portable;
    step_fn step;
} mma_call;

/* C of one l is finite (a non-finite C goes to the reference, which propagates it) */
static int c_finite(const mma_call *p, int64_t l) {
    int bad = 0;
    if (p->c)
        for (int64_t i = 0; i < p->M; i++)
            for (int64_t j = 0; j < p->N; j++) bad |= !__builtin_isfinite(p->c[l * p->cs[0] + i * p->cs[1] + j * p->cs[2]]);
    return !bad;
}

/* Row tiles [t0, t1) of one l against its prepared B (bv, ub); av, ua: the thread's A buffers.
 * Returns 1 for an A value outside the exact domain. */
static int mma_rows(const mma_call *p, int64_t l, int64_t t0, int64_t t1, const float *bv, const uint8_t *ub,
                    float *av, uint32_t *ua) {
    const int64_t M = p->M, N = p->N, kp = p->kp, np = p->np;
    const int64_t *cs = p->cs;
    float acc[TM * TN] __attribute__((aligned(32)));
    for (int64_t t = t0; t < t1; t++) {
        const int64_t i0 = t * TM, rows = M - i0 < TM ? M - i0 : TM;
        if (prep_a(p->a, p->as, l, i0, M, p->K, kp, p->a_min_exp, av, ua, p->portable)) return 1;
        for (int64_t j0 = 0; j0 < np; j0 += TN) {
            const int64_t cols = N - j0 < TN ? N - j0 : TN;
            const float *csrc = p->c ? p->c + l * cs[0] + i0 * cs[1] + j0 * cs[2] : NULL;
            if (csrc && rows == TM && cols == TN && cs[2] == 1) {
                for (int r = 0; r < TM; r++)
                    for (int j = 0; j < TN; j++) acc[r * TN + j] = csrc[r * cs[1] + j];
            } else if (csrc) {
                gather(csrc, cs[1], cs[2], rows, cols, TM, TN, 1.0f, acc);
            } else {
                /* 1 in the padding: a lane without products and C = 0 takes the slow path */
                for (int r = 0; r < TM; r++)
                    for (int j = 0; j < TN; j++) acc[r * TN + j] = (r < rows && j < cols) ? 0.0f : 1.0f;
            }
            for (int64_t k0 = 0; k0 < kp; k0 += K_STEP)
                p->step(av + k0, ua + k0, kp, bv + j0 * kp + k0 * TN, ub + j0 * kp + k0 * TN, TN, acc);
            float *o = p->out + (l * M + i0) * N + j0;
            if (rows == TM && cols == TN) {
                for (int r = 0; r < TM; r++)
                    for (int j = 0; j < TN; j++) o[r * N + j] = acc[r * TN + j];
            } else {
                for (int r = 0; r < rows; r++) memcpy(o + r * N, acc + r * TN, sizeof(float) * (size_t)cols);
            }
        }
    }
    return 0;
}

/* D = C + A @ B under the model for L independent products: A [L, M, K], B [L, K, N], C [L, M, N]
 * or NULL (zeros) with element strides as[3], bs[3], cs[3] (any layout: the emulator's K^T is a
 * transposed view), D [L, M, N] contiguous. Returns 0, 1 (nothing to use: an operand outside the
 * exact domain or a non-finite C; the caller runs the reference) or 2 (out of memory).
 * `portable` runs the plain C step where AVX2 is compiled in (for the tests).
 *
 * Threads take work dynamically and meet at one barrier per call, the end: on a machine shared
 * with other processes a thread that loses its core then delays the call by what it holds, not
 * every thread at every barrier by a scheduler time slice. With L >= 2 x threads a thread takes
 * whole l's, preparing B next to its use (in L2); otherwise all of B is prepared first. */
int fa3n_mma_fp22_f32(int64_t L, int64_t M, int64_t K, int64_t N, const float *a, const int64_t *as, const float *b,
                      const int64_t *bs, const float *c, const int64_t *cs, float *out, int a_min_exp, int b_min_exp,
                      int nthreads, int portable) {
    if (L <= 0 || M <= 0 || N <= 0) return 0;
    if (K > 0 && (a_min_exp < -30 || a_min_exp > 31 || b_min_exp < -30 || b_min_exp > 31)) return 1;
    mma_call p = {M, K, N, (K + K_STEP - 1) / K_STEP * K_STEP, (N + TN - 1) / TN * TN, a, b, c, as, bs, cs, out,
                  a_min_exp, b_min_exp, portable, tile_step_portable};
#ifdef __AVX2__
    if (!portable) p.step = tile_step_avx2;
#endif
    const int64_t kp = p.kp, np = p.np, mt = (M + TM - 1) / TM, bsize = kp * np;
    const int per_l = L >= 2 * (int64_t)nthreads;
    /* B for every l, or one per thread; 16 floats of slack so that no buffer is empty */
    const int64_t nb = per_l ? nthreads : L;
    float *bv = (float *)aligned_alloc(64, sizeof(float) * (size_t)(nb * bsize + 16));
    uint8_t *ub = (uint8_t *)aligned_alloc(64, (size_t)(nb * bsize + 64));
    int rc = (!bv || !ub) ? 2 : 0;
    if (rc == 0) {
#pragma omp parallel num_threads(nthreads)
        {
            float *av = (float *)aligned_alloc(64, sizeof(float) * (size_t)(TM * kp + 16));
            uint32_t *ua = (uint32_t *)aligned_alloc(64, sizeof(uint32_t) * (size_t)(TM * kp + 16));
            int err = (!av || !ua) ? 2 : 0;
            if (per_l) {
                float *bvt = bv + (int64_t)omp_get_thread_num() * bsize;
                uint8_t *ubt = ub + (int64_t)omp_get_thread_num() * bsize;
#pragma omp for schedule(dynamic, 1)
                for (int64_t l = 0; l < L; l++) {
                    if (err) continue;
                    if (prep_b(b, bs, l, K, N, kp, np, b_min_exp, bvt, ubt, portable) || !c_finite(&p, l) ||
                        mma_rows(&p, l, 0, mt, bvt, ubt, av, ua))
                        err = 1;
                }
            } else {
#pragma omp for schedule(static)
                for (int64_t l = 0; l < L; l++)
                    if (prep_b(b, bs, l, K, N, kp, np, b_min_exp, bv + l * bsize, ub + l * bsize, portable) || !c_finite(&p, l))
                        err = err ? err : 1;
#pragma omp for collapse(2) schedule(dynamic, 1)
                for (int64_t l = 0; l < L; l++)
                    for (int64_t t = 0; t < mt; t++)
                        if (!err && mma_rows(&p, l, t, t + 1, bv + l * bsize, ub + l * bsize, av, ua)) err = 1;
            }
            if (err) {
#pragma omp critical
                rc = rc == 2 ? 2 : err;
            }
            free(av);
            free(ua);
        }
    }
    free(bv);
    free(ub);
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

/* round_fmt for a float32 x, in float32 arithmetic (sixteen lanes a vector where the double form
 * has eight), the same value bit for bit where round_fmt32_ok: x 2^-qe is exact in float32 (a
 * power-of-two scaling that stays within the normal range, or that shifts a subnormal up), rintf
 * rounds that same value to the same integer, and the integer times 2^qe is the format's value,
 * exact, or beyond float32 only where the clamps and the overflow test replace it all the same.
 * It needs 2^qe and 2^-qe normal floats for every exponent: emin - mbits >= -126 and
 * mbits >= 2 (qe <= 126; inf and NaN, e = 128, are replaced by the selects), and fmax and ovf far
 * below float32's range: e4m3, e5m2 and fp16 (bf16 keeps the double form). */
static inline int round_fmt32_ok(int mbits, int emin, double fmax, double ovf, int sat) {
    return mbits >= 2 && emin - mbits >= -126 && fmax < 0x1p100 && (sat || ovf < 0x1p100);
}

static inline float round_fmt32(float x, int mbits, int emin, float fmax, float ovf, int sat) {
    uint32_t bits;
    memcpy(&bits, &x, 4);
    int32_t e = (int32_t)((bits >> 23) & 0xff) - 127; /* floor(log2|x|) for normal x; -127 for 0, subnormals */
    int32_t qe = (e > emin ? e : emin) - mbits;
    qe = qe > 126 ? 126 : qe; /* only inf and NaN reach it */
    float y = __builtin_rintf(x * pow2f(-qe)) * pow2f(qe);
    float a = __builtin_fabsf(x);
    float lim = sat ? fmax : INFINITY;
    y = y > lim ? lim : y;
    y = y < -lim ? -lim : y;
    y = (!sat & (a >= ovf)) ? __builtin_copysignf(INFINITY, x) : y;
    return x != x ? x : y;
}

void fa3n_round_f64(int64_t n, const double *restrict x, float *restrict out, int mbits, int emin, double fmax,
                    double ovf, int sat, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t i = 0; i < n; i++) out[i] = (float)round_fmt(x[i], mbits, emin, fmax, ovf, sat);
}

/* float64 x divided by a per-row float32 descale, then rounded to a narrow format: what
 * quant._scaled_cast computes as cast(x.double() / d.double(), f) (the same IEEE division, the same
 * single rounding) in one pass, without the whole-tensor float64 quotient. rows x d values, row
 * r divided by desc[r] (desc NULL: by one descale, scalar). */
void fa3n_scaled_round_f64(int64_t rows, int64_t d, const double *restrict x, const float *restrict desc,
                           double scalar, float *restrict out, int mbits, int emin, double fmax, double ovf, int sat,
                           int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t r = 0; r < rows; r++) {
        const double dv = desc ? (double)desc[r] : scalar;
        const double *xr = x + r * d;
        float *o = out + r * d;
        for (int64_t j = 0; j < d; j++) o[j] = (float)round_fmt(xr[j] / dv, mbits, emin, fmax, ovf, sat);
    }
}

/* max |x| of each row of d float64 values (the infinity norm): NaN where the row holds one, as
 * torch.linalg.vector_norm(ord=inf) gives; a max is exact in any order. */
void fa3n_row_absmax(int64_t rows, int64_t d, const double *restrict x, double *restrict out, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t r = 0; r < rows; r++) {
        const double *xr = x + r * d;
        double m8[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        int nan8[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        int64_t j = 0;
        for (; j + 8 <= d; j += 8)
            for (int u = 0; u < 8; u++) {
                const double a = __builtin_fabs(xr[j + u]);
                nan8[u] |= a != a;
                m8[u] = a > m8[u] ? a : m8[u];
            }
        double m = 0.0;
        int nan = 0;
        for (; j < d; j++) {
            const double a = __builtin_fabs(xr[j]);
            nan |= a != a;
            m = a > m ? a : m;
        }
        for (int u = 0; u < 8; u++) {
            nan |= nan8[u];
            m = m8[u] > m ? m8[u] : m;
        }
        out[r] = nan ? NAN : m;
    }
}

void fa3n_round_f32(int64_t n, const float *x, float *out, int mbits, int emin, double fmax, double ovf, int sat,
                    int nthreads) {
    /* float32 -> a narrower format, ties to even (out may alias x) */
    if (round_fmt32_ok(mbits, emin, fmax, ovf, sat)) {
        const float f32max = (float)fmax, f32ovf = (float)ovf;
#pragma omp parallel for schedule(static) num_threads(nthreads)
        for (int64_t i = 0; i < n; i++) out[i] = round_fmt32(x[i], mbits, emin, f32max, f32ovf, sat);
        return;
    }
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
    const int fast_round = round_fmt32_ok(mbits, emin, fmax, ovf, sat);
    const float f32max = (float)fmax, f32ovf = (float)ovf;
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
#ifdef __AVX2__
            /* gcc leaves the loop below scalar (the NaN flags); vmaxps(v, m) is v > m ? v : m, lane
             * for lane the same selects, so the eight maxima are the same bits */
            {
                __m256 vm = _mm256_set1_ps(-INFINITY), vn = _mm256_setzero_ps();
                for (; c + 8 <= nv; c += 8) {
                    const __m256 v = _mm256_loadu_ps(row + c);
                    vn = _mm256_or_ps(vn, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
                    vm = _mm256_max_ps(v, vm);
                }
                _mm256_storeu_ps(mx8, vm);
                const int nm = _mm256_movemask_ps(vn);
                for (int u = 0; u < 8; u++) nan8[u] = (nm >> u) & 1;
            }
#endif
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
            /* Thread t of the quad adds columns 8j + 2t, then 8j + 2t + 1, for j = 0, 1, ...: the
             * four chains run side by side (each keeps its own order, so the sums are the same
             * bits) instead of one after another, which left the adder waiting on each sum's
             * latency. Non-negative normal addends: no sum here is ever subnormal, so no flush. */
            float a0 = flush32(t4[0] * resc, ftz), a1 = flush32(t4[1] * resc, ftz);
            float a2 = flush32(t4[2] * resc, ftz), a3 = flush32(t4[3] * resc, ftz);
            int64_t c8 = 0;
            for (; c8 + 8 <= N; c8 += 8) {
                const float *p8 = row + c8;
                a0 = a0 + p8[0];
                a1 = a1 + p8[2];
                a2 = a2 + p8[4];
                a3 = a3 + p8[6];
                a0 = a0 + p8[1];
                a1 = a1 + p8[3];
                a2 = a2 + p8[5];
                a3 = a3 + p8[7];
            }
            float a4[4] = {a0, a1, a2, a3};
            for (int t = 0; t < 4; t++) { /* the last, partial group of eight columns */
                const int64_t c0 = c8 + 2 * t;
                if (c0 < N) a4[t] = a4[t] + row[c0];
                if (c0 + 1 < N) a4[t] = a4[t] + row[c0 + 1];
                t4[t] = a4[t];
            }
            if (fmt_kind && fast_round)
                for (int64_t c = 0; c < N; c++) row[c] = round_fmt32(row[c], mbits, emin, f32max, f32ovf, sat);
            else if (fmt_kind)
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
        if (s == 1.0f) {
            /* x * 1 is x (NaN, inf and -0 included): once a row's max has settled (most rows of
             * most tiles) only the flush of a subnormal could change it, so the row is read, and
             * written only if it holds one */
            if (!ftz) continue;
            int sub = 0;
            for (int64_t j = 0; j < d; j++) sub |= (a[j] != 0.0f) & (__builtin_fabsf(a[j]) < 0x1p-126f);
            if (!sub) continue;
        }
        for (int64_t j = 0; j < d; j++) a[j] = flush32(a[j] * s, ftz);
    }
}

/* ---- |x| statistics of an input tensor in one pass: histogram over sorted edges, amax, and
 * the count of non-finite values (NaN/Inf are left out of the histogram and amax). Bin b
 * holds edges[b] <= |x| < edges[b+1]; the last bin is open above, as torch.bucketize(right=True)
 * - 1 gives. The bin comes from a table on the value's top bits (its exponent and ABS_KEY_BITS
 * bits of mantissa: ranges of values less than 2^(1/16) wide): the bin of the range's smallest
 * value, and how many edges lie inside the range; with none the bin is that one, with one a single
 * comparison decides, with more a binary search (exact at the edges, in every case). ---- */
#define ABS_KEY_BITS 4
#define ABS_KEYS (1 << (11 + ABS_KEY_BITS))
static int abs_bin_search(double a, const double *pad, int pw) {
    int lo = 0; /* pad[lo] <= a (pad[0] = edges[0] <= |x| by contract) */
    for (int step = pw >> 1; step > 0; step >>= 1) lo += (a >= pad[lo + step]) ? step : 0;
    return lo;
}

void fa3n_abs_stats(int64_t n, const double *restrict x, const double *restrict edges, int nedges,
                    int64_t *restrict counts, double *restrict amax_out, int64_t *restrict nonfinite_out,
                    int nthreads) {
    int64_t nonfinite = 0;
    double amax = 0.0;
    /* edges padded with +inf to a power of two: a branch-free binary search (no mispredicts) */
    int pw = 1;
    while (pw < nedges) pw <<= 1;
    double *pad = (double *)malloc(sizeof(double) * (size_t)(pw + 1));
    for (int b = 0; b <= pw; b++) pad[b] = b < nedges ? edges[b] : INFINITY;
    /* per key: the bin of the range's first value (int32) and the count of edges above it within
     * the range, capped at 2 (uint8) */
    int32_t *start = (int32_t *)malloc(sizeof(int32_t) * ABS_KEYS);
    uint8_t *inside = (uint8_t *)malloc(ABS_KEYS);
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int k = 0; k < ABS_KEYS; k++) {
        uint64_t lo_bits = (uint64_t)k << (52 - ABS_KEY_BITS), hi_bits = (uint64_t)(k + 1) << (52 - ABS_KEY_BITS);
        double lo, hi; /* the range is [lo, hi); hi is the next range's first value (inf or NaN at the top) */
        memcpy(&lo, &lo_bits, 8);
        memcpy(&hi, &hi_bits, 8);
        const int b = abs_bin_search(lo, pad, pw);
        int c = 0;
        for (int e = b + 1; e < nedges && c < 2; e++) {
            if (!(edges[e] < hi) && hi == hi) break; /* at or beyond the range's end */
            c++;
        }
        start[k] = b;
        inside[k] = (uint8_t)c;
    }
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
            uint64_t bits;
            memcpy(&bits, &a, 8);
            const int k = (int)(bits >> (52 - ABS_KEY_BITS));
            int lo = start[k];
            const int c = inside[k];
            if (c == 1)
                lo += a >= pad[lo + 1];
            else if (c > 1)
                lo = abs_bin_search(a, pad, pw);
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
    free(start);
    free(inside);
    free(pad);
    *amax_out = amax;
    *nonfinite_out = nonfinite;
}

/* ---- torch.randn's Box-Muller transform, float64 on the CPU ----
 * For a contiguous float64 tensor of at least 16 elements, torch's CPU normal_ (normal_fill in
 * ATen's DistributionTemplates.h) first draws a uniform in [0, 1) per element from the
 * generator, then maps each block of 16 in place: for j < 8, u1 = 1 - d[j], u2 = d[j + 8],
 * r = sqrt(-2 log u1), d[j] = r cos(2 pi u2) std + mean, d[j + 8] = r sin(2 pi u2) std + mean.
 * The uniforms come from torch (torch.rand draws the same ones); this is the map, with the same
 * libm calls in the same order, hence the same bits, and the blocks shared among threads
 * (torch runs it on one). native.randn checks the bits against torch.randn before first use. */
void fa3n_box_muller16(int64_t blocks, double *restrict d, double mean, double sd, int nthreads) {
    const double two_pi = 2.0 * 3.14159265358979323846; /* c10::pi<double>, doubled: exact */
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t b = 0; b < blocks; b++) {
        double *x = d + b * 16;
        for (int j = 0; j < 8; j++) {
            const double u1 = 1.0 - x[j];
            const double u2 = x[j + 8];
            const double radius = sqrt(-2.0 * log(u1));
            const double theta = two_pi * u2;
            x[j] = radius * cos(theta) * sd + mean;
            x[j + 8] = radius * sin(theta) * sd + mean;
        }
    }
}

/* ---- torch.rand(n, dtype=float64) on the CPU: the same draws from the same generator ----
 *
 * torch's CPU generator is MT19937 (ATen/core/MT19937RNGEngine.h: Cokus's form, the state
 * refreshed when `--left` reaches 0). A float64 uniform takes two 32-bit draws, the first the
 * high word (CPUGeneratorImpl::random64), keeps the low 53 bits and scales them by 2^-53
 * (transformation::uniform_real; `* (1 - 0) + 0` changes nothing). torch computes them one at a
 * time through a kernel that calls the generator per element (~25 ns a value here); the same
 * recurrence inline is ~2 ns. state: the 624 words; left, next: the engine's counters, updated.
 * native.randn checks the bits and the generator's state after against torch before first use. */
#define MT_N 624
#define MT_M 397
static inline uint32_t mt_twist(uint32_t u, uint32_t v) {
    return (((u & 0x80000000u) | (v & 0x7fffffffu)) >> 1) ^ ((v & 1u) ? 0x9908b0dfu : 0u);
}

static void mt_refresh(uint32_t *st) {
    uint32_t *p = st;
    for (int j = MT_N - MT_M + 1; --j; p++) *p = p[MT_M] ^ mt_twist(p[0], p[1]);
    for (int j = MT_M; --j; p++) *p = p[MT_M - MT_N] ^ mt_twist(p[0], p[1]);
    *p = p[MT_M - MT_N] ^ mt_twist(p[0], st[0]);
}

static inline double mt_u53(uint64_t hi, uint64_t lo) {
    return (double)(((hi << 32) | lo) & ((UINT64_C(1) << 53) - 1)) * 0x1p-53;
}

/* The words are tempered a run at a time (every word the state holds before its next refresh) and
 * then paired, so both loops vectorise; a double whose two words straddle a refresh takes its high
 * word from the run before. After a refresh `left` is 625 - (words read since), `next` the words
 * read: what the engine holds after the same draws one at a time. */
void fa3n_mt_uniform64(uint32_t *restrict st, int32_t *restrict left, uint32_t *restrict next, int64_t n,
                       double *restrict out) {
    int64_t l = *left, nx = *next, i = 0;
    uint32_t buf[MT_N];
    int have_hi = 0;
    uint64_t hi = 0;
    while (i < n) {
        if (l == 1) { /* the engine's `--left == 0`: refresh before the next word */
            mt_refresh(st);
            l = MT_N + 1;
            nx = 0;
        }
        const int64_t need = 2 * (n - i) - have_hi;
        const int64_t k = need < l - 1 ? need : l - 1;
        for (int64_t j = 0; j < k; j++) {
            uint32_t y = st[nx + j];
            y ^= (y >> 11);
            y ^= (y << 7) & 0x9d2c5680u;
            y ^= (y << 15) & 0xefc60000u;
            y ^= (y >> 18);
            buf[j] = y;
        }
        int64_t j = 0;
        if (have_hi) {
            out[i++] = mt_u53(hi, buf[0]);
            j = 1;
            have_hi = 0;
        }
        const int64_t pairs = (k - j) / 2;
        for (int64_t q = 0; q < pairs; q++) out[i + q] = mt_u53(buf[j + 2 * q], buf[j + 2 * q + 1]);
        i += pairs;
        j += 2 * pairs;
        if (j < k) {
            hi = buf[j];
            have_hi = 1;
        }
        l -= k;
        nx += k;
    }
    *left = (int32_t)l;
    *next = (uint32_t)nx;
}

/* ---- the tensor-core model for any finite float32 operands, in double ----
 *
 * What numerics/mma.py's hopper_fp8_mma_reference computes, for operands outside the float form's
 * exact domain above (more than 12 significant bits: a per-token V descale multiplied into FP8 V,
 * say), where the caller used to run the PyTorch reference. The same steps in the same arithmetic:
 * E(x) = floor(log2|x|) clamped at the format's smallest normal exponent; per k-step emax over
 * non-zero products of E(a) + E(b), and E(C) (unclamped) when C != 0; a b is exact in double (at
 * most 48 significant bits), a b 2^(bits - emax) too (a power of two, far from double's range
 * ends), its truncation is below 2^15, and a step's sum of them (and of C's) is an exact integer in
 * double in any order; it is truncated to final_bits after its leading bit and rounded once to
 * float32, as the reference's .to(torch.float32). The sum starts from +0, as torch's does, so a
 * zero result has the reference's sign. Returns 1 for a non-finite operand (the reference
 * propagates those), 0 otherwise. */
#define GEN_ZERO_EXP (-100000)
static inline int exp_of(double x) {
    int e;
    frexp(x, &e);
    return e - 1;
}

int fa3n_mma_model_f64(int64_t L, int64_t M, int64_t K, int64_t N, const float *a, const int64_t *as, const float *b,
                       const int64_t *bs, const float *c, const int64_t *cs, float *out, int a_min_exp, int b_min_exp,
                       int k_step, int bits, int final_bits, int nthreads) {
    if (L <= 0 || M <= 0 || N <= 0) return 0;
    if (K <= 0 || k_step <= 0) return 1;
    int bad = 0;
#pragma omp parallel num_threads(nthreads) reduction(| : bad)
    {
        double *bt = (double *)malloc(sizeof(double) * (size_t)(N * K));
        int *ebt = (int *)malloc(sizeof(int) * (size_t)(N * K));
        double *ar = (double *)malloc(sizeof(double) * (size_t)K);
        int *ear = (int *)malloc(sizeof(int) * (size_t)K);
        if (!bt || !ebt || !ar || !ear) bad |= 2;
        int64_t last_l = -1;
#pragma omp for collapse(2) schedule(static)
        for (int64_t l = 0; l < L; l++)
            for (int64_t i = 0; i < M; i++) {
                if (bad) continue;
                if (l != last_l) { /* B of this l, transposed to [N][K], and its clamped exponents */
                    for (int64_t kk = 0; kk < K; kk++)
                        for (int64_t j = 0; j < N; j++) {
                            const double x = b[l * bs[0] + kk * bs[1] + j * bs[2]];
                            if (!isfinite(x)) bad |= 1;
                            bt[j * K + kk] = x;
                            const int e = exp_of(x);
                            ebt[j * K + kk] = x == 0.0 ? GEN_ZERO_EXP : (e < b_min_exp ? b_min_exp : e);
                        }
                    last_l = l;
                }
                int row_zero = 1;
                for (int64_t kk = 0; kk < K; kk++) {
                    const double x = a[l * as[0] + i * as[1] + kk * as[2]];
                    if (!isfinite(x)) bad |= 1;
                    row_zero &= x == 0.0;
                    ar[kk] = x;
                    const int e = exp_of(x);
                    ear[kk] = x == 0.0 ? GEN_ZERO_EXP : (e < a_min_exp ? a_min_exp : e);
                }
                for (int64_t j = 0; j < N; j++) {
                    const double *bj = bt + j * K;
                    const int *ej = ebt + j * K;
                    float acc = c ? c[l * cs[0] + i * cs[1] + j * cs[2]] : 0.0f;
                    if (c && !isfinite(acc)) bad |= 1;
                    if (row_zero && acc == 0.0f) { /* no live step: +0, as every step gives (a causal P row before its keys) */
                        out[l * N * M + i * N + j] = 0.0f;
                        continue;
                    }
                    int has_acc = c != NULL;
                    for (int64_t k0 = 0; k0 < K; k0 += k_step) {
                        const int64_t k1 = k0 + k_step < K ? k0 + k_step : K;
                        /* a zero operand's exponent code keeps its sum below every real one (>= -400) */
                        int emax = 2 * GEN_ZERO_EXP;
#pragma omp simd reduction(max : emax)
                        for (int64_t kk = k0; kk < k1; kk++) {
                            const int e = ear[kk] + ej[kk];
                            emax = e > emax ? e : emax;
                        }
                        int live = emax > GEN_ZERO_EXP / 2;
                        if (has_acc && acc != 0.0f) {
                            const int e = exp_of((double)acc);
                            if (!live || e > emax) emax = e;
                            live = 1;
                        }
                        double d = 0.0;
                        if (live) {
                            const double inv = ldexp(1.0, bits - emax);
                            /* exact integers below 2^21 in all: any order of the sum gives the same value */
                            double total = 0.0;
#pragma omp simd reduction(+ : total)
                            for (int64_t kk = k0; kk < k1; kk++) total += trunc(ar[kk] * bj[kk] * inv);
                            if (has_acc) total = total + trunc((double)acc * inv);
                            d = total / inv;
                            if (d != 0.0) {
                                const double q = ldexp(1.0, exp_of(d) - final_bits);
                                d = trunc(d / q) * q;
                            }
                        }
                        acc = (float)d;
                        has_acc = 1;
                    }
                    out[l * N * M + i * N + j] = acc;
                }
            }
        free(bt);
        free(ebt);
        free(ar);
        free(ear);
    }
    return bad & 2 ? 2 : (bad ? 1 : 0);
}

/* ---- the H200's ex2/lg2/rcp.approx.ftz.f32 (numerics/sfu.py: the same reductions over the same
 * measured tables; op 0 ex2 with the joined [x >= 0 | x < 0] table, 1 lg2 with [e >= 0 | e < 0],
 * 2 rcp). Bits in, bits out: no float compare sees a subnormal, whatever the FPU's DAZ mode. */
void fa3n_sfu(int64_t n, const uint32_t *x, uint32_t *y, const int32_t *table, int op, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t i = 0; i < n; i++) {
        const uint32_t b = x[i];
        const int32_t e = (int32_t)((b >> 23) & 0xff) - 127;
        const uint32_t mant = b & 0x7fffff;
        const uint32_t neg = b >> 31;
        uint32_t out;
        if (e == 128 && mant) {
            out = 0x7fffffffu; /* NaN in: the unit's canonical NaN */
        } else if (op == 0) {
            float ax;
            uint32_t ab = b & 0x7fffffffu;
            memcpy(&ax, &ab, 4);
            if (e == -127) ax = 0.0f;
            if (ax > 200.0f) ax = 200.0f; /* saturated either way */
            const int32_t X = (int32_t)(ax * 8388608.0f); /* exact, truncated toward zero */
            const int32_t m = -(int32_t)neg;
            const int32_t s = ((X >> 23) ^ m) - m;
            const int32_t t = table[(X & 0x7fffff) | (m & (1 << 23))];
            const int32_t ef = (t >> 23) + s;
            out = ef <= 0 ? 0u : ef >= 255 ? 0x7f800000u : (uint32_t)(t + (s << 23));
        } else if (op == 1) {
            if (e == -127) out = 0xff800000u;            /* +-0, subnormals */
            else if (neg) out = 0x7fffffffu;             /* x < 0, -inf */
            else if (e == 128) out = 0x7f800000u;        /* +inf */
            else {
                const int lo = e < 0;
                float t;
                const int32_t tb = table[mant | ((uint32_t)lo << 23)];
                memcpy(&t, &tb, 4);
                const double v = (double)(e + lo) + (double)t; /* exact */
                float r = (float)v;
                uint32_t rb;
                memcpy(&rb, &r, 4);
                if (fabs((double)r) > fabs(v)) rb -= 1; /* toward zero */
                out = rb;
            }
        } else {
            const uint32_t sign = b & 0x80000000u;
            if (e == -127) out = sign | 0x7f800000u;
            else {
                const int32_t r = table[mant];
                const int32_t ef = ((r >> 23) & 0xff) - e;
                out = ef <= 0 ? sign : ((uint32_t)(r - (e << 23)) | sign);
            }
        }
        y[i] = out;
    }
}

/* ex2 again, from the packed form instead of the 64 MB table: the entry at fraction F is the
 * cubic base of its 1/64 segment (Horner in double with the same operations as sfu.base_table,
 * so the same bits) plus a 2-bit code (0: +0, 1: +1 ulp, 2: -1 ulp) from a 2 MB array that stays
 * in cache, where the big table's random reads miss it at every element. */
static inline int32_t sfu_ex2_entry(uint32_t F, const double *coef, const uint8_t *pk) {
    const double *c = coef + 4 * (F >> 17);
    const double u = (double)(F & 0x1ffff) / 131072.0;
    double acc = c[3];
    acc = acc * u + c[2];
    acc = acc * u + c[1];
    acc = acc * u + c[0];
    const float f = (float)acc;
    int32_t b;
    memcpy(&b, &f, 4);
    const uint32_t code = (pk[F >> 2] >> ((F & 3) * 2)) & 3;
    return b + (code == 1) - (code == 2);
}

void fa3n_sfu_ex2_packed(int64_t n, const uint32_t *x, uint32_t *y, const double *coef, const uint8_t *pk,
                         int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t i = 0; i < n; i++) {
        const uint32_t b = x[i];
        const int32_t e = (int32_t)((b >> 23) & 0xff) - 127;
        uint32_t out;
        if (e == 128 && (b & 0x7fffff)) {
            out = 0x7fffffffu;
        } else {
            float ax;
            const uint32_t ab = b & 0x7fffffffu;
            memcpy(&ax, &ab, 4);
            if (e == -127) ax = 0.0f;
            if (ax > 200.0f) ax = 200.0f;
            const int32_t X = (int32_t)(ax * 8388608.0f);
            const uint32_t F = (uint32_t)X & 0x7fffff;
            int32_t s, t;
            if (b >> 31) {
                s = -(X >> 23);
                t = F ? sfu_ex2_entry(0x7fffff - F, coef, pk) - (1 << 23) : (127 << 23);
            } else {
                s = X >> 23;
                t = sfu_ex2_entry(F, coef, pk);
            }
            const int32_t ef = (t >> 23) + s;
            out = ef <= 0 ? 0u : ef >= 255 ? 0x7f800000u : (uint32_t)(t + (s << 23));
        }
        y[i] = out;
    }
}
