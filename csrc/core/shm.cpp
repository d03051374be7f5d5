// Shared-memory segment and sync protocol (see shm.h for the design).
#include "core/shm.h"

#include "core/cpus.h"

#include <errno.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <sstream>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define TS_CPU_RELAX() _mm_pause()
#else
#define TS_CPU_RELAX() ((void)0)
#endif

namespace torchstrategies {
namespace core {
namespace shm {
namespace {

constexpr uint64_t kMagic = 0x7473747261747368ULL;  // "tsstrash"
constexpr size_t kAlign = 4096;
// Block of the reduce-then-publish loop: small enough to stay in L1 between the reduce and the copy.
constexpr size_t kReduceBlockBytes = 16 * 1024;

size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

double now_s() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// A pid is dead if it no longer exists or is a zombie (exited, not yet reaped by its parent).
bool pid_dead(int pid) {
  if (pid <= 0) return false;
  if (kill(pid, 0) != 0) return errno == ESRCH;
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%d/stat", pid);
  FILE* f = std::fopen(path, "r");
  if (!f) return false;
  char buf[512];
  const size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  buf[n] = '\0';
  const char* p = std::strrchr(buf, ')');
  if (!p || p[1] == '\0' || p[2] == '\0') return false;
  return p[2] == 'Z' || p[2] == 'X';
}

std::string join(const std::vector<int>& v) {
  std::ostringstream s;
  s << "[";
  for (size_t i = 0; i < v.size(); ++i) s << (i ? ", " : "") << v[i];
  s << "]";
  return s.str();
}

std::string sys_error(const char* what, const std::string& name) {
  return std::string("shared memory: ") + what + " '" + name + "' failed: " + std::strerror(errno);
}

// Slice [lo, hi) of `count` elements owned by `r`, boundaries aligned to 64 bytes.
void slice_of(int64_t count, size_t esize, int world, int r, int64_t* lo, int64_t* hi) {
  const int64_t align = std::max<int64_t>(1, 64 / static_cast<int64_t>(esize));
  int64_t per = (count + world - 1) / world;
  per = (per + align - 1) / align * align;
  *lo = std::min<int64_t>(count, per * r);
  *hi = std::min<int64_t>(count, per * (r + 1));
}

void futex_wait(std::atomic<uint32_t>* addr, uint32_t expected, double seconds) {
  timespec ts;
  ts.tv_sec = static_cast<time_t>(seconds);
  ts.tv_nsec = static_cast<long>((seconds - static_cast<double>(ts.tv_sec)) * 1e9);
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void futex_wake(std::atomic<uint32_t>* addr) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), FUTEX_WAKE, 0x7fffffff, nullptr, nullptr, 0);
}

// Names of segments created by this process and not yet unlinked, for the exit / SIGTERM clean-up.
// Fixed storage: the signal handler may only touch plain memory and call async-signal-safe functions.
constexpr int kPendingMax = 64;
constexpr int kNameMax = 96;
char g_pending[kPendingMax][kNameMax];
std::atomic<int> g_pending_used[kPendingMax];
struct sigaction g_prev_term;
std::atomic<bool> g_handlers_installed{false};

void on_sigterm(int sig) {
  unlink_pending_segments();
  // Hand the signal on: to the handler that was there before, else the default action (terminate).
  if (g_prev_term.sa_handler != SIG_DFL && g_prev_term.sa_handler != SIG_IGN &&
      !(g_prev_term.sa_flags & SA_SIGINFO)) {
    g_prev_term.sa_handler(sig);
    return;
  }
  if (g_prev_term.sa_handler == SIG_IGN) return;
  signal(sig, SIG_DFL);
  raise(sig);
}

void install_handlers() {
  bool expected = false;
  if (!g_handlers_installed.compare_exchange_strong(expected, true)) return;
  std::atexit(unlink_pending_segments);
  struct sigaction sa;
  std::memset(&sa, 0, sizeof(sa));
  sa.sa_handler = on_sigterm;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGTERM, &sa, &g_prev_term);
}

void remember_pending(const std::string& name) {
  if (name.size() >= static_cast<size_t>(kNameMax)) return;
  install_handlers();
  for (int i = 0; i < kPendingMax; ++i) {
    int expected = 0;
    if (g_pending_used[i].compare_exchange_strong(expected, 2)) {  // 2: being written
      std::memcpy(g_pending[i], name.c_str(), name.size() + 1);
      g_pending_used[i].store(1, std::memory_order_release);
      return;
    }
  }
}

void forget_pending(const std::string& name) {
  for (int i = 0; i < kPendingMax; ++i) {
    if (g_pending_used[i].load(std::memory_order_acquire) == 1 && name == g_pending[i]) {
      g_pending_used[i].store(0, std::memory_order_release);
      return;
    }
  }
}

}  // namespace

void unlink_pending_segments() {
  for (int i = 0; i < kPendingMax; ++i) {
    if (g_pending_used[i].load(std::memory_order_acquire) == 1) {
      shm_unlink(g_pending[i]);
      g_pending_used[i].store(0, std::memory_order_release);
    }
  }
}

size_t segment_bytes(int world, size_t slot_bytes) {
  return round_up(sizeof(Header), kAlign) + static_cast<size_t>(world) * 2 * slot_bytes;
}

std::shared_ptr<Segment> Segment::create(const std::string& name, size_t bytes) {
  const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) throw std::runtime_error(sys_error("shm_open(create)", name));
  int rc = ftruncate(fd, static_cast<off_t>(bytes));
  if (rc == 0) rc = posix_fallocate(fd, 0, static_cast<off_t>(bytes)) == 0 ? 0 : -1;
  if (rc != 0) {
    const std::string msg = sys_error("reserving bytes for", name) + " (is /dev/shm full?)";
    close(fd);
    shm_unlink(name.c_str());
    throw std::runtime_error(msg);
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) {
    const std::string msg = sys_error("mmap", name);
    shm_unlink(name.c_str());
    throw std::runtime_error(msg);
  }
  remember_pending(name);
  return std::shared_ptr<Segment>(new Segment(name, static_cast<char*>(p), bytes, true));
}

std::shared_ptr<Segment> Segment::open(const std::string& name, size_t bytes) {
  const int fd = shm_open(name.c_str(), O_RDWR, 0600);
  if (fd < 0) throw std::runtime_error(sys_error("shm_open", name));
  struct stat st;
  if (fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) < bytes) {
    close(fd);
    throw std::runtime_error("shared memory: segment '" + name + "' is smaller than expected (" +
                             std::to_string(bytes) + " bytes)");
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) throw std::runtime_error(sys_error("mmap", name));
  return std::shared_ptr<Segment>(new Segment(name, static_cast<char*>(p), bytes, false));
}

Segment::~Segment() {
  unlink();
  if (data_) munmap(data_, size_);
}

void Segment::unlink() {
  if (linked_) {
    shm_unlink(name_.c_str());
    forget_pending(name_);
    linked_ = false;
  }
}

Comm::Comm(const std::string& name, int rank, int world, size_t slot_bytes, bool create)
    : rank_(rank), world_(world), slot_bytes_(round_up(std::max<size_t>(slot_bytes, kAlign), kAlign)) {
  if (world < 1 || world > kMaxRanks || rank < 0 || rank >= world) {
    throw std::invalid_argument("shared memory: bad rank " + std::to_string(rank) + " of world " +
                                std::to_string(world) + " (at most " + std::to_string(kMaxRanks) + ")");
  }
  const size_t bytes = segment_bytes(world, slot_bytes_);
  seg_ = create ? Segment::create(name, bytes) : Segment::open(name, bytes);
  hdr_ = reinterpret_cast<Header*>(seg_->data());
  data_ = seg_->data() + round_up(sizeof(Header), kAlign);
  if (create) {
    hdr_->magic = kMagic;
    hdr_->total_bytes = bytes;
    hdr_->world = world;
    hdr_->slot_bytes = slot_bytes_;
  } else if (hdr_->magic != kMagic || hdr_->world != world) {
    throw std::runtime_error("shared memory: segment '" + name + "' was created for world " +
                             std::to_string(hdr_->world) + ", this rank expects " + std::to_string(world));
  } else if (hdr_->slot_bytes != slot_bytes_) {
    throw std::runtime_error("shared memory: segment '" + name + "' was created with slot bytes " +
                             std::to_string(hdr_->slot_bytes) + ", this rank uses " +
                             std::to_string(slot_bytes_) +
                             " (TORCHSTRATEGIES_SHM_SLOT_BYTES must be the same on every rank)");
  }
}

void Comm::attach(double timeout_s) {
  hdr_->ranks[rank_].pid.store(static_cast<int32_t>(getpid()), std::memory_order_release);
  // The creator set magic before publishing the name; a barrier proves every rank has mapped it.
  sync(0xA77AC4, 0, 0, timeout_s, "attach");
  if (rank_ == 0) seg_->unlink();
}

void Comm::expect_pids(const std::vector<int>& pids) {
  for (int j = 0; j < world_ && j < static_cast<int>(pids.size()); ++j) {
    int32_t expected = 0;
    if (j != rank_) hdr_->ranks[j].pid.compare_exchange_strong(expected, static_cast<int32_t>(pids[j]));
  }
}

void Comm::abort(CommError::Kind cause) {
  broken_ = true;
  hdr_->abort_kind.store(static_cast<int32_t>(cause), std::memory_order_relaxed);
  int expected = 0;
  hdr_->aborted.compare_exchange_strong(expected, rank_ + 1);
  notify();
}

void Comm::notify() {
  hdr_->epoch.fetch_add(1, std::memory_order_seq_cst);
  if (hdr_->waiters.load(std::memory_order_seq_cst) > 0) futex_wake(&hdr_->epoch);
}

void Comm::fail(CommError::Kind kind, const std::string& msg, std::vector<int> missing) {
  broken_ = true;
  int expected = 0;
  if (hdr_->aborted.load(std::memory_order_relaxed) == 0) {
    hdr_->abort_kind.store(static_cast<int32_t>(kind), std::memory_order_relaxed);
  }
  hdr_->aborted.compare_exchange_strong(expected, rank_ + 1);
  notify();
  throw CommError(kind, msg, std::move(missing));
}

void Comm::check_usable() const {
  if (broken_) {
    throw CommError(CommError::kBroken,
                    "shared-memory communicator '" + seg_->name() +
                        "' is broken by an earlier error (a timeout or a dead peer); "
                        "create a new group",
                    {});
  }
}

void Comm::wait_all(uint64_t target, double timeout_s, const char* what) {
  auto all_arrived = [&] {
    for (int j = 0; j < world_; ++j) {
      if (hdr_->ranks[j].arrive.load(std::memory_order_acquire) < target) return false;
    }
    return true;
  };
  // Spin budget: spinning only helps while the missing ranks can run at the same time as us. With more
  // ranks than CPUs, go to sleep almost at once and let the kernel run them; else spin up to 50 us.
  // (A shorter spin when a missing rank last arrived on our own CPU was dropped by measurement, issue 41:
  // in DDP/MWMS training, where a rank's threads move between CPUs, it made MWMS 87.4% / 88.0% of the
  // no-communication rate against 92.6% / 91.8% with 50 us always; docs/collectives.md.)
  static const long ncpu = core::usable_cpus();  // this process's CPUs: affinity and cgroup quota
  // TORCHSTRATEGIES_SHM_SPIN_US=N forces a spin budget of N microseconds in every case (for tuning).
  static const double forced_spin_s = [] {
    const char* v = std::getenv("TORCHSTRATEGIES_SHM_SPIN_US");
    return v && *v ? std::max(0.0, std::atof(v)) * 1e-6 : -1.0;
  }();
  const bool oversubscribed = world_ > ncpu;
  double start = -1.0, last_live = 0.0;
  double spin_s = oversubscribed ? 3e-6 : 50e-6;
  for (uint64_t iter = 0;; ++iter) {
    // A peer that gave up fails every later barrier, even one whose counters are all in place.
    const int ab = hdr_->aborted.load(std::memory_order_acquire);
    if (ab == 0 && all_arrived()) return;
    if (ab != 0) {
      broken_ = true;
      const auto cause = static_cast<CommError::Kind>(hdr_->abort_kind.load(std::memory_order_relaxed));
      const char* why = cause == CommError::kTimeout ? "a peer did not arrive in time"
                        : cause == CommError::kPeerDead ? "a peer is gone"
                        : cause == CommError::kAborted  ? "it left the group"
                                                        : "an earlier failure";
      throw CommError(CommError::kAborted,
                      std::string(what) + ": rank " + std::to_string(ab - 1) +
                          " gave up on this shared-memory group (" + why + ")",
                      {ab - 1}, cause);
    }
    if (iter < 64 || (iter & 15) != 0) {
      TS_CPU_RELAX();
      continue;
    }
    const double t = now_s();
    if (start < 0) {
      start = last_live = t;
      if (forced_spin_s >= 0) spin_s = forced_spin_s;
    }
    const double waited = t - start;
    if (waited < spin_s) {
      TS_CPU_RELAX();
      continue;
    }
    // Sleep until some rank arrives (it bumps `epoch` and wakes us) or 5 ms pass.
    const uint32_t e = hdr_->epoch.load(std::memory_order_seq_cst);
    hdr_->waiters.fetch_add(1, std::memory_order_seq_cst);
    if (!all_arrived() && hdr_->aborted.load(std::memory_order_relaxed) == 0) futex_wait(&hdr_->epoch, e, 0.005);
    hdr_->waiters.fetch_sub(1, std::memory_order_seq_cst);
    const double t2 = now_s();
    const bool check_live = t2 - last_live > 0.02;
    const bool timed_out = t2 - start > timeout_s;
    if (!check_live && !timed_out) continue;
    last_live = t2;
    std::vector<int> missing, dead;
    for (int j = 0; j < world_; ++j) {
      if (hdr_->ranks[j].arrive.load(std::memory_order_acquire) < target) {
        missing.push_back(j);
        if (pid_dead(hdr_->ranks[j].pid.load(std::memory_order_relaxed))) dead.push_back(j);
      }
    }
    if (missing.empty()) return;
    if (!dead.empty()) {
      std::ostringstream s;
      s << what << ": ranks " << join(missing) << " did not arrive; ranks " << join(dead)
        << " died (process gone) after " << (t2 - start) << " s";
      fail(CommError::kPeerDead, s.str(), missing);
    }
    if (timed_out) {
      std::ostringstream s;
      s << what << ": ranks " << join(missing) << " did not arrive within " << timeout_s << " s";
      fail(CommError::kTimeout, s.str(), missing);
    }
  }
}

void Comm::sync(uint64_t d0, uint64_t d1, uint64_t d2, double timeout_s, const char* what) {
  const uint64_t target = ++seq_;
  const int par = static_cast<int>(target & 1);
  RankCtl& me = hdr_->ranks[rank_];
  me.desc[par][0] = d0;
  me.desc[par][1] = d1;
  me.desc[par][2] = d2;
  me.call[par] = call_;
  me.arrive.store(target, std::memory_order_release);
  if (world_ == 1) return;
  notify();
  wait_all(target, timeout_s, what);
  for (int j = 0; j < world_; ++j) {
    const uint64_t* d = hdr_->ranks[j].desc[par];
    const CallDesc& c = hdr_->ranks[j].call[par];
    if (d[0] != d0 || d[1] != d1 || d[2] != d2 || c != call_) {
      std::ostringstream s;
      s << what << ": mismatched calls across ranks: rank " << rank_ << " called " << describe(call_) << " {code "
        << std::hex << d0 << std::dec << ", count " << d1 << ", extra " << d2 << "} but rank " << j << " called "
        << describe(c) << " {code " << std::hex << d[0] << std::dec << ", count " << d[1] << ", extra " << d[2]
        << "} (code = kind<<32 | op<<16 | dtype; count = elements or bytes)";
      round_ = seq_;  // every rank raises at this barrier: realign the slot parity and stay usable
      CommError e(CommError::kMismatch, s.str(), {j});
      std::memcpy(e.mine, me.desc[par], sizeof e.mine);
      std::memcpy(e.theirs, d, sizeof e.theirs);
      e.mine_call = call_;
      e.theirs_call = c;
      e.other = j;
      throw e;
    }
  }
}

void Comm::barrier(double timeout_s) {
  check_usable();
  sync(0xBA, 0, 0, timeout_s, "barrier");
}

void Comm::reduce_scatter(const char* in, char* out, int64_t count, const Reducer& r, double timeout_s) {
  check_usable();
  const size_t es = r.esize;
  if (world_ == 1) {
    const void* xs[1] = {in};
    if (count > 0) r.reduce(out, xs, 1, count);
    return;
  }
  const uint64_t code = (6ULL << 32) | r.code;
  // Each round moves `per` elements of every block: this rank's slot holds them block after block.
  const int64_t per = std::max<int64_t>(1, static_cast<int64_t>(slot_bytes_ / es) / world_);
  std::vector<const void*> ins(world_);
  int64_t off = 0;
  do {
    const int64_t c = std::min(per, count - off);
    const int b = static_cast<int>(round_++ & 1);
    for (int j = 0; j < world_; ++j) {
      std::memcpy(slot(rank_, b) + static_cast<size_t>(j * c) * es, in + static_cast<size_t>(j * count + off) * es,
                  static_cast<size_t>(c) * es);
    }
    sync(code, static_cast<uint64_t>(count), static_cast<uint64_t>(off), timeout_s, "reduce_scatter");
    for (int j = 0; j < world_; ++j) ins[j] = slot(j, b) + static_cast<size_t>(rank_ * c) * es;
    if (c > 0) r.reduce(out + static_cast<size_t>(off) * es, ins.data(), world_, c);
    off += c;
  } while (off < count);
}

void Comm::all_reduce(char* data, int64_t count, const Reducer& r, double timeout_s) {
  check_usable();
  const size_t nbytes = static_cast<size_t>(count) * r.esize;
  if (world_ > 1) {
    for (const Buffer& b : buffers_) {
      const char* base = b.seg->data() + static_cast<size_t>(rank_) * b.stride;
      // Small messages are cheaper through the one-shot path (1 barrier instead of 3).
      if (nbytes > one_shot_bytes && data >= base && data + nbytes <= base + b.stride) {
        zero_copy_all_reduce(data, count, r, b, timeout_s);
        return;
      }
    }
  }
  all_reduce_many({Piece{data, count}}, r, timeout_s);
}

namespace {

// Calls fn(ptr, v, n) for each contiguous part of the virtual element range [lo, hi) of the concatenation
// of `pieces` (starts[i] = index of pieces[i]'s first element): ptr is element v, n elements follow it.
template <typename F>
void for_range(const std::vector<Piece>& pieces, const std::vector<int64_t>& starts, size_t es, int64_t lo,
               int64_t hi, F&& fn) {
  if (hi <= lo) return;
  size_t i = static_cast<size_t>(std::upper_bound(starts.begin(), starts.end(), lo) - starts.begin()) - 1;
  for (int64_t v = lo; v < hi; ++i) {
    const int64_t end = starts[i] + pieces[i].count;
    if (end <= v) continue;  // an empty piece
    const int64_t n = std::min(hi, end) - v;
    fn(pieces[i].data + static_cast<size_t>(v - starts[i]) * es, v, n);
    v += n;
  }
}

}  // namespace

void Comm::all_reduce_many(const std::vector<Piece>& pieces, const Reducer& r, double timeout_s) {
  check_usable();
  const uint64_t code = (1ULL << 32) | r.code;
  const size_t es = r.esize;
  std::vector<int64_t> starts(pieces.size());
  int64_t count = 0;
  for (size_t i = 0; i < pieces.size(); ++i) {
    starts[i] = count;
    count += pieces[i].count;
  }
  const size_t nbytes = static_cast<size_t>(count) * es;
  if (world_ == 1) {
    for (const Piece& p : pieces) {
      const void* in[1] = {p.data};
      if (p.count > 0) r.reduce(p.data, in, 1, p.count);  // applies MEAN's scale (1) and nothing else
    }
    return;
  }
  // The descriptor's third word also carries the number of pieces, so ranks that pass different lists of
  // the same total size get a mismatch error instead of silently pairing different tensors.
  const uint64_t npieces = static_cast<uint64_t>(pieces.size()) << 40;
  std::vector<const void*> ins(world_);
  if (nbytes <= one_shot_bytes && nbytes <= slot_bytes_) {
    const int b = static_cast<int>(round_++ & 1);
    for_range(pieces, starts, es, 0, count, [&](char* p, int64_t v, int64_t n) {
      std::memcpy(slot(rank_, b) + v * es, p, static_cast<size_t>(n) * es);
    });
    sync(code, static_cast<uint64_t>(count), npieces, timeout_s, "all_reduce");
    for_range(pieces, starts, es, 0, count, [&](char* p, int64_t v, int64_t n) {
      for (int j = 0; j < world_; ++j) ins[j] = slot(j, b) + v * es;
      r.reduce(p, ins.data(), world_, n);
    });
    return;
  }
  const int64_t chunk = static_cast<int64_t>(slot_bytes_ / es);
  const int64_t block = std::max<int64_t>(1, static_cast<int64_t>(kReduceBlockBytes / es));
  for (int64_t off = 0; off < count; off += chunk) {
    const int64_t c = std::min(chunk, count - off);
    const int b = static_cast<int>(round_++ & 1);
    const uint64_t extra = npieces | static_cast<uint64_t>(off);
    auto at = [&](int j, int64_t v) { return slot(j, b) + static_cast<size_t>(v - off) * es; };
    int64_t lo, hi;
    // Copy in only the slices the peers reduce; this rank's own slice is read straight from the pieces.
    for (int j = 0; j < world_; ++j) {
      if (j == rank_) continue;
      slice_of(c, es, world_, j, &lo, &hi);
      for_range(pieces, starts, es, off + lo, off + hi, [&](char* p, int64_t v, int64_t n) {
        std::memcpy(at(rank_, v), p, static_cast<size_t>(n) * es);
      });
    }
    sync(code, static_cast<uint64_t>(count), extra, timeout_s, "all_reduce");
    // Reduce this rank's slice in place, block by block, and publish each block to our slot while it is
    // still in L1: the caller's tensors get their own slice without a second pass over the slot.
    slice_of(c, es, world_, rank_, &lo, &hi);
    for_range(pieces, starts, es, off + lo, off + hi, [&](char* p, int64_t v, int64_t n) {
      for (int64_t a = 0; a < n; a += block) {
        const int64_t m = std::min(block, n - a);
        char* mine = p + static_cast<size_t>(a) * es;
        for (int j = 0; j < world_; ++j) ins[j] = j == rank_ ? mine : at(j, v + a);
        r.reduce(mine, ins.data(), world_, m);
        std::memcpy(at(rank_, v + a), mine, static_cast<size_t>(m) * es);
      }
    });
    sync(code, static_cast<uint64_t>(count), extra, timeout_s, "all_reduce");
    for (int j = 0; j < world_; ++j) {
      if (j == rank_) continue;
      slice_of(c, es, world_, j, &lo, &hi);
      for_range(pieces, starts, es, off + lo, off + hi, [&](char* p, int64_t v, int64_t n) {
        std::memcpy(p, at(j, v), static_cast<size_t>(n) * es);
      });
    }
  }
}

void Comm::zero_copy_all_reduce(char* data, int64_t count, const Reducer& r, const Buffer& buf,
                                double timeout_s) {
  const size_t es = r.esize;
  const size_t offset = static_cast<size_t>(data - (buf.seg->data() + static_cast<size_t>(rank_) * buf.stride));
  const uint64_t code = (2ULL << 32) | r.code;
  auto peer = [&](int j) { return buf.seg->data() + static_cast<size_t>(j) * buf.stride + offset; };
  sync(code, static_cast<uint64_t>(count), offset, timeout_s, "all_reduce(zero-copy)");
  int64_t lo, hi;
  slice_of(count, es, world_, rank_, &lo, &hi);
  if (hi > lo) {
    std::vector<const void*> ins(world_);
    for (int j = 0; j < world_; ++j) ins[j] = peer(j) + lo * es;
    r.reduce(data + lo * es, ins.data(), world_, hi - lo);
  }
  sync(code, static_cast<uint64_t>(count), offset, timeout_s, "all_reduce(zero-copy)");
  for (int j = 0; j < world_; ++j) {
    if (j == rank_) continue;
    slice_of(count, es, world_, j, &lo, &hi);
    if (hi > lo) std::memcpy(data + lo * es, peer(j) + lo * es, (hi - lo) * es);
  }
  // Nobody may return (and let its caller overwrite the buffer) while a peer still copies from it.
  sync(code, static_cast<uint64_t>(count), offset, timeout_s, "all_reduce(zero-copy)");
}

void Comm::broadcast(char* data, size_t nbytes, int root, double timeout_s) {
  check_usable();
  if (root < 0 || root >= world_) {
    throw std::invalid_argument("broadcast: root " + std::to_string(root) + " is not a rank of a group of " +
                                std::to_string(world_));
  }
  if (world_ == 1) return;
  const uint64_t code = (3ULL << 32);
  size_t off = 0;
  do {
    const size_t c = std::min(slot_bytes_, nbytes - off);
    const int b = static_cast<int>(round_++ & 1);
    if (rank_ == root) std::memcpy(slot(root, b), data + off, c);
    sync(code, nbytes, static_cast<uint64_t>(root), timeout_s, "broadcast");
    if (rank_ != root) std::memcpy(data + off, slot(root, b), c);
    off += c;
  } while (off < nbytes);
}

void Comm::all_gather(const char* in, size_t nbytes, char* out, double timeout_s) {
  check_usable();
  if (world_ == 1) {
    if (out != in && nbytes) std::memmove(out, in, nbytes);
    return;
  }
  const uint64_t code = (4ULL << 32);
  size_t off = 0;
  do {
    const size_t c = std::min(slot_bytes_, nbytes - off);
    const int b = static_cast<int>(round_++ & 1);
    std::memcpy(slot(rank_, b), in + off, c);
    sync(code, nbytes, 0, timeout_s, "all_gather");
    for (int j = 0; j < world_; ++j) std::memcpy(out + static_cast<size_t>(j) * nbytes + off, slot(j, b), c);
    off += c;
  } while (off < nbytes);
}

char* Comm::alloc_buffer(size_t bytes_per_rank, double timeout_s, std::shared_ptr<Segment>* keep) {
  check_usable();
  const size_t stride = round_up(std::max<size_t>(bytes_per_rank, 64), kAlign);
  const std::string name = seg_->name() + "_b" + std::to_string(buffers_.size());
  const size_t total = stride * static_cast<size_t>(world_);
  std::shared_ptr<Segment> s;
  if (rank_ == 0) {
    try {
      s = Segment::create(name, total);
    } catch (const std::exception& e) {
      fail(CommError::kBroken, e.what(), {});  // sets `aborted`, so the peers fail fast too
    }
  }
  sync(5ULL << 32, bytes_per_rank, 0, timeout_s, "alloc_buffer(create)");
  if (rank_ != 0) {
    try {
      s = Segment::open(name, total);
    } catch (const std::exception& e) {
      fail(CommError::kBroken, e.what(), {});
    }
  }
  sync(5ULL << 32, bytes_per_rank, 1, timeout_s, "alloc_buffer(map)");
  if (rank_ == 0) s->unlink();
  buffers_.push_back(Buffer{s, stride});
  if (keep) *keep = s;
  return s->data() + static_cast<size_t>(rank_) * stride;
}

bool Comm::in_buffer(const char* p, size_t nbytes) const {
  for (const Buffer& b : buffers_) {
    const char* base = b.seg->data() + static_cast<size_t>(rank_) * b.stride;
    if (p >= base && p + nbytes <= base + b.stride) return true;
  }
  return false;
}

}  // namespace shm
}  // namespace core
}  // namespace torchstrategies
