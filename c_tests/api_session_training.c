/* A training loop through the session's C API, checked against a plain reference written
 * here: every step the reference takes the session's state before the step, the complete
 * gradient of every sub-group (accumulated over micro-steps, late gradients added, zeros for
 * a missing slice) and calls so_adam_update on it once, with the factor the session reports
 * (so_step_result.grad_factor). The factor itself is checked against the norm, clip
 * coefficient and loss scale computed here from the same gradients.
 *
 * Model: four sub-groups (seven named slices) in two param groups, registered in forward
 * order; gradients arrive in reverse order, as in backward. The scenario (PLAN below) has
 * an LR schedule applied with so_session_set_group before every step, clipping that triggers,
 * clipping enabled but not triggering, a skip by the caller's overflow flag, a non-finite
 * gradient (its speculative step's ticket fails with SO_STATUS_NON_FINITE and the step is
 * skipped), a given infinite norm, micro-step accumulation (also of a slice that has no
 * gradient in the last micro-step), late gradients, missing slices, hyperparameters changed
 * between backward and step, the caller-given norm from so_session_local_grad_sumsq, and
 * loss scales 1 to 1024.
 *
 * Per sub-group the test predicts what the session must have done (kept, stepped, rescaled,
 * rolled back, redone, or left alone), checks the result's counters against the prediction
 * and against the numbers written in PLAN, then compares the session's master weights and
 * moments (read from a checkpoint: the C API has no call that returns moments):
 * - kept, stepped, untouched sub-groups bit for bit; so every step whose result reports
 *   rescaled == 0 && rolled_back == 0 && redone == 0 is bit-exact as a whole;
 * - rescaled, rolled back and redone sub-groups within the error bounds of tol_* below.
 * The reference then adopts the session's state, so that the tolerance of one step does not
 * carry into the next.
 *
 * The reference runs on a pool of its own with the portable instruction set and one thread,
 * the session on a two-thread pool with the widest instruction set: the kernels are
 * documented to give the same bits for every ISA and thread count.
 */
#include "session_test.h"

/* ------------------------------------------------------------------------------ model */

static const so_st_sg_def MODEL[] = {
    {0, 2, {{"embed", 1500}, {"embed.norm", 37}}},
    {0, 2, {{"l0.w", 2048}, {"l0.b", 64}}},
    {1, 1, {{"l1.w", 3000}}},
    {1, 2, {{"head.w", 1111}, {"head.b", 9}}},
};
#define NUM_SG 4
#define NUM_SLICES 7

/* ------------------------------------------------------------------------- scenario */

enum { CLIP_OFF, CLIP_TRIGGERS, CLIP_ABOVE };

typedef struct plan_step {
    float loss_scale;
    uint32_t micro_steps;
    int clip;          /* CLIP_OFF: max_norm 0; CLIP_TRIGGERS: half the norm; CLIP_ABOVE: 4x the norm */
    int missing;       /* slice without any gradient this step, or -1 */
    int partial;       /* slice without a gradient in the last micro-step (only earlier), or -1 */
    int late;          /* slice that gets a second gradient after its sub-group completed, or -1 */
    int nonfinite;     /* slice whose gradient holds an inf, or -1 */
    int changed_group; /* group whose hyperparameters change between backward and step, or -1 */
    int norm;          /* 0: local; 1: given, from so_session_local_grad_sumsq; 2: given +inf */
    bool overflow;
    /* What the scenario implies for the result: */
    uint32_t speculative, kept, rescaled, rolled_back, redone, stepped, late_gradients;
    bool skipped;
} plan_step;

/* Slices: 0 embed, 1 embed.norm (sub-group 0); 2 l0.w, 3 l0.b (1); 4 l1.w (2); 5 head.w,
 * 6 head.b (3). */
/* clang-format off: a hand-aligned table */
static const plan_step PLAN[] = {
    /*  S    mic clip           miss part late nonf chg norm ovf   spec kept resc rb redo stp late skip */
    {1024.f, 1, CLIP_ABOVE, -1, -1, -1, -1, -1, 0, false, 4, 4, 0, 0, 0, 0, 0, false},
    {1024.f, 1, CLIP_TRIGGERS, -1, -1, -1, -1, -1, 0, false, 4, 0, 4, 0, 0, 0, 0, false},
    {1024.f, 1, CLIP_OFF, -1, -1, -1, -1, -1, 0, true, 4, 0, 0, 4, 0, 0, 0, true},
    {256.f, 3, CLIP_OFF, -1, -1, -1, -1, -1, 0, false, 4, 4, 0, 0, 0, 0, 0, false},
    {256.f, 1, CLIP_OFF, -1, -1, 3, -1, -1, 0, false, 4, 3, 0, 0, 1, 0, 1, false},
    {256.f, 1, CLIP_OFF, 4, -1, -1, -1, -1, 0, false, 3, 3, 0, 0, 0, 1, 0, false},
    {256.f, 1, CLIP_OFF, -1, -1, -1, 6, -1, 0, false, 4, 0, 0, 3, 0, 0, 0, true},
    {512.f, 1, CLIP_OFF, -1, -1, -1, -1, 1, 0, false, 4, 2, 0, 0, 2, 0, 0, false},
    {512.f, 2, CLIP_TRIGGERS, 1, -1, -1, -1, -1, 0, false, 3, 0, 3, 0, 0, 1, 0, false},
    {512.f, 1, CLIP_TRIGGERS, -1, -1, 5, -1, -1, 0, false, 4, 0, 3, 0, 1, 0, 1, false},
    {512.f, 1, CLIP_TRIGGERS, -1, -1, -1, -1, -1, 1, false, 4, 0, 4, 0, 0, 0, 0, false},
    {1.f, 1, CLIP_OFF, -1, -1, -1, -1, -1, 1, false, 4, 4, 0, 0, 0, 0, 0, false},
    {1.f, 2, CLIP_OFF, -1, 2, -1, -1, -1, 0, false, 3, 3, 0, 0, 0, 1, 0, false},
    {64.f, 1, CLIP_OFF, -1, -1, 3, -1, -1, 0, true, 4, 0, 0, 4, 0, 0, 1, true},
    {64.f, 1, CLIP_TRIGGERS, -1, -1, -1, -1, -1, 2, false, 4, 0, 0, 4, 0, 0, 0, true},
    {64.f, 1, CLIP_TRIGGERS, -1, -1, -1, -1, 0, 0, false, 4, 0, 2, 0, 2, 0, 0, false},
    {64.f, 2, CLIP_ABOVE, -1, -1, -1, -1, -1, 1, false, 4, 4, 0, 0, 0, 0, 0, false},
};
/* clang-format on */
#define NUM_STEPS (sizeof PLAN / sizeof PLAN[0])

/* The LR schedule: linear warm-up over 5 steps, then a slow decay. */
static so_group_hparams schedule(uint32_t group, size_t step) {
    so_group_hparams h = so_group_hparams_default();
    double warm = step < 5 ? (double)(step + 1) / 5.0 : 1.0 / (1.0 + 0.05 * (double)(step - 4));
    if (group == 0) {
        h.lr = 2e-3 * warm;
        h.weight_decay = 0.01;
    } else {
        h.lr = 1e-3 * warm;
        h.beta1 = 0.85;
        h.beta2 = 0.995;
        h.eps = 1e-6;
        h.weight_decay = 0.0;
    }
    return h;
}

static so_group_hparams changed(so_group_hparams h) {
    h.lr *= 0.5;
    h.beta1 *= 0.98;
    h.eps *= 2.0;
    return h;
}

/* ------------------------------------------------------------------- the reference */

static so_pool *ref_pool;

static so_adam_hparams adam_hparams(so_group_hparams g, uint64_t step) {
    so_adam_hparams hp = so_adam_hparams_default();
    hp.mode = SO_ADAM_MODE_ADAMW;
    hp.lr = g.lr;
    hp.beta1 = g.beta1;
    hp.beta2 = g.beta2;
    hp.eps = g.eps;
    hp.weight_decay = g.weight_decay;
    hp.bias_correction = true;
    hp.step = step;
    return hp;
}

/* One plain Adam step of (p, m, v) in place with `grad * factor`. */
static void ref_update(so_group_hparams g, uint64_t step, float *p, float *m, float *v, const float *grad, size_t n,
                       float factor) {
    so_adam_hparams hp = adam_hparams(g, step);
    so_adam_buffers b = so_test_adam_buffers(n, p, grad, m, v);
    so_test_adam_step(ref_pool, &hp, &b, factor, NULL);
}

/* ------------------------------------------------------------------- error bounds
 *
 * u = 2^-24 is the unit roundoff of f32. The session's non-exact paths start from a stored
 * f32 state and apply formulas that are exact in real arithmetic (documented with
 * so_adam_rollback and so_adam_rescale); each f32 operation in them adds at most u times the
 * magnitude of the terms it combines. So the difference from the value wanted is a few u
 * times the magnitudes of the terms involved, plus, for p, the step size (lr / bc1) times
 * the effect on m / denom of the errors in m and v. K = 8 "few ulps" per term is several
 * times what the formulas need (at most 3-4 roundings per term), yet the bounds stay
 * around 1e-6 relative to the values: far below any real error (a wrong factor, a missing
 * rollback or a lost gradient changes the results by 1e-3 or more relative to the step).
 *
 * - rollback (skipped step, documented: "a few ulps of |p| and (lr/bc1)|m/denom| for p, of
 *   |m| and (1-b1)|g| relative to b1 for m"): m by K u (|m_s| + (1-b1)|g|) / b1, v by
 *   K u (v_s + (1-b2) g^2) / b2, p by K u (|p_s| + (lr/bc1)|m_s|/d_s) / (1 - lr wd), where
 *   (p_s, m_s, v_s) is the speculative state (computed here with so_adam_update, which is
 *   the very step the session took) and g the scaled gradient of the speculative step.
 * - rescale: m by K u (|m_s| + |m_d| + (1-b1)(|g_s| + |g_d|)), v by
 *   K u (v_s + v_d + (1-b2)(g_s^2 + g_d^2)) (this is where the rounding of the larger v_s
 *   carries into the smaller v_d, as the documentation of so_adam_rescale says), p by its own
 *   roundings K u (|p_s| + |p_d|) plus the step's sensitivity (below); (p_d, m_d, v_d) is the
 *   reference's direct step, g_d the finally scaled gradient.
 * - redo (rollback, then a step with the final gradient and hyperparameters): the rollback
 *   bounds, carried through the step (m's by b1, v's by b2, p's by 1 - lr wd), plus K u of
 *   the step's terms and the sensitivity of p.
 * - sensitivity of p to errors e_m, e_v of the final m and v: with d = sqrt(v)/sqrt(bc2) + eps
 *   and e_d = min(e_v / (2 sqrt(v)), sqrt(e_v)) / sqrt(bc2) (a bound of the change of d),
 *   (lr/bc1) (e_m / d_lo + |m| e_d / (d d_lo)) where d_lo = max(d - e_d, eps).
 */
#define U 0x1p-24
#define K 8.0

typedef struct bounds {
    double p, m, v;
} bounds;

typedef struct consts {
    double lr, b1, b2, eps, wd, bc1, bc2;
} consts;

static consts consts_of(so_group_hparams g, uint64_t step) {
    consts c;
    c.lr = g.lr;
    c.b1 = g.beta1;
    c.b2 = g.beta2;
    c.eps = g.eps;
    c.wd = g.weight_decay;
    c.bc1 = 1.0 - pow(g.beta1, (double)step);
    c.bc2 = 1.0 - pow(g.beta2, (double)step);
    return c;
}

static double denom(const consts *c, double v) { return sqrt(fmax(v, 0.0)) / sqrt(c->bc2) + c->eps; }

static double p_sensitivity(const consts *c, double m, double v, double e_m, double e_v) {
    double d = denom(c, v);
    double e_d = (v > 0.0 ? fmin(e_v / (2.0 * sqrt(v)), sqrt(e_v)) : sqrt(e_v)) / sqrt(c->bc2);
    double d_lo = fmax(d - e_d, c->eps);
    return (c->lr / c->bc1) * (e_m / d_lo + fabs(m) * e_d / (d * d_lo));
}

/* (ps, ms, vs): the speculative state; gs: the scaled speculative gradient. */
static bounds tol_rollback(const consts *c, double ps, double ms, double vs, double gs) {
    bounds b;
    b.m = K * U * (fabs(ms) + (1.0 - c->b1) * fabs(gs)) / c->b1;
    b.v = K * U * (vs + (1.0 - c->b2) * gs * gs) / c->b2;
    b.p = K * U * (fabs(ps) + (c->lr / c->bc1) * fabs(ms) / denom(c, vs)) / (1.0 - c->lr * c->wd);
    return b;
}

static bounds tol_rescale(const consts *c, double ps, double ms, double vs, double gs, double pd, double md, double vd,
                          double gd) {
    bounds b;
    b.m = K * U * (fabs(ms) + fabs(md) + (1.0 - c->b1) * (fabs(gs) + fabs(gd)));
    b.v = K * U * (vs + vd + (1.0 - c->b2) * (gs * gs + gd * gd));
    b.p = K * U * (fabs(ps) + fabs(pd)) + p_sensitivity(c, md, vd, b.m, b.v) +
          K * U * (c->lr / c->bc1) * (fabs(ms) / denom(c, vs) + fabs(md) / denom(c, vd));
    return b;
}

/* cs: constants of the speculative step; cf: of the final one. (p0, m0, v0): the state
 * before the step; gd: the finally scaled gradient; (pd, md, vd): the direct step. */
static bounds tol_redo(const consts *cs, const consts *cf, double ps, double ms, double vs, double gs, double p0,
                       double m0, double v0, double gd, double pd, double md, double vd) {
    bounds rb = tol_rollback(cs, ps, ms, vs, gs);
    bounds b;
    b.m = cf->b1 * rb.m + K * U * (cf->b1 * fabs(m0) + (1.0 - cf->b1) * fabs(gd) + fabs(md));
    b.v = cf->b2 * rb.v + K * U * (cf->b2 * v0 + (1.0 - cf->b2) * gd * gd + vd);
    b.p = rb.p * (1.0 - cf->lr * cf->wd) + p_sensitivity(cf, md, vd, b.m, b.v) +
          K * U * (fabs(p0) + fabs(pd) + (cf->lr / cf->bc1) * fabs(md) / denom(cf, vd));
    return b;
}

/* ------------------------------------------------------------------------- the test */

enum outcome { UNTOUCHED, KEPT, STEPPED, RESCALED, ROLLED_BACK, REDONE };
static const char *const OUTCOME_NAME[] = {"untouched", "kept", "stepped", "rescaled", "rolled back", "redone"};

static double worst_ratio[6]; /* max |got - want| / bound per outcome, for the log */
static double worst_rel_tol;  /* max bound relative to |want| + lr, for the log */

static void check_close(const char *what, size_t step, size_t sg, size_t j, enum outcome o, double got, double want,
                        double bound, double scale) {
    double err = fabs(got - want);
    CHECKF(err <= bound, "step %zu sub-group %zu (%s) %s[%zu]: got %.9g, want %.9g, error %.3g > bound %.3g", step, sg,
           OUTCOME_NAME[o], what, j, got, want, err, bound);
    if (bound > 0.0 && err / bound > worst_ratio[o]) worst_ratio[o] = err / bound;
    if (bound / (fabs(want) + scale) > worst_rel_tol) worst_rel_tol = bound / (fabs(want) + scale);
}

static bool same_bits(const float *a, const float *b, size_t n, size_t *at) {
    for (size_t j = 0; j < n; j++) {
        if (so_f32_to_bits(a[j]) != so_f32_to_bits(b[j])) {
            *at = j;
            return false;
        }
    }
    return true;
}

int main(void) {
    char path[512];
    so_st_temp_path(path, sizeof path, "training");

    ref_pool = so_test_pool(SO_ISA_PORTABLE, 1);
    CHECK(ref_pool != NULL);
    so_pool *pool = NULL;
    so_pool_options po = so_pool_options_default();
    po.num_threads = 2;
    CHECK_OK(so_pool_create(&po, &pool));

    so_session_options opts = so_session_options_default();
    opts.pool = pool;
    opts.speculation = SO_SPECULATION_ON; /* the paths predicted below are the speculative ones */
    so_session *s = NULL;
    CHECK_OK(so_session_create(&opts, &s));
    so_pool_destroy(pool); /* the session keeps its own reference */
    for (uint32_t g = 0; g < 2; g++) {
        so_group_hparams h = schedule(g, 0);
        uint32_t id = 99;
        CHECK_OK(so_session_add_group(s, &h, &id));
        CHECK(id == g);
    }
    so_st_model model;
    so_st_model_init(&model, s, MODEL, NUM_SG, 11);
    CHECK(model.num_slices == NUM_SLICES);
    for (size_t i = 0; i < NUM_SLICES; i++) CHECK(model.slice_id[i] == (uint32_t)i);
    size_t total = 0;
    for (size_t sg = 0; sg < NUM_SG; sg++) total += model.sg_numel[sg];

    so_st_state before = so_st_state_initial(&model), after = so_st_state_initial(&model);
    so_st_state spec = so_st_state_initial(&model), direct = so_st_state_initial(&model);
    float *acc[NUM_SG], *spec_grad[NUM_SG];
    for (size_t sg = 0; sg < NUM_SG; sg++) {
        acc[sg] = (float *)so_test_malloc(model.sg_numel[sg] * sizeof(float));
        spec_grad[sg] = (float *)so_test_malloc(model.sg_numel[sg] * sizeof(float));
    }
    float *scratch = (float *)so_test_malloc(4096 * sizeof(float));
    so_rng rng = so_rng_new(2024);
    so_ticket last_ticket = 0;
    unsigned seen_clipped = 0, seen_rescaled_steps = 0, seen_exact_steps = 0;

    for (size_t step = 0; step < NUM_STEPS; step++) {
        const plan_step *ev = &PLAN[step];
        const uint32_t last_micro = ev->micro_steps - 1;

        /* The LR schedule, before the backward: speculative steps use it. */
        so_group_hparams spec_hp[2], final_hp[2];
        for (uint32_t g = 0; g < 2; g++) {
            spec_hp[g] = final_hp[g] = schedule(g, step);
            CHECK_OK(so_session_set_group(s, g, &spec_hp[g]));
        }

        CHECK_OK(so_session_begin_step(s, ev->loss_scale, ev->micro_steps));
        bool got[NUM_SLICES] = {false};
        size_t done_in_last[NUM_SG] = {0};
        bool submitted[NUM_SG] = {false}, spec_failed[NUM_SG] = {false}, late_after[NUM_SG] = {false};
        so_ticket spec_ticket[NUM_SG] = {0};
        for (size_t sg = 0; sg < NUM_SG; sg++) memset(acc[sg], 0, model.sg_numel[sg] * sizeof(float));
        const double magnitude = 0.004 * (1.0 + (double)(step % 3));

        for (uint32_t micro = 0; micro < ev->micro_steps; micro++) {
            if (micro > 0) CHECK_OK(so_session_next_micro_step(s));
            for (size_t k = NUM_SLICES; k-- > 0;) {
                if ((int)k == ev->missing || ((int)k == ev->partial && micro == last_micro)) continue;
                size_t sg = model.slice_sg[k], off = model.slice_offset[k], n = model.slice_numel[k];
                for (size_t j = 0; j < n; j++) {
                    scratch[j] = (float)(so_rng_normalish(&rng, magnitude) * (double)ev->loss_scale);
                }
                if ((int)k == ev->nonfinite) scratch[n / 2] = INFINITY;
                so_ticket t = 12345;
                CHECK_OK(so_session_grad_copy(s, model.slice_id[k], scratch, n, &t));
                float *dst = acc[sg] + off;
                for (size_t j = 0; j < n; j++) dst[j] = got[k] ? dst[j] + scratch[j] : scratch[j];
                got[k] = true;
                /* The hand-off that completes a sub-group in the last micro-step queues its
                 * speculative step and returns its ticket; every other one returns 0. */
                bool completes = false;
                if (micro == last_micro) {
                    size_t slices_of_sg = MODEL[sg].num_slices;
                    completes = ++done_in_last[sg] == slices_of_sg;
                }
                if (completes) {
                    CHECKF(t > last_ticket, "step %zu: ticket %llu after %llu", step, (unsigned long long)t,
                           (unsigned long long)last_ticket);
                    last_ticket = t;
                    spec_ticket[sg] = t;
                    submitted[sg] = true;
                    memcpy(spec_grad[sg], acc[sg], model.sg_numel[sg] * sizeof(float));
                    spec_failed[sg] =
                        (int)k == ev->nonfinite || (ev->nonfinite >= 0 && model.slice_sg[ev->nonfinite] == sg);
                } else {
                    CHECKF(t == 0, "step %zu slice %zu: ticket %llu for a hand-off that completes nothing", step, k,
                           (unsigned long long)t);
                }
            }
        }
        /* Every speculative step runs before what follows (none is cancelled at step(): the
         * schedule tests cover that path); a non-finite one fails, checked below. */
        for (size_t sg = 0; sg < NUM_SG; sg++) {
            if (spec_ticket[sg] != 0) {
                so_status ws = so_ticket_wait(s, spec_ticket[sg], -1);
                (void)ws;
            }
        }
        uint32_t late_count = 0;
        if (ev->late >= 0) {
            size_t k = (size_t)ev->late, sg = model.slice_sg[k], off = model.slice_offset[k], n = model.slice_numel[k];
            CHECK(submitted[sg]);
            for (size_t j = 0; j < n; j++) {
                scratch[j] = (float)(so_rng_normalish(&rng, magnitude) * (double)ev->loss_scale);
            }
            so_ticket t = 12345;
            CHECK_OK(so_session_grad_copy(s, model.slice_id[k], scratch, n, &t));
            CHECKF(t == 0, "a late gradient queues nothing (ticket %llu)", (unsigned long long)t);
            for (size_t j = 0; j < n; j++) acc[sg][off + j] += scratch[j];
            late_after[sg] = true;
            late_count++;
        }
        if (ev->changed_group >= 0) {
            final_hp[ev->changed_group] = changed(spec_hp[ev->changed_group]);
            CHECK_OK(so_session_set_group(s, (uint32_t)ev->changed_group, &final_hp[ev->changed_group]));
        }

        /* The reference decision, from the complete gradients. */
        const float unscale = (float)(1.0 / (double)ev->loss_scale);
        double local = 0.0; /* per slice, in forward order, as the session takes them at hand-over */
        for (size_t k = 0; k < NUM_SLICES; k++) {
            double ss = 0.0;
            CHECK_OK(so_grad_sumsq(ref_pool, acc[model.slice_sg[k]] + model.slice_offset[k], SO_DTYPE_F32,
                                   model.slice_numel[k], unscale, &ss));
            local += ss;
        }
        const double ref_norm = sqrt(local);
        so_step_args args = so_step_args_default();
        args.max_norm = ev->clip == CLIP_OFF ? 0.0 : ev->clip == CLIP_TRIGGERS ? 0.5 * ref_norm : 4.0 * ref_norm;
        if (!isfinite(args.max_norm)) args.max_norm = 1.0;
        args.overflow = ev->overflow;
        double norm = ref_norm;
        if (ev->norm == 1) {
            double sumsq = -1.0;
            CHECK_OK(so_session_local_grad_sumsq(s, -1, &sumsq));
            CHECKF(memcmp(&sumsq, &local, sizeof sumsq) == 0, "step %zu: local_grad_sumsq %.17g, reference %.17g", step,
                   sumsq, local);
            args.norm_source = SO_NORM_SOURCE_GIVEN;
            args.global_norm = sqrt(sumsq);
        } else if (ev->norm == 2) {
            args.norm_source = SO_NORM_SOURCE_GIVEN;
            args.global_norm = INFINITY;
            norm = INFINITY;
        }
        const bool skip = ev->overflow || !isfinite(local) || !isfinite(norm);
        const double clip = skip ? 1.0 : args.max_norm > 0.0 ? fmin(1.0, args.max_norm / (norm + 1e-6)) : 1.0;
        const float factor = (float)(clip / (double)ev->loss_scale);

        /* A non-finite gradient fails its speculative step's ticket, and nothing else. */
        if (ev->nonfinite >= 0) {
            size_t sg = model.slice_sg[ev->nonfinite];
            CHECK(spec_ticket[sg] != 0);
            EXPECT_REFUSED(so_ticket_wait(s, spec_ticket[sg], -1), SO_STATUS_NON_FINITE, "so_ticket_wait",
                           "inf or NaN");
            char sub[64];
            snprintf(sub, sizeof sub, "sub-group %zu", sg);
            CHECKF(strstr(so_test_last_error(), sub) != NULL, "the message names the sub-group: %s",
                   so_test_last_error());
            EXPECT_REFUSED(so_ticket_query(s, spec_ticket[sg]), SO_STATUS_NON_FINITE, "so_ticket_query", sub);
            for (size_t o = 0; o < NUM_SG; o++) {
                if (o != sg && spec_ticket[o] != 0) CHECK_OK(so_ticket_wait(s, spec_ticket[o], -1));
            }
        }

        so_ticket st = 0;
        CHECK_OK(so_session_step(s, &args, &st));
        CHECK(st > last_ticket);
        const so_step_result r = so_test_step_result(s, st);
        /* Final tickets: one per sub-group, in registration order, after the speculative
         * steps and before the step's ticket. */
        so_ticket prev = last_ticket;
        for (uint32_t sg = 0; sg < NUM_SG; sg++) {
            so_ticket ft = 0;
            CHECK_OK(so_session_final_ticket(s, sg, &ft));
            CHECKF(ft > prev && ft < st, "step %zu: final ticket %llu of sub-group %u (previous %llu, step %llu)", step,
                   (unsigned long long)ft, sg, (unsigned long long)prev, (unsigned long long)st);
            CHECK_OK(so_ticket_query(s, ft));
            prev = ft;
        }
        last_ticket = st;

        /* The decision. */
        CHECKF(r.serial == step + 1, "serial %llu", (unsigned long long)r.serial);
        CHECKF(r.skipped == skip && skip == ev->skipped, "step %zu: skipped %d, predicted %d, planned %d", step,
               (int)r.skipped, (int)skip, (int)ev->skipped);
        if (isfinite(local)) {
            CHECKF(r.global_norm == norm, "step %zu: global norm %.17g, reference %.17g", step, r.global_norm, norm);
        }
        CHECKF(r.clip_coef == clip, "step %zu: clip %.17g, reference %.17g", step, r.clip_coef, clip);
        CHECKF(so_f32_to_bits(r.grad_factor) == so_f32_to_bits(factor), "step %zu: factor %.9g, reference %.9g", step,
               (double)r.grad_factor, (double)factor);
        CHECK(r.loss_scale == ev->loss_scale && r.next_loss_scale == ev->loss_scale);
        if (ev->clip == CLIP_TRIGGERS && !skip) {
            CHECKF(r.clip_coef < 0.6 && r.clip_coef > 0.4, "step %zu: clipping triggers (%.6f)", step, r.clip_coef);
            seen_clipped++;
        }

        /* Per sub-group: what the session must have done, then the comparison. */
        so_st_read_state(&model, path, &after);
        uint32_t n_spec = 0, tally[6] = {0};
        for (size_t sg = 0; sg < NUM_SG; sg++) {
            const uint32_t g = model.sg_group[sg];
            const size_t n = model.sg_numel[sg];
            const uint64_t t = before.count[sg] + 1;
            const bool changed_hp = ev->changed_group == (int)g;
            n_spec += submitted[sg];
            enum outcome o;
            if (!submitted[sg]) {
                o = skip ? UNTOUCHED : STEPPED;
            } else if (spec_failed[sg]) {
                o = UNTOUCHED; /* refused: nothing was modified, and the step is skipped */
                CHECK(skip);
            } else if (skip) {
                o = ROLLED_BACK;
            } else if (late_after[sg] || changed_hp) {
                o = REDONE;
            } else if (factor != unscale) {
                o = RESCALED;
            } else {
                o = KEPT;
            }
            tally[o]++;
            CHECKF(after.count[sg] == before.count[sg] + (skip ? 0u : 1u), "step %zu sub-group %zu: step count %llu",
                   step, sg, (unsigned long long)after.count[sg]);

            /* The reference: the speculative step as the session took it, and the direct one. */
            memcpy(spec.p[sg], before.p[sg], n * sizeof(float));
            memcpy(spec.m[sg], before.m[sg], n * sizeof(float));
            memcpy(spec.v[sg], before.v[sg], n * sizeof(float));
            memcpy(direct.p[sg], before.p[sg], n * sizeof(float));
            memcpy(direct.m[sg], before.m[sg], n * sizeof(float));
            memcpy(direct.v[sg], before.v[sg], n * sizeof(float));
            if (submitted[sg] && !spec_failed[sg]) {
                ref_update(spec_hp[g], t, spec.p[sg], spec.m[sg], spec.v[sg], spec_grad[sg], n, unscale);
            }
            if (!skip) {
                ref_update(final_hp[g], t, direct.p[sg], direct.m[sg], direct.v[sg], acc[sg], n, factor);
            }
            if (o == UNTOUCHED || o == KEPT || o == STEPPED) {
                /* Exact paths: bit for bit (direct == before when skipped). */
                size_t at = 0;
                CHECKF(same_bits(after.p[sg], direct.p[sg], n, &at),
                       "step %zu sub-group %zu (%s): master[%zu] %.9g vs %.9g", step, sg, OUTCOME_NAME[o], at,
                       (double)after.p[sg][at], (double)direct.p[sg][at]);
                CHECKF(same_bits(after.m[sg], direct.m[sg], n, &at),
                       "step %zu sub-group %zu (%s): exp_avg[%zu] %.9g vs %.9g", step, sg, OUTCOME_NAME[o], at,
                       (double)after.m[sg][at], (double)direct.m[sg][at]);
                CHECKF(same_bits(after.v[sg], direct.v[sg], n, &at),
                       "step %zu sub-group %zu (%s): exp_avg_sq[%zu] %.9g vs %.9g", step, sg, OUTCOME_NAME[o], at,
                       (double)after.v[sg][at], (double)direct.v[sg][at]);
                continue;
            }
            const consts cs = consts_of(spec_hp[g], t), cf = consts_of(final_hp[g], t);
            for (size_t j = 0; j < n; j++) {
                const double ps = spec.p[sg][j], ms = spec.m[sg][j], vs = spec.v[sg][j];
                const double gs = (double)spec_grad[sg][j] * (double)unscale, gd = (double)acc[sg][j] * (double)factor;
                const double p0 = before.p[sg][j], m0 = before.m[sg][j], v0 = before.v[sg][j];
                const double pd = direct.p[sg][j], md = direct.m[sg][j], vd = direct.v[sg][j];
                bounds b;
                double wp, wm, wv;
                if (o == ROLLED_BACK) {
                    b = tol_rollback(&cs, ps, ms, vs, gs);
                    wp = p0;
                    wm = m0;
                    wv = v0;
                } else if (o == RESCALED) {
                    b = tol_rescale(&cs, ps, ms, vs, gs, pd, md, vd, gd);
                    wp = pd;
                    wm = md;
                    wv = vd;
                } else {
                    b = tol_redo(&cs, &cf, ps, ms, vs, gs, p0, m0, v0, gd, pd, md, vd);
                    wp = pd;
                    wm = md;
                    wv = vd;
                }
                check_close("master", step, sg, j, o, after.p[sg][j], wp, b.p, cs.lr);
                check_close("exp_avg", step, sg, j, o, after.m[sg][j], wm, b.m, fabs(gs) + fabs(gd));
                check_close("exp_avg_sq", step, sg, j, o, after.v[sg][j], wv, b.v, gs * gs + gd * gd);
            }
        }
        printf(
            "step %2zu: S %6g micro %u norm %.4g clip %.4f skipped %d | spec %u kept %u rescaled %u rolled back %u "
            "redone %u stepped %u late %u\n",
            step + 1, (double)ev->loss_scale, ev->micro_steps, r.global_norm, r.clip_coef, (int)r.skipped,
            r.speculative, r.kept, r.rescaled, r.rolled_back, r.redone, r.stepped, r.late_gradients);

        /* The counters: as the per-sub-group prediction says, and as the plan says. */
        CHECKF(r.speculative == n_spec && n_spec == ev->speculative,
               "step %zu: speculative %u, predicted %u, planned %u", step, r.speculative, n_spec, ev->speculative);
        CHECKF(r.kept == tally[KEPT] && r.kept == ev->kept, "step %zu: kept %u / %u / %u", step, r.kept, tally[KEPT],
               ev->kept);
        CHECKF(r.rescaled == tally[RESCALED] && r.rescaled == ev->rescaled, "step %zu: rescaled %u / %u / %u", step,
               r.rescaled, tally[RESCALED], ev->rescaled);
        CHECKF(r.rolled_back == tally[ROLLED_BACK] && r.rolled_back == ev->rolled_back,
               "step %zu: rolled back %u / %u / %u", step, r.rolled_back, tally[ROLLED_BACK], ev->rolled_back);
        CHECKF(r.redone == tally[REDONE] && r.redone == ev->redone, "step %zu: redone %u / %u / %u", step, r.redone,
               tally[REDONE], ev->redone);
        CHECKF(r.stepped == tally[STEPPED] && r.stepped == ev->stepped, "step %zu: stepped %u / %u / %u", step,
               r.stepped, tally[STEPPED], ev->stepped);
        CHECKF(r.late_gradients == late_count && late_count == ev->late_gradients, "step %zu: late %u / %u / %u", step,
               r.late_gradients, late_count, ev->late_gradients);
        if (r.rescaled == 0 && r.rolled_back == 0 && r.redone == 0) {
            seen_exact_steps++;
        }
        if (r.rescaled > 0) seen_rescaled_steps++;

        /* The next step starts from the session's state. */
        so_st_state_copy(&before, &after);
    }

    /* The scenario exercised what it claims. */
    CHECK(seen_clipped >= 4 && seen_rescaled_steps >= 4 && seen_exact_steps >= 6);
    for (size_t sg = 0; sg < NUM_SG; sg++) CHECK(after.count[sg] > 8);
    size_t bytes = 0;
    CHECK_OK(so_session_host_bytes(s, &bytes));
    /* Moments (2 x f32) and session-owned gradient buffers (f32) of every element, plus the
     * late-gradient buffers of the two sub-groups that received late gradients. */
    const size_t late_bytes = (model.sg_numel[1] + model.sg_numel[3]) * sizeof(float);
    CHECKF(bytes == total * 3 * sizeof(float) + late_bytes, "host bytes %zu, expected %zu", bytes,
           total * 3 * sizeof(float) + late_bytes);
    printf(
        "worst error / bound: rescaled %.3f, rolled back %.3f, redone %.3f; largest bound relative to the value: "
        "%.3g\n",
        worst_ratio[RESCALED], worst_ratio[ROLLED_BACK], worst_ratio[REDONE], worst_rel_tol);
    CHECK(worst_rel_tol < 1e-4);

    so_session_destroy(s);
    so_pool_destroy(ref_pool);
    remove(path);
    for (size_t sg = 0; sg < NUM_SG; sg++) {
        free(acc[sg]);
        free(spec_grad[sg]);
    }
    free(scratch);
    so_st_state_free(&before);
    so_st_state_free(&after);
    so_st_state_free(&spec);
    so_st_state_free(&direct);
    so_st_model_free(&model);
    printf("api_session_training: ok (%zu steps)\n", NUM_STEPS);
    return 0;
}
