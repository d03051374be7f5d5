// Torch-free element-wise reduction of N arrays of one dtype: the one combine every transport (the
// shared-memory protocol, the TCP ring) calls. SUM and MEAN go to the vectorized core/reduce kernels;
// MIN, MAX and PRODUCT are plain loops here.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/reduce_kernels.h"

namespace torchstrategies {
namespace core {

// Reduce-op codes, shared by every transport, the call descriptors and the Python tables.
enum Op : int { kSum = 0, kMean = 1, kMin = 2, kMax = 3, kProduct = 4 };
constexpr int kNumOps = 5;

size_t dtype_size(DType dtype);
const char* dtype_name(DType dtype);
const char* op_name(int op);

// out = op(xs[0], ..., xs[n-1]) element-wise in that order, times `scale` if has_scale (SUM/MEAN only);
// `out` may alias any input exactly. float16 / bfloat16 accumulate in float32, integers in int64 (and
// wrap on store); NaN propagates through MIN / MAX like torch.minimum / torch.maximum.
void combine(int op, DType dtype, void* out, const void* const* xs, int n, int64_t len, bool has_scale,
             double scale);

}  // namespace core
}  // namespace torchstrategies
