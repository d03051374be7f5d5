// The collectives the "torchstrategies" backend hands to its gloo backend (see backend.h): each agrees on its
// descriptor on our transport first (Backend::delegate), in FIFO order with the native ones; point-to-point
// calls (send / recv) go to gloo directly, as there is no group-wide call to agree on.
#include "cpu/backend.h"

namespace torchstrategies {

using c10d::OpType;

c10::intrusive_ptr<c10d::Work> Backend::allreduce_sparse(std::vector<at::Tensor>& tensors,
                                                         const c10d::AllreduceOptions& opts) {
  auto ts = tensors;
  auto o = opts;
  const auto desc = describe_call(core::kAllReduceSparse, tensors, static_cast<int32_t>(opts.reduceOp.op_));
  return delegate(OpType::_ALLREDUCE_SPARSE, desc, tensors, opts.timeout, !opts.asyncOp,
                  [this, ts, o]() mutable { return gloo_->allreduce_sparse(ts, o); });
}

c10::intrusive_ptr<c10d::Work> Backend::reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) {
  auto ts = tensors;
  auto o = opts;
  const auto desc = describe_call(core::kReduce, tensors, static_cast<int32_t>(opts.reduceOp.op_),
                                  static_cast<int32_t>(opts.rootRank));
  if (desc.dtype != core::kMixedDtype && !tensors.empty() && tensors[0].layout() == at::kStrided) {
    std::string why = unsupported_reduction("reduce", tensors[0].scalar_type(), desc.op);
    if (!why.empty()) return refuse(OpType::REDUCE, desc, tensors, opts.timeout, !opts.asyncOp, std::move(why));
  }
  return delegate(OpType::REDUCE, desc, tensors, opts.timeout, !opts.asyncOp,
                  [this, ts, o]() mutable { return gloo_->reduce(ts, o); });
}

c10::intrusive_ptr<c10d::Work> Backend::allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                            std::vector<at::Tensor>& inputs,
                                                            const c10d::AllgatherOptions& opts) {
  auto out = outputs;
  auto in = inputs;
  auto o = opts;
  return delegate(OpType::ALLGATHER_COALESCED, describe_call(core::kAllGatherCoalesced, inputs), inputs,
                  opts.timeout, !opts.asyncOp,
                  [this, out, in, o]() mutable { return gloo_->allgather_coalesced(out, in, o); });
}

c10::intrusive_ptr<c10d::Work> Backend::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                               std::vector<at::Tensor>& inputs, const c10d::GatherOptions& opts) {
  auto out = outputs;
  auto in = inputs;
  auto o = opts;
  const auto desc = describe_call(core::kGather, inputs, 0, static_cast<int32_t>(opts.rootRank));
  return delegate(OpType::GATHER, desc, inputs, opts.timeout, !opts.asyncOp,
                  [this, out, in, o]() mutable { return gloo_->gather(out, in, o); });
}

c10::intrusive_ptr<c10d::Work> Backend::scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ScatterOptions& opts) {
  auto out = outputs;
  auto in = inputs;
  auto o = opts;
  // Described by what every rank receives (only the root has inputs).
  const auto desc = describe_call(core::kScatter, outputs, 0, static_cast<int32_t>(opts.rootRank));
  return delegate(OpType::SCATTER, desc, outputs, opts.timeout, !opts.asyncOp,
                  [this, out, in, o]() mutable { return gloo_->scatter(out, in, o); });
}

c10::intrusive_ptr<c10d::Work> Backend::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                      std::vector<int64_t>& output_splits,
                                                      std::vector<int64_t>& input_splits,
                                                      const c10d::AllToAllOptions& opts) {
  auto out = output, in = input;
  auto os = output_splits, is = input_splits;
  auto o = opts;
  // Sizes may differ between ranks (uneven splits): the check agrees on the collective and the dtype.
  return delegate(OpType::ALLTOALL_BASE, describe_call(core::kAllToAll, {input}, 0, 0, /*sizes_agree=*/false),
                  {output}, opts.timeout, !opts.asyncOp,
                  [this, out, in, os, is, o]() mutable { return gloo_->alltoall_base(out, in, os, is, o); });
}

c10::intrusive_ptr<c10d::Work> Backend::alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                                 const c10d::AllToAllOptions& opts) {
  auto out = outputs, in = inputs;
  auto o = opts;
  return delegate(OpType::ALLTOALL, describe_call(core::kAllToAll, inputs, 0, 0, /*sizes_agree=*/false), outputs,
                  opts.timeout, !opts.asyncOp,
                  [this, out, in, o]() mutable { return gloo_->alltoall(out, in, o); });
}

c10::intrusive_ptr<c10d::Work> Backend::send(std::vector<at::Tensor>& tensors, int dst, int tag) {
  return gloo_->send(tensors, dst, tag);
}

c10::intrusive_ptr<c10d::Work> Backend::recv(std::vector<at::Tensor>& tensors, int src, int tag) {
  return gloo_->recv(tensors, src, tag);
}

c10::intrusive_ptr<c10d::Work> Backend::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  return gloo_->recvAnysource(tensors, tag);
}

void Backend::monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) {
  barrier(opts)->wait();  // after everything queued before it
  gloo_->monitoredBarrier(opts, wait_all_ranks);
}

}  // namespace torchstrategies
