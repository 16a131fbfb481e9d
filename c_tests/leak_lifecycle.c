/* Run under valgrind (run_leak_check.sh): pools created and destroyed (default options,
 * one thread, pinned, each instruction set), updates with every copy-out, rollback,
 * rescale, sums of squares, the default pool, error paths (whose messages are allocated),
 * the last-error message read back, and a thread that fails calls and exits (its
 * thread-local message must be freed). Definite or indirect leaks, or any memcheck error,
 * fail the test. Small buffers: valgrind is slow.
 */
#include <pthread.h>
#include <sched.h>

#include "so_test.h"

#define N 1003

static void updates_on(so_pool *pool) {
    float *p = (float *)so_test_malloc(N * 4), *g = (float *)so_test_malloc(N * 4);
    float *m = (float *)so_test_malloc(N * 4), *v = (float *)so_test_malloc(N * 4);
    uint16_t *copy = (uint16_t *)so_test_malloc(N * 2);
    so_rng rng = so_rng_new(1);
    for (size_t i = 0; i < N; i++) {
        p[i] = (float)so_rng_normalish(&rng, 0.5);
        g[i] = (float)so_rng_normalish(&rng, 1e-2);
        m[i] = 0.0f;
        v[i] = 0.0f;
    }
    so_adam_hparams hp = so_adam_hparams_default();
    so_adam_buffers b = so_test_adam_buffers(N, p, g, m, v);
    const uint32_t copies[3] = {SO_DTYPE_NONE, SO_DTYPE_BF16, SO_DTYPE_F16};
    for (int k = 0; k < 3; k++) {
        b.param_copy = copies[k] == SO_DTYPE_NONE ? NULL : copy;
        b.param_copy_dtype = copies[k];
        hp.step = (uint64_t)k + 1;
        so_update_options o = so_update_options_default();
        o.check_finite = k == 2;
        double s = 0.0;
        CHECK_OK(so_adam_update(pool, &hp, &b, &o, &s));
        CHECK(s > 0.0);
    }
    CHECK_OK(so_adam_rescale(pool, &hp, &b, 1.0f, 0.5f));
    CHECK_OK(so_adam_rollback(pool, &hp, &b, 0.5f));
    double s = 0.0;
    CHECK_OK(so_grad_sumsq(pool, g, SO_DTYPE_BF16, N, 2.0f, &s));
    so_pool_info info;
    info.struct_size = sizeof info;
    CHECK_OK(so_pool_get_info(pool, &info));

    /* Error paths. */
    so_update_options bad_opts = so_update_options_default();
    bad_opts.grad_scale = -1.0f;
    CHECK_STATUS(so_adam_update(pool, &hp, &b, &bad_opts, NULL), SO_STATUS_INVALID_ARGUMENT);
    b.grad = p; /* aliasing */
    CHECK_STATUS(so_adam_update(pool, &hp, &b, NULL, NULL), SO_STATUS_ALIASING);
    b.grad = g;
    g[7] = NAN;
    so_update_options check = so_update_options_default();
    check.check_finite = true;
    CHECK_STATUS(so_adam_update(pool, &hp, &b, &check, NULL), SO_STATUS_NON_FINITE);
    b.param_dtype = SO_DTYPE_BF16;
    CHECK_STATUS(so_adam_rollback(pool, &hp, &b, 1.0f), SO_STATUS_UNSUPPORTED);
    char msg[16];
    CHECK(so_last_error_message(msg, sizeof msg) > 0);
    free(p);
    free(g);
    free(m);
    free(v);
    free(copy);
}

static void *failing_thread(void *arg) {
    (void)arg;
    so_adam_hparams hp = so_adam_hparams_default();
    hp.beta1 = 2.0;
    so_adam_buffers b = so_adam_buffers_default();
    for (int i = 0; i < 3; i++) CHECK_STATUS(so_adam_update(NULL, &hp, &b, NULL, NULL), SO_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(so_pool_create(NULL, NULL), SO_STATUS_NULL_ARGUMENT);
    return NULL;
}

int main(void) {
    for (int round = 0; round < 2; round++) {
        so_pool *pool = NULL;
        CHECK_OK(so_pool_create(NULL, &pool));
        updates_on(pool);
        so_pool_destroy(pool);

        so_pool_options o = so_pool_options_default();
        o.num_threads = 1;
        CHECK_OK(so_pool_create(&o, &pool));
        updates_on(pool);
        so_pool_destroy(pool);

        cpu_set_t set;
        CPU_ZERO(&set);
        CHECK(sched_getaffinity(0, sizeof set, &set) == 0);
        uint32_t core = 0;
        while (!CPU_ISSET(core, &set)) core++;
        o = so_pool_options_default();
        o.cores = &core;
        o.num_cores = 1;
        CHECK_OK(so_pool_create(&o, &pool));
        updates_on(pool);
        so_pool_destroy(pool);

        for (int k = 0; k < SO_TEST_NUM_ISAS; k++) {
            so_pool *p = so_test_pool(so_test_isa(k), 2);
            if (!p) continue;
            updates_on(p);
            so_pool_destroy(p);
        }
        /* Refused options. */
        uint32_t twice[2] = {core, core};
        o.cores = twice;
        o.num_cores = 2;
        CHECK_STATUS(so_pool_create(&o, &pool), SO_STATUS_INVALID_ARGUMENT);
        o = so_pool_options_default();
        o.isa = 77;
        CHECK_STATUS(so_pool_create(&o, &pool), SO_STATUS_INVALID_ARGUMENT);
    }
    updates_on(NULL); /* the default pool */
    pthread_t t;
    CHECK(pthread_create(&t, NULL, failing_thread, NULL) == 0);
    CHECK(pthread_join(t, NULL) == 0);
    printf("ok\n");
    return 0;
}
