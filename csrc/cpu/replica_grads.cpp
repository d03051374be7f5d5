// MirroredStrategy's per-replica gradient bookkeeping in C, for the common case (CPU replicas that compute
// with the parameters' own storage): the gradient swap between replicas, a replica's zero_grad, the sum.
// Each does what a few Python lines per parameter do in distribute/replicated.py and strategies/mirrored.py;
// those lines run right after a backward pass, where each costs about a microsecond (cold caches), once or
// twice per replica and parameter per step. Each function checks everything before it writes anything and
// answers "not mine" (False / the entries left) for anything unusual, which the Python code then handles
// as before: tensor subclasses other than Parameter, a gradient of another dtype, shape, layout or device.
//
// _C.swap_gradients(slots, save, load, device): for the ReplicaSlot of each parameter, stores the
// parameter's .grad as replica `save`'s gradient (slot.grads[save]; -1: slot.home_grad, the cross-replica
// gradient) and gives it replica `load`'s (slot.grads[load]; -1: slot.home_grad, then set to None).
//
// _C.clear_gradients(param_groups): `p.grad = None` for every parameter of an optimizer's param_groups.
//
// _C.sum_replica_gradients: the gradient sum for replicas that compute on the CPU, in one C call per
// optimizer step.
//
// Inside strategy.run, optimizer.step() sets each replicated parameter's .grad to the SUM of its replicas'
// gradients (MirroredExtended.aggregate_gradients). The replicas' gradients wait in ReplicaSlot.grads
// (distribute/replicated.py). For CPU replicas that is a handful of small tensors per parameter, and the
// Python loop around torch's adds cost more than the adds (tens of microseconds per step, right after the
// backward pass, where every Python line runs cold). This does that loop in C for the common case:
//
//   for (index, slot, *_) in plan:                     # the parameters every replica computes on, in order
//       p = params[index]
//       if slot.ref() is not p: return None            # the plan is stale: the caller plans anew
//       if p and every slot.grads[k] are CPU float32/float64 strided tensors of one dtype and shape,
//          the gradients contiguous and outside autograd (requires_grad False):
//           total = ((g0 + g1) + g2) + ...             # in the gradients' dtype, element by element,
//                                                      # into g0 itself (see in_place below)
//           p.grad = total; slot.grads = [total, None, ...]   (in place: the list object stays)
//       else: rest.append(entry)                       # the caller sums these as before
//   return rest
//
// The sum is core::reduce_range's sequential order in the tensors' own dtype (float32 in float32, float64
// in float64): bit for bit torch's `g0 + g1`, then `+= g2`, ..., which the Python path and the default
// cross-device op (ReductionToOneDevice, EXPERIMENTAL_ACCUMULATE_N) compute. Every check is made before
// anything is written, so a stale plan changes nothing. The GIL is released around the sums when they are
// large.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <vector>

#include "checks.h"
#include "core/reduce_kernels.h"

namespace py = pybind11;

namespace torchstrategies {
namespace {

constexpr int64_t kGrain = 32 * 1024;                // elements per parallel task (as reduce_cpu.cpp)
constexpr int64_t kReleaseGilElements = 256 * 1024;  // total elements from which the GIL is released

// The object behind weak reference `ref` (a new reference; None when it died), or nullptr on error.
PyObject* deref(PyObject* ref) {
  if (!PyWeakref_Check(ref)) {
    PyErr_Format(PyExc_TypeError, "sum_replica_gradients: slot.ref must be a weakref, got %R", ref);
    return nullptr;
  }
#if PY_VERSION_HEX >= 0x030D0000
  PyObject* obj = nullptr;
  if (PyWeakref_GetRef(ref, &obj) < 0) return nullptr;
  if (obj == nullptr) Py_RETURN_NONE;
  return obj;
#else
  PyObject* obj = PyWeakref_GetObject(ref);  // borrowed
  if (obj == nullptr) return nullptr;
  Py_INCREF(obj);
  return obj;
#endif
}

// One parameter whose gradients are summed here.
struct Item {
  at::Tensor param;
  std::vector<at::Tensor> grads;
  py::object grads_list;  // slot.grads (held: dropping a gradient below may run Python code)
  at::Tensor total;
};

// Whether `p` and its replicas' gradients (`grads`, a list) fit the C sum; fills `item` if so.
bool fits(const at::Tensor& p, PyObject* grads, Item* item) {
  if (!p.is_cpu() || p.layout() != at::kStrided) return false;
  const auto dtype = p.scalar_type();
  if (dtype != at::kFloat && dtype != at::kDouble) return false;
  const Py_ssize_t n = PyList_GET_SIZE(grads);
  if (n < 2) return false;
  item->grads.reserve(static_cast<size_t>(n));
  for (Py_ssize_t k = 0; k < n; ++k) {
    PyObject* g = PyList_GET_ITEM(grads, k);
    if (!THPVariable_Check(g)) return false;  // None, or not a tensor
    const at::Tensor& t = THPVariable_Unpack(g);
    if (!t.defined() || !t.is_cpu() || t.layout() != at::kStrided || t.scalar_type() != dtype ||
        t.requires_grad() || !t.is_contiguous() || t.sizes() != p.sizes()) {
      return false;
    }
    item->grads.push_back(t);
  }
  return true;
}

// Whether replica 0's gradient may take the sum in place: what one device does, whose later backward
// passes accumulate into the existing .grad in place (torch's AccumulateGrad, `grad += new`), unless
// another replica's gradient shares its memory or it is an inference tensor (no version counter to bump).
bool in_place(const Item& item) {
  const at::Tensor& g0 = item.grads[0];
  if (g0.is_inference()) return false;
  for (size_t k = 1; k < item.grads.size(); ++k) {
    if (item.grads[k].is_alias_of(g0)) return false;
  }
  return true;
}

void sum_into(Item& item) {
  const at::Tensor& g0 = item.grads[0];
  const int n = static_cast<int>(item.grads.size());
  const int64_t numel = g0.numel();
  if (numel == 0) return;
  const int64_t elem = g0.element_size();
  std::vector<const char*> ptrs(static_cast<size_t>(n));
  for (int k = 0; k < n; ++k) ptrs[k] = static_cast<const char*>(item.grads[k].const_data_ptr());
  char* out = static_cast<char*>(item.total.mutable_data_ptr());
  const core::DType dt = *kernel_dtype(g0.scalar_type());
  at::parallel_for(0, numel, kGrain, [&](int64_t begin, int64_t end) {
    std::vector<const void*> p(static_cast<size_t>(n));
    for (int k = 0; k < n; ++k) p[k] = ptrs[k] + begin * elem;
    core::reduce_range(core::Order::kSequential, dt, out + begin * elem, p.data(), n, end - begin, false,
                       1.0);
  });
}

// Whether `g` (a gradient or None) may become the .grad of `t` as torch's setter would take it, for the
// cases handled here: None, or a strided tensor (exactly Tensor) of t's dtype, shape and device.
bool settable_grad(const at::Tensor& t, PyObject* g) {
  if (g == Py_None) return true;
  if (!THPVariable_CheckExact(g)) return false;
  const at::Tensor& gt = THPVariable_Unpack(g);
  return gt.defined() && gt.layout() == at::kStrided && t.layout() == at::kStrided &&
         gt.scalar_type() == t.scalar_type() && gt.device() == t.device() && gt.sizes() == t.sizes();
}

PyObject* grad_of(const at::Tensor& t) {  // t.grad as Python sees it (a new reference)
  const at::Tensor& g = t.grad();
  if (!g.defined()) Py_RETURN_NONE;
  return THPVariable_Wrap(g);
}

struct Swap {
  py::object tensor;  // the parameter (held: the weak reference may die while we write)
  py::object slot;
  py::object grads;   // slot.grads
  py::object incoming;
};

bool swap_gradients(py::list slots, int save, int load, at::Device device) {
  static PyObject* const kRef = PyUnicode_InternFromString("ref");
  static PyObject* const kGrads = PyUnicode_InternFromString("grads");
  static PyObject* const kIsParam = PyUnicode_InternFromString("is_param");
  static PyObject* const kHomeGrad = PyUnicode_InternFromString("home_grad");
  std::vector<Swap> todo;
  todo.reserve(static_cast<size_t>(PyList_GET_SIZE(slots.ptr())));
  for (py::handle slot : slots) {
    py::object ref = py::reinterpret_steal<py::object>(PyObject_GetAttr(slot.ptr(), kRef));
    if (!ref) throw py::error_already_set();
    py::object t = py::reinterpret_steal<py::object>(deref(ref.ptr()));
    if (!t) throw py::error_already_set();
    if (t.is_none()) continue;  // the tensor died: nothing to swap (as the Python loop)
    py::object is_param = py::reinterpret_steal<py::object>(PyObject_GetAttr(slot.ptr(), kIsParam));
    if (!is_param) throw py::error_already_set();
    if (is_param.ptr() != Py_True || !THPVariable_CheckExact(t.ptr())) return false;
    const at::Tensor& tensor = THPVariable_Unpack(t.ptr());
    if (tensor.device() != device) return false;
    py::object grads = py::reinterpret_steal<py::object>(PyObject_GetAttr(slot.ptr(), kGrads));
    if (!grads) throw py::error_already_set();
    if (!PyList_CheckExact(grads.ptr())) return false;
    const Py_ssize_t n = PyList_GET_SIZE(grads.ptr());
    if (save >= n || load >= n) return false;
    py::object incoming;
    if (load < 0) {
      incoming = py::reinterpret_steal<py::object>(PyObject_GetAttr(slot.ptr(), kHomeGrad));
      if (!incoming) throw py::error_already_set();
    } else {
      incoming = py::reinterpret_borrow<py::object>(PyList_GET_ITEM(grads.ptr(), load));
    }
    if (!settable_grad(tensor, incoming.ptr())) return false;
    todo.push_back(Swap{std::move(t), py::reinterpret_borrow<py::object>(slot), std::move(grads),
                        std::move(incoming)});
  }
  for (Swap& s : todo) {
    const at::Tensor& tensor = THPVariable_Unpack(s.tensor.ptr());
    PyObject* current = grad_of(tensor);
    if (current == nullptr) throw py::error_already_set();
    if (save < 0) {
      const int rc = PyObject_SetAttr(s.slot.ptr(), kHomeGrad, current);
      Py_DECREF(current);
      if (rc < 0) throw py::error_already_set();
    } else if (PyList_SetItem(s.grads.ptr(), save, current) < 0) {  // steals `current`
      throw py::error_already_set();
    }
    if (s.incoming.is_none()) {
      tensor.mutable_grad().reset();
    } else {
      tensor.mutable_grad() = THPVariable_Unpack(s.incoming.ptr());
    }
    if (load < 0 && PyObject_SetAttr(s.slot.ptr(), kHomeGrad, Py_None) < 0) throw py::error_already_set();
  }
  return true;
}

bool clear_gradients(py::list param_groups) {
  static PyObject* const kParams = PyUnicode_InternFromString("params");
  std::vector<PyObject*> lists;  // borrowed from the groups, which param_groups holds
  lists.reserve(static_cast<size_t>(PyList_GET_SIZE(param_groups.ptr())));
  for (py::handle group : param_groups) {
    if (!PyDict_CheckExact(group.ptr())) return false;
    PyObject* params = PyDict_GetItemWithError(group.ptr(), kParams);  // borrowed
    if (params == nullptr) {
      if (PyErr_Occurred()) throw py::error_already_set();
      return false;
    }
    if (!PyList_CheckExact(params)) return false;
    for (Py_ssize_t k = 0; k < PyList_GET_SIZE(params); ++k) {
      if (!THPVariable_CheckExact(PyList_GET_ITEM(params, k))) return false;
    }
    lists.push_back(params);
  }
  std::vector<at::Tensor> dropped;  // released after the loop (a gradient's end may run Python code)
  for (PyObject* params : lists) {
    for (Py_ssize_t k = 0; k < PyList_GET_SIZE(params); ++k) {
      at::Tensor& grad = THPVariable_Unpack(PyList_GET_ITEM(params, k)).mutable_grad();
      if (grad.defined()) dropped.push_back(std::move(grad));
      grad.reset();
    }
  }
  return true;
}

py::object sum_replica_gradients(py::list params, py::list plan) {
  static PyObject* const kRef = PyUnicode_InternFromString("ref");
  static PyObject* const kGrads = PyUnicode_InternFromString("grads");
  const Py_ssize_t count = PyList_GET_SIZE(params.ptr());
  std::vector<Item> items;
  items.reserve(static_cast<size_t>(PyList_GET_SIZE(plan.ptr())));
  py::list rest;
  int64_t elements = 0;
  for (py::handle entry : plan) {
    if (!PyTuple_Check(entry.ptr()) || PyTuple_GET_SIZE(entry.ptr()) < 2) {
      throw py::type_error("sum_replica_gradients: plan entries must be (index, slot, ...) tuples, got " +
                           py::repr(entry).cast<std::string>());
    }
    const Py_ssize_t index = PyLong_AsSsize_t(PyTuple_GET_ITEM(entry.ptr(), 0));
    if (index == -1 && PyErr_Occurred()) throw py::error_already_set();
    if (index < 0 || index >= count) {
      throw py::index_error("sum_replica_gradients: plan index " + std::to_string(index) +
                            " outside the " + std::to_string(count) + " parameters");
    }
    PyObject* slot = PyTuple_GET_ITEM(entry.ptr(), 1);
    PyObject* p = PyList_GET_ITEM(params.ptr(), index);  // borrowed, held by params
    py::object ref = py::reinterpret_steal<py::object>(PyObject_GetAttr(slot, kRef));
    if (!ref) throw py::error_already_set();
    py::object held = py::reinterpret_steal<py::object>(deref(ref.ptr()));
    if (!held) throw py::error_already_set();
    if (held.ptr() != p) return py::none();  // a new tensor where the plan's was: plan anew
    py::object grads = py::reinterpret_steal<py::object>(PyObject_GetAttr(slot, kGrads));
    if (!grads) throw py::error_already_set();
    Item item;
    if (!THPVariable_Check(p) || !PyList_CheckExact(grads.ptr()) ||
        !fits(THPVariable_Unpack(p), grads.ptr(), &item)) {
      rest.append(entry);
      continue;
    }
    item.param = THPVariable_Unpack(p);
    item.grads_list = std::move(grads);
    elements += item.param.numel();
    items.push_back(std::move(item));
  }
  for (Item& item : items) {
    const at::Tensor& g0 = item.grads[0];
    item.total = in_place(item) ? g0 : at::empty_like(g0, at::MemoryFormat::Contiguous);
  }
  if (elements >= kReleaseGilElements) {
    py::gil_scoped_release release;
    for (Item& item : items) sum_into(item);
  } else {
    for (Item& item : items) sum_into(item);
  }
  for (Item& item : items) {
    item.param.mutable_grad() = item.total;
    PyObject* list = item.grads_list.ptr();
    const Py_ssize_t n = PyList_GET_SIZE(list);
    if (item.total.is_same(item.grads[0])) {
      item.total.unsafeGetTensorImpl()->bump_version();  // written in place, as add_ would
    } else {
      PyObject* total = THPVariable_Wrap(item.total);
      if (total == nullptr) throw py::error_already_set();
      if (PyList_SetItem(list, 0, total) < 0) throw py::error_already_set();  // steals `total`
    }
    for (Py_ssize_t k = 1; k < n; ++k) {
      Py_INCREF(Py_None);
      if (PyList_SetItem(list, k, Py_None) < 0) throw py::error_already_set();
    }
  }
  return std::move(rest);
}

}  // namespace

void init_replica_grads_bindings(py::module_& m) {
  m.def("swap_gradients", &swap_gradients, py::arg("slots"), py::arg("save"), py::arg("load"),
        py::arg("device"),
        "Stores each slot's parameter .grad as replica `save`'s and gives it replica `load`'s (-1: the "
        "slot's home_grad); False, with nothing changed, where a slot needs the Python path (see "
        "csrc/cpu/replica_grads.cpp).");
  m.def("clear_gradients", &clear_gradients, py::arg("param_groups"),
        "Sets .grad to None for every parameter of the param_groups; False, with nothing changed, where "
        "one is not a plain Tensor or Parameter.");
  m.def("sum_replica_gradients", &sum_replica_gradients, py::arg("params"), py::arg("plan"),
        "Sets each planned parameter's .grad to the sum of its replicas' CPU gradients (plan: (index in params, "
        "slot, ...) tuples; see "
        "csrc/cpu/replica_grads.cpp); returns the plan entries left to the caller, or None when the plan is "
        "stale.");
}

}  // namespace torchstrategies
