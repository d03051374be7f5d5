// CPU kernels for accumulate_n / tree_reduce / accumulate_: thin ATen glue around the torch-free loops
// in csrc/core (reduce_kernels.h). Here we validate, make inputs contiguous, split the elements into
// contiguous ranges over torch's intra-op pool (at::parallel_for), and hand each range's raw pointers to
// the serial core::reduce_range.
//
// Threads: a tensor of at most kGrain elements is summed on the calling thread; a larger one is cut into
// min(at::get_num_threads(), ceil(numel / kGrain)) contiguous ranges of equal length (the last shorter),
// one per pool thread, so torch.set_num_threads decides. Called from inside a parallel region (another
// at::parallel_for, an OpenMP thread) it runs on the calling thread. Every element is summed by the same
// serial code in the same order whatever range holds it, so the result is bit-identical for every
// thread count. (The backend's transports reduce through core::combine, which calls core::reduce_range
// on the rank's one thread: one rank per core under MWMS; see docs/kernels.md, Threads.)
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <pybind11/stl.h>
#include <torch/library.h>

#include <algorithm>
#include <mutex>
#include <tuple>
#include <vector>

#include "checks.h"
#include "core/reduce_kernels.h"
#include "python_bindings.h"
#include "reduce_ops.h"

namespace torchstrategies {
namespace {

// Elements per parallel range at least: torch's own grain for elementwise ops (at::internal::GRAIN_SIZE
// in ATen/TensorIterator.h), below which waking the pool costs more than a second thread saves.
constexpr int64_t kGrain = 32768;

// Runs fn(begin, end) over contiguous ranges that cover [0, numel), on torch's intra-op pool: the one
// place the CPU kernels split their work (reduce_ranges below reports what it does).
template <typename F>
void for_each_range(int64_t numel, const F& fn) {
  at::parallel_for(0, numel, kGrain, fn);
}

core::DType core_dtype(at::ScalarType t) {
  const auto d = kernel_dtype(t);
  TORCH_INTERNAL_ASSERT(d.has_value(), "unsupported dtype reached the kernel: ", t);
  return *d;
}

// The CPU backend's Reduce (reduce_ops.h): sums `tensors` (already validated) into `out` in `order`.
// `out` may alias an input exactly: the kernel reads an element from every input before writing it.
void reduce_into(const char* /*op*/, core::Order order, at::TensorList tensors, std::optional<double> scale,
                 const at::Tensor& out) {
  const int64_t numel = out.numel();
  if (numel == 0) return;
  const ContiguousOperands operands(tensors, out);

  const int n = static_cast<int>(operands.ins.size());
  const int64_t elem = out.element_size();
  std::vector<const char*> ptrs(n);
  for (int i = 0; i < n; ++i) ptrs[i] = static_cast<const char*>(operands.ins[i].const_data_ptr());
  char* o = static_cast<char*>(operands.dst.mutable_data_ptr());
  const core::DType dt = core_dtype(out.scalar_type());
  for_each_range(numel, [&](int64_t begin, int64_t end) {
    std::vector<const void*> p(n);
    for (int i = 0; i < n; ++i) p[i] = ptrs[i] + begin * elem;
    core::reduce_range(order, dt, o + begin * elem, p.data(), n, end - begin, scale.has_value(),
                       scale.value_or(1.0));
  });
  operands.finish(out);
}

// _C.reduce_ranges(numel): the (begin, end, pool thread) ranges for_each_range cuts `numel` elements
// into at the current torch thread count, sorted; it runs the split itself (no data is touched), so a
// test can see the work spread over threads without timing anything.
std::vector<std::tuple<int64_t, int64_t, int>> reduce_ranges(int64_t numel) {
  TORCH_CHECK(numel >= 0, "reduce_ranges: numel must be >= 0, got ", numel);
  std::mutex mu;
  std::vector<std::tuple<int64_t, int64_t, int>> ranges;
  for_each_range(numel, [&](int64_t begin, int64_t end) {
    const int thread = at::get_thread_num();
    std::lock_guard<std::mutex> lock(mu);
    ranges.emplace_back(begin, end, thread);
  });
  std::sort(ranges.begin(), ranges.end());
  return ranges;
}

}  // namespace

void init_reduce_bindings(pybind11::module_& m) {
  m.def("reduce_ranges", &reduce_ranges, pybind11::arg("numel"),
        "The (begin, end, thread) element ranges the CPU reduce kernels split numel elements into at "
        "the current torch thread count.");
  m.attr("REDUCE_GRAIN") = kGrain;
}

TORCH_LIBRARY_IMPL(torchstrategies, CPU, m) { register_reduce_ops<&reduce_into>(m); }

}  // namespace torchstrategies
