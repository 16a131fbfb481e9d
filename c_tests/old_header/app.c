/* What any program does at start-up: check the ABI, create a session from the default
 * options. Built twice (c_tests/CMakeLists.txt, test build_old_header_*): against the current
 * header, and against 0.4.0's, linked as a program of that release is. SO_TEST_HEADER names
 * the header.
 */
#include <stdio.h>

#include SO_TEST_HEADER

int main(void) {
    printf("built against superoffload %d.%d (ABI %d), running %s (ABI %u)\n", SO_VERSION_MAJOR, SO_VERSION_MINOR,
           SO_ABI_VERSION, so_version_string(), (unsigned)so_abi_version());
    if (so_abi_version() != SO_ABI_VERSION) {
        fprintf(stderr, "ABI mismatch\n");
        return 1;
    }
    so_session_options options = so_session_options_default();
    if (options.struct_size != sizeof options) {
        fprintf(stderr, "so_session_options: the library's has %zu bytes, ours %zu\n", options.struct_size,
                sizeof options);
        return 1;
    }
    so_session *session = NULL;
    if (so_session_create(&options, &session) != SO_STATUS_OK) {
        fprintf(stderr, "so_session_create failed\n");
        return 1;
    }
    so_session_destroy(session);
    printf("ok\n");
    return 0;
}
