// Call descriptors in words (see desc.h).
#include "core/desc.h"

#include "core/combine.h"

namespace torchstrategies {
namespace core {

const char* kind_name(int32_t kind) {
  switch (kind) {
    case kAllReduce: return "all_reduce";
    case kAllGather: return "all_gather";
    case kBroadcast: return "broadcast";
    case kReduceScatter: return "reduce_scatter";
    case kBarrier: return "barrier";
    case kAllToAll: return "all_to_all";
    case kGather: return "gather";
    case kScatter: return "scatter";
    case kReduce: return "reduce";
    case kAllGatherCoalesced: return "all_gather_coalesced";
    case kAllReduceDelegated: return "all_reduce(gloo)";
  }
  return "?";
}

namespace {
bool is_reduction(int32_t kind) { return kind == kAllReduce || kind == kReduceScatter; }
}  // namespace

std::string describe(const CallDesc& d) {
  std::string s = std::string(kind_name(d.kind)) + "(";
  if (is_reduction(d.kind)) {
    s += std::string("op=") + op_name(d.op) + ", dtype=" +
         (d.dtype >= 0 && d.dtype < 6 ? dtype_name(static_cast<DType>(d.dtype)) : "?") +
         ", numel=" + std::to_string(d.count);
    if (d.parts != 1) s += ", tensors=" + std::to_string(d.parts);
  } else {
    if (d.kind == kBroadcast || d.kind == kGather || d.kind == kScatter || d.kind == kReduce) {
      s += "root=" + std::to_string(d.root) + ", ";
    }
    s += "bytes=" + std::to_string(d.count);
  }
  return s + ")";
}

std::string differences(const CallDesc& a, const CallDesc& b) {
  std::string out;
  auto add = [&out](const char* f) { out += (out.empty() ? "" : ", ") + std::string(f); };
  if (a.kind != b.kind) add("kind");
  if (a.op != b.op) add("op");
  if (a.dtype != b.dtype) add("dtype");
  if (a.count != b.count) add(is_reduction(a.kind) ? "numel" : "bytes");
  if (a.root != b.root) add("root");
  if (a.parts != b.parts) add("number of tensors");
  return out;
}

}  // namespace core
}  // namespace torchstrategies
