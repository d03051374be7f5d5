// Registers the CUDA reduction kernels for the CUDA dispatch key: thin torch glue around the
// torch-free launchers in reduce_cuda.h. Built only by setup.py's CUDA path (torch with CUDA and
// CUDA_HOME present).
#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <vector>

#include "checks.h"
#include "cuda/reduce_cuda.h"

namespace torchstrategies {
namespace {

// The CUDA kernels take the floating-point dtypes of the kernels' one table (checks.h kernel_dtype).
core::DType cuda_dtype(const char* op, at::ScalarType t) {
  const std::optional<core::DType> d = kernel_dtype(t);
  TORCH_CHECK(d.has_value() && at::isFloatingType(t), op, ": dtype ", t,
              " has no CUDA kernel (supported on CUDA: float32, float64, float16, bfloat16)");
  return *d;
}

void reduce_into_cuda(const char* op, core::Order order, at::TensorList tensors,
                      std::optional<double> scale, const at::Tensor& out) {
  TORCH_CHECK(out.is_cuda(), op, ": expected CUDA tensors, got ", out.device());
  const core::DType dt = cuda_dtype(op, out.scalar_type());
  const int64_t numel = out.numel();
  if (numel == 0) return;
  c10::cuda::CUDAGuard guard(out.device());
  for (const auto& t : tensors) at::assert_no_partial_overlap(out, t);
  std::vector<at::Tensor> ins;
  ins.reserve(tensors.size());
  for (const auto& t : tensors) ins.push_back(t.contiguous());
  const bool out_contig = out.is_contiguous();
  at::Tensor dst = out_contig ? out : at::empty_like(out, at::MemoryFormat::Contiguous);

  const int n = static_cast<int>(ins.size());
  std::vector<const void*> ptrs(n);
  for (int i = 0; i < n; ++i) ptrs[i] = ins[i].const_data_ptr();
  // Device-resident pointer table, only when the pointers do not fit the kernel parameters. It is
  // allocated and copied on the current stream, the one the kernel runs on.
  at::Tensor table;
  const void* const* table_ptr = nullptr;
  if (n > cuda::kMaxArgPtrs) {
    at::Tensor host = at::empty({n}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
    auto* h = host.mutable_data_ptr<int64_t>();
    for (int i = 0; i < n; ++i) h[i] = reinterpret_cast<int64_t>(ptrs[i]);
    table = host.to(at::TensorOptions().dtype(at::kLong).device(out.device()), /*non_blocking=*/true);
    table_ptr = reinterpret_cast<const void* const*>(table.const_data_ptr<int64_t>());
  }
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  C10_CUDA_CHECK(cuda::launch_reduce(order, dt, dst.mutable_data_ptr(), ptrs.data(), table_ptr, n,
                                     numel, scale.has_value(), scale.value_or(1.0), stream));
  if (!out_contig) out.copy_(dst);
}

at::Tensor accumulate_n_cuda(at::TensorList tensors, std::optional<double> scale) {
  check_reduce_inputs("accumulate_n", tensors, nullptr, scale);
  at::Tensor out = at::empty_like(tensors[0], at::MemoryFormat::Contiguous);
  reduce_into_cuda("accumulate_n", core::Order::kSequential, tensors, scale, out);
  return out;
}

void accumulate_n_out_cuda(at::TensorList tensors, std::optional<double> scale, at::Tensor out) {
  check_reduce_inputs("accumulate_n", tensors, &out, scale);
  check_out_without_autograd("accumulate_n", tensors, out);
  reduce_into_cuda("accumulate_n", core::Order::kSequential, tensors, scale, out);
}

at::Tensor tree_reduce_cuda(at::TensorList tensors, std::optional<double> scale) {
  check_reduce_inputs("tree_reduce", tensors, nullptr, scale);
  at::Tensor out = at::empty_like(tensors[0], at::MemoryFormat::Contiguous);
  reduce_into_cuda("tree_reduce", core::Order::kTree, tensors, scale, out);
  return out;
}

void tree_reduce_out_cuda(at::TensorList tensors, std::optional<double> scale, at::Tensor out) {
  check_reduce_inputs("tree_reduce", tensors, &out, scale);
  check_out_without_autograd("tree_reduce", tensors, out);
  reduce_into_cuda("tree_reduce", core::Order::kTree, tensors, scale, out);
}

void accumulate_inplace_cuda(at::Tensor dst, at::TensorList tensors) {
  check_reduce_inputs("accumulate_", tensors, &dst, std::nullopt, "dst");
  std::vector<at::Tensor> all;
  all.reserve(tensors.size() + 1);
  all.push_back(dst);
  for (const auto& t : tensors) all.push_back(t);
  reduce_into_cuda("accumulate_", core::Order::kSequential, all, std::nullopt, dst);
}

}  // namespace

TORCH_LIBRARY_IMPL(torchstrategies, CUDA, m) {
  m.impl("accumulate_n", &accumulate_n_cuda);
  m.impl("accumulate_n_out", &accumulate_n_out_cuda);
  m.impl("tree_reduce", &tree_reduce_cuda);
  m.impl("tree_reduce_out", &tree_reduce_out_cuda);
  m.impl("accumulate_", &accumulate_inplace_cuda);
}

}  // namespace torchstrategies
