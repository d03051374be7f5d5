// Input validation shared by every backend's kernels: one helper, clear messages with the values.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <optional>

#include "core/reduce_kernels.h"

namespace torchstrategies {

// The dtypes our kernels take and their code in the torch-free kernels (core::DType): the one table.
// csrc/cpu/shm_binding.cpp exports it to Python (torchstrategies._C.DTYPES), where ops.py reads it.
inline std::optional<core::DType> kernel_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return core::DType::kFloat32;
    case at::kDouble: return core::DType::kFloat64;
    case at::kHalf: return core::DType::kFloat16;
    case at::kBFloat16: return core::DType::kBFloat16;
    case at::kInt: return core::DType::kInt32;
    case at::kLong: return core::DType::kInt64;
    default: return std::nullopt;
  }
}

inline bool supported_dtype(at::ScalarType t) { return kernel_dtype(t).has_value(); }

// Checks that `tensors` is a non-empty list of same-shaped, same-dtype, same-device tensors of a
// supported dtype; `out`, if given, must match them too.
// `out_name` names `out` in messages ("out", or "dst" for accumulate_).
inline void check_reduce_inputs(const char* op, at::TensorList tensors, const at::Tensor* out,
                                std::optional<double> scale, const char* out_name = "out") {
  TORCH_CHECK(!tensors.empty(), op, ": expected a non-empty list of tensors, got an empty list");
  const at::Tensor& t0 = tensors[0];
  TORCH_CHECK(supported_dtype(t0.scalar_type()), op, ": unsupported dtype ", t0.scalar_type(),
              " (supported: float32, float64, float16, bfloat16, int32, int64)");
  for (size_t i = 1; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    TORCH_CHECK(t.scalar_type() == t0.scalar_type(), op, ": tensors[", i, "] has dtype ",
                t.scalar_type(), " but tensors[0] has dtype ", t0.scalar_type());
    TORCH_CHECK(t.sizes() == t0.sizes(), op, ": tensors[", i, "] has shape ", t.sizes(),
                " but tensors[0] has shape ", t0.sizes());
    TORCH_CHECK(t.device() == t0.device(), op, ": tensors[", i, "] is on ", t.device(),
                " but tensors[0] is on ", t0.device());
  }
  if (out != nullptr) {
    TORCH_CHECK(out->scalar_type() == t0.scalar_type(), op, ": ", out_name, " has dtype ",
                out->scalar_type(), " but the inputs have dtype ", t0.scalar_type());
    TORCH_CHECK(out->sizes() == t0.sizes(), op, ": ", out_name, " has shape ", out->sizes(),
                " but the inputs have shape ", t0.sizes());
    TORCH_CHECK(out->device() == t0.device(), op, ": ", out_name, " is on ", out->device(),
                " but the inputs are on ", t0.device());
  }
  if (scale.has_value()) {
    TORCH_CHECK(at::isFloatingType(t0.scalar_type()), op, ": scale=", *scale,
                " needs a floating-point dtype, got ", t0.scalar_type());
  }
}

// The out= variants have no autograd formula: refuse inputs that require grad (while grad mode is on)
// instead of silently cutting the graph.
inline void check_out_without_autograd(const char* op, at::TensorList tensors, const at::Tensor& out) {
  if (!at::GradMode::is_enabled()) return;
  bool any = out.requires_grad();
  for (const auto& t : tensors) any = any || t.requires_grad();
  TORCH_CHECK(!any, op, ": out= does not support autograd (an input or out requires grad); call it "
              "without out=, or under torch.no_grad()");
}

// hash_tensors' inputs: strided tensors on one device (any dtype: the hash reads their bytes).
inline void check_hash_inputs(const char* op, at::TensorList tensors) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    TORCH_CHECK(t.layout() == at::kStrided, op, ": tensors[", i, "] has layout ", t.layout(),
                "; only strided (dense) tensors are hashed (call .to_dense() first)");
    TORCH_CHECK(t.device() == tensors[0].device(), op, ": tensors[", i, "] is on ", t.device(),
                " but tensors[0] is on ", tensors[0].device(), " (hash each device's tensors in a call of their own)");
  }
}

// The bytes a hash reads: t's values in their logical (row-major) order, conjugation and negation views
// resolved (a copy only where t is not already such an array).
inline at::Tensor hash_operand(const at::Tensor& t) {
  return t.resolve_conj().resolve_neg().contiguous();
}

}  // namespace torchstrategies
