/* A 4090 x 4090 weight whose bf16 gradient goes to the host in two 16 MiB pieces arrives
 * exactly, and the speculative step reads all of it.
 *
 * With --expect-fault the test expects the transport's fault injection
 * (SUPEROFFLOAD_DEBUG_COPY=drop-last-piece or =no-final-wait, set by ctest) to make the
 * arrival wrong: the last piece missing, or the step reading before it landed. It exits 0
 * only if the fault is seen, proving the checks below would catch a broken protocol. */
#include "cuda_driver.h"

#define ROWS 4090
#define NUMEL ((size_t)ROWS * ROWS)

int main(int argc, char **argv) {
    int expect_fault = argc > 1 && strcmp(argv[1], "--expect-fault") == 0;
    cuda_driver_load();

    /* The gradient on the device: random bf16. */
    so_rng rng = so_rng_new(42);
    uint16_t *grad_src = (uint16_t *)so_test_malloc(NUMEL * 2);
    for (size_t i = 0; i < NUMEL; i++) grad_src[i] = so_f32_to_bf16((float)so_rng_normalish(&rng, 1e-3));
    cu_ptr d_grad, d_param;
    CU_CHECK(cu.mem_alloc(&d_grad, NUMEL * 2));
    CU_CHECK(cu.mem_alloc(&d_param, NUMEL * 2));
    CU_CHECK(cu.htod(d_grad, grad_src, NUMEL * 2));
    CU_CHECK(cu.ctx_sync()); /* a pageable upload may return before its DMA lands */

    /* Host side: f32 master weights and a caller gradient buffer poisoned with NaN, so a
     * step that reads a region before its copy landed fails its finiteness check. */
    float *master = (float *)so_test_malloc(NUMEL * 4);
    for (size_t i = 0; i < NUMEL; i++) master[i] = (float)so_rng_normalish(&rng, 0.02);
    float *master_ref = (float *)so_test_dup(master, NUMEL * 4);
    uint16_t *grad_host = (uint16_t *)so_test_malloc(NUMEL * 2);
    for (size_t i = 0; i < NUMEL; i++) grad_host[i] = 0x7FC0;

    so_session_options o = so_session_options_default();
    o.grad_dtype = SO_DTYPE_BF16;
    o.accum_dtype = SO_DTYPE_BF16;
    so_session *s = NULL;
    CHECK_OK(so_session_create_cuda(&o, NULL, &s));
    uint32_t group;
    so_group_hparams hp = so_group_hparams_default();
    CHECK_OK(so_session_add_group(s, &hp, &group));
    so_slice_desc slice = {"w", 0, NUMEL};
    so_subgroup_desc d = so_subgroup_desc_default();
    d.group = group;
    d.master = master;
    d.numel = NUMEL;
    d.grad = grad_host;
    d.slices = &slice;
    d.num_slices = 1;
    d.device_param = d_param;
    d.device_param_dtype = SO_DTYPE_BF16;
    uint32_t sg;
    CHECK_OK(so_session_add_subgroup(s, &d, &sg));

    so_cuda_stream_t stream;
    CU_CHECK(cu.stream_create(&stream, 1));
    CHECK_OK(so_session_begin_step(s, 1.0f, 1));
    so_ticket spec = 0;
    CHECK_OK(so_session_grad_device(s, 0, d_grad, NUMEL, SO_DTYPE_BF16, stream, &spec));
    CHECK(spec != 0);
    /* The protocol's promise: once the copy stream has passed the hand-off, the whole
     * gradient is on the host. Look at the very end of the last piece at once (a piece
     * still in flight leaves it NaN), then at everything once the step ran. */
    so_cuda_stream_t copy_stream;
    CHECK_OK(so_session_copy_stream(s, &copy_stream));
    CU_CHECK(cu.stream_sync(copy_stream));
    int tail_arrived = grad_host[NUMEL - 1] == grad_src[NUMEL - 1];
    so_status spec_status = so_ticket_wait(s, spec, -1);
    int arrived = tail_arrived && memcmp(grad_host, grad_src, NUMEL * 2) == 0;

    /* What the step should have produced: the same update on the true gradient. */
    so_adam_hparams ahp = so_adam_hparams_default();
    ahp.step = 1;
    float *m = (float *)calloc(NUMEL, 4), *v = (float *)calloc(NUMEL, 4);
    so_adam_buffers b = so_test_adam_buffers(NUMEL, master_ref, grad_src, m, v);
    b.grad_dtype = SO_DTYPE_BF16;
    CHECK_OK(so_adam_update(NULL, &ahp, &b, NULL, NULL));
    int stepped_right = spec_status == SO_STATUS_OK && memcmp(master, master_ref, NUMEL * 4) == 0;

    so_step_args args = so_step_args_default();
    so_ticket done;
    CHECK_OK(so_session_step(s, &args, &done));
    CHECK_OK(so_ticket_wait(s, done, -1));
    so_session_destroy(s);
    CU_CHECK(cu.stream_destroy(stream));
    CU_CHECK(cu.mem_free(d_grad));
    CU_CHECK(cu.mem_free(d_param));

    printf("gradient %s; speculative step %s (%s)\n", arrived ? "arrived exactly" : "DIFFERS from the source",
           stepped_right ? "read all of it" : "did NOT read the whole gradient", so_status_str(spec_status));
    if (expect_fault) {
        CHECKF(!arrived || !stepped_right, "the injected fault (%s) went unnoticed", getenv("SUPEROFFLOAD_DEBUG_COPY"));
        printf("the fault was detected, as it must be\n");
    } else {
        CHECK(arrived);
        CHECK(stepped_right);
    }
    free(grad_src);
    free(master);
    free(master_ref);
    free(grad_host);
    free(m);
    free(v);
    return 0;
}
