// Registers the CUDA reduction kernels for the CUDA dispatch key: thin torch glue around the
// torch-free launchers in reduce_cuda.h. Built only by setup.py's CUDA path (torch with CUDA and
// CUDA_HOME present).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <vector>

#include "checks.h"
#include "cuda/reduce_cuda.h"
#include "reduce_ops.h"

namespace torchstrategies {
namespace {

// The CUDA kernels take the floating-point dtypes of the kernels' one table (checks.h kernel_dtype).
core::DType cuda_dtype(const char* op, at::ScalarType t) {
  const std::optional<core::DType> d = kernel_dtype(t);
  TORCH_CHECK(d.has_value() && at::isFloatingType(t), op, ": dtype ", t,
              " has no CUDA kernel (supported on CUDA: float32, float64, float16, bfloat16)");
  return *d;
}

// The CUDA backend's Reduce (reduce_ops.h): sums `tensors` (already validated) into `out` in `order`
// on the current stream.
void reduce_into_cuda(const char* op, core::Order order, at::TensorList tensors,
                      std::optional<double> scale, const at::Tensor& out) {
  TORCH_CHECK(out.is_cuda(), op, ": expected CUDA tensors, got ", out.device());
  const core::DType dt = cuda_dtype(op, out.scalar_type());
  const int64_t numel = out.numel();
  if (numel == 0) return;
  c10::cuda::CUDAGuard guard(out.device());
  const ContiguousOperands operands(tensors, out);

  const int n = static_cast<int>(operands.ins.size());
  std::vector<const void*> ptrs(n);
  for (int i = 0; i < n; ++i) ptrs[i] = operands.ins[i].const_data_ptr();
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
  C10_CUDA_CHECK(cuda::launch_reduce(order, dt, operands.dst.mutable_data_ptr(), ptrs.data(), table_ptr,
                                     n, numel, scale.has_value(), scale.value_or(1.0), stream));
  operands.finish(out);
}

}  // namespace

TORCH_LIBRARY_IMPL(torchstrategies, CUDA, m) { register_reduce_ops<&reduce_into_cuda>(m); }

}  // namespace torchstrategies
