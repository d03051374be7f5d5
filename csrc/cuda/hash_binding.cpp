// Registers the CUDA hash_tensors kernel for the CUDA dispatch key: thin torch glue around the torch-free
// launcher in hash_cuda.h. Built only by setup.py's CUDA path (torch with CUDA and CUDA_HOME present).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "checks.h"
#include "core/hash.h"
#include "cpu/agreement_step.h"
#include "cuda/hash_cuda.h"

namespace torchstrategies {
namespace {

at::Tensor hash_tensors_cuda(at::TensorList tensors) {
  check_hash_inputs("hash_tensors", tensors);
  const int64_t n = static_cast<int64_t>(tensors.size());
  TORCH_CHECK(n > 0 && tensors[0].is_cuda(), "hash_tensors: expected CUDA tensors");
  c10::cuda::CUDAGuard guard(tensors[0].device());
  at::Tensor out = at::empty({n}, tensors[0].options().dtype(at::kLong));
  std::vector<at::Tensor> operands;
  int64_t words = 0;
  for (const auto& t : tensors) {
    operands.push_back(hash_operand(t));
    const int64_t nbytes = operands.back().numel() * static_cast<int64_t>(operands.back().element_size());
    words = std::max(words, core::hash_scratch_words(nbytes));
  }
  // One scratch for every tensor: the kernels of one stream run in order.
  at::Tensor scratch = at::empty({std::max<int64_t>(words, 1)}, out.options());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  for (int64_t i = 0; i < n; ++i) {
    const at::Tensor& t = operands[i];
    const int64_t nbytes = t.numel() * static_cast<int64_t>(t.element_size());
    C10_CUDA_CHECK(cuda::launch_hash(t.const_data_ptr(), nbytes,
                                     reinterpret_cast<uint64_t*>(scratch.mutable_data_ptr<int64_t>()),
                                     out.mutable_data_ptr<int64_t>() + i, stream));
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(torchstrategies, CUDA, m) {
  m.impl("hash_tensors", &hash_tensors_cuda);
  // The agreement check's glue (csrc/cpu/agreement_step.cpp): CUDA tensors' bytes go to the kernel above.
  m.impl("agreement_hash_", &agreement_hash_);
  m.impl("agreement_record_", &agreement_record_);
}

}  // namespace torchstrategies
