// The transport's collectives on each plan (see transport.h).
#include "core/transport.h"

#include <algorithm>
#include <cstring>

namespace torchstrategies {
namespace core {
namespace {

// What a hierarchical leader tells its host after the stage between hosts: ok (kind -1) or the fault.
struct Status {
  int32_t kind;
  char msg[1020];
};

}  // namespace

template <typename F>
void Transport::local_stage(const char* what, double timeout_s, F&& f) {
  try {
    f();
  } catch (const shm::CommError& e) {
    const Fault fault = shm_fault(what, e, timeout_s);
    if (plan_ == Plan::kHierarchical) publish_failure(fault);
    raise(fault);
  }
}

template <typename F>
void Transport::ring_stage(const char* what, double timeout_s, F&& f) {
  ensure_ring(timeout_s);
  try {
    f(*ring_);
  } catch (const ring::RingError& e) {
    raise(ring_fault(what, e, timeout_s));
  }
}

template <typename L, typename R>
void Transport::two_level(const char* what, double timeout_s, L&& local_first, R&& between_hosts) {
  if (local_) local_stage(what, timeout_s, local_first);
  Status st{};
  st.kind = -1;
  if (ring_rank_ >= 0 && ring_members_.size() > 1) {
    try {
      ring_stage(what, timeout_s, between_hosts);
    } catch (const Fault& f) {
      if (!local_) throw;
      st.kind = f.kind;
      std::strncpy(st.msg, f.what(), sizeof(st.msg) - 1);
    }
  }
  if (!local_) return;
  // The host's other ranks wait for the leader, which waits at most timeout_s (+ the store's bound) between
  // the hosts: give them longer, so that they report the leader's error rather than their own timeout.
  const double wait_s = timeout_s + 3 * kStoreSeconds + 1.0;
  local_stage(what, wait_s, [&] { local_->broadcast(reinterpret_cast<char*>(&st), sizeof st, 0, wait_s); });
  if (st.kind >= 0) {
    st.msg[sizeof(st.msg) - 1] = '\0';
    raise(Fault(static_cast<Fault::Kind>(st.kind), st.msg));
  }
}

void Transport::all_reduce(const std::vector<shm::Piece>& pieces, DType dtype, int op, const CallDesc& d,
                           double timeout_s) {
  begin(d);
  const size_t es = dtype_size(dtype);
  int64_t count = 0;
  for (const auto& p : pieces) count += p.count;
  if (plan_ == Plan::kShm) {
    const shm::OpReducer r(op, dtype, local_ ? local_->world() : 1);
    if (!local_) {  // a group of one
      for (const auto& p : pieces) {
        const void* xs[1] = {p.data};
        r.reduce(p.data, xs, 1, p.count);
      }
      return;
    }
    local_stage("all_reduce", timeout_s, [&] {
      if (pieces.size() == 1) {
        local_->all_reduce(pieces[0].data, pieces[0].count, r, timeout_s);  // zero-copy if in a buffer
      } else {
        local_->all_reduce_many(pieces, r, timeout_s);
      }
    });
    return;
  }
  // The ring reduces one buffer: several pieces are packed into a scratch buffer and copied back.
  char* data = pieces.size() == 1 ? pieces[0].data : nullptr;
  if (!data) {
    scratch_.resize(static_cast<size_t>(count) * es);
    data = scratch_.data();
    size_t off = 0;
    for (const auto& p : pieces) {
      std::memcpy(data + off, p.data, static_cast<size_t>(p.count) * es);
      off += static_cast<size_t>(p.count) * es;
    }
  }
  if (plan_ == Plan::kRing) {
    ring_stage("all_reduce", timeout_s, [&](ring::Comm& c) {
      c.all_reduce(data, count, dtype, op, cfg_.ring_small_bytes, cfg_.ring_chunk_bytes, d, timeout_s);
    });
  } else {
    // Inside the host, between the leaders, back inside the host; MEAN is a SUM scaled at the end.
    const int op1 = op == kMean ? kSum : op;
    const shm::OpReducer r(op1, dtype, local_ ? local_->world() : 1);
    two_level(
        "all_reduce", timeout_s, [&] { local_->all_reduce(data, count, r, timeout_s); },
        [&](ring::Comm& c) {
          c.all_reduce(data, count, dtype, op1, cfg_.ring_small_bytes, cfg_.ring_chunk_bytes, d, timeout_s);
        });
    if (local_) {
      local_stage("all_reduce", timeout_s,
                  [&] { local_->broadcast(data, static_cast<size_t>(count) * es, 0, timeout_s); });
    }
    if (op == kMean) {
      const void* xs[1] = {data};
      combine(kSum, dtype, data, xs, 1, count, true, 1.0 / cfg_.size);
    }
  }
  if (data != pieces[0].data || pieces.size() > 1) {
    size_t off = 0;
    for (const auto& p : pieces) {
      std::memcpy(p.data, data + off, static_cast<size_t>(p.count) * es);
      off += static_cast<size_t>(p.count) * es;
    }
  }
}

void Transport::broadcast(char* data, size_t nbytes, int root, const CallDesc& d, double timeout_s) {
  begin(d);
  if (plan_ == Plan::kShm) {
    if (local_) local_stage("broadcast", timeout_s, [&] { local_->broadcast(data, nbytes, root, timeout_s); });
    return;
  }
  if (plan_ == Plan::kRing) {
    ring_stage("broadcast", timeout_s, [&](ring::Comm& c) { c.broadcast(data, nbytes, root, d, timeout_s); });
    return;
  }
  const int root_host = host_of_[root];
  const auto& rh = host_ranks_[root_host];
  const int root_local = static_cast<int>(std::find(rh.begin(), rh.end(), root) - rh.begin());
  two_level(
      "broadcast", timeout_s,
      [&] {
        local_->barrier(timeout_s);  // compares the descriptor in the host
        if (host_ == root_host) local_->broadcast(data, nbytes, root_local, timeout_s);  // to the leader
      },
      // the ring of leaders is in host order
      [&](ring::Comm& c) { c.broadcast(data, nbytes, root_host, d, timeout_s); });
  if (local_ && host_ != root_host) {
    local_stage("broadcast", timeout_s, [&] { local_->broadcast(data, nbytes, 0, timeout_s); });
  }
}

void Transport::all_gather(const char* in, char* out, size_t nbytes, const CallDesc& d, double timeout_s) {
  begin(d);
  const int n = cfg_.size;
  if (plan_ == Plan::kShm) {
    if (!local_) {
      if (nbytes && out != in) std::memmove(out, in, nbytes);
      return;
    }
    local_stage("all_gather", timeout_s, [&] { local_->all_gather(in, nbytes, out, timeout_s); });
    return;
  }
  if (plan_ == Plan::kRing) {
    ring_stage("all_gather", timeout_s, [&](ring::Comm& c) { c.all_gather(in, out, nbytes, d, timeout_s); });
    return;
  }
  // Hosts may hold different numbers of ranks: each leader sends a block of the largest host's size.
  size_t most = 0;
  for (const auto& h : host_ranks_) most = std::max(most, h.size());
  const size_t block = most * nbytes, nh = host_ranks_.size();
  scratch_.assign(block * nh, 0);
  char* mine = scratch_.data() + block * static_cast<size_t>(host_);
  if (!local_ && nbytes) std::memcpy(mine, in, nbytes);  // a leader alone on its host: its own block
  two_level(
      "all_gather", timeout_s, [&] { local_->all_gather(in, nbytes, mine, timeout_s); },
      [&](ring::Comm& c) { c.all_gather(mine, scratch_.data(), block, d, timeout_s); });
  if (local_) {
    local_stage("all_gather", timeout_s, [&] { local_->broadcast(scratch_.data(), block * nh, 0, timeout_s); });
  }
  for (int g = 0; g < n; ++g) {
    const auto& h = host_ranks_[host_of_[g]];
    const size_t li = static_cast<size_t>(std::find(h.begin(), h.end(), g) - h.begin());
    if (nbytes) std::memcpy(out + nbytes * g, scratch_.data() + block * host_of_[g] + nbytes * li, nbytes);
  }
}

void Transport::reduce_scatter(const char* in, char* out, int64_t count, DType dtype, int op, const CallDesc& d,
                               double timeout_s) {
  begin(d);
  const size_t es = dtype_size(dtype), bytes = static_cast<size_t>(count) * es;
  const int n = cfg_.size;
  if (plan_ == Plan::kShm) {
    const shm::OpReducer r(op, dtype, local_ ? local_->world() : 1);
    if (!local_) {
      const void* xs[1] = {in};
      r.reduce(out, xs, 1, count);
      return;
    }
    local_stage("reduce_scatter", timeout_s, [&] { local_->reduce_scatter(in, out, count, r, timeout_s); });
    return;
  }
  scratch2_.resize(bytes * n);
  if (bytes) std::memcpy(scratch2_.data(), in, bytes * n);
  if (plan_ == Plan::kRing) {
    ring_stage("reduce_scatter", timeout_s, [&](ring::Comm& c) {
      c.reduce_scatter(scratch2_.data(), out, count, dtype, op, cfg_.ring_chunk_bytes, d, timeout_s);
    });
    return;
  }
  // Hierarchical: the whole input all-reduced, then this rank's block (simple; moves n times the output).
  all_reduce({shm::Piece{scratch2_.data(), count * n}}, dtype, op, d, timeout_s);
  if (bytes) std::memcpy(out, scratch2_.data() + bytes * cfg_.rank, bytes);
}

void Transport::barrier(double timeout_s) {
  CallDesc d;
  d.kind = kBarrier;
  check(d, timeout_s);
}

void Transport::abort() {
  if (broken_.empty()) {
    broken_ = "this rank aborted the group";
    broken_kind_ = Fault::kUnavailable;
  }
  if (local_) local_->abort(shm::CommError::kAborted);
  if (ring_) ring_->close();
}

void Transport::check(const CallDesc& d, double timeout_s) {
  begin(d);
  const char* what = kind_name(d.kind);
  char token = 0;
  std::vector<char> all(ring_members_.size());
  auto between = [&](ring::Comm& c) { c.all_gather(&token, all.data(), 1, d, timeout_s); };
  auto in_host = [&] { local_->barrier(timeout_s); };  // compares the descriptor (begin gave it)
  if (plan_ == Plan::kShm) {
    if (local_) local_stage(what, timeout_s, in_host);
  } else if (plan_ == Plan::kRing) {
    ring_stage(what, timeout_s, between);
  } else {
    two_level(what, timeout_s, in_host, between);
  }
}

char* Transport::alloc_buffer(size_t bytes_per_rank, double timeout_s, std::shared_ptr<shm::Segment>* keep) {
  CallDesc d;
  d.kind = kBuffer;
  d.count = static_cast<int64_t>(bytes_per_rank);
  begin(d);
  if (!local_ || plan_ == Plan::kRing) return nullptr;
  char* p = nullptr;
  local_stage("buffer", timeout_s, [&] { p = local_->alloc_buffer(bytes_per_rank, timeout_s, keep); });
  return p;
}

}  // namespace core
}  // namespace torchstrategies
