// Torch-free reduction loops: the sum of N same-length arrays in one pass over memory.
//
// Every routine here works on one contiguous range [0, len) of N input pointers. Callers (the
// dispatch in reduce_kernels.cpp, reached from csrc/cpu glue and the shared-memory all-reduce) split
// large arrays into ranges and run ranges in parallel. Inside a range we walk cache-sized blocks: a
// block's running sum lives in an L1-resident accumulator, and up to kGroup inputs are added per pass
// over it, so every input element is read from memory exactly once and the output written once.
//
// T is the storage type, Acc the accumulation type (float for float16/bfloat16/float32, double for
// float64, int64_t for integers). float16 is stored as _Float16 and bfloat16 as Bf16 below, so this
// header never sees torch; the glue reinterprets c10::Half / c10::BFloat16 (same bits).
//
// Every helper is always_inline: the callers in reduce_kernels.cpp carry GCC target_clones, and the
// loops are vectorized for each target when they are inlined there.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#define TS_INLINE inline __attribute__((always_inline))

namespace torchstrategies {
namespace core {

// Elements per block: the float accumulator of one block (4096 * 4 B = 16 KiB) stays in L1.
constexpr int64_t kBlock = 4096;
// Inputs added per pass over the accumulator (sequential order is kept: ((acc + a) + b) + c ...); up to
// kGroup inputs are summed in registers in one pass with no accumulator. 8 rather than 4: at N = 8 one
// pass over 9 streams beats two passes over the accumulator (one thread, 16M float32; issue 28).
constexpr int kGroup = 8;
// Inputs summed directly in registers at the leaves of tree_reduce (balanced order inside a leaf).
constexpr int kLeaf = 4;

// bfloat16: the top 16 bits of a float32; float -> bfloat16 rounds to nearest even, NaN stays NaN
// (the same rule as c10::BFloat16).
struct Bf16 {
  uint16_t bits;
};

template <typename Acc, typename T>
struct Conv {
  static TS_INLINE Acc load(T x) { return static_cast<Acc>(x); }
  static TS_INLINE T store(Acc x) { return static_cast<T>(x); }
};

template <>
struct Conv<float, Bf16> {
  static TS_INLINE float load(Bf16 x) {
    uint32_t u = static_cast<uint32_t>(x.bits) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
  }
  static TS_INLINE Bf16 store(float f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    if (f != f) return Bf16{static_cast<uint16_t>(0x7FC0u)};
    u += 0x7FFFu + ((u >> 16) & 1u);
    return Bf16{static_cast<uint16_t>(u >> 16)};
  }
};

template <typename T, typename Acc>
TS_INLINE Acc ld(const T* p, int64_t i) {
  return Conv<Acc, T>::load(p[i]);
}

// Sum of K inputs at element i, left to right.
template <typename T, typename Acc, int K>
TS_INLINE Acc seq_sum(const T* const* x, int64_t i) {
  Acc s = ld<T, Acc>(x[0], i);
  for (int j = 1; j < K; ++j) s += ld<T, Acc>(x[j], i);
  return s;
}

// Balanced pairwise sum of K inputs at element i: split as in tree_reduce (left half = K / 2).
template <typename T, typename Acc, int K>
TS_INLINE Acc pair_sum(const T* const* x, int64_t i) {
  if constexpr (K == 1) {
    return ld<T, Acc>(x[0], i);
  } else {
    return pair_sum<T, Acc, K / 2>(x, i) + pair_sum<T, Acc, K - K / 2>(x + K / 2, i);
  }
}

template <typename T, typename Acc>
TS_INLINE T finish(Acc v, bool has_scale, Acc s) {
  return Conv<Acc, T>::store(has_scale ? v * s : v);
}

// ---- sequential order: out = scale * (((x0 + x1) + x2) + ...) -----------------------------------

// One block of m elements, K inputs: dst(acc or out) = [acc +] x0 + ... + x{K-1}.
// FIRST: no acc yet. LAST: write the (scaled) result to out, else to acc.
template <typename T, typename Acc, int K, bool FIRST, bool LAST>
TS_INLINE void seq_group(T* __restrict out, Acc* __restrict acc, const T* const* xs, int64_t m,
                         bool has_scale, Acc s) {
  const T* x[K];
  for (int j = 0; j < K; ++j) x[j] = xs[j];
  if (LAST && has_scale) {
    for (int64_t i = 0; i < m; ++i) {
      Acc v = FIRST ? seq_sum<T, Acc, K>(x, i) : acc[i];
      if (!FIRST) for (int j = 0; j < K; ++j) v += ld<T, Acc>(x[j], i);
      out[i] = Conv<Acc, T>::store(v * s);
    }
    return;
  }
  for (int64_t i = 0; i < m; ++i) {
    Acc v = FIRST ? seq_sum<T, Acc, K>(x, i) : acc[i];
    if (!FIRST) for (int j = 0; j < K; ++j) v += ld<T, Acc>(x[j], i);
    if (LAST) out[i] = Conv<Acc, T>::store(v);
    else acc[i] = v;
  }
}

template <typename T, typename Acc, bool FIRST, bool LAST>
TS_INLINE void seq_group_k(int k, T* out, Acc* acc, const T* const* xs, int64_t m, bool hs, Acc s) {
  switch (k) {
    case 1: seq_group<T, Acc, 1, FIRST, LAST>(out, acc, xs, m, hs, s); break;
    case 2: seq_group<T, Acc, 2, FIRST, LAST>(out, acc, xs, m, hs, s); break;
    case 3: seq_group<T, Acc, 3, FIRST, LAST>(out, acc, xs, m, hs, s); break;
    case 4: seq_group<T, Acc, 4, FIRST, LAST>(out, acc, xs, m, hs, s); break;
    case 5: seq_group<T, Acc, 5, FIRST, LAST>(out, acc, xs, m, hs, s); break;
    case 6: seq_group<T, Acc, 6, FIRST, LAST>(out, acc, xs, m, hs, s); break;
    case 7: seq_group<T, Acc, 7, FIRST, LAST>(out, acc, xs, m, hs, s); break;
    default: seq_group<T, Acc, 8, FIRST, LAST>(out, acc, xs, m, hs, s); break;
  }
}

// out[i] = scale * (x0[i] + x1[i] + ... + x{n-1}[i]), summed left to right, for i in [0, len).
// `out` may alias any input exactly: each element is read from every input before it is written.
template <typename T, typename Acc>
TS_INLINE void accumulate_n_range(T* out, const T* const* xs, int n, int64_t len, bool has_scale,
                                  double scale) {
  const Acc s = static_cast<Acc>(scale);
  if (n <= kGroup) {  // everything in registers, one loop
    seq_group_k<T, Acc, true, true>(n, out, nullptr, xs, len, has_scale, s);
    return;
  }
  alignas(64) Acc acc[kBlock];
  const T* p[kGroup];
  for (int64_t off = 0; off < len; off += kBlock) {
    const int64_t m = (len - off) < kBlock ? (len - off) : kBlock;
    for (int j = 0; j < kGroup; ++j) p[j] = xs[j] + off;
    seq_group<T, Acc, kGroup, true, false>(nullptr, acc, p, m, false, s);
    int j0 = kGroup;
    for (; n - j0 > kGroup; j0 += kGroup) {
      for (int j = 0; j < kGroup; ++j) p[j] = xs[j0 + j] + off;
      seq_group<T, Acc, kGroup, false, false>(nullptr, acc, p, m, false, s);
    }
    const int k = n - j0;
    for (int j = 0; j < k; ++j) p[j] = xs[j0 + j] + off;
    seq_group_k<T, Acc, false, true>(k, out + off, acc, p, m, has_scale, s);
  }
}

// Kept for existing callers (the shared-memory all-reduce): the sequential sum of one range with the
// loops inlined at the caller, for any T that static_casts to and from Acc (c10::Half works). New code
// should call core::reduce_range (reduce_kernels.h), which runs the per-ISA vectorized clones.
template <typename T, typename Acc>
void accumulate_n_block(T* out, const T* const* xs, int n, int64_t len, bool has_scale, double scale) {
  accumulate_n_range<T, Acc>(out, xs, n, len, has_scale, scale);
}

// ---- balanced pairwise order: out = scale * tree(x0 .. x{n-1}) ----------------------------------

// A leaf of the tree: dst[i] = pairwise sum of K <= kLeaf inputs, in registers. Inner nodes then add
// the right subtree's scratch level into the left's (add_into).
template <typename T, typename Acc, int K>
TS_INLINE void tree_leaf(Acc* __restrict dst, const T* const* xs, int64_t m) {
  const T* x[K];
  for (int j = 0; j < K; ++j) x[j] = xs[j];
  for (int64_t i = 0; i < m; ++i) dst[i] = pair_sum<T, Acc, K>(x, i);
}

template <typename Acc>
TS_INLINE void add_into(Acc* __restrict dst, const Acc* __restrict src, int64_t m) {
  for (int64_t i = 0; i < m; ++i) dst[i] += src[i];
}

// tree_reduce's schedule for n > kLeaf inputs, built once per call (not per element): a post-order
// list of steps over kBlock-sized scratch levels. A leaf step (k > 0) writes the pairwise sum of
// xs[lo, lo + k) into level `level`; a combine step (k == 0) adds level + 1 into level. The split rule
// (left half = k / 2, rounded down) is pair_sum's, so the whole order is one balanced tree. The last
// step is always the root's combine at level 0.
struct TreeStep {
  int lo;
  int k;
  int level;
};

inline void tree_plan_rec(std::vector<TreeStep>& plan, int lo, int hi, int level) {
  const int k = hi - lo;
  if (k <= kLeaf) {
    plan.push_back({lo, k, level});
    return;
  }
  const int mid = lo + k / 2;
  tree_plan_rec(plan, lo, mid, level);
  tree_plan_rec(plan, mid, hi, level + 1);
  plan.push_back({0, 0, level});
}

// The schedule; *levels receives the number of scratch levels (of kBlock Acc values) it uses.
inline std::vector<TreeStep> tree_plan(int n, int* levels) {
  std::vector<TreeStep> plan;
  tree_plan_rec(plan, 0, n, 0);
  int mx = 0;
  for (const auto& st : plan) mx = st.level > mx ? st.level : mx;
  *levels = mx + 2;
  return plan;
}

// out[i] = scale * (balanced pairwise sum of x0[i] .. x{n-1}[i]); rounding error grows like log n.
// For n > kLeaf, `plan` is tree_plan(n, &levels) (`steps` entries) and `scratch` holds
// levels * kBlock Acc values; for n <= kLeaf they are unused (the sum stays in registers).
template <typename T, typename Acc>
TS_INLINE void tree_reduce_range(T* out, const T* const* xs, int n, int64_t len, bool has_scale,
                                 double scale, const TreeStep* plan, int steps, Acc* scratch) {
  const Acc s = static_cast<Acc>(scale);
  if (n <= kLeaf) {
    const T* p[kLeaf];
    for (int j = 0; j < n; ++j) p[j] = xs[j];
    auto run = [&](auto kc) {
      constexpr int K = decltype(kc)::value;
      for (int64_t i = 0; i < len; ++i) out[i] = finish<T, Acc>(pair_sum<T, Acc, K>(p, i), has_scale, s);
    };
    switch (n) {
      case 1: run(std::integral_constant<int, 1>{}); break;
      case 2: run(std::integral_constant<int, 2>{}); break;
      case 3: run(std::integral_constant<int, 3>{}); break;
      default: run(std::integral_constant<int, 4>{}); break;
    }
    return;
  }
  for (int64_t off = 0; off < len; off += kBlock) {
    const int64_t m = (len - off) < kBlock ? (len - off) : kBlock;
    const TreeStep* root = plan + steps - 1;  // level0 + level1, written to out instead
    for (const TreeStep* st = plan; st != root; ++st) {
      Acc* dst = scratch + static_cast<int64_t>(st->level) * kBlock;
      if (st->k == 0) {
        add_into<Acc>(dst, dst + kBlock, m);
        continue;
      }
      const T* p[kLeaf];
      for (int j = 0; j < st->k; ++j) p[j] = xs[st->lo + j] + off;
      switch (st->k) {
        case 1: tree_leaf<T, Acc, 1>(dst, p, m); break;
        case 2: tree_leaf<T, Acc, 2>(dst, p, m); break;
        case 3: tree_leaf<T, Acc, 3>(dst, p, m); break;
        default: tree_leaf<T, Acc, 4>(dst, p, m); break;
      }
    }
    const Acc* a = scratch;
    const Acc* b = scratch + kBlock;
    T* o = out + off;
    for (int64_t i = 0; i < m; ++i) o[i] = finish<T, Acc>(a[i] + b[i], has_scale, s);
  }
}

}  // namespace core
}  // namespace torchstrategies
