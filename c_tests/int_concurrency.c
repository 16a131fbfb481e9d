/* Several caller threads on one pool at the same time.
 *
 * 1. Progress: thread A runs large updates back to back on a two-thread pool; thread B,
 *    started once A is busy, must complete its updates while A is still going: A stops as
 *    soon as B is done and fails the test if it reaches its budget of calls first (B
 *    starved). Progress only, not timing: no durations are asserted.
 * 2. Four caller threads with different dtype combinations on one pool, and two on the
 *    default pool (NULL), all at once.
 * Every result (parameter, moments, copy-out, sum of squares) is compared with the same
 * sequence of updates replayed by one thread on copies, on a one-thread pool: bit-identical.
 */
#include <pthread.h>
#include <sched.h>

#include "so_test.h"

typedef struct worker {
    /* configuration */
    so_pool *pool;
    size_t n;
    uint32_t pd, gd, md, cd;
    size_t max_calls; /* budget */
    int role;         /* 0 plain, 1 progress-A, 2 progress-B */
    uint64_t seed;
    /* buffers: initial state and the worker's own */
    void *p0, *m0, *v0, *g;
    void *p, *m, *v, *copy;
    /* results */
    size_t calls;
    double sumsq_last;
    size_t a_calls_at_b_start, a_calls_at_b_end;
} worker;

/* Shared by the progress pair. */
static size_t a_calls; /* updates A has completed */
static int b_done;     /* B has completed all of its updates */

static size_t load_size(const size_t *x) { return __atomic_load_n(x, __ATOMIC_SEQ_CST); }
static int load_int(const int *x) { return __atomic_load_n(x, __ATOMIC_SEQ_CST); }

static so_adam_hparams hparams_for(const worker *w, size_t call) {
    so_adam_hparams hp = so_adam_hparams_default();
    hp.mode = (w->seed % 2) ? SO_ADAM_MODE_L2 : SO_ADAM_MODE_ADAMW;
    hp.lr = 1e-3 * (1.0 + 0.01 * (double)(call % 7));
    hp.step = call + 1;
    return hp;
}

static void one_update(so_pool *pool, const worker *w, void *p, void *m, void *v, void *copy, size_t call,
                       double *sumsq) {
    so_adam_hparams hp = hparams_for(w, call);
    so_adam_buffers b = so_test_adam_buffers(w->n, p, w->g, m, v);
    b.param_copy = copy;
    b.param_dtype = w->pd;
    b.grad_dtype = w->gd;
    b.moment_dtype = w->md;
    b.param_copy_dtype = w->cd;
    so_test_adam_step(pool, &hp, &b, 0.5f + (float)(call % 3), sumsq);
}

static void *run_worker(void *arg) {
    worker *w = (worker *)arg;
    if (w->role == 2) {
        while (load_size(&a_calls) < 1) sched_yield(); /* A is busy with its second call */
        w->a_calls_at_b_start = load_size(&a_calls);
    }
    for (size_t call = 0; call < w->max_calls; call++) {
        if (w->role == 1 && load_int(&b_done)) break;
        one_update(w->pool, w, w->p, w->m, w->v, w->copy, call, &w->sumsq_last);
        w->calls = call + 1;
        if (w->role == 1) __atomic_fetch_add(&a_calls, 1, __ATOMIC_SEQ_CST);
    }
    if (w->role == 2) {
        w->a_calls_at_b_end = load_size(&a_calls);
        __atomic_store_n(&b_done, 1, __ATOMIC_SEQ_CST);
    }
    return NULL;
}

static void worker_init(worker *w, so_pool *pool, size_t n, uint32_t pd, uint32_t gd, uint32_t md, uint32_t cd,
                        size_t max_calls, int role, uint64_t seed) {
    memset(w, 0, sizeof *w);
    w->pool = pool;
    w->n = n;
    w->pd = pd;
    w->gd = gd;
    w->md = md;
    w->cd = cd;
    w->max_calls = max_calls;
    w->role = role;
    w->seed = seed;
    so_rng rng = so_rng_new(seed);
    w->p0 = so_test_malloc(n * so_dtype_size(pd));
    w->m0 = so_test_malloc(n * so_dtype_size(md));
    w->v0 = so_test_malloc(n * so_dtype_size(md));
    w->g = so_test_malloc(n * so_dtype_size(gd));
    for (size_t i = 0; i < n; i++) {
        so_store(w->p0, pd, i, so_rng_normalish(&rng, 0.5));
        so_store(w->m0, md, i, 0.0);
        so_store(w->v0, md, i, 0.0);
        so_store(w->g, gd, i, so_rng_normalish(&rng, 1e-2));
    }
    w->p = so_test_dup(w->p0, n * so_dtype_size(pd));
    w->m = so_test_dup(w->m0, n * so_dtype_size(md));
    w->v = so_test_dup(w->v0, n * so_dtype_size(md));
    w->copy = cd == SO_DTYPE_NONE ? NULL : so_test_malloc(n * so_dtype_size(cd));
}

/* Replays the worker's `calls` updates on copies, alone, on `serial`; compares bits. */
static void verify_worker(const worker *w, so_pool *serial, const char *name) {
    size_t n = w->n;
    void *p = so_test_dup(w->p0, n * so_dtype_size(w->pd));
    void *m = so_test_dup(w->m0, n * so_dtype_size(w->md));
    void *v = so_test_dup(w->v0, n * so_dtype_size(w->md));
    void *copy = w->cd == SO_DTYPE_NONE ? NULL : so_test_malloc(n * so_dtype_size(w->cd));
    double sumsq = 0.0;
    for (size_t call = 0; call < w->calls; call++) one_update(serial, w, p, m, v, copy, call, &sumsq);
    CHECKF(w->calls > 0, "%s made no update", name);
    CHECKF(memcmp(p, w->p, n * so_dtype_size(w->pd)) == 0, "%s: param differs from the serial replay", name);
    CHECKF(memcmp(m, w->m, n * so_dtype_size(w->md)) == 0, "%s: exp_avg differs from the serial replay", name);
    CHECKF(memcmp(v, w->v, n * so_dtype_size(w->md)) == 0, "%s: exp_avg_sq differs from the serial replay", name);
    if (copy) CHECKF(memcmp(copy, w->copy, n * so_dtype_size(w->cd)) == 0, "%s: copy differs", name);
    CHECKF(memcmp(&sumsq, &w->sumsq_last, sizeof sumsq) == 0, "%s: sumsq %.17g vs %.17g", name, w->sumsq_last, sumsq);
    /* The updates did something. */
    CHECKF(memcmp(w->p0, w->p, n * so_dtype_size(w->pd)) != 0, "%s: param unchanged", name);
    free(p);
    free(m);
    free(v);
    free(copy);
}

static void worker_free(worker *w) {
    free(w->p0);
    free(w->m0);
    free(w->v0);
    free(w->g);
    free(w->p);
    free(w->m);
    free(w->v);
    free(w->copy);
}

int main(void) {
    so_pool_options o = so_pool_options_default();
    o.num_threads = 2;
    so_pool *pool = NULL;
    CHECK_OK(so_pool_create(&o, &pool));
    o.num_threads = 1;
    so_pool *serial = NULL;
    CHECK_OK(so_pool_create(&o, &serial));

    /* 1. Progress. */
    {
        worker a, b;
        const size_t b_calls = 8, a_budget = 400;
        worker_init(&a, pool, (size_t)1 << 20, SO_DTYPE_F32, SO_DTYPE_F32, SO_DTYPE_F32, SO_DTYPE_NONE, a_budget, 1, 1);
        worker_init(&b, pool, 50000 + 3, SO_DTYPE_BF16, SO_DTYPE_BF16, SO_DTYPE_F32, SO_DTYPE_F16, b_calls, 2, 2);
        pthread_t ta, tb;
        CHECK(pthread_create(&ta, NULL, run_worker, &a) == 0);
        CHECK(pthread_create(&tb, NULL, run_worker, &b) == 0);
        CHECK(pthread_join(tb, NULL) == 0);
        CHECK(pthread_join(ta, NULL) == 0);
        printf(
            "progress: B made %zu updates while A made %zu (A at %zu when B started, %zu when B ended; A stopped "
            "at %zu of its %zu)\n",
            b.calls, b.a_calls_at_b_end - b.a_calls_at_b_start, b.a_calls_at_b_start, b.a_calls_at_b_end, a.calls,
            a_budget);
        CHECK(b.calls == b_calls);
        CHECKF(b.a_calls_at_b_end < a_budget, "B finished only after A had used its whole budget: starved");
        CHECK(a.calls < a_budget && a.calls >= b.a_calls_at_b_end);
        verify_worker(&a, serial, "A");
        verify_worker(&b, serial, "B");
        worker_free(&a);
        worker_free(&b);
    }

    /* 2. Four callers on one pool and two on the default pool, all at once. */
    {
        enum { NW = 6 };
        worker w[NW];
        const uint32_t pds[NW] = {SO_DTYPE_F32, SO_DTYPE_BF16, SO_DTYPE_F16, SO_DTYPE_F32, SO_DTYPE_BF16, SO_DTYPE_F32};
        const uint32_t gds[NW] = {SO_DTYPE_BF16, SO_DTYPE_F32, SO_DTYPE_F16, SO_DTYPE_F16, SO_DTYPE_BF16, SO_DTYPE_F32};
        const uint32_t mds[NW] = {SO_DTYPE_F32, SO_DTYPE_BF16, SO_DTYPE_F32, SO_DTYPE_BF16, SO_DTYPE_F32, SO_DTYPE_F32};
        const uint32_t cds[NW] = {SO_DTYPE_BF16, SO_DTYPE_NONE, SO_DTYPE_BF16,
                                  SO_DTYPE_F16,  SO_DTYPE_NONE, SO_DTYPE_BF16};
        pthread_t t[NW];
        for (int k = 0; k < NW; k++) {
            worker_init(&w[k], k < 4 ? pool : NULL, 8192 * 8 + 17 * (size_t)k, pds[k], gds[k], mds[k], cds[k], 6, 0,
                        10 + (uint64_t)k);
        }
        for (int k = 0; k < NW; k++) CHECK(pthread_create(&t[k], NULL, run_worker, &w[k]) == 0);
        for (int k = 0; k < NW; k++) CHECK(pthread_join(t[k], NULL) == 0);
        for (int k = 0; k < NW; k++) {
            char name[32];
            snprintf(name, sizeof name, "caller %d", k);
            CHECK(w[k].calls == 6);
            verify_worker(&w[k], serial, name);
            worker_free(&w[k]);
        }
        printf("%d concurrent callers: results identical to serial replays\n", (int)NW);
    }

    so_pool_destroy(serial);
    so_pool_destroy(pool);
    printf("ok\n");
    return 0;
}
