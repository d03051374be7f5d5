#include "python_bindings.h"

namespace torchstrategies {
// csrc/cpu/shm_binding.cpp: the shared-memory communicator (torchstrategies._C.ShmComm).
void init_shm_bindings(pybind11::module_& m);
void init_ring_bindings(pybind11::module_& m);  // csrc/cpu/ring_binding.cpp: the TCP ring (_C.RingComm)
void init_watch_bindings(pybind11::module_& m);  // csrc/cpu/tensor_watch.cpp: _C.TensorWatch
// csrc/cpu/replica_grads.cpp: _C.sum_replica_gradients (MirroredStrategy's CPU gradient sum)
void init_replica_grads_bindings(pybind11::module_& m);
void init_frame_check_bindings(pybind11::module_& m);  // csrc/cpu/frame_check.cpp: _C.FrameCheck
// csrc/cpu/reduce_cpu.cpp: _C.reduce_ranges / _C.REDUCE_GRAIN (how the CPU kernels split their work)
void init_reduce_bindings(pybind11::module_& m);

void init_python_bindings(pybind11::module_& m) {
  init_shm_bindings(m);
  init_ring_bindings(m);
  init_watch_bindings(m);
  init_replica_grads_bindings(m);
  init_frame_check_bindings(m);
  init_reduce_bindings(m);
}
}  // namespace torchstrategies
