// Call descriptors: what a rank is about to do, compared across the ranks by every transport before the
// data is used (the shared-memory barrier words, the TCP ring's first bytes), and the one place that turns
// a descriptor into words for an error message.
#pragma once

#include <cstdint>
#include <string>

namespace torchstrategies {
namespace core {

// The collective of a call. Kinds from 10 up are the collectives the backend hands to gloo: it only
// checks their descriptor on its own transport first, so a rank calling one of them while another calls
// something else is a mismatch, not a hang.
enum CallKind : int32_t {
  kAllReduce = 1,
  kAllGather = 2,
  kBroadcast = 3,
  kReduceScatter = 4,
  kBarrier = 5,
  kAllToAll = 10,
  kGather = 11,
  kScatter = 12,
  kReduce = 13,
  kAllGatherCoalesced = 14,
  kAllReduceDelegated = 15,  // an all-reduce of a dtype or op our kernels do not take
};

struct CallDesc {
  int32_t kind = kAllReduce;
  int32_t op = 0;     // core::Op for reductions (all_reduce, reduce_scatter, reduce), else 0
  int32_t dtype = 0;  // core::DType for reductions, else the caller's dtype tag
  int64_t count = 0;  // elements for reductions, else bytes per rank
  int32_t root = 0;   // broadcast / gather / scatter / reduce root (group rank), else 0
  int32_t parts = 1;  // all_reduce: how many tensors the call reduces as one buffer
};

const char* kind_name(int32_t kind);
// e.g. "all_reduce(op=SUM, dtype=float32, numel=5)" or "broadcast(root=1, bytes=20)".
std::string describe(const CallDesc& d);
// The fields in which two descriptors differ, e.g. "kind, numel".
std::string differences(const CallDesc& a, const CallDesc& b);

}  // namespace core
}  // namespace torchstrategies
