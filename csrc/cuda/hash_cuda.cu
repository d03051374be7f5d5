// CUDA kernels of hash_tensors (torch-free; launched by hash_binding.cpp). The same code as the CPU's
// (csrc/core/hash.h, compiled for the device): one thread per 4 KiB chunk of a level, so the result is
// bit-identical to the CPU kernel's for the same bytes.
#include <cuda_runtime.h>

#include <cstdint>

#include "core/hash.h"
#include "cuda/hash_cuda.h"

namespace torchstrategies {
namespace cuda {
namespace {

constexpr int kThreads = 128;

__global__ void hash_level(const uint8_t* data, int64_t nbytes, int level, int64_t chunks, uint64_t* out) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < chunks) core::hash_chunk(data, nbytes, level, i, out);
}

// The last level (0 or 1 chunk) and the final step, on one thread.
__global__ void hash_last(const uint8_t* data, int64_t len, int level, int64_t chunks, int64_t nbytes,
                          int64_t* out) {
  uint64_t last = 0;
  if (chunks == 1) last = core::xxh3_64(data, len, core::hash_seed(level, 0));
  *out = static_cast<int64_t>(core::hash_final(&last, chunks, nbytes));
}

}  // namespace

cudaError_t launch_hash(const void* data, int64_t nbytes, uint64_t* scratch, int64_t* out,
                        cudaStream_t stream) {
  const uint8_t* in = static_cast<const uint8_t*>(data);
  int64_t len = nbytes;
  int level = 0;
  int64_t n = core::hash_chunks(len);
  while (n > 1) {
    const int64_t blocks = (n + kThreads - 1) / kThreads;
    hash_level<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(in, len, level, n, scratch);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
    in = reinterpret_cast<const uint8_t*>(scratch);
    len = n * 8;
    scratch += n;
    ++level;
    n = core::hash_chunks(len);
  }
  hash_last<<<1, 1, 0, stream>>>(in, len, level, n, nbytes, out);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace torchstrategies
