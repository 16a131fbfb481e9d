// The harness of the C++ tests (api_cpp_*): non-fatal expectations that count failures and
// let the test go on, expectations that a wrapper call throws superoffload::Error with a
// given status, a reproducible RNG, bit-for-bit comparison of vectors, temporary file paths,
// and the exit status.
//
//   EXPECT(cond);                                   // counts a failure, prints file:line
//   std::string msg = EXPECT_ERROR(SO_STATUS_NOT_FOUND, session.slice_id("nope"));
//   ...
//   int main() { test_a(); test_b(); return so_test::finish("api_cpp_example"); }
//
// C++17 only (the C tests and the C-style checks that exit at once are in so_test.h).
#ifndef SO_TEST_HPP
#define SO_TEST_HPP

#include "superoffload.hpp"

#include "session_test.h"

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

namespace so_test {

// Failed expectations so far.
inline int failures = 0;

// Records a failed expectation at file:line.
inline void fail(const char* file, int line, const char* what) {
    std::fprintf(stderr, "%s:%d: expectation failed: %s\n", file, line, what);
    ++failures;
}

// Runs `body`, which must throw superoffload::Error with `status` whose status description
// is so_status_str(status); returns the error's message (empty when it did not throw).
template <class F>
std::string expect_error(so_status status, F&& body, const char* what, const char* file, int line) {
    try {
        body();
    } catch (const superoffload::Error& e) {
        if (e.status() != status) {
            std::fprintf(stderr, "%s:%d: %s: status %u, expected %u (%s)\n", file, line, what,
                         static_cast<unsigned>(e.status()), static_cast<unsigned>(status), e.what());
            ++failures;
        }
        if (std::string(e.status_description()) != so_status_str(status)) {
            std::fprintf(stderr, "%s:%d: %s: status description mismatch\n", file, line, what);
            ++failures;
        }
        return e.what();
    } catch (...) {
        std::fprintf(stderr, "%s:%d: %s: threw something other than superoffload::Error\n", file, line, what);
        ++failures;
        return {};
    }
    std::fprintf(stderr, "%s:%d: %s: did not throw\n", file, line, what);
    ++failures;
    return {};
}

inline bool contains(const std::string& haystack, const char* needle) {
    return haystack.find(needle) != std::string::npos;
}

// Deterministic pseudo-random numbers (splitmix64; no <random> distributions: their output
// differs between standard libraries).
struct Rng {
    std::uint64_t state;
    std::uint64_t next() {
        state += 0x9E3779B97F4A7C15ull;
        std::uint64_t z = state;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        return z ^ (z >> 31);
    }
    // Uniform in [-1, 1), a multiple of 2^-52.
    double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-52 - 1.0; }
};

// Same length and the same bits (NaN payloads and signed zeros included).
template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

// A path in $TMPDIR (or /tmp) unique to this process and `tag` (so_st_temp_path).
inline std::string temp_path(const char* tag) {
    char buf[512];
    so_st_temp_path(buf, sizeof buf, tag);
    return buf;
}

// The test's exit status: 1 with a count of the failures, else 0 with "<name>: ok".
inline int finish(const char* name) {
    if (failures != 0) {
        std::fprintf(stderr, "%s: %d failure(s)\n", name, failures);
        return 1;
    }
    std::printf("%s: ok\n", name);
    return 0;
}

} // namespace so_test

// A non-fatal check: on failure prints file:line and the condition, and the test goes on.
#define EXPECT(cond)                                  \
    do {                                              \
        if (!(cond)) {                                \
            so_test::fail(__FILE__, __LINE__, #cond); \
        }                                             \
    } while (0)

// `stmt` must throw superoffload::Error with `status`; evaluates to the error's message.
#define EXPECT_ERROR(status, stmt) so_test::expect_error((status), [&] { stmt; }, #stmt, __FILE__, __LINE__)

#endif // SO_TEST_HPP
