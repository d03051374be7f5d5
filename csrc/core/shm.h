// Torch-free shared-memory collectives: a POSIX shm segment per group and a sync protocol on it.
//
// Layout of a communicator segment: a Header (one cache line of control per rank: an arrival counter,
// the rank's pid and a small call descriptor) followed by 2 staging slots per rank (double buffering).
// Every collective is a sequence of "rounds"; a round writes into the rank's own slot of parity b,
// passes a barrier, then reads peers' slots of parity b. Rounds alternate parity, and a round is always
// separated from the round two before it by a barrier, so no slot is overwritten while it is read.
//
// Waits spin briefly (up to ~50 us when every rank can have its own core; a few us otherwise), then sleep on a futex in the segment (woken
// at once by every arrival; a 5 ms timeout bounds each sleep), so that more ranks than cores, or a
// peer sharing our CPU with other jobs, still progress without burning its time slice. Every
// wait is bounded by a timeout and polls the pids of the ranks that have not arrived; a timeout, a dead
// peer or a peer that aborted raises CommError, and the communicator is marked broken (aborted in the
// header, so every other rank fails fast too). A mismatched call is different: every rank sees every
// descriptor at the barrier where they differ, so all raise there, realign their staging rounds and can
// go on using the communicator.
//
// The element-wise reduction is supplied by the caller (Reducer; OpReducer is core/combine's).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/combine.h"
#include "core/desc.h"

namespace torchstrategies {
namespace core {
namespace shm {

constexpr int kMaxRanks = 128;

struct alignas(64) RankCtl {
  std::atomic<uint64_t> arrive;  // number of barriers this rank has entered
  std::atomic<int32_t> pid;      // 0 until the rank has mapped the segment
  uint64_t desc[2][3];  // barrier descriptor per barrier parity: {kind|op|dtype, count, extra}
  CallDesc call[2];     // the caller's call descriptor per barrier parity (Comm::set_call)
};
static_assert(sizeof(RankCtl) == 128, "RankCtl must be two cache lines");

struct Header {
  uint64_t magic;
  uint64_t total_bytes;
  int32_t world;
  std::atomic<int32_t> aborted;  // 0, or 1 + the rank that gave up
  std::atomic<uint32_t> epoch;   // futex word: bumped on every arrival
  std::atomic<int32_t> waiters;  // ranks sleeping on `epoch`
  uint64_t slot_bytes;           // the creator's staging-slot size (every rank must agree)
  std::atomic<int32_t> abort_kind;  // CommError::Kind of the failure that set `aborted`
  char pad[20];
  RankCtl ranks[kMaxRanks];
};

// A mapped POSIX shared-memory object. The creator unlinks it on destruction if nobody did before.
class Segment {
 public:
  static std::shared_ptr<Segment> create(const std::string& name, size_t bytes);
  static std::shared_ptr<Segment> open(const std::string& name, size_t bytes);
  ~Segment();
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;

  void unlink();  // removes the name from /dev/shm; the mapping stays valid
  char* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& name() const { return name_; }

 private:
  Segment(std::string name, char* data, size_t size, bool linked)
      : name_(std::move(name)), data_(data), size_(size), linked_(linked) {}
  std::string name_;
  char* data_;
  size_t size_;
  bool linked_;
};

// Error kinds: the Python layer maps kTimeout/kPeerDead/kAborted to DeadlineExceededError and
// kMismatch to ValueError.
class CommError : public std::runtime_error {
 public:
  enum Kind { kTimeout, kPeerDead, kAborted, kMismatch, kBroken };
  CommError(Kind kind, const std::string& msg, std::vector<int> missing, Kind cause)
      : std::runtime_error(msg), kind(kind), cause(cause), missing(std::move(missing)) {}
  CommError(Kind kind, const std::string& msg, std::vector<int> missing)
      : CommError(kind, msg, std::move(missing), kind) {}
  Kind kind;
  Kind cause;  // for kAborted: the kind of the failure of the rank that gave up (kTimeout, kPeerDead...)
  std::vector<int> missing;
  // kMismatch: this rank's barrier descriptor {code, count, extra} and that of rank `other`, which differs.
  uint64_t mine[3] = {0, 0, 0};
  uint64_t theirs[3] = {0, 0, 0};
  CallDesc mine_call{};
  CallDesc theirs_call{};
  int other = -1;
};

// out = reduce(ins[0..n)) over `count` elements; `out` may alias ins[i].
struct Reducer {
  virtual ~Reducer() = default;
  virtual void reduce(void* out, const void* const* ins, int n, int64_t count) const = 0;
  size_t esize = 1;
  uint64_t code = 0;  // op and dtype, compared across ranks
};

// The reducer of a core::Op on a core::DType (MEAN scales by 1 / world).
struct OpReducer : Reducer {
  OpReducer(int op, DType dtype, int world)
      : op(op), dtype(dtype), scale(1.0 / world) {
    esize = dtype_size(dtype);
    code = (static_cast<uint64_t>(op) << 16) | static_cast<uint64_t>(dtype);
  }
  void reduce(void* out, const void* const* ins, int n, int64_t count) const override {
    combine(op, dtype, out, ins, n, count, op == kMean, scale);
  }
  int op;
  DType dtype;
  double scale;
};

// One tensor's storage in a multi-tensor all-reduce: `count` elements at `data`.
struct Piece {
  char* data;
  int64_t count;
};

class Comm {
 public:
  // Rank 0 creates the segment (create=true), the others open it by name.
  Comm(const std::string& name, int rank, int world, size_t slot_bytes, bool create);
  ~Comm() = default;

  // Publishes this rank's pid, waits for every rank to map the segment, then rank 0 unlinks it.
  void attach(double timeout_s);
  // Creator only, before attach: the pids of the other ranks (learnt out of band), so that a rank that
  // dies before it maps the segment is noticed in attach instead of after the whole timeout.
  void expect_pids(const std::vector<int>& pids);
  // Marks the group failed (e.g. a later stage of a hierarchical collective failed): every rank waiting in
  // or entering a collective of this group raises kAborted with `cause` at once.
  void abort(CommError::Kind cause);
  // The caller's descriptor of the call the next barriers belong to: compared, whole, at every barrier (so the
  // first barrier of a call catches any difference), besides the protocol's own barrier descriptor.
  void set_call(const CallDesc& d) { call_ = d; }

  void all_reduce(char* data, int64_t count, const Reducer& r, double timeout_s);
  // All-reduces several buffers of one dtype in place, as if they were one concatenated buffer (no packing:
  // each rank reads its own slice straight from the pieces and copies in only what the peers reduce).
  void all_reduce_many(const std::vector<Piece>& pieces, const Reducer& r, double timeout_s);
  void broadcast(char* data, size_t nbytes, int root, double timeout_s);
  void all_gather(const char* in, size_t nbytes, char* out, double timeout_s);
  // out = r's block of `in` (world blocks of `count` elements) reduced over the ranks; `in` is not written.
  void reduce_scatter(const char* in, char* out, int64_t count, const Reducer& r, double timeout_s);
  void barrier(double timeout_s);

  // Collective: a segment holding `bytes_per_rank` for every rank; returns this rank's part.
  char* alloc_buffer(size_t bytes_per_rank, double timeout_s, std::shared_ptr<Segment>* keep);
  // True if [p, p+nbytes) lies inside this rank's part of a buffer from alloc_buffer.
  bool in_buffer(const char* p, size_t nbytes) const;

  int rank() const { return rank_; }
  int world() const { return world_; }
  bool broken() const { return broken_; }
  const std::string& name() const { return seg_->name(); }
  size_t slot_bytes() const { return slot_bytes_; }
  // Messages up to this many bytes take the one-shot path (each rank reduces the whole message).
  size_t one_shot_bytes = 64 * 1024;

 private:
  struct Buffer {
    std::shared_ptr<Segment> seg;
    size_t stride;
  };
  char* slot(int r, int b) const {
    return data_ + (static_cast<size_t>(r) * 2 + static_cast<size_t>(b)) * slot_bytes_;
  }
  void sync(uint64_t d0, uint64_t d1, uint64_t d2, double timeout_s, const char* what);
  void wait_all(uint64_t target, double timeout_s, const char* what);
  void notify();
  [[noreturn]] void fail(CommError::Kind kind, const std::string& msg, std::vector<int> missing);
  void check_usable() const;
  void zero_copy_all_reduce(char* data, int64_t count, const Reducer& r, const Buffer& buf,
                            double timeout_s);

  std::shared_ptr<Segment> seg_;
  Header* hdr_;
  char* data_;
  int rank_;
  int world_;
  size_t slot_bytes_;
  uint64_t seq_ = 0;    // barriers entered
  uint64_t round_ = 0;  // staging rounds (slot parity)
  CallDesc call_{};
  bool broken_ = false;
  std::vector<Buffer> buffers_;
};

// Unlinks every segment this process created and has not unlinked yet. Called at exit and on SIGTERM (a
// launcher killing a rank that waits in attach must not leave a segment in /dev/shm).
void unlink_pending_segments();

// Size of a communicator segment for `world` ranks with `slot_bytes` per staging slot.
size_t segment_bytes(int world, size_t slot_bytes);

}  // namespace shm
}  // namespace core
}  // namespace torchstrategies
