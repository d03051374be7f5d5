// The "torchstrategies" c10d backend: tensors in, checks in the caller's thread, raw memory to the
// transport on the worker thread (see backend.h).
#include "cpu/backend.h"

#include <ATen/ThreadLocalState.h>
#include <ATen/core/grad_mode.h>
#include <ATen/record_function.h>
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

// The kernels' dtype of `tensors` if every one is a dense tensor of the same dtype our kernels take.
std::optional<core::DType> kernel_dtype_of(const std::vector<at::Tensor>& tensors) {
  for (const auto& t : tensors) {
    if (t.layout() != at::kStrided || t.scalar_type() != tensors[0].scalar_type()) return std::nullopt;
  }
  return tensors.empty() ? std::nullopt : kernel_dtype(tensors[0].scalar_type());
}

// The transport's unit of time (seconds) for a c10d timeout: the one conversion into csrc/core.
double core_seconds(std::chrono::milliseconds t) { return static_cast<double>(t.count()) / 1000.0; }

// The profiler span of a collective: "torchstrategies:<collective>" (static names: the profiler keeps them).
const char* span_name(int32_t kind) {
  switch (kind) {
    case core::kAllReduce: return "torchstrategies:all_reduce";
    case core::kAllGather: return "torchstrategies:all_gather";
    case core::kBroadcast: return "torchstrategies:broadcast";
    case core::kReduceScatter: return "torchstrategies:reduce_scatter";
    case core::kBarrier: return "torchstrategies:barrier";
    case core::kBuffer: return "torchstrategies:buffer";
    case core::kAbort: return "torchstrategies:abort";
    case core::kAllToAll: return "torchstrategies:all_to_all";
    case core::kGather: return "torchstrategies:gather";
    case core::kScatter: return "torchstrategies:scatter";
    case core::kReduce: return "torchstrategies:reduce";
    case core::kAllGatherCoalesced: return "torchstrategies:all_gather_coalesced";
    case core::kAllReduceDelegated: return "torchstrategies:all_reduce";
    case core::kReduceScatterDelegated: return "torchstrategies:reduce_scatter";
    case core::kAllReduceSparse: return "torchstrategies:all_reduce_sparse";
  }
  return "torchstrategies:collective";
}

std::string c10d_op_name(int32_t code) {
  static const char* names[] = {"SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM"};
  return code >= 0 && code < 9 ? names[code] : "#" + std::to_string(code);
}

std::string torch_dtype_name(int32_t code) {
  if (code < 0 || code >= static_cast<int32_t>(at::ScalarType::NumOptions)) return "#" + std::to_string(code);
  switch (static_cast<at::ScalarType>(code)) {  // Python's names
    case at::kByte: return "uint8";
    case at::kChar: return "int8";
    case at::kShort: return "int16";
    case at::kInt: return "int32";
    case at::kLong: return "int64";
    case at::kHalf: return "float16";
    case at::kFloat: return "float32";
    case at::kDouble: return "float64";
    case at::kBFloat16: return "bfloat16";
    case at::kComplexHalf: return "complex32";
    case at::kComplexFloat: return "complex64";
    case at::kComplexDouble: return "complex128";
    case at::kBool: return "bool";
    default: return c10::toString(static_cast<at::ScalarType>(code));
  }
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
    : c10d::Work(rank, type), outputs_(std::move(outputs)) {}

c10::intrusive_ptr<c10::ivalue::Future> Work::getFuture() {
  c10::intrusive_ptr<c10::ivalue::Future> future;
  bool done;
  {
    std::lock_guard<std::mutex> lock(future_mu_);
    if (future_) return future_;
    future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::ofTensors());
    future = future_;
    done = done_;  // made after the call completed: complete() has passed, it is settled here
  }
  if (done) settle(*future);
  return future;
}

void Work::complete(std::exception_ptr error) {
  c10::intrusive_ptr<c10::ivalue::Future> future;
  {
    std::lock_guard<std::mutex> lock(future_mu_);
    done_ = true;
    error_ = error;
    future = future_;  // made before: settled here, once (a later getFuture settles its own)
  }
  if (future) settle(*future);
  finish(error);
}

void Work::settle(c10::ivalue::Future& future) const {
  if (error_) {
    future.setError(error_);
  } else {
    future.markCompleted(c10::IValue(outputs_));
  }
}

core::CallDesc describe_call(core::CallKind kind, const std::vector<at::Tensor>& tensors, int32_t op, int32_t root,
                             bool sizes_agree, const std::vector<at::Tensor>& outputs) {
  core::CallDesc d;
  d.kind = kind;
  d.op = op;
  d.root = root;
  d.parts = static_cast<int32_t>(tensors.size());
  d.dtype = tensors.empty() ? 0 : static_cast<int32_t>(tensors[0].scalar_type());
  uint32_t h = 2166136261u;  // FNV-1a over (shape, dtype) of every tensor, in order, then of every output
  auto mix = [&h](uint64_t v) {
    for (int i = 0; i < 8; ++i, v >>= 8) h = (h ^ static_cast<uint32_t>(v & 0xFF)) * 16777619u;
  };
  auto mix_shape = [&mix](const at::Tensor& t) {
    mix(static_cast<uint64_t>(t.dim()));
    for (const int64_t s : t.sizes()) mix(static_cast<uint64_t>(s));
  };
  for (const auto& t : tensors) {
    if (static_cast<int32_t>(t.scalar_type()) != d.dtype) d.dtype = core::kMixedDtype;
    if (sizes_agree) {
      d.count += t.numel();
      mix_shape(t);
    }
    mix(static_cast<uint64_t>(t.scalar_type()));
  }
  if (sizes_agree && !outputs.empty()) {
    mix(static_cast<uint64_t>(outputs.size()));
    for (const auto& t : outputs) mix_shape(t);
  }
  d.shape = h;
  return d;
}

std::string unsupported_reduction(const char* what, at::ScalarType dtype, int32_t op) {
  const bool floating = at::isFloatingType(dtype);
  const std::string call = std::string("torchstrategies ") + what + ": ";
  const std::string pair = torch_dtype_name(static_cast<int32_t>(dtype)) + " with " + c10d_op_name(op);
  switch (dtype) {  // our kernels' dtypes (checks.h) and gloo's: the dtypes some implementation reduces
    case at::kFloat: case at::kDouble: case at::kHalf: case at::kBFloat16: case at::kInt: case at::kLong:
    case at::kBool: case at::kByte: case at::kChar:
      break;
    default:
      return call + "no implementation reduces " + pair + " (our kernels take float32, float64, float16, bfloat16, "
             "int32 and int64, gloo also bool, int8 and uint8): convert the tensor, e.g. to int32";
  }
  if (op == c10d::ReduceOp::AVG && !floating) {
    return call + "no implementation reduces " + pair + ": AVG needs a floating-point dtype (reduce with SUM "
           "and divide, or convert to a floating-point dtype)";
  }
  if ((op == c10d::ReduceOp::BAND || op == c10d::ReduceOp::BOR || op == c10d::ReduceOp::BXOR) && floating) {
    return call + "no implementation reduces " + pair + ": bitwise ops need an integer or bool dtype";
  }
  return "";
}

void install_code_names() { core::set_code_names(c10d_op_name, torch_dtype_name); }

Backend::Backend(int rank, int size, std::unique_ptr<core::Transport> transport, std::chrono::milliseconds timeout)
    : c10d::Backend(rank, size), transport_(std::move(transport)), timeout_(timeout) {
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
  return c10::make_intrusive<Options>("torchstrategies", timeout());
}

void Backend::setTimeout(std::chrono::milliseconds timeout) {
  std::lock_guard<std::mutex> lock(mu_);
  timeout_ = timeout;
}

std::chrono::milliseconds Backend::timeout() const {
  std::lock_guard<std::mutex> lock(mu_);
  return timeout_;
}

c10::intrusive_ptr<c10d::Work> Backend::submit(OpType type, const core::CallDesc& desc, std::vector<at::Tensor> outputs,
                                               std::chrono::milliseconds timeout, bool sync, Task task) {
  auto work = c10::make_intrusive<Work>(getRank(), type, std::move(outputs));
  Item item{work, span_name(desc.kind), timeout, std::move(task)};
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (item.timeout.count() < 0) item.timeout = timeout_;
    if (!sync || busy_ || !queue_.empty()) {
      // A queued call runs on the worker: it takes the caller's thread-local state (the profiler's callbacks
      // among it) while a profiler is on, so its span shows in the caller's trace.
      if (at::hasCallbacks()) item.state = std::make_shared<at::ThreadLocalState>();
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
  std::optional<at::ThreadLocalStateGuard> state;
  if (item.state) state.emplace(*item.state);
  at::NoGradGuard no_grad;  // the copies back into the caller's tensors are not part of any graph
  std::exception_ptr error;
  {
    const std::vector<at::Tensor>& outputs = item.work->outputs();
    RECORD_FUNCTION(item.span, std::vector<c10::IValue>(outputs.begin(), outputs.end()));
    try {
      item.task(item.timeout, outputs);
    } catch (const core::Fault& f) {
      error = to_error(f);
    } catch (...) {
      error = std::current_exception();
    }
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

c10::intrusive_ptr<c10d::Work> Backend::refuse(OpType type, const core::CallDesc& desc, std::vector<at::Tensor> outputs,
                                               std::chrono::milliseconds timeout, bool sync, std::string why) {
  return submit(type, desc, std::move(outputs), timeout, sync,
                [this, desc, why = std::move(why)](std::chrono::milliseconds t, const auto&) {
                  transport_->check(desc, core_seconds(t));
                  TORCH_CHECK_VALUE(false, why);
                });
}

c10::intrusive_ptr<c10d::Work> Backend::delegate(OpType type, const core::CallDesc& desc, std::vector<at::Tensor> outputs,
                                                 std::chrono::milliseconds timeout, bool sync,
                                                 std::function<c10::intrusive_ptr<c10d::Work>()> gloo_op) {
  return submit(type, desc, std::move(outputs), timeout, sync,
                [this, desc, gloo_op = std::move(gloo_op)](std::chrono::milliseconds t, const auto&) {
                  transport_->check(desc, core_seconds(t));
                  gloo_op()->wait(t + std::chrono::milliseconds(1));  // gloo's own timeout answers first
                });
}

// ---- all-reduce -------------------------------------------------------------------------------------------
c10::intrusive_ptr<c10d::Work> Backend::allreduce(std::vector<at::Tensor>& tensors,
                                                  const c10d::AllreduceOptions& opts) {
  TORCH_CHECK(!tensors.empty(), "torchstrategies allreduce: expected at least one tensor");
  for (const auto& t : tensors) check_cpu("allreduce", t);
  const int op = core_op(opts.reduceOp);
  const auto dtype = kernel_dtype_of(tensors);
  const int32_t c10d_op = static_cast<int32_t>(opts.reduceOp.op_);
  const core::CallDesc desc =
      describe_call(op < 0 || !dtype ? core::kAllReduceDelegated : core::kAllReduce, tensors, c10d_op);
  if (desc.dtype != core::kMixedDtype && tensors[0].layout() == at::kStrided) {
    std::string why = unsupported_reduction("all_reduce", tensors[0].scalar_type(), c10d_op);
    if (!why.empty()) return refuse(OpType::ALLREDUCE, desc, tensors, opts.timeout, !opts.asyncOp, std::move(why));
  }
  if (op < 0 || !dtype) {  // a dtype (bool, int8...), op or layout our kernels do not take: gloo
    auto ts = tensors;
    auto o = opts;
    return delegate(OpType::ALLREDUCE, desc, tensors, opts.timeout, !opts.asyncOp, [this, ts, o]() mutable {
                      if (ts.size() == 1) return gloo_->allreduce(ts, o);
                      c10d::AllreduceCoalescedOptions co;
                      co.reduceOp = o.reduceOp;
                      co.timeout = o.timeout;
                      return gloo_->allreduce_coalesced(ts, co);
                    });
  }
  std::vector<at::Tensor> used;
  for (const auto& t : tensors) used.push_back(work_on(t));
  unalias(used);
  return submit(OpType::ALLREDUCE, desc, tensors, opts.timeout, !opts.asyncOp,
                [this, used = std::move(used), dt = *dtype, op, desc](std::chrono::milliseconds t,
                                                                      const std::vector<at::Tensor>& outputs) {
                  std::vector<core::shm::Piece> pieces;
                  pieces.reserve(used.size());
                  for (const auto& u : used) pieces.push_back({ptr(u), u.numel()});
                  transport_->all_reduce(pieces, dt, op, desc, core_seconds(t));
                  copy_back(outputs, used);
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
  // Every tensor's broadcast carries the whole list's descriptor.
  const core::CallDesc desc = describe_call(core::kBroadcast, tensors, 0, root);
  return submit(OpType::BROADCAST, desc, tensors, opts.timeout, !opts.asyncOp,
                [this, used = std::move(used), root, desc](std::chrono::milliseconds t,
                                                           const std::vector<at::Tensor>& outputs) {
                  for (const auto& u : used) {
                    transport_->broadcast(ptr(u), static_cast<size_t>(nbytes(u)), root, desc, core_seconds(t));
                  }
                  if (getRank() != root) copy_back(outputs, used);
                });
}

c10::intrusive_ptr<c10d::Work> Backend::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                        const c10d::AllgatherOptions& opts) {
  return all_gather_pairs(OpType::_ALLGATHER_BASE, {output}, {input}, opts);
}

// One call for every pair (a coalesced call is one descriptor: the ranks agree on the whole list at once).
c10::intrusive_ptr<c10d::Work> Backend::all_gather_pairs(OpType type, const std::vector<at::Tensor>& outputs,
                                                         const std::vector<at::Tensor>& inputs,
                                                         const c10d::AllgatherOptions& opts) {
  TORCH_CHECK(outputs.size() == inputs.size(), "torchstrategies allgather: ", outputs.size(), " outputs for ",
              inputs.size(), " inputs");
  if (inputs.empty()) return barrier(c10d::BarrierOptions());
  std::vector<at::Tensor> ins, outs;
  for (size_t i = 0; i < inputs.size(); ++i) {
    check_flat_pair("allgather", inputs[i], outputs[i], /*output_is_long=*/true, getSize());
    ins.push_back(work_on(inputs[i]));
    outs.push_back(work_on(outputs[i]));
  }
  const core::CallDesc desc = describe_call(core::kAllGather, inputs, 0, 0, true, outputs);
  return submit(type, desc, outputs, opts.timeout, !opts.asyncOp,
                [this, ins = std::move(ins), outs = std::move(outs), desc](std::chrono::milliseconds t,
                                                                           const std::vector<at::Tensor>& outputs) {
                  for (size_t i = 0; i < ins.size(); ++i) {
                    transport_->all_gather(ptr(ins[i]), ptr(outs[i]), static_cast<size_t>(nbytes(ins[i])), desc,
                                           core_seconds(t));
                  }
                  copy_back(outputs, outs);
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
  for (size_t j = 0; j < outs.size(); ++j) {
    check_cpu("allgather", outs[j]);
    TORCH_CHECK(outs[j].numel() == input.numel() && outs[j].scalar_type() == input.scalar_type(),
                "torchstrategies allgather: every output must have the input's numel and dtype (", input.numel(),
                ", ", input.scalar_type(), "), output ", j, " has ", outs[j].numel(), ", ", outs[j].scalar_type());
  }
  check_cpu("allgather", input);
  const at::Tensor in = work_on(input);
  const at::Tensor flat = at::empty({getSize() * input.numel()}, input.options());
  const core::CallDesc desc = describe_call(core::kAllGather, {input}, 0, 0, true, outs);
  return submit(OpType::ALLGATHER, desc, outs, opts.timeout, !opts.asyncOp,
                [this, in, flat, desc](std::chrono::milliseconds t, const std::vector<at::Tensor>& outs) {
                  transport_->all_gather(ptr(in), ptr(flat), static_cast<size_t>(nbytes(in)), desc, core_seconds(t));
                  const int64_t n = in.numel();
                  for (size_t j = 0; j < outs.size(); ++j) {  // outputs of any layout (copy_ follows strides)
                    outs[j].copy_(flat.narrow(0, static_cast<int64_t>(j) * n, n).view(outs[j].sizes()));
                  }
                });
}

c10::intrusive_ptr<c10d::Work> Backend::allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                        std::vector<at::Tensor>& inputs,
                                                                        const c10d::AllgatherOptions& opts) {
  return all_gather_pairs(OpType::COALESCED, outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> Backend::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                            const c10d::ReduceScatterOptions& opts) {
  return reduce_scatter_pairs(OpType::_REDUCE_SCATTER_BASE, {output}, {input}, opts);
}

// One call for every pair, as all_gather_pairs; a list our kernels do not take goes to gloo pair by pair.
c10::intrusive_ptr<c10d::Work> Backend::reduce_scatter_pairs(OpType type, const std::vector<at::Tensor>& outputs,
                                                             const std::vector<at::Tensor>& inputs,
                                                             const c10d::ReduceScatterOptions& opts) {
  TORCH_CHECK(outputs.size() == inputs.size(), "torchstrategies reduce_scatter: ", outputs.size(), " outputs for ",
              inputs.size(), " inputs");
  if (inputs.empty()) return barrier(c10d::BarrierOptions());
  for (size_t i = 0; i < inputs.size(); ++i) {
    check_flat_pair("reduce_scatter", inputs[i], outputs[i], /*output_is_long=*/false, getSize());
  }
  const int op = core_op(opts.reduceOp);
  const auto dtype = kernel_dtype_of(inputs);
  const int32_t c10d_op = static_cast<int32_t>(opts.reduceOp.op_);
  const core::CallDesc desc = describe_call(op < 0 || !dtype ? core::kReduceScatterDelegated : core::kReduceScatter,
                                            inputs, c10d_op, 0, true, outputs);
  if (desc.dtype != core::kMixedDtype && inputs[0].layout() == at::kStrided) {
    std::string why = unsupported_reduction("reduce_scatter", inputs[0].scalar_type(), c10d_op);
    if (!why.empty()) return refuse(type, desc, outputs, opts.timeout, !opts.asyncOp, std::move(why));
  }
  if (op < 0 || !dtype) {
    auto o = opts;
    return delegate(type, desc, outputs, opts.timeout, !opts.asyncOp, [this, outs = outputs, ins = inputs, o]() mutable {
                      c10::intrusive_ptr<c10d::Work> w;
                      for (size_t i = 0; i < ins.size(); ++i) {
                        if (w) w->wait();
                        w = gloo_->_reduce_scatter_base(outs[i], ins[i], o);
                      }
                      return w;
                    });
  }
  std::vector<at::Tensor> ins, outs;
  for (size_t i = 0; i < inputs.size(); ++i) {
    ins.push_back(work_on(inputs[i]));
    outs.push_back(work_on(outputs[i]));
  }
  return submit(type, desc, outputs, opts.timeout, !opts.asyncOp,
                [this, ins = std::move(ins), outs = std::move(outs), dt = *dtype, op, desc](
                    std::chrono::milliseconds t, const std::vector<at::Tensor>& outputs) {
                  for (size_t i = 0; i < ins.size(); ++i) {
                    transport_->reduce_scatter(ptr(ins[i]), ptr(outs[i]), outs[i].numel(), dt, op, desc,
                                               core_seconds(t));
                  }
                  copy_back(outputs, outs);
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
  return reduce_scatter_pairs(OpType::COALESCED, outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> Backend::barrier(const c10d::BarrierOptions& opts) {
  return submit(OpType::BARRIER, describe_call(core::kBarrier, {}), {}, opts.timeout, !opts.asyncOp,
                [this](std::chrono::milliseconds t, const auto&) { transport_->barrier(core_seconds(t)); });
}

void Backend::abort() {
  core::CallDesc d;
  d.kind = core::kAbort;
  submit(OpType::UNKNOWN, d, {}, std::chrono::milliseconds(-1), true,
         [this](std::chrono::milliseconds, const auto&) { transport_->abort(); })
      ->wait();
}

at::Tensor Backend::buffer(int64_t numel, at::ScalarType dtype) {
  TORCH_CHECK(numel >= 0, "torchstrategies buffer: numel must be >= 0, got ", numel);
  auto keep = std::make_shared<std::shared_ptr<core::shm::Segment>>();
  char* p = nullptr;
  const size_t bytes = static_cast<size_t>(numel) * c10::elementSize(dtype);
  auto w = submit(OpType::UNKNOWN, describe_call(core::kBuffer, {}), {}, std::chrono::milliseconds(-1), true,
                  [this, keep, &p, bytes](std::chrono::milliseconds t, const auto&) {
                    p = transport_->alloc_buffer(bytes, core_seconds(t), keep.get());
                  });
  w->wait();
  if (p == nullptr) return at::zeros({numel}, at::TensorOptions().dtype(dtype));
  auto holder = new std::shared_ptr<core::shm::Segment>(*keep);
  at::Tensor t = at::from_blob(
      p, {numel}, [holder](void*) { delete holder; }, at::TensorOptions().dtype(dtype).device(at::kCPU));
  t.zero_();
  return t;
}

}  // namespace torchstrategies
