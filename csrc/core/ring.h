// Torch-free ring all-reduce over TCP (POSIX sockets): reduce-scatter + all-gather between neighbouring
// ranks, with the reduction fused into the receive.
//
// Each rank holds one connection to its right neighbour (it only sends on it) and one from its left (it only
// receives on it). Connection set-up is driven from Python through the process group's store: every rank
// listens on its own interface address (port 0, never a wildcard), publishes host:port and a random nonce,
// connects to its right neighbour and accepts from its left. The connecting side's hello carries its rank,
// the group id and the acceptor's nonce (read from the store), so a stray connection is refused.
//
// A call is one stream per direction: a 72-byte call descriptor (sequence number, the caller's descriptor of
// the call - core/desc.h - and the settings that must agree), then the data of every step back to back. The descriptor rides in the first
// write with the first step's data, so a mismatched call is seen without a separate round. Small messages
// (at most `small_bytes`) are all-gathered whole and reduced in rank order on every rank (for 2 ranks: one
// exchange); larger ones take the ring: n-1 reduce-scatter steps (received bytes go to a small staging
// buffer and are combined into the output by the core/reduce kernels as they arrive) then n-1 all-gather
// steps (received straight into the output). Sends are streamed: a step's bytes are sent as soon as the
// previous step has reduced them, so sending overlaps receiving and reducing (non-blocking sockets, poll).
// A collective here only lays out its steps; ring_call.cpp's Comm::Call runs them, the same for every one.
//
// Besides the all-reduce, the same engine runs the all-gather (n-1 steps forwarding blocks), the
// reduce-scatter (the all-reduce's first half, ending on the rank's own block), the broadcast (a pipelined
// chain from the root, closed by a one-byte token that the last rank sends round the ring once it has every
// byte - to the root, then down the chain to the last-but-one - so no rank returns before every rank has
// checked its left neighbour's descriptor) and the barrier (an all-gather
// of one byte). The descriptor carries the collective's kind and root, so two ranks calling different
// collectives are caught like two ranks reducing different sizes. A call that returns has received bytes
// that passed through every other rank after each checked its left neighbour's descriptor, so all agreed.
//
// Every wait is bounded: no progress within the timeout raises kTimeout naming the neighbour waited on; EOF
// or a reset raises kPeerDead naming the neighbour. After any error the communicator is closed (broken).
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/combine.h"
#include "core/desc.h"

namespace torchstrategies {
namespace core {
namespace ring {

// The call descriptor: the first 72 bytes of every call's stream.
struct Header {
  uint32_t magic;
  int32_t rank;  // the sender's group rank
  uint64_t group;
  uint64_t seq;
  CallDesc call;  // the caller's descriptor of the call (kind, op, dtype, root, count, tensors)
  int64_t small_bytes;
  int64_t chunk_bytes;
};
static_assert(sizeof(Header) == 72, "Header must be 72 bytes");

class RingError : public std::runtime_error {
 public:
  enum Kind { kTimeout, kPeerDead, kMismatch, kBroken };
  RingError(Kind kind, int peer, const std::string& msg) : std::runtime_error(msg), kind(kind), peer(peer) {}
  Kind kind;
  int peer;  // group rank of the neighbour at fault, or -1
  Header mine{};
  Header theirs{};
};

struct Options {
  int64_t socket_bytes = 0;  // SO_SNDBUF / SO_RCVBUF; 0 leaves the kernel's autotuning
  bool nodelay = true;       // TCP_NODELAY
};

using Desc = CallDesc;

class Comm {
 public:
  Comm(int rank, int world, uint64_t group, Options opts);
  ~Comm();
  Comm(const Comm&) = delete;
  Comm& operator=(const Comm&) = delete;

  // Binds `addr` (a numeric IPv4/IPv6 address) on port 0 and listens; returns the port.
  int listen(const std::string& addr);
  // Connects to the right neighbour (sending it `right_nonce`) while accepting the left one (which must send
  // `my_nonce`); both hellos are answered before this returns. Bounded by timeout_s.
  void establish(const std::string& right_host, int right_port, uint64_t right_nonce, uint64_t my_nonce,
                 double timeout_s);

  // Every call takes the caller's descriptor `d`, which the ranks agree on in the call's first bytes.
  // In-place all-reduce of `count` elements of `dtype` at `data`.
  void all_reduce(void* data, int64_t count, DType dtype, int op, int64_t small_bytes, int64_t chunk_bytes,
                  const Desc& d, double timeout_s);
  // out[r * nbytes, (r+1) * nbytes) = rank r's `in` (nbytes each; `in` may be this rank's block of `out`).
  // `d.kind` says what for (kAllGather, kBarrier, or a kind handed to gloo, whose descriptor this agrees on).
  void all_gather(const void* in, void* out, size_t nbytes, const Desc& d, double timeout_s);
  // Copies ring rank `root`'s nbytes at `data` into every rank's `data`.
  void broadcast(void* data, size_t nbytes, int root, const Desc& d, double timeout_s);
  // out = op over ranks of block r of `work` (world blocks of `count` elements; `work` is overwritten).
  void reduce_scatter(void* work, void* out, int64_t count, DType dtype, int op, int64_t chunk_bytes,
                      const Desc& d, double timeout_s);
  void close();

  int rank() const { return rank_; }
  int world() const { return world_; }
  bool broken() const { return broken_; }
  uint64_t seq() const { return seq_; }

 private:
  struct Step {
    char* send;
    size_t send_len;
    char* recv;
    size_t recv_len;
    bool reduce;      // combine into recv (via the staging buffer) instead of receiving into it
    bool scale_last;  // apply MEAN's scale in this step's combine
    bool after_prev;  // send only once the previous step has received everything
  };
  class Call;  // one call in progress (ring_call.cpp)
  Header header(const Desc& d, int64_t small_bytes, int64_t chunk_bytes);
  // Sends and receives every step of a call (`chunk_bytes`: the staging buffer of a reducing call; `tiny`: the
  // receive may go straight into place before the descriptor is checked, as it is private memory).
  void run(const Header& mine, std::vector<Step>& steps, DType dtype, int op, double scale,
           size_t chunk_bytes, bool tiny, double timeout_s);
  [[noreturn]] void fail(RingError::Kind kind, int peer, const std::string& msg);

  int rank_;
  int world_;
  uint64_t group_;
  Options opts_;
  int listen_fd_ = -1;
  int send_fd_ = -1;  // to the right neighbour
  int recv_fd_ = -1;  // from the left neighbour
  uint64_t seq_ = 0;
  bool broken_ = false;
  std::vector<char> stage_;
  std::vector<char> gather_;
};

}  // namespace ring
}  // namespace core
}  // namespace torchstrategies
