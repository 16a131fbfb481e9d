/* Helpers shared by the c_tests programs: checks that print file:line and exit 1, a
 * reproducible RNG, bf16/f16 conversions written independently of the library, typed
 * buffers, status checks and the Adam and session step calls the tests share.
 *
 * Everything is `static inline` so that a test uses what it needs without -Wunused
 * warnings. The code is the common subset of C11 and C++17: every test built from a .c
 * file is compiled as both.
 */
#ifndef SO_TEST_H
#define SO_TEST_H

#undef NDEBUG
#include <assert.h>
#include <math.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "superoffload.h"

/* ------------------------------------------------------------------------------ checks */

#define CHECK(cond)                                                                  \
    do {                                                                             \
        if (!(cond)) {                                                               \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
            so_test_dump_last_error();                                               \
            exit(1);                                                                 \
        }                                                                            \
    } while (0)

/* CHECK with a printf-style explanation (at least the format string). */
#define CHECKF(cond, ...)                                                            \
    do {                                                                             \
        if (!(cond)) {                                                               \
            fprintf(stderr, "%s:%d: CHECK failed: %s: ", __FILE__, __LINE__, #cond); \
            fprintf(stderr, __VA_ARGS__);                                            \
            fputc('\n', stderr);                                                     \
            so_test_dump_last_error();                                               \
            exit(1);                                                                 \
        }                                                                            \
    } while (0)

/* A call that must return SO_STATUS_OK. */
#define CHECK_OK(expr) CHECK_STATUS((expr), SO_STATUS_OK)

/* A call that must return `want`. */
#define CHECK_STATUS(expr, want)                                                                               \
    do {                                                                                                       \
        so_status got_status_ = (expr);                                                                        \
        if (got_status_ != (want)) {                                                                           \
            fprintf(stderr, "%s:%d: %s returned %u (%s), expected %u (%s)\n", __FILE__, __LINE__, #expr,       \
                    (unsigned)got_status_, so_status_str(got_status_), (unsigned)(want), so_status_str(want)); \
            so_test_dump_last_error();                                                                         \
            exit(1);                                                                                           \
        }                                                                                                      \
    } while (0)

static inline void so_test_dump_last_error(void) {
    char msg[1024];
    if (so_last_error_message(msg, sizeof msg) > 0) {
        fprintf(stderr, "  so_last_error_message: %s\n", msg);
    }
}

/* The thread's last error message (truncated to 1023 bytes). */
static inline const char *so_test_last_error(void) {
    static char msg[1024];
    so_last_error_message(msg, sizeof msg);
    return msg;
}

static inline void *so_test_malloc(size_t bytes) {
    void *p = malloc(bytes ? bytes : 1);
    CHECK(p != NULL);
    return p;
}

static inline void *so_test_dup(const void *src, size_t bytes) {
    void *p = so_test_malloc(bytes);
    if (bytes) memcpy(p, src, bytes);
    return p;
}

/* -------------------------------------------------------------------------------- RNG */

/* splitmix64 stepping plus a multiply-xorshift output: reproducible on every platform. */
typedef struct so_rng {
    uint64_t state;
} so_rng;

static inline so_rng so_rng_new(uint64_t seed) {
    so_rng r;
    r.state = seed * 0x2545F4914F6CDD1DULL + 0x9E3779B97F4A7C15ULL;
    return r;
}

static inline uint64_t so_rng_u64(so_rng *r) {
    uint64_t z = (r->state += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

/* Uniform in [0, 1). */
static inline double so_rng_unit(so_rng *r) { return (double)(so_rng_u64(r) >> 11) * 0x1p-53; }

static inline double so_rng_range(so_rng *r, double lo, double hi) { return lo + (hi - lo) * so_rng_unit(r); }

/* exp(uniform(log lo, log hi)). */
static inline double so_rng_log_range(so_rng *r, double lo, double hi) {
    return exp(so_rng_range(r, log(lo), log(hi)));
}

static inline size_t so_rng_below(so_rng *r, size_t n) { return (size_t)(so_rng_u64(r) % (uint64_t)n); }

/* Roughly normal with standard deviation ~scale; one value in 16 gets a much wider
 * (or narrower) exponent, so that magnitudes spread over many binades. */
static inline double so_rng_normalish(so_rng *r, double scale) {
    double x = so_rng_unit(r) + so_rng_unit(r) + so_rng_unit(r) + so_rng_unit(r) - 2.0;
    if (so_rng_below(r, 16) == 0) x *= ldexp(1.0, (int)so_rng_range(r, -14.0, 6.0));
    return x * scale * 1.7;
}

/* --------------------------------------------------------------- bf16 / f16 conversions */

/* The library's own conversions are not used: these are written from the definitions.
 * bf16 is the upper half of a binary32 (load: bits << 16); f16 is IEEE binary16. Stores
 * round to nearest, ties to even. NaN inputs are not used with these (tests keep NaNs in
 * f32 buffers). */

static inline float so_bits_to_f32(uint32_t bits) {
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint32_t so_f32_to_bits(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    return bits;
}

static inline float so_bf16_to_f32(uint16_t h) { return so_bits_to_f32((uint32_t)h << 16); }

/* Round a float to the nearest value with `sig` significant bits (ties to even), with
 * the smallest exponent `min_exp` (values below 2^min_exp are rounded on the subnormal
 * grid 2^(min_exp - sig + 1)), in double arithmetic: nearbyint rounds ties to even. */
static inline double so_round_to_precision(double x, int sig, int min_exp) {
    if (x == 0.0 || !isfinite(x)) return x;
    int e;
    frexp(fabs(x), &e); /* |x| = f * 2^e, f in [0.5, 1): the leading bit is 2^(e-1) */
    int lead = e - 1;
    if (lead < min_exp) lead = min_exp;
    int quantum = lead - (sig - 1);
    return ldexp(nearbyint(ldexp(x, -quantum)), quantum);
}

static inline uint16_t so_f32_to_bf16(float f) {
    /* bf16: 8 significant bits, the exponent range of binary32 (min normal 2^-126). */
    double r = so_round_to_precision((double)f, 8, -126);
    if (fabs(r) > 0x1.fffffep127) r = r > 0 ? INFINITY : -INFINITY; /* overflow */
    uint32_t bits = so_f32_to_bits((float)r);                       /* exact: r has 8 significant bits */
    assert((bits & 0xFFFFu) == 0);
    return (uint16_t)(bits >> 16);
}

static inline float so_f16_to_f32(uint16_t h) {
    int sign = (h >> 15) & 1;
    int exp = (h >> 10) & 0x1F;
    int mant = h & 0x3FF;
    double v;
    if (exp == 0) {
        v = ldexp((double)mant, -24);
    } else if (exp == 31) {
        v = mant ? NAN : INFINITY;
    } else {
        v = ldexp((double)(1024 + mant), exp - 25);
    }
    return (float)(sign ? -v : v);
}

static inline uint16_t so_f32_to_f16(float f) {
    uint16_t sign = (so_f32_to_bits(f) >> 31) ? 0x8000 : 0;
    double a = fabs((double)f);
    if (isnan(a)) return (uint16_t)(sign | 0x7E00);
    /* f16: 11 significant bits, min normal 2^-14, max finite 65504. */
    double r = so_round_to_precision(a, 11, -14);
    if (r > 65504.0) return (uint16_t)(sign | 0x7C00);
    if (r < 0x1p-14) return (uint16_t)(sign | (uint16_t)ldexp(r, 24)); /* subnormal or 0 */
    int e;
    double m = frexp(r, &e); /* r = m * 2^e, m in [0.5, 1) */
    int biased = e - 1 + 15;
    int mant = (int)ldexp(m, 11) - 1024;
    return (uint16_t)(sign | (uint16_t)(biased << 10) | (uint16_t)mant);
}

/* ----------------------------------------------------------------------- typed buffers */

static inline size_t so_dtype_size(uint32_t dtype) { return dtype == SO_DTYPE_F32 ? 4 : 2; }

static inline const char *so_dtype_name(uint32_t dtype) {
    switch (dtype) {
    case SO_DTYPE_NONE: return "none";
    case SO_DTYPE_F32: return "f32";
    case SO_DTYPE_BF16: return "bf16";
    case SO_DTYPE_F16: return "f16";
    default: return "?";
    }
}

/* The raw bits of element i (for bit-exact comparisons). */
static inline uint32_t so_raw(const void *buf, uint32_t dtype, size_t i) {
    const unsigned char *b = (const unsigned char *)buf;
    if (dtype == SO_DTYPE_F32) {
        uint32_t u;
        memcpy(&u, b + 4 * i, 4);
        return u;
    }
    uint16_t h;
    memcpy(&h, b + 2 * i, 2);
    return h;
}

/* Element i as the kernels load it (exactly, into f32). */
static inline float so_load(const void *buf, uint32_t dtype, size_t i) {
    uint32_t bits = so_raw(buf, dtype, i);
    if (dtype == SO_DTYPE_F32) return so_bits_to_f32(bits);
    return dtype == SO_DTYPE_BF16 ? so_bf16_to_f32((uint16_t)bits) : so_f16_to_f32((uint16_t)bits);
}

/* Stores x (first rounded to f32) as element i, rounding to nearest even. */
static inline void so_store(void *buf, uint32_t dtype, size_t i, double x) {
    unsigned char *b = (unsigned char *)buf;
    float f = (float)x;
    if (dtype == SO_DTYPE_F32) {
        memcpy(b + 4 * i, &f, 4);
        return;
    }
    uint16_t h = dtype == SO_DTYPE_BF16 ? so_f32_to_bf16(f) : so_f32_to_f16(f);
    memcpy(b + 2 * i, &h, 2);
}

/* Half an ulp of the storage type at x: what rounding x to `dtype` may add. */
static inline double so_store_halfulp(uint32_t dtype, double x) {
    double a = fabs(x);
    switch (dtype) {
    case SO_DTYPE_BF16: return a * 0x1p-8 + 0x1p-134;
    case SO_DTYPE_F16: return fmax(a * 0x1p-11, 0x1p-25);
    default: return 0.0;
    }
}

/* ------------------------------------------------------------------------------- steps */

/* Plain Adam buffers over (param, grad, exp_avg, exp_avg_sq), f32 and without a copy-out
 * unless the caller sets the dtype fields after. */
static inline so_adam_buffers so_test_adam_buffers(size_t numel, void *param, const void *grad, void *exp_avg,
                                                   void *exp_avg_sq) {
    so_adam_buffers b = so_adam_buffers_default();
    b.numel = numel;
    b.param = param;
    b.grad = grad;
    b.exp_avg = exp_avg;
    b.exp_avg_sq = exp_avg_sq;
    return b;
}

/* One so_adam_update of `b` with the gradient times `grad_scale`, which must succeed; the
 * gradient's sum of squares goes to `sumsq` unless it is NULL. */
static inline void so_test_adam_step(const so_pool *pool, const so_adam_hparams *hp, const so_adam_buffers *b,
                                     float grad_scale, double *sumsq) {
    so_update_options o = so_update_options_default();
    o.grad_scale = grad_scale;
    CHECK_OK(so_adam_update(pool, hp, b, &o, sumsq));
}

/* The result of the session step `t`, waiting for it. */
static inline so_step_result so_test_step_result(so_session *s, so_ticket t) {
    so_step_result r;
    memset(&r, 0, sizeof r);
    r.struct_size = sizeof r;
    CHECK_OK(so_session_step_result(s, t, -1, &r));
    return r;
}

/* --------------------------------------------------------------------------- the ISAs */

#define SO_TEST_NUM_ISAS 3

/* The instruction sets a pool can be created with, widest last. */
static inline uint32_t so_test_isa(int i) {
    return i == 0 ? (uint32_t)SO_ISA_PORTABLE : i == 1 ? (uint32_t)SO_ISA_AVX2 : (uint32_t)SO_ISA_AVX512;
}

/* Creates a pool for `isa` with `threads` threads (0: default); returns NULL, with a note
 * on stdout, when the CPU lacks the instruction set. */
static inline so_pool *so_test_pool(uint32_t isa, size_t threads) {
    so_pool_options o = so_pool_options_default();
    o.isa = isa;
    o.num_threads = threads;
    so_pool *pool = NULL;
    so_status st = so_pool_create(&o, &pool);
    if (st == SO_STATUS_UNSUPPORTED) {
        printf("note: ISA %s is not supported by this CPU: skipped (%s)\n", so_isa_name(isa), so_test_last_error());
        return NULL;
    }
    CHECK_OK(st);
    CHECK(pool != NULL);
    return pool;
}

#endif /* SO_TEST_H */
