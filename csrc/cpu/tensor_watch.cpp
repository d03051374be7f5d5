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
#include <cstdint>
#include <unordered_set>
#include <vector>

namespace py = pybind11;

namespace torchstrategies {
namespace {

// Strong references held for the length of one walk, released (in reverse) when it ends.
class Held {
 public:
  Held() = default;
  Held(const Held&) = delete;
  Held& operator=(const Held&) = delete;
  ~Held() {
    for (auto it = objs_.rbegin(); it != objs_.rend(); ++it) Py_DECREF(*it);
  }
  PyObject* keep(PyObject* o) {  // `o` borrowed: held from now on
    Py_INCREF(o);
    objs_.push_back(o);
    return o;
  }
  PyObject* adopt(PyObject* o) {  // `o` a new reference: released with the rest
    objs_.push_back(o);
    return o;
  }

 private:
  std::vector<PyObject*> objs_;
};

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
  //
  // Reading a module's __dict__ may create it (an allocation), which may start a garbage collection, which
  // may run weakref callbacks and finalizers: Python code, e.g. clear(), or code that edits a module. So
  // the walk owns what it compares with (seen_ is detached first; a clear() meanwhile makes the answer
  // True and keeps nothing), holds a reference to every module and dict it reads from until it ends, and
  // takes a reference to every tensor it records as it records it; tensors it only compares with the
  // previous walk's (which holds references to those) are never dereferenced.
  bool changed(const py::list& root_refs, const py::list& optimizer_refs) {
    std::vector<PyObject*> last;
    last.swap(seen_);
    const uint64_t clears = clears_;
    Walk w{last};
    bool ok = walk(w, root_refs, optimizer_refs);
    bool differs = !ok || w.differs || w.pos != last.size() || clears_ != clears || !seen_.empty();
    if (!differs) {
      seen_.swap(last);  // unchanged: keep the references we had
      return false;
    }
    if (ok && clears_ == clears && seen_.empty()) {
      if (!w.differs) w.copy_prefix();
      seen_.swap(w.fresh);  // references taken as recorded
    }
    release(w.fresh);  // (whatever was not kept)
    release(last);
    return true;
  }

  void clear() {
    ++clears_;
    std::vector<PyObject*> old;
    old.swap(seen_);
    release(old);
  }

  size_t size() const { return seen_.size(); }

 private:
  // Compares the walk with `last` as it goes; from the first difference on, records (with a reference).
  struct Walk {
    const std::vector<PyObject*>& last;
    size_t pos = 0;
    bool differs = false;
    std::vector<PyObject*> fresh;

    void copy_prefix() {
      fresh.assign(last.begin(), last.begin() + static_cast<std::ptrdiff_t>(pos));
      for (PyObject* o : fresh) Py_XINCREF(o);  // alive: `last` holds them
    }
    void add(PyObject* o) {  // `o` borrowed from a dict or list the walk holds
      if (!differs) {
        if (pos < last.size() && last[pos] == o) {
          ++pos;
          return;
        }
        differs = true;
        copy_prefix();
      }
      Py_XINCREF(o);
      fresh.push_back(o);
    }
    void mark() { add(nullptr); }
    void values(PyObject* dict) {  // no allocation: no collection while it iterates
      Py_ssize_t i = 0;
      PyObject *key, *value;
      while (PyDict_Next(dict, &i, &key, &value)) add(value);
    }
  };

  // False when something could not be read (a dead referent, a missing or odd entry): a change.
  static bool walk(Walk& w, const py::list& root_refs, const py::list& optimizer_refs) {
    static PyObject* k_params = PyUnicode_InternFromString("_parameters");
    static PyObject* k_buffers = PyUnicode_InternFromString("_buffers");
    static PyObject* k_modules = PyUnicode_InternFromString("_modules");
    static PyObject* k_groups = PyUnicode_InternFromString("param_groups");
    static PyObject* k_group_params = PyUnicode_InternFromString("params");
    Held held;
    std::vector<PyObject*> stack;
    std::unordered_set<PyObject*> visited;
    for (py::handle ref : root_refs) {
      PyObject* root = referent(ref.ptr());
      if (root == nullptr) return false;
      visited.clear();
      stack.assign(1, held.keep(root));
      while (!stack.empty()) {
        PyObject* m = stack.back();
        stack.pop_back();
        if (!visited.insert(m).second) continue;
        PyObject* dict = instance_dict(m, held);
        if (dict == nullptr) return false;
        PyObject* params = PyDict_GetItemWithError(dict, k_params);  // borrowed
        PyObject* buffers = params ? PyDict_GetItemWithError(dict, k_buffers) : nullptr;
        PyObject* children = buffers ? PyDict_GetItemWithError(dict, k_modules) : nullptr;
        if (!children || !PyDict_CheckExact(params) || !PyDict_CheckExact(buffers) ||
            !PyDict_CheckExact(children)) {
          PyErr_Clear();
          return false;
        }
        held.keep(params);
        held.keep(buffers);
        held.keep(children);
        w.values(params);
        w.mark();
        w.values(buffers);
        w.mark();
        // Children reversed on the stack: popped in insertion order (pre-order), each held.
        size_t first = stack.size();
        Py_ssize_t i = 0;
        PyObject *key, *value;
        while (PyDict_Next(children, &i, &key, &value)) {
          if (value != Py_None) stack.push_back(value);
        }
        for (size_t k = first; k < stack.size(); ++k) held.keep(stack[k]);
        std::reverse(stack.begin() + static_cast<std::ptrdiff_t>(first), stack.end());
      }
    }
    for (py::handle ref : optimizer_refs) {
      PyObject* opt = referent(ref.ptr());
      if (opt == nullptr) return false;
      held.keep(opt);
      PyObject* dict = instance_dict(opt, held);
      if (dict == nullptr) return false;
      PyObject* groups = PyDict_GetItemWithError(dict, k_groups);  // borrowed
      if (!groups || !PyList_CheckExact(groups)) {
        PyErr_Clear();
        return false;
      }
      held.keep(groups);
      for (Py_ssize_t g = 0; g < PyList_GET_SIZE(groups); ++g) {  // no allocation below: no collection
        PyObject* group = PyList_GET_ITEM(groups, g);
        PyObject* list = PyDict_CheckExact(group) ? PyDict_GetItemWithError(group, k_group_params) : nullptr;
        if (!list || !PyList_CheckExact(list)) {
          PyErr_Clear();
          return false;
        }
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(list); ++i) w.add(PyList_GET_ITEM(list, i));
        w.mark();
      }
    }
    return true;
  }

  // `obj`'s instance __dict__ (held until the walk ends), or nullptr when it has none. Creating it (a
  // module's may not exist yet) allocates, which may start a collection: Python code may run here.
  static PyObject* instance_dict(PyObject* obj, Held& held) {
    PyObject* dict = PyObject_GenericGetDict(obj, nullptr);  // new reference
    if (dict == nullptr) {
      PyErr_Clear();
      return nullptr;
    }
    return held.adopt(dict);
  }

  // The live object behind weak reference `ref` (borrowed, alive until the caller runs Python code), or
  // nullptr when it died or `ref` is not one.
  static PyObject* referent(PyObject* ref) {
    if (!PyWeakref_Check(ref)) return nullptr;
#if PY_VERSION_HEX >= 0x030D0000
    PyObject* obj = nullptr;
    if (PyWeakref_GetRef(ref, &obj) != 1) {
      PyErr_Clear();
      return nullptr;
    }
    Py_DECREF(obj);  // the caller takes its own reference before anything can run
    return obj;
#else
    PyObject* obj = PyWeakref_GetObject(ref);  // borrowed; Py_None once dead
    return obj == Py_None ? nullptr : obj;
#endif
  }

  static void release(std::vector<PyObject*>& objs) {
    std::vector<PyObject*> old;
    old.swap(objs);  // detached first: a finalizer that runs below finds the vector empty
    for (PyObject* o : old) Py_XDECREF(o);
  }

  std::vector<PyObject*> seen_;
  uint64_t clears_ = 0;  // clear() calls so far (one during a walk makes its answer True)
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
