// The engine of one TCP ring call (see ring.h for the protocol): Comm::run makes a Comm::Call and drives it.
//
// Set-up (the constructor): the cursors, the staging buffer, and for a large call the sender thread. Then, in
// turn until both directions are done: the send pump (one non-blocking write of what the steps allow: the
// descriptor, then each step's bytes once the step before has received and reduced them), and the receive
// and reduce (one non-blocking read from the left: the rest of the descriptor, which is checked as soon as it
// is complete, then the current step's bytes; bytes of a reducing step go to the staging buffer and are
// combined into place). When neither moved, a bounded wait on the sockets. Finish: join the sender thread.
//
// A call sending at least TORCHSTRATEGIES_RING_THREAD_BYTES (4 MiB) runs its send pump on a second thread, so
// that the copies into the socket run beside the receive and the reduce (two cores' worth of copying, as a
// full-duplex link needs); the receiving side publishes how many received bytes it has processed, which is
// exactly how far the sender may go (a step sends what the step before received).
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "core/ring.h"
#include "core/ring_io.h"

namespace torchstrategies {
namespace core {
namespace ring {
namespace {

constexpr size_t kThreadBytes = 4 << 20;

size_t thread_bytes() {
  static const size_t bytes = [] {
    const char* v = std::getenv("TORCHSTRATEGIES_RING_THREAD_BYTES");
    return v && *v ? static_cast<size_t>(std::strtoull(v, nullptr, 10)) : kThreadBytes;
  }();
  return bytes;
}

// One non-blocking sendmsg of what is left of the call descriptor (from *hdr_done) followed by up to `len`
// bytes at `data`. Returns the data bytes written (advancing *hdr_done past the descriptor bytes written),
// kWouldBlock when the socket took nothing, or kSendFailed on a connection error (errno says which).
constexpr ssize_t kWouldBlock = -1;
constexpr ssize_t kSendFailed = -2;
ssize_t send_some(int fd, const Header& h, size_t* hdr_done, const char* data, size_t len) {
  iovec iov[2];
  int k = 0;
  if (*hdr_done < sizeof(Header)) {
    iov[k++] = {reinterpret_cast<char*>(const_cast<Header*>(&h)) + *hdr_done, sizeof(Header) - *hdr_done};
  }
  if (len) iov[k++] = {const_cast<char*>(data), len};
  if (k == 0) return 0;
  msghdr mh{};
  mh.msg_iov = iov;
  mh.msg_iovlen = k;
  const ssize_t w = ::sendmsg(fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
  if (w <= 0) {
    return w < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR ? kSendFailed : kWouldBlock;
  }
  size_t rest = static_cast<size_t>(w);
  const size_t hh = std::min(rest, sizeof(Header) - *hdr_done);
  *hdr_done += hh;
  return static_cast<ssize_t>(rest - hh);
}

// The right neighbour never sends on our connection to it: a readable byte, EOF or an error there is its
// failure (true, with what to report), else nothing (false).
bool right_failed(int fd, RingError::Kind* kind, std::string* msg) {
  char b;
  const ssize_t g = ::recv(fd, &b, 1, MSG_DONTWAIT);
  if (g == 0) {
    *kind = RingError::kPeerDead;
    *msg = "it closed the connection";
  } else if (g < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
    *kind = RingError::kPeerDead;
    *msg = "its connection failed (" + err_text(errno) + ")";
  } else if (g > 0) {
    *kind = RingError::kBroken;
    *msg = "protocol error: unexpected bytes from it";
  } else {
    return false;
  }
  return true;
}

}  // namespace

class Comm::Call {
 public:
  Call(Comm& comm, const Header& mine, std::vector<Step>& steps, DType dtype, int op, double scale,
       size_t chunk_bytes, bool tiny, double timeout_s);
  ~Call() { stop_sender(); }  // also on the way out of a failure
  void run();

 private:
  void skip();
  size_t sendable() const;
  bool send_pump();
  void sender_thread();
  bool receive();
  void check_descriptor();
  bool reduce();
  void wait_for_sockets();
  void finish();
  void publish(size_t nbytes);
  void stop_sender();
  [[noreturn]] void fail(RingError::Kind kind, int peer, const std::string& msg);

  Comm& comm_;
  const Header& mine_;
  std::vector<Step>& steps_;
  const DType dtype_;
  const int op_;
  const double scale_;
  const size_t es_, nsteps_, cap_;  // element size, steps, staging bytes (0 unless the steps reduce)
  const bool tiny_;
  const double timeout_s_;
  const int right_, left_;
  bool threaded_ = false;
  Header theirs_{};
  size_t hout_ = 0, hin_ = 0;  // descriptor bytes sent / received
  bool hdr_ok_ = false;        // the left neighbour's descriptor arrived and equals ours
  size_t ss_ = 0, soff_ = 0;   // send: step, offset
  size_t rs_ = 0, roff_ = 0, poff_ = 0;  // receive: step, bytes received, bytes processed
  double deadline_;
  // Shared with the sender thread.
  std::thread sender_;
  std::atomic<uint64_t> processed_{0};  // received bytes processed (how far the sender may go)
  std::atomic<uint32_t> epoch_{0};      // bumped (and waited on) whenever processed_ or stop_ changes
  std::atomic<bool> stop_{false};
  std::atomic<bool> failed_{false};
  RingError::Kind failed_kind_ = RingError::kBroken;  // written by the sender before failed_
  std::string failed_msg_;
};

// ---- set-up -------------------------------------------------------------------------------------------------
Comm::Call::Call(Comm& comm, const Header& mine, std::vector<Step>& steps, DType dtype, int op, double scale,
                 size_t chunk_bytes, bool tiny, double timeout_s)
    : comm_(comm), mine_(mine), steps_(steps), dtype_(dtype), op_(op), scale_(scale), es_(dtype_size(dtype)),
      nsteps_(steps.size()), cap_(!steps.empty() && steps[0].reduce ? chunk_bytes : 0), tiny_(tiny),
      timeout_s_(timeout_s), right_((comm.rank_ + 1) % comm.world_), left_((comm.rank_ + comm.world_ - 1) % comm.world_),
      deadline_(now_s() + timeout_s) {
  if (comm_.stage_.size() < cap_) comm_.stage_.resize(cap_);
  size_t total = 0;
  for (const Step& st : steps_) total += st.send_len;
  threaded_ = !tiny_ && total >= thread_bytes();
  if (threaded_) {
    hout_ = sizeof(Header);  // the sender thread writes the descriptor
    sender_ = std::thread([this] { sender_thread(); });
  }
}

void Comm::Call::run() {
  for (;;) {
    skip();
    const bool send_done = threaded_ || (hout_ == sizeof(Header) && ss_ >= nsteps_);
    const bool recv_done = hdr_ok_ && rs_ >= nsteps_;
    if (threaded_ && failed_.load()) fail(failed_kind_, right_, failed_msg_);
    if (send_done && recv_done) return finish();
    bool moved = !send_done && send_pump();
    if (!recv_done) moved = receive() || moved;
    moved = reduce() || moved;
    if (moved) {
      deadline_ = now_s() + timeout_s_;  // the timeout bounds a wait without progress
    } else {
      wait_for_sockets();
    }
  }
}

// Moves the cursors past the steps that are done.
void Comm::Call::skip() {
  while (ss_ < nsteps_ && soff_ == steps_[ss_].send_len) ++ss_, soff_ = 0;
  while (hdr_ok_ && rs_ < nsteps_ && poff_ == steps_[rs_].recv_len) ++rs_, roff_ = 0, poff_ = 0;
}

// ---- the send pump --------------------------------------------------------------------------------------------
// Bytes of the current step that may be sent now: a step sends what the step before has received and reduced
// (all of it first, for a step marked after_prev).
size_t Comm::Call::sendable() const {
  if (threaded_ || ss_ >= nsteps_) return 0;
  const Step& st = steps_[ss_];
  size_t lim = st.send_len;
  if (ss_ > 0 && rs_ <= ss_ - 1) lim = (rs_ == ss_ - 1 && !st.after_prev) ? std::min(lim, poff_) : 0;
  return lim - soff_;
}

bool Comm::Call::send_pump() {
  const size_t avail = sendable();
  if (hout_ == sizeof(Header) && avail == 0) return false;
  const ssize_t w = send_some(comm_.send_fd_, mine_, &hout_, avail ? steps_[ss_].send + soff_ : nullptr, avail);
  if (w == kSendFailed) fail(RingError::kPeerDead, right_, "sending to it failed (" + err_text(errno) + ")");
  if (w < 0) return false;
  soff_ += static_cast<size_t>(w);
  return true;
}

// The send pump of a large call, on its own thread: it records a failure for the receiving side to raise.
void Comm::Call::sender_thread() {
  size_t h = 0, s = 0, off = 0;
  uint64_t sent = 0;
  const uint64_t first = steps_[0].send_len;  // the first step sends what this rank holds
  double dl = now_s() + timeout_s_;
  auto record = [this](RingError::Kind kind, const std::string& msg) {
    failed_kind_ = kind;
    failed_msg_ = msg;
    failed_.store(true);
  };
  for (;;) {
    while (s < nsteps_ && off == steps_[s].send_len) ++s, off = 0;
    if ((h == sizeof(Header) && s >= nsteps_) || stop_.load()) return;
    const uint32_t ep = epoch_.load(std::memory_order_acquire);
    const uint64_t limit = first + processed_.load(std::memory_order_acquire);
    const size_t avail =
        s < nsteps_ ? static_cast<size_t>(std::min<uint64_t>(steps_[s].send_len - off, limit > sent ? limit - sent : 0))
                    : 0;
    if (h == sizeof(Header) && avail == 0) {
      epoch_.wait(ep);
      dl = now_s() + timeout_s_;
      continue;
    }
    const ssize_t w = send_some(comm_.send_fd_, mine_, &h, avail ? steps_[s].send + off : nullptr, avail);
    if (w >= 0) {
      off += static_cast<size_t>(w);
      sent += static_cast<uint64_t>(w);
      dl = now_s() + timeout_s_;
      continue;
    }
    if (w == kSendFailed) return record(RingError::kPeerDead, "sending to it failed (" + err_text(errno) + ")");
    pollfd pf{comm_.send_fd_, static_cast<short>(POLLOUT | POLLIN), 0};
    const int ms = ms_left(dl);
    if (ms <= 0) return record(RingError::kTimeout, "it did not take data within the timeout");
    poll(&pf, 1, std::min(ms, 50));
    RingError::Kind kind;
    std::string msg;
    if ((pf.revents & (POLLIN | POLLHUP | POLLERR)) && right_failed(comm_.send_fd_, &kind, &msg)) {
      return record(kind, msg);
    }
  }
}

// ---- the receive and reduce -----------------------------------------------------------------------------------
bool Comm::Call::receive() {
  iovec iov[2];
  int k = 0;
  if (hin_ < sizeof(Header)) iov[k++] = {reinterpret_cast<char*>(&theirs_) + hin_, sizeof(Header) - hin_};
  char* target = nullptr;
  size_t room = 0;
  if (rs_ < nsteps_) {
    const Step& st = steps_[rs_];
    if (st.reduce) {
      target = comm_.stage_.data() + (roff_ - poff_);
      room = std::min(cap_ - (roff_ - poff_), st.recv_len - roff_);
    } else if (hdr_ok_ || tiny_) {
      // Before the descriptor is checked, bytes only go to private memory (staging, gather buffer).
      target = st.recv + roff_;
      room = st.recv_len - roff_;
    }
  }
  if (room) iov[k++] = {target, room};
  if (k == 0) return false;
  msghdr mh{};
  mh.msg_iov = iov;
  mh.msg_iovlen = k;
  const ssize_t got = ::recvmsg(comm_.recv_fd_, &mh, MSG_DONTWAIT);
  if (got == 0) fail(RingError::kPeerDead, left_, "it closed the connection");
  if (got < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
    fail(RingError::kPeerDead, left_, "receiving from it failed (" + err_text(errno) + ")");
  }
  if (got <= 0) return false;
  size_t g = static_cast<size_t>(got);
  if (hin_ < sizeof(Header)) {
    const size_t h = std::min(g, sizeof(Header) - hin_);
    hin_ += h;
    g -= h;
  }
  roff_ += g;
  if (!steps_[rs_].reduce) {
    poff_ = roff_;
    publish(g);
  }
  if (!hdr_ok_ && hin_ == sizeof(Header)) check_descriptor();
  return true;
}

// The left neighbour's descriptor must be a call descriptor of this ring, and the same call as ours.
void Comm::Call::check_descriptor() {
  if (theirs_.magic != kCallMagic || theirs_.group != mine_.group || theirs_.rank != left_) {
    fail(RingError::kBroken, left_, "protocol error: unexpected bytes instead of a call descriptor");
  }
  if (theirs_.seq != mine_.seq || theirs_.call != mine_.call || theirs_.small_bytes != mine_.small_bytes ||
      theirs_.chunk_bytes != mine_.chunk_bytes) {
    comm_.broken_ = true;  // the caller publishes the mismatch, then closes (the peers see EOF after it)
    RingError e(RingError::kMismatch, left_, "collective mismatch");
    e.mine = mine_;
    e.theirs = theirs_;
    throw e;
  }
  hdr_ok_ = true;
}

// Combines the whole elements staged for the current reducing step into place.
bool Comm::Call::reduce() {
  if (!hdr_ok_ || rs_ >= nsteps_ || !steps_[rs_].reduce || roff_ <= poff_) return false;
  const size_t fill = roff_ - poff_;
  const size_t nb = fill / es_ * es_;
  if (nb == 0) return false;
  Step& st = steps_[rs_];
  char* out = st.recv + poff_;
  char* stage = comm_.stage_.data();
  const void* xs[2] = {out, stage};
  combine(op_, dtype_, out, xs, 2, static_cast<int64_t>(nb / es_), st.scale_last && op_ == kMean, scale_);
  poff_ += nb;
  publish(nb);
  if (fill > nb) std::memmove(stage, stage + nb, fill - nb);
  return true;
}

// Tells the sender thread how far it may go.
void Comm::Call::publish(size_t nbytes) {
  if (!threaded_) return;
  processed_.fetch_add(nbytes, std::memory_order_release);
  epoch_.fetch_add(1, std::memory_order_release);
  epoch_.notify_one();
}

// ---- waiting and finishing ------------------------------------------------------------------------------------
// Nothing moved: wait for the sockets (bounded), watching the right neighbour for a hang-up too while this call
// still has bytes for it. Once everything is sent, a hang-up there is not this call's failure: the right
// neighbour may have finished this call and closed the ring over a later call's mismatch (the next call here
// sees the closed connection), and the bytes from the left are all this call still needs.
void Comm::Call::wait_for_sockets() {
  skip();
  const bool want_out = hout_ < sizeof(Header) || sendable() > 0;
  const bool recv_pending = !(hdr_ok_ && rs_ >= nsteps_);
  const bool watch_right = !threaded_ && !(hout_ == sizeof(Header) && ss_ >= nsteps_);
  pollfd pf[2] = {{watch_right ? comm_.send_fd_ : -1, static_cast<short>(POLLIN | (want_out ? POLLOUT : 0)), 0},
                  {comm_.recv_fd_, static_cast<short>(recv_pending ? POLLIN : 0), 0}};
  const int ms = ms_left(deadline_);
  // With a sender thread, wake every 50 ms to see whether it failed.
  const int pr = ms > 0 ? poll(pf, 2, threaded_ ? std::min(ms, 50) : ms) : 0;
  if (threaded_ && pr == 0 && ms_left(deadline_) > 0) return;
  if (pr == 0) {
    fail(RingError::kTimeout, recv_pending ? left_ : right_,
         recv_pending ? "no data arrived from it within the timeout" : "it did not take data within the timeout");
  }
  RingError::Kind kind;
  std::string msg;
  if ((pf[0].revents & (POLLIN | POLLHUP | POLLERR)) && right_failed(comm_.send_fd_, &kind, &msg)) {
    fail(kind, right_, msg);
  }
}

void Comm::Call::finish() {
  if (!threaded_) return;
  sender_.join();  // it ends once everything is written, or records a failure (bounded by the timeout)
  if (failed_.load()) comm_.fail(failed_kind_, right_, failed_msg_);
}

void Comm::Call::stop_sender() {
  if (!sender_.joinable()) return;
  stop_.store(true);
  epoch_.fetch_add(1);
  epoch_.notify_all();
  sender_.join();
}

// Every failure stops the sender thread before the connections close.
void Comm::Call::fail(RingError::Kind kind, int peer, const std::string& msg) {
  stop_sender();
  comm_.fail(kind, peer, msg);
}

void Comm::run(const Header& mine, std::vector<Step>& steps, DType dtype, int op, double scale, size_t chunk_bytes,
               bool tiny, double timeout_s) {
  Call(*this, mine, steps, dtype, op, scale, chunk_bytes, tiny, timeout_s).run();
}

}  // namespace ring
}  // namespace core
}  // namespace torchstrategies
