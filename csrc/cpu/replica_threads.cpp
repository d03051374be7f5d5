// The in-process replicas' threads (MirroredStrategy, CentralStorageStrategy): the hand-over between the
// thread that schedules the replicas and a replica's worker thread, and the torch thread-local state their
// threads start from. Python's side: torchstrategies/distribute/mirrored_run.py.
//
// _C.Baton: replicas run one at a time, so a hand-over is a ping-pong between two threads: the scheduler
// posts `go` and waits for `back`; the worker posts `back` (it paused in a merge_call or returned) and
// waits for `go`. Each side releases the GIL BEFORE it posts, so the woken thread finds the GIL free and
// takes it without sleeping again, and waits by spinning (kSpin, yielding its CPU every few polls) before it
// sleeps on a condition variable: a replica's part between two merge_calls is often shorter than a sleep
// and wake-up (tens of microseconds on a VM), which Python's Lock pays on every hand-over.
//
// The scheduler's wait (`resume`) has a timeout (merge_call_timeout) and sleeps in slices, taking the GIL
// between them only to run Python's signal handlers, so Ctrl-C interrupts a replica that never pauses.
// A worker's wait (`pause`, `wait`) takes the GIL only when it is posted: an idle daemon worker never
// touches the GIL again, so interpreter shutdown never finds it taking the GIL.
//
// _C.ThreadState: at::ThreadLocalState (grad mode, inference mode, autocast, saved-tensor hooks, torch
// function/dispatch modes, profiler TLS), captured in the thread that calls strategy.run and entered around
// each replica's function on its own thread, as torch's autograd engine does for its worker threads.
#include <torch/extension.h>

#include <ATen/ThreadLocalState.h>

#include "core/cpus.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define TS_CPU_RELAX() _mm_pause()
#else
#define TS_CPU_RELAX() std::this_thread::yield()
#endif

namespace py = pybind11;

namespace torchstrategies {
namespace {

using Clock = std::chrono::steady_clock;

// How long a waiting thread spins before it sleeps: only where the other thread can run on another CPU of
// this process (its affinity and cgroup quota: core/cpus.h; a 1-CPU container never spins), decided when
// the extension loads. Measured (bench inproc --threads 1, MLP 64-64-10, 2026-11-27, load about 1.1):
// Mirrored(2)'s overhead was 187 us per replica with 50 us of spin (a replica's part between merges is often
// longer, and the sleeper then pays an idle CPU's wake-up), 72 / 76 / 75 us with 300 / 1000 / 3000 us.
const Clock::duration kSpin =
    core::usable_cpus() > 1 ? std::chrono::microseconds(300) : Clock::duration::zero();
// The scheduler's sleep slice: how often it looks at Python's signals while a replica runs.
constexpr auto kSlice = std::chrono::milliseconds(50);

// A binary semaphore: post() sets it, take() waits until it is set and clears it.
class Signal {
 public:
  void post() {
    set_.store(true);
    if (sleepers_.load() > 0) {
      std::lock_guard<std::mutex> lock(mu_);
      cv_.notify_one();
    }
  }

  // Spins up to kSpin, then sleeps until `deadline`; true if taken. Call without the GIL.
  bool take(Clock::time_point deadline) {
    if (spin()) return true;
    std::unique_lock<std::mutex> lock(mu_);
    sleepers_.fetch_add(1);
    const bool got = cv_.wait_until(lock, deadline, [&] { return set_.load(); });
    sleepers_.fetch_sub(1);
    return got && set_.exchange(false);
  }

 private:
  bool spin() {
    const auto until = Clock::now() + kSpin;
    for (unsigned i = 0;; ++i) {
      if (set_.load(std::memory_order_acquire) && set_.exchange(false)) return true;
      if ((i & 15) == 15) {
        if (Clock::now() >= until) return false;
        std::this_thread::yield();  // (a thread that shares this CPU with us runs: the other one, perhaps)
      }
      TS_CPU_RELAX();
    }
  }

  std::atomic<bool> set_{false};
  std::atomic<int> sleepers_{0};
  std::mutex mu_;
  std::condition_variable cv_;
};

class Baton {
 public:
  // Scheduler: lets the worker run; waits until it pauses or returns. False after `timeout` seconds
  // (None: no limit). Raises what a Python signal handler raised (KeyboardInterrupt) while it waits.
  bool resume(std::optional<double> timeout) {
    const auto start = Clock::now();
    const auto deadline = timeout ? start + std::chrono::duration_cast<Clock::duration>(
                                                std::chrono::duration<double>(std::max(0.0, *timeout)))
                                  : Clock::time_point::max();
    bool first = true;
    while (true) {
      {
        py::gil_scoped_release nogil;
        if (first) go_.post();
        first = false;
        const auto slice_end = Clock::now() + kSlice;
        if (back_.take(std::min(deadline, slice_end))) return true;
      }
      if (Clock::now() >= deadline) return false;
      if (PyErr_CheckSignals() != 0) throw py::error_already_set();
    }
  }

  // Worker: hands back to the scheduler (paused in a merge_call, or returned) and waits for its next turn.
  void pause() {
    py::gil_scoped_release nogil;
    back_.post();
    go_.take(Clock::time_point::max());
  }

  // Worker: waits for its first turn.
  void wait() {
    py::gil_scoped_release nogil;
    go_.take(Clock::time_point::max());
  }

 private:
  Signal go_, back_;
};

// at::ThreadLocalState, captured where it is made; `call(fn)` runs fn with it entered.
struct ThreadState {
  at::ThreadLocalState state;
};

}  // namespace

void init_replica_threads_bindings(py::module_& m) {
  py::class_<Baton>(m, "Baton",
                    "The hand-over between the replica scheduler and one replica's worker thread "
                    "(csrc/cpu/replica_threads.cpp, distribute/mirrored_run.py).")
      .def(py::init<>())
      .def("resume", &Baton::resume, py::arg("timeout"),
           "Scheduler: lets the worker run until it pauses; False after timeout seconds (None: no limit).")
      .def("pause", &Baton::pause, "Worker: hands back to the scheduler and waits for its next turn.")
      .def("wait", &Baton::wait, "Worker: waits for its first turn.")
      .def_property_readonly_static(
          "spin_us", [](const py::object&) { return std::chrono::duration_cast<std::chrono::microseconds>(kSpin).count(); },
          "How long a waiting side spins before it sleeps (0 where this process has one usable CPU).");
  m.def("usable_cpus", py::overload_cast<>(&core::usable_cpus),
        "The CPUs this process can run on at once: its affinity mask capped by its cgroup CPU quota.");
  m.def("usable_cpus_in", py::overload_cast<const std::string&, const std::string&>(&core::usable_cpus),
        py::arg("cgroup_root"), py::arg("proc_self_cgroup"),
        "usable_cpus() with the cgroup files read under cgroup_root for the given /proc/self/cgroup text.");
  py::class_<ThreadState>(m, "ThreadState",
                          "torch's thread-local state (grad mode, autocast, ...) of the thread that made it.")
      .def(py::init<>())
      .def("call", [](const ThreadState& s, const py::function& fn) {
        at::ThreadLocalStateGuard guard(s.state);
        return fn();
      }, py::arg("fn"), "Calls fn() with this state entered in the current thread.");
}

}  // namespace torchstrategies
