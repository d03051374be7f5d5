// The per-step agreement check's work on its tensors, one call a step (torchstrategies/distribute/
// agreement_step.py): which tensors moved since they were recorded, which bytes this step's piece of the
// rotating slice holds, their fingerprints (the hash of csrc/core/hash.h mixed with the tensor's dtype, shape
// and the hashed range), written into the int64 payload of the check's one MAX all-reduce.
//
// Device-agnostic glue: the bookkeeping is host work on the tensors' metadata; the bytes are hashed by
// hash_tensors through the dispatcher, so CPU and CUDA tensors take the kernel of their device. Registered
// here for the CPU key and by csrc/cuda/hash_binding.cpp for the CUDA key (an opaque op: torch.compile sees
// its fake, ops.py). `state` and `payload` are int64 CPU tensors the caller keeps per tensor list.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

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

int64_t address(const at::Tensor& t) { return static_cast<int64_t>(reinterpret_cast<intptr_t>(t.const_data_ptr())); }

// The fingerprint of elements [a, b) of t's flat view whose bytes hash to h.
int64_t mix(uint64_t h, const at::Tensor& t, int64_t a, int64_t b) {
  std::vector<int64_t> words{static_cast<int64_t>(t.scalar_type()), t.dim()};
  for (const int64_t s : t.sizes()) words.push_back(s);
  words.push_back(a);
  words.push_back(b);
  const uint64_t d = core::xxh64(reinterpret_cast<const uint8_t*>(words.data()),
                                 static_cast<int64_t>(words.size() * sizeof(int64_t)), 0);
  return static_cast<int64_t>((h ^ (d * kGolden)) & kMask63);
}

struct Item {
  int64_t index;  // position in the list
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
      slots[it.index] = mix(static_cast<uint64_t>(hp[k]), it.view, it.a, it.b);
    }
  }
}

void check_call(at::TensorList tensors, const at::Tensor& state, const at::Tensor& payload, int64_t forced_from,
                int64_t piece, int64_t slices) {
  const char* op = "agreement_hash_";
  const int64_t n = static_cast<int64_t>(tensors.size());
  check_state(op, tensors, state);
  TORCH_CHECK(payload.device().is_cpu() && payload.scalar_type() == at::kLong && payload.is_contiguous() &&
                  payload.dim() == 1 && payload.size(0) == 6 * n,
              op, ": payload must be a contiguous int64 CPU tensor of ", 6 * n, " elements, got ",
              payload.scalar_type(), " ", payload.sizes(), " on ", payload.device());
  TORCH_CHECK(0 <= forced_from && forced_from <= n, op, ": forced_from=", forced_from, " is not in [0, ", n, "]");
  TORCH_CHECK(slices >= 1 && 0 <= piece && piece < slices, op, ": piece ", piece, " of ", slices,
              " slices: expected slices >= 1 and 0 <= piece < slices");
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(tensors[i].layout() == at::kStrided, op, ": tensors[", i, "] has layout ", tensors[i].layout(),
                "; only strided (dense) tensors are hashed");
  }
}

}  // namespace

// One call a step, before the optimizer's update: flags[i] = whether tracked tensor i (i < forced_from) moved
// (version or storage) since recorded (recorded now); the moved and the forced (i >= forced_from) tensors
// hashed whole into slots[i]; each other tracked tensor's part of piece `piece` of `slices` of the tracked
// tensors' bytes laid end to end into slots[i] (a non-contiguous tensor whole, in the piece where it starts;
// 0 for a tensor with no byte in the piece). Then payload = [flags, slots, -flags, -slots, flags, slots]: the
// first 4n for the MAX all-reduce (reduced in place), the last 2n this rank's own values.
void agreement_hash_(at::TensorList tensors, const at::Tensor& state, const at::Tensor& payload,
                     int64_t forced_from, int64_t piece, int64_t slices) {
  check_call(tensors, state, payload, forced_from, piece, slices);
  const int64_t n = static_cast<int64_t>(tensors.size());
  int64_t* st = state.mutable_data_ptr<int64_t>();
  int64_t* flags = payload.mutable_data_ptr<int64_t>();
  int64_t* slots = flags + n;
  std::vector<Item> items;
  int64_t total = 0;
  for (int64_t i = 0; i < forced_from; ++i) total += tensors[i].numel() * static_cast<int64_t>(tensors[i].element_size());
  const int64_t lo = piece * total / slices, hi = (piece + 1) * total / slices;
  int64_t start = 0;
  for (int64_t i = 0; i < n; ++i) {
    const at::Tensor& t = tensors[i];
    int64_t* row = st + i * kCols;
    row[kMoved] = 0;
    slots[i] = 0;
    if (i >= forced_from) {
      items.push_back({i, t.detach(), 0, t.numel()});
    } else {
      const int64_t version = t._version(), ptr = address(t);
      const int64_t e = static_cast<int64_t>(t.element_size());
      const int64_t size = t.numel() * e, end = start + size;
      if (row[kVersion] != version || row[kPtr] != ptr) {
        row[kVersion] = version;
        row[kPtr] = ptr;
        row[kMoved] = 1;
        items.push_back({i, t.detach(), 0, t.numel()});
      } else if (end > lo && start < hi && size > 0) {
        if (!t.is_contiguous()) {
          if (lo <= start) items.push_back({i, t.detach(), 0, t.numel()});
        } else {
          const int64_t a = std::min(std::max(lo - start, int64_t{0}), size) / e;
          const int64_t b = std::min(hi - start, size) / e;
          if (b > a) items.push_back({i, t.detach().reshape(-1).slice(0, a, b), a, b});
        }
      }
      start = end;
    }
    flags[i] = row[kMoved];
  }
  hash_items(items, slots);
  for (int64_t j = 0; j < 2 * n; ++j) {
    flags[2 * n + j] = -flags[j];
    flags[4 * n + j] = flags[j];
  }
}

// After an optimizer's step: every position of `tensors` is recorded as it is now (what moved during the
// optimizer's step is its own write: no news at the next step).
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

}  // namespace torchstrategies
