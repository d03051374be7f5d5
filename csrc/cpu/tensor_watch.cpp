// _C.TensorWatch: tells MirroredStrategy's replica scheduler, without running Python code, whether the
// parameters and buffers of its modules and optimizers are still the very tensors it saw last time.
//
// Every strategy.run must know the replicated tensors (distribute/replicated.py), whatever user code or
// torch did to the modules since the last run (assignment, del, deepcopy, .to(), parametrize, direct
// writes to module._parameters / _buffers / _modules). Walking the module tree in Python on every step
// costs tens of microseconds per step for a small model; this walk reads the same dicts in C and compares
// object identities with the previous walk. The Python walk then runs only when something changed.
//
// The walk is the one of MirroredExtended._refresh_slots: for each root, modules in pre-order (children
// pushed reversed on a stack, each module once per root), its _parameters then its _buffers values, read
// from the instance __dict__ (no descriptor, no Python code runs); then each optimizer's param_groups'
// "params" lists. Roots and optimizers come as weak references; a dead one, or a module or optimizer
// whose __dict__ lacks those entries or holds something else there, counts as a change (the Python walk
// decides). The watch holds references to the tensors it saw (so an address cannot be reused by
// another tensor while it compares), never to modules; clear() drops them.
#include <pybind11/pybind11.h>

#include <algorithm>
#include <unordered_set>
#include <vector>

namespace py = pybind11;

namespace torchstrategies {
namespace {

class TensorWatch {
 public:
  TensorWatch() = default;
  TensorWatch(const TensorWatch&) = delete;
  TensorWatch& operator=(const TensorWatch&) = delete;
  ~TensorWatch() { release(seen_); }

  // True when the tensors reachable from the modules behind the weak references `root_refs`, then the
  // parameters of the optimizers behind `optimizer_refs` (their param_groups' "params" lists), differ from
  // the previous call's (or on the first call, after clear(), or when a referent died); the new sequence
  // is kept.
  bool changed(const py::list& root_refs, const py::list& optimizer_refs) {
    Walk w{seen_};
    static PyObject* k_params = PyUnicode_InternFromString("_parameters");
    static PyObject* k_buffers = PyUnicode_InternFromString("_buffers");
    static PyObject* k_modules = PyUnicode_InternFromString("_modules");
    static PyObject* k_groups = PyUnicode_InternFromString("param_groups");
    static PyObject* k_group_params = PyUnicode_InternFromString("params");
    std::vector<PyObject*> stack;
    std::unordered_set<PyObject*> visited;
    for (py::handle ref : root_refs) {
      PyObject* root = referent(ref.ptr());
      if (root == nullptr) return w.fail(seen_);
      visited.clear();
      stack.assign(1, root);
      while (!stack.empty()) {
        PyObject* m = stack.back();
        stack.pop_back();
        if (!visited.insert(m).second) continue;
        PyObject* dict = PyObject_GenericGetDict(m, nullptr);  // new reference
        if (dict == nullptr) {
          PyErr_Clear();
          return w.fail(seen_);
        }
        PyObject* params = PyDict_GetItemWithError(dict, k_params);  // borrowed
        PyObject* buffers = params ? PyDict_GetItemWithError(dict, k_buffers) : nullptr;
        PyObject* children = buffers ? PyDict_GetItemWithError(dict, k_modules) : nullptr;
        bool ok = children && PyDict_CheckExact(params) && PyDict_CheckExact(buffers) &&
                  PyDict_CheckExact(children);
        if (ok) {
          w.values(params);
          w.mark();
          w.values(buffers);
          w.mark();
          // Children reversed on the stack: popped in insertion order (pre-order). They stay alive while
          // their parent's dict holds them; no Python code runs during the walk.
          size_t first = stack.size();
          Py_ssize_t pos = 0;
          PyObject *key, *value;
          while (PyDict_Next(children, &pos, &key, &value)) {
            if (value != Py_None) stack.push_back(value);
          }
          std::reverse(stack.begin() + static_cast<std::ptrdiff_t>(first), stack.end());
        }
        Py_DECREF(dict);
        if (!ok) {
          PyErr_Clear();
          return w.fail(seen_);
        }
      }
    }
    for (py::handle ref : optimizer_refs) {
      PyObject* opt = referent(ref.ptr());
      if (opt == nullptr) return w.fail(seen_);
      PyObject* dict = PyObject_GenericGetDict(opt, nullptr);  // new reference
      if (dict == nullptr) {
        PyErr_Clear();
        return w.fail(seen_);
      }
      PyObject* groups = PyDict_GetItemWithError(dict, k_groups);  // borrowed
      bool ok = groups && PyList_CheckExact(groups);
      for (Py_ssize_t g = 0; ok && g < PyList_GET_SIZE(groups); ++g) {
        PyObject* group = PyList_GET_ITEM(groups, g);
        PyObject* list = PyDict_CheckExact(group) ? PyDict_GetItemWithError(group, k_group_params) : nullptr;
        ok = list && PyList_CheckExact(list);
        if (!ok) break;
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(list); ++i) w.add(PyList_GET_ITEM(list, i));
        w.mark();
      }
      Py_DECREF(dict);
      if (!ok) {
        PyErr_Clear();
        return w.fail(seen_);
      }
    }
    return w.finish(seen_);
  }

  void clear() {
    std::vector<PyObject*> old;
    old.swap(seen_);
    release(old);
  }

  size_t size() const { return seen_.size(); }

 private:
  // Compares the walk with `last` as it goes; copies only from the first difference on.
  struct Walk {
    const std::vector<PyObject*>& last;
    size_t pos = 0;
    bool differs = false;
    std::vector<PyObject*> fresh;

    void add(PyObject* o) {
      if (!differs) {
        if (pos < last.size() && last[pos] == o) {
          ++pos;
          return;
        }
        differs = true;
        fresh.assign(last.begin(), last.begin() + static_cast<std::ptrdiff_t>(pos));
      }
      fresh.push_back(o);
    }
    void mark() { add(nullptr); }
    void values(PyObject* dict) {
      Py_ssize_t pos_ = 0;
      PyObject *key, *value;
      while (PyDict_Next(dict, &pos_, &key, &value)) add(value);
    }
    bool finish(std::vector<PyObject*>& keep) {
      if (!differs && pos == last.size()) return false;
      if (!differs) fresh.assign(last.begin(), last.begin() + static_cast<std::ptrdiff_t>(pos));
      for (PyObject* o : fresh) Py_XINCREF(o);
      std::vector<PyObject*> old;
      old.swap(keep);
      keep = std::move(fresh);
      release(old);
      return true;
    }
    bool fail(std::vector<PyObject*>& keep) {
      std::vector<PyObject*> old;
      old.swap(keep);  // nothing kept: the next call reports a change too
      release(old);
      return true;
    }
  };

  // The live object behind weak reference `ref` (borrowed), or nullptr when it died or `ref` is not one.
  static PyObject* referent(PyObject* ref) {
    if (!PyWeakref_Check(ref)) return nullptr;
#if PY_VERSION_HEX >= 0x030D0000
    PyObject* obj = nullptr;
    if (PyWeakref_GetRef(ref, &obj) != 1) {
      PyErr_Clear();
      return nullptr;
    }
    Py_DECREF(obj);  // still alive: the caller's weak reference list's owner keeps it (as borrowed below)
    return obj;
#else
    PyObject* obj = PyWeakref_GetObject(ref);  // borrowed; Py_None once dead
    return obj == Py_None ? nullptr : obj;
#endif
  }

  static void release(std::vector<PyObject*>& objs) {
    for (PyObject* o : objs) Py_XDECREF(o);  // may run finalizers: the vector is already detached
    objs.clear();
  }

  std::vector<PyObject*> seen_;
};

}  // namespace

void init_watch_bindings(py::module_& m) {
  py::class_<TensorWatch>(m, "TensorWatch",
                          "Whether the tensors of some modules and parameter lists changed since the last "
                          "call (see csrc/cpu/tensor_watch.cpp).")
      .def(py::init<>())
      .def("changed", &TensorWatch::changed, py::arg("root_refs"), py::arg("optimizer_refs"),
           "True when the parameters/buffers reachable from the modules behind the weak references "
           "`root_refs`, then the parameters of the optimizers behind `optimizer_refs`, are not the very "
           "objects of the previous call (always True on the first call, after clear() and once a "
           "referent died).")
      .def("clear", &TensorWatch::clear, "Forgets (and releases) the tensors seen.")
      .def("__len__", &TensorWatch::size);
}

}  // namespace torchstrategies
