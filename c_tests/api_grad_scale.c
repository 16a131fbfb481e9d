/* grad_scale is applied as the gradient is loaded, after promotion to f32: a step with
 * scale s on a bf16 (or f16, or f32) gradient is bit-identical to a step with scale 1 on
 * the f32 gradient (float)g * s computed beforehand, for every param and moment dtype,
 * both modes, every instruction set; out_grad_sumsq is identical too. Also: check_finite
 * on a finite gradient changes no bit of the result; so_grad_sumsq reports the same sum
 * as so_adam_update.
 */
#include "so_test.h"

static const uint32_t PARAM_DTYPES[3] = {SO_DTYPE_F32, SO_DTYPE_BF16, SO_DTYPE_F16};
static const uint32_t MOMENT_DTYPES[2] = {SO_DTYPE_F32, SO_DTYPE_BF16};
static const float SCALES[4] = {0.37f, 1024.5f, 3.1e-5f, 7.0f};

typedef struct state {
    void *p, *m, *v, *copy;
} state;

static void step(so_pool *pool, const so_adam_hparams *hp, size_t n, uint32_t pd, uint32_t md, uint32_t cd,
                 const void *grad, uint32_t gd, float scale, bool check_finite, const state *st, double *sumsq) {
    so_adam_buffers b = so_test_adam_buffers(n, st->p, grad, st->m, st->v);
    b.param_copy = st->copy;
    b.param_dtype = pd;
    b.grad_dtype = gd;
    b.moment_dtype = md;
    b.param_copy_dtype = cd;
    so_update_options o = so_update_options_default();
    o.grad_scale = scale;
    o.check_finite = check_finite;
    CHECK_OK(so_adam_update(pool, hp, &b, &o, sumsq));
}

static state clone(const state *s, size_t n, uint32_t pd, uint32_t md, uint32_t cd) {
    state c;
    c.p = so_test_dup(s->p, n * so_dtype_size(pd));
    c.m = so_test_dup(s->m, n * so_dtype_size(md));
    c.v = so_test_dup(s->v, n * so_dtype_size(md));
    c.copy = cd == SO_DTYPE_NONE ? NULL : so_test_dup(s->copy, n * so_dtype_size(cd));
    return c;
}

static void release(state *s) {
    free(s->p);
    free(s->m);
    free(s->v);
    free(s->copy);
}

static bool same_state(const state *a, const state *b, size_t n, uint32_t pd, uint32_t md, uint32_t cd) {
    return memcmp(a->p, b->p, n * so_dtype_size(pd)) == 0 && memcmp(a->m, b->m, n * so_dtype_size(md)) == 0 &&
           memcmp(a->v, b->v, n * so_dtype_size(md)) == 0 &&
           (cd == SO_DTYPE_NONE || memcmp(a->copy, b->copy, n * so_dtype_size(cd)) == 0);
}

int main(void) {
    const size_t n = 8192 * 2 + 13;
    so_rng rng = so_rng_new(42);
    size_t combos = 0;
    for (int k = 0; k < SO_TEST_NUM_ISAS; k++) {
        so_pool *pool = so_test_pool(so_test_isa(k), 0);
        if (!pool) continue;
        for (int pi = 0; pi < 3; pi++)
            for (int mi = 0; mi < 2; mi++)
                for (int gi = 0; gi < 3; gi++)
                    for (int mode = 0; mode < 2; mode++) {
                        uint32_t pd = PARAM_DTYPES[pi], md = MOMENT_DTYPES[mi], gd = PARAM_DTYPES[gi];
                        uint32_t cd = mode ? SO_DTYPE_BF16 : SO_DTYPE_F16;
                        float scale = SCALES[so_rng_below(&rng, 4)];
                        so_adam_hparams hp = so_adam_hparams_default();
                        hp.mode = mode ? SO_ADAM_MODE_L2 : SO_ADAM_MODE_ADAMW;
                        hp.weight_decay = 0.05f;
                        hp.step = 1 + so_rng_below(&rng, 50);

                        state s0;
                        s0.p = so_test_malloc(n * so_dtype_size(pd));
                        s0.m = so_test_malloc(n * so_dtype_size(md));
                        s0.v = so_test_malloc(n * so_dtype_size(md));
                        s0.copy = so_test_malloc(n * so_dtype_size(cd));
                        memset(s0.copy, 0, n * so_dtype_size(cd));
                        void *g = so_test_malloc(n * so_dtype_size(gd));
                        float *g_scaled = (float *)so_test_malloc(n * sizeof(float));
                        for (size_t i = 0; i < n; i++) {
                            so_store(s0.p, pd, i, so_rng_normalish(&rng, 0.5));
                            so_store(s0.m, md, i, so_rng_normalish(&rng, 1e-3));
                            double sd = so_rng_normalish(&rng, 1e-3);
                            so_store(s0.v, md, i, sd * sd);
                            so_store(g, gd, i, so_rng_normalish(&rng, 1e-2));
                            float loaded = so_load(g, gd, i);
                            g_scaled[i] = loaded * scale; /* one f32 multiplication */
                        }

                        state a = clone(&s0, n, pd, md, cd), b = clone(&s0, n, pd, md, cd);
                        state c = clone(&s0, n, pd, md, cd);
                        double sum_a = -1, sum_b = -2, sum_c = -3, sum_d = -4;
                        step(pool, &hp, n, pd, md, cd, g, gd, scale, false, &a, &sum_a);
                        step(pool, &hp, n, pd, md, cd, g_scaled, SO_DTYPE_F32, 1.0f, false, &b, &sum_b);
                        step(pool, &hp, n, pd, md, cd, g, gd, scale, true, &c, &sum_c);
                        CHECK_OK(so_grad_sumsq(pool, g, gd, n, scale, &sum_d));
                        if (!same_state(&a, &b, n, pd, md, cd)) {
                            for (size_t i = 0; i < n; i++) {
                                if (so_raw(a.p, pd, i) != so_raw(b.p, pd, i) ||
                                    so_raw(a.m, md, i) != so_raw(b.m, md, i) ||
                                    so_raw(a.v, md, i) != so_raw(b.v, md, i)) {
                                    fprintf(stderr, "element %zu: p %.9g vs %.9g, m %.9g vs %.9g, v %.9g vs %.9g\n", i,
                                            (double)so_load(a.p, pd, i), (double)so_load(b.p, pd, i),
                                            (double)so_load(a.m, md, i), (double)so_load(b.m, md, i),
                                            (double)so_load(a.v, md, i), (double)so_load(b.v, md, i));
                                    break;
                                }
                            }
                            CHECKF(false, "%s: param %s, moments %s, grad %s, mode %u, scale %g: scaled step differs",
                                   so_isa_name(so_test_isa(k)), so_dtype_name(pd), so_dtype_name(md), so_dtype_name(gd),
                                   (unsigned)hp.mode, (double)scale);
                        }
                        CHECKF(memcmp(&sum_a, &sum_b, sizeof sum_a) == 0, "sumsq %.17g vs %.17g", sum_a, sum_b);
                        CHECKF(same_state(&a, &c, n, pd, md, cd), "check_finite changed the result");
                        CHECKF(memcmp(&sum_a, &sum_c, sizeof sum_a) == 0, "sumsq with check_finite %.17g vs %.17g",
                               sum_a, sum_c);
                        CHECKF(memcmp(&sum_a, &sum_d, sizeof sum_a) == 0, "so_grad_sumsq %.17g vs %.17g", sum_d, sum_a);
                        /* A scale that is not applied would show: the states must differ
                         * from a step with scale 1 on the unscaled gradient. */
                        state e = clone(&s0, n, pd, md, cd);
                        step(pool, &hp, n, pd, md, cd, g, gd, 1.0f, false, &e, NULL);
                        CHECK(!same_state(&a, &e, n, pd, md, cd));

                        release(&a);
                        release(&b);
                        release(&c);
                        release(&e);
                        release(&s0);
                        free(g);
                        free(g_scaled);
                        combos++;
                    }
        so_pool_destroy(pool);
    }
    printf("%zu combinations bit-identical\n", combos);
    printf("ok\n");
    return 0;
}
