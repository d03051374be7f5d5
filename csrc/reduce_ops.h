// The six reduce ops (accumulate_n, tree_reduce, their out= variants, accumulate_, accumulate_grouped_),
// written once for
// every backend. Each entry point checks its inputs (checks.h), picks the output and the summation order,
// and hands the sum to the backend's `Reduce`:
//
//   void Reduce(const char* op, core::Order order, at::TensorList tensors, std::optional<double> scale,
//               const at::Tensor& out);
//
// which sums the already validated `tensors` into `out` (out may alias an input exactly). A backend
// registers the ops for its dispatch key with register_reduce_ops<Reduce>(m) in its TORCH_LIBRARY_IMPL
// (csrc/cpu/reduce_cpu.cpp, csrc/cuda/reduce_binding.cpp).
#pragma once

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <torch/library.h>

#include <optional>
#include <vector>

#include "checks.h"
#include "core/reduce_kernels.h"

namespace torchstrategies {

using ReduceFn = void (*)(const char* op, core::Order order, at::TensorList tensors,
                          std::optional<double> scale, const at::Tensor& out);

// What a backend's Reduce works on: every input contiguous (a copy where it is not) and `dst`, `out`
// itself when it is contiguous, else a contiguous temporary the backend copies back into `out`
// (finish). `out` may alias an input exactly; partial overlap is rejected.
struct ContiguousOperands {
  ContiguousOperands(at::TensorList tensors, const at::Tensor& out) {
    for (const auto& t : tensors) at::assert_no_partial_overlap(out, t);
    ins.reserve(tensors.size());
    for (const auto& t : tensors) ins.push_back(t.contiguous());
    dst = out.is_contiguous() ? out : at::empty_like(out, at::MemoryFormat::Contiguous);
  }
  void finish(const at::Tensor& out) const {
    if (!dst.is_same(out)) out.copy_(dst);
  }
  std::vector<at::Tensor> ins;
  at::Tensor dst;
};

template <ReduceFn Reduce>
struct ReduceOps {
  static at::Tensor reduce(const char* op, core::Order order, at::TensorList tensors,
                           std::optional<double> scale) {
    check_reduce_inputs(op, tensors, nullptr, scale);
    at::Tensor out = at::empty_like(tensors[0], at::MemoryFormat::Contiguous);
    Reduce(op, order, tensors, scale, out);
    return out;
  }
  static void reduce_out(const char* op, core::Order order, at::TensorList tensors,
                         std::optional<double> scale, const at::Tensor& out) {
    check_reduce_inputs(op, tensors, &out, scale);
    check_out_without_autograd(op, tensors, out);
    Reduce(op, order, tensors, scale, out);
  }

  static at::Tensor accumulate_n(at::TensorList tensors, std::optional<double> scale) {
    return reduce("accumulate_n", core::Order::kSequential, tensors, scale);
  }
  static void accumulate_n_out(at::TensorList tensors, std::optional<double> scale, at::Tensor out) {
    reduce_out("accumulate_n", core::Order::kSequential, tensors, scale, out);
  }
  static at::Tensor tree_reduce(at::TensorList tensors, std::optional<double> scale) {
    return reduce("tree_reduce", core::Order::kTree, tensors, scale);
  }
  static void tree_reduce_out(at::TensorList tensors, std::optional<double> scale, at::Tensor out) {
    reduce_out("tree_reduce", core::Order::kTree, tensors, scale, out);
  }
  static void accumulate_inplace(at::Tensor dst, at::TensorList tensors) {
    check_reduce_inputs("accumulate_", tensors, &dst, std::nullopt, "dst");
    // dst + t0 + t1 + ...: reduce [dst, tensors...] left to right into dst.
    std::vector<at::Tensor> all;
    all.reserve(tensors.size() + 1);
    all.push_back(dst);
    for (const auto& t : tensors) all.push_back(t);
    Reduce("accumulate_", core::Order::kSequential, all, std::nullopt, dst);
  }
  // dsts[i] += tensors[i] + tensors[n + i] + ... (n = len(dsts)): accumulate_ over a group in one call.
  static void accumulate_grouped(at::TensorList dsts, at::TensorList tensors) {
    const size_t n = dsts.size();
    TORCH_CHECK(n > 0 ? tensors.size() % n == 0 : tensors.empty(), "accumulate_grouped_: ", tensors.size(),
                " tensors do not split evenly over ", n, " destinations");
    const size_t per = n > 0 ? tensors.size() / n : 0;
    std::vector<at::Tensor> terms(per);
    for (size_t i = 0; i < n; ++i) {
      for (size_t j = 0; j < per; ++j) terms[j] = tensors[j * n + i];
      accumulate_inplace(dsts[i], terms);
    }
  }
};

template <ReduceFn Reduce>
void register_reduce_ops(torch::Library& m) {
  using Ops = ReduceOps<Reduce>;
  m.impl("accumulate_n", &Ops::accumulate_n);
  m.impl("accumulate_n_out", &Ops::accumulate_n_out);
  m.impl("tree_reduce", &Ops::tree_reduce);
  m.impl("tree_reduce_out", &Ops::tree_reduce_out);
  m.impl("accumulate_", &Ops::accumulate_inplace);
  m.impl("accumulate_grouped_", &Ops::accumulate_grouped);
}

}  // namespace torchstrategies
