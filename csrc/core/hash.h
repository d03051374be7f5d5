// Torch-free: an exact, order-sensitive 64-bit hash of a byte array, the fingerprint the agreement seam
// compares across replicas and ranks (torchstrategies/distribute/agreement.py).
//
// The bytes are cut into chunks of kHashChunk bytes (the last shorter); chunk i is hashed with xxHash64
// (Yann Collet's XXH64, reproduced below) seeded with its index. The chunk hashes, as little-endian 8-byte
// words, are hashed again the same way (level L >= 1 seeds chunk i with (L << 56) + i) until one hash is
// left; the result is XXH64 of that last word (no word for 0 bytes) seeded with the byte count. Every chunk
// of a level is independent, so any split over threads (or one CUDA thread per chunk) gives the same
// value; a swap of two rows (the chunks' and XXH64's lanes are position-seeded) and any one-bit flip change
// it. tests/reference.py holds the pure-Python definition the kernels are checked against.
//
// Everything is inline and marked TS_HD so that csrc/cuda/hash_cuda.cu runs the same code on the device.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define TS_HD __host__ __device__ __forceinline__
#else
#define TS_HD inline __attribute__((always_inline))
#endif

namespace torchstrategies {
namespace core {

// Bytes per chunk: 4 KiB, small enough that a CUDA thread per chunk fills the device for a tensor of a
// few MiB, large enough that a chunk's finalization is ~2% of its work.
constexpr int64_t kHashChunk = 4096;

namespace xxh {
constexpr uint64_t P1 = 0x9E3779B185EBCA87ULL;
constexpr uint64_t P2 = 0xC2B2AE3D27D4EB4FULL;
constexpr uint64_t P3 = 0x165667B19E3779F9ULL;
constexpr uint64_t P4 = 0x85EBCA77C2B2AE63ULL;
constexpr uint64_t P5 = 0x27D4EB2F165667C5ULL;

TS_HD uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

// Little-endian loads that do not assume alignment (a flat slice of a float32 tensor may start at any
// multiple of 4 bytes): memcpy on the host, byte assembly on the device where the pointer is unaligned.
TS_HD uint64_t read64(const uint8_t* p) {
#if defined(__CUDA_ARCH__)
  if ((reinterpret_cast<uintptr_t>(p) & 7u) == 0) return *reinterpret_cast<const uint64_t*>(p);
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
#else
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
#endif
}

TS_HD uint32_t read32(const uint8_t* p) {
#if defined(__CUDA_ARCH__)
  if ((reinterpret_cast<uintptr_t>(p) & 3u) == 0) return *reinterpret_cast<const uint32_t*>(p);
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | p[i];
  return v;
#else
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
#endif
}

TS_HD uint64_t round(uint64_t acc, uint64_t input) {
  acc += input * P2;
  acc = rotl(acc, 31);
  return acc * P1;
}

TS_HD uint64_t merge(uint64_t acc, uint64_t val) {
  acc ^= round(0, val);
  return acc * P1 + P4;
}
}  // namespace xxh

// XXH64 of len bytes at p with `seed` (the reference algorithm, bit for bit).
TS_HD uint64_t xxh64(const uint8_t* p, int64_t len, uint64_t seed) {
  using namespace xxh;
  const uint8_t* const end = p + len;
  uint64_t h;
  if (len >= 32) {
    uint64_t v1 = seed + P1 + P2, v2 = seed + P2, v3 = seed, v4 = seed - P1;
    const uint8_t* const limit = end - 32;
    do {
      v1 = round(v1, read64(p));
      v2 = round(v2, read64(p + 8));
      v3 = round(v3, read64(p + 16));
      v4 = round(v4, read64(p + 24));
      p += 32;
    } while (p <= limit);
    h = rotl(v1, 1) + rotl(v2, 7) + rotl(v3, 12) + rotl(v4, 18);
    h = merge(h, v1);
    h = merge(h, v2);
    h = merge(h, v3);
    h = merge(h, v4);
  } else {
    h = seed + P5;
  }
  h += static_cast<uint64_t>(len);
  for (; p + 8 <= end; p += 8) {
    h ^= round(0, read64(p));
    h = rotl(h, 27) * P1 + P4;
  }
  if (p + 4 <= end) {
    h ^= static_cast<uint64_t>(read32(p)) * P1;
    h = rotl(h, 23) * P2 + P3;
    p += 4;
  }
  for (; p < end; ++p) {
    h ^= static_cast<uint64_t>(*p) * P5;
    h = rotl(h, 11) * P1;
  }
  h ^= h >> 33;
  h *= P2;
  h ^= h >> 29;
  h *= P3;
  h ^= h >> 32;
  return h;
}

// The chunks of `nbytes` bytes.
TS_HD int64_t hash_chunks(int64_t nbytes) { return (nbytes + kHashChunk - 1) / kHashChunk; }

// The seed of chunk i of level L.
TS_HD uint64_t hash_seed(int level, int64_t i) {
  return (static_cast<uint64_t>(level) << 56) + static_cast<uint64_t>(i);
}

// out[i] = the hash of chunk i of `data` (nbytes bytes) at `level`.
TS_HD void hash_chunk(const uint8_t* data, int64_t nbytes, int level, int64_t i, uint64_t* out) {
  const int64_t off = i * kHashChunk;
  const int64_t len = nbytes - off < kHashChunk ? nbytes - off : kHashChunk;
  out[i] = xxh64(data + off, len, hash_seed(level, i));
}

// The final step: `last` is the one hash left (count 1) or nothing (count 0, an empty input).
TS_HD uint64_t hash_final(const uint64_t* last, int64_t count, int64_t nbytes) {
  return xxh64(reinterpret_cast<const uint8_t*>(last), count * 8, static_cast<uint64_t>(nbytes));
}

// Words of scratch hash_bytes needs for nbytes: every level's hashes, side by side.
inline int64_t hash_scratch_words(int64_t nbytes) {
  int64_t total = 0;
  for (int64_t n = hash_chunks(nbytes); n > 1; n = hash_chunks(n * 8)) total += n;
  return total;
}

// The hash of nbytes bytes at data. `for_chunks(count, fn)` runs fn(begin, end) over ranges covering
// [0, count) (serially or on threads: the result is the same); scratch holds hash_scratch_words(nbytes)
// words.
template <typename ForChunks>
uint64_t hash_bytes(const void* data, int64_t nbytes, uint64_t* scratch, const ForChunks& for_chunks) {
  const uint8_t* in = static_cast<const uint8_t*>(data);
  int64_t len = nbytes;
  int level = 0;
  int64_t n = hash_chunks(len);
  while (n > 1) {
    uint64_t* out = scratch;
    for_chunks(n, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) hash_chunk(in, len, level, i, out);
    });
    in = reinterpret_cast<const uint8_t*>(out);
    len = n * 8;
    scratch += n;
    ++level;
    n = hash_chunks(len);
  }
  uint64_t last = 0;
  if (n == 1) last = xxh64(in, len, hash_seed(level, 0));
  return hash_final(&last, n, nbytes);
}

}  // namespace core
}  // namespace torchstrategies
