#include "python_bindings.h"

namespace torchstrategies {
// csrc/cpu/shm_binding.cpp: the shared-memory communicator (torchstrategies._C.ShmComm).
void init_shm_bindings(pybind11::module_& m);
// csrc/cpu/replica_views.cpp: _C.ReplicaViews (the in-process replicas' tensors)
void init_replica_views_bindings(pybind11::module_& m);
// csrc/cpu/replica_threads.cpp: _C.Baton and _C.ThreadState (the in-process replicas' threads)
void init_replica_threads_bindings(pybind11::module_& m);
// csrc/cpu/backend_binding.cpp: the torch.distributed backend "torchstrategies" (_C.make_backend, ...)
void init_backend_bindings(pybind11::module_& m);
// csrc/cpu/reduce_cpu.cpp: _C.reduce_ranges / _C.REDUCE_GRAIN (how the CPU kernels split their work)
void init_reduce_bindings(pybind11::module_& m);

void init_python_bindings(pybind11::module_& m) {
  init_shm_bindings(m);
  init_replica_views_bindings(m);
  init_replica_threads_bindings(m);
  init_backend_bindings(m);
  init_reduce_bindings(m);
}
}  // namespace torchstrategies
