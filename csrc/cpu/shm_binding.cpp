// pybind11 glue for the shared-memory communicator (csrc/core/shm.h) used directly from Python (the
// benchmark's baseline row and the segment clean-up tests; the package itself reaches SHM through the
// torch.distributed backend, csrc/cpu/backend*.cpp): tensors in, raw pointers and an OpReducer down.
#include <torch/extension.h>

#include <algorithm>
#include <cstring>
#include <vector>
#include <memory>

#include "checks.h"
#include "core/reduce_kernels.h"
#include "core/shm.h"

namespace py = pybind11;

namespace torchstrategies {
namespace {

using core::shm::Comm;
using core::shm::CommError;
using core::shm::Reducer;

using core::shm::OpReducer;

// A collective's reducer for a tensor dtype and a core::Op code (a clear error for what we do not take).
std::unique_ptr<Reducer> make_reducer(at::ScalarType dt, int op, int world) {
  TORCH_CHECK(op >= core::kSum && op < core::kNumOps, "shm: bad reduce op code ", op);
  const std::optional<core::DType> d = kernel_dtype(dt);
  TORCH_CHECK(d.has_value(), "shm all_reduce: unsupported dtype ", dt,
              " (supported: float32, float64, float16, bfloat16, int32, int64)");
  TORCH_CHECK(op != core::kMean || at::isFloatingType(dt), "shm all_reduce: MEAN is not defined for ", dt,
              " tensors");
  return std::make_unique<OpReducer>(op, *d, world);
}

void check_tensor(const char* what, const at::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu(), what, ": shared-memory collectives need CPU tensors, got one on ",
              t.device());
  TORCH_CHECK(t.is_contiguous(), what, ": expected a contiguous tensor, got strides ", t.strides());
}

// Converts core errors into the Python exception types registered below.
PyObject* g_deadline_error = nullptr;
PyObject* g_mismatch_error = nullptr;

template <typename F>
void guarded(F&& f) {
  try {
    py::gil_scoped_release nogil;
    f();
  } catch (const CommError& e) {
    PyObject* type = e.kind == CommError::kMismatch ? g_mismatch_error
                     : e.kind == CommError::kBroken ? PyExc_RuntimeError
                                                    : g_deadline_error;
    py::list missing;
    for (int m : e.missing) missing.append(m);
    py::object exc = py::reinterpret_borrow<py::object>(type)(py::str(e.what()));
    exc.attr("missing_ranks") = missing;
    // "timeout" (a peer is late), "unavailable" (a peer is gone), "mismatch" or "broken"; for a group
    // another rank gave up on, the kind of that rank's failure.
    const CommError::Kind k = e.kind == CommError::kAborted ? e.cause : e.kind;
    exc.attr("kind") = k == CommError::kTimeout    ? "timeout"
                       : k == CommError::kMismatch ? "mismatch"
                       : k == CommError::kBroken   ? "broken"
                                                   : "unavailable";
    PyErr_SetObject(type, exc.ptr());
    throw py::error_already_set();
  }
}

class PyComm {
 public:
  PyComm(const std::string& name, int rank, int world, size_t slot_bytes, bool create)
      : comm_(std::make_shared<Comm>(name, rank, world, slot_bytes, create)) {}

  void attach(double timeout) { guarded([&] { comm_->attach(timeout); }); }
  void expect_pids(const std::vector<int>& pids) { comm_->expect_pids(pids); }
  void abort(bool timed_out) { comm_->abort(timed_out ? CommError::kTimeout : CommError::kPeerDead); }
  void barrier(double timeout) { guarded([&] { comm_->barrier(timeout); }); }

  void all_reduce_(at::Tensor& t, int op, double timeout) {
    check_tensor("all_reduce", t);
    const Reducer& r = reducer(t.scalar_type(), op);
    char* p = static_cast<char*>(t.data_ptr());
    const int64_t n = t.numel();
    guarded([&] { comm_->all_reduce(p, n, r, timeout); });
  }

  // Several tensors of one dtype reduced in place as one concatenated buffer (no packing).
  void all_reduce_many_(std::vector<at::Tensor>& ts, int op, double timeout) {
    TORCH_CHECK(!ts.empty(), "all_reduce_many_: expected at least one tensor");
    const at::ScalarType dt = ts[0].scalar_type();
    std::vector<core::shm::Piece> pieces;
    pieces.reserve(ts.size());
    for (size_t i = 0; i < ts.size(); ++i) {
      check_tensor("all_reduce_many_", ts[i]);
      TORCH_CHECK(ts[i].scalar_type() == dt, "all_reduce_many_: every tensor must have dtype ", dt,
                  ", tensors[", i, "] has ", ts[i].scalar_type());
      pieces.push_back({static_cast<char*>(ts[i].data_ptr()), ts[i].numel()});
    }
    const Reducer& r = reducer(dt, op);
    guarded([&] { comm_->all_reduce_many(pieces, r, timeout); });
  }

  void broadcast_(at::Tensor& t, int root, double timeout) {
    check_tensor("broadcast", t);
    char* p = static_cast<char*>(t.data_ptr());
    const size_t nb = t.numel() * t.element_size();
    guarded([&] { comm_->broadcast(p, nb, root, timeout); });
  }

  void all_gather(const at::Tensor& in, at::Tensor& out, double timeout) {
    check_tensor("all_gather", in);
    check_tensor("all_gather", out);
    const size_t nb = in.numel() * in.element_size();
    TORCH_CHECK(out.scalar_type() == in.scalar_type() &&
                    static_cast<size_t>(out.numel() * out.element_size()) == nb * comm_->world(),
                "all_gather: output must hold world * input elements of the input's dtype");
    const char* pi = static_cast<const char*>(in.data_ptr());
    char* po = static_cast<char*>(out.data_ptr());
    guarded([&] { comm_->all_gather(pi, nb, po, timeout); });
  }

  at::Tensor alloc_buffer(int64_t numel, const at::Tensor& like, double timeout) {
    TORCH_CHECK(numel >= 0, "alloc_buffer: numel must be >= 0, got ", numel);
    const size_t nb = static_cast<size_t>(numel) * like.element_size();
    char* p = nullptr;
    std::shared_ptr<core::shm::Segment> keep;
    guarded([&] { p = comm_->alloc_buffer(nb, timeout, &keep); });
    auto holder = new std::shared_ptr<core::shm::Segment>(std::move(keep));
    return torch::from_blob(
        p, {numel}, [holder](void*) { delete holder; },
        at::TensorOptions().dtype(like.scalar_type()).device(at::kCPU));
  }

  bool in_buffer(const at::Tensor& t) const {
    if (!t.device().is_cpu() || !t.is_contiguous()) return false;
    return comm_->in_buffer(static_cast<const char*>(t.data_ptr()), t.numel() * t.element_size());
  }

  int rank() const { return comm_->rank(); }
  int world() const { return comm_->world(); }
  bool broken() const { return comm_->broken(); }
  std::string name() const { return comm_->name(); }
  size_t slot_bytes() const { return comm_->slot_bytes(); }
  size_t get_one_shot() const { return comm_->one_shot_bytes; }
  void set_one_shot(size_t v) { comm_->one_shot_bytes = v; }

 private:
  // Reducers are immutable once built: one per (dtype, op), made on first use.
  const Reducer& reducer(at::ScalarType dt, int op) {
    const int d = static_cast<int>(dt);
    if (op >= core::kSum && op < core::kNumOps && d >= 0 && d < kDtypes) {
      auto& slot = reducers_[d][op];
      if (!slot) slot = make_reducer(dt, op, comm_->world());
      return *slot;
    }
    scratch_ = make_reducer(dt, op, comm_->world());  // raises the error for a bad op / dtype
    return *scratch_;
  }
  static constexpr int kDtypes = 32;
  std::shared_ptr<Comm> comm_;
  std::unique_ptr<Reducer> reducers_[kDtypes][core::kNumOps];
  std::unique_ptr<Reducer> scratch_;
};

// Packing for many tensors in one call (Python per-tensor overhead dominated the packed all-reduce).
void pack_into(const std::vector<at::Tensor>& tensors, at::Tensor& flat) {
  check_tensor("pack_into", flat);
  int64_t total = 0;
  for (const auto& t : tensors) {
    TORCH_CHECK(t.scalar_type() == flat.scalar_type() && t.device().is_cpu(),
                "pack_into: every tensor must be a CPU tensor of dtype ", flat.scalar_type(), ", got ",
                t.scalar_type(), " on ", t.device());
    total += t.numel();
  }
  TORCH_CHECK(total <= flat.numel(), "pack_into: ", total, " elements do not fit a pack of ", flat.numel());
  py::gil_scoped_release nogil;
  char* dst = static_cast<char*>(flat.data_ptr());
  int64_t off = 0;
  for (const auto& t : tensors) {
    const int64_t n = t.numel();
    if (n == 0) continue;
    if (t.is_contiguous()) {
      std::memcpy(dst + off * t.element_size(), t.data_ptr(), n * t.element_size());
    } else {
      flat.narrow(0, off, n).view(t.sizes()).copy_(t);
    }
    off += n;
  }
}

void unpack_from(const at::Tensor& flat, std::vector<at::Tensor>& tensors) {
  check_tensor("unpack_from", flat);
  int64_t total = 0;
  for (const auto& t : tensors) {
    TORCH_CHECK(t.scalar_type() == flat.scalar_type() && t.device().is_cpu(),
                "unpack_from: every tensor must be a CPU tensor of dtype ", flat.scalar_type());
    total += t.numel();
  }
  TORCH_CHECK(total <= flat.numel(), "unpack_from: ", total, " elements exceed the pack's ", flat.numel());
  py::gil_scoped_release nogil;
  const char* src = static_cast<const char*>(flat.data_ptr());
  int64_t off = 0;
  for (auto& t : tensors) {
    const int64_t n = t.numel();
    if (n == 0) continue;
    if (t.is_contiguous()) {
      std::memcpy(t.data_ptr(), src + off * t.element_size(), n * t.element_size());
    } else {
      t.copy_(flat.narrow(0, off, n).view(t.sizes()));
    }
    off += n;
  }
}

}  // namespace

void init_shm_bindings(py::module_& m) {
  m.def("pack_into", &pack_into, py::arg("tensors"), py::arg("flat"),
        "Copies CPU tensors of one dtype, in order, into the 1-D tensor `flat`.");
  m.def("unpack_from", &unpack_from, py::arg("flat"), py::arg("tensors"),
        "Copies consecutive slices of the 1-D tensor `flat` back into the tensors, in order.");
  static py::exception<std::runtime_error> deadline(m, "ShmDeadlineError", PyExc_TimeoutError);
  static py::exception<std::runtime_error> mismatch(m, "ShmMismatchError", PyExc_ValueError);
  g_deadline_error = deadline.ptr();
  // The reduce-op codes every communicator call takes: the one table Python imports.
  py::dict op_codes;
  op_codes["SUM"] = static_cast<int>(core::kSum);
  op_codes["MEAN"] = static_cast<int>(core::kMean);
  op_codes["MIN"] = static_cast<int>(core::kMin);
  op_codes["MAX"] = static_cast<int>(core::kMax);
  op_codes["PRODUCT"] = static_cast<int>(core::kProduct);
  m.attr("REDUCE_OP_CODES") = op_codes;
  // Every dtype a collective may see: torch.dtype -> (code in call descriptors = c10's ScalarType number,
  // the kernels' core::DType code or -1 where our kernels do not take it, is floating point).
  py::dict dtypes;
  auto add_dtype = [&dtypes](at::ScalarType st) {
    const auto k = kernel_dtype(st);
    dtypes[py::cast(st)] = py::make_tuple(static_cast<int>(st), k ? static_cast<int>(*k) : -1,
                                          at::isFloatingType(st));
  };
#define TS_ADD_DTYPE(_, name) add_dtype(at::ScalarType::name);
  AT_FORALL_SCALAR_TYPES_WITH_COMPLEX(TS_ADD_DTYPE)
#undef TS_ADD_DTYPE
  m.attr("DTYPES") = dtypes;
  g_mismatch_error = mismatch.ptr();
  py::class_<PyComm>(m, "ShmComm")
      .def(py::init<const std::string&, int, int, size_t, bool>(), py::arg("name"), py::arg("rank"),
           py::arg("world"), py::arg("slot_bytes"), py::arg("create"))
      .def("attach", &PyComm::attach, py::arg("timeout"))
      .def("expect_pids", &PyComm::expect_pids, py::arg("pids"))
      .def("abort", &PyComm::abort, py::arg("timed_out"))
      .def("barrier", &PyComm::barrier, py::arg("timeout"))
      .def("all_reduce_", &PyComm::all_reduce_, py::arg("tensor"), py::arg("op"), py::arg("timeout"))
      .def("all_reduce_many_", &PyComm::all_reduce_many_, py::arg("tensors"), py::arg("op"), py::arg("timeout"))
      .def("broadcast_", &PyComm::broadcast_, py::arg("tensor"), py::arg("root"), py::arg("timeout"))
      .def("all_gather", &PyComm::all_gather, py::arg("input"), py::arg("output"), py::arg("timeout"))
      .def("alloc_buffer", &PyComm::alloc_buffer, py::arg("numel"), py::arg("like"), py::arg("timeout"))
      .def("in_buffer", &PyComm::in_buffer, py::arg("tensor"))
      .def_property_readonly("rank", &PyComm::rank)
      .def_property_readonly("world", &PyComm::world)
      .def_property_readonly("broken", &PyComm::broken)
      .def_property_readonly("name", &PyComm::name)
      .def_property_readonly("slot_bytes", &PyComm::slot_bytes)
      .def_property("one_shot_bytes", &PyComm::get_one_shot, &PyComm::set_one_shot);
}

}  // namespace torchstrategies
