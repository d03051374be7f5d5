// _C.FrameCheck: whether a merge_call is the last act of a replica function, read from the Python frames
// between them (MirroredStrategy's scheduler lets such a replica end at once instead of waiting in a
// thread: distribute/_frames.py says when and why).
//
// The walk of distribute/_frames.py's ends_replica_fn, in C: from the frame that called the scheduler's
// merge_call entry point up to the replica function's frame (the one whose code is fn.__code__ and whose
// caller is _Replica.call), at most `max_depth` frames. For each frame, the answer for its code and
// current instruction offset comes from a cache, filled on a miss by `passes_through(code, lasti,
// drops)` (Python: it disassembles the code once): True/False, or for the replica function's frame the
// name of a local whose value must be exactly a torch.Tensor with a grad_fn, not a view (`return
// loss.detach()`).
// The cache holds the code objects of its keys, so an address cannot be reused by another code object
// while it is cached. Each call runs with the GIL held; `passes_through` may run other threads meanwhile,
// so nothing of the cache is held across it.
#include <torch/extension.h>

#include <Python.h>
#include <frameobject.h>

#include <cstdint>
#include <unordered_map>

namespace py = pybind11;

namespace torchstrategies {
namespace {

#if PY_VERSION_HEX >= 0x030B0000
constexpr bool kSupported = true;  // PyFrame_GetLasti / PyFrame_GetLocals (3.11+)
#else
constexpr bool kSupported = false;
#endif

class FrameCheck {
 public:
  FrameCheck(py::object caller_code, py::object passes_through, int max_depth)
      : caller_(std::move(caller_code)), passes_through_(std::move(passes_through)), max_depth_(max_depth) {
    if (!PyCode_Check(caller_.ptr())) throw py::type_error("FrameCheck: caller_code must be a code object");
  }

  // Whether the merge_call made in `frame` (the caller of the scheduler) ends replica function `fn`.
  bool ends(py::handle fn, py::handle frame) {
#if PY_VERSION_HEX >= 0x030B0000
    PyObject* func = fn.ptr();
    if (PyMethod_Check(func)) func = PyMethod_GET_FUNCTION(func);  // a bound method: its function's code
    if (!PyFunction_Check(func)) return false;  // a partial, a compiled or traced callable: no
    PyObject* code = PyFunction_GET_CODE(func);  // borrowed (fn holds it)
    if (!PyFrame_Check(frame.ptr())) return false;
    py::object f = py::reinterpret_borrow<py::object>(frame);
    for (int d = 0; d < max_depth_; ++d) {
      auto* fo = reinterpret_cast<PyFrameObject*>(f.ptr());
      py::object back = py::reinterpret_steal<py::object>(reinterpret_cast<PyObject*>(PyFrame_GetBack(fo)));
      py::object fcode = py::reinterpret_steal<py::object>(reinterpret_cast<PyObject*>(PyFrame_GetCode(fo)));
      const int lasti = PyFrame_GetLasti(fo);
      if (fcode.ptr() == code && back) {
        py::object bcode = py::reinterpret_steal<py::object>(
            reinterpret_cast<PyObject*>(PyFrame_GetCode(reinterpret_cast<PyFrameObject*>(back.ptr()))));
        if (bcode.ptr() == caller_.ptr()) {
          py::object answer = lookup(fcode, lasti, true);
          if (PyUnicode_Check(answer.ptr())) {  // return <local>.detach() etc.: only of a computed tensor
            py::object locals = py::reinterpret_steal<py::object>(PyFrame_GetLocals(fo));
            if (!locals) throw py::error_already_set();
            PyObject* value = PyObject_GetItem(locals.ptr(), answer.ptr());
            if (value == nullptr) {
              if (!PyErr_ExceptionMatches(PyExc_KeyError)) throw py::error_already_set();
              PyErr_Clear();
              return false;
            }
            // Exactly a Tensor computed by autograd (a grad_fn: the loss) with memory of its own (not a
            // view), which a merge never writes; not a parameter, gradient or state tensor, or a view of
            // one, which the optimizer's step updates in place.
            bool computed = false;
            if (THPVariable_CheckExact(value)) {
              const at::Tensor& t = THPVariable_Unpack(value);
              computed = t.grad_fn() != nullptr && !t.is_view();
            }
            Py_DECREF(value);
            return computed;
          }
          return PyObject_IsTrue(answer.ptr()) == 1;
        }
      }
      if (PyObject_IsTrue(lookup(fcode, lasti, false).ptr()) != 1) return false;
      if (!back) return false;
      f = std::move(back);
    }
    return false;
#else
    (void)fn;
    (void)frame;
    return false;
#endif
  }

  size_t cached() const { return cache_.size(); }

 private:
  struct Key {
    PyObject* code;
    int lasti;
    bool drops;
    bool operator==(const Key& o) const { return code == o.code && lasti == o.lasti && drops == o.drops; }
  };
  struct KeyHash {
    size_t operator()(const Key& k) const {
      return std::hash<const void*>()(k.code) ^ (static_cast<size_t>(k.lasti) << 1) ^ (k.drops ? 1u : 0u);
    }
  };
  struct Entry {
    py::object code;  // holds the key's code object
    py::object answer;
  };

  py::object lookup(const py::object& code, int lasti, bool drops) {
    auto it = cache_.find(Key{code.ptr(), lasti, drops});
    if (it != cache_.end()) return it->second.answer;
    py::object answer = passes_through_(code, lasti, drops);  // may run other threads: no iterator held
    if (cache_.size() >= kCacheLimit) cache_.clear();
    cache_[Key{code.ptr(), lasti, drops}] = Entry{code, answer};
    return answer;
  }

  static constexpr size_t kCacheLimit = 4096;
  py::object caller_;
  py::object passes_through_;
  int max_depth_;
  std::unordered_map<Key, Entry, KeyHash> cache_;
};

}  // namespace

void init_frame_check_bindings(py::module_& m) {
  m.attr("FRAME_CHECK_SUPPORTED") = kSupported;
  py::class_<FrameCheck>(m, "FrameCheck",
                         "Whether a merge_call ends a replica function, from the frames between them (see "
                         "csrc/cpu/frame_check.cpp and distribute/_frames.py).")
      .def(py::init<py::object, py::object, int>(), py::arg("caller_code"), py::arg("passes_through"),
           py::arg("max_depth"))
      .def("__call__", &FrameCheck::ends, py::arg("fn"), py::arg("frame"))
      .def_property_readonly("cached", &FrameCheck::cached);
}

}  // namespace torchstrategies
