// Call descriptors in words (see desc.h).
#include "core/desc.h"

namespace torchstrategies {
namespace core {
namespace {

std::string code_text(int32_t code) { return "#" + std::to_string(code); }
CodeName g_op_name = code_text;
CodeName g_dtype_name = code_text;

bool has_root(int32_t kind) { return kind == kBroadcast || kind == kGather || kind == kScatter || kind == kReduce; }

}  // namespace

void set_code_names(CodeName op_name, CodeName dtype_name) {
  g_op_name = op_name ? op_name : code_text;
  g_dtype_name = dtype_name ? dtype_name : code_text;
}

const char* kind_name(int32_t kind) {
  switch (kind) {
    case kAllReduce: return "all_reduce";
    case kAllGather: return "all_gather";
    case kBroadcast: return "broadcast";
    case kReduceScatter: return "reduce_scatter";
    case kBarrier: return "barrier";
    case kBuffer: return "buffer";
    case kAbort: return "abort";
    case kAllToAll: return "all_to_all";
    case kGather: return "gather";
    case kScatter: return "scatter";
    case kReduce: return "reduce";
    case kAllGatherCoalesced: return "all_gather_coalesced";
    case kAllReduceDelegated: return "all_reduce(gloo)";
    case kReduceScatterDelegated: return "reduce_scatter(gloo)";
    case kAllReduceSparse: return "all_reduce(sparse, gloo)";
  }
  return "?";
}

bool is_reduction(int32_t kind) {
  return kind == kAllReduce || kind == kReduceScatter || kind == kReduce || kind == kAllReduceDelegated ||
         kind == kReduceScatterDelegated || kind == kAllReduceSparse;
}

std::string describe(const CallDesc& d) {
  std::string s = std::string(kind_name(d.kind)) + "(";
  if (d.kind == kBarrier) return s + ")";
  if (is_reduction(d.kind)) s += "op=" + g_op_name(d.op) + ", ";
  if (has_root(d.kind)) s += "root=" + std::to_string(d.root) + ", ";
  s += "dtype=" + (d.dtype == kMixedDtype ? std::string("mixed") : g_dtype_name(d.dtype)) +
       ", numel=" + std::to_string(d.count);
  if (d.parts != 1) s += ", tensors=" + std::to_string(d.parts);
  return s + ")";
}

std::string differences(const CallDesc& a, const CallDesc& b) {
  std::string out;
  auto add = [&out](const char* f) { out += (out.empty() ? "" : ", ") + std::string(f); };
  if (a.kind != b.kind) add("kind");
  if (a.op != b.op) add("op");
  if (a.dtype != b.dtype) add("dtype");
  if (a.count != b.count) add("numel");
  if (a.root != b.root) add("root");
  if (a.parts != b.parts) add("number of tensors");
  if (a.parts == b.parts && a.shape != b.shape) add("the tensors' shapes or dtypes");
  return out;
}

}  // namespace core
}  // namespace torchstrategies
