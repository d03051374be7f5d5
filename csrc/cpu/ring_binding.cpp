// pybind11 glue for the TCP ring all-reduce (csrc/core/ring.h): tensors in, raw pointers and a core::DType
// down to the torch-free protocol; core errors up as torchstrategies._C.RingError with `kind` and `peer`.
#include <torch/extension.h>

#include <memory>
#include <string>

#include "checks.h"
#include "core/ring.h"

namespace py = pybind11;

namespace torchstrategies {
namespace {

using core::ring::Comm;
using core::ring::Header;
using core::ring::RingError;

PyObject* g_ring_error = nullptr;

// The kernels' one dtype table (checks.h).
core::DType to_core(at::ScalarType t) {
  const std::optional<core::DType> d = kernel_dtype(t);
  TORCH_CHECK(d.has_value(), "ring all_reduce: unsupported dtype ", t,
              " (supported: float32, float64, float16, bfloat16, int32, int64)");
  return *d;
}

const char* dtype_name(int d) {
  static const char* names[] = {"float32", "float64", "float16", "bfloat16", "int32", "int64"};
  return d >= 0 && d < 6 ? names[d] : "?";
}

py::dict header_dict(const Header& h) {
  py::dict d;
  d["rank"] = h.rank;
  d["seq"] = h.seq;
  d["op"] = h.op;
  d["dtype"] = dtype_name(h.dtype);
  d["count"] = h.count;
  d["small_bytes"] = h.small_bytes;
  d["chunk_bytes"] = h.chunk_bytes;
  return d;
}

template <typename F>
void guarded(F&& f) {
  try {
    py::gil_scoped_release nogil;
    f();
  } catch (const RingError& e) {
    py::object exc = py::reinterpret_borrow<py::object>(g_ring_error)(py::str(e.what()));
    exc.attr("kind") = e.kind == RingError::kTimeout    ? "timeout"
                       : e.kind == RingError::kPeerDead ? "unavailable"
                       : e.kind == RingError::kMismatch ? "mismatch"
                                                        : "broken";
    exc.attr("peer") = e.peer;
    if (e.kind == RingError::kMismatch) {
      exc.attr("mine") = header_dict(e.mine);
      exc.attr("theirs") = header_dict(e.theirs);
    }
    PyErr_SetObject(g_ring_error, exc.ptr());
    throw py::error_already_set();
  }
}

class PyRing {
 public:
  PyRing(int rank, int world, uint64_t group, int64_t socket_bytes, bool nodelay) {
    core::ring::Options o;
    o.socket_bytes = socket_bytes;
    o.nodelay = nodelay;
    comm_ = std::make_unique<Comm>(rank, world, group, o);
  }
  int listen(const std::string& addr) { return comm_->listen(addr); }
  void establish(const std::string& host, int port, uint64_t right_nonce, uint64_t my_nonce, double timeout) {
    guarded([&] { comm_->establish(host, port, right_nonce, my_nonce, timeout); });
  }
  void all_reduce_(at::Tensor& t, int op, int64_t small_bytes, int64_t chunk_bytes, double timeout) {
    TORCH_CHECK(t.device().is_cpu(), "ring all_reduce: expected a CPU tensor, got one on ", t.device());
    TORCH_CHECK(t.is_contiguous(), "ring all_reduce: expected a contiguous tensor");
    const core::DType d = to_core(t.scalar_type());
    TORCH_CHECK(op != core::ring::kMean || t.is_floating_point(), "ring all_reduce: MEAN needs a floating dtype");
    void* p = t.data_ptr();
    const int64_t n = t.numel();
    guarded([&] { comm_->all_reduce(p, n, d, op, small_bytes, chunk_bytes, timeout); });
  }
  void close() { comm_->close(); }
  bool broken() const { return comm_->broken(); }

 private:
  std::unique_ptr<Comm> comm_;
};

}  // namespace

void init_ring_bindings(py::module_& m) {
  static py::exception<std::runtime_error> ring_error(m, "RingError", PyExc_RuntimeError);
  g_ring_error = ring_error.ptr();
  py::dict codes;
  codes["SUM"] = static_cast<int>(core::ring::kSum);
  codes["MEAN"] = static_cast<int>(core::ring::kMean);
  codes["MIN"] = static_cast<int>(core::ring::kMin);
  codes["MAX"] = static_cast<int>(core::ring::kMax);
  codes["PRODUCT"] = static_cast<int>(core::ring::kProduct);
  m.attr("RING_OP_CODES") = codes;
  py::class_<PyRing>(m, "RingComm")
      .def(py::init<int, int, uint64_t, int64_t, bool>(), py::arg("rank"), py::arg("world"), py::arg("group"),
           py::arg("socket_bytes"), py::arg("nodelay"))
      .def("listen", &PyRing::listen, py::arg("addr"))
      .def("establish", &PyRing::establish, py::arg("host"), py::arg("port"), py::arg("right_nonce"),
           py::arg("my_nonce"), py::arg("timeout"))
      .def("all_reduce_", &PyRing::all_reduce_, py::arg("tensor"), py::arg("op"), py::arg("small_bytes"),
           py::arg("chunk_bytes"), py::arg("timeout"))
      .def("close", &PyRing::close)
      .def_property_readonly("broken", &PyRing::broken);
}

}  // namespace torchstrategies
