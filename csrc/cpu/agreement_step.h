// The per-step agreement check's two calls (the check, before the update; the record, after it) (agreement_step.cpp): device-agnostic glue, registered for the
// CPU key there and for the CUDA key by csrc/cuda/hash_binding.cpp.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace torchstrategies {

void agreement_hash_(at::TensorList tensors, const at::Tensor& state, const at::Tensor& payload,
                     int64_t forced_from, int64_t piece, int64_t slices);

void agreement_record_(at::TensorList tensors, const at::Tensor& state);

}  // namespace torchstrategies
