// The per-step agreement check's two calls (the check, before the update; the record, after it) (agreement_step.cpp): device-agnostic glue, registered for the
// CPU key there and for the CUDA key by csrc/cuda/hash_binding.cpp.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace torchstrategies {

void agreement_hash_(at::TensorList tensors, const at::Tensor& state, const at::Tensor& payload,
                     int64_t forced_from, int64_t piece, int64_t slices);

void agreement_record_(at::TensorList tensors, const at::Tensor& state);

// Piece `piece` of `slices` of the tensors' bytes laid end to end: int64 (n, 2) CPU rows [a, b), the element
// range of tensor i's flat view in the piece (a == b: none; a tensor that is not contiguous whole, in the
// piece that holds its first byte). Metadata only; registered for every device (CompositeExplicitAutograd).
at::Tensor agreement_piece(at::TensorList tensors, int64_t piece, int64_t slices);

// Per tensor, the fingerprint of its part in piece `piece` of `slices` (0: none): int64 (n,) on the CPU, the
// values agreement_hash_ writes to its payload's piece part. Its bytes are hashed through hash_tensors, so
// it is registered once for every device (CompositeExplicitAutograd).
at::Tensor agreement_piece_fingerprints(at::TensorList tensors, int64_t piece, int64_t slices);

}  // namespace torchstrategies
