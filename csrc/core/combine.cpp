// Element-wise reductions for every transport (see combine.h).
#include "core/combine.h"

#include <type_traits>

#include "core/reduce.h"

namespace torchstrategies {
namespace core {
namespace {

template <typename T, typename Acc>
void combine_loop(int op, T* out, const T* const* xs, int n, int64_t len) {
  for (int64_t i = 0; i < len; ++i) {
    Acc v = Conv<Acc, T>::load(xs[0][i]);
    for (int j = 1; j < n; ++j) {
      const Acc x = Conv<Acc, T>::load(xs[j][i]);
      if (op == kProduct) {
        v = v * x;
        if constexpr (std::is_integral_v<T>) v = static_cast<Acc>(static_cast<T>(v));  // wrap as T does
        continue;
      }
      if constexpr (!std::is_integral_v<T>) {  // NaN propagates, like torch.minimum / maximum
        if (v != v) continue;
        if (x != x) {
          v = x;
          continue;
        }
      }
      if (op == kMin ? (x < v) : (x > v)) v = x;
    }
    out[i] = Conv<Acc, T>::store(v);
  }
}

template <typename T, typename Acc>
void combine_typed(int op, void* out, const void* const* xs, int n, int64_t len) {
  combine_loop<T, Acc>(op, static_cast<T*>(out), reinterpret_cast<const T* const*>(xs), n, len);
}

}  // namespace

size_t dtype_size(DType d) {
  switch (d) {
    case DType::kFloat32: return 4;
    case DType::kFloat64: return 8;
    case DType::kFloat16: return 2;
    case DType::kBFloat16: return 2;
    case DType::kInt32: return 4;
    case DType::kInt64: return 8;
  }
  return 1;
}

const char* dtype_name(DType d) {
  switch (d) {
    case DType::kFloat32: return "float32";
    case DType::kFloat64: return "float64";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
  }
  return "?";
}

const char* op_name(int op) {
  static const char* names[kNumOps] = {"SUM", "AVG", "MIN", "MAX", "PRODUCT"};
  return op >= 0 && op < kNumOps ? names[op] : "?";
}

void combine(int op, DType dtype, void* out, const void* const* xs, int n, int64_t len, bool has_scale,
             double scale) {
  if (len <= 0) return;
  if (op == kSum || op == kMean) {
    reduce_range(Order::kSequential, dtype, out, xs, n, len, has_scale, scale);
    return;
  }
  switch (dtype) {
    case DType::kFloat32: return combine_typed<float, float>(op, out, xs, n, len);
    case DType::kFloat64: return combine_typed<double, double>(op, out, xs, n, len);
    case DType::kFloat16: return combine_typed<_Float16, float>(op, out, xs, n, len);
    case DType::kBFloat16: return combine_typed<Bf16, float>(op, out, xs, n, len);
    case DType::kInt32: return combine_typed<int32_t, int64_t>(op, out, xs, n, len);
    case DType::kInt64: return combine_typed<int64_t, int64_t>(op, out, xs, n, len);
  }
}

}  // namespace core
}  // namespace torchstrategies

