// CPU kernel of hash_tensors: thin ATen glue around the torch-free hash (csrc/core/hash.h). Each tensor's
// bytes (logical order: a non-contiguous tensor is copied first) are hashed chunk by chunk; the chunks of
// a level are split over torch's intra-op pool (at::parallel_for, at least kHashGrain chunks a range), each
// range on XXH3's AVX2 loop where the CPU has AVX2 (else the plain one of hash.h).
// Every chunk's hash goes to its own slot and the levels combine the slots in index order, so the result
// is the same for every thread count (tests/test_ops_hash.py checks it).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdlib>
#include <string>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

#include "checks.h"
#include "core/hash.h"

namespace torchstrategies {
namespace {

// Chunks per parallel range at least (64 KiB): below that, waking the pool costs more than it saves.
constexpr int64_t kHashGrain = 16;

#if defined(__x86_64__) && defined(__GNUC__)
#define TS_HASH_AVX2 1
// XXH3's 8 accumulators on two AVX2 registers (lanes 0-3 and 4-7): core::xxh3::ScalarLanes' arithmetic, four
// lanes an instruction (tests/test_ops_hash.py checks both against the pure-Python definition).
struct Avx2Lanes {
  __m256i a[2];
  __attribute__((target("avx2"))) explicit Avx2Lanes(const uint64_t* init) {
    a[0] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(init));
    a[1] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(init + 4));
  }
  __attribute__((target("avx2"))) void accumulate(const uint8_t* p, const uint8_t* secret) {
    for (int h = 0; h < 2; ++h) {
      const __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * h));
      const __m256i k = _mm256_xor_si256(d, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(secret + 32 * h)));
      const __m256i product = _mm256_mul_epu32(k, _mm256_srli_epi64(k, 32));   // low 32 bits x high 32 bits
      const __m256i swapped = _mm256_shuffle_epi32(d, _MM_SHUFFLE(1, 0, 3, 2));   // lane i gets lane i ^ 1's input
      a[h] = _mm256_add_epi64(a[h], _mm256_add_epi64(product, swapped));
    }
  }
  __attribute__((target("avx2"))) void scramble(const uint8_t* secret) {
    const __m256i prime = _mm256_set1_epi32(static_cast<int>(core::xxh3::P32_1));
    for (int h = 0; h < 2; ++h) {
      __m256i x = _mm256_xor_si256(a[h], _mm256_srli_epi64(a[h], 47));
      x = _mm256_xor_si256(x, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(secret + 32 * h)));
      const __m256i lo = _mm256_mul_epu32(x, prime);                           // (x mod 2^32) * P32_1
      const __m256i hi = _mm256_mul_epu32(_mm256_srli_epi64(x, 32), prime);   // (x >> 32) * P32_1
      a[h] = _mm256_add_epi64(lo, _mm256_slli_epi64(hi, 32));
    }
  }
  __attribute__((target("avx2"))) void store(uint64_t* out) const {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), a[0]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 4), a[1]);
  }
};

// The chunks [begin, end) of a level on AVX2 (flatten: the Lanes' AVX2 methods are inlined into this one
// AVX2 function, not into the default-target template between them).
__attribute__((target("avx2"), flatten)) void hash_range_avx2(const uint8_t* data, int64_t nbytes, int level,
                                                               int64_t begin, int64_t end, uint64_t* out) {
  core::hash_chunk_range<Avx2Lanes>(data, nbytes, level, begin, end, out);
}
#endif

void hash_range_scalar(const uint8_t* data, int64_t nbytes, int level, int64_t begin, int64_t end, uint64_t* out) {
  core::hash_chunk_range(data, nbytes, level, begin, end, out);
}

using HashRange = void (*)(const uint8_t*, int64_t, int, int64_t, int64_t, uint64_t*);

// AVX2 where the CPU has it, unless TORCHSTRATEGIES_HASH_SCALAR=1 (read once: the tests check the plain loop,
// which CPUs without AVX2 and the CUDA kernel run, against the same definition).
HashRange pick_hash_range() {
  const char* scalar = std::getenv("TORCHSTRATEGIES_HASH_SCALAR");
  if (scalar != nullptr && std::string(scalar) == "1") return &hash_range_scalar;
#if defined(TS_HASH_AVX2)
  if (__builtin_cpu_supports("avx2")) return &hash_range_avx2;
#endif
  return &hash_range_scalar;
}

at::Tensor hash_tensors_cpu(at::TensorList tensors) {
  check_hash_inputs("hash_tensors", tensors);
  const int64_t n = static_cast<int64_t>(tensors.size());
  at::Tensor out = at::empty({n}, at::TensorOptions().dtype(at::kLong));
  auto* o = out.mutable_data_ptr<int64_t>();
  std::vector<uint64_t> scratch;
  for (int64_t i = 0; i < n; ++i) {
    const at::Tensor t = hash_operand(tensors[i]);
    const int64_t nbytes = t.numel() * static_cast<int64_t>(t.element_size());
    scratch.resize(static_cast<size_t>(core::hash_scratch_words(nbytes)));
    const uint64_t h = core::hash_bytes(
        t.const_data_ptr(), nbytes, scratch.data(),
        [](const uint8_t* in, int64_t len, int level, int64_t count, uint64_t* level_out) {
          static const HashRange hash_range = pick_hash_range();
          at::parallel_for(0, count, kHashGrain, [&](int64_t begin, int64_t end) {
            hash_range(in, len, level, begin, end, level_out);
          });
        });
    o[i] = static_cast<int64_t>(h);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(torchstrategies, CPU, m) { m.impl("hash_tensors", &hash_tensors_cpu); }

}  // namespace torchstrategies
