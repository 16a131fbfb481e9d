/* Links the static library (SuperOffload::superoffload_static, with the system libraries
 * the Rust runtime needs) instead of the shared one: the program runs one update with the
 * right result, and libsuperoffload.so is not loaded. Arguments (as every build_ test):
 * the shared library's path and the header's path, unused here.
 */
#include "so_test.h"

int main(int argc, char **argv) {
    (void)argc;
    (void)argv;
    CHECK(so_abi_version() == SO_ABI_VERSION);
    /* One AdamW step from zero moments: m = 0.05, v = 2.5e-4, bc1 = 0.1, bc2 = 1e-3, so
     * denom = 0.5 + 1e-8 and p = 1 * (1 - 1e-5) - (1e-3 / 0.1) * 0.05 / denom. */
    float p[3] = {1.0f, 1.0f, 1.0f}, g[3] = {0.5f, 0.5f, 0.5f}, m[3] = {0, 0, 0}, v[3] = {0, 0, 0};
    so_adam_hparams hp = so_adam_hparams_default();
    so_adam_buffers b = so_test_adam_buffers(3, p, g, m, v);
    CHECK_OK(so_adam_update(NULL, &hp, &b, NULL, NULL));
    double want = (1.0 - 1e-5) - 1e-2 * 0.05 / (0.5 + 1e-8);
    for (int i = 0; i < 3; i++) {
        CHECKF(fabs(p[i] - want) < 1e-6, "p = %.9g, expected %.9g", (double)p[i], want);
        CHECKF(fabs(m[i] - 0.05) < 1e-8 && fabs(v[i] - 2.5e-4) < 1e-10, "m %.9g v %.9g", (double)m[i], (double)v[i]);
    }
    FILE *maps = fopen("/proc/self/maps", "r");
    CHECK(maps != NULL);
    char line[4096];
    while (fgets(line, sizeof line, maps)) CHECKF(strstr(line, "libsuperoffload.so") == NULL, "loaded: %s", line);
    fclose(maps);
    printf("ok\n");
    return 0;
}
