// pybind11 glue for the "torchstrategies" c10d backend: the factory the Python creator calls (registered with
// torch.distributed.Backend.register_backend in torchstrategies/collectives/backend.py), and extras for
// torchstrategies.collectives (the plan, the timeout, a zero-copy buffer).
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/extension.h>

#include <chrono>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "cpu/backend.h"
#include "cpu/bounded_store.h"

namespace py = pybind11;

namespace torchstrategies {
namespace {

// Python's float seconds <-> c10d's milliseconds: the two conversions at this seam.
std::chrono::milliseconds to_c10d(double seconds) {
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000.0));
}
double to_python(std::chrono::milliseconds t) { return static_cast<double>(t.count()) / 1000.0; }

Backend& ours(c10d::Backend& b) {
  auto* p = dynamic_cast<Backend*>(&b);
  TORCH_CHECK(p != nullptr, "expected a backend of torchstrategies, got '", b.getBackendName(), "'");
  return *p;
}

c10::intrusive_ptr<c10d::Backend> make_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                               double timeout_s, double setup_timeout_s,
                                               std::vector<int64_t> global_ranks, std::string desc, int impl,
                                               std::string host_id, std::string ring_addr, int64_t slot_bytes,
                                               int64_t ring_small_bytes, int64_t ring_chunk_bytes,
                                               int64_t ring_socket_bytes,
                                               std::vector<std::pair<std::string, std::string>> settings) {
  TORCH_CHECK(impl >= 0 && impl <= 3, "torchstrategies backend: bad implementation code ", impl);
  TORCH_CHECK(size >= 1 && rank >= 0 && rank < size, "torchstrategies backend: bad rank ", rank, " of ", size);
  TORCH_CHECK(static_cast<int>(global_ranks.size()) == size, "torchstrategies backend: ", global_ranks.size(),
              " global ranks for a group of ", size);
  core::Config cfg;
  cfg.rank = rank;
  cfg.size = size;
  cfg.global_ranks = std::move(global_ranks);
  cfg.desc = std::move(desc);
  cfg.impl = static_cast<core::Impl>(impl);
  cfg.host_id = std::move(host_id);
  cfg.ring_addr = std::move(ring_addr);
  cfg.slot_bytes = static_cast<size_t>(slot_bytes);
  cfg.ring_small_bytes = ring_small_bytes;
  cfg.ring_chunk_bytes = ring_chunk_bytes;
  cfg.ring_socket_bytes = ring_socket_bytes;
  cfg.settings = std::move(settings);
  std::unique_ptr<core::Transport> t;
  try {
    t = std::make_unique<core::Transport>(std::move(cfg), std::make_shared<BoundedStore>(store), setup_timeout_s);
  } catch (const core::Fault& f) {
    static const char* names[] = {"DeadlineExceededError", "UnavailableError", "ValueError", "ValueError"};
    throw c10::DistBackendError(c10::SourceLocation{__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                                std::string("torchstrategies ") + names[f.kind] + ": " + f.what());
  }
  return c10::make_intrusive<Backend>(rank, size, std::move(t), to_c10d(timeout_s));
}

}  // namespace

void init_backend_bindings(py::module_& m) {
  install_code_names();
  m.def("make_backend", &make_backend, py::call_guard<py::gil_scoped_release>(), py::arg("store"), py::arg("rank"),
        py::arg("size"), py::arg("timeout"), py::arg("setup_timeout"), py::arg("global_ranks"), py::arg("desc"),
        py::arg("implementation"), py::arg("host_id"), py::arg("ring_addr"), py::arg("slot_bytes"),
        py::arg("ring_small_bytes"), py::arg("ring_chunk_bytes"), py::arg("ring_socket_bytes"), py::arg("settings"),
        "Makes the torchstrategies c10d backend of one group (collective over the group's ranks): its set-up\n"
        "waits at most setup_timeout seconds, its calls default to timeout seconds.");
  m.def(
      "backend_set_gloo", [](c10d::Backend& b, c10::intrusive_ptr<c10d::Backend> gloo) { ours(b).set_gloo(gloo); },
      py::arg("backend"), py::arg("gloo"), "Gives the backend the gloo backend it hands other collectives to.");
  m.def(
      "backend_plan", [](c10d::Backend& b) { return py::make_tuple(ours(b).plan_name(), ours(b).num_hosts()); },
      py::arg("backend"), "(plan name, number of hosts) of a torchstrategies backend.");
  m.def(
      "backend_timeout", [](c10d::Backend& b) { return to_python(ours(b).timeout()); }, py::arg("backend"),
      "The timeout, in seconds, of a torchstrategies backend (torch's Python binding does not show it).");
  m.def(
      "backend_buffer",
      [](c10d::Backend& b, int64_t numel, const at::Tensor& like) {
        Backend& ts = ours(b);
        py::gil_scoped_release nogil;
        return ts.buffer(numel, like.scalar_type());
      },
      py::arg("backend"), py::arg("numel"), py::arg("like"),
      "A zeroed 1-D tensor in the group's shared memory where the plan has it (collective).");
  m.def("is_torchstrategies_backend", [](c10d::Backend& b) { return dynamic_cast<Backend*>(&b) != nullptr; },
        py::arg("backend"));
}

}  // namespace torchstrategies
