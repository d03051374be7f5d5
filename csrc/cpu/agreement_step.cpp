// The per-step agreement check's work on its tensors, one call before the optimizer's update and one after
// it (torchstrategies/distribute/agreement_step.py): which tensors moved since they were recorded, which
// bytes this step's piece of the rotating slice holds, their fingerprints (the hash of csrc/core/hash.h mixed with the tensor's dtype, shape
// and the hashed range), written into the int64 payload of the check's one MAX all-reduce.
//
// Device-agnostic glue: the bookkeeping is host work on the tensors' metadata; the bytes are hashed by
// hash_tensors through the dispatcher, so CPU and CUDA tensors take the kernel of their device. Registered
// here for the CPU key and by csrc/cuda/hash_binding.cpp for the CUDA key (an opaque op: torch.compile sees
// its fake, ops.py). `state` and `payload` are int64 CPU tensors the caller keeps per tensor list.
// agreement_piece, which bytes a piece holds (the rotating slice's one definition), reads metadata only, and
// agreement_piece_fingerprints (a piece's fingerprints: the in-process strategies' check compares them per
// replica) reads bytes only through hash_tensors: each is registered once, CompositeExplicitAutograd, for
// every device.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "core/hash.h"
#include "cpu/agreement_step.h"

namespace torchstrategies {
namespace {

// Columns of `state` (n x 3): what each position held when last recorded, and whether it moved this step.
constexpr int64_t kVersion = 0, kPtr = 1, kMoved = 2, kCols = 3;
constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ULL;   // spreads the descriptor's bits
constexpr uint64_t kMask63 = (1ULL << 63) - 1;        // kept to 63 bits: -h is exact in int64

void check_state(const char* op, at::TensorList tensors, const at::Tensor& state) {
  const int64_t n = static_cast<int64_t>(tensors.size());
  TORCH_CHECK(state.device().is_cpu() && state.scalar_type() == at::kLong && state.is_contiguous() &&
                  state.dim() == 2 && state.size(0) == n && state.size(1) == kCols,
              op, ": state must be a contiguous int64 CPU tensor of shape (", n, ", ", kCols, "), got ",
              state.scalar_type(), " ", state.sizes(), " on ", state.device());
}

void check_piece(const char* op, int64_t piece, int64_t slices) {
  TORCH_CHECK(slices >= 1 && 0 <= piece && piece < slices, op, ": piece ", piece, " of ", slices,
              " slices: expected slices >= 1 and 0 <= piece < slices");
}

int64_t address(const at::Tensor& t) { return static_cast<int64_t>(reinterpret_cast<intptr_t>(t.const_data_ptr())); }

// The fingerprint of elements [a, b) of t's flat view whose bytes hash to h.
int64_t mix(uint64_t h, const at::Tensor& t, int64_t a, int64_t b) {
  std::vector<int64_t> words{static_cast<int64_t>(t.scalar_type()), t.dim()};
  for (const int64_t s : t.sizes()) words.push_back(s);
  words.push_back(a);
  words.push_back(b);
  const uint64_t d = core::xxh3_64(reinterpret_cast<const uint8_t*>(words.data()),
                                 static_cast<int64_t>(words.size() * sizeof(int64_t)), 0);
  return static_cast<int64_t>((h ^ (d * kGolden)) & kMask63);
}

struct Item {
  int64_t slot;   // where its fingerprint goes (in the payload's own part)
  at::Tensor view;
  int64_t a, b;   // the element range of the flat view it covers (b - a == numel for a whole tensor)
};

// Hashes every item (each device's in one hash_tensors call) and writes its fingerprint to slots[index].
void hash_items(std::vector<Item>& items, int64_t* slots) {
  static auto hash = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("torchstrategies::hash_tensors", "")
                         .typed<at::Tensor(at::TensorList)>();
  std::vector<bool> done(items.size(), false);
  for (size_t first = 0; first < items.size(); ++first) {
    if (done[first]) continue;
    const at::Device device = items[first].view.device();
    std::vector<size_t> group;
    std::vector<at::Tensor> views;
    for (size_t j = first; j < items.size(); ++j) {
      if (!done[j] && items[j].view.device() == device) {
        group.push_back(j);
        views.push_back(items[j].view);
        done[j] = true;
      }
    }
    const at::Tensor h = hash.call(views).to(at::kCPU);
    const int64_t* hp = h.const_data_ptr<int64_t>();
    for (size_t k = 0; k < group.size(); ++k) {
      const Item& it = items[group[k]];
      slots[it.slot] = mix(static_cast<uint64_t>(hp[k]), it.view, it.a, it.b);
    }
  }
}

void check_call(const char* op, at::TensorList tensors, const at::Tensor& state, const at::Tensor& payload,
                int64_t forced_from) {
  const int64_t n = static_cast<int64_t>(tensors.size());
  check_state(op, tensors, state);
  TORCH_CHECK(payload.device().is_cpu() && payload.scalar_type() == at::kLong && payload.is_contiguous() &&
                  payload.dim() == 1 && payload.size(0) == 9 * n,
              op, ": payload must be a contiguous int64 CPU tensor of ", 9 * n, " elements, got ",
              payload.scalar_type(), " ", payload.sizes(), " on ", payload.device());
  TORCH_CHECK(0 <= forced_from && forced_from <= n, op, ": forced_from=", forced_from, " is not in [0, ", n, "]");
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(tensors[i].layout() == at::kStrided, op, ": tensors[", i, "] has layout ", tensors[i].layout(),
                "; only strided (dense) tensors are hashed");
  }
}

// Piece `piece` of `slices` of the tensors' bytes laid end to end (byte offsets [piece * total / slices,
// (piece + 1) * total / slices)): per tensor, the element range [a, b) of its flat view in the piece, a == b
// for none. An element is in the piece that holds its first byte, so every element of a contiguous tensor is
// in exactly one piece; a tensor that is not contiguous (its bytes are not one run to cut) is whole (a = 0,
// b = numel) in the piece that holds its first byte. Metadata only: no byte is read. The one definition of
// the rotating slice: every piece's fingerprints (piece_items: MWMS's agreement_hash_ and
// agreement_piece_fingerprints, which the in-process check compares) and agreement_piece's rows.
struct PieceRange {
  int64_t a, b;
};

std::vector<PieceRange> piece_ranges(const char* op, at::TensorList tensors, int64_t piece, int64_t slices) {
  check_piece(op, piece, slices);
  int64_t total = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    TORCH_CHECK(tensors[i].layout() == at::kStrided, op, ": tensors[", i, "] has layout ", tensors[i].layout(),
                "; only strided (dense) tensors are cut into pieces");
    total += tensors[i].numel() * static_cast<int64_t>(tensors[i].element_size());
  }
  // k * total / slices without overflowing k * total
  const auto offset = [&](int64_t k) { return k * (total / slices) + k * (total % slices) / slices; };
  const int64_t lo = offset(piece), hi = offset(piece + 1);
  std::vector<PieceRange> out(tensors.size(), PieceRange{0, 0});
  int64_t start = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    const int64_t e = static_cast<int64_t>(t.element_size());
    const int64_t size = t.numel() * e, end = start + size;
    if (end > lo && start < hi && size > 0) {
      if (!t.is_contiguous()) {
        if (lo <= start) out[i] = {0, t.numel()};
      } else {
        out[i] = {std::max(lo - start, int64_t{0}) / e, std::min(hi - start, size) / e};
      }
    }
    start = end;
  }
  return out;
}

// The part of t a range names (a view, no copy): t itself when the range is all of it, else its flat view's
// [a, b).
at::Tensor piece_view(const at::Tensor& t, int64_t a, int64_t b) {
  return a == 0 && b == t.numel() ? t.detach() : t.detach().view(-1).slice(0, a, b);
}

// Piece `piece` of `slices` of the tensors as items, tensor i's fingerprint to slot base + i: the one path of
// a piece's fingerprints (agreement_hash_'s payload, agreement_piece_fingerprints).
void piece_items(const char* op, at::TensorList tensors, int64_t base, int64_t piece, int64_t slices,
                 std::vector<Item>& items) {
  const std::vector<PieceRange> ranges = piece_ranges(op, tensors, piece, slices);
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto [a, b] = ranges[i];
    if (b > a) items.push_back({base + static_cast<int64_t>(i), piece_view(tensors[i], a, b), a, b});
  }
}

}  // namespace

// Rows [a, b] (int64 (n, 2), CPU) of piece_ranges: which elements of each tensor a piece holds.
at::Tensor agreement_piece(at::TensorList tensors, int64_t piece, int64_t slices) {
  const std::vector<PieceRange> ranges = piece_ranges("agreement_piece", tensors, piece, slices);
  at::Tensor out = at::empty({static_cast<int64_t>(ranges.size()), 2}, at::TensorOptions().dtype(at::kLong));
  int64_t* o = out.mutable_data_ptr<int64_t>();
  for (const auto& [a, b] : ranges) {
    *o++ = a;
    *o++ = b;
  }
  return out;
}

// The fingerprints of piece `piece` of `slices`, a tensor each (0 where a tensor has no part in it): what
// agreement_hash_ writes to its payload's piece part for the same tensors, one hash call per device.
at::Tensor agreement_piece_fingerprints(at::TensorList tensors, int64_t piece, int64_t slices) {
  at::Tensor out = at::zeros({static_cast<int64_t>(tensors.size())}, at::TensorOptions().dtype(at::kLong));
  std::vector<Item> items;
  piece_items("agreement_piece_fingerprints", tensors, 0, piece, slices, items);
  hash_items(items, out.mutable_data_ptr<int64_t>());
  return out;
}

// The payload (int64, 9n) of a list of n tensors: the wire [flags, whole, piece, -flags, -whole, -piece] (6n,
// the MAX all-reduce's, reduced in place), then this rank's own [flags, whole, piece] (3n). `whole` holds the
// fingerprints of the tensors hashed whole, `piece` those of this step's piece of the rotating slice.

// Before the optimizer's update: flags[i] = whether tracked tensor i (i < forced_from) moved (version or
// storage) since recorded (recorded now); the moved and the forced (i >= forced_from) tensors hashed whole
// into whole[i] (0 for the others); piece `piece` of `slices` of the tracked tensors' bytes hashed into
// piece[i]; then the wire laid out from this rank's values. One hash call per device for all of it.
void agreement_hash_(at::TensorList tensors, const at::Tensor& state, const at::Tensor& payload,
                     int64_t forced_from, int64_t piece, int64_t slices) {
  check_call("agreement_hash_", tensors, state, payload, forced_from);
  check_piece("agreement_hash_", piece, slices);
  const int64_t n = static_cast<int64_t>(tensors.size());
  int64_t* st = state.mutable_data_ptr<int64_t>();
  int64_t* wire = payload.mutable_data_ptr<int64_t>();
  int64_t* own = wire + 6 * n;
  int64_t* flags = own;
  std::vector<Item> items;
  for (int64_t i = 0; i < n; ++i) {
    const at::Tensor& t = tensors[i];
    int64_t* row = st + i * kCols;
    row[kMoved] = 0;
    own[n + i] = 0;
    own[2 * n + i] = 0;
    if (i < forced_from) {
      const int64_t version = t._version(), ptr = address(t);
      if (row[kVersion] != version || row[kPtr] != ptr) {
        row[kVersion] = version;
        row[kPtr] = ptr;
        row[kMoved] = 1;
      }
    }
    flags[i] = row[kMoved];
    if (i >= forced_from || row[kMoved]) items.push_back({n + i, t.detach(), 0, t.numel()});
  }
  piece_items("agreement_hash_", tensors.slice(0, static_cast<size_t>(forced_from)), 2 * n, piece, slices, items);
  hash_items(items, own);
  for (int64_t j = 0; j < 3 * n; ++j) {
    wire[j] = own[j];
    wire[3 * n + j] = -own[j];
  }
}

// After the optimizer's update: every position recorded as it is now (what moved during the optimizer's step
// is its own write: no news at the next check).
void agreement_record_(at::TensorList tensors, const at::Tensor& state) {
  check_state("agreement_record_", tensors, state);
  int64_t* st = state.mutable_data_ptr<int64_t>();
  for (size_t i = 0; i < tensors.size(); ++i) {
    st[i * kCols + kVersion] = tensors[i]._version();
    st[i * kCols + kPtr] = address(tensors[i]);
  }
}

TORCH_LIBRARY_IMPL(torchstrategies, CPU, m) {
  m.impl("agreement_hash_", &agreement_hash_);
  m.impl("agreement_record_", &agreement_record_);
}

// Metadata only (shapes, strides, dtypes) or bytes through hash_tensors (which dispatches by device), so one
// kernel serves every device's tensors, CUDA's too, in CPU and CUDA builds alike; Meta (torch.compile's
// tracing) takes the fakes of torchstrategies/ops.py.
TORCH_LIBRARY_IMPL(torchstrategies, CompositeExplicitAutograd, m) {
  m.impl("agreement_piece", &agreement_piece);
  m.impl("agreement_piece_fingerprints", &agreement_piece_fingerprints);
}

}  // namespace torchstrategies
