// Torch-free transport of one process group: the shared-memory segment of this host (csrc/core/shm.*) and
// the TCP ring (csrc/core/ring.*), combined by a plan, behind one set of collectives on raw memory.
//
// Plans (chosen once, when the group is made, from every rank's host identity):
//   SHM           every rank on one host: the shared-memory protocol.
//   RING          the C++ TCP ring over every rank.
//   HIERARCHICAL  the shared-memory protocol inside each host, the ring between one leader per host (the
//                 host's lowest group rank), and the result shared back inside each host.
//
// Set-up goes through the rendezvous store (KeyValue): every rank publishes one row (host identity, pid,
// machine, the settings that must agree); rows that disagree on a setting raise on every rank, naming it.
//
// Every call's descriptor (the caller's, desc.h: kind, op, dtype, root, element count, list shape) is compared
// whole across the ranks before its data is used (shm: at every barrier; ring: in the first bytes of every
// call), so ranks making different calls raise kMismatch on every rank. In the
// hierarchical plan every call starts with a stage inside the host (which compares the descriptors there) and
// ends with the leader telling its host how the stage between hosts went (a small status record through shared
// memory), so a mismatch or a fault anywhere reaches every rank as the same error. After a mismatch the
// transport stays usable (the ring is rebuilt by its members on their next call); after a timeout or a gone
// peer it is broken and every later call raises at once.
//
// Errors name the rank really at fault where the processes tell (a peer on this machine that is gone or
// stopped), else what a ring member reported in the store, else the neighbour waited on. Store calls on the
// error path are bounded by kStoreSeconds, so a frozen store host (rank 0 under torchrun) cannot hang them.
#pragma once

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "core/desc.h"
#include "core/ring.h"
#include "core/shm.h"

namespace torchstrategies {
namespace core {

// Bound on one store call on an error path (reading a mismatch message, reporting a gone peer).
constexpr double kStoreSeconds = 2.0;

// What the transport needs from the rendezvous store; every call is bounded by `seconds`.
class KeyValue {
 public:
  virtual ~KeyValue() = default;
  virtual void set(const std::string& key, const std::string& value, double seconds) = 0;
  // Waits for every key (up to `seconds` in all) and returns their values; throws StoreTimeout.
  virtual std::vector<std::string> get(const std::vector<std::string>& keys, double seconds) = 0;
  // True if the key exists; false if it does not, or the store did not answer within `seconds`.
  virtual bool check(const std::string& key, double seconds) = 0;
  // Which keys exist (one answer per key), or an empty vector if the store did not answer in time.
  virtual std::vector<bool> check_all(const std::vector<std::string>& keys, double seconds) = 0;
};

class StoreTimeout : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A failed collective. kTimeout: a peer is late; kUnavailable: a peer is gone; kMismatch: the ranks made
// different calls (the transport stays usable); kInvalid: a setting differs between ranks, or bad input.
class Fault : public std::runtime_error {
 public:
  enum Kind : int32_t { kTimeout = 0, kUnavailable = 1, kMismatch = 2, kInvalid = 3 };
  Fault(Kind kind, const std::string& msg) : std::runtime_error(msg), kind(kind) {}
  Kind kind;
};

enum class Impl : int { kAuto = 0, kShm = 1, kRing = 2, kHierarchical = 3 };
enum class Plan : int { kShm = 1, kRing = 2, kHierarchical = 3 };
const char* plan_name(Plan plan);

struct Config {
  int rank = 0;
  int size = 1;
  std::vector<int64_t> global_ranks;  // group rank -> global rank
  std::string desc;                   // e.g. "group 'x' (global ranks [0, 1])", for messages
  Impl impl = Impl::kAuto;
  std::string host_id;    // TORCHSTRATEGIES_HOST_ID, else the hostname
  std::string ring_addr;  // the numeric address this rank's ring listens on
  size_t slot_bytes = 1 << 20;  // collectives/backend.py's SHM_SLOT_BYTES
  int64_t ring_small_bytes = 64 << 10;
  int64_t ring_chunk_bytes = 256 << 10;
  int64_t ring_socket_bytes = 0;
  std::vector<std::pair<std::string, std::string>> settings;  // (name, value) that must agree on every rank
};

class Transport {
 public:
  // Collective over the group (bounded by timeout_s). Throws Fault.
  Transport(Config cfg, std::shared_ptr<KeyValue> store, double timeout_s);
  ~Transport();
  Transport(const Transport&) = delete;
  Transport& operator=(const Transport&) = delete;

  Plan plan() const { return plan_; }
  const Config& config() const { return cfg_; }
  int num_hosts() const { return static_cast<int>(host_ranks_.size()); }

  // Every collective takes the caller's descriptor `d` of the call (desc.h), which the ranks agree on before
  // the data is used, on every plan: a difference raises Fault::kMismatch on every rank.
  // In place over the concatenation of `pieces` (one dtype); MEAN scales by 1 / world.
  void all_reduce(const std::vector<shm::Piece>& pieces, DType dtype, int op, const CallDesc& d, double timeout_s);
  // Group rank `root`'s nbytes at `data` into every rank's `data`.
  void broadcast(char* data, size_t nbytes, int root, const CallDesc& d, double timeout_s);
  // out[g * nbytes ...] = group rank g's `in`.
  void all_gather(const char* in, char* out, size_t nbytes, const CallDesc& d, double timeout_s);
  // out = block `rank` (of `count` elements) of `in` (world blocks) reduced over the ranks.
  void reduce_scatter(const char* in, char* out, int64_t count, DType dtype, int op, const CallDesc& d,
                      double timeout_s);
  void barrier(double timeout_s);
  // This rank leaves the group for good: its later calls raise kUnavailable, and every peer waiting in or
  // entering a collective fails at once (the shared-memory group's abort flag; the ring's sockets close).
  void abort();
  // Agreement on a descriptor only (what the backend runs before a collective it hands to gloo).
  void check(const CallDesc& d, double timeout_s);
  // Shared memory mapped by every rank of this host, for zero-copy all-reduces (collective over the group);
  // nullptr where this rank has no shared-memory group (the caller allocates ordinary memory).
  char* alloc_buffer(size_t bytes_per_rank, double timeout_s, std::shared_ptr<shm::Segment>* keep);

 private:
  void rendezvous(double timeout_s);
  void setup_shm(double timeout_s);
  void build_ring(double timeout_s);
  void ensure_ring(double timeout_s);
  // Every collective starts here: raises if the transport is broken, and gives the shared-memory group the
  // call's descriptor, which its barriers compare.
  void begin(const CallDesc& d);

  // Runs one stage on the shared-memory group / the ring, turning their errors into Faults.
  template <typename F>
  void local_stage(const char* what, double timeout_s, F&& f);
  template <typename F>
  void ring_stage(const char* what, double timeout_s, F&& f);
  Fault ring_fault(const char* what, const ring::RingError& e, double timeout_s);
  Fault shm_fault(const char* what, const shm::CommError& e, double timeout_s);
  // A hierarchical call: fn_local_first runs inside the host, then the leader runs fn_ring between the
  // hosts and tells its host the outcome; a failure of the leader is published for the other hosts.
  template <typename L, typename R>
  void two_level(const char* what, double timeout_s, L&& local_first, R&& between_hosts);
  void publish_failure(const Fault& f);
  [[noreturn]] void raise(const Fault& f);

  std::string ranks_text(const std::vector<int>& group_ranks) const;
  std::string mismatch_text(int a, const CallDesc& da, int b, const CallDesc& db, const char* note) const;
  // Group ranks on this machine whose process is gone / stopped.
  void diagnose(std::vector<int>* gone, std::vector<int>* stopped) const;
  Fault named_fault(Fault::Kind kind, const char* what, std::vector<int> ranks, double timeout_s,
                    const std::string& detail) const;

  Config cfg_;
  std::shared_ptr<KeyValue> store_;
  Plan plan_ = Plan::kShm;
  std::vector<int> pids_;                    // per group rank
  std::vector<uint64_t> machines_;           // per group rank: hash of the real hostname
  uint64_t group_id_ = 0;                    // from rank 0's row: names this group's rings
  std::vector<int> host_of_;                 // group rank -> host index (order of first appearance)
  std::vector<std::vector<int>> host_ranks_;  // host index -> its group ranks, ascending
  int host_ = 0;                             // this rank's host index
  int local_rank_ = 0;                       // index in host_ranks_[host_]
  std::unique_ptr<shm::Comm> local_;         // this host's shared-memory group (none if alone)
  std::vector<int> ring_members_;            // group ranks of the ring, in ring order (empty: no ring)
  int ring_rank_ = -1;                       // this rank's index in ring_members_, -1 if not a member
  int epoch_ = 0;                            // rings built so far in this group (the next one's number)
  std::unique_ptr<ring::Comm> ring_;
  std::string broken_;                       // the fault that broke this transport ("" while usable)
  Fault::Kind broken_kind_ = Fault::kUnavailable;
  std::vector<char> scratch_;
  std::vector<char> scratch2_;
};

}  // namespace core
}  // namespace torchstrategies
