// Op schemas, declared once. Backends register kernels in csrc/cpu and csrc/cuda.
// The Python module itself only carries non-tensor state (see python_bindings.h).
#include <torch/extension.h>
#include <torch/library.h>

#include "python_bindings.h"

TORCH_LIBRARY(torchstrategies, m) {
  // Sum of N same-shaped tensors in one pass over memory, times `scale` if given.
  m.def("accumulate_n(Tensor[] tensors, float? scale=None) -> Tensor");
  m.def("accumulate_n_out(Tensor[] tensors, float? scale, Tensor(a!) out) -> ()");
  // The same sum in balanced pairwise order per element.
  m.def("tree_reduce(Tensor[] tensors, float? scale=None) -> Tensor");
  m.def("tree_reduce_out(Tensor[] tensors, float? scale, Tensor(a!) out) -> ()");
  // dst += sum(tensors), one pass.
  m.def("accumulate_(Tensor(a!) dst, Tensor[] tensors) -> ()");
  // dsts[i] += tensors[i] + tensors[n + i] + ... for n = len(dsts): accumulate_ over a group, one call.
  m.def("accumulate_grouped_(Tensor(a!)[] dsts, Tensor[] tensors) -> ()");
  // An exact, order-sensitive 64-bit hash of each tensor's bytes (csrc/core/hash.h), as int64 on their device.
  m.def("hash_tensors(Tensor[] tensors) -> Tensor");
  // The per-step agreement check (csrc/cpu/agreement_step.cpp): before the update, the fingerprints of the
  // tensors that moved, of the forced ones and of this step's piece of the rotating slice into `payload`,
  // ready for one MAX all-reduce; after it, the optimizer's writes recorded.
  m.def("agreement_hash_(Tensor[] tensors, Tensor(a!) state, Tensor(b!) payload, int forced_from, int piece, "
        "int slices) -> ()");
  m.def("agreement_record_(Tensor[] tensors, Tensor(a!) state) -> ()");
  // The rotating slice's one definition: piece `piece` of `slices` of the tensors' bytes laid end to end, as
  // an int64 (len(tensors), 2) CPU tensor of element ranges [a, b) of each tensor's flat view (a == b: none).
  m.def("agreement_piece(Tensor[] tensors, int piece, int slices) -> Tensor");
  // Per tensor, the fingerprint of its part in that piece (0: none), an int64 (len(tensors),) CPU tensor: what
  // agreement_hash_ writes to its payload's piece part; the in-process strategies compare it per replica.
  m.def("agreement_piece_fingerprints(Tensor[] tensors, int piece, int slices) -> Tensor");
}

PYBIND11_MODULE(_C, m) {
  m.doc() = "torchstrategies C++ extension";
  m.attr("with_cuda") =
#ifdef TORCHSTRATEGIES_WITH_CUDA
      true;
#else
      false;
#endif
  torchstrategies::init_python_bindings(m);
}
