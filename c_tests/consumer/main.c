/* The consumer program: checks the ABI of the library it loaded, runs one Adam step, and
 * prints the version. Exits 0 on success. */
#include <math.h>
#include <stdio.h>

#include <superoffload.h>

int main(void) {
    if (so_abi_version() != SO_ABI_VERSION) {
        fprintf(stderr, "ABI mismatch: library %u, header %u\n", so_abi_version(), (unsigned)SO_ABI_VERSION);
        return 1;
    }
    float param[5] = {1, 2, 3, 4, 5}, grad[5] = {0.5f, -0.5f, 0.25f, 0, 1};
    float exp_avg[5] = {0}, exp_avg_sq[5] = {0};
    so_adam_hparams hp = so_adam_hparams_default();
    so_adam_buffers b = so_adam_buffers_default();
    b.numel = 5;
    b.param = param;
    b.grad = grad;
    b.exp_avg = exp_avg;
    b.exp_avg_sq = exp_avg_sq;
    so_status st = so_adam_update(NULL, &hp, &b, NULL, NULL);
    if (st != SO_STATUS_OK) {
        char msg[256];
        so_last_error_message(msg, sizeof msg);
        fprintf(stderr, "so_adam_update: %s: %s\n", so_status_str(st), msg);
        return 1;
    }
    /* The first AdamW step moves each parameter with a gradient by about lr = 1e-3. */
    if (!(fabsf(param[0] - (1.0f - 1e-5f - 1e-3f)) < 1e-5f) || !(param[3] < 4.0f && param[3] > 3.9999f)) {
        fprintf(stderr, "unexpected result: %.9g %.9g\n", (double)param[0], (double)param[3]);
        return 1;
    }
    printf("superoffload %s (ABI %u): ok\n", so_version_string(), so_abi_version());
    return 0;
}
