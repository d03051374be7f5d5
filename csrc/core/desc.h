// Call descriptors: what a rank is about to do, agreed across the ranks by every transport before the data
// is used (the shared-memory barriers, the TCP ring's first bytes), and the one place that turns a
// descriptor into words for an error message.
//
// The caller (the c10d backend) builds one descriptor per call, from its tensors and options, and hands it to
// the transport with the data; the transport compares it whole on every plan. The op and dtype fields are the
// caller's own codes (c10d's ReduceOp, torch's ScalarType): the caller installs their names for messages.
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
  kBuffer = 6,  // collectives.buffer(): every rank maps the group's shared buffer
  kAbort = 7,   // Backend::abort(): not a collective (nothing is exchanged); named in its profiler span
  kAllToAll = 10,
  kGather = 11,
  kScatter = 12,
  kReduce = 13,
  kAllGatherCoalesced = 14,
  kAllReduceDelegated = 15,   // an all-reduce of a dtype or op our kernels do not take
  kReduceScatterDelegated = 16,
  kAllReduceSparse = 17,
};

// Plain data (it is written into shared memory and onto the wire as it is).
struct CallDesc {
  int32_t kind = 0;
  int32_t op = 0;      // the caller's reduce-op code for reductions, else 0
  int32_t dtype = 0;   // the caller's dtype code (kMixedDtype: the tensors differ in dtype)
  int32_t root = 0;    // broadcast / gather / scatter / reduce root (group rank), else 0
  int64_t count = 0;   // elements, every tensor of the call together
  int32_t parts = 1;   // how many tensors the call takes
  uint32_t shape = 0;  // a hash of every tensor's element count and dtype, in order (the list's shape)
};
static_assert(sizeof(CallDesc) == 32, "CallDesc is 32 bytes of plain data");
constexpr int32_t kMixedDtype = -1;

inline bool operator==(const CallDesc& a, const CallDesc& b) {
  return a.kind == b.kind && a.op == b.op && a.dtype == b.dtype && a.root == b.root && a.count == b.count &&
         a.parts == b.parts && a.shape == b.shape;
}
inline bool operator!=(const CallDesc& a, const CallDesc& b) { return !(a == b); }

// The names of the caller's op and dtype codes in messages (default: "#<code>").
using CodeName = std::string (*)(int32_t code);
void set_code_names(CodeName op_name, CodeName dtype_name);

const char* kind_name(int32_t kind);
bool is_reduction(int32_t kind);
// e.g. "all_reduce(op=SUM, dtype=float32, numel=5)" or "broadcast(root=1, dtype=int8, numel=20, tensors=2)".
std::string describe(const CallDesc& d);
// The fields in which two descriptors differ, e.g. "kind, numel".
std::string differences(const CallDesc& a, const CallDesc& b);

}  // namespace core
}  // namespace torchstrategies
