/* The small query functions of the C API (its documented errors: api_errors.c).
 *
 * Covered: so_last_error_message's snprintf semantics and thread-locality; so_status_str
 * for every status and unknown values; so_isa_name; versions; so_pool_get_info on the
 * default pool, a created pool and a pinned one (whose threads really are pinned, and
 * joined on destroy).
 */
#include <dirent.h>
#include <pthread.h>
#include <sched.h>
#include <sys/types.h>

#include "so_test.h"

#define N 64

/* Buffers that an update accepts (zeros: their values do not matter here). */
static float param[N], grad[N], exp_avg[N], exp_avg_sq[N];

static so_adam_buffers valid_buffers(void) { return so_test_adam_buffers(N, param, grad, exp_avg, exp_avg_sq); }

/* ---------------------------------------------------------------------- error messages */

static void *message_thread(void *arg) {
    size_t *out = (size_t *)arg;
    out[0] = so_last_error_message(NULL, 0); /* nothing failed on this thread yet */
    so_adam_hparams hp = so_adam_hparams_default();
    hp.lr = -1.0;
    so_adam_buffers b = so_adam_buffers_default();
    so_status st = so_adam_update(NULL, &hp, &b, NULL, NULL);
    out[1] = (size_t)st;
    out[2] = so_last_error_message(NULL, 0);
    out[3] = strstr(so_test_last_error(), "lr") != NULL;
    return NULL;
}

static void test_last_error_message(void) {
    CHECK_STATUS(so_pool_get_info(NULL, NULL), SO_STATUS_NULL_ARGUMENT);
    char full[512];
    size_t len = so_last_error_message(NULL, 0);
    CHECK(len > 0 && len < sizeof full);
    CHECK(so_last_error_message(full, sizeof full) == len);
    CHECK(strlen(full) == len);
    CHECK(strncmp(full, "so_pool_get_info", 16) == 0);

    /* Truncation: at most len - 1 bytes and a NUL; the return value is the full length. */
    char small[8];
    memset(small, 'x', sizeof small);
    CHECK(so_last_error_message(small, 5) == len);
    CHECK(memcmp(small, full, 4) == 0 && small[4] == '\0' && small[5] == 'x');
    memset(small, 'x', sizeof small);
    CHECK(so_last_error_message(small, 1) == len && small[0] == '\0' && small[1] == 'x');
    memset(small, 'x', sizeof small);
    CHECK(so_last_error_message(small, 0) == len && small[0] == 'x'); /* len 0: nothing written */
    char exact[512];
    memset(exact, 'x', sizeof exact);
    CHECK(so_last_error_message(exact, len) == len); /* one byte short: truncated */
    CHECK(strlen(exact) == len - 1 && memcmp(exact, full, len - 1) == 0);
    memset(exact, 'x', sizeof exact);
    CHECK(so_last_error_message(exact, len + 1) == len && strcmp(exact, full) == 0);

    /* A successful call leaves the message as it was. */
    so_adam_hparams hp = so_adam_hparams_default();
    so_adam_buffers b = valid_buffers();
    CHECK_OK(so_adam_update(NULL, &hp, &b, NULL, NULL));
    CHECK(so_last_error_message(exact, sizeof exact) == len && strcmp(exact, full) == 0);
    CHECK(so_abi_version() == SO_ABI_VERSION);
    CHECK(so_last_error_message(NULL, 0) == len);

    /* Thread-local: another thread starts with none, and its errors do not show here. */
    pthread_t t;
    size_t results[4] = {99, 99, 99, 99};
    CHECK(pthread_create(&t, NULL, message_thread, results) == 0);
    CHECK(pthread_join(t, NULL) == 0);
    CHECK(results[0] == 0);
    CHECK(results[1] == (size_t)SO_STATUS_INVALID_ARGUMENT);
    CHECK(results[2] > 0 && results[3] == 1);
    CHECK(so_last_error_message(exact, sizeof exact) == len && strcmp(exact, full) == 0);
}

/* ------------------------------------------------------------- status strings, versions */

static void test_strings_and_versions(void) {
    /* clang-format off: a hand-aligned table */
    const uint32_t known[] = {SO_STATUS_OK,
                              SO_STATUS_NULL_ARGUMENT,
                              SO_STATUS_INVALID_ARGUMENT,
                              SO_STATUS_STRUCT_SIZE,
                              SO_STATUS_UNSUPPORTED,
                              SO_STATUS_ALIASING,
                              SO_STATUS_INVALID_STATE,
                              SO_STATUS_NOT_FOUND,
                              SO_STATUS_NON_FINITE,
                              SO_STATUS_OUT_OF_RESOURCES,
                              SO_STATUS_TIMEOUT,
                              SO_STATUS_PENDING,
                              SO_STATUS_IO,
                              SO_STATUS_BAD_CHECKPOINT,
                              SO_STATUS_PANIC};
    /* clang-format on */
    const size_t count = sizeof known / sizeof known[0];
    for (size_t i = 0; i < count; i++) {
        const char *s = so_status_str(known[i]);
        CHECKF(s != NULL && s[0] != '\0' && strcmp(s, "unknown status") != 0, "status %u", (unsigned)known[i]);
        for (size_t j = 0; j < i; j++) CHECKF(strcmp(s, so_status_str(known[j])) != 0, "status %u", (unsigned)known[i]);
        CHECK(so_status_str(known[i]) == s); /* static */
    }
    const uint32_t unknown[] = {8, 19, 21, 31, 42, 52, 98, 100, 1000, 0x80000000u, 0xFFFFFFFFu};
    for (size_t i = 0; i < sizeof unknown / sizeof unknown[0]; i++) {
        CHECKF(strcmp(so_status_str(unknown[i]), "unknown status") == 0, "%u", (unsigned)unknown[i]);
    }

    CHECK(strcmp(so_isa_name(SO_ISA_AUTO), "auto") == 0);
    CHECK(strcmp(so_isa_name(SO_ISA_PORTABLE), "portable") == 0);
    CHECK(strcmp(so_isa_name(SO_ISA_AVX2), "avx2") == 0);
    CHECK(strcmp(so_isa_name(SO_ISA_AVX512), "avx512") == 0);
    CHECK(strcmp(so_isa_name(4), "unknown") == 0 && strcmp(so_isa_name(0xFFFFFFFFu), "unknown") == 0);

    CHECK(so_abi_version() == SO_ABI_VERSION);
    char v[64];
    snprintf(v, sizeof v, "%d.%d.%d", SO_VERSION_MAJOR, SO_VERSION_MINOR, SO_VERSION_PATCH);
    CHECKF(strcmp(so_version_string(), v) == 0, "so_version_string() = %s, header %s", so_version_string(), v);
    CHECK(SO_VERSION_NUMBER == ((SO_VERSION_MAJOR << 16) | (SO_VERSION_MINOR << 8) | SO_VERSION_PATCH));
}

/* ------------------------------------------------------------------------------ pools */

static int allowed_cores(cpu_set_t *set) {
    CPU_ZERO(set);
    CHECK(sched_getaffinity(0, sizeof *set, set) == 0);
    return CPU_COUNT(set);
}

/* The thread ids of this process (at most `cap`). */
static size_t list_threads(pid_t *tids, size_t cap) {
    DIR *d = opendir("/proc/self/task");
    CHECK(d != NULL);
    size_t n = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (e->d_name[0] == '.') continue;
        if (n < cap) tids[n] = (pid_t)atoi(e->d_name);
        n++;
    }
    closedir(d);
    return n;
}

static bool contains(const pid_t *tids, size_t n, pid_t t) {
    for (size_t i = 0; i < n; i++)
        if (tids[i] == t) return true;
    return false;
}

static void test_pools(void) {
    cpu_set_t allowed;
    int ncpu = allowed_cores(&allowed);
    uint32_t first = 0;
    while (!CPU_ISSET(first, &allowed)) first++;

    /* The default pool. */
    so_pool_info info;
    memset(&info, 0, sizeof info);
    info.struct_size = sizeof info;
    CHECK_OK(so_pool_get_info(NULL, &info));
    CHECK(info.struct_size == sizeof info);
    CHECK(info.isa == SO_ISA_PORTABLE || info.isa == SO_ISA_AVX2 || info.isa == SO_ISA_AVX512);
    CHECKF(info.num_threads == (size_t)ncpu, "default pool: %zu threads, %d CPUs allowed", info.num_threads, ncpu);
    CHECK(!info.pinned);
    const uint32_t widest = info.isa;

    /* Created pools: 3 threads, AUTO picks the widest, threads start before create returns
     * and are joined by destroy. */
    pid_t before[4096], during[4096], after[4096];
    size_t n_before = list_threads(before, 4096);
    so_pool_options o = so_pool_options_default();
    o.num_threads = 3;
    so_pool *pool = NULL;
    CHECK_OK(so_pool_create(&o, &pool));
    CHECK(pool != NULL);
    memset(&info, 0, sizeof info);
    info.struct_size = sizeof info;
    CHECK_OK(so_pool_get_info(pool, &info));
    CHECK(info.num_threads == 3 && info.isa == widest && !info.pinned);
    size_t n_during = list_threads(during, 4096);
    CHECKF(n_during == n_before + 3, "%zu threads before, %zu with a 3-thread pool", n_before, n_during);
    so_pool_destroy(pool);
    /* Joined: not one of the pool's threads is left when destroy returns. */
    size_t n_after = list_threads(after, 4096);
    CHECKF(n_after == n_before, "%zu threads before, %zu right after so_pool_destroy", n_before, n_after);

    o = so_pool_options_default();
    o.isa = SO_ISA_PORTABLE;
    CHECK_OK(so_pool_create(&o, &pool));
    CHECK_OK(so_pool_get_info(pool, &info));
    CHECK(info.isa == SO_ISA_PORTABLE && info.num_threads == (size_t)ncpu && !info.pinned);
    so_pool_destroy(pool);

    /* Pinned to the first allowed core: one thread, pinned, and its affinity is that core. */
    n_before = list_threads(before, 4096);
    o = so_pool_options_default();
    o.cores = &first;
    o.num_cores = 1;
    CHECK_OK(so_pool_create(&o, &pool));
    CHECK_OK(so_pool_get_info(pool, &info));
    CHECK(info.pinned && info.num_threads == 1);
    n_during = list_threads(during, 4096);
    CHECK(n_during == n_before + 1);
    size_t pinned_threads = 0;
    for (size_t i = 0; i < n_during; i++) {
        if (contains(before, n_before, during[i])) continue;
        cpu_set_t set;
        CPU_ZERO(&set);
        CHECK(sched_getaffinity(during[i], sizeof set, &set) == 0);
        CHECKF(CPU_COUNT(&set) == 1 && CPU_ISSET(first, &set), "the new thread %d is not pinned to core %u",
               (int)during[i], (unsigned)first);
        pinned_threads++;
    }
    CHECK(pinned_threads == 1);
    so_adam_hparams hp = so_adam_hparams_default();
    so_adam_buffers b = valid_buffers();
    CHECK_OK(so_adam_update(pool, &hp, &b, NULL, NULL));
    /* num_threads 0 or equal to the core count is accepted. */
    o.num_threads = 1;
    so_pool *pool2 = NULL;
    CHECK_OK(so_pool_create(&o, &pool2));
    so_pool_destroy(pool2);
    so_pool_destroy(pool);
}

int main(void) {
    test_last_error_message();
    test_strings_and_versions();
    test_pools();
    printf("ok\n");
    return 0;
}
