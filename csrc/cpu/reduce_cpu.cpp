// CPU kernels for accumulate_n / tree_reduce / accumulate_: thin ATen glue around the torch-free loops
// in csrc/core (reduce_kernels.h). Here we validate, make inputs contiguous, split the elements into
// ranges for at::parallel_for, and hand raw pointers to core::reduce_range.
#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "checks.h"
#include "core/reduce_kernels.h"

namespace torchstrategies {
namespace {

// Elements per parallel task: large enough that a task's start-up cost is amortized.
constexpr int64_t kGrain = 32 * 1024;

core::DType core_dtype(at::ScalarType t) {
  const auto d = kernel_dtype(t);
  TORCH_INTERNAL_ASSERT(d.has_value(), "unsupported dtype reached the kernel: ", t);
  return *d;
}

// Sums `tensors` (already validated) into `out` in `order`. Inputs that are not contiguous are copied;
// a non-contiguous `out` receives the result through a contiguous temporary. `out` may alias an
// input exactly (the kernel reads an element from every input before writing it); partial overlap
// is rejected.
void reduce_into(core::Order order, at::TensorList tensors, std::optional<double> scale,
                 const at::Tensor& out) {
  const int64_t numel = out.numel();
  if (numel == 0) return;
  for (const auto& t : tensors) at::assert_no_partial_overlap(out, t);
  std::vector<at::Tensor> ins;
  ins.reserve(tensors.size());
  for (const auto& t : tensors) ins.push_back(t.contiguous());
  const bool out_contig = out.is_contiguous();
  at::Tensor dst = out_contig ? out : at::empty_like(out, at::MemoryFormat::Contiguous);

  const int n = static_cast<int>(ins.size());
  const int64_t elem = out.element_size();
  std::vector<const char*> ptrs(n);
  for (int i = 0; i < n; ++i) ptrs[i] = static_cast<const char*>(ins[i].const_data_ptr());
  char* o = static_cast<char*>(dst.mutable_data_ptr());
  const core::DType dt = core_dtype(out.scalar_type());
  at::parallel_for(0, numel, kGrain, [&](int64_t begin, int64_t end) {
    std::vector<const void*> p(n);
    for (int i = 0; i < n; ++i) p[i] = ptrs[i] + begin * elem;
    core::reduce_range(order, dt, o + begin * elem, p.data(), n, end - begin, scale.has_value(),
                       scale.value_or(1.0));
  });
  if (!out_contig) out.copy_(dst);
}

at::Tensor accumulate_n_cpu(at::TensorList tensors, std::optional<double> scale) {
  check_reduce_inputs("accumulate_n", tensors, nullptr, scale);
  at::Tensor out = at::empty_like(tensors[0], at::MemoryFormat::Contiguous);
  reduce_into(core::Order::kSequential, tensors, scale, out);
  return out;
}

void accumulate_n_out_cpu(at::TensorList tensors, std::optional<double> scale, at::Tensor out) {
  check_reduce_inputs("accumulate_n", tensors, &out, scale);
  check_out_without_autograd("accumulate_n", tensors, out);
  reduce_into(core::Order::kSequential, tensors, scale, out);
}

at::Tensor tree_reduce_cpu(at::TensorList tensors, std::optional<double> scale) {
  check_reduce_inputs("tree_reduce", tensors, nullptr, scale);
  at::Tensor out = at::empty_like(tensors[0], at::MemoryFormat::Contiguous);
  reduce_into(core::Order::kTree, tensors, scale, out);
  return out;
}

void tree_reduce_out_cpu(at::TensorList tensors, std::optional<double> scale, at::Tensor out) {
  check_reduce_inputs("tree_reduce", tensors, &out, scale);
  check_out_without_autograd("tree_reduce", tensors, out);
  reduce_into(core::Order::kTree, tensors, scale, out);
}

void accumulate_inplace_cpu(at::Tensor dst, at::TensorList tensors) {
  check_reduce_inputs("accumulate_", tensors, &dst, std::nullopt, "dst");
  // dst + t0 + t1 + ...: reduce [dst, tensors...] left to right into dst.
  std::vector<at::Tensor> all;
  all.reserve(tensors.size() + 1);
  all.push_back(dst);
  for (const auto& t : tensors) all.push_back(t);
  reduce_into(core::Order::kSequential, all, std::nullopt, dst);
}

}  // namespace

TORCH_LIBRARY_IMPL(torchstrategies, CPU, m) {
  m.impl("accumulate_n", &accumulate_n_cpu);
  m.impl("accumulate_n_out", &accumulate_n_out_cpu);
  m.impl("tree_reduce", &tree_reduce_cpu);
  m.impl("tree_reduce_out", &tree_reduce_out_cpu);
  m.impl("accumulate_", &accumulate_inplace_cpu);
}

}  // namespace torchstrategies
