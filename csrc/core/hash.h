// Torch-free: an exact, order-sensitive 64-bit hash of a byte array, the fingerprint the agreement seam
// compares across replicas and ranks (torchstrategies/distribute/agreement.py).
//
// The bytes are cut into chunks of kHashChunk bytes (the last shorter); chunk i is hashed with XXH3-64 (Yann
// Collet's XXH3_64bits_withSeed, written here from the published specification, doc/xxhash_spec.md of the
// xxHash project) seeded with its index. The chunk hashes, as little-endian 8-byte words, are hashed again the
// same way (level L >= 1 seeds chunk i with (L << 56) + i) until one hash is left; the result is XXH3-64 of
// that last word (no word for 0 bytes) seeded with the byte count. Every chunk of a level is independent, so
// any split over threads (or one CUDA thread per chunk) gives the same value; a swap of two rows (the chunks'
// and XXH3's stripes are position-keyed) and any one-bit flip change it. tests/reference.py holds the
// pure-Python definition the kernels are checked against (and it against the xxhash library's XXH3).
//
// XXH3 rather than XXH64: its inner loop is one 32x32->64 multiply per 8 bytes on independent lanes (the
// compiler vectorizes it), where XXH64's chain of 64-bit multiplies caps it at about 20 GB/s a core here:
// the agreement check's slice of the model is then read at memory speed (docs/kernels.md).
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

namespace xxh3 {
constexpr uint64_t P32_1 = 0x9E3779B1ULL;
constexpr uint64_t P32_2 = 0x85EBCA77ULL;
constexpr uint64_t P32_3 = 0xC2B2AE3DULL;
constexpr uint64_t P64_1 = 0x9E3779B185EBCA87ULL;
constexpr uint64_t P64_2 = 0xC2B2AE3D27D4EB4FULL;
constexpr uint64_t P64_3 = 0x165667B19E3779F9ULL;
constexpr uint64_t P64_4 = 0x85EBCA77C2B2AE63ULL;
constexpr uint64_t P64_5 = 0x27D4EB2F165667C5ULL;
constexpr uint64_t PMX_1 = 0x165667919E3779F9ULL;
constexpr uint64_t PMX_2 = 0x9FB21C651E98DF25ULL;
constexpr int kSecretSize = 192;
constexpr int kStripe = 64;
constexpr int kStripesPerBlock = (kSecretSize - kStripe) / 8;   // 16: a block is 1 KiB
// How far ahead of the stripe being hashed the host asks for the bytes (two chunks): the hardware prefetcher
// alone leaves XXH3 waiting for memory (740 KB not in cache: 41 us without, 23 us with it, this machine's AVX2
// loop; 64 B to 4 KiB ahead help less).
constexpr int64_t kPrefetchAhead = 8192;

// The specification's default secret (read as little-endian words); the device reads its copy in constant
// memory.
#define TS_XXH3_SECRET \
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c, \
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f, \
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21, \
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c, \
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3, \
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8, \
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d, \
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64, \
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb, \
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e, \
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce, \
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e
#if defined(__CUDACC__)
static __constant__ uint8_t kSecretDevice[kSecretSize] = {TS_XXH3_SECRET};
#endif
static constexpr uint8_t kSecretHost[kSecretSize] = {TS_XXH3_SECRET};
#undef TS_XXH3_SECRET

TS_HD const uint8_t* default_secret() {
#if defined(__CUDA_ARCH__)
  return kSecretDevice;
#else
  return kSecretHost;
#endif
}

// Little-endian loads that do not assume alignment (a flat slice of a float32 tensor may start at any
// multiple of 4 bytes, and the secret is read at odd offsets): memcpy on the host, bytes on the device.
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

TS_HD uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

TS_HD uint32_t swap32(uint32_t x) {
  return ((x << 24) & 0xff000000u) | ((x << 8) & 0x00ff0000u) | ((x >> 8) & 0x0000ff00u) | (x >> 24);
}

TS_HD uint64_t swap64(uint64_t x) {
  return (static_cast<uint64_t>(swap32(static_cast<uint32_t>(x))) << 32) | swap32(static_cast<uint32_t>(x >> 32));
}

// The 128-bit product of a and b, its halves xor-ed.
TS_HD uint64_t mul128_fold64(uint64_t a, uint64_t b) {
#if defined(__CUDA_ARCH__)
  return (a * b) ^ __umul64hi(a, b);
#else
  const unsigned __int128 p = static_cast<unsigned __int128>(a) * b;
  return static_cast<uint64_t>(p) ^ static_cast<uint64_t>(p >> 64);
#endif
}

TS_HD uint64_t avalanche(uint64_t h) {
  h ^= h >> 37;
  h *= PMX_1;
  return h ^ (h >> 32);
}

TS_HD uint64_t avalanche_xxh64(uint64_t h) {
  h ^= h >> 33;
  h *= P64_2;
  h ^= h >> 29;
  h *= P64_3;
  return h ^ (h >> 32);
}

TS_HD uint64_t mix16(const uint8_t* p, const uint8_t* secret, uint64_t seed) {
  return mul128_fold64(read64(p) ^ (read64(secret) + seed), read64(p + 8) ^ (read64(secret + 8) - seed));
}

// Inputs of 0 to 16 bytes.
TS_HD uint64_t hash_0to16(const uint8_t* p, int64_t len, uint64_t seed) {
  const uint8_t* s = default_secret();
  if (len > 8) {
    const uint64_t lo = read64(p) ^ ((read64(s + 24) ^ read64(s + 32)) + seed);
    const uint64_t hi = read64(p + len - 8) ^ ((read64(s + 40) ^ read64(s + 48)) - seed);
    return avalanche(static_cast<uint64_t>(len) + swap64(lo) + hi + mul128_fold64(lo, hi));
  }
  if (len >= 4) {
    seed ^= static_cast<uint64_t>(swap32(static_cast<uint32_t>(seed))) << 32;
    const uint64_t in = read32(p + len - 4) + (static_cast<uint64_t>(read32(p)) << 32);
    uint64_t h = in ^ ((read64(s + 8) ^ read64(s + 16)) - seed);
    h ^= rotl(h, 49) ^ rotl(h, 24);
    h *= PMX_2;
    h ^= (h >> 35) + static_cast<uint64_t>(len);
    h *= PMX_2;
    return h ^ (h >> 28);
  }
  if (len > 0) {
    const uint32_t combined = (static_cast<uint32_t>(p[0]) << 16) | (static_cast<uint32_t>(p[len >> 1]) << 24) |
                              static_cast<uint32_t>(p[len - 1]) | (static_cast<uint32_t>(len) << 8);
    return avalanche_xxh64(static_cast<uint64_t>(combined) ^ ((read32(s) ^ read32(s + 4)) + seed));
  }
  return avalanche_xxh64(seed ^ read64(s + 56) ^ read64(s + 64));
}

// Inputs of 17 to 240 bytes.
TS_HD uint64_t hash_17to240(const uint8_t* p, int64_t len, uint64_t seed) {
  const uint8_t* s = default_secret();
  uint64_t acc = static_cast<uint64_t>(len) * P64_1;
  if (len <= 128) {
    for (int64_t i = (len - 1) >> 5; i >= 0; --i) {
      acc += mix16(p + 16 * i, s + 32 * i, seed);
      acc += mix16(p + len - 16 * i - 16, s + 32 * i + 16, seed);
    }
    return avalanche(acc);
  }
  for (int i = 0; i < 8; ++i) acc += mix16(p + 16 * i, s + 16 * i, seed);
  acc = avalanche(acc);
  for (int64_t i = 8; i < len / 16; ++i) acc += mix16(p + 16 * i, s + 16 * (i - 8) + 3, seed);
  acc += mix16(p + len - 16, s + 136 - 17, seed);
  return avalanche(acc);
}

// The 8 accumulators of XXH3's long-input loop, one 64-bit lane each, in plain code (any host, the device).
// A Lanes type holds them: `Lanes(init)`, `accumulate(p, secret)` (one 64-byte stripe with the 64 secret
// bytes at `secret`), `scramble(secret)` and `store(out)`; the CPU kernel adds one on AVX2 registers
// (csrc/cpu/hash_cpu.cpp), checked bit for bit against this one.
struct ScalarLanes {
  uint64_t acc[8];
  TS_HD explicit ScalarLanes(const uint64_t* init) {
    for (int i = 0; i < 8; ++i) acc[i] = init[i];
  }
  TS_HD void accumulate(const uint8_t* p, const uint8_t* secret) {
    uint64_t v[8];
    for (int i = 0; i < 8; ++i) v[i] = read64(p + 8 * i);
    for (int i = 0; i < 8; ++i) {
      const uint64_t k = v[i] ^ read64(secret + 8 * i);
      acc[i] += static_cast<uint64_t>(static_cast<uint32_t>(k)) * static_cast<uint32_t>(k >> 32) + v[i ^ 1];
    }
  }
  TS_HD void scramble(const uint8_t* secret) {
    for (int i = 0; i < 8; ++i) {
      uint64_t a = acc[i];
      a ^= a >> 47;
      a ^= read64(secret + 8 * i);
      acc[i] = a * P32_1;
    }
  }
  TS_HD void store(uint64_t* out) const {
    for (int i = 0; i < 8; ++i) out[i] = acc[i];
  }
};

// Inputs over 240 bytes, with the secret derived from the seed.
template <typename Lanes>
TS_HD uint64_t hash_long(const uint8_t* p, int64_t len, uint64_t seed) {
  uint8_t secret[kSecretSize];
  for (int i = 0; i < kSecretSize / 8; ++i) {
    const uint64_t w = read64(default_secret() + 8 * i) + (i % 2 == 0 ? seed : 0 - seed);
    for (int b = 0; b < 8; ++b) secret[8 * i + b] = static_cast<uint8_t>(w >> (8 * b));   // little-endian
  }
  const uint64_t init[8] = {P32_3, P64_1, P64_2, P64_3, P64_4, P32_2, P64_5, P32_1};
  Lanes lanes(init);
  constexpr int64_t kBlock = static_cast<int64_t>(kStripe) * kStripesPerBlock;
  const int64_t blocks = (len - 1) / kBlock;
  for (int64_t b = 0; b < blocks; ++b) {
    for (int n = 0; n < kStripesPerBlock; ++n) {
#if !defined(__CUDA_ARCH__)
      __builtin_prefetch(p + b * kBlock + n * kStripe + kPrefetchAhead);   // (never faults past the end)
#endif
      lanes.accumulate(p + b * kBlock + n * kStripe, secret + 8 * n);
    }
    lanes.scramble(secret + kSecretSize - kStripe);
  }
  const int64_t stripes = ((len - 1) - kBlock * blocks) / kStripe;
  for (int64_t n = 0; n < stripes; ++n) lanes.accumulate(p + blocks * kBlock + n * kStripe, secret + 8 * n);
  lanes.accumulate(p + len - kStripe, secret + kSecretSize - kStripe - 7);
  uint64_t acc[8];
  lanes.store(acc);
  uint64_t h = static_cast<uint64_t>(len) * P64_1;
  for (int i = 0; i < 4; ++i) {
    h += mul128_fold64(acc[2 * i] ^ read64(secret + 11 + 16 * i), acc[2 * i + 1] ^ read64(secret + 11 + 16 * i + 8));
  }
  return avalanche(h);
}
}  // namespace xxh3

// XXH3-64 of len bytes at p with `seed` (XXH3_64bits_withSeed of the specification, bit for bit), its
// long-input loop on `Lanes`.
template <typename Lanes = xxh3::ScalarLanes>
TS_HD uint64_t xxh3_64(const uint8_t* p, int64_t len, uint64_t seed) {
  if (len <= 16) return xxh3::hash_0to16(p, len, seed);
  if (len <= 240) return xxh3::hash_17to240(p, len, seed);
  return xxh3::hash_long<Lanes>(p, len, seed);
}

// The chunks of `nbytes` bytes.
TS_HD int64_t hash_chunks(int64_t nbytes) { return (nbytes + kHashChunk - 1) / kHashChunk; }

// The seed of chunk i of level L.
TS_HD uint64_t hash_seed(int level, int64_t i) {
  return (static_cast<uint64_t>(level) << 56) + static_cast<uint64_t>(i);
}

// out[i] = the hash of chunk i of `data` (nbytes bytes) at `level`.
template <typename Lanes = xxh3::ScalarLanes>
TS_HD void hash_chunk(const uint8_t* data, int64_t nbytes, int level, int64_t i, uint64_t* out) {
  const int64_t off = i * kHashChunk;
  const int64_t len = nbytes - off < kHashChunk ? nbytes - off : kHashChunk;
  out[i] = xxh3_64<Lanes>(data + off, len, hash_seed(level, i));
}

// The final step: `last` is the one hash left (count 1) or nothing (count 0, an empty input).
TS_HD uint64_t hash_final(const uint64_t* last, int64_t count, int64_t nbytes) {
  return xxh3_64(reinterpret_cast<const uint8_t*>(last), count * 8, static_cast<uint64_t>(nbytes));
}

// Words of scratch hash_bytes needs for nbytes: every level's hashes, side by side.
inline int64_t hash_scratch_words(int64_t nbytes) {
  int64_t total = 0;
  for (int64_t n = hash_chunks(nbytes); n > 1; n = hash_chunks(n * 8)) total += n;
  return total;
}

// out[i] = the hash of chunk i of `data` (nbytes bytes) at `level`, for begin <= i < end.
template <typename Lanes = xxh3::ScalarLanes>
TS_HD void hash_chunk_range(const uint8_t* data, int64_t nbytes, int level, int64_t begin, int64_t end,
                            uint64_t* out) {
  for (int64_t i = begin; i < end; ++i) hash_chunk<Lanes>(data, nbytes, level, i, out);
}

// The hash of nbytes bytes at data. `hash_level(in, len, level, count, out)` writes the hashes of the
// `count` chunks of `in` (len bytes) at `level` to out[0, count) (hash_chunk_range over any split of
// [0, count), serially or on threads: the result is the same); scratch holds hash_scratch_words(nbytes)
// words.
template <typename HashLevel>
uint64_t hash_bytes(const void* data, int64_t nbytes, uint64_t* scratch, const HashLevel& hash_level) {
  const uint8_t* in = static_cast<const uint8_t*>(data);
  int64_t len = nbytes;
  int level = 0;
  int64_t n = hash_chunks(len);
  while (n > 1) {
    hash_level(in, len, level, n, scratch);
    in = reinterpret_cast<const uint8_t*>(scratch);
    len = n * 8;
    scratch += n;
    ++level;
    n = hash_chunks(len);
  }
  uint64_t last = 0;
  if (n == 1) last = xxh3_64(in, len, hash_seed(level, 0));
  return hash_final(&last, n, nbytes);
}

}  // namespace core
}  // namespace torchstrategies
