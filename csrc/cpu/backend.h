// The torch.distributed backend "torchstrategies": a c10d::Backend whose collectives run on this
// project's transport (csrc/core/transport.*: shared memory inside a host, the C++ TCP ring between hosts).
//
// Every collective returns at once with a Work; one worker thread per backend runs them in the order they
// were called (FIFO, as every rank calls them in the same order), so communication overlaps the caller's
// computation (DDP's gradient buckets during backward). A call made with async_op=False, which the caller
// waits for at once, runs on the caller's thread when nothing is queued before it (same order, no hand-off).
// Work::getFuture() gives the torch Future that DDP's
// communication hooks chain on. Native here: allreduce (+ coalesced), broadcast, allgather (+ base and
// coalesced-into-tensor), reduce_scatter (+ base and coalesced), barrier. Everything else (send / recv,
// all_to_all, gather, scatter, reduce, and reductions of dtypes or ops our kernels do not take) goes to a gloo
// backend made from the same store.
//
// One descriptor check for every collective, native or handed to gloo: the call's descriptor (core/desc.h:
// collective, reduce op, dtype, element count, number and sizes of the tensors, root) is built once from
// its tensors and options (`describe_call`) and agreed on our transport before any data moves, on every plan.
// A difference raises ValueError on every rank and leaves the group usable. Every call is also a profiler span
// "torchstrategies:<collective>" (with its tensors' sizes) on the thread that runs it.
//
// Time: this layer counts in c10d's std::chrono::milliseconds; the transport (csrc/core) in double seconds,
// converted once where a call enters it (core_seconds); Python in float seconds, converted in the binding.
//
// Errors: torch.distributed.DistBackendError (c10::DistBackendError) whose message starts with
// "torchstrategies <Name>: " - DeadlineExceededError (a peer is late), UnavailableError (a peer is gone) or
// ValueError (ranks made different calls, or settings differ) - and names the op, the group and the ranks.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <ATen/ThreadLocalState.h>

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/transport.h"

namespace torchstrategies {

class Work : public c10d::Work {
 public:
  Work(int rank, c10d::OpType type, std::vector<at::Tensor> outputs);
  std::vector<at::Tensor> result() override { return outputs_; }
  const std::vector<at::Tensor>& outputs() const { return outputs_; }
  // The future of this call, made on the first request (most calls are waited for and never asked for one:
  // dist.all_reduce), completed with the outputs or the error whenever it is made, before or after the call.
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  // Called once, by the thread that ran the call: the outputs are ready, or the collective failed with
  // `error`. A future already handed out completes before wait() returns.
  void complete(std::exception_ptr error);

 private:
  void settle(c10::ivalue::Future& future) const;  // completes `future` with the outputs or the error

  std::vector<at::Tensor> outputs_;
  std::mutex future_mu_;  // guards the three below
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  bool done_ = false;
  std::exception_ptr error_;
};

class Backend final : public c10d::Backend {
 public:
  Backend(int rank, int size, std::unique_ptr<core::Transport> transport, std::chrono::milliseconds timeout);
  // The gloo backend the collectives we do not run go to (set by the creator right after construction, once
  // our own set-up succeeded, so a set-up failure is reported as ours).
  void set_gloo(c10::intrusive_ptr<c10d::Backend> gloo) { gloo_ = std::move(gloo); }
  ~Backend() override;

  const std::string getBackendName() const override { return "torchstrategies"; }
  c10::intrusive_ptr<Options> getBackendOptions() override;
  void setTimeout(std::chrono::milliseconds timeout) override;

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;

  // Handed to gloo (collectives after a descriptor check on our transport; point-to-point directly).
  c10::intrusive_ptr<c10d::Work> allreduce_sparse(std::vector<at::Tensor>& tensors,
                                                  const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs, const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_splits,
                                               std::vector<int64_t>& input_splits,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) override;

  // Tears the group down for every rank (c10d's ProcessGroup.abort()): this rank's later calls raise at once,
  // and a peer waiting in, or entering, a collective of the group fails at once instead of after the timeout
  // (shared memory: the segment's abort flag; the ring: the sockets close). It runs in this rank's order of
  // calls, after those queued before it (each ends by its timeout). Calls handed to gloo are not aborted:
  // gloo's connections close when the group is destroyed.
  void abort() override;

  // For torchstrategies.collectives: the plan in words, and a zero-copy shared-memory buffer.
  std::string plan_name() const { return core::plan_name(transport_->plan()); }
  int num_hosts() const { return transport_->num_hosts(); }
  std::chrono::milliseconds timeout() const;
  at::Tensor buffer(int64_t numel, at::ScalarType dtype);

 private:
  // The work of one call, given the call's timeout (it converts it with core_seconds where it calls the
  // transport) and the call's outputs (the Work holds them: the task copies results into them).
  using Task = std::function<void(std::chrono::milliseconds timeout, const std::vector<at::Tensor>& outputs)>;
  struct Item {
    c10::intrusive_ptr<Work> work;  // its outputs are also the span's inputs (their sizes)
    const char* span;               // the profiler span's name
    std::chrono::milliseconds timeout;
    Task task;
    std::shared_ptr<at::ThreadLocalState> state;  // the caller's, for a queued call while a profiler is on
  };
  // Queues `task` (FIFO) for the call `desc` describes; `sync` (the caller waits at once, async_op=False) runs
  // it on the caller's thread when nothing is queued or running. A negative timeout is the group's.
  c10::intrusive_ptr<c10d::Work> submit(c10d::OpType type, const core::CallDesc& desc, std::vector<at::Tensor> outputs,
                                        std::chrono::milliseconds timeout, bool sync, Task task);
  // Runs `gloo_op` (a gloo collective) after the ranks agree on `desc` on our transport, in FIFO order.
  c10::intrusive_ptr<c10d::Work> delegate(c10d::OpType type, const core::CallDesc& desc, std::vector<at::Tensor> outputs,
                                          std::chrono::milliseconds timeout, bool sync,
                                          std::function<c10::intrusive_ptr<c10d::Work>()> gloo_op);
  // A reduction no implementation takes (`why`): the ranks agree on `desc` (so a rank making another call
  // gets the mismatch), then every rank raises ValueError(`why`) without moving any data.
  c10::intrusive_ptr<c10d::Work> refuse(c10d::OpType type, const core::CallDesc& desc, std::vector<at::Tensor> outputs,
                                        std::chrono::milliseconds timeout, bool sync, std::string why);
  // all_gather / reduce_scatter of every (output, input) pair as one call with one descriptor.
  c10::intrusive_ptr<c10d::Work> all_gather_pairs(c10d::OpType type, const std::vector<at::Tensor>& outputs,
                                                  const std::vector<at::Tensor>& inputs,
                                                  const c10d::AllgatherOptions& opts);
  c10::intrusive_ptr<c10d::Work> reduce_scatter_pairs(c10d::OpType type, const std::vector<at::Tensor>& outputs,
                                                      const std::vector<at::Tensor>& inputs,
                                                      const c10d::ReduceScatterOptions& opts);
  void run(Item& item);
  void loop();

  std::unique_ptr<core::Transport> transport_;
  c10::intrusive_ptr<c10d::Backend> gloo_;
  mutable std::mutex mu_;              // guards everything below
  std::chrono::milliseconds timeout_;  // the group's (setTimeout writes it, submit reads it)
  std::condition_variable cv_;
  std::deque<Item> queue_;
  bool stop_ = false;
  bool busy_ = false;  // a task is running (on the worker or inline on a caller's thread)
  std::thread worker_;
};

// The one descriptor of a call over `tensors` (core/desc.h): kind, c10d reduce-op code, torch dtype code, the
// elements of every tensor, their number and a hash of every tensor's shape and dtype, `outputs`' too (the
// tensors a call writes that are not its inputs: all_gather's list against all_gather_into_tensor's one
// tensor). `sizes_agree` false: the ranks' sizes may differ (uneven all_to_all), so only the kind, dtype and
// number of tensors are compared.
core::CallDesc describe_call(core::CallKind kind, const std::vector<at::Tensor>& tensors, int32_t op = 0,
                             int32_t root = 0, bool sizes_agree = true, const std::vector<at::Tensor>& outputs = {});
// Why no implementation (our kernels, gloo) reduces `dtype` with c10d op `op` ("" if one does), e.g. int16
// with any op, AVG of an integer dtype, BAND of a floating-point one; `what` names the collective.
std::string unsupported_reduction(const char* what, at::ScalarType dtype, int32_t op);
// Installs the names of c10d's reduce ops and torch's dtypes for the transport's messages (once, at import).
void install_code_names();

}  // namespace torchstrategies
