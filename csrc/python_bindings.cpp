#include "python_bindings.h"

namespace torchstrategies {
// csrc/cpu/shm_binding.cpp: the shared-memory communicator (torchstrategies._C.ShmComm).
void init_shm_bindings(pybind11::module_& m);
// csrc/cpu/replica_views.cpp: _C.ReplicaViews and _C.ThreadState (the in-process replicas)
void init_replica_views_bindings(pybind11::module_& m);
// csrc/cpu/backend_binding.cpp: the torch.distributed backend "torchstrategies" (_C.make_backend, ...)
void init_backend_bindings(pybind11::module_& m);

void init_python_bindings(pybind11::module_& m) {
  init_shm_bindings(m);
  init_replica_views_bindings(m);
  init_backend_bindings(m);
}
}  // namespace torchstrategies
