// CPU kernel of hash_tensors: thin ATen glue around the torch-free hash (csrc/core/hash.h). Each tensor's
// bytes (logical order: a non-contiguous tensor is copied first) are hashed chunk by chunk; the chunks of
// a level are split over torch's intra-op pool (at::parallel_for, at least kHashGrain chunks a range).
// Every chunk's hash goes to its own slot and the levels combine the slots in index order, so the result
// is the same for every thread count (tests/test_ops_hash.py checks it).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "checks.h"
#include "core/hash.h"

namespace torchstrategies {
namespace {

// Chunks per parallel range at least (64 KiB): below that, waking the pool costs more than it saves.
constexpr int64_t kHashGrain = 16;

at::Tensor hash_tensors_cpu(at::TensorList tensors) {
  check_hash_inputs("hash_tensors", tensors);
  const int64_t n = static_cast<int64_t>(tensors.size());
  at::Tensor out = at::empty({n}, at::TensorOptions().dtype(at::kLong));
  auto* o = out.mutable_data_ptr<int64_t>();
  std::vector<uint64_t> scratch;
  for (int64_t i = 0; i < n; ++i) {
    const at::Tensor t = hash_operand(tensors[i]);
    const int64_t nbytes = t.numel() * static_cast<int64_t>(t.element_size());
    scratch.resize(static_cast<size_t>(core::hash_scratch_words(nbytes)));
    const uint64_t h = core::hash_bytes(t.const_data_ptr(), nbytes, scratch.data(),
                                        [](int64_t count, const auto& fn) {
                                          at::parallel_for(0, count, kHashGrain, fn);
                                        });
    o[i] = static_cast<int64_t>(h);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(torchstrategies, CPU, m) { m.impl("hash_tensors", &hash_tensors_cpu); }

}  // namespace torchstrategies
