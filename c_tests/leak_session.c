/* Run under valgrind (run_leak_check.sh): sessions created and destroyed in every way (default
 * options, an explicit pool destroyed before the session, a pool of the session's own pinned
 * to a core, the built-in loss scaler with f16 gradients, bf16 moments, caller gradient
 * buffers, speculation off), steps through every path (kept, rescaled by clipping, skipped
 * by overflow and by a NaN, late gradients, missing slices, micro-steps, changed
 * hyperparameters, a given norm), save and load (and refused loads of a corrupt and a missing
 * file), sub-groups removed and re-registered, every kind of refused call (whose messages
 * are allocated), sessions destroyed with work in flight, and a thread that fails session
 * calls and exits (its thread-local message must be freed). Definite or indirect leaks, or
 * any memcheck error, fail the test. Small buffers: valgrind is slow.
 */
#include <pthread.h>
#include <sched.h>

#include "session_test.h"

#define N0 300
#define N1 200
#define N2 64

static float w0[N0], w1[N1], w2[N2], caller_grad[N2];

/* Registers three sub-groups: two with session-owned gradient buffers (f32 or bf16/f16
 * masters), one with a caller buffer. */
static void register_model(so_session *s, uint32_t master_dtype) {
    so_group_hparams h = so_group_hparams_default();
    uint32_t g = 0, id = 0;
    CHECK_OK(so_session_add_group(s, &h, &g));
    h.lr = 5e-4;
    CHECK_OK(so_session_add_group(s, &h, &g));
    for (int i = 0; i < N0; i++) w0[i] = 0.5f;
    for (int i = 0; i < N1; i++) w1[i] = -0.25f;
    for (int i = 0; i < N2; i++) w2[i] = 0.125f;
    so_slice_desc s0[2] = {{"emb", 0, 250}, {"emb.norm", 250, 50}};
    so_slice_desc s1 = {"block", 0, N1};
    so_slice_desc s2 = {"head", 0, N2};
    so_subgroup_desc d = so_subgroup_desc_default();
    d.master = w0;
    d.numel = N0;
    d.slices = s0;
    d.num_slices = 2;
    CHECK_OK(so_session_add_subgroup(s, &d, &id));
    d.master = w1;
    d.master_dtype = master_dtype;
    d.numel = master_dtype == SO_DTYPE_F32 ? N1 : N1 / 2;
    s1.numel = d.numel;
    d.slices = &s1;
    d.num_slices = 1;
    CHECK_OK(so_session_add_subgroup(s, &d, &id));
    d.group = 1;
    d.master = w2;
    d.master_dtype = SO_DTYPE_F32;
    d.numel = N2;
    d.slices = &s2;
    d.grad = caller_grad;
    CHECK_OK(so_session_add_subgroup(s, &d, &id));
}

/* Gradients in the session's grad dtype (f32, or 16-bit values of 0.01). */
static void give(so_session *s, const char *name, size_t n, uint32_t grad_dtype, float value) {
    uint32_t slice = 0;
    CHECK_OK(so_session_slice_id(s, name, &slice));
    float g32[N0];
    uint16_t g16[N0];
    for (size_t i = 0; i < n; i++) {
        g32[i] = value * (float)(1 + i % 5);
        g16[i] = grad_dtype == SO_DTYPE_BF16 ? so_f32_to_bf16(g32[i]) : so_f32_to_f16(g32[i]);
    }
    const void *src = grad_dtype == SO_DTYPE_F32 ? (const void *)g32 : (const void *)g16;
    CHECK_OK(so_session_grad_copy(s, slice, src, n, NULL));
}

static void steps(so_session *s, uint32_t grad_dtype, size_t n1) {
    float scale = 1.0f;
    for (int step = 0; step < 7; step++) {
        const uint32_t micro = step == 2 ? 2 : 1;
        CHECK_OK(so_session_begin_step(s, 0.0f, micro));
        CHECK_OK(so_session_loss_scale(s, &scale));
        for (uint32_t k = 0; k < micro; k++) {
            if (k > 0) CHECK_OK(so_session_next_micro_step(s));
            for (int i = 0; i < N2; i++) caller_grad[i] = (k > 0 ? caller_grad[i] : 0.0f) + 0.01f * scale;
            CHECK_OK(so_session_grad_written(s, 3, NULL));
            give(s, "block", n1, grad_dtype, (step == 5 ? NAN : 0.01f) * scale);
            if (step != 3) give(s, "emb.norm", 50, grad_dtype, 0.02f * scale);
            give(s, "emb", 250, grad_dtype, 0.01f * scale);
        }
        if (step == 4) give(s, "emb", 250, grad_dtype, 0.005f * scale); /* late */
        if (step == 6) {
            so_group_hparams h = so_group_hparams_default();
            h.lr = 1e-4;
            CHECK_OK(so_session_set_group(s, 1, &h));
        }
        so_step_args a = so_step_args_default();
        a.max_norm = step % 2 == 0 ? 0.01 : 0.0;
        a.overflow = step == 1;
        if (step == 3) {
            double sumsq = 0.0;
            CHECK_OK(so_session_local_grad_sumsq(s, -1, &sumsq));
            a.norm_source = SO_NORM_SOURCE_GIVEN;
            a.global_norm = sqrt(sumsq);
        }
        so_ticket t = 0;
        CHECK_OK(so_session_step(s, &a, &t));
        (void)so_test_step_result(s, t);
        for (uint32_t sg = 0; sg < 3; sg++) {
            so_ticket f = 0;
            uint64_t count = 0;
            CHECK_OK(so_session_final_ticket(s, sg, &f));
            CHECK(so_ticket_query(s, f) == SO_STATUS_OK);
            CHECK_OK(so_session_step_count(s, sg, &count));
        }
        so_status all = so_ticket_wait_all(s, t, -1); /* reports the NaN's failure from step 5 on */
        CHECK(all == SO_STATUS_OK || (step >= 5 && all == SO_STATUS_NON_FINITE));
    }
}

static void refusals(so_session *s) {
    float g[8] = {0};
    uint32_t id = 0;
    so_ticket t = 0;
    so_group_hparams h = so_group_hparams_default();
    h.beta1 = 2.0;
    CHECK_STATUS(so_session_add_group(s, &h, &id), SO_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(so_session_set_group(s, 9, &h), SO_STATUS_INVALID_ARGUMENT);
    h = so_group_hparams_default();
    CHECK_STATUS(so_session_set_group(s, 9, &h), SO_STATUS_NOT_FOUND);
    CHECK_STATUS(so_session_grad_copy(s, 0, g, 8, &t), SO_STATUS_INVALID_STATE);
    CHECK_STATUS(so_session_step(s, NULL, &t), SO_STATUS_INVALID_STATE);
    CHECK_STATUS(so_session_slice_id(s, "nope", &id), SO_STATUS_NOT_FOUND);
    CHECK_STATUS(so_ticket_wait(s, 100000, 0), SO_STATUS_NOT_FOUND);
    so_slice_desc sl[2] = {{"x", 0, 6}, {"y", 4, 4}};
    so_subgroup_desc d = so_subgroup_desc_default();
    d.master = g;
    d.numel = 8;
    d.slices = sl;
    d.num_slices = 2;
    CHECK_STATUS(so_session_add_subgroup(s, &d, &id), SO_STATUS_ALIASING);
    sl[1].offset = 6;
    sl[1].numel = 2;
    sl[1].name = "x";
    CHECK_STATUS(so_session_add_subgroup(s, &d, &id), SO_STATUS_INVALID_ARGUMENT); /* "x" twice */
    d.master = w0;
    sl[1].name = "y";
    CHECK_STATUS(so_session_add_subgroup(s, &d, &id), SO_STATUS_ALIASING); /* sub-group 0's master */
    CHECK_STATUS(so_session_begin_step(s, -1.0f, 1), SO_STATUS_INVALID_ARGUMENT);
    CHECK_OK(so_session_begin_step(s, 0.0f, 1));
    CHECK_STATUS(so_session_begin_step(s, 0.0f, 1), SO_STATUS_INVALID_STATE);
    CHECK_STATUS(so_session_next_micro_step(s), SO_STATUS_INVALID_STATE);
    CHECK_STATUS(so_session_grad_copy(s, 0, g, 8, &t), SO_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(so_session_save(s, "/tmp/never"), SO_STATUS_INVALID_STATE);
    CHECK_OK(so_session_step(s, NULL, &t)); /* no gradients: every slice is zero */
    CHECK_OK(so_ticket_wait(s, t, -1));
    char msg[8];
    CHECK(so_last_error_message(msg, sizeof msg) > sizeof msg); /* truncated copy */
}

static void checkpoints(so_session *s) {
    char path[512];
    so_st_temp_path(path, sizeof path, "leak");
    CHECK_OK(so_session_save(s, path));
    CHECK_OK(so_session_save(s, path)); /* over the previous one */
    CHECK_OK(so_session_load(s, path));
    size_t len = 0;
    unsigned char *bytes = so_st_read_file(path, &len);
    CHECK(bytes != NULL);
    bytes[len - 3] ^= 1;
    so_st_write_file(path, bytes, len);
    CHECK_STATUS(so_session_load(s, path), SO_STATUS_BAD_CHECKPOINT);
    so_st_write_file(path, bytes, len / 3);
    CHECK_STATUS(so_session_load(s, path), SO_STATUS_BAD_CHECKPOINT);
    remove(path);
    CHECK_STATUS(so_session_load(s, path), SO_STATUS_IO);
    free(bytes);
}

typedef struct config {
    const char *what;
    uint32_t grad_dtype, moment_dtype, master1_dtype;
    bool scaler, speculation;
    int pool_kind; /* 0: default, 1: explicit pool destroyed first, 2: own pool on a core */
} config;

static void *failing_thread(void *arg) {
    so_session *s = (so_session *)arg;
    uint32_t id = 0;
    for (int i = 0; i < 3; i++) CHECK_STATUS(so_session_slice_id(s, "missing", &id), SO_STATUS_NOT_FOUND);
    CHECK_STATUS(so_session_create(NULL, NULL), SO_STATUS_NULL_ARGUMENT);
    return NULL;
}

int main(void) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CHECK(sched_getaffinity(0, sizeof set, &set) == 0);
    uint32_t core = 0;
    while (!CPU_ISSET(core, &set)) core++;

    const config configs[] = {
        {"defaults", SO_DTYPE_F32, SO_DTYPE_F32, SO_DTYPE_F32, false, true, 0},
        {"explicit pool, f16 gradients, scaler", SO_DTYPE_F16, SO_DTYPE_F32, SO_DTYPE_F32, true, true, 1},
        {"own pool, bf16 moments and master", SO_DTYPE_BF16, SO_DTYPE_BF16, SO_DTYPE_BF16, false, true, 2},
        {"no speculation", SO_DTYPE_F32, SO_DTYPE_F32, SO_DTYPE_F16, false, false, 0},
    };
    for (size_t c = 0; c < sizeof configs / sizeof configs[0]; c++) {
        const config *cf = &configs[c];
        so_loss_scaler_options ls = so_loss_scaler_options_default();
        ls.init_scale = 256.0f;
        ls.growth_interval = 2;
        so_session_options o = so_session_options_default();
        o.grad_dtype = cf->grad_dtype;
        o.moment_dtype = cf->moment_dtype;
        o.speculation = cf->speculation;
        o.loss_scaler = cf->scaler ? &ls : NULL;
        so_pool *pool = NULL;
        if (cf->pool_kind == 1) {
            CHECK_OK(so_pool_create(NULL, &pool));
            o.pool = pool;
        } else if (cf->pool_kind == 2) {
            o.cores = &core;
            o.num_cores = 1;
        }
        so_session *s = NULL;
        CHECK_OK(so_session_create(&o, &s));
        so_pool_destroy(pool);
        register_model(s, cf->master1_dtype);
        size_t n1 = cf->master1_dtype == SO_DTYPE_F32 ? N1 : N1 / 2;
        steps(s, cf->grad_dtype, n1);
        refusals(s);
        checkpoints(s);
        /* Remove a sub-group and register it again (its slice name is free again). */
        CHECK_OK(so_session_remove_subgroup(s, 1));
        so_slice_desc sl = {"block", 0, n1};
        so_subgroup_desc d = so_subgroup_desc_default();
        d.master = w1;
        d.master_dtype = cf->master1_dtype;
        d.numel = n1;
        d.slices = &sl;
        d.num_slices = 1;
        uint32_t id = 0;
        CHECK_OK(so_session_add_subgroup(s, &d, &id));
        CHECK(id == 3);
        pthread_t th;
        CHECK(pthread_create(&th, NULL, failing_thread, s) == 0);
        CHECK(pthread_join(th, NULL) == 0);
        /* Destroyed with a speculative step and a step in flight. */
        CHECK_OK(so_session_begin_step(s, 0.0f, 1));
        for (int i = 0; i < N2; i++) caller_grad[i] = 0.01f;
        CHECK_OK(so_session_grad_written(s, 3, NULL));
        give(s, "emb.norm", 50, cf->grad_dtype, 0.01f);
        give(s, "emb", 250, cf->grad_dtype, 0.01f);
        so_ticket t = 0;
        CHECK_OK(so_session_step(s, NULL, &t));
        so_session_destroy(s);
        printf("%s: ok\n", cf->what);
    }
    /* Refused creations. */
    so_session *s = NULL;
    so_session_options o = so_session_options_default();
    o.amsgrad = true;
    CHECK_STATUS(so_session_create(&o, &s), SO_STATUS_UNSUPPORTED);
    o = so_session_options_default();
    uint32_t twice[2] = {core, core};
    o.cores = twice;
    o.num_cores = 2;
    CHECK_STATUS(so_session_create(&o, &s), SO_STATUS_INVALID_ARGUMENT);
    /* Destroyed mid-backward, and right after creation. */
    CHECK_OK(so_session_create(NULL, &s));
    register_model(s, SO_DTYPE_F32);
    CHECK_OK(so_session_begin_step(s, 0.0f, 1));
    give(s, "emb", 250, SO_DTYPE_F32, 0.01f);
    so_session_destroy(s);
    CHECK_OK(so_session_create(NULL, &s));
    so_session_destroy(s);
    printf("ok\n");
    return 0;
}
