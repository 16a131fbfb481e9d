/* The checks of the checkers: one deliberate memory error, chosen by the argument, that
 * valgrind memcheck or the sanitizers must report. c_tests/CMakeLists.txt registers one test
 * per error, which passes only when the checker's report appears in the output; so a
 * broken valgrind wrapper or missing -fsanitize flags make the suite fail instead of
 * passing silently. Not a test of superoffload (it only calls so_abi_version, so that it
 * links the library the way the tests do).
 *
 *   heap    writes one byte past an 8-byte heap block
 *   leak    loses the only pointer to a heap block
 *   uninit  branches on an uninitialised heap value (valgrind)
 *   ub      signed integer overflow (UndefinedBehaviorSanitizer)
 */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "superoffload.h"

/* Volatile, so that the compiler can neither drop the allocations nor see the errors. */
static void *volatile sink;
static volatile int one = 1;

int main(int argc, char **argv) {
    const char *what = argc > 1 ? argv[1] : "";
    printf("checker_probe %s (library ABI %u)\n", what, so_abi_version());
    if (strcmp(what, "heap") == 0) {
        char *p = (char *)malloc((size_t)(8 * one)); /* a size the compiler cannot see */
        sink = p;
        p[7 + one] = 1;
        printf("%d\n", p[7 + one]);
        free(p);
    } else if (strcmp(what, "leak") == 0) {
        sink = malloc(100);
        sink = NULL;
    } else if (strcmp(what, "uninit") == 0) {
        int *p = (int *)malloc(4 * sizeof(int));
        sink = p;
        if (p[one] > 0) printf("positive\n");
        free(p);
    } else if (strcmp(what, "ub") == 0) {
        volatile int x = INT_MAX;
        int y = x + one;
        printf("%d\n", y);
    } else {
        fprintf(stderr, "usage: checker_probe heap|leak|uninit|ub\n");
        return 2;
    }
    return 0;
}
