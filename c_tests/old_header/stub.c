/* Stands in for the 0.4 library when the old program is linked: the program records the
 * stub's SONAME as NEEDED, as it would 0.4's, and gets the symbols it calls. It never runs
 * with the stub (it has no RPATH), so these bodies are never reached.
 */
#include <stdlib.h>

#include "superoffload-0.4.h"

uint32_t so_abi_version(void) { abort(); }

const char *so_version_string(void) { abort(); }

struct so_session_options so_session_options_default(void) {
    abort();
}

so_status so_session_create(const struct so_session_options *options, struct so_session **out_session) {
    (void)options;
    (void)out_session;
    abort();
}

void so_session_destroy(struct so_session *session) {
    (void)session;
    abort();
}
