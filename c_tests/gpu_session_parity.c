/* A small model stepped through a CUDA session ends bit-identical to the same run through a
 * host session given the same gradients and global norms, with clipping, a skipped step
 * and a late gradient in the run; after each step the model's device parameters equal the
 * bf16 rounding of the master weights, read back after a GPU-side wait on each sub-group's
 * final ticket. The local sums of squares (taken on the GPU at hand-over in the CUDA
 * session, on the CPU in the host session) are equal bit for bit.
 *
 * Three runs: speculation off; speculation off with sub-group 1 placed on the GPU (stepped
 * by the library's GPU kernel: bit-identical to the CPU kernel); speculation on without
 * clipping, late gradients or skips (every speculative step is kept or cancelled, both exact). */
#include "cuda_driver.h"

#define NSG 3
#define STEPS 6
/* Sub-group 0 is larger than a publication piece (8 Mi elements): staged in two pieces. */
static const size_t SLICES[NSG][2] = {{9000000, 0}, {50000, 20001}, {5000, 0}};

typedef struct {
    so_session *s;
    float *master[NSG];
    size_t numel[NSG];
} model;

typedef enum { RUN_OFF, RUN_DEVICE, RUN_SPECULATIVE } run_kind;

static void build(model *mm, int cuda, cu_ptr *d_params, run_kind kind) {
    so_session_options o = so_session_options_default();
    o.grad_dtype = SO_DTYPE_BF16;
    o.accum_dtype = SO_DTYPE_BF16;
    o.speculation = kind == RUN_SPECULATIVE ? SO_SPECULATION_ON : SO_SPECULATION_OFF;
    if (cuda) {
        CHECK_OK(so_session_create_cuda(&o, NULL, &mm->s));
    } else {
        CHECK_OK(so_session_create(&o, &mm->s));
    }
    uint32_t g;
    so_group_hparams hp = so_group_hparams_default();
    hp.weight_decay = 0.05;
    CHECK_OK(so_session_add_group(mm->s, &hp, &g));
    so_rng rng = so_rng_new(7);
    char names[NSG][2][16];
    for (int k = 0; k < NSG; k++) {
        size_t n = SLICES[k][0] + SLICES[k][1];
        mm->numel[k] = n;
        mm->master[k] = (float *)so_test_malloc(n * 4);
        for (size_t i = 0; i < n; i++) mm->master[k][i] = (float)so_rng_normalish(&rng, 0.05);
        so_slice_desc sl[2];
        size_t ns = SLICES[k][1] ? 2 : 1;
        for (size_t j = 0; j < ns; j++) {
            snprintf(names[k][j], sizeof names[k][j], "sg%d.%zu", k, j);
            sl[j].name = names[k][j];
            sl[j].offset = j ? SLICES[k][0] : 0;
            sl[j].numel = SLICES[k][j];
        }
        so_subgroup_desc d = so_subgroup_desc_default();
        d.master = mm->master[k];
        d.numel = n;
        d.slices = sl;
        d.num_slices = ns;
        if (cuda) {
            d.device_param = d_params[k];
            d.device_param_dtype = SO_DTYPE_BF16;
            if (kind == RUN_DEVICE && k == 1) d.placement = SO_PLACEMENT_DEVICE;
        }
        uint32_t id;
        CHECK_OK(so_session_add_subgroup(mm->s, &d, &id));
        CHECK(id == (uint32_t)k);
    }
}

static void run(run_kind kind) {
    const char *names[] = {"speculation off", "sub-group 1 on the GPU", "speculation on, no clipping"};
    printf("== %s\n", names[kind]);
    cu_ptr d_params[NSG], d_grads[NSG], d_late;
    model host, dev;
    size_t total = 0;
    for (int k = 0; k < NSG; k++) total += SLICES[k][0] + SLICES[k][1];
    for (int k = 0; k < NSG; k++) {
        size_t n = SLICES[k][0] + SLICES[k][1];
        CU_CHECK(cu.mem_alloc(&d_params[k], n * 2));
        CU_CHECK(cu.mem_alloc(&d_grads[k], n * 2));
    }
    CU_CHECK(cu.mem_alloc(&d_late, SLICES[0][0] * 2));
    build(&host, 0, NULL, kind);
    build(&dev, 1, d_params, kind);
    so_cuda_stream_t stream;
    CU_CHECK(cu.stream_create(&stream, 1));
    CHECK_OK(so_session_set_compute_stream(dev.s, stream));

    so_rng rng = so_rng_new(99);
    uint16_t *grad = (uint16_t *)so_test_malloc(total * 2);
    uint16_t *late = (uint16_t *)so_test_malloc(SLICES[0][0] * 2);
    uint16_t *readback = (uint16_t *)so_test_malloc(total * 2);
    uint16_t *previous = (uint16_t *)so_test_malloc(total * 2);
    size_t pinned = 0;
    for (int step = 1; step <= STEPS; step++) {
        const int plain = kind == RUN_SPECULATIVE;
        int is_late = step == 3 && kind == RUN_OFF, overflow = step == 4 && !plain;
        double norm = step % 2 ? 5.0 : 0.5; /* max_norm 1: odd steps clip */
        for (size_t i = 0; i < total; i++) grad[i] = so_f32_to_bf16((float)so_rng_normalish(&rng, 1e-2));
        for (size_t i = 0; i < SLICES[0][0]; i++) late[i] = so_f32_to_bf16((float)so_rng_normalish(&rng, 1e-2));
        size_t off = 0;
        /* The previous step's copies read these device gradients: wait for them first (the
         * documented lifetime rule), and for the uploads (a pageable upload may return before
         * its DMA lands) before handing the gradients over on another stream. */
        CU_CHECK(cu.ctx_sync());
        for (int k = 0; k < NSG; k++) {
            CU_CHECK(cu.htod(d_grads[k], grad + off, dev.numel[k] * 2));
            off += dev.numel[k];
        }
        CU_CHECK(cu.htod(d_late, late, SLICES[0][0] * 2));
        CU_CHECK(cu.ctx_sync());
        CHECK_OK(so_session_begin_step(host.s, 1.0f, 1));
        CHECK_OK(so_session_begin_step(dev.s, 1.0f, 1));
        /* Backward order: last sub-group first. */
        off = total;
        uint32_t slice_id = 0;
        for (int k = NSG - 1; k >= 0; k--) {
            off -= dev.numel[k];
            size_t ns = SLICES[k][1] ? 2 : 1;
            size_t inner = 0;
            for (size_t j = 0; j < ns; j++) {
                char name[16];
                snprintf(name, sizeof name, "sg%d.%zu", k, j);
                CHECK_OK(so_session_slice_id(host.s, name, &slice_id));
                size_t n = SLICES[k][j];
                CHECK_OK(so_session_grad_copy(host.s, slice_id, grad + off + inner, n, NULL));
                CHECK_OK(
                    so_session_grad_device(dev.s, slice_id, d_grads[k] + inner * 2, n, SO_DTYPE_BF16, stream, NULL));
                inner += n;
            }
        }
        if (is_late) {
            /* A second gradient for sub-group 0's slice after the sub-group completed. */
            CHECK_OK(so_session_grad_copy(host.s, 0, late, SLICES[0][0], NULL));
            CHECK_OK(so_session_grad_device(dev.s, 0, d_late, SLICES[0][0], SO_DTYPE_BF16, stream, NULL));
        }
        so_step_args a = so_step_args_default();
        a.max_norm = plain ? 0.0 : 1.0;
        a.norm_source = SO_NORM_SOURCE_GIVEN;
        double sh = -1.0, sd = -2.0;
        CHECK_OK(so_session_local_grad_sumsq(host.s, -1, &sh));
        CHECK_OK(so_session_local_grad_sumsq(dev.s, -1, &sd));
        CHECKF(memcmp(&sh, &sd, sizeof sh) == 0, "step %d: sum of squares %.17g on the CPU, %.17g on the GPU", step, sh,
               sd);
        a.global_norm = norm;
        a.overflow = overflow;
        so_ticket th, td;
        CHECK_OK(so_session_step(host.s, &a, &th));
        CHECK_OK(so_session_step(dev.s, &a, &td));
        const so_step_result rh = so_test_step_result(host.s, th);
        const so_step_result rd = so_test_step_result(dev.s, td);
        CHECK(rh.skipped == rd.skipped && rh.global_norm == rd.global_norm);
        if (kind == RUN_DEVICE) CHECK(rd.device_stepped == (rd.skipped ? 0u : 1u));
        printf("step %d: skipped %d clip %.3f rescaled %u rolled back %u redone %u kept %u\n", step, rd.skipped,
               rd.clip_coef, rd.rescaled, rd.rolled_back, rd.redone, rd.kept);
        /* The published parameters, read back after a GPU-side wait on each final ticket. */
        off = 0;
        for (int k = 0; k < NSG; k++) {
            so_ticket fin;
            CHECK_OK(so_session_final_ticket(dev.s, (uint32_t)k, &fin));
            CHECK_OK(so_ticket_enqueue_wait(dev.s, fin, stream));
            CU_CHECK(cu.dtoh_async(readback + off, d_params[k], dev.numel[k] * 2, stream));
            off += dev.numel[k];
        }
        CU_CHECK(cu.stream_sync(stream));
        if (kind == RUN_DEVICE) {
            /* The GPU holds sub-group 1's state: bring it into its host master buffer. */
            so_subgroup_state st;
            memset(&st, 0, sizeof st);
            st.struct_size = sizeof st;
            CHECK_OK(so_session_get_subgroup_state(dev.s, 1, &st));
            CHECK(st.placement == SO_PLACEMENT_DEVICE && st.master == (void *)dev.master[1]);
        }
        off = 0;
        for (int k = 0; k < NSG; k++) {
            for (size_t i = 0; i < dev.numel[k]; i++) {
                CHECKF(so_f32_to_bits(host.master[k][i]) == so_f32_to_bits(dev.master[k][i]),
                       "step %d sub-group %d element %zu: host %.9g, cuda %.9g", step, k, i, (double)host.master[k][i],
                       (double)dev.master[k][i]);
            }
            for (size_t i = 0; i < dev.numel[k]; i++) {
                /* A skipped step publishes nothing: the device keeps the previous weights
                 * (the rolled-back master equals them only up to rounding). */
                uint16_t want = overflow ? previous[off + i] : so_f32_to_bf16(dev.master[k][i]);
                CHECKF(readback[off + i] == want, "step %d sub-group %d element %zu: device %#06x, expected %#06x",
                       step, k, i, readback[off + i], want);
            }
            off += dev.numel[k];
        }
        memcpy(previous, readback, total * 2);
        CHECK_OK(so_session_pinned_bytes(dev.s, &pinned));
    }
    size_t device_bytes = 0;
    CHECK_OK(so_session_device_bytes(dev.s, &device_bytes));
    printf("pinned bytes: %zu, device bytes: %zu\n", pinned, device_bytes);
    CHECK(pinned > 0 && device_bytes > 0);
    so_session_destroy(host.s);
    so_session_destroy(dev.s);
    CU_CHECK(cu.stream_destroy(stream));
    CU_CHECK(cu.mem_free(d_late));
    for (int k = 0; k < NSG; k++) {
        CU_CHECK(cu.mem_free(d_params[k]));
        CU_CHECK(cu.mem_free(d_grads[k]));
        free(host.master[k]);
        free(dev.master[k]);
    }
    free(grad);
    free(late);
    free(readback);
    free(previous);
    printf("CUDA session bit-identical to the host session over %d steps (%s)\n", STEPS, names[kind]);
}

int main(void) {
    cuda_driver_load();
    run(RUN_OFF);
    run(RUN_DEVICE);
    run(RUN_SPECULATIVE);
    return 0;
}
