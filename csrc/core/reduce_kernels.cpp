// The CPU reduction kernels, instantiated per dtype and compiled per ISA (see reduce_kernels.h).
//
// Portability: the translation unit is built without -march (unless TORCHSTRATEGIES_NATIVE=1), so the
// default clone is plain x86-64 (SSE2); the x86-64-v3 (AVX2/FMA/F16C) and x86-64-v4 (AVX-512) clones
// are only chosen by the ifunc resolver on CPUs that have them.
#include "core/reduce_kernels.h"

#include <vector>

#include "core/reduce.h"

#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(__clang__) && \
    !defined(TORCHSTRATEGIES_NO_CLONES)
#define TS_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define TS_CLONES
#endif

namespace torchstrategies {
namespace core {
namespace {

template <typename T, typename Acc>
TS_INLINE void run(Order order, void* out, const void* const* xs, int n, int64_t len, bool has_scale,
                   double scale) {
  T* o = static_cast<T*>(out);
  const T* const* x = reinterpret_cast<const T* const*>(xs);
  if (order == Order::kSequential || n <= kLeaf) {
    if (order == Order::kSequential) {
      accumulate_n_range<T, Acc>(o, x, n, len, has_scale, scale);
    } else {
      tree_reduce_range<T, Acc>(o, x, n, len, has_scale, scale, nullptr, 0, nullptr);
    }
    return;
  }
  int levels = 0;
  const std::vector<TreeStep> plan = tree_plan(n, &levels);
  std::vector<Acc> scratch(static_cast<size_t>(levels) * kBlock);
  tree_reduce_range<T, Acc>(o, x, n, len, has_scale, scale, plan.data(), static_cast<int>(plan.size()),
                            scratch.data());
}

// One clone-carrying function per dtype (an instantiation of run_clones) keeps each resolver small.
template <typename T, typename Acc>
TS_CLONES void run_clones(Order o, void* out, const void* const* xs, int n, int64_t len, bool hs, double s) {
  run<T, Acc>(o, out, xs, n, len, hs, s);
}

}  // namespace

void reduce_range(Order order, DType dtype, void* out, const void* const* xs, int n, int64_t len,
                  bool has_scale, double scale) {
  switch (dtype) {
    case DType::kFloat32: return run_clones<float, float>(order, out, xs, n, len, has_scale, scale);
    case DType::kFloat64: return run_clones<double, double>(order, out, xs, n, len, has_scale, scale);
    case DType::kFloat16: return run_clones<_Float16, float>(order, out, xs, n, len, has_scale, scale);
    case DType::kBFloat16: return run_clones<Bf16, float>(order, out, xs, n, len, has_scale, scale);
    case DType::kInt32: return run_clones<int32_t, int64_t>(order, out, xs, n, len, has_scale, scale);
    case DType::kInt64: return run_clones<int64_t, int64_t>(order, out, xs, n, len, has_scale, scale);
  }
}

}  // namespace core
}  // namespace torchstrategies
