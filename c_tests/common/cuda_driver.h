/* The CUDA driver calls the gpu_ tests need, loaded with dlopen: the tests build without
 * CUDA headers or libraries and exit 77 (skipped) where there is no driver or device. */
#ifndef SO_TEST_CUDA_DRIVER_H
#define SO_TEST_CUDA_DRIVER_H

#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "so_test.h"

typedef int cu_result;
typedef int cu_device;
typedef struct cu_ctx_st *cu_context;
typedef uint64_t cu_ptr;
typedef struct CUgraph_st *cu_graph;

struct cuda_driver {
    cu_result (*init)(unsigned);
    cu_result (*device_get)(cu_device *, int);
    cu_result (*primary_retain)(cu_context *, cu_device);
    cu_result (*ctx_set_current)(cu_context);
    cu_result (*mem_alloc)(cu_ptr *, size_t);
    cu_result (*mem_free)(cu_ptr);
    cu_result (*htod)(cu_ptr, const void *, size_t);
    cu_result (*dtoh)(void *, cu_ptr, size_t);
    cu_result (*dtoh_async)(void *, cu_ptr, size_t, so_cuda_stream_t);
    cu_result (*stream_create)(so_cuda_stream_t *, unsigned);
    cu_result (*stream_destroy)(so_cuda_stream_t);
    cu_result (*stream_sync)(so_cuda_stream_t);
    cu_result (*begin_capture)(so_cuda_stream_t, int);
    cu_result (*end_capture)(so_cuda_stream_t, cu_graph *);
    cu_result (*graph_destroy)(cu_graph);
    cu_result (*host_alloc)(void **, size_t);
    cu_result (*host_free)(void *);
    cu_result (*ctx_sync)(void);
};

static struct cuda_driver cu;

/* Loads the driver and makes device 0's primary context current; exits 77 if impossible. */
static void cuda_driver_load(void) {
    if (so_cuda_available() != SO_STATUS_OK) {
        char msg[256];
        so_last_error_message(msg, sizeof msg);
        printf("SKIP: %s\n", msg);
        exit(77);
    }
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (!lib) {
        printf("SKIP: dlopen(libcuda.so.1): %s\n", dlerror());
        exit(77);
    }
#define SO_CU_LOAD(field, name)                          \
    do {                                                 \
        *(void **)(&cu.field) = dlsym(lib, name);        \
        if (!cu.field) {                                 \
            fprintf(stderr, "libcuda lacks %s\n", name); \
            exit(1);                                     \
        }                                                \
    } while (0)
    SO_CU_LOAD(init, "cuInit");
    SO_CU_LOAD(device_get, "cuDeviceGet");
    SO_CU_LOAD(primary_retain, "cuDevicePrimaryCtxRetain");
    SO_CU_LOAD(ctx_set_current, "cuCtxSetCurrent");
    SO_CU_LOAD(mem_alloc, "cuMemAlloc_v2");
    SO_CU_LOAD(mem_free, "cuMemFree_v2");
    SO_CU_LOAD(htod, "cuMemcpyHtoD_v2");
    SO_CU_LOAD(dtoh, "cuMemcpyDtoH_v2");
    SO_CU_LOAD(dtoh_async, "cuMemcpyDtoHAsync_v2");
    SO_CU_LOAD(stream_create, "cuStreamCreate");
    SO_CU_LOAD(stream_destroy, "cuStreamDestroy_v2");
    SO_CU_LOAD(stream_sync, "cuStreamSynchronize");
    SO_CU_LOAD(begin_capture, "cuStreamBeginCapture_v2");
    SO_CU_LOAD(end_capture, "cuStreamEndCapture");
    SO_CU_LOAD(graph_destroy, "cuGraphDestroy");
    SO_CU_LOAD(host_alloc, "cuMemAllocHost_v2");
    SO_CU_LOAD(host_free, "cuMemFreeHost");
    SO_CU_LOAD(ctx_sync, "cuCtxSynchronize");
#undef SO_CU_LOAD
    cu_device dev;
    cu_context ctx;
    if (cu.init(0) || cu.device_get(&dev, 0) || cu.primary_retain(&ctx, dev) || cu.ctx_set_current(ctx)) {
        fprintf(stderr, "cannot set up device 0\n");
        exit(1);
    }
}

#define CU_CHECK(call)                                                                   \
    do {                                                                                 \
        cu_result cu_r_ = (call);                                                        \
        if (cu_r_ != 0) {                                                                \
            fprintf(stderr, "%s:%d: %s failed: %d\n", __FILE__, __LINE__, #call, cu_r_); \
            exit(1);                                                                     \
        }                                                                                \
    } while (0)

#endif
