/* Every documented error of the C API (its small query functions: api_errors_queries.c).
 *
 * For each refused call: the status; a message from so_last_error_message that names the
 * function and the offending field (the message is first set to another function's, so a
 * stale one cannot pass); and no byte changed in any buffer (all of them live in one arena
 * that is compared with a snapshot), nor in the output arguments.
 *
 * Covered: NULL for each required pointer; wrong struct_size of every struct; invalid
 * dtype values, f16 moments, an f32 copy-out, a copy pointer without dtype and a dtype
 * without pointer; numel overflow; misaligned pointers; the overlap of every pair of
 * buffers (and adjacency accepted); every hyperparameter out of range; grad_scale and the
 * rescale scales 0/negative/inf/NaN; pool options (core outside the affinity mask, core
 * listed twice, num_threads != num_cores, cores NULL with num_cores > 0, bad isa);
 * check_finite with inf/NaN gradients, also produced by the scale; numel 0 as a no-op with
 * NULL pointers.
 */
#include <sched.h>

#include "so_test.h"

#define N 64
#define ARENA_SIZE 8192
/* Offsets of the buffers in the arena; the gaps leave room for shifted pointers. */
#define OFF_PARAM 0
#define OFF_GRAD 1024
#define OFF_M 2048
#define OFF_V 3072
#define OFF_COPY 4096
#define OFF_SPARE 5120

static unsigned char *arena, *snapshot;

static float *P(void) { return (float *)(void *)(arena + OFF_PARAM); }
static float *G(void) { return (float *)(void *)(arena + OFF_GRAD); }
static float *M(void) { return (float *)(void *)(arena + OFF_M); }
static float *V(void) { return (float *)(void *)(arena + OFF_V); }
static uint16_t *C(void) { return (uint16_t *)(void *)(arena + OFF_COPY); }

/* Fills the arena with random bytes and valid buffers, and takes the snapshot. */
static void arena_fill(void) {
    so_rng rng = so_rng_new(3);
    for (size_t i = 0; i < ARENA_SIZE; i++) arena[i] = (unsigned char)so_rng_u64(&rng);
    for (size_t i = 0; i < N; i++) {
        P()[i] = (float)so_rng_normalish(&rng, 0.5);
        G()[i] = (float)so_rng_normalish(&rng, 1e-2);
        M()[i] = (float)so_rng_normalish(&rng, 1e-2);
        V()[i] = (float)(1e-4 * so_rng_unit(&rng));
    }
    memcpy(snapshot, arena, ARENA_SIZE);
}

static void arena_init(void) {
    arena = (unsigned char *)so_test_malloc(ARENA_SIZE);
    snapshot = (unsigned char *)so_test_malloc(ARENA_SIZE);
    arena_fill();
}

/* Puts the arena back after a call that was meant to succeed. */
static void arena_restore(void) { memcpy(arena, snapshot, ARENA_SIZE); }

static so_adam_buffers base_buffers(void) { return so_test_adam_buffers(N, P(), G(), M(), V()); }

/* Buffers with a bf16 copy-out, so that all five buffers take part. */
static so_adam_buffers base_buffers_with_copy(void) {
    so_adam_buffers b = base_buffers();
    b.param_copy = C();
    b.param_copy_dtype = SO_DTYPE_BF16;
    return b;
}

/* Sets the thread's last error to a message of another function than `func`. */
static void prime_message(const char *func) {
    if (strcmp(func, "so_pool_get_info") != 0) {
        CHECK_STATUS(so_pool_get_info(NULL, NULL), SO_STATUS_NULL_ARGUMENT);
    } else {
        CHECK_STATUS(so_grad_sumsq(NULL, NULL, SO_DTYPE_F32, 0, 1.0f, NULL), SO_STATUS_NULL_ARGUMENT);
    }
}

static double sumsq_out;

static void expect_error_(so_status got, so_status want, const char *func, const char *field, const char *expr,
                          const char *file, int line) {
    const char *msg = so_test_last_error();
    bool ok = got == want && strncmp(msg, func, strlen(func)) == 0 && strstr(msg, field) != NULL &&
              memcmp(arena, snapshot, ARENA_SIZE) == 0 && sumsq_out == 12345.0;
    if (!ok) {
        fprintf(stderr, "%s:%d: %s\n  returned %u (%s), expected %u (%s)\n  message \"%s\" (expected %s: ... %s ...)\n",
                file, line, expr, (unsigned)got, so_status_str(got), (unsigned)want, so_status_str(want), msg, func,
                field);
        if (memcmp(arena, snapshot, ARENA_SIZE) != 0) fprintf(stderr, "  a buffer was modified\n");
        if (sumsq_out != 12345.0) fprintf(stderr, "  out_grad_sumsq was written\n");
        exit(1);
    }
}

/* `call` must fail with `want`, naming `field` in a message from `func`, changing nothing. */
#define EXPECT_ERROR(call, want, func, field)                                   \
    do {                                                                        \
        prime_message(func);                                                    \
        sumsq_out = 12345.0;                                                    \
        so_status st_ = (call);                                                 \
        expect_error_(st_, (want), (func), (field), #call, __FILE__, __LINE__); \
    } while (0)

/* The three step-shaped calls on the same arguments. */
#define EXPECT_ERROR_ALL3(hp, bufs, want, field)                                                             \
    do {                                                                                                     \
        EXPECT_ERROR(so_adam_update(NULL, (hp), (bufs), NULL, &sumsq_out), (want), "so_adam_update", field); \
        EXPECT_ERROR(so_adam_rollback(NULL, (hp), (bufs), 1.0f), (want), "so_adam_rollback", field);         \
        EXPECT_ERROR(so_adam_rescale(NULL, (hp), (bufs), 1.0f, 0.5f), (want), "so_adam_rescale", field);     \
    } while (0)

/* ------------------------------------------------------------------------ NULL pointers */

static void test_null_arguments(void) {
    so_adam_hparams hp = so_adam_hparams_default();
    so_adam_buffers b = base_buffers();
    EXPECT_ERROR_ALL3(NULL, &b, SO_STATUS_NULL_ARGUMENT, "hparams");
    EXPECT_ERROR_ALL3(&hp, NULL, SO_STATUS_NULL_ARGUMENT, "buffers");

    const char *names[4] = {"param", "grad", "exp_avg", "exp_avg_sq"};
    for (int k = 0; k < 4; k++) {
        so_adam_buffers c = base_buffers();
        if (k == 0) c.param = NULL;
        if (k == 1) c.grad = NULL;
        if (k == 2) c.exp_avg = NULL;
        if (k == 3) c.exp_avg_sq = NULL;
        EXPECT_ERROR_ALL3(&hp, &c, SO_STATUS_NULL_ARGUMENT, names[k]);
    }
    so_adam_buffers c = base_buffers();
    c.param_copy_dtype = SO_DTYPE_BF16; /* a copy asked for, no pointer */
    EXPECT_ERROR(so_adam_update(NULL, &hp, &c, NULL, &sumsq_out), SO_STATUS_NULL_ARGUMENT, "so_adam_update",
                 "param_copy");

    EXPECT_ERROR(so_grad_sumsq(NULL, G(), SO_DTYPE_F32, N, 1.0f, NULL), SO_STATUS_NULL_ARGUMENT, "so_grad_sumsq",
                 "out_sumsq");
    EXPECT_ERROR(so_grad_sumsq(NULL, NULL, SO_DTYPE_F32, N, 1.0f, &sumsq_out), SO_STATUS_NULL_ARGUMENT, "so_grad_sumsq",
                 "grad");
    EXPECT_ERROR(so_pool_create(NULL, NULL), SO_STATUS_NULL_ARGUMENT, "so_pool_create", "out_pool");
    EXPECT_ERROR(so_pool_get_info(NULL, NULL), SO_STATUS_NULL_ARGUMENT, "so_pool_get_info", "out_info");
    so_pool_destroy(NULL); /* a no-op */
}

/* ------------------------------------------------------------------------- struct_size */

static void test_struct_sizes(void) {
    const size_t deltas[3] = {(size_t)0 - 8, 8, 1}; /* applied as size + delta; plus 0 below */
    for (int k = 0; k < 4; k++) {
        so_adam_hparams hp = so_adam_hparams_default();
        so_adam_buffers b = base_buffers();
        so_update_options o = so_update_options_default();
        CHECK(hp.struct_size == sizeof hp && b.struct_size == sizeof b && o.struct_size == sizeof o);
        size_t bad_hp = k < 3 ? sizeof hp + deltas[k] : 0;
        size_t bad_b = k < 3 ? sizeof b + deltas[k] : 0;
        size_t bad_o = k < 3 ? sizeof o + deltas[k] : 0;

        hp.struct_size = bad_hp;
        EXPECT_ERROR_ALL3(&hp, &b, SO_STATUS_STRUCT_SIZE, "hparams->struct_size");
        hp.struct_size = sizeof hp;
        b.struct_size = bad_b;
        EXPECT_ERROR_ALL3(&hp, &b, SO_STATUS_STRUCT_SIZE, "buffers->struct_size");
        b.struct_size = sizeof b;
        o.struct_size = bad_o;
        EXPECT_ERROR(so_adam_update(NULL, &hp, &b, &o, &sumsq_out), SO_STATUS_STRUCT_SIZE, "so_adam_update",
                     "options->struct_size");

        so_pool_options po = so_pool_options_default();
        CHECK(po.struct_size == sizeof po);
        po.struct_size = k < 3 ? sizeof po + deltas[k] : 0;
        so_pool *sentinel = (so_pool *)(void *)&sentinel;
        so_pool *out = sentinel;
        EXPECT_ERROR(so_pool_create(&po, &out), SO_STATUS_STRUCT_SIZE, "so_pool_create", "options->struct_size");
        CHECK(out == sentinel);

        so_pool_info info;
        memset(&info, 0x5A, sizeof info);
        info.struct_size = k < 3 ? sizeof info + deltas[k] : 0;
        so_pool_info before = info;
        EXPECT_ERROR(so_pool_get_info(NULL, &info), SO_STATUS_STRUCT_SIZE, "so_pool_get_info", "out_info");
        CHECK(memcmp(&info, &before, sizeof info) == 0);
    }
}

/* ------------------------------------------------------------------------------ dtypes */

static void test_dtypes(void) {
    so_adam_hparams hp = so_adam_hparams_default();
    const uint32_t invalid[3] = {SO_DTYPE_NONE, 4, 0xFFFFFFFFu};
    for (int k = 0; k < 3; k++) {
        so_adam_buffers b = base_buffers();
        b.param_dtype = invalid[k];
        EXPECT_ERROR_ALL3(&hp, &b, SO_STATUS_INVALID_ARGUMENT, "param_dtype");
        b = base_buffers();
        b.grad_dtype = invalid[k];
        EXPECT_ERROR_ALL3(&hp, &b, SO_STATUS_INVALID_ARGUMENT, "grad_dtype");
        b = base_buffers();
        b.moment_dtype = invalid[k];
        EXPECT_ERROR_ALL3(&hp, &b, SO_STATUS_INVALID_ARGUMENT, "moment_dtype");
        if (k > 0) {
            b = base_buffers_with_copy();
            b.param_copy_dtype = invalid[k];
            EXPECT_ERROR_ALL3(&hp, &b, SO_STATUS_INVALID_ARGUMENT, "param_copy_dtype");
        }
        EXPECT_ERROR(so_grad_sumsq(NULL, G(), invalid[k], N, 1.0f, &sumsq_out), SO_STATUS_INVALID_ARGUMENT,
                     "so_grad_sumsq", "grad_dtype");
    }
    /* Moments are f32 or bf16. */
    so_adam_buffers b = base_buffers();
    b.moment_dtype = SO_DTYPE_F16;
    EXPECT_ERROR(so_adam_update(NULL, &hp, &b, NULL, &sumsq_out), SO_STATUS_UNSUPPORTED, "so_adam_update",
                 "moment_dtype");
    /* The copy-out is bf16 or f16. */
    b = base_buffers_with_copy();
    b.param_copy_dtype = SO_DTYPE_F32;
    EXPECT_ERROR(so_adam_update(NULL, &hp, &b, NULL, &sumsq_out), SO_STATUS_UNSUPPORTED, "so_adam_update",
                 "param_copy_dtype");
    /* A copy pointer without a dtype. */
    b = base_buffers_with_copy();
    b.param_copy_dtype = SO_DTYPE_NONE;
    EXPECT_ERROR_ALL3(&hp, &b, SO_STATUS_INVALID_ARGUMENT, "param_copy");
}

/* ------------------------------------------------------------ numel, alignment, overlap */

static void test_numel_overflow(void) {
    so_adam_hparams hp = so_adam_hparams_default();
    const size_t huge[3] = {SIZE_MAX, SIZE_MAX / 2 + 1, SIZE_MAX / 4 + 1};
    for (int k = 0; k < 3; k++) {
        so_adam_buffers b = base_buffers();
        b.numel = huge[k];
        EXPECT_ERROR_ALL3(&hp, &b, SO_STATUS_INVALID_ARGUMENT, "numel");
        b.param_dtype = b.grad_dtype = b.moment_dtype = SO_DTYPE_BF16;
        EXPECT_ERROR(so_adam_update(NULL, &hp, &b, NULL, &sumsq_out), SO_STATUS_INVALID_ARGUMENT, "so_adam_update",
                     "numel");
        EXPECT_ERROR(so_grad_sumsq(NULL, G(), SO_DTYPE_F32, huge[k], 1.0f, &sumsq_out), SO_STATUS_INVALID_ARGUMENT,
                     "so_grad_sumsq", "numel");
    }
}

static void test_misaligned(void) {
    so_adam_hparams hp = so_adam_hparams_default();
    const char *names[5] = {"param", "grad", "exp_avg", "exp_avg_sq", "param_copy"};
    for (int k = 0; k < 5; k++) {
        for (size_t shift = 1; shift < 4; shift++) {
            so_adam_buffers b = base_buffers_with_copy();
            void *bad = arena + OFF_SPARE + shift;  /* in the spare area: overlaps nothing */
            if (k == 4 && shift % 2 == 0) continue; /* bf16 copy: 2-byte alignment suffices */
            if (k == 0) b.param = bad;
            if (k == 1) b.grad = bad;
            if (k == 2) b.exp_avg = bad;
            if (k == 3) b.exp_avg_sq = bad;
            if (k == 4) b.param_copy = bad;
            EXPECT_ERROR(so_adam_update(NULL, &hp, &b, NULL, &sumsq_out), SO_STATUS_INVALID_ARGUMENT, "so_adam_update",
                         names[k]);
            CHECK(strstr(so_test_last_error(), "aligned") != NULL);
            if (k < 4) {
                b.param_copy = NULL;
                b.param_copy_dtype = SO_DTYPE_NONE;
                EXPECT_ERROR(so_adam_rollback(NULL, &hp, &b, 1.0f), SO_STATUS_INVALID_ARGUMENT, "so_adam_rollback",
                             names[k]);
                EXPECT_ERROR(so_adam_rescale(NULL, &hp, &b, 1.0f, 2.0f), SO_STATUS_INVALID_ARGUMENT, "so_adam_rescale",
                             names[k]);
            }
        }
    }
    /* A bf16 buffer needs 2-byte alignment. */
    so_adam_buffers b = base_buffers();
    b.param_dtype = SO_DTYPE_BF16;
    b.param = arena + OFF_SPARE + 1;
    EXPECT_ERROR(so_adam_update(NULL, &hp, &b, NULL, &sumsq_out), SO_STATUS_INVALID_ARGUMENT, "so_adam_update",
                 "param");
    EXPECT_ERROR(so_grad_sumsq(NULL, arena + OFF_SPARE + 1, SO_DTYPE_F16, N, 1.0f, &sumsq_out),
                 SO_STATUS_INVALID_ARGUMENT, "so_grad_sumsq", "aligned");
}

static void **slot(so_adam_buffers *b, int k) {
    switch (k) {
    case 0: return &b->param;
    case 1: return (void **)(void *)&b->grad; /* const void * stored through void * */
    case 2: return &b->exp_avg;
    case 3: return &b->exp_avg_sq;
    default: return &b->param_copy;
    }
}

static void test_aliasing(void) {
    so_adam_hparams hp = so_adam_hparams_default();
    const char *names[5] = {"param", "grad", "exp_avg", "exp_avg_sq", "param_copy"};
    size_t pairs = 0;
    for (int a = 0; a < 5; a++) {
        for (int c = 0; c < 5; c++) {
            if (a == c) continue;
            /* c starts 4 bytes into a (aligned for every dtype): they overlap. */
            so_adam_buffers b = base_buffers_with_copy();
            *slot(&b, c) = (unsigned char *)*slot(&b, a) + 4;
            char field[64];
            snprintf(field, sizeof field, "buffers->%s", names[c]);
            EXPECT_ERROR(so_adam_update(NULL, &hp, &b, NULL, &sumsq_out), SO_STATUS_ALIASING, "so_adam_update", field);
            snprintf(field, sizeof field, "buffers->%s", names[a]);
            CHECK(strstr(so_test_last_error(), field) != NULL);
            CHECK(strstr(so_test_last_error(), "overlap") != NULL);
            /* The same pointer twice. */
            *slot(&b, c) = *slot(&b, a);
            EXPECT_ERROR(so_adam_update(NULL, &hp, &b, NULL, &sumsq_out), SO_STATUS_ALIASING, "so_adam_update",
                         names[c]);
            if (a < 4 && c < 4) {
                b.param_copy = NULL;
                b.param_copy_dtype = SO_DTYPE_NONE;
                EXPECT_ERROR(so_adam_rollback(NULL, &hp, &b, 1.0f), SO_STATUS_ALIASING, "so_adam_rollback", names[c]);
                EXPECT_ERROR(so_adam_rescale(NULL, &hp, &b, 1.0f, 2.0f), SO_STATUS_ALIASING, "so_adam_rescale",
                             names[c]);
            }
            pairs++;
        }
    }
    CHECK(pairs == 20);
    /* Adjacent buffers do not overlap: grad right after param is accepted. */
    so_adam_buffers b = base_buffers();
    b.grad = P() + N;
    CHECK_OK(so_adam_update(NULL, &hp, &b, NULL, NULL));
    arena_restore();
}

/* ------------------------------------------------------------------- hyperparameters */

typedef struct bad_value {
    int field; /* 0 lr, 1 beta1, 2 beta2, 3 eps, 4 weight_decay */
    double value;
} bad_value;

static void test_hparams(void) {
    const char *fields[5] = {"hparams->lr", "hparams->beta1", "hparams->beta2", "hparams->eps",
                             "hparams->weight_decay"};
    /* clang-format off: a hand-aligned table */
    const bad_value bad[] = {
        {0, -1e-3}, {0, NAN},      {0, INFINITY}, {0, -INFINITY}, {1, -0.1}, {1, 1.0},      {1, 1.5},
        {1, NAN},   {1, INFINITY}, {2, -0.1},     {2, 1.0},       {2, 1.5},  {2, NAN},      {2, -INFINITY},
        {3, -1e-8}, {3, NAN},      {3, INFINITY}, {4, -0.01},     {4, NAN},  {4, INFINITY},
    };
    /* clang-format on */
    so_adam_buffers b = base_buffers();
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
        so_adam_hparams hp = so_adam_hparams_default();
        switch (bad[k].field) {
        case 0: hp.lr = bad[k].value; break;
        case 1: hp.beta1 = bad[k].value; break;
        case 2: hp.beta2 = bad[k].value; break;
        case 3: hp.eps = bad[k].value; break;
        default: hp.weight_decay = bad[k].value; break;
        }
        EXPECT_ERROR_ALL3(&hp, &b, SO_STATUS_INVALID_ARGUMENT, fields[bad[k].field]);
        /* Validated even when there is nothing to do. */
        so_adam_buffers empty = so_adam_buffers_default();
        EXPECT_ERROR(so_adam_update(NULL, &hp, &empty, NULL, &sumsq_out), SO_STATUS_INVALID_ARGUMENT, "so_adam_update",
                     fields[bad[k].field]);
    }
    so_adam_hparams hp = so_adam_hparams_default();
    hp.step = 0;
    EXPECT_ERROR_ALL3(&hp, &b, SO_STATUS_INVALID_ARGUMENT, "step");
    const uint32_t modes[3] = {0, 3, 0xFFFFFFFFu};
    for (int k = 0; k < 3; k++) {
        hp = so_adam_hparams_default();
        hp.mode = modes[k];
        EXPECT_ERROR_ALL3(&hp, &b, SO_STATUS_INVALID_ARGUMENT, "mode");
    }
    /* The edges of the ranges are accepted by an update. */
    hp = so_adam_hparams_default();
    hp.lr = 0.0;
    hp.beta1 = 0.0;
    hp.beta2 = 0.0;
    hp.weight_decay = 0.0;
    CHECK_OK(so_adam_update(NULL, &hp, &b, NULL, NULL));
    arena_restore();
}

static void test_scales(void) {
    so_adam_hparams hp = so_adam_hparams_default();
    so_adam_buffers b = base_buffers();
    const float bad[5] = {0.0f, -0.0f, -1.0f, INFINITY, NAN};
    for (int k = 0; k < 5; k++) {
        so_update_options o = so_update_options_default();
        o.grad_scale = bad[k];
        EXPECT_ERROR(so_adam_update(NULL, &hp, &b, &o, &sumsq_out), SO_STATUS_INVALID_ARGUMENT, "so_adam_update",
                     "grad_scale");
        o.check_finite = true;
        EXPECT_ERROR(so_adam_update(NULL, &hp, &b, &o, &sumsq_out), SO_STATUS_INVALID_ARGUMENT, "so_adam_update",
                     "grad_scale");
        EXPECT_ERROR(so_adam_rollback(NULL, &hp, &b, bad[k]), SO_STATUS_INVALID_ARGUMENT, "so_adam_rollback",
                     "grad_scale");
        EXPECT_ERROR(so_adam_rescale(NULL, &hp, &b, bad[k], 1.0f), SO_STATUS_INVALID_ARGUMENT, "so_adam_rescale",
                     "old_scale");
        EXPECT_ERROR(so_adam_rescale(NULL, &hp, &b, 1.0f, bad[k]), SO_STATUS_INVALID_ARGUMENT, "so_adam_rescale",
                     "new_scale");
        EXPECT_ERROR(so_grad_sumsq(NULL, G(), SO_DTYPE_F32, N, bad[k], &sumsq_out), SO_STATUS_INVALID_ARGUMENT,
                     "so_grad_sumsq", "scale");
    }
}

/* ---------------------------------------------------------------------- check_finite */

static void test_check_finite(void) {
    so_adam_hparams hp = so_adam_hparams_default();
    so_update_options o = so_update_options_default();
    o.check_finite = true;
    /* f32: inf, NaN, and a large value that the scale makes inf. */
    const float values[3] = {INFINITY, NAN, 3e38f};
    const float scales[3] = {1.0f, 1.0f, 10.0f};
    for (int k = 0; k < 3; k++) {
        G()[17] = values[k];
        memcpy(snapshot, arena, ARENA_SIZE); /* the bad gradient is the baseline */
        so_adam_buffers b = base_buffers_with_copy();
        o.grad_scale = scales[k];
        EXPECT_ERROR(so_adam_update(NULL, &hp, &b, &o, &sumsq_out), SO_STATUS_NON_FINITE, "so_adam_update",
                     "inf or NaN");
        /* Without a pool named, with a pool, and without the sum: the same. */
        so_pool *pool = so_test_pool(SO_ISA_PORTABLE, 2);
        EXPECT_ERROR(so_adam_update(pool, &hp, &b, &o, NULL), SO_STATUS_NON_FINITE, "so_adam_update", "inf or NaN");
        so_pool_destroy(pool);
    }
    /* bf16 inf and f16 max times a large scale. */
    uint16_t *g16 = (uint16_t *)(void *)G();
    for (size_t i = 0; i < N; i++) g16[i] = 0x3F80; /* bf16 1.0 */
    g16[5] = 0x7F80;                                /* bf16 +inf */
    memcpy(snapshot, arena, ARENA_SIZE);
    so_adam_buffers b = base_buffers();
    b.grad_dtype = SO_DTYPE_BF16;
    o.grad_scale = 1.0f;
    EXPECT_ERROR(so_adam_update(NULL, &hp, &b, &o, &sumsq_out), SO_STATUS_NON_FINITE, "so_adam_update", "inf or NaN");
    for (size_t i = 0; i < N; i++) g16[i] = 0x3C00; /* f16 1.0 */
    g16[40] = 0x7BFF;                               /* f16 65504 */
    memcpy(snapshot, arena, ARENA_SIZE);
    b.grad_dtype = SO_DTYPE_F16;
    o.grad_scale = 1e35f; /* 65504 * 1e35 overflows f32 */
    EXPECT_ERROR(so_adam_update(NULL, &hp, &b, &o, &sumsq_out), SO_STATUS_NON_FINITE, "so_adam_update", "inf or NaN");
    /* The same gradient without the check: the call goes ahead. */
    o.check_finite = false;
    CHECK_OK(so_adam_update(NULL, &hp, &b, &o, NULL));
    CHECK(isnan(P()[40]) || isinf(P()[40]) || !isfinite(M()[40]) || !isfinite(V()[40]));
    /* so_grad_sumsq reports a non-finite sum for it. */
    double s = 0.0;
    CHECK_OK(so_grad_sumsq(NULL, G(), SO_DTYPE_F16, N, 1e35f, &s));
    CHECK(!isfinite(s));

    /* Back to the finite baseline. */
    arena_fill();
}

/* ------------------------------------------------------------------------ pool options */

static void test_pool_options(void) {
    cpu_set_t allowed;
    CPU_ZERO(&allowed);
    CHECK(sched_getaffinity(0, sizeof allowed, &allowed) == 0);
    uint32_t first = 0;
    while (!CPU_ISSET(first, &allowed)) first++;
    uint32_t outside = 0; /* the first core index not in the mask, if any */
    while (outside < CPU_SETSIZE && CPU_ISSET(outside, &allowed)) outside++;

    /* Refused options: out_pool is left alone. */
    so_pool *sentinel = (so_pool *)(void *)&sentinel;
    so_pool *out = sentinel;
    uint32_t cores[2];
    so_pool_options o = so_pool_options_default();
    if (outside < CPU_SETSIZE) {
        cores[0] = outside;
        o.cores = cores;
        o.num_cores = 1;
        EXPECT_ERROR(so_pool_create(&o, &out), SO_STATUS_INVALID_ARGUMENT, "so_pool_create", "core");
        CHECK(strstr(so_test_last_error(), "affinity") != NULL);
    }
    cores[0] = 100000;
    o.cores = cores;
    o.num_cores = 1;
    EXPECT_ERROR(so_pool_create(&o, &out), SO_STATUS_INVALID_ARGUMENT, "so_pool_create", "core 100000");
    cores[0] = first;
    cores[1] = first;
    o.num_cores = 2;
    EXPECT_ERROR(so_pool_create(&o, &out), SO_STATUS_INVALID_ARGUMENT, "so_pool_create", "twice");
    o.num_cores = 1;
    o.num_threads = 2;
    EXPECT_ERROR(so_pool_create(&o, &out), SO_STATUS_INVALID_ARGUMENT, "so_pool_create", "num_threads");
    o = so_pool_options_default();
    o.cores = NULL;
    o.num_cores = 1;
    EXPECT_ERROR(so_pool_create(&o, &out), SO_STATUS_NULL_ARGUMENT, "so_pool_create", "cores");
    o.cores = cores;
    o.num_cores = 0;
    EXPECT_ERROR(so_pool_create(&o, &out), SO_STATUS_INVALID_ARGUMENT, "so_pool_create", "cores");
    const uint32_t bad_isa[3] = {4, 99, 0xFFFFFFFFu};
    for (int k = 0; k < 3; k++) {
        o = so_pool_options_default();
        o.isa = bad_isa[k];
        EXPECT_ERROR(so_pool_create(&o, &out), SO_STATUS_INVALID_ARGUMENT, "so_pool_create", "isa");
    }
    CHECK(out == sentinel);
}

/* ------------------------------------------------------------------------------ numel 0 */

static void test_empty(void) {
    so_adam_hparams hp = so_adam_hparams_default();
    so_adam_buffers b = so_adam_buffers_default();
    CHECK(b.numel == 0 && b.param == NULL && b.grad == NULL && b.exp_avg == NULL && b.exp_avg_sq == NULL &&
          b.param_copy == NULL && b.param_dtype == SO_DTYPE_F32 && b.grad_dtype == SO_DTYPE_F32 &&
          b.moment_dtype == SO_DTYPE_F32 && b.param_copy_dtype == SO_DTYPE_NONE);
    double s = -1.0;
    CHECK_OK(so_adam_update(NULL, &hp, &b, NULL, &s));
    CHECK(s == 0.0);
    CHECK_OK(so_adam_rollback(NULL, &hp, &b, 1.0f));
    CHECK_OK(so_adam_rescale(NULL, &hp, &b, 1.0f, 0.5f));
    s = -1.0;
    CHECK_OK(so_grad_sumsq(NULL, NULL, SO_DTYPE_BF16, 0, 1.0f, &s));
    CHECK(s == 0.0);
    b.param_copy_dtype = SO_DTYPE_F16; /* no pointer needed when there is nothing to write */
    CHECK_OK(so_adam_update(NULL, &hp, &b, NULL, NULL));
    so_update_options o = so_update_options_default();
    CHECK(o.grad_scale == 1.0f && !o.check_finite);
    o.check_finite = true;
    CHECK_OK(so_adam_update(NULL, &hp, &b, &o, NULL));
    /* Everything else is still validated. */
    b.param_dtype = 9;
    EXPECT_ERROR(so_adam_update(NULL, &hp, &b, NULL, &sumsq_out), SO_STATUS_INVALID_ARGUMENT, "so_adam_update",
                 "param_dtype");

    /* The defaults are torch.optim.AdamW's. */
    CHECK(hp.struct_size == sizeof hp && hp.mode == SO_ADAM_MODE_ADAMW && hp.bias_correction && hp.step == 1);
    CHECK(fabs((double)hp.lr - 1e-3) < 1e-9 && fabs((double)hp.beta1 - 0.9) < 1e-7 &&
          fabs((double)hp.beta2 - 0.999) < 1e-7 && fabs((double)hp.eps - 1e-8) < 1e-15 &&
          fabs((double)hp.weight_decay - 0.01) < 1e-9);
}

int main(void) {
    arena_init();
    test_null_arguments();
    test_struct_sizes();
    test_dtypes();
    test_numel_overflow();
    test_misaligned();
    test_aliasing();
    test_hparams();
    test_scales();
    test_check_finite();
    test_pool_options();
    test_empty();
    free(arena);
    free(snapshot);
    printf("ok\n");
    return 0;
}
