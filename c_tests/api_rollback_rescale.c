/* so_adam_rollback and so_adam_rescale (f32 master weights and moments).
 *
 * Rollback: update then rollback returns the state before the update within the bounds
 * derived below, for AdamW and Adam-L2, with and without bias correction, weight decay 0
 * and > 0, f32, bf16 and f16 gradients, grad_scale 1 and != 1, cold and warm moments; with
 * a copy-out, the copy is the RNE of the recovered parameter. v is clamped at 0 (a case
 * where the recovered v would be slightly negative is constructed) but a NaN v stays NaN.
 *
 * Rescale: update with s_old then rescale to s_new equals the direct update with s_new
 * within bounds (first step with cold moments, and warm moments at step 1000); rescale to
 * the same scale leaves every byte as it was; a NaN v stays NaN.
 *
 * Both refuse bf16/f16 params and bf16 moments (SO_STATUS_UNSUPPORTED); rollback refuses
 * beta1 = 0, beta2 = 0 and AdamW with lr * wd >= 1. Results are bit-identical on every
 * instruction set. Each bound is also checked to be tight enough to notice a rollback or
 * rescale that does nothing, or a rescale to a scale off by 2^-12.
 *
 * ---- The bounds (first order in u = 2^-24, one f32 rounding = at most u * |result|) ----
 * Names: decf = f32(1 - lr*wd) (AdamW; 1 for L2), ss = f32(lr/bc1), c1 = f32(1-beta1),
 * c2 = f32(1-beta2), w = m/denom(v). These constants are the same in the forward and the
 * backward pass, so they cancel exactly and contribute no error.
 *
 * Rollback, p. The update computed A = fl(p0*decf), p1 = fl(A - ss*w) from the post-step
 * moments, which it stored; the rollback recomputes w from the same stored bits, so w is
 * identical, and p0' = fl(fl(p1 + ss*w) / decf). Hence
 *     |p0' - p0| <= (u|p0*decf| [decf != 1] + u|p1| + u|A|) / decf + u|p0'|.
 * Rollback, m. m1 = fl(c1*g1 + fl(b1*m0)); m0' = fl(fl(m1 - c1*g2) / b1), where g1, g2 are
 * the effective gradients of the two passes (identical for AdamW or wd = 0; for Adam-L2
 * g2 uses the recovered p0', so |g2 - g1| <= wd|p0' - p0| + 2u|g|):
 *     |m0' - m0| <= u|m0| + (u|m1| + c1|g2 - g1| + u(|m1| + c1|g|)) / b1 + u|m0'|.
 * Rollback, v: the same with b2, c2 and g^2 (|g2^2 - g1^2| <= 2|g||g2 - g1| + 2u g^2); the
 * clamp at 0 only moves v0' towards v0 >= 0.
 *
 * Rescale, m and v: both the rescaled and the direct result are compared with the exact
 * step on s_new; each error is the sum of u * |result| of every rounding on its path (the
 * f32 products s*g, the fused adds, dm = f32((1-b1)(new-old)), dv = f32((1-b2)(new^2-old^2))
 * and, for Adam-L2, the cross term with the recovered p_prev), and the bound is their sum.
 * Rescale, p. p_new = fl(p1 - ss*fl(w_new - w_old)) with w_old as stored by the update,
 * p2 = fl(A - ss*w2) with the same A, so
 *     |p_new - p2| <= ss|W(m_new, v_new) - W(m2, v2)| + u(|p1| + |p_new| + |p2|)
 *                     + ss*u|w_new - w_old|,
 * where each evaluation of W = m / (sqrt(v)/sqrt(bc2) + eps) adds 4u|W| (sqrt, divide, add,
 * divide) and |W(m,v) - W(m',v')| <= |m - m'|/d + |W| |sqrt(v) - sqrt(v')| / (sqrt(bc2) d),
 * with the measured differences of the m and v results (themselves checked above).
 *
 * Every check is |got - expected| <= K * bound with K = 2 (headroom for second-order terms).
 */
#include "so_test.h"

#define K_BOUND 2.0
static const double U = 0x1p-24;

typedef struct state {
    float *p, *m, *v;
} state;

static state state_new(size_t n) {
    state s;
    s.p = (float *)so_test_malloc(n * sizeof(float));
    s.m = (float *)so_test_malloc(n * sizeof(float));
    s.v = (float *)so_test_malloc(n * sizeof(float));
    return s;
}

static state state_clone(const state *s, size_t n) {
    state c;
    c.p = (float *)so_test_dup(s->p, n * sizeof(float));
    c.m = (float *)so_test_dup(s->m, n * sizeof(float));
    c.v = (float *)so_test_dup(s->v, n * sizeof(float));
    return c;
}

static void state_free(state *s) {
    free(s->p);
    free(s->m);
    free(s->v);
}

static bool state_same(const state *a, const state *b, size_t n) {
    return memcmp(a->p, b->p, n * 4) == 0 && memcmp(a->m, b->m, n * 4) == 0 && memcmp(a->v, b->v, n * 4) == 0;
}

static so_adam_buffers buffers_of(state *s, size_t n, const void *grad, uint32_t gd) {
    so_adam_buffers b = so_test_adam_buffers(n, s->p, grad, s->m, s->v);
    b.grad_dtype = gd;
    return b;
}

static void do_update(so_pool *pool, const so_adam_hparams *hp, state *s, size_t n, const void *g, uint32_t gd,
                      float scale) {
    so_adam_buffers b = buffers_of(s, n, g, gd);
    so_test_adam_step(pool, hp, &b, scale, NULL);
}

static void do_rescale(so_pool *pool, const so_adam_hparams *hp, state *s, size_t n, const void *g, uint32_t gd,
                       float old_scale, float new_scale) {
    so_adam_buffers b = buffers_of(s, n, g, gd);
    CHECK_OK(so_adam_rescale(pool, hp, &b, old_scale, new_scale));
}

typedef struct constants {
    bool l2w; /* Adam-L2 with wd != 0 */
    double decf, ss, c1, c2, b1, b2, sb2, eps, wd;
} constants;

static constants constants_of(const so_adam_hparams *hp) {
    constants k;
    double t = (double)hp->step;
    float bc1 = hp->bias_correction ? (float)(1.0 - pow((double)hp->beta1, t)) : 1.0f;
    float bc2 = hp->bias_correction ? (float)(1.0 - pow((double)hp->beta2, t)) : 1.0f;
    k.l2w = hp->mode == SO_ADAM_MODE_L2 && hp->weight_decay != 0.0f;
    k.decf = hp->mode == SO_ADAM_MODE_ADAMW ? (double)(float)(1.0 - (double)hp->lr * (double)hp->weight_decay) : 1.0;
    k.ss = (double)(hp->lr / bc1);
    k.c1 = (double)(1.0f - hp->beta1);
    k.c2 = (double)(1.0f - hp->beta2);
    k.b1 = hp->beta1;
    k.b2 = hp->beta2;
    k.sb2 = (double)sqrtf(bc2);
    k.eps = hp->eps;
    k.wd = hp->weight_decay;
    return k;
}

static void make_state(so_rng *rng, state *s, size_t n, bool warm) {
    for (size_t i = 0; i < n; i++) {
        s->p[i] = (float)so_rng_normalish(rng, 0.5);
        if (warm) {
            s->m[i] = (float)so_rng_normalish(rng, 1e-2);
            double sd = so_rng_normalish(rng, 1e-2);
            s->v[i] = (float)(sd * sd + (double)s->m[i] * s->m[i]);
        } else {
            s->m[i] = 0.0f;
            s->v[i] = 0.0f;
        }
    }
}

static void *make_grad(so_rng *rng, uint32_t gd, size_t n) {
    void *g = so_test_malloc(n * so_dtype_size(gd));
    for (size_t i = 0; i < n; i++) so_store(g, gd, i, so_rng_normalish(rng, 1e-2));
    return g;
}

static so_adam_hparams random_hparams(so_rng *rng, uint32_t mode, bool bc, bool wd, uint64_t step) {
    so_adam_hparams hp = so_adam_hparams_default();
    hp.mode = mode;
    hp.bias_correction = bc;
    hp.step = step;
    hp.lr = (float)so_rng_log_range(rng, 1e-4, 2e-2);
    hp.beta1 = (float)(so_rng_below(rng, 4) == 0 ? so_rng_range(rng, 0.2, 0.6) : so_rng_range(rng, 0.8, 0.99));
    hp.beta2 = (float)so_rng_range(rng, 0.9, 0.9999);
    hp.eps = (float)so_rng_log_range(rng, 1e-8, 1e-3);
    hp.weight_decay = wd ? (float)so_rng_log_range(rng, 1e-3, 0.1) : 0.0f;
    return hp;
}

static const char *case_name(const so_adam_hparams *hp, uint32_t gd, float scale) {
    static char buf[256];
    snprintf(buf, sizeof buf,
             "%s, bias_correction %d, lr %.6g, beta1 %.6g, beta2 %.6g, eps %.3g, wd %.3g, step %llu, grad %s, scale %g",
             hp->mode == SO_ADAM_MODE_L2 ? "L2" : "AdamW", (int)hp->bias_correction, (double)hp->lr, (double)hp->beta1,
             (double)hp->beta2, (double)hp->eps, (double)hp->weight_decay, (unsigned long long)hp->step,
             so_dtype_name(gd), (double)scale);
    return buf;
}

/* -------------------------------------------------------------------------- rollback */

typedef struct detect {
    size_t p, m, v, n; /* elements where a no-op would have been caught */
} detect;

static double worst_rollback = 0.0, worst_rescale = 0.0;

static void check_rollback_element(const constants *k, float scale, double g, const state *s0, const state *s1,
                                   const state *r, size_t i, const char *what, detect *det) {
    const double p0 = s0->p[i], m0 = s0->m[i], v0 = s0->v[i];
    const double p1 = s1->p[i], m1 = s1->m[i], v1 = s1->v[i];
    const double pr = r->p[i], mr = r->m[i], vr = r->v[i];
    const double pa = fabs(p0 * k->decf);
    const double e_p = ((k->decf != 1.0 ? U * pa : 0.0) + U * fabs(p1) + U * pa) / k->decf + U * fabs(pr);

    double ge = (double)scale * g + (k->l2w ? k->wd * p0 : 0.0);
    double dge = k->l2w ? k->wd * fabs(pr - p0) + 2.0 * U * fabs(ge) : 0.0;
    const double e_m =
        U * fabs(m0) + (U * fabs(m1) + k->c1 * dge + U * (fabs(m1) + k->c1 * fabs(ge))) / k->b1 + U * fabs(mr);
    double dsq = k->l2w ? 2.0 * fabs(ge) * dge + 2.0 * U * ge * ge : 0.0;
    const double e_v = U * v0 + (U * v1 + k->c2 * dsq + U * (v1 + k->c2 * ge * ge)) / k->b2 + U * vr;

    double bp = K_BOUND * e_p, bm = K_BOUND * e_m, bv = K_BOUND * e_v;
    double rp = fabs(pr - p0) / bp, rm = fabs(mr - m0) / fmax(bm, 1e-300), rv = fabs(vr - v0) / fmax(bv, 1e-300);
    if (!(rp <= 1.0 && rm <= 1.0 && rv <= 1.0)) {
        fprintf(
            stderr,
            "%s: element %zu (g %.9g): p0 %.9g -> %.9g -> %.9g (bound %.3g)\n  m0 %.9g -> %.9g -> %.9g (bound %.3g)\n"
            "  v0 %.9g -> %.9g -> %.9g (bound %.3g)\n",
            what, i, g, p0, p1, pr, bp, m0, m1, mr, bm, v0, v1, vr, bv);
        CHECKF(false, "rollback out of bound");
    }
    worst_rollback = fmax(worst_rollback, fmax(rp, fmax(rm, rv)));
    if (g != 0.0) {
        det->n++;
        if (fabs(p1 - p0) > bp) det->p++;
        if (fabs(m1 - m0) > bm) det->m++;
        if (fabs(v1 - v0) > bv) det->v++;
    }
}

static void test_rollback(so_pool **pools) {
    static const uint32_t GRADS[3] = {SO_DTYPE_F32, SO_DTYPE_BF16, SO_DTYPE_F16};
    const size_t n = 8192 + 37;
    so_rng rng = so_rng_new(7);
    size_t cases = 0;
    for (int mode = 0; mode < 2; mode++)
        for (int bc = 0; bc < 2; bc++)
            for (int gi = 0; gi < 3; gi++)
                for (int wd = 0; wd < 2; wd++)
                    for (int warm = 0; warm < 2; warm++)
                        for (int sc = 0; sc < 2; sc++) {
                            uint32_t gd = GRADS[gi];
                            so_adam_hparams hp = random_hparams(&rng, mode ? SO_ADAM_MODE_L2 : SO_ADAM_MODE_ADAMW,
                                                                bc == 0, wd == 1, warm ? 1000 : 1);
                            float scale = sc ? (float)so_rng_log_range(&rng, 0.01, 100.0) : 1.0f;
                            bool with_copy = (cases % 2) == 1;
                            state s0 = state_new(n);
                            make_state(&rng, &s0, n, warm == 1);
                            void *g = make_grad(&rng, gd, n);
                            constants k = constants_of(&hp);
                            state first;
                            memset(&first, 0, sizeof first);
                            uint16_t *first_copy = NULL;
                            for (int isa = 0; isa < SO_TEST_NUM_ISAS; isa++) {
                                if (!pools[isa]) continue;
                                state s1 = state_clone(&s0, n);
                                do_update(pools[isa], &hp, &s1, n, g, gd, scale);
                                state r = state_clone(&s1, n);
                                so_adam_buffers b = buffers_of(&r, n, g, gd);
                                uint16_t *copy = NULL;
                                if (with_copy) {
                                    copy = (uint16_t *)so_test_malloc(n * 2);
                                    b.param_copy = copy;
                                    b.param_copy_dtype = SO_DTYPE_BF16;
                                }
                                CHECK_OK(so_adam_rollback(pools[isa], &hp, &b, scale));
                                if (isa == 0) {
                                    detect det;
                                    memset(&det, 0, sizeof det);
                                    for (size_t i = 0; i < n; i++) {
                                        check_rollback_element(&k, scale, so_load(g, gd, i), &s0, &s1, &r, i,
                                                               case_name(&hp, gd, scale), &det);
                                        if (copy) CHECK(copy[i] == so_f32_to_bf16(r.p[i]));
                                    }
                                    /* The bounds are far below the step: a rollback that
                                     * changed nothing would fail nearly everywhere. */
                                    CHECKF(det.p > det.n * 9 / 10 && det.m > det.n * 9 / 10 && det.v > det.n * 9 / 10,
                                           "%s: a no-op rollback is not detected (p %zu m %zu v %zu of %zu)",
                                           case_name(&hp, gd, scale), det.p, det.m, det.v, det.n);
                                    first = r;
                                    first_copy = copy;
                                } else {
                                    CHECKF(state_same(&r, &first, n), "%s: rollback on %s differs from portable",
                                           case_name(&hp, gd, scale), so_isa_name(so_test_isa(isa)));
                                    if (copy) CHECK(memcmp(copy, first_copy, n * 2) == 0);
                                    state_free(&r);
                                    free(copy);
                                }
                                state_free(&s1);
                            }
                            state_free(&first);
                            free(first_copy);
                            state_free(&s0);
                            free(g);
                            cases++;
                        }
    printf("rollback: %zu cases, worst |error| / bound %.3f\n", cases, worst_rollback);
}

/* From v0 = 0, the update stores v1 = fl(c2 * g^2); where that rounded down, the exact
 * (v1 - c2 g^2) / b2 is negative and must come back as +0, not as a tiny negative. */
static void test_rollback_clamps_v(so_pool *pool) {
    const size_t n = 4096;
    so_rng rng = so_rng_new(99);
    so_adam_hparams hp = so_adam_hparams_default(); /* AdamW, step 1 */
    hp.beta2 = 0.99f;
    float c2 = 1.0f - hp.beta2;
    float scale = 1.0f;
    state s = state_new(n);
    make_state(&rng, &s, n, false);
    float *g = (float *)make_grad(&rng, SO_DTYPE_F32, n);
    do_update(pool, &hp, &s, n, g, SO_DTYPE_F32, scale);
    so_adam_buffers b = buffers_of(&s, n, g, SO_DTYPE_F32);
    CHECK_OK(so_adam_rollback(pool, &hp, &b, scale));
    size_t rounded_down = 0;
    for (size_t i = 0; i < n; i++) {
        float sq = g[i] * g[i];
        double exact = (double)c2 * (double)sq; /* exact: 24 x 24 bits */
        float v1 = (float)exact;
        if ((double)v1 < exact) {
            rounded_down++;
            CHECKF(so_f32_to_bits(s.v[i]) == 0, "element %zu: recovered v %.9g (bits 0x%08x), expected +0", i,
                   (double)s.v[i], so_f32_to_bits(s.v[i]));
        } else {
            CHECKF(s.v[i] >= 0.0f && s.v[i] <= 4 * U * v1 / hp.beta2, "element %zu: recovered v %.9g", i,
                   (double)s.v[i]);
        }
    }
    CHECKF(rounded_down > n / 10, "only %zu of %zu elements would go negative", rounded_down, n);
    printf("rollback clamps v at +0: %zu elements would have been negative\n", rounded_down);
    state_free(&s);
    free(g);
}

/* A NaN in v stays NaN through a rollback and a rescale (the clamp must not hide it). */
static void test_nan_v_stays_nan(so_pool *pool) {
    const size_t n = 64;
    so_rng rng = so_rng_new(5);
    so_adam_hparams hp = so_adam_hparams_default();
    state s = state_new(n);
    make_state(&rng, &s, n, true);
    float *g = (float *)make_grad(&rng, SO_DTYPE_F32, n);
    s.v[3] = NAN;
    s.v[17] = NAN;
    so_adam_buffers b = buffers_of(&s, n, g, SO_DTYPE_F32);
    CHECK_OK(so_adam_rollback(pool, &hp, &b, 1.0f));
    CHECK(isnan(s.v[3]) && isnan(s.v[17]));
    CHECK(!isnan(s.v[4]) && s.v[4] >= 0.0f);
    s.v[5] = NAN;
    CHECK_OK(so_adam_rescale(pool, &hp, &b, 1.0f, 0.5f));
    CHECK(isnan(s.v[3]) && isnan(s.v[5]) && isnan(s.v[17]));
    CHECK(!isnan(s.v[4]) && s.v[4] >= 0.0f);
    state_free(&s);
    free(g);
}

/* --------------------------------------------------------------------------- rescale */

typedef struct rescale_errors {
    size_t bad_p, bad_m, bad_v;
    double worst;
} rescale_errors;

/* Compares `cand` with a direct step `s2`, under the bounds of the rescaled state `sr`
 * (cand == sr is the real check; another cand checks that the bounds notice it); counts
 * elements out of bound. */
static rescale_errors compare_rescale(const constants *k, float old_scale, float new_scale, const void *gbuf,
                                      uint32_t gd, size_t n, const state *s0, const state *s1, const state *sr,
                                      const state *cand, const state *s2, bool report, const char *what) {
    rescale_errors out;
    memset(&out, 0, sizeof out);
    const double o = old_scale, nn = new_scale;
    for (size_t i = 0; i < n; i++) {
        const double g = so_load(gbuf, gd, i);
        const double p0 = s0->p[i], m0 = s0->m[i], v0 = s0->v[i];
        const double p1 = s1->p[i], m1 = s1->m[i], v1 = s1->v[i];
        const double pn = sr->p[i], mn = sr->m[i], vn = sr->v[i];
        const double p2 = s2->p[i], m2 = s2->m[i], v2 = s2->v[i];
        const double gp = k->l2w ? k->wd * p0 : 0.0;

        const double ge_o = gp + o * g, ge_n = gp + nn * g;
        const double e_ge_o = (o != 1.0 ? U * fabs(o * g) : 0.0) + (k->l2w ? U * fabs(ge_o) : 0.0);
        const double e_ge_n = (nn != 1.0 ? U * fabs(nn * g) : 0.0) + (k->l2w ? U * fabs(ge_n) : 0.0);

        /* m */
        const double e_m1 = k->c1 * e_ge_o + U * k->b1 * fabs(m0) + U * fabs(m1);
        const double dm = k->c1 * (nn - o);
        const double e_mn = e_m1 + U * fabs(dm) * fabs(g) + U * fabs(mn);
        const double e_m2 = k->c1 * e_ge_n + U * k->b1 * fabs(m0) + U * fabs(m2);
        const double bm = K_BOUND * (e_mn + e_m2);

        /* v */
        const double e_v1 = k->c2 * (2.0 * fabs(ge_o) * e_ge_o + U * ge_o * ge_o) + U * k->b2 * v0 + U * v1;
        const double dv = k->c2 * (nn * nn - o * o);
        const double gg = g * g;
        const double va = v1 + dv * gg;
        double e_vn = e_v1 + 2.0 * U * fabs(dv) * gg + U * fabs(va);
        if (k->l2w) {
            const double e_pp = U * fabs(p1) + U * fabs(p0);
            const double dvc = 2.0 * k->c2 * k->wd * (nn - o);
            e_vn += fabs(dvc) * (fabs(g) * e_pp + U * fabs(g * p0)) + U * fabs(dvc * g * p0) + U * fabs(vn);
        }
        const double e_v2 = k->c2 * (2.0 * fabs(ge_n) * e_ge_n + U * ge_n * ge_n) + U * k->b2 * v0 + U * v2;
        const double bv = K_BOUND * (e_vn + e_v2);

        /* p */
        const double d_old = sqrt(v1) / k->sb2 + k->eps, d_new = sqrt(fmax(vn, 0.0)) / k->sb2 + k->eps;
        const double d2 = sqrt(v2) / k->sb2 + k->eps;
        const double w_old = m1 / d_old, w_new = mn / d_new, w2 = m2 / d2;
        const double dmeas = fabs(mn - m2), dvmeas = fabs(vn - v2);
        const double root_sum = sqrt(fmax(vn, 0.0)) + sqrt(v2);
        double dsqrt = sqrt(dvmeas);
        if (root_sum > 0.0) dsqrt = fmin(dsqrt, dvmeas / root_sum);
        const double dmin = fmin(d_new, d2), wmax = fmax(fabs(w_new), fabs(w2));
        const double e_w = 4.0 * U * (fabs(w_new) + fabs(w2)) + dmeas / dmin + wmax * (dsqrt / k->sb2) / dmin;
        const double e_p = k->ss * e_w + U * (fabs(p1) + fabs(pn) + fabs(p2)) + k->ss * U * fabs(w_new - w_old);
        const double bp = K_BOUND * e_p;

        const double cp = cand->p[i], cm = cand->m[i], cv = cand->v[i];
        const double rp = fabs(cp - p2) / fmax(bp, 1e-300), rm = fabs(cm - m2) / fmax(bm, 1e-300);
        const double rv = fabs(cv - v2) / fmax(bv, 1e-300);
        bool bad = false;
        if (!(rp <= 1.0)) out.bad_p++, bad = true;
        if (!(rm <= 1.0)) out.bad_m++, bad = true;
        if (!(rv <= 1.0)) out.bad_v++, bad = true;
        if (!bad) out.worst = fmax(out.worst, fmax(rp, fmax(rm, rv)));
        if (bad && report) {
            fprintf(stderr,
                    "%s: element %zu (g %.9g, p0 %.9g m0 %.9g v0 %.9g)\n  p rescaled %.9g direct %.9g bound %.3g\n"
                    "  m rescaled %.9g direct %.9g bound %.3g\n  v rescaled %.9g direct %.9g bound %.3g\n",
                    what, i, g, p0, m0, v0, cp, p2, bp, cm, m2, bm, cv, v2, bv);
            CHECKF(false, "rescale out of bound");
        }
    }
    return out;
}

static void test_rescale(so_pool **pools) {
    static const float SCALES[4][2] = {{1.0f, 0.5f}, {1.0f, 0.3f}, {0.8f, 1.3f}, {2048.0f, 1000.0f}};
    static const uint32_t GRADS[2] = {SO_DTYPE_F32, SO_DTYPE_BF16};
    const size_t n = 8192 + 101;
    so_rng rng = so_rng_new(11);
    size_t cases = 0, p_detected = 0;
    for (int mode = 0; mode < 2; mode++)
        for (int bc = 0; bc < 2; bc++)
            for (int wd = 0; wd < 2; wd++)
                for (int warm = 0; warm < 2; warm++)
                    for (int gi = 0; gi < 2; gi++)
                        for (int si = 0; si < 4; si++) {
                            uint32_t gd = GRADS[gi];
                            float o = SCALES[si][0], nn = SCALES[si][1];
                            so_adam_hparams hp = random_hparams(&rng, mode ? SO_ADAM_MODE_L2 : SO_ADAM_MODE_ADAMW,
                                                                bc == 0, wd == 1, warm ? 1000 : 1);
                            state s0 = state_new(n);
                            make_state(&rng, &s0, n, warm == 1);
                            void *g = make_grad(&rng, gd, n);
                            constants k = constants_of(&hp);
                            char what[320];
                            snprintf(what, sizeof what, "rescale %g -> %g, %s", (double)o, (double)nn,
                                     case_name(&hp, gd, o));

                            state s1 = state_clone(&s0, n), s2 = state_clone(&s0, n), s3 = state_clone(&s0, n);
                            do_update(pools[0], &hp, &s1, n, g, gd, o);
                            do_update(pools[0], &hp, &s2, n, g, gd, nn);
                            do_update(pools[0], &hp, &s3, n, g, gd, nn * (1.0f + 0x1p-12f));
                            state sr = state_clone(&s1, n);
                            do_rescale(pools[0], &hp, &sr, n, g, gd, o, nn);
                            rescale_errors e =
                                compare_rescale(&k, o, nn, g, gd, n, &s0, &s1, &sr, &sr, &s2, true, what);
                            worst_rescale = fmax(worst_rescale, e.worst);

                            /* Tight enough: a rescale that did nothing (s1 instead of sr) or one to a
                             * scale off by 2^-12 (compared with s3) must fail for most elements. */
                            rescale_errors noop =
                                compare_rescale(&k, o, nn, g, gd, n, &s0, &s1, &sr, &s1, &s2, false, what);
                            rescale_errors off =
                                compare_rescale(&k, o, nn, g, gd, n, &s0, &s1, &sr, &sr, &s3, false, what);
                            CHECKF(noop.bad_m > n * 9 / 10 && noop.bad_v > n * 9 / 10,
                                   "%s: a no-op rescale is not detected (m %zu, v %zu)", what, noop.bad_m, noop.bad_v);
                            /* (With warm moments, b2 * v0 dominates v and the change of v
                             * is close to its rounding: fewer elements notice.) */
                            CHECKF(off.bad_m > n / 2 && off.bad_v > (warm ? n / 20 : n / 2),
                                   "%s: a scale off by 2^-12 is not detected (m %zu, v %zu)", what, off.bad_m,
                                   off.bad_v);
                            if (warm && noop.bad_p > n / 2) p_detected++;

                            /* Same bits on every instruction set. */
                            for (int isa = 1; isa < SO_TEST_NUM_ISAS; isa++) {
                                if (!pools[isa]) continue;
                                state t = state_clone(&s1, n);
                                do_rescale(pools[isa], &hp, &t, n, g, gd, o, nn);
                                CHECKF(state_same(&t, &sr, n), "%s: %s differs from portable", what,
                                       so_isa_name(so_test_isa(isa)));
                                state_free(&t);
                            }

                            /* To the same scale: nothing changes. */
                            state same = state_clone(&s1, n);
                            void *g_before = so_test_dup(g, n * so_dtype_size(gd));
                            do_rescale(pools[0], &hp, &same, n, g, gd, o, o);
                            CHECK(state_same(&same, &s1, n));
                            CHECK(memcmp(g, g_before, n * so_dtype_size(gd)) == 0);
                            free(g_before);

                            state_free(&same);
                            state_free(&s0);
                            state_free(&s1);
                            state_free(&s2);
                            state_free(&s3);
                            state_free(&sr);
                            free(g);
                            cases++;
                        }
    printf("rescale: %zu cases, worst |error| / bound %.3f; a no-op on p detected in %zu warm cases\n", cases,
           worst_rescale, p_detected);
    CHECK(p_detected > 0);
}

/* --------------------------------------------------------------------------- refusals */

static void test_refusals(so_pool *pool) {
    const size_t n = 33;
    unsigned char *p = (unsigned char *)so_test_malloc(n * 4), *m = (unsigned char *)so_test_malloc(n * 4);
    unsigned char *v = (unsigned char *)so_test_malloc(n * 4), *g = (unsigned char *)so_test_malloc(n * 4);
    for (size_t i = 0; i < n * 4; i++) p[i] = m[i] = v[i] = g[i] = (unsigned char)(0x3C + i % 3);
    unsigned char *snap = (unsigned char *)so_test_malloc(n * 16);
    memcpy(snap, p, n * 4);
    memcpy(snap + n * 4, m, n * 4);
    memcpy(snap + n * 8, v, n * 4);
    memcpy(snap + n * 12, g, n * 4);

    struct {
        uint32_t pd, md;
    } combos[5] = {{SO_DTYPE_BF16, SO_DTYPE_F32},
                   {SO_DTYPE_F16, SO_DTYPE_F32},
                   {SO_DTYPE_F32, SO_DTYPE_BF16},
                   {SO_DTYPE_BF16, SO_DTYPE_BF16},
                   {SO_DTYPE_F16, SO_DTYPE_BF16}};
    so_adam_hparams hp = so_adam_hparams_default();
    for (int c = 0; c < 5; c++) {
        for (int empty = 0; empty < 2; empty++) {
            so_adam_buffers b = so_test_adam_buffers(empty ? 0 : n, p, g, m, v);
            b.param_dtype = combos[c].pd;
            b.moment_dtype = combos[c].md;
            CHECK_STATUS(so_adam_rollback(pool, &hp, &b, 1.0f), SO_STATUS_UNSUPPORTED);
            CHECK(strstr(so_test_last_error(), "rollback") != NULL);
            CHECK(strstr(so_test_last_error(), "f32") != NULL);
            CHECK_STATUS(so_adam_rescale(pool, &hp, &b, 1.0f, 0.5f), SO_STATUS_UNSUPPORTED);
            CHECK(strstr(so_test_last_error(), "rescale") != NULL);
        }
    }
    so_adam_buffers b = so_test_adam_buffers(n, p, g, m, v);
    so_adam_hparams bad = hp;
    bad.beta1 = 0.0f;
    CHECK_STATUS(so_adam_rollback(pool, &bad, &b, 1.0f), SO_STATUS_INVALID_ARGUMENT);
    CHECK(strstr(so_test_last_error(), "beta1") != NULL);
    bad = hp;
    bad.beta2 = 0.0f;
    CHECK_STATUS(so_adam_rollback(pool, &bad, &b, 1.0f), SO_STATUS_INVALID_ARGUMENT);
    CHECK(strstr(so_test_last_error(), "beta2") != NULL);
    bad = hp;
    bad.lr = 1.0f;
    bad.weight_decay = 1.0f; /* AdamW's decay factor 1 - lr*wd = 0 cannot be undone */
    CHECK_STATUS(so_adam_rollback(pool, &bad, &b, 1.0f), SO_STATUS_INVALID_ARGUMENT);
    CHECK(strstr(so_test_last_error(), "weight_decay") != NULL);

    /* Nothing was modified by the refusals above. */
    CHECK(memcmp(snap, p, n * 4) == 0 && memcmp(snap + n * 4, m, n * 4) == 0 && memcmp(snap + n * 8, v, n * 4) == 0 &&
          memcmp(snap + n * 12, g, n * 4) == 0);

    bad.mode = SO_ADAM_MODE_L2; /* no decay factor in Adam-L2: accepted */
    CHECK_OK(so_adam_rollback(pool, &bad, &b, 1.0f));
    free(p);
    free(m);
    free(v);
    free(g);
    free(snap);
}

int main(void) {
    so_pool *pools[SO_TEST_NUM_ISAS];
    for (int k = 0; k < SO_TEST_NUM_ISAS; k++) pools[k] = so_test_pool(so_test_isa(k), 0);
    CHECK(pools[0] != NULL);
    test_refusals(pools[0]);
    test_rollback(pools);
    test_rollback_clamps_v(pools[0]);
    test_nan_v_stays_nan(pools[0]);
    test_rescale(pools);
    for (int k = 0; k < SO_TEST_NUM_ISAS; k++) so_pool_destroy(pools[k]);
    printf("ok\n");
    return 0;
}
