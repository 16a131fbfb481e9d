/* CUDA faults reach the caller as a status and a message, never as a hang, a crash, a leak
 * or wrong weights:
 *
 * 1. host registration refused (the transport's fault injection
 *    SUPEROFFLOAD_DEBUG_REGISTER_LIMIT stands in for a pinned-memory limit):
 *    so_session_add_subgroup fails with a CUDA status and changes nothing; the same
 *    sub-group is accepted once registration works again;
 * 2. the upload of a device-placed sub-group refused (SUPEROFFLOAD_DEBUG_UPLOAD=fail):
 *    so_session_add_subgroup fails with a CUDA status and leaves neither device memory (the
 *    free memory the driver reports comes back) nor a host registration behind (the sums of
 *    squares' partials the transport page-locked, then freed: fresh heap blocks must all be
 *    registrable); the same sub-group is accepted once uploads work again;
 * 3. a session destroyed while gradient copies are queued behind caller work that has not
 *    run yet: so_session_destroy waits for them (it returns only after the caller's stream
 *    is released) and nothing writes into freed memory (valgrind and ASan see this run);
 * 4. a caller stream that faults (an illegal address, a sticky error that ruins the
 *    context) while a gradient copy is queued behind it: the ticket of that hand-off and
 *    the step report SO_STATUS_CUDA_ERROR with a message, the master weights are unchanged,
 *    and so_session_destroy returns. This one runs last: nothing CUDA works afterwards.
 *
 * 1 and 2 need a library built with its fault switches (-DSO_FAULT_INJECTION=ON; ctest then
 * sets SO_TEST_FAULT_INJECTION=1): without, they are skipped and so is the test (exit 77),
 * after the other cases have run. */
#include <pthread.h>
#include <time.h>

#include "cuda_driver.h"

#define NUMEL ((size_t)1 << 20)
#define CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED 712

typedef struct cu_mod_st *cu_module;
typedef struct cu_func_st *cu_function;

static struct {
    cu_result (*write_value32)(so_cuda_stream_t, cu_ptr, uint32_t, unsigned);
    cu_result (*wait_value32)(so_cuda_stream_t, cu_ptr, uint32_t, unsigned);
    cu_result (*module_load_data)(cu_module *, const void *);
    cu_result (*module_get_function)(cu_function *, cu_module, const char *);
    cu_result (*launch)(cu_function, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                        so_cuda_stream_t, void **, void **);
    cu_result (*mem_get_info)(size_t *, size_t *);
    cu_result (*host_register)(void *, size_t, unsigned);
    cu_result (*host_unregister)(void *);
} cux;

static int skipped;

static void load_extra(void) {
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    CHECK(lib != NULL);
    *(void **)(&cux.write_value32) = dlsym(lib, "cuStreamWriteValue32_v2");
    *(void **)(&cux.wait_value32) = dlsym(lib, "cuStreamWaitValue32_v2");
    *(void **)(&cux.module_load_data) = dlsym(lib, "cuModuleLoadData");
    *(void **)(&cux.module_get_function) = dlsym(lib, "cuModuleGetFunction");
    *(void **)(&cux.launch) = dlsym(lib, "cuLaunchKernel");
    *(void **)(&cux.mem_get_info) = dlsym(lib, "cuMemGetInfo_v2");
    *(void **)(&cux.host_register) = dlsym(lib, "cuMemHostRegister_v2");
    *(void **)(&cux.host_unregister) = dlsym(lib, "cuMemHostUnregister");
    CHECK(cux.write_value32 && cux.wait_value32 && cux.module_load_data && cux.module_get_function && cux.launch);
    CHECK(cux.mem_get_info && cux.host_register && cux.host_unregister);
}

/* Whether the library has its fault switches; if not, `what` is skipped (visibly). */
static int fault_switches(const char *what) {
    const char *built = getenv("SO_TEST_FAULT_INJECTION");
    if (built && strcmp(built, "1") == 0) return 1;
    printf("SKIP %s: the library has no fault switches (configure with -DSO_FAULT_INJECTION=ON)\n", what);
    skipped++;
    return 0;
}

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* One f32 sub-group with a bf16 gradient from the device and bf16 parameters on it. */
typedef struct fixture {
    so_session *s;
    float *master, *master_before;
    uint16_t *grad_host;
    cu_ptr d_grad, d_param;
} fixture;

static so_status add_subgroup(fixture *f, uint32_t *sg) {
    uint32_t group;
    so_group_hparams hp = so_group_hparams_default();
    CHECK_OK(so_session_add_group(f->s, &hp, &group));
    so_slice_desc slice = {"w", 0, NUMEL};
    so_subgroup_desc d = so_subgroup_desc_default();
    d.group = group;
    d.master = f->master;
    d.numel = NUMEL;
    d.grad = f->grad_host;
    d.slices = &slice;
    d.num_slices = 1;
    d.device_param = f->d_param;
    d.device_param_dtype = SO_DTYPE_BF16;
    return so_session_add_subgroup(f->s, &d, sg);
}

static void fixture_new(fixture *f) {
    f->master = (float *)so_test_malloc(NUMEL * 4);
    so_rng rng = so_rng_new(7);
    for (size_t i = 0; i < NUMEL; i++) f->master[i] = (float)so_rng_normalish(&rng, 0.02);
    f->master_before = (float *)so_test_dup(f->master, NUMEL * 4);
    f->grad_host = (uint16_t *)so_test_malloc(NUMEL * 2);
    uint16_t *grad = (uint16_t *)so_test_malloc(NUMEL * 2);
    for (size_t i = 0; i < NUMEL; i++) grad[i] = so_f32_to_bf16((float)so_rng_normalish(&rng, 1e-3));
    CU_CHECK(cu.mem_alloc(&f->d_grad, NUMEL * 2));
    CU_CHECK(cu.mem_alloc(&f->d_param, NUMEL * 2));
    CU_CHECK(cu.htod(f->d_grad, grad, NUMEL * 2));
    CU_CHECK(cu.ctx_sync());
    free(grad);
    so_session_options o = so_session_options_default();
    o.grad_dtype = SO_DTYPE_BF16;
    o.accum_dtype = SO_DTYPE_BF16;
    f->s = NULL;
    CHECK_OK(so_session_create_cuda(&o, NULL, &f->s));
}

static void fixture_free(fixture *f, int cuda_works) {
    if (f->s) so_session_destroy(f->s);
    if (cuda_works) {
        CU_CHECK(cu.mem_free(f->d_grad));
        CU_CHECK(cu.mem_free(f->d_param));
    }
    free(f->master);
    free(f->master_before);
    free(f->grad_host);
}

static void registration_refused(void) {
    if (!fault_switches("registration refused")) return;
    fixture f;
    fixture_new(&f);
    setenv("SUPEROFFLOAD_DEBUG_REGISTER_LIMIT", "4096", 1);
    uint32_t sg = 99;
    so_status st = add_subgroup(&f, &sg);
    char msg[512];
    so_last_error_message(msg, sizeof msg);
    CHECKF(st == SO_STATUS_CUDA_ERROR, "add_subgroup with registration refused: %s (%s)", so_status_str(st), msg);
    CHECKF(strstr(msg, "cuMemHostRegister") != NULL, "the message names the refused call: %s", msg);
    CHECK(sg == 99);
    size_t pinned = 1;
    CHECK_OK(so_session_pinned_bytes(f.s, &pinned));
    CHECKF(pinned == 0, "pinned bytes after the refusal: %zu", pinned);
    unsetenv("SUPEROFFLOAD_DEBUG_REGISTER_LIMIT");
    CHECK_OK(add_subgroup(&f, &sg));
    CHECK_OK(so_session_pinned_bytes(f.s, &pinned));
    CHECK(pinned > 0);
    fixture_free(&f, 1);
    printf("registration refused: %s; accepted once registration works\n", msg);
}

static size_t device_free_bytes(void) {
    size_t free_bytes, total;
    CU_CHECK(cux.mem_get_info(&free_bytes, &total));
    return free_bytes;
}

/* Whether heap memory is still page-locked after everything was unpinned: fresh blocks
 * whose registration is refused as "already registered" overlap a range someone freed
 * without unregistering it. malloc hands out the smallest free blocks that fit first, so
 * a small freed range (the partials) is among the first probes. */
static int heap_still_registered(void) {
    enum { PROBES = 512, PROBE_BYTES = 4096 };
    void *probe[PROBES];
    int found = 0;
    /* All allocated first: the driver's own allocations must not take the freed blocks. */
    for (int i = 0; i < PROBES; i++) probe[i] = so_test_malloc(PROBE_BYTES);
    for (int i = 0; i < PROBES; i++) {
        cu_result r = cux.host_register(probe[i], PROBE_BYTES, 0);
        if (r == CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED) {
            found = 1;
        } else {
            CU_CHECK(r);
            CU_CHECK(cux.host_unregister(probe[i]));
        }
    }
    for (int i = 0; i < PROBES; i++) free(probe[i]);
    return found;
}

#define UPLOAD_NUMEL ((size_t)1 << 24)
#define UPLOAD_ATTEMPTS 3

static void upload_refused(void) {
    if (!fault_switches("upload refused")) return;
    so_session_options o = so_session_options_default();
    o.grad_dtype = SO_DTYPE_BF16;
    o.accum_dtype = SO_DTYPE_BF16;
    o.moment_dtype = SO_DTYPE_F32;
    so_session *s = NULL;
    CHECK_OK(so_session_create_cuda(&o, NULL, &s));
    uint32_t group;
    so_group_hparams hp = so_group_hparams_default();
    CHECK_OK(so_session_add_group(s, &hp, &group));
    float *master = (float *)so_test_malloc(UPLOAD_NUMEL * 4);
    for (size_t i = 0; i < UPLOAD_NUMEL; i++) master[i] = (float)(i % 1000) * 1e-3f;
    cu_ptr d_param;
    CU_CHECK(cu.mem_alloc(&d_param, UPLOAD_NUMEL * 2));
    so_slice_desc slice = {"w", 0, UPLOAD_NUMEL};
    so_subgroup_desc d = so_subgroup_desc_default();
    d.group = group;
    d.master = master;
    d.numel = UPLOAD_NUMEL;
    d.slices = &slice;
    d.num_slices = 1;
    d.device_param = d_param;
    d.device_param_dtype = SO_DTYPE_BF16;
    d.placement = SO_PLACEMENT_DEVICE;
    /* What a failed attempt would leave behind: the device state (f32 master and moments,
     * the bf16 gradient). */
    size_t state_bytes = UPLOAD_NUMEL * (4 + 4 + 4 + 2);

    size_t free_before = device_free_bytes();
    setenv("SUPEROFFLOAD_DEBUG_UPLOAD", "fail", 1);
    char msg[512] = "";
    for (int attempt = 0; attempt < UPLOAD_ATTEMPTS; attempt++) {
        uint32_t sg = 99;
        so_status st = so_session_add_subgroup(s, &d, &sg);
        so_last_error_message(msg, sizeof msg);
        CHECKF(st == SO_STATUS_CUDA_ERROR, "add_subgroup with the upload refused: %s (%s)", so_status_str(st), msg);
        CHECKF(strstr(msg, "cuMemcpyHtoDAsync") != NULL, "the message names the refused call: %s", msg);
        CHECK(sg == 99);
        CHECKF(!heap_still_registered(), "attempt %d left a host registration behind", attempt);
    }
    size_t free_after = device_free_bytes();
    unsetenv("SUPEROFFLOAD_DEBUG_UPLOAD");
    size_t lost = free_before > free_after ? free_before - free_after : 0;
    CHECKF(lost < state_bytes / 2, "%zu MiB of device memory gone after %d refused uploads (a device state: %zu MiB)",
           lost >> 20, UPLOAD_ATTEMPTS, state_bytes >> 20);
    size_t bytes = 1;
    CHECK_OK(so_session_device_bytes(s, &bytes));
    CHECKF(bytes == 0, "device bytes after the refusals: %zu", bytes);
    CHECK_OK(so_session_pinned_bytes(s, &bytes));
    CHECKF(bytes == 0, "pinned bytes after the refusals: %zu", bytes);

    uint32_t sg;
    CHECK_OK(so_session_add_subgroup(s, &d, &sg));
    CHECK_OK(so_session_device_bytes(s, &bytes));
    CHECKF(bytes >= state_bytes, "device bytes once accepted: %zu", bytes);
    so_session_destroy(s);
    CU_CHECK(cu.mem_free(d_param));
    free(master);
    printf("upload refused: %s; %zu MiB of device memory gone after %d attempts; accepted once uploads work\n", msg,
           lost >> 20, UPLOAD_ATTEMPTS);
}

typedef struct release_arg {
    so_cuda_stream_t stream;
    cu_ptr flag;
    double at;
} release_arg;

static void *release_later(void *p) {
    release_arg *a = (release_arg *)p;
    struct timespec delay = {0, 300 * 1000 * 1000};
    nanosleep(&delay, NULL);
    a->at = now_s();
    CU_CHECK(cux.write_value32(a->stream, a->flag, 1, 0));
    return NULL;
}

static void destroy_with_copies_queued(void) {
    fixture f;
    fixture_new(&f);
    uint32_t sg;
    CHECK_OK(add_subgroup(&f, &sg));
    so_cuda_stream_t caller, releaser;
    CU_CHECK(cu.stream_create(&caller, 1));
    CU_CHECK(cu.stream_create(&releaser, 1));
    cu_ptr flag;
    CU_CHECK(cu.mem_alloc(&flag, 8));
    uint32_t zero = 0;
    CU_CHECK(cu.htod(flag, &zero, 4));
    /* The caller's stream is held at a device word: the hand-off's copies queue behind it. */
    CU_CHECK(cux.wait_value32(caller, flag, 1, 0 /* GEQ */));
    CHECK_OK(so_session_begin_step(f.s, 1.0f, 1));
    CHECK_OK(so_session_grad_device(f.s, sg, f.d_grad, NUMEL, SO_DTYPE_BF16, caller, NULL));
    release_arg a = {releaser, flag, 0.0};
    pthread_t t;
    CHECK(pthread_create(&t, NULL, release_later, &a) == 0);
    so_session_destroy(f.s);
    double returned = now_s();
    f.s = NULL;
    CHECK(pthread_join(t, NULL) == 0);
    CHECKF(returned >= a.at, "so_session_destroy returned %.3f s before the queued copies could run", a.at - returned);
    CU_CHECK(cu.stream_sync(caller));
    CU_CHECK(cu.stream_destroy(caller));
    CU_CHECK(cu.stream_destroy(releaser));
    CU_CHECK(cu.mem_free(flag));
    fixture_free(&f, 1);
    printf("destroy with copies queued: returned %.0f ms after the caller's stream was released\n",
           (returned - a.at) * 1e3);
}

/* A kernel that stores to the address it is given: with a bad address, an illegal-address
 * fault (sticky: the context is lost). */
static const char fault_ptx[] =
    ".version 7.0\n"
    ".target sm_80\n"
    ".address_size 64\n"
    ".visible .entry so_test_fault(.param .u64 p)\n"
    "{\n"
    "  .reg .b64 %rd<2>;\n"
    "  .reg .b32 %r<2>;\n"
    "  ld.param.u64 %rd1, [p];\n"
    "  mov.u32 %r1, 1;\n"
    "  st.global.u32 [%rd1], %r1;\n"
    "  ret;\n"
    "}\n";

static void caller_stream_faults(void) {
    fixture f;
    fixture_new(&f);
    uint32_t sg;
    CHECK_OK(add_subgroup(&f, &sg));
    so_cuda_stream_t caller;
    CU_CHECK(cu.stream_create(&caller, 1));
    cu_module mod;
    cu_function fn;
    CU_CHECK(cux.module_load_data(&mod, fault_ptx));
    CU_CHECK(cux.module_get_function(&fn, mod, "so_test_fault"));
    uint64_t bad = 8;
    void *params[] = {&bad};
    CHECK_OK(so_session_begin_step(f.s, 1.0f, 1));
    CU_CHECK(cux.launch(fn, 1, 1, 1, 1, 1, 1, 0, caller, params, NULL));
    so_ticket spec = 0;
    so_status handed = so_session_grad_device(f.s, sg, f.d_grad, NUMEL, SO_DTYPE_BF16, caller, &spec);
    char msg[512] = "";
    so_status outcome = handed;
    if (handed == SO_STATUS_OK) {
        /* Enqueued before the fault was known: the work behind it must fail. */
        so_step_args args = so_step_args_default();
        so_ticket step = 0;
        so_status stepped = so_session_step(f.s, &args, &step);
        outcome = stepped;
        if (stepped == SO_STATUS_OK) outcome = so_ticket_wait(f.s, step, 30000000000LL);
        if (spec != 0) {
            so_status spec_status = so_ticket_wait(f.s, spec, 30000000000LL);
            CHECKF(spec_status != SO_STATUS_TIMEOUT, "the hand-off's ticket never completed");
        }
    }
    so_last_error_message(msg, sizeof msg);
    CHECKF(outcome == SO_STATUS_CUDA_ERROR, "a faulted caller stream gave %s (%s)", so_status_str(outcome), msg);
    CHECKF(strlen(msg) > 0, "the failure comes with a message");
    CHECKF(memcmp(f.master, f.master_before, NUMEL * 4) == 0, "master weights changed by a failed step");
    double t0 = now_s();
    fixture_free(&f, 0);
    printf("caller stream faulted: %s (%s); masters unchanged; destroy took %.0f ms\n", so_status_str(outcome), msg,
           (now_s() - t0) * 1e3);
}

int main(void) {
    cuda_driver_load();
    load_extra();
    registration_refused();
    upload_refused();
    destroy_with_copies_queued();
    caller_stream_faults();
    if (skipped) {
        printf("gpu_cuda_faults: ok, %d case(s) skipped\n", skipped);
        return 77;
    }
    printf("gpu_cuda_faults: ok\n");
    return 0;
}
