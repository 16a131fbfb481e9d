// The installed C++ header compiles on its own (and with the C header) in a consumer.
#include <superoffload.hpp>
#include <superoffload.h>

#include <cstdio>

int main() {
    if (so_abi_version() != SO_ABI_VERSION) return 1;
    std::printf("superoffload %s from C++: ok\n", so_version_string());
    return 0;
}
