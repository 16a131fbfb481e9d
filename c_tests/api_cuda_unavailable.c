/* Without a CUDA driver (the CI machines), every CUDA entry point answers
 * SO_STATUS_CUDA_UNAVAILABLE with a message, and nothing aborts. Skipped (77) where CUDA
 * is present: the gpu_ tests cover that case. */
#include "so_test.h"

int main(void) {
    if (so_cuda_available() == SO_STATUS_OK) {
        printf("SKIP: CUDA is available here\n");
        return 77;
    }
    CHECK(strstr(so_test_last_error(), "CUDA unavailable") != NULL);
    so_session *s = (so_session *)0x1;
    CHECK_STATUS(so_session_create_cuda(NULL, NULL, &s), SO_STATUS_CUDA_UNAVAILABLE);
    CHECK(s == (so_session *)0x1);
    CHECK(strstr(so_test_last_error(), "so_session_create_cuda") != NULL);
    /* A host session refuses the device calls. */
    CHECK_OK(so_session_create(NULL, &s));
    CHECK_STATUS(so_session_grad_device(s, 0, 0, 0, SO_DTYPE_F32, NULL, NULL), SO_STATUS_INVALID_STATE);
    CHECK_STATUS(so_ticket_enqueue_wait(s, 1, NULL), SO_STATUS_INVALID_STATE);
    so_cuda_stream_t st;
    CHECK_STATUS(so_session_copy_stream(s, &st), SO_STATUS_INVALID_STATE);
    size_t pinned = 1;
    CHECK_OK(so_session_pinned_bytes(s, &pinned));
    CHECK(pinned == 0);
    so_session_destroy(s);
    printf("api_cuda_unavailable: ok\n");
    return 0;
}
