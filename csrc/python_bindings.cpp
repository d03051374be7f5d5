#include "python_bindings.h"

namespace torchstrategies {
// csrc/cpu/shm_binding.cpp: the shared-memory communicator (torchstrategies._C.ShmComm).
void init_shm_bindings(pybind11::module_& m);
void init_watch_bindings(pybind11::module_& m);  // csrc/cpu/tensor_watch.cpp: _C.TensorWatch
// csrc/cpu/replica_grads.cpp: _C.sum_replica_gradients (MirroredStrategy's CPU gradient sum)
void init_replica_grads_bindings(pybind11::module_& m);
void init_frame_check_bindings(pybind11::module_& m);  // csrc/cpu/frame_check.cpp: _C.FrameCheck
// csrc/cpu/backend_binding.cpp: the torch.distributed backend "torchstrategies" (_C.make_backend, ...)
void init_backend_bindings(pybind11::module_& m);

void init_python_bindings(pybind11::module_& m) {
  init_shm_bindings(m);
  init_watch_bindings(m);
  init_replica_grads_bindings(m);
  init_frame_check_bindings(m);
  init_backend_bindings(m);
}
}  // namespace torchstrategies
