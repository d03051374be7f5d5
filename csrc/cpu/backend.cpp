// The "torchstrategies" c10d backend: tensors in, checks in the caller's thread, raw memory to the
// transport on the worker thread (see backend.h).
#include "cpu/backend.h"

#include <ATen/core/grad_mode.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <chrono>
#include <optional>
#include <utility>

#include "checks.h"

namespace torchstrategies {
namespace {

using c10d::OpType;

c10::DistBackendError dist_error(const std::string& msg) {
  return c10::DistBackendError(c10::SourceLocation{__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, msg);
}

std::exception_ptr to_error(const core::Fault& f) {
  static const char* names[] = {"DeadlineExceededError", "UnavailableError", "ValueError", "ValueError"};
  return std::make_exception_ptr(dist_error(std::string("torchstrategies ") + names[f.kind] + ": " + f.what()));
}

// Our core::Op for a c10d op, or -1 (BAND / BOR / BXOR / PREMUL_SUM go to gloo).
int core_op(const c10d::ReduceOp& op) {
  switch (op.op_) {
    case c10d::ReduceOp::SUM: return core::kSum;
    case c10d::ReduceOp::AVG: return core::kMean;
    case c10d::ReduceOp::PRODUCT: return core::kProduct;
    case c10d::ReduceOp::MIN: return core::kMin;
    case c10d::ReduceOp::MAX: return core::kMax;
    default: return -1;
  }
}

void check_cpu(const char* what, const at::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu(), "torchstrategies ", what, ": expected CPU tensors, got one on ", t.device(),
              " (the backend serves CPU tensors: for CUDA use e.g. init_process_group(\"cpu:torchstrategies,"
              "cuda:nccl\"))");
}

// The checks of a collective over one flat tensor per rank and one `size` times as long (all-gather: the
// output; reduce-scatter: the input): CPU tensors, one dtype, and the long one's length.
void check_flat_pair(const char* op, const at::Tensor& input, const at::Tensor& output, bool output_is_long,
                     int size) {
  check_cpu(op, input);
  check_cpu(op, output);
  TORCH_CHECK(output.scalar_type() == input.scalar_type(), "torchstrategies ", op, ": output dtype ",
              output.scalar_type(), " differs from the input's ", input.scalar_type());
  const at::Tensor& whole = output_is_long ? output : input;
  const at::Tensor& part = output_is_long ? input : output;
  TORCH_CHECK(whole.numel() == part.numel() * size, "torchstrategies ", op, ": ", output_is_long ? "output" : "input",
              " holds ", whole.numel(), " elements, expected world size ", size, " x ", part.numel());
}

// A coalesced call as its pairs' calls, one by one in order: the last one's Work completes after the others
// (FIFO), a barrier's when there are none.
template <typename Call>
c10::intrusive_ptr<c10d::Work> one_by_one(Backend& backend, const char* op, std::vector<at::Tensor>& outputs,
                                          std::vector<at::Tensor>& inputs, const Call& call) {
  TORCH_CHECK(outputs.size() == inputs.size(), "torchstrategies ", op, ": ", outputs.size(), " outputs for ",
              inputs.size(), " inputs");
  c10::intrusive_ptr<c10d::Work> last;
  for (size_t i = 0; i < inputs.size(); ++i) last = call(outputs[i], inputs[i]);
  return last ? last : backend.barrier(c10d::BarrierOptions());
}

// The kernels' dtype of `tensors` if every one is a dense tensor of the same dtype our kernels take.
std::optional<core::DType> kernel_dtype_of(const std::vector<at::Tensor>& tensors) {
  for (const auto& t : tensors) {
    if (t.layout() != at::kStrided || t.scalar_type() != tensors[0].scalar_type()) return std::nullopt;
  }
  return tensors.empty() ? std::nullopt : kernel_dtype(tensors[0].scalar_type());
}

// A contiguous tensor to work on: `t` itself, or a copy the worker writes back with `copy_back`.
at::Tensor work_on(const at::Tensor& t) { return t.is_contiguous() ? t : t.contiguous(); }
void copy_back(const std::vector<at::Tensor>& dst, const std::vector<at::Tensor>& used) {
  for (size_t i = 0; i < dst.size(); ++i) {
    if (!used[i].is_same(dst[i])) dst[i].copy_(used[i]);
  }
}

int64_t nbytes(const at::Tensor& t) { return t.numel() * static_cast<int64_t>(t.element_size()); }
char* ptr(const at::Tensor& t) { return static_cast<char*>(t.data_ptr()); }

// A list reduced as one buffer must not hold the same memory twice (the same tensor, a view of another):
// every tensor whose bytes overlap an earlier one's works on a private copy, copied back afterwards, so each
// entry is reduced exactly once.
void unalias(std::vector<at::Tensor>& used) {
  if (used.size() < 2) return;
  std::vector<std::pair<uintptr_t, size_t>> spans;  // (start, index)
  for (size_t i = 0; i < used.size(); ++i) {
    if (used[i].numel()) spans.emplace_back(reinterpret_cast<uintptr_t>(used[i].data_ptr()), i);
  }
  std::sort(spans.begin(), spans.end());
  uintptr_t end = 0;
  for (const auto& [lo, i] : spans) {
    if (lo < end) {
      used[i] = used[i].clone();
    } else {
      end = std::max(end, lo + static_cast<uintptr_t>(nbytes(used[i])));
    }
  }
}

}  // namespace

Work::Work(int rank, OpType type, std::vector<at::Tensor> outputs)
    : c10d::Work(rank, type), outputs_(std::move(outputs)),
      future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()))) {}

void Work::complete(std::exception_ptr error) {
  finish(error);
  if (error) {
    future_->setError(error);
  } else {
    future_->markCompleted(c10::IValue(outputs_));
  }
}

Backend::Backend(int rank, int size, std::unique_ptr<core::Transport> transport, double timeout_s)
    : c10d::Backend(rank, size), transport_(std::move(transport)), timeout_s_(timeout_s) {
  worker_ = std::thread([this] { loop(); });
}

Backend::~Backend() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  // A Python callback chained on a Work's future runs on the worker and needs the GIL: never join holding it.
  if (Py_IsInitialized() && PyGILState_Check()) {
    pybind11::gil_scoped_release nogil;
    worker_.join();
  } else {
    worker_.join();
  }
}

c10::intrusive_ptr<c10d::Backend::Options> Backend::getBackendOptions() {
  return c10::make_intrusive<Options>(
      "torchstrategies", std::chrono::milliseconds(static_cast<int64_t>(timeout_s_ * 1000.0)));
}

void Backend::setTimeout(std::chrono::milliseconds timeout) { timeout_s_ = timeout.count() / 1000.0; }

double Backend::timeout_of(std::chrono::milliseconds t) const {
  return t.count() >= 0 ? t.count() / 1000.0 : timeout_s_;
}

c10::intrusive_ptr<c10d::Work> Backend::submit(OpType type, std::vector<at::Tensor> outputs,
                                               std::chrono::milliseconds timeout, bool sync, Task task) {
  auto work = c10::make_intrusive<Work>(getRank(), type, std::move(outputs));
  Item item{work, timeout_of(timeout), std::move(task)};
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (!sync || busy_ || !queue_.empty()) {
      queue_.push_back(std::move(item));
      lock.unlock();
      cv_.notify_one();
      return work;
    }
    busy_ = true;  // the worker starts nothing while this call runs
  }
  // A call the caller waits for at once (async_op=False), with nothing queued before it, runs on the
  // caller's thread: the same order, without handing it to the worker and waking the caller up again.
  run(item);
  bool queued;
  {
    std::lock_guard<std::mutex> lock(mu_);
    busy_ = false;
    queued = !queue_.empty();
  }
  // Only the worker waits on cv_, and only for queued items: waking it for nothing would cost a context
  // switch per call, on a core another rank may need.
  if (queued) cv_.notify_one();
  return work;
}

void Backend::run(Item& item) {
  at::NoGradGuard no_grad;  // the copies back into the caller's tensors are not part of any graph
  std::exception_ptr error;
  try {
    item.task(item.timeout_s);
  } catch (const core::Fault& f) {
    error = to_error(f);
  } catch (...) {
    error = std::current_exception();
  }
  item.work->complete(error);
}

void Backend::loop() {
  for (;;) {
    Item item;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || (!queue_.empty() && !busy_); });
      if (queue_.empty()) return;
      item = std::move(queue_.front());
      queue_.pop_front();
      busy_ = true;
    }
    run(item);
    std::lock_guard<std::mutex> lock(mu_);
    busy_ = false;  // the loop looks at the queue again itself: nobody else waits on cv_
  }
}

c10::intrusive_ptr<c10d::Work> Backend::delegate(OpType type, std::vector<at::Tensor> outputs,
                                                 std::chrono::milliseconds timeout, bool sync, core::CallDesc desc,
                                                 std::function<c10::intrusive_ptr<c10d::Work>()> gloo_op) {
  return submit(type, std::move(outputs), timeout, sync, [this, desc, gloo_op = std::move(gloo_op)](double t) {
    transport_->check(desc, t);
    auto w = gloo_op();
    w->wait(std::chrono::milliseconds(static_cast<int64_t>(t * 1000.0) + 1));
  });
}

// ---- all-reduce -------------------------------------------------------------------------------------------
c10::intrusive_ptr<c10d::Work> Backend::allreduce(std::vector<at::Tensor>& tensors,
                                                  const c10d::AllreduceOptions& opts) {
  TORCH_CHECK(!tensors.empty(), "torchstrategies allreduce: expected at least one tensor");
  for (const auto& t : tensors) check_cpu("allreduce", t);
  const int op = core_op(opts.reduceOp);
  const auto dtype = kernel_dtype_of(tensors);
  if (op < 0 || !dtype) {  // a dtype (bool, int8, complex...), op or layout our kernels do not take: gloo
    int64_t total = 0;
    for (const auto& t : tensors) total += t.layout() == at::kStrided ? nbytes(t) : 0;
    auto ts = tensors;
    auto o = opts;
    return delegate(OpType::ALLREDUCE, tensors, opts.timeout, !opts.asyncOp, {core::kAllReduceDelegated, 0, 0, total, 0},
                    [this, ts, o]() mutable {
                      if (ts.size() == 1) return gloo_->allreduce(ts, o);
                      c10d::AllreduceCoalescedOptions co;
                      co.reduceOp = o.reduceOp;
                      co.timeout = o.timeout;
                      return gloo_->allreduce_coalesced(ts, co);
                    });
  }
  TORCH_CHECK(op != core::kMean || at::isFloatingType(tensors[0].scalar_type()),
              "torchstrategies allreduce: AVG needs floating-point tensors, got ", tensors[0].scalar_type());
  std::vector<at::Tensor> used;
  for (const auto& t : tensors) used.push_back(work_on(t));
  unalias(used);
  return submit(OpType::ALLREDUCE, tensors, opts.timeout, !opts.asyncOp, [this, tensors, used, dt = *dtype, op](double t) {
    std::vector<core::shm::Piece> pieces;
    for (const auto& u : used) pieces.push_back({ptr(u), u.numel()});
    transport_->all_reduce(pieces, dt, op, t);
    copy_back(tensors, used);
  });
}

c10::intrusive_ptr<c10d::Work> Backend::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                            const c10d::AllreduceCoalescedOptions& opts) {
  return allreduce(tensors, opts);
}

// ---- broadcast, all-gather, reduce-scatter, barrier ---------------------------------------------------------
c10::intrusive_ptr<c10d::Work> Backend::broadcast(std::vector<at::Tensor>& tensors,
                                                  const c10d::BroadcastOptions& opts) {
  TORCH_CHECK(opts.rootTensor == 0, "torchstrategies broadcast: rootTensor must be 0, got ", opts.rootTensor);
  TORCH_CHECK(opts.rootRank >= 0 && opts.rootRank < getSize(), "torchstrategies broadcast: root ", opts.rootRank,
              " is not a rank of a group of ", getSize());
  std::vector<at::Tensor> used;
  for (const auto& t : tensors) {
    check_cpu("broadcast", t);
    TORCH_CHECK(t.layout() == at::kStrided, "torchstrategies broadcast: expected dense tensors");
    used.push_back(work_on(t));
  }
  const int root = static_cast<int>(opts.rootRank);
  return submit(OpType::BROADCAST, tensors, opts.timeout, !opts.asyncOp, [this, tensors, used, root](double t) {
    for (const auto& u : used) {
      transport_->broadcast(ptr(u), static_cast<size_t>(nbytes(u)), root, static_cast<int32_t>(u.scalar_type()), t);
    }
    if (getRank() != root) copy_back(tensors, used);
  });
}

c10::intrusive_ptr<c10d::Work> Backend::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                        const c10d::AllgatherOptions& opts) {
  check_flat_pair("allgather", input, output, /*output_is_long=*/true, getSize());
  const at::Tensor in = work_on(input), out = work_on(output);
  return submit(OpType::_ALLGATHER_BASE, {output}, opts.timeout, !opts.asyncOp, [this, in, out, output](double t) {
    transport_->all_gather(ptr(in), ptr(out), static_cast<size_t>(nbytes(in)), static_cast<int32_t>(in.scalar_type()), t);
    copy_back({output}, {out});
  });
}

c10::intrusive_ptr<c10d::Work> Backend::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                  std::vector<at::Tensor>& inputs,
                                                  const c10d::AllgatherOptions& opts) {
  TORCH_CHECK(inputs.size() == 1 && outputs.size() == 1, "torchstrategies allgather: expected one input tensor");
  const at::Tensor& input = inputs[0];
  auto outs = outputs[0];
  TORCH_CHECK(static_cast<int>(outs.size()) == getSize(), "torchstrategies allgather: expected ", getSize(),
              " output tensors, got ", outs.size());
  for (const auto& o : outs) {
    check_cpu("allgather", o);
    TORCH_CHECK(o.numel() == input.numel() && o.scalar_type() == input.scalar_type(),
                "torchstrategies allgather: every output must have the input's numel and dtype (", input.numel(),
                ", ", input.scalar_type(), "), got ", o.numel(), ", ", o.scalar_type());
  }
  check_cpu("allgather", input);
  const at::Tensor in = work_on(input);
  const at::Tensor flat = at::empty({getSize() * input.numel()}, input.options());
  return submit(OpType::ALLGATHER, outs, opts.timeout, !opts.asyncOp, [this, in, flat, outs](double t) {
    transport_->all_gather(ptr(in), ptr(flat), static_cast<size_t>(nbytes(in)), static_cast<int32_t>(in.scalar_type()),
                           t);
    const int64_t n = in.numel();
    for (size_t j = 0; j < outs.size(); ++j) outs[j].view({-1}).copy_(flat.narrow(0, static_cast<int64_t>(j) * n, n));
  });
}

c10::intrusive_ptr<c10d::Work> Backend::allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                        std::vector<at::Tensor>& inputs,
                                                                        const c10d::AllgatherOptions& opts) {
  return one_by_one(*this, "allgather", outputs, inputs,
                    [&](at::Tensor& out, at::Tensor& in) { return _allgather_base(out, in, opts); });
}

c10::intrusive_ptr<c10d::Work> Backend::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                            const c10d::ReduceScatterOptions& opts) {
  check_flat_pair("reduce_scatter", input, output, /*output_is_long=*/false, getSize());
  const int op = core_op(opts.reduceOp);
  const auto dtype = kernel_dtype(input.scalar_type());
  if (op < 0 || !dtype) {
    auto out = output, in = input;
    auto o = opts;
    return delegate(OpType::_REDUCE_SCATTER_BASE, {output}, opts.timeout, !opts.asyncOp,
                    {core::kAllReduceDelegated, 0, 0, nbytes(input), 0},
                    [this, out, in, o]() mutable { return gloo_->_reduce_scatter_base(out, in, o); });
  }
  TORCH_CHECK(op != core::kMean || at::isFloatingType(input.scalar_type()),
              "torchstrategies reduce_scatter: AVG needs floating-point tensors, got ", input.scalar_type());
  const at::Tensor in = work_on(input), out = work_on(output);
  return submit(OpType::_REDUCE_SCATTER_BASE, {output}, opts.timeout, !opts.asyncOp,
                [this, in, out, output, dt = *dtype, op](double t) {
                  transport_->reduce_scatter(ptr(in), ptr(out), out.numel(), dt, op, t);
                  copy_back({output}, {out});
                });
}

c10::intrusive_ptr<c10d::Work> Backend::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                       std::vector<std::vector<at::Tensor>>& inputs,
                                                       const c10d::ReduceScatterOptions& opts) {
  TORCH_CHECK(outputs.size() == 1 && inputs.size() == 1, "torchstrategies reduce_scatter: expected one output");
  TORCH_CHECK(static_cast<int>(inputs[0].size()) == getSize(), "torchstrategies reduce_scatter: expected ", getSize(),
              " input tensors, got ", inputs[0].size());
  for (const auto& i : inputs[0]) {
    TORCH_CHECK(i.numel() == outputs[0].numel() && i.scalar_type() == outputs[0].scalar_type(),
                "torchstrategies reduce_scatter: every input must have the output's numel and dtype");
  }
  std::vector<at::Tensor> flat_parts;
  for (const auto& i : inputs[0]) flat_parts.push_back(i.reshape({-1}));
  at::Tensor flat = at::cat(flat_parts);
  return _reduce_scatter_base(outputs[0], flat, opts);
}

c10::intrusive_ptr<c10d::Work> Backend::reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                        std::vector<at::Tensor>& inputs,
                                                                        const c10d::ReduceScatterOptions& opts) {
  return one_by_one(*this, "reduce_scatter", outputs, inputs,
                    [&](at::Tensor& out, at::Tensor& in) { return _reduce_scatter_base(out, in, opts); });
}

c10::intrusive_ptr<c10d::Work> Backend::barrier(const c10d::BarrierOptions& opts) {
  return submit(OpType::BARRIER, {}, opts.timeout, !opts.asyncOp, [this](double t) { transport_->barrier(t); });
}

// ---- handed to gloo ---------------------------------------------------------------------------------------
c10::intrusive_ptr<c10d::Work> Backend::allreduce_sparse(std::vector<at::Tensor>& tensors,
                                                         const c10d::AllreduceOptions& opts) {
  auto ts = tensors;
  auto o = opts;
  return delegate(OpType::_ALLREDUCE_SPARSE, tensors, opts.timeout, !opts.asyncOp, {core::kAllReduceDelegated, 0, 0, 0, 0},
                  [this, ts, o]() mutable { return gloo_->allreduce_sparse(ts, o); });
}

c10::intrusive_ptr<c10d::Work> Backend::reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) {
  auto ts = tensors;
  auto o = opts;
  const int64_t b = tensors.empty() ? 0 : nbytes(tensors[0]);
  return delegate(OpType::REDUCE, tensors, opts.timeout, !opts.asyncOp,
                  {core::kReduce, static_cast<int32_t>(opts.reduceOp.op_), 0, b, static_cast<int32_t>(opts.rootRank)},
                  [this, ts, o]() mutable { return gloo_->reduce(ts, o); });
}

c10::intrusive_ptr<c10d::Work> Backend::allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                            std::vector<at::Tensor>& inputs,
                                                            const c10d::AllgatherOptions& opts) {
  auto out = outputs;
  auto in = inputs;
  auto o = opts;
  int64_t b = 0;
  for (const auto& t : inputs) b += nbytes(t);
  return delegate(OpType::ALLGATHER_COALESCED, inputs, opts.timeout, !opts.asyncOp, {core::kAllGatherCoalesced, 0, 0, b, 0},
                  [this, out, in, o]() mutable { return gloo_->allgather_coalesced(out, in, o); });
}

c10::intrusive_ptr<c10d::Work> Backend::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                               std::vector<at::Tensor>& inputs, const c10d::GatherOptions& opts) {
  auto out = outputs;
  auto in = inputs;
  auto o = opts;
  const int64_t b = inputs.empty() ? 0 : nbytes(inputs[0]);
  return delegate(OpType::GATHER, inputs, opts.timeout, !opts.asyncOp, {core::kGather, 0, 0, b, static_cast<int32_t>(opts.rootRank)},
                  [this, out, in, o]() mutable { return gloo_->gather(out, in, o); });
}

c10::intrusive_ptr<c10d::Work> Backend::scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ScatterOptions& opts) {
  auto out = outputs;
  auto in = inputs;
  auto o = opts;
  const int64_t b = outputs.empty() ? 0 : nbytes(outputs[0]);
  return delegate(OpType::SCATTER, outputs, opts.timeout, !opts.asyncOp,
                  {core::kScatter, 0, 0, b, static_cast<int32_t>(opts.rootRank)},
                  [this, out, in, o]() mutable { return gloo_->scatter(out, in, o); });
}

c10::intrusive_ptr<c10d::Work> Backend::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                      std::vector<int64_t>& output_splits,
                                                      std::vector<int64_t>& input_splits,
                                                      const c10d::AllToAllOptions& opts) {
  auto out = output, in = input;
  auto os = output_splits, is = input_splits;
  auto o = opts;
  // Sizes may differ between ranks (uneven splits): the check agrees on the collective only.
  return delegate(OpType::ALLTOALL_BASE, {output}, opts.timeout, !opts.asyncOp, {core::kAllToAll, 0, 0, 0, 0},
                  [this, out, in, os, is, o]() mutable { return gloo_->alltoall_base(out, in, os, is, o); });
}

c10::intrusive_ptr<c10d::Work> Backend::alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                                 const c10d::AllToAllOptions& opts) {
  auto out = outputs, in = inputs;
  auto o = opts;
  return delegate(OpType::ALLTOALL, outputs, opts.timeout, !opts.asyncOp, {core::kAllToAll, 0, 0, 0, 0},
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

at::Tensor Backend::buffer(int64_t numel, at::ScalarType dtype) {
  TORCH_CHECK(numel >= 0, "torchstrategies buffer: numel must be >= 0, got ", numel);
  auto keep = std::make_shared<std::shared_ptr<core::shm::Segment>>();
  char* p = nullptr;
  const size_t bytes = static_cast<size_t>(numel) * c10::elementSize(dtype);
  auto w = submit(OpType::UNKNOWN, {}, std::chrono::milliseconds(-1), true,
                  [this, keep, &p, bytes](double t) { p = transport_->alloc_buffer(bytes, t, keep.get()); });
  w->wait();
  if (p == nullptr) return at::zeros({numel}, at::TensorOptions().dtype(dtype));
  auto holder = new std::shared_ptr<core::shm::Segment>(*keep);
  at::Tensor t = at::from_blob(
      p, {numel}, [holder](void*) { delete holder; }, at::TensorOptions().dtype(dtype).device(at::kCPU));
  t.zero_();
  return t;
}

}  // namespace torchstrategies
