/* Device-placed sub-groups (SO_PLACEMENT_DEVICE): the library's GPU Adam kernel against the
 * CPU kernel (so_adam_update) on the same inputs, bit for bit, for every gradient, moment and
 * parameter dtype a CUDA session supports with f32 master weights, AdamW and Adam-L2, with a
 * clip factor; with speculation on, a device-placed sub-group ends every kind of step (kept,
 * rescaled, rolled back, redone) with the bits of a host-placed one; a checkpoint saved with
 * one host/GPU split loads bit-exactly into another and resumes bit for bit; moving a
 * sub-group to the GPU and back changes no bit. */
#include <unistd.h>

#include "cuda_driver.h"

/* Slice b (N - 30000 elements) is more than one grid's batch of the kernel (2112 blocks of 256
 * threads, four elements each), so threads step a second batch, some only in part. */
#define N 2200001

static size_t dsize(uint32_t dtype) { return dtype == SO_DTYPE_F32 ? 4 : 2; }

typedef struct {
    so_session *s;
    float *master;
    cu_ptr d_param, d_grad;
    uint32_t grad_dtype, moment_dtype, param_dtype;
} one;

static one make_with(uint32_t grad_dtype, uint32_t moment_dtype, uint32_t param_dtype, uint32_t mode,
                     uint32_t placement, uint32_t speculation, const float *init) {
    one o;
    o.grad_dtype = grad_dtype;
    o.moment_dtype = moment_dtype;
    o.param_dtype = param_dtype;
    so_session_options opts = so_session_options_default();
    opts.grad_dtype = opts.accum_dtype = grad_dtype;
    opts.moment_dtype = moment_dtype;
    opts.mode = mode;
    opts.speculation = speculation;
    CHECK_OK(so_session_create_cuda(&opts, NULL, &o.s));
    so_group_hparams h = so_group_hparams_default();
    h.weight_decay = 0.05;
    uint32_t g = 0, id = 0;
    CHECK_OK(so_session_add_group(o.s, &h, &g));
    o.master = (float *)so_test_malloc(N * 4);
    memcpy(o.master, init, N * 4);
    CU_CHECK(cu.mem_alloc(&o.d_param, N * dsize(param_dtype)));
    CU_CHECK(cu.mem_alloc(&o.d_grad, N * dsize(grad_dtype)));
    so_slice_desc sl[2] = {{"a", 0, 30000}, {"b", 30000, N - 30000}};
    so_subgroup_desc d = so_subgroup_desc_default();
    d.master = o.master;
    d.numel = N;
    d.slices = sl;
    d.num_slices = 2;
    d.device_param = o.d_param;
    d.device_param_dtype = param_dtype;
    d.placement = placement;
    CHECK_OK(so_session_add_subgroup(o.s, &d, &id));
    return o;
}

static one make(uint32_t grad_dtype, uint32_t moment_dtype, uint32_t param_dtype, uint32_t mode, uint32_t placement,
                const float *init) {
    return make_with(grad_dtype, moment_dtype, param_dtype, mode, placement, SO_SPECULATION_OFF, init);
}

static void drop(one *o) {
    so_session_destroy(o->s);
    CU_CHECK(cu.mem_free(o->d_param));
    CU_CHECK(cu.mem_free(o->d_grad));
    free(o->master);
}

/* One step with gradient `g` (grad dtype, uploaded to the device) and `a`; with `lr` > 0, the
 * group's learning rate changes between backward and the step. The result. */
static so_step_result step_with(one *o, const void *g, so_step_args a, double lr) {
    CU_CHECK(cu.ctx_sync());
    CU_CHECK(cu.htod(o->d_grad, g, N * dsize(o->grad_dtype)));
    CHECK_OK(so_session_begin_step(o->s, 1.0f, 1));
    size_t half = 30000 * dsize(o->grad_dtype);
    CHECK_OK(so_session_grad_device(o->s, 1, o->d_grad + half, N - 30000, o->grad_dtype, NULL, NULL));
    so_ticket speculative = 0;
    CHECK_OK(so_session_grad_device(o->s, 0, o->d_grad, 30000, o->grad_dtype, NULL, &speculative));
    /* A speculative step is queued when the sub-group's gradient is complete; waiting for it
     * makes sure that a device-placed one is queued on the GPU before the step is decided. */
    if (speculative != 0) CHECK_OK(so_ticket_wait(o->s, speculative, -1));
    if (lr > 0) {
        so_group_hparams h = so_group_hparams_default();
        h.weight_decay = 0.05;
        h.lr = lr;
        CHECK_OK(so_session_set_group(o->s, 0, &h));
    }
    so_ticket t = 0;
    CHECK_OK(so_session_step(o->s, &a, &t));
    return so_test_step_result(o->s, t);
}

/* One step with gradient `g` and max_norm; the result. */
static so_step_result step(one *o, const void *g, double max_norm) {
    so_step_args a = so_step_args_default();
    a.max_norm = max_norm;
    return step_with(o, g, a, 0.0);
}

static so_subgroup_state state(one *o) {
    so_subgroup_state st;
    memset(&st, 0, sizeof st);
    st.struct_size = sizeof st;
    CHECK_OK(so_session_get_subgroup_state(o->s, 0, &st));
    return st;
}

static void kernel_matches_cpu(so_pool *pool) {
    const uint32_t grads[] = {SO_DTYPE_F32, SO_DTYPE_BF16, SO_DTYPE_F16};
    const uint32_t moments[] = {SO_DTYPE_F32, SO_DTYPE_BF16};
    const uint32_t params[] = {SO_DTYPE_F32, SO_DTYPE_BF16, SO_DTYPE_F16};
    const uint32_t modes[] = {SO_ADAM_MODE_ADAMW, SO_ADAM_MODE_L2};
    so_rng rng = so_rng_new(5);
    float *init = (float *)so_test_malloc(N * 4);
    for (size_t i = 0; i < N; i++) init[i] = (float)so_rng_normalish(&rng, 0.1);
    void *g = so_test_malloc(N * 4);
    void *ref_m = so_test_malloc(N * 4), *ref_v = so_test_malloc(N * 4), *ref_copy = so_test_malloc(N * 4);
    float *ref_p = (float *)so_test_malloc(N * 4);
    void *readback = so_test_malloc(N * 4);
    int combos = 0;
    for (size_t gi = 0; gi < 3; gi++)
        for (size_t mi = 0; mi < 2; mi++)
            for (size_t pi = 0; pi < 3; pi++)
                for (size_t di = 0; di < 2; di++) {
                    one o = make(grads[gi], moments[mi], params[pi], modes[di], SO_PLACEMENT_DEVICE, init);
                    memcpy(ref_p, init, N * 4);
                    memset(ref_m, 0, N * 4);
                    memset(ref_v, 0, N * 4);
                    for (int s = 1; s <= 3; s++) {
                        for (size_t i = 0; i < N; i++) so_store(g, grads[gi], i, so_rng_normalish(&rng, 0.02));
                        const so_step_result r = step(&o, g, s == 2 ? 0.5 : 0.0); /* step 2 clips */
                        CHECK(!r.skipped && r.device_stepped == 1 && r.stepped == 0);
                        /* The CPU kernel on the same inputs, with the step's factor. */
                        so_adam_hparams hp = so_adam_hparams_default();
                        hp.mode = modes[di];
                        hp.weight_decay = 0.05;
                        hp.step = (uint64_t)s;
                        so_adam_buffers b = so_test_adam_buffers(N, ref_p, g, ref_m, ref_v);
                        b.grad_dtype = grads[gi];
                        b.moment_dtype = moments[mi];
                        if (params[pi] != SO_DTYPE_F32) {
                            b.param_copy = ref_copy;
                            b.param_copy_dtype = params[pi];
                        }
                        so_test_adam_step(pool, &hp, &b, r.grad_factor, NULL);
                        const so_subgroup_state st = state(&o);
                        CHECK(st.placement == SO_PLACEMENT_DEVICE && st.step_count == (uint64_t)s);
                        CU_CHECK(cu.dtoh(readback, o.d_param, N * dsize(params[pi])));
                        const void *want_param = params[pi] == SO_DTYPE_F32 ? (const void *)ref_p : ref_copy;
                        for (size_t i = 0; i < N; i++) {
                            CHECKF(so_raw(st.master, SO_DTYPE_F32, i) == so_raw(ref_p, SO_DTYPE_F32, i) &&
                                       so_raw(st.exp_avg, moments[mi], i) == so_raw(ref_m, moments[mi], i) &&
                                       so_raw(st.exp_avg_sq, moments[mi], i) == so_raw(ref_v, moments[mi], i) &&
                                       so_raw(readback, params[pi], i) == so_raw(want_param, params[pi], i),
                                   "grad %u moments %u param %u mode %u step %d element %zu: GPU %.9g, CPU %.9g",
                                   grads[gi], moments[mi], params[pi], modes[di], s, i, (double)o.master[i],
                                   (double)ref_p[i]);
                        }
                    }
                    drop(&o);
                    combos++;
                }
    printf("GPU kernel bit-identical to the CPU kernel: %d dtype and mode combinations x 3 steps\n", combos);
    free(init);
    free(g);
    free(ref_m);
    free(ref_v);
    free(ref_copy);
    free(ref_p);
    free(readback);
}

/* Speculation on: the host-placed sub-group takes a speculative step and resolves it; the
 * device-placed one queues its update on the GPU at hand-off (unpublished) and resolves it
 * in its final step. Both end each step with the same bits. */
static void speculation_resolved_alike(void) {
    so_rng rng = so_rng_new(13);
    float *init = (float *)so_test_malloc(N * 4);
    for (size_t i = 0; i < N; i++) init[i] = (float)so_rng_normalish(&rng, 0.1);
    uint16_t *g = (uint16_t *)so_test_malloc(N * 2);
    uint16_t *published = (uint16_t *)so_test_malloc(N * 2), *readback = (uint16_t *)so_test_malloc(N * 2);
    const uint32_t modes[] = {SO_ADAM_MODE_ADAMW, SO_ADAM_MODE_L2};
    for (size_t di = 0; di < 2; di++) {
        one on_gpu = make_with(SO_DTYPE_BF16, SO_DTYPE_F32, SO_DTYPE_BF16, modes[di], SO_PLACEMENT_DEVICE,
                               SO_SPECULATION_ON, init);
        CU_CHECK(cu.ctx_sync());
        CU_CHECK(cu.dtoh(published, on_gpu.d_param, N * 2));
        one on_cpu = make_with(SO_DTYPE_BF16, SO_DTYPE_F32, SO_DTYPE_BF16, modes[di], SO_PLACEMENT_HOST,
                               SO_SPECULATION_ON, init);
        /* kept, rescaled (clipped), rolled back (overflow), redone (lr changed), kept */
        const double max_norms[] = {0.0, 0.3, 0.3, 0.0, 0.0};
        const bool overflows[] = {false, false, true, false, false};
        const double lrs[] = {0.0, 0.0, 0.0, 3e-3, 0.0};
        for (int s = 0; s < 5; s++) {
            for (size_t i = 0; i < N; i++) g[i] = so_f32_to_bf16((float)so_rng_normalish(&rng, 0.02));
            so_step_args a = so_step_args_default();
            a.max_norm = max_norms[s];
            a.overflow = overflows[s];
            const so_step_result rg = step_with(&on_gpu, g, a, lrs[s]);
            const so_step_result rc = step_with(&on_cpu, g, a, lrs[s]);
            CHECKF(rg.skipped == rc.skipped && rg.grad_factor == rc.grad_factor &&
                       rc.kept + rc.rescaled + rc.rolled_back + rc.redone == 1,
                   "mode %u step %d", modes[di], s);
            const so_subgroup_state sg = state(&on_gpu), sc = state(&on_cpu);
            CHECKF(sg.step_count == sc.step_count && memcmp(sg.master, sc.master, N * 4) == 0 &&
                       memcmp(sg.exp_avg, sc.exp_avg, N * 4) == 0 && memcmp(sg.exp_avg_sq, sc.exp_avg_sq, N * 4) == 0,
                   "mode %u step %d (kept %u rescaled %u rolled back %u redone %u): GPU and CPU differ", modes[di], s,
                   rc.kept, rc.rescaled, rc.rolled_back, rc.redone);
            /* The parameter: the new master weights rounded (a kept update is published from
             * them, not by the step kernel), or, skipped, the previous step's. */
            CU_CHECK(cu.ctx_sync());
            CU_CHECK(cu.dtoh(readback, on_gpu.d_param, N * 2));
            if (!rg.skipped)
                for (size_t i = 0; i < N; i++) published[i] = so_f32_to_bf16(((const float *)sg.master)[i]);
            CHECKF(memcmp(readback, published, N * 2) == 0, "mode %u step %d: the published parameter", modes[di], s);
        }
        drop(&on_gpu);
        drop(&on_cpu);
    }
    printf("speculative steps resolved on the GPU: the CPU's bits (kept, rescaled, rolled back, redone)\n");
    free(init);
    free(g);
    free(published);
    free(readback);
}

static void checkpoint_across_splits(void) {
    so_rng rng = so_rng_new(9);
    float *init = (float *)so_test_malloc(N * 4);
    for (size_t i = 0; i < N; i++) init[i] = (float)so_rng_normalish(&rng, 0.1);
    uint16_t *g = (uint16_t *)so_test_malloc(N * 2 * 6);
    for (size_t i = 0; i < N * 6; i++) g[i] = so_f32_to_bf16((float)so_rng_normalish(&rng, 0.02));
    one on_gpu = make(SO_DTYPE_BF16, SO_DTYPE_F32, SO_DTYPE_BF16, SO_ADAM_MODE_ADAMW, SO_PLACEMENT_DEVICE, init);
    one on_cpu = make(SO_DTYPE_BF16, SO_DTYPE_F32, SO_DTYPE_BF16, SO_ADAM_MODE_ADAMW, SO_PLACEMENT_HOST, init);
    for (int s = 0; s < 3; s++) {
        step(&on_gpu, g + (size_t)s * N, 0.3);
        step(&on_cpu, g + (size_t)s * N, 0.3);
    }
    char path[600];
    snprintf(path, sizeof path, "%s/so-gpu-split-%d.safetensors", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp",
             (int)getpid());
    CHECK_OK(so_session_save(on_gpu.s, path));
    /* Loaded into a host-placed sub-group, and into a GPU-placed one: both continue exactly
     * as the run that never stopped (the GPU and CPU steps are the same bits). */
    one resumed_cpu = make(SO_DTYPE_BF16, SO_DTYPE_F32, SO_DTYPE_BF16, SO_ADAM_MODE_ADAMW, SO_PLACEMENT_HOST, init);
    one resumed_gpu = make(SO_DTYPE_BF16, SO_DTYPE_F32, SO_DTYPE_BF16, SO_ADAM_MODE_ADAMW, SO_PLACEMENT_DEVICE, init);
    CHECK_OK(so_session_load(resumed_cpu.s, path));
    CHECK_OK(so_session_load(resumed_gpu.s, path));
    remove(path);
    for (int s = 3; s < 6; s++) {
        step(&on_gpu, g + (size_t)s * N, 0.3);
        step(&on_cpu, g + (size_t)s * N, 0.3);
        step(&resumed_cpu, g + (size_t)s * N, 0.3);
        step(&resumed_gpu, g + (size_t)s * N, 0.3);
    }
    one *all[4] = {&on_gpu, &on_cpu, &resumed_cpu, &resumed_gpu};
    so_subgroup_state st[4];
    for (int k = 0; k < 4; k++) st[k] = state(all[k]);
    for (int k = 1; k < 4; k++) {
        CHECK(st[k].step_count == 6);
        CHECKF(memcmp(st[0].master, st[k].master, N * 4) == 0 && memcmp(st[0].exp_avg, st[k].exp_avg, N * 4) == 0 &&
                   memcmp(st[0].exp_avg_sq, st[k].exp_avg_sq, N * 4) == 0,
               "run %d differs from the GPU-placed run", k);
    }
    /* To the host and back: nothing changes; the step after is still the same bits. */
    CHECK_OK(so_session_set_placement(on_gpu.s, 0, SO_PLACEMENT_HOST));
    CHECK(state(&on_gpu).placement == SO_PLACEMENT_HOST);
    CHECK(memcmp(on_gpu.master, on_cpu.master, N * 4) == 0);
    CHECK_OK(so_session_set_placement(on_gpu.s, 0, SO_PLACEMENT_DEVICE));
    step(&on_gpu, g, 0.3);
    step(&on_cpu, g, 0.3);
    CHECK(memcmp(state(&on_gpu).master, on_cpu.master, N * 4) == 0);
    size_t bytes = 0;
    CHECK_OK(so_session_device_bytes(on_gpu.s, &bytes));
    CHECK(bytes >= (size_t)N * 14);
    printf("checkpoint across GPU/CPU splits and placement moves: bit-exact (device bytes %zu)\n", bytes);
    for (int k = 0; k < 4; k++) drop(all[k]);
    free(init);
    free(g);
}

int main(void) {
    cuda_driver_load();
    so_pool *pool = so_test_pool(SO_ISA_AUTO, 4);
    kernel_matches_cpu(pool);
    speculation_resolved_alike();
    checkpoint_across_splits();
    so_pool_destroy(pool);
    /* A host session refuses device placement. */
    so_session *h = NULL;
    CHECK_OK(so_session_create(NULL, &h));
    CHECK_STATUS(so_session_set_placement(h, 0, SO_PLACEMENT_DEVICE), SO_STATUS_NOT_FOUND);
    so_session_destroy(h);
    printf("gpu_device_placement: ok\n");
    return 0;
}
