// Dense kernels. Matrices are row-major; a layer's weight is stored [in][out].

#ifndef SUPEROFFLOAD_DEMO_KERNELS_HPP
#define SUPEROFFLOAD_DEMO_KERNELS_HPP

#include "threads.hpp"

#include <cstddef>

namespace demo {

// Y[r, c] = init[c] (or 0) + sum_{k ascending} X(r, k) * M[k, c], for r < R, c < C, where
// X(r, k) = X[r * xr + k * xk] and M is K x C. Tasks are column blocks; each computes every
// row of its columns.
void gemm(Workers& w, int R, int K, int C, const float* X, size_t xr, size_t xk, const float* M, const float* init,
          float* Y);

// dX[b, i] = sum_o dZ[b, o] * W[i, o] (dZ is B x O, W is I x O, dX is B x I). Tasks are
// blocks of 4 rows of W.
void backward_input(Workers& w, int B, int I, int O, const float* dZ, const float* W, float* dX);

} // namespace demo

#endif // SUPEROFFLOAD_DEMO_KERNELS_HPP
