/* so_adam_update against a double-precision reference written here, element by element,
 * for every dtype combination: param {f32,bf16,f16} x grad {f32,bf16,f16} x moments
 * {f32,bf16} x copy-out {none,bf16,f16}, AdamW and Adam-L2, bias correction on and off,
 * weight decay 0 and > 0, grad_scale 1 and != 1, steps 1, 2 and 1000, random
 * hyperparameters, warm and cold moments, lengths that are not multiples of the vector
 * width, on every instruction set the CPU has (and two thread counts).
 *
 * Also checked: the copy-out is exactly the round-to-nearest-even of the stored
 * parameter; the gradient is not written; out_grad_sumsq matches a double sum; results are
 * bit-identical across instruction sets and thread counts.
 *
 * The error bound. The reference loads every input exactly as the kernel does and
 * evaluates the documented formula in double (bc1 and bc2 rounded once to float, as
 * documented). Alongside each intermediate value x it carries e(x), a first-order bound of
 * how far the kernel's f32 value of x can be from it: every f32 operation contributes
 * u*|its result| (u = 2^-24, one rounding to nearest), and the errors of its operands
 * enter through the operation's sensitivity (|a|e(b) + |b|e(a) for a product, e(a)/(2
 * sqrt(a)) for a square root, ...). For a plain sum of terms this is exactly "u times the
 * sum of the magnitudes of the terms forming the value"; through the division by the
 * denominator it is that sum's image. The check is
 *     |got - ref| <= K * e + (half an ulp of the storage dtype at the value)
 * with K = 2 (headroom for the neglected second-order terms), plus half an ulp of bf16
 * (2^-8 relative) or f16 (2^-11 relative, at least 2^-25 in the subnormal range) when the
 * value is stored in low precision: a low-precision moment or param is re-rounded on
 * store, while the rest of the step uses the f32 value.
 *
 * The bound is a few ulps. Every run also checks that it is tight enough: each of a set of
 * plausible mistakes in the formula (eps added at another place, no bias correction,
 * bc2 without the square root, the grad_scale ignored, the L2 term or AdamW's decay
 * dropped, beta1 and 1-beta1 swapped) evaluated as the reference must be rejected.
 */
#include "so_test.h"

#define K_BOUND 2.0
static const double U = 0x1p-24;

enum mutant {
    MUTANT_NONE = 0,
    MUTANT_EPS_BEFORE_BC2, /* (sqrt(v) + eps) / sqrt(bc2) */
    MUTANT_EPS_UNDER_SQRT, /* sqrt(v / bc2 + eps) */
    MUTANT_NO_BIAS_CORRECTION,
    MUTANT_BC2_WITHOUT_SQRT,
    MUTANT_NO_GRAD_SCALE,
    MUTANT_NO_L2_TERM,
    MUTANT_NO_DECAY,
    MUTANT_BETA1_SWAPPED,
    MUTANT_COUNT
};

static const char *mutant_name(int m) {
    switch (m) {
    case MUTANT_EPS_BEFORE_BC2: return "eps added before dividing by sqrt(bc2)";
    case MUTANT_EPS_UNDER_SQRT: return "eps under the square root";
    case MUTANT_NO_BIAS_CORRECTION: return "bias correction dropped";
    case MUTANT_BC2_WITHOUT_SQRT: return "bc2 instead of sqrt(bc2)";
    case MUTANT_NO_GRAD_SCALE: return "grad_scale ignored";
    case MUTANT_NO_L2_TERM: return "L2 term dropped";
    case MUTANT_NO_DECAY: return "AdamW decay dropped";
    case MUTANT_BETA1_SWAPPED: return "beta1 and 1-beta1 swapped";
    default: return "none";
    }
}

typedef struct ref_result {
    double p, m, v;    /* the exact step */
    double ep, em, ev; /* first-order bounds of the kernel's f32 rounding */
} ref_result;

/* Error of rounding the double x to f32: what the kernel's f32 constant is off by. The
 * hyperparameters may be doubles (every per-call constant is derived in double and rounded
 * once to f32: b1, 1 - b1, b2, 1 - b2, eps, wd, lr / bc1, 1 - lr * wd, sqrt(bc2)); with
 * f32-representable inputs most of these terms are 0. */
static double f32_rounding(double x) { return fabs((double)(float)x - x); }

static ref_result reference(const so_adam_hparams *hp, float grad_scale, double p, double g, double m, double v,
                            int mutant) {
    const bool l2 = hp->mode == SO_ADAM_MODE_L2;
    const double lr = hp->lr, b1 = hp->beta1, b2 = hp->beta2, eps = hp->eps, wd = hp->weight_decay;
    const double s = mutant == MUTANT_NO_GRAD_SCALE ? 1.0 : (double)grad_scale;
    const bool bc = hp->bias_correction && mutant != MUTANT_NO_BIAS_CORRECTION;
    const double t = (double)hp->step;
    const double bc1 = bc ? (double)(float)(1.0 - pow(b1, t)) : 1.0;
    const double bc2 = bc ? (double)(float)(1.0 - pow(b2, t)) : 1.0;

    /* g <- s * g (exact when s == 1); Adam-L2: g <- g + wd * p (one fused rounding). */
    double ge = s * g;
    double e_ge = s == 1.0 ? 0.0 : U * fabs(ge);
    if (l2 && wd != 0.0 && mutant != MUTANT_NO_L2_TERM) {
        ge = wd * p + ge;
        e_ge += f32_rounding(wd) * fabs(p) + U * fabs(ge);
    }

    /* m <- b1 * m + (1 - b1) * g: the kernel's 1 - b1 is an f32 constant. */
    const double c1 = 1.0 - b1, c2 = 1.0 - b2;
    double mn, em;
    if (mutant == MUTANT_BETA1_SWAPPED) {
        mn = b1 * ge + c1 * m;
    } else {
        mn = c1 * ge + b1 * m;
    }
    em = f32_rounding(c1) * fabs(ge) + c1 * e_ge + f32_rounding(b1) * fabs(m) + U * fabs(b1 * m) + U * fabs(mn);

    /* v <- b2 * v + (1 - b2) * g^2 (all terms >= 0: no cancellation). */
    const double sq = ge * ge;
    const double e_sq = 2.0 * fabs(ge) * e_ge + U * sq;
    const double vn = c2 * sq + b2 * v;
    const double ev = f32_rounding(c2) * sq + c2 * e_sq + f32_rounding(b2) * v + U * b2 * v + U * vn;

    /* denom = sqrt(v) / sqrt(bc2) + eps; sqrt(bc2) is an f32 constant. */
    const double sb2 = mutant == MUTANT_BC2_WITHOUT_SQRT ? bc2 : sqrt(bc2);
    const double e_sb2 = U * sb2;
    const double r = sqrt(vn);
    const double e_r = (vn > 0.0 ? ev / (2.0 * r) : 0.0) + U * r;
    const double q = r / sb2;
    const double e_q = e_r / sb2 + q * (e_sb2 / sb2) + U * q;
    double d;
    if (mutant == MUTANT_EPS_BEFORE_BC2) {
        d = (r + eps) / sb2;
    } else if (mutant == MUTANT_EPS_UNDER_SQRT) {
        d = sqrt(vn / bc2 + eps);
    } else {
        d = q + eps;
    }
    const double e_d = e_q + f32_rounding(eps) + U * d;

    /* u = m / denom; step size lr / bc1 is an f32 constant. */
    const double w = mn / d;
    const double e_w = em / d + fabs(w) * e_d / d + U * fabs(w);
    const double ss = lr / bc1;
    const double e_ss = U * ss;

    /* AdamW: p <- p * (1 - lr * wd), the factor rounded once to f32; then p <- p - ss * u
     * (one fused rounding). */
    const double dec = (!l2 && mutant != MUTANT_NO_DECAY) ? 1.0 - lr * wd : 1.0;
    const double decf = (double)(float)dec;
    const double pd = p * dec;
    const double e_pd = fabs(p) * fabs(decf - dec) + (decf == 1.0 ? 0.0 : U * fabs(p * decf));
    const double pn = pd - ss * w;
    const double ep = e_pd + ss * e_w + e_ss * fabs(w) + U * fabs(pn);

    ref_result res;
    res.p = pn;
    res.m = mn;
    res.v = vn;
    res.ep = ep;
    res.em = em;
    res.ev = ev;
    return res;
}

/* ---------------------------------------------------------------------------- cases */

typedef struct test_case {
    uint32_t param_dtype, grad_dtype, moment_dtype, copy_dtype;
    so_adam_hparams hp;
    float grad_scale;
    size_t n;
    bool warm;
    uint64_t seed;
} test_case;

static const uint32_t PARAM_DTYPES[3] = {SO_DTYPE_F32, SO_DTYPE_BF16, SO_DTYPE_F16};
static const uint32_t MOMENT_DTYPES[2] = {SO_DTYPE_F32, SO_DTYPE_BF16};
static const uint32_t COPY_DTYPES[3] = {SO_DTYPE_NONE, SO_DTYPE_BF16, SO_DTYPE_F16};
static const uint64_t STEPS[3] = {1, 2, 1000};
static const size_t SMALL_LENGTHS[4] = {1, 15, 17, 1000};
static const size_t LARGE_LENGTHS[2] = {8192 * 5 + 3, 8192 * 9 + 5};

#define NUM_DTYPE_COMBOS (3 * 3 * 2 * 3)
#define NUM_FACTOR_COMBOS (2 * 2 * 2 * 2 * 3) /* mode, bias correction, wd, scale, step */

static void dtype_combo(int index, test_case *c) {
    c->param_dtype = PARAM_DTYPES[index % 3];
    c->grad_dtype = PARAM_DTYPES[(index / 3) % 3];
    c->moment_dtype = MOMENT_DTYPES[(index / 9) % 2];
    c->copy_dtype = COPY_DTYPES[(index / 18) % 3];
}

/* Factors from `index` (mode, bias correction, wd zero or not, scale one or not, step);
 * the hyperparameter values themselves are random, in sane ranges. */
static void factor_combo(int index, so_rng *rng, test_case *c) {
    so_adam_hparams hp = so_adam_hparams_default();
    hp.mode = index % 2 ? SO_ADAM_MODE_L2 : SO_ADAM_MODE_ADAMW;
    hp.bias_correction = (index / 2) % 2 == 0;
    bool wd_zero = (index / 4) % 2 == 1;
    bool scale_one = (index / 8) % 2 == 1;
    hp.step = STEPS[(index / 16) % 3];

    /* Plain doubles: rounded to f32 by the struct where its fields are float. */
    hp.lr = so_rng_log_range(rng, 1e-5, 3e-2);
    double pick = so_rng_unit(rng);
    hp.beta1 = pick < 0.6    ? so_rng_range(rng, 0.8, 0.99)
               : pick < 0.85 ? so_rng_range(rng, 0.0, 0.5)
               : pick < 0.93 ? 0.0
                             : 0.9;
    hp.beta2 = so_rng_unit(rng) < 0.7 ? so_rng_range(rng, 0.9, 0.9999) : so_rng_range(rng, 0.3, 0.9);
    hp.eps = so_rng_log_range(rng, 1e-10, 1e-2);
    hp.weight_decay = wd_zero ? 0.0 : so_rng_log_range(rng, 1e-4, 0.2);
    c->hp = hp;
    c->grad_scale = scale_one ? 1.0f : (float)so_rng_log_range(rng, 0x1p-10, 0x1p10);
    c->warm = !(hp.step == 1 && so_rng_below(rng, 2) == 0);
}

static void describe(const test_case *c, FILE *out) {
    fprintf(out,
            "case: param %s, grad %s, moments %s, copy %s, n %zu, %s, bias_correction %d, lr %.9g, beta1 %.9g, "
            "beta2 %.9g, eps %.9g, wd %.9g, step %llu, grad_scale %.9g, %s moments, seed %llu\n",
            so_dtype_name(c->param_dtype), so_dtype_name(c->grad_dtype), so_dtype_name(c->moment_dtype),
            so_dtype_name(c->copy_dtype), c->n, c->hp.mode == SO_ADAM_MODE_L2 ? "L2" : "AdamW",
            (int)c->hp.bias_correction, (double)c->hp.lr, (double)c->hp.beta1, (double)c->hp.beta2, (double)c->hp.eps,
            (double)c->hp.weight_decay, (unsigned long long)c->hp.step, (double)c->grad_scale,
            c->warm ? "warm" : "cold", (unsigned long long)c->seed);
}

/* The buffers of one case. */
typedef struct case_buffers {
    void *param, *grad, *m, *v, *copy;
} case_buffers;

static size_t bytes_of(uint32_t dtype, size_t n) { return dtype == SO_DTYPE_NONE ? 0 : so_dtype_size(dtype) * n; }

static void fill_inputs(const test_case *c, case_buffers *b) {
    so_rng rng = so_rng_new(c->seed * 7919 + 17);
    size_t n = c->n;
    b->param = so_test_malloc(bytes_of(c->param_dtype, n));
    b->grad = so_test_malloc(bytes_of(c->grad_dtype, n));
    b->m = so_test_malloc(bytes_of(c->moment_dtype, n));
    b->v = so_test_malloc(bytes_of(c->moment_dtype, n));
    b->copy = c->copy_dtype == SO_DTYPE_NONE ? NULL : so_test_malloc(bytes_of(c->copy_dtype, n));
    for (size_t i = 0; i < n; i++) {
        so_store(b->param, c->param_dtype, i, so_rng_normalish(&rng, 0.5));
        double g = so_rng_below(&rng, 32) == 0 ? 0.0 : so_rng_normalish(&rng, 1e-2);
        so_store(b->grad, c->grad_dtype, i, g);
        double m = 0.0, v = 0.0;
        if (c->warm && so_rng_below(&rng, 32) != 0) {
            m = so_rng_normalish(&rng, 1e-2);
            double sd = so_rng_normalish(&rng, 1e-2);
            v = sd * sd * so_rng_range(&rng, 0.5, 2.0) + m * m;
        }
        so_store(b->m, c->moment_dtype, i, m);
        so_store(b->v, c->moment_dtype, i, v);
    }
    if (b->copy) memset(b->copy, 0xA5, bytes_of(c->copy_dtype, n));
}

static case_buffers copy_buffers(const test_case *c, const case_buffers *src) {
    case_buffers b;
    b.param = so_test_dup(src->param, bytes_of(c->param_dtype, c->n));
    b.grad = so_test_dup(src->grad, bytes_of(c->grad_dtype, c->n));
    b.m = so_test_dup(src->m, bytes_of(c->moment_dtype, c->n));
    b.v = so_test_dup(src->v, bytes_of(c->moment_dtype, c->n));
    b.copy = src->copy ? so_test_dup(src->copy, bytes_of(c->copy_dtype, c->n)) : NULL;
    return b;
}

static void free_buffers(case_buffers *b) {
    free(b->param);
    free(b->grad);
    free(b->m);
    free(b->v);
    free(b->copy);
}

static so_adam_buffers api_buffers(const test_case *c, const case_buffers *b) {
    so_adam_buffers ab = so_test_adam_buffers(c->n, b->param, b->grad, b->m, b->v);
    ab.param_copy = b->copy;
    ab.param_dtype = c->param_dtype;
    ab.grad_dtype = c->grad_dtype;
    ab.moment_dtype = c->moment_dtype;
    ab.param_copy_dtype = c->copy_dtype;
    return ab;
}

static double run_update(so_pool *pool, const test_case *c, case_buffers *b) {
    so_adam_buffers ab = api_buffers(c, b);
    double sumsq = -1.0;
    so_test_adam_step(pool, &c->hp, &ab, c->grad_scale, &sumsq);
    return sumsq;
}

/* ---------------------------------------------------------------------------- checks */

typedef struct stats {
    double worst_p, worst_m, worst_v; /* max |got - ref| / bound */
    double worst_f32;                 /* the same, over values stored in f32 (no storage rounding) */
    size_t elements;
} stats;

static double ratio(double got, double ref, double bound) {
    if (isnan(got) || isnan(ref)) return INFINITY;
    double err = fabs(got - ref);
    return err == 0.0 ? 0.0 : err / bound;
}

/* Compares one result with the reference; returns the number of elements out of bound.
 * With `report`, prints the first few and the case. */
static size_t compare(const test_case *c, const case_buffers *in, const case_buffers *out, int mutant, bool report,
                      stats *st) {
    size_t bad = 0;
    for (size_t i = 0; i < c->n; i++) {
        double p0 = so_load(in->param, c->param_dtype, i), g = so_load(in->grad, c->grad_dtype, i);
        double m0 = so_load(in->m, c->moment_dtype, i), v0 = so_load(in->v, c->moment_dtype, i);
        ref_result r = reference(&c->hp, c->grad_scale, p0, g, m0, v0, mutant);
        double p = so_load(out->param, c->param_dtype, i);
        double m = so_load(out->m, c->moment_dtype, i);
        double v = so_load(out->v, c->moment_dtype, i);
        double bp = K_BOUND * r.ep + so_store_halfulp(c->param_dtype, fmax(fabs(p), fabs(r.p)));
        double bm = K_BOUND * r.em + so_store_halfulp(c->moment_dtype, fmax(fabs(m), fabs(r.m)));
        double bv = K_BOUND * r.ev + so_store_halfulp(c->moment_dtype, fmax(fabs(v), fabs(r.v)));
        double rp = ratio(p, r.p, bp), rm = ratio(m, r.m, bm), rv = ratio(v, r.v, bv);
        if (st) {
            st->worst_p = fmax(st->worst_p, rp);
            st->worst_m = fmax(st->worst_m, rm);
            st->worst_v = fmax(st->worst_v, rv);
            if (c->param_dtype == SO_DTYPE_F32) st->worst_f32 = fmax(st->worst_f32, rp);
            if (c->moment_dtype == SO_DTYPE_F32) st->worst_f32 = fmax(st->worst_f32, fmax(rm, rv));
            st->elements++;
        }
        if (rp > 1.0 || rm > 1.0 || rv > 1.0) {
            if (report && bad < 8) {
                if (bad == 0) describe(c, stderr);
                fprintf(stderr,
                        "  element %zu (p0 %.9g g %.9g m0 %.9g v0 %.9g):\n"
                        "    p got %.9g ref %.17g bound %.3g (x%.2f)\n"
                        "    m got %.9g ref %.17g bound %.3g (x%.2f)\n"
                        "    v got %.9g ref %.17g bound %.3g (x%.2f)\n",
                        i, p0, g, m0, v0, p, r.p, bp, rp, m, r.m, bm, rm, v, r.v, bv, rv);
            }
            bad++;
        }
        if (mutant == MUTANT_NONE && c->copy_dtype != SO_DTYPE_NONE) {
            /* The copy is the stored parameter rounded to nearest even (for f32 params,
             * the f32 result itself). */
            float stored = so_load(out->param, c->param_dtype, i);
            uint32_t want = c->copy_dtype == SO_DTYPE_BF16 ? so_f32_to_bf16(stored) : so_f32_to_f16(stored);
            uint32_t got = so_raw(out->copy, c->copy_dtype, i);
            if (got != want) {
                if (report) {
                    describe(c, stderr);
                    fprintf(stderr, "  element %zu: copy-out 0x%04x, expected 0x%04x (RNE of %.9g)\n", i, got, want,
                            (double)stored);
                }
                bad++;
            }
        }
    }
    return bad;
}

static double reference_sumsq(const test_case *c, const case_buffers *in) {
    double sum = 0.0;
    for (size_t i = 0; i < c->n; i++) {
        float gs = so_load(in->grad, c->grad_dtype, i) * c->grad_scale; /* f32 product, as loaded */
        sum += (double)gs * (double)gs;
    }
    return sum;
}

static bool same_bytes(const void *a, const void *b, size_t n) { return n == 0 || memcmp(a, b, n) == 0; }

/* ----------------------------------------------------------------------------- main */

#define NUM_POOLS 4

typedef struct pool_entry {
    so_pool *pool;
    const char *name;
} pool_entry;

static void run_case(const test_case *c, pool_entry *pools, stats *st) {
    case_buffers in;
    fill_inputs(c, &in);
    case_buffers first;
    memset(&first, 0, sizeof first);
    double first_sumsq = 0.0;
    bool have_first = false;
    for (int k = 0; k < NUM_POOLS; k++) {
        if (!pools[k].pool) continue;
        case_buffers out = copy_buffers(c, &in);
        double sumsq = run_update(pools[k].pool, c, &out);
        CHECKF(same_bytes(out.grad, in.grad, bytes_of(c->grad_dtype, c->n)), "the gradient was written");
        if (!have_first) {
            size_t bad = compare(c, &in, &out, MUTANT_NONE, true, st);
            CHECKF(bad == 0, "%zu values out of bound on pool %s", bad, pools[k].name);
            double want = reference_sumsq(c, &in);
            CHECKF(fabs(sumsq - want) <= (double)(c->n + 8) * 0x1p-52 * want, "sumsq %.17g, expected %.17g", sumsq,
                   want);
            first = out;
            first_sumsq = sumsq;
            have_first = true;
        } else {
            /* Every instruction set and thread count gives the same bits. */
            bool same = same_bytes(out.param, first.param, bytes_of(c->param_dtype, c->n)) &&
                        same_bytes(out.m, first.m, bytes_of(c->moment_dtype, c->n)) &&
                        same_bytes(out.v, first.v, bytes_of(c->moment_dtype, c->n)) &&
                        (!out.copy || same_bytes(out.copy, first.copy, bytes_of(c->copy_dtype, c->n))) &&
                        memcmp(&sumsq, &first_sumsq, sizeof sumsq) == 0;
            if (!same) {
                describe(c, stderr);
                size_t bad = compare(c, &in, &out, MUTANT_NONE, true, NULL);
                CHECKF(false, "pool %s differs from pool %s (%zu values out of bound)", pools[k].name, pools[0].name,
                       bad);
            }
            free_buffers(&out);
        }
    }
    free_buffers(&first);
    free_buffers(&in);
}

/* The reference with each mistake must be rejected somewhere in a sweep over the factors. */
static void check_mutants_are_caught(so_pool *pool) {
    for (int mutant = 1; mutant < MUTANT_COUNT; mutant++) {
        size_t caught = 0, cases = 0;
        for (int f = 0; f < NUM_FACTOR_COMBOS; f++) {
            for (int rep = 0; rep < 2; rep++) {
                test_case c;
                so_rng rng = so_rng_new(100000 + (uint64_t)(f * 2 + rep));
                dtype_combo(0, &c); /* all f32, no copy */
                factor_combo(f, &rng, &c);
                c.n = 257;
                c.seed = 100000 + (uint64_t)(f * 2 + rep);
                case_buffers in;
                fill_inputs(&c, &in);
                case_buffers out = copy_buffers(&c, &in);
                (void)run_update(pool, &c, &out);
                if (compare(&c, &in, &out, mutant, false, NULL) > 0) caught++;
                cases++;
                free_buffers(&out);
                free_buffers(&in);
            }
        }
        printf("mutant \"%s\": rejected in %zu of %zu cases\n", mutant_name(mutant), caught, cases);
        CHECKF(caught > 0, "the bound does not detect the mistake \"%s\"", mutant_name(mutant));
    }
}

/* The converters of so_test.h against the definitions, before anything relies on them. */
static void check_converters(void) {
    for (uint32_t bits = 0; bits < 0x10000; bits++) {
        uint16_t h = (uint16_t)bits;
        float b = so_bf16_to_f32(h);
        if (!isnan(b)) CHECKF(so_f32_to_bf16(b) == h, "bf16 0x%04x", bits);
        float f = so_f16_to_f32(h);
        if (!isnan(f)) CHECKF(so_f32_to_f16(f) == h, "f16 0x%04x", bits);
    }
    /* Ties go to even, just above a tie rounds up, overflow goes to inf. */
    CHECK(so_f32_to_bf16(so_bits_to_f32(0x3F808000u)) == 0x3F80);
    CHECK(so_f32_to_bf16(so_bits_to_f32(0x3F818000u)) == 0x3F82);
    CHECK(so_f32_to_bf16(so_bits_to_f32(0x3F808001u)) == 0x3F81);
    CHECK(so_f32_to_bf16(3.4e38f) == 0x7F80);
    CHECK(so_f32_to_f16(1.0f + 0x1p-11f) == 0x3C00);            /* tie -> even */
    CHECK(so_f32_to_f16(1.0f + 0x1p-11f + 0x1p-20f) == 0x3C01); /* above the tie */
    CHECK(so_f32_to_f16(1.0f + 3 * 0x1p-11f) == 0x3C02);        /* tie -> even (up) */
    CHECK(so_f32_to_f16(65504.0f) == 0x7BFF);
    CHECK(so_f32_to_f16(65519.0f) == 0x7BFF);
    CHECK(so_f32_to_f16(65520.0f) == 0x7C00);
    CHECK(so_f32_to_f16(0x1p-25f) == 0x0000); /* tie at half the smallest subnormal */
    CHECK(so_f32_to_f16(0x1p-25f + 0x1p-40f) == 0x0001);
    CHECK(so_f32_to_f16(3 * 0x1p-25f) == 0x0002);
    CHECK(so_f32_to_f16(-0x1p-14f) == 0x8400);
}

int main(void) {
    check_converters();

    pool_entry pools[NUM_POOLS];
    for (int k = 0; k < SO_TEST_NUM_ISAS; k++) {
        pools[k].pool = so_test_pool(so_test_isa(k), 0);
        pools[k].name = so_isa_name(so_test_isa(k));
    }
    CHECK(pools[0].pool != NULL); /* the portable path runs everywhere */
    pools[3].pool = so_test_pool(SO_ISA_AUTO, 3);
    pools[3].name = "auto with 3 threads";

    stats st;
    memset(&st, 0, sizeof st);
    size_t cases = 0;

    /* Every dtype combination with every factor combination, short lengths. */
    for (int d = 0; d < NUM_DTYPE_COMBOS; d++) {
        for (int f = 0; f < NUM_FACTOR_COMBOS; f++) {
            test_case c;
            c.seed = (uint64_t)(d * NUM_FACTOR_COMBOS + f);
            so_rng rng = so_rng_new(c.seed);
            dtype_combo(d, &c);
            factor_combo(f, &rng, &c);
            c.n = SMALL_LENGTHS[so_rng_below(&rng, 4)];
            run_case(&c, pools, &st);
            cases++;
        }
    }
    /* Every dtype combination once more on a long buffer (several blocks and threads). */
    for (int d = 0; d < NUM_DTYPE_COMBOS; d++) {
        test_case c;
        c.seed = 50000 + (uint64_t)d;
        so_rng rng = so_rng_new(c.seed);
        dtype_combo(d, &c);
        factor_combo((int)so_rng_below(&rng, NUM_FACTOR_COMBOS), &rng, &c);
        c.n = LARGE_LENGTHS[d % 2];
        run_case(&c, pools, &st);
        cases++;
    }
    printf("%zu cases, %zu elements: worst |error| / bound: p %.3f, m %.3f, v %.3f; f32-stored values %.3f\n", cases,
           st.elements, st.worst_p, st.worst_m, st.worst_v, st.worst_f32);

    check_mutants_are_caught(pools[0].pool);

    for (int k = 0; k < NUM_POOLS; k++) so_pool_destroy(pools[k].pool);
    printf("ok\n");
    return 0;
}
