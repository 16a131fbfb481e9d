#include "kernels.hpp"

#include <algorithm>

namespace demo {

namespace {

constexpr int kRows = 4;  // output rows per register block
constexpr int kCols = 32; // output columns per register block

// Dot product with 16 running partial sums, combined in a fixed order.
inline float dot(const float* a, const float* b, int n) {
    float s[16] = {};
    int i = 0;
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; ++j) s[j] += a[i + j] * b[i + j];
    for (int j = 0; j < 8; ++j) s[j] += s[j + 8];
    for (int j = 0; j < 4; ++j) s[j] += s[j + 4];
    float t = (s[0] + s[1]) + (s[2] + s[3]);
    for (; i < n; ++i) t += a[i] * b[i];
    return t;
}

} // namespace

void gemm(Workers& w, int R, int K, int C, const float* X, size_t xr, size_t xk, const float* M, const float* init,
          float* Y) {
    size_t blocks = (C + kCols - 1) / kCols;
    w.parallel_for(blocks, [&](size_t b0, size_t b1) {
        for (size_t blk = b0; blk < b1; ++blk) {
            const int c0 = (int)blk * kCols;
            const int cn = std::min(kCols, C - c0);
            for (int r0 = 0; r0 < R; r0 += kRows) {
                const int rn = std::min(kRows, R - r0);
                float acc[kRows][kCols];
                for (int r = 0; r < kRows; ++r)
                    for (int c = 0; c < kCols; ++c) acc[r][c] = (init && c < cn) ? init[c0 + c] : 0.0f;
                if (rn == kRows && cn == kCols) {
                    for (int k = 0; k < K; ++k) {
                        const float* m = M + (size_t)k * C + c0;
                        const float x0 = X[(r0 + 0) * xr + k * xk], x1 = X[(r0 + 1) * xr + k * xk];
                        const float x2 = X[(r0 + 2) * xr + k * xk], x3 = X[(r0 + 3) * xr + k * xk];
                        for (int c = 0; c < kCols; ++c) {
                            acc[0][c] += x0 * m[c];
                            acc[1][c] += x1 * m[c];
                            acc[2][c] += x2 * m[c];
                            acc[3][c] += x3 * m[c];
                        }
                    }
                } else {
                    for (int k = 0; k < K; ++k) {
                        const float* m = M + (size_t)k * C + c0;
                        for (int r = 0; r < rn; ++r) {
                            const float x = X[(r0 + r) * xr + k * xk];
                            for (int c = 0; c < cn; ++c) acc[r][c] += x * m[c];
                        }
                    }
                }
                for (int r = 0; r < rn; ++r)
                    for (int c = 0; c < cn; ++c) Y[(size_t)(r0 + r) * C + c0 + c] = acc[r][c];
            }
        }
    });
}

void backward_input(Workers& w, int B, int I, int O, const float* dZ, const float* W, float* dX) {
    size_t blocks = (I + 3) / 4;
    w.parallel_for(blocks, [&](size_t b0, size_t b1) {
        for (size_t blk = b0; blk < b1; ++blk) {
            const int i0 = (int)blk * 4, in = std::min(4, I - i0);
            for (int b = 0; b < B; ++b)
                for (int i = i0; i < i0 + in; ++i)
                    dX[(size_t)b * I + i] = dot(dZ + (size_t)b * O, W + (size_t)i * O, O);
        }
    });
}

} // namespace demo
