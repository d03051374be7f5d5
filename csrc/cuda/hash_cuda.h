// Torch-free launcher of the CUDA hash kernel (hash_cuda.cu): the hash of csrc/core/hash.h, computed on the
// device. The torch glue (hash_binding.cpp) makes the tensor contiguous and allocates the scratch.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace torchstrategies {
namespace cuda {

// *out = the hash (csrc/core/hash.h) of nbytes bytes at the device pointer `data`, as int64 bits.
// `scratch` holds core::hash_scratch_words(nbytes) device words. Launches on `stream` asynchronously
// (one thread per chunk of each level, then one thread for the final step) and returns the launch status.
cudaError_t launch_hash(const void* data, int64_t nbytes, uint64_t* scratch, int64_t* out,
                        cudaStream_t stream);

}  // namespace cuda
}  // namespace torchstrategies
