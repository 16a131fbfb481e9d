/* Buffers and streams in a CUDA session: master weights the caller already pinned are used
 * in place and not counted (nor unregistered) by the session; unpinned ones are pinned in
 * place and counted; the session's own gradient buffer is pinned when it is provisioned, at
 * the first step; a stream in graph capture is refused; a session destroyed with copies in
 * flight finishes them cleanly. */
#include "cuda_driver.h"

#define N ((size_t)1 << 22)

static so_session *session(void) {
    so_session_options o = so_session_options_default();
    o.grad_dtype = SO_DTYPE_BF16;
    o.accum_dtype = SO_DTYPE_BF16;
    so_session *s = NULL;
    CHECK_OK(so_session_create_cuda(&o, NULL, &s));
    uint32_t g;
    so_group_hparams hp = so_group_hparams_default();
    CHECK_OK(so_session_add_group(s, &hp, &g));
    return s;
}

static void add(so_session *s, float *master, cu_ptr param, const char *name) {
    so_slice_desc sl = {name, 0, N};
    so_subgroup_desc d = so_subgroup_desc_default();
    d.master = master;
    d.numel = N;
    d.slices = &sl;
    d.num_slices = 1;
    d.device_param = param;
    d.device_param_dtype = SO_DTYPE_BF16;
    uint32_t id;
    CHECK_OK(so_session_add_subgroup(s, &d, &id));
}

int main(void) {
    cuda_driver_load();
    cu_ptr param, grad;
    CU_CHECK(cu.mem_alloc(&param, N * 2));
    CU_CHECK(cu.mem_alloc(&grad, N * 2));
    uint16_t *g = (uint16_t *)so_test_malloc(N * 2);
    for (size_t i = 0; i < N; i++) g[i] = so_f32_to_bf16(1e-3f * (float)(i % 17));
    CU_CHECK(cu.htod(grad, g, N * 2));
    CU_CHECK(cu.ctx_sync()); /* a pageable upload may return before its DMA lands */

    /* Unpinned master: the session pins it in place, and its own gradient buffer once the
     * first step provisions it (the host has room for it). */
    so_session *s = session();
    float *plain = (float *)calloc(N, 4);
    add(s, plain, param, "plain");
    size_t pinned = 0;
    CHECK_OK(so_session_pinned_bytes(s, &pinned));
    CHECKF(pinned == N * 4, "pinned %zu, expected the master's %zu", pinned, N * 4);
    CHECK_OK(so_session_begin_step(s, 1.0f, 1));
    CHECK_OK(so_session_pinned_bytes(s, &pinned));
    CHECKF(pinned == N * 4 + N * 2, "pinned %zu, expected master %zu + gradient %zu", pinned, N * 4, N * 2);
    so_session_destroy(s);

    /* Caller-pinned master: used as it is, not counted, still pinned after destroy. */
    s = session();
    float *host_pinned = NULL;
    CU_CHECK(cu.host_alloc((void **)&host_pinned, N * 4));
    memset(host_pinned, 0, N * 4);
    add(s, host_pinned, param, "pinned");
    CHECK_OK(so_session_begin_step(s, 1.0f, 1));
    CHECK_OK(so_session_pinned_bytes(s, &pinned));
    CHECKF(pinned == N * 2, "pinned %zu: only the session's gradient buffer (%zu) is ours", pinned, N * 2);

    /* A stream in capture is refused, and the session stays usable. */
    so_cuda_stream_t stream, capturing;
    CU_CHECK(cu.stream_create(&stream, 1));
    CU_CHECK(cu.stream_create(&capturing, 1));
    CU_CHECK(cu.begin_capture(capturing, 0 /* global */));
    CHECK_STATUS(so_session_grad_device(s, 0, grad, N, SO_DTYPE_BF16, capturing, NULL), SO_STATUS_STREAM_CAPTURING);
    cu_graph graph = NULL;
    CU_CHECK(cu.end_capture(capturing, &graph));
    if (graph) CU_CHECK(cu.graph_destroy(graph));
    CHECK_STATUS(so_session_grad_device(s, 0, grad, N, SO_DTYPE_F32, stream, NULL), SO_STATUS_UNSUPPORTED);
    CHECK_OK(so_session_grad_device(s, 0, grad, N, SO_DTYPE_BF16, stream, NULL));
    so_ticket t;
    CHECK_OK(so_session_step(s, NULL, &t));
    CHECK_OK(so_ticket_wait(s, t, -1));
    CHECK(host_pinned[1] != 0.0f);

    /* Destroyed with the copy and the steps in flight. */
    CHECK_OK(so_session_begin_step(s, 1.0f, 1));
    CHECK_OK(so_session_grad_device(s, 0, grad, N, SO_DTYPE_BF16, stream, NULL));
    CHECK_OK(so_session_step(s, NULL, &t));
    so_session_destroy(s);
    /* Still the caller's pinned memory: the driver can copy into it asynchronously. */
    CU_CHECK(cu.dtoh_async(host_pinned, param, 4, stream));
    CU_CHECK(cu.stream_sync(stream));
    CU_CHECK(cu.host_free(host_pinned));

    /* Host sessions refuse the CUDA calls with a clear status. */
    so_session *h = NULL;
    CHECK_OK(so_session_create(NULL, &h));
    CHECK_STATUS(so_session_set_compute_stream(h, stream), SO_STATUS_INVALID_STATE);
    so_session_destroy(h);

    CU_CHECK(cu.stream_destroy(stream));
    CU_CHECK(cu.stream_destroy(capturing));
    CU_CHECK(cu.mem_free(param));
    CU_CHECK(cu.mem_free(grad));
    free(plain);
    free(g);
    printf("gpu_buffers: ok\n");
    return 0;
}
