#include "python_bindings.h"

namespace torchstrategies {
// csrc/cpu/shm_binding.cpp: the shared-memory communicator (torchstrategies._C.ShmComm).
void init_shm_bindings(pybind11::module_& m);
void init_ring_bindings(pybind11::module_& m);  // csrc/cpu/ring_binding.cpp: the TCP ring (_C.RingComm)
void init_watch_bindings(pybind11::module_& m);  // csrc/cpu/tensor_watch.cpp: _C.TensorWatch

void init_python_bindings(pybind11::module_& m) {
  init_shm_bindings(m);
  init_ring_bindings(m);
  init_watch_bindings(m);
}
}  // namespace torchstrategies
