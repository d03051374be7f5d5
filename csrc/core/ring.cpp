// Torch-free ring all-reduce over TCP: see ring.h for the protocol.
#include "core/ring.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <atomic>
#include <functional>
#include <thread>

#include <algorithm>

namespace torchstrategies {
namespace core {
namespace ring {
namespace {

constexpr uint32_t kCallMagic = 0x52494e47;   // "RING"
constexpr uint32_t kHelloMagic = 0x52484c4f;  // hello from the left neighbour
constexpr uint32_t kAckMagic = 0x5241434b;
// Ring calls sending at least this many bytes send from a second thread (see Comm::run).
constexpr size_t kThreadBytes = 4 << 20;

struct Hello {
  uint32_t magic;
  int32_t rank;
  uint64_t group;
  uint64_t nonce;
};
struct Ack {
  uint32_t magic;
  int32_t rank;
};

double now_s() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

int ms_left(double deadline) {
  const double left = deadline - now_s();
  if (left <= 0) return 0;
  return left > 3.6e6 ? 3600 * 1000 : static_cast<int>(left * 1000.0) + 1;
}

std::string err_text(int e) { return std::string(std::strerror(e)); }

void set_nonblocking(int fd) {
  const int fl = fcntl(fd, F_GETFL, 0);
  fcntl(fd, F_SETFL, fl | O_NONBLOCK);
}

void tune(int fd, const Options& o) {
  if (o.socket_bytes > 0) {
    const int v = static_cast<int>(o.socket_bytes);
    setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &v, sizeof v);
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &v, sizeof v);
  }
  const int one = o.nodelay ? 1 : 0;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

// Reads or writes exactly len bytes on a non-blocking fd before `deadline`. Returns 0, or -1 on timeout,
// or -2 on EOF / a connection error (errno-like code in *err).
int io_all(int fd, void* buf, size_t len, bool write, double deadline, int* err) {
  char* p = static_cast<char*>(buf);
  size_t done = 0;
  while (done < len) {
    const ssize_t n = write ? ::send(fd, p + done, len - done, MSG_NOSIGNAL | MSG_DONTWAIT)
                            : ::recv(fd, p + done, len - done, MSG_DONTWAIT);
    if (n > 0) {
      done += static_cast<size_t>(n);
      continue;
    }
    if (n == 0 && !write) {
      *err = 0;
      return -2;
    }
    if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
      *err = errno;
      return -2;
    }
    pollfd pf{fd, static_cast<short>(write ? POLLOUT : POLLIN), 0};
    const int ms = ms_left(deadline);
    if (ms <= 0) return -1;
    if (poll(&pf, 1, ms) == 0 && ms_left(deadline) <= 0) return -1;
  }
  return 0;
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

}  // namespace

Comm::Comm(int rank, int world, uint64_t group, Options opts)
    : rank_(rank), world_(world), group_(group), opts_(opts) {
  if (world < 1 || rank < 0 || rank >= world) {
    throw std::invalid_argument("ring: bad rank " + std::to_string(rank) + " of world " + std::to_string(world));
  }
}

Comm::~Comm() { close(); }

void Comm::close() {
  if (send_fd_ >= 0 || recv_fd_ >= 0) broken_ = true;  // a ring that was up is unusable once closed
  for (int* fd : {&listen_fd_, &send_fd_, &recv_fd_}) {
    if (*fd >= 0) ::close(*fd);
    *fd = -1;
  }
}

void Comm::fail(RingError::Kind kind, int peer, const std::string& msg) {
  broken_ = true;
  close();
  throw RingError(kind, peer, msg);
}

int Comm::listen(const std::string& addr) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICHOST | AI_NUMERICSERV | AI_PASSIVE;
  addrinfo* res = nullptr;
  const int rc = getaddrinfo(addr.c_str(), "0", &hints, &res);
  if (rc != 0) throw std::invalid_argument("ring: bind address '" + addr + "' is not a numeric IP address");
  const int fd = ::socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    freeaddrinfo(res);
    throw std::runtime_error("ring: socket(): " + err_text(errno));
  }
  tune(fd, opts_);  // buffer sizes are inherited by the accepted connection
  if (::bind(fd, res->ai_addr, res->ai_addrlen) != 0 || ::listen(fd, 16) != 0) {
    const int e = errno;
    freeaddrinfo(res);
    ::close(fd);
    throw std::runtime_error("ring: cannot listen on " + addr + ": " + err_text(e));
  }
  freeaddrinfo(res);
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len);
  listen_fd_ = fd;
  set_nonblocking(fd);
  return ss.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port)
                                  : ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
}

void Comm::establish(const std::string& right_host, int right_port, uint64_t right_nonce, uint64_t my_nonce,
                     double timeout_s) {
  if (world_ == 1) return;
  const double deadline = now_s() + timeout_s;
  const int right = (rank_ + 1) % world_;
  const int left = (rank_ + world_ - 1) % world_;
  std::exception_ptr connect_error;
  int out_fd = -1;
  std::thread connector([&] {
    try {
      addrinfo hints{};
      hints.ai_family = AF_UNSPEC;
      hints.ai_socktype = SOCK_STREAM;
      hints.ai_flags = AI_NUMERICSERV;
      addrinfo* res = nullptr;
      const std::string port = std::to_string(right_port);
      if (getaddrinfo(right_host.c_str(), port.c_str(), &hints, &res) != 0 || res == nullptr) {
        throw RingError(RingError::kBroken, right, "cannot resolve rank's address " + right_host);
      }
      int last = 0;
      while (out_fd < 0) {
        const int fd = ::socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
        tune(fd, opts_);
        int rc = ::connect(fd, res->ai_addr, res->ai_addrlen);
        if (rc != 0 && errno == EINPROGRESS) {
          pollfd pf{fd, POLLOUT, 0};
          poll(&pf, 1, ms_left(deadline));
          int so = 0;
          socklen_t sl = sizeof so;
          getsockopt(fd, SOL_SOCKET, SO_ERROR, &so, &sl);
          rc = (pf.revents & POLLOUT) && so == 0 ? 0 : -1;
          last = so ? so : ETIMEDOUT;
        } else if (rc != 0) {
          last = errno;
        }
        if (rc == 0) {
          out_fd = fd;
          break;
        }
        ::close(fd);
        if (ms_left(deadline) <= 0) {
          freeaddrinfo(res);
          throw RingError(RingError::kTimeout, right, "could not connect within the timeout (" + err_text(last) + ")");
        }
        usleep(20000);
      }
      freeaddrinfo(res);
      Hello h{kHelloMagic, rank_, group_, right_nonce};
      int e = 0;
      int rc = io_all(out_fd, &h, sizeof h, true, deadline, &e);
      Ack a{};
      if (rc == 0) rc = io_all(out_fd, &a, sizeof a, false, deadline, &e);
      if (rc == -1) throw RingError(RingError::kTimeout, right, "no answer to the connection hello within the timeout");
      if (rc == -2) throw RingError(RingError::kPeerDead, right, "connection closed during the hello (" + err_text(e) + ")");
      if (a.magic != kAckMagic || a.rank != right) {
        throw RingError(RingError::kBroken, right, "unexpected answer to the connection hello");
      }
    } catch (...) {
      connect_error = std::current_exception();
    }
  });
  int in_fd = -1;
  std::exception_ptr accept_error;
  try {
    while (in_fd < 0) {
      pollfd pf{listen_fd_, POLLIN, 0};
      const int ms = ms_left(deadline);
      if (ms <= 0 || poll(&pf, 1, ms) == 0) {
        if (ms_left(deadline) <= 0) throw RingError(RingError::kTimeout, left, "did not connect within the timeout");
        continue;
      }
      const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (fd < 0) continue;
      // A stray connection gets at most a few seconds to say hello; then it is refused.
      const double hello_deadline = std::min(deadline, now_s() + 5.0);
      Hello h{};
      int e = 0;
      if (io_all(fd, &h, sizeof h, false, hello_deadline, &e) != 0 || h.magic != kHelloMagic ||
          h.group != group_ || h.rank != left || h.nonce != my_nonce) {
        ::close(fd);
        continue;
      }
      Ack a{kAckMagic, rank_};
      if (io_all(fd, &a, sizeof a, true, deadline, &e) != 0) {
        ::close(fd);
        continue;
      }
      in_fd = fd;
    }
  } catch (...) {
    accept_error = std::current_exception();
  }
  connector.join();
  ::close(listen_fd_);  // nothing listens once the ring is up
  listen_fd_ = -1;
  send_fd_ = out_fd;
  recv_fd_ = in_fd;
  if (connect_error || accept_error) {
    broken_ = true;
    close();
    std::rethrow_exception(connect_error ? connect_error : accept_error);
  }
  tune(send_fd_, opts_);
  tune(recv_fd_, opts_);
}

Header Comm::header(const Desc& d, int64_t small_bytes, int64_t chunk_bytes) {
  if (broken_) throw RingError(RingError::kBroken, -1, "the ring communicator failed earlier");
  Header h{};
  h.magic = kCallMagic;
  h.rank = rank_;
  h.group = group_;
  h.seq = seq_++;
  h.op = d.op;
  h.dtype = d.dtype;
  h.count = d.count;
  h.small_bytes = small_bytes;
  h.chunk_bytes = chunk_bytes;
  h.kind = d.kind;
  h.root = d.root;
  return h;
}

void Comm::all_reduce(void* data, int64_t count, DType dtype, int op, int64_t small_bytes, int64_t chunk_bytes,
                      double timeout_s) {
  if (op < kSum || op > kProduct) throw std::invalid_argument("ring: bad reduce op code " + std::to_string(op));
  const Header mine = header({kAllReduce, op, static_cast<int32_t>(dtype), count, 0}, small_bytes, chunk_bytes);
  const size_t es = dtype_size(dtype);
  const int n = world_;
  const double scale = 1.0 / n;
  if (n == 1) {
    if (op == kMean) combine(op, dtype, data, const_cast<const void* const*>(&data), 1, count, true, scale);
    return;
  }
  char* base = static_cast<char*>(data);
  const size_t bytes = static_cast<size_t>(count) * es;
  std::vector<Step> steps;
  const int r = rank_;
  auto mod = [n](int v) { return ((v % n) + n) % n; };
  const bool tiny = static_cast<int64_t>(bytes) <= small_bytes;
  if (tiny) {  // all-gather whole messages, then every rank reduces in rank order
    gather_.resize(bytes * n);
    auto blob = [&](int k) { return k == r ? base : gather_.data() + bytes * k; };
    for (int s = 0; s < n - 1; ++s) {
      steps.push_back({blob(mod(r - s)), bytes, blob(mod(r - s - 1)), bytes, false, false, false});
    }
  } else {
    std::vector<int64_t> lo(n + 1);
    for (int k = 0; k <= n; ++k) lo[k] = count / n * k + std::min<int64_t>(k, count % n);
    auto seg = [&](int k) { return base + lo[k] * es; };
    auto len = [&](int k) { return static_cast<size_t>(lo[k + 1] - lo[k]) * es; };
    for (int s = 0; s < n - 1; ++s) {
      const int a = mod(r - s), b = mod(r - s - 1);
      steps.push_back({seg(a), len(a), seg(b), len(b), true, s == n - 2, false});
    }
    for (int s = 0; s < n - 1; ++s) {
      const int a = mod(r + 1 - s), b = mod(r - s);
      steps.push_back({seg(a), len(a), seg(b), len(b), false, false, false});
    }
  }
  const size_t chunk = std::max<size_t>(static_cast<size_t>(std::max<int64_t>(chunk_bytes, 4096)) / es * es, es);
  run(mine, steps, dtype, op, scale, chunk, tiny, timeout_s);
  if (tiny) {
    std::vector<const void*> xs(n);
    for (int k = 0; k < n; ++k) xs[k] = k == r ? base : gather_.data() + bytes * k;
    combine(op, dtype, base, xs.data(), n, count, op == kMean, scale);
  }
}

void Comm::all_gather(const void* in, void* out, size_t nbytes, const Desc& d, double timeout_s) {
  const Header mine = header(d, 0, 0);
  const int n = world_, r = rank_;
  char* base = static_cast<char*>(out);
  if (in != base + nbytes * r && nbytes) std::memcpy(base + nbytes * r, in, nbytes);
  if (n == 1) return;
  auto mod = [n](int v) { return ((v % n) + n) % n; };
  std::vector<Step> steps;
  for (int s = 0; s < n - 1; ++s) {  // step s forwards the block received in step s - 1
    steps.push_back({base + nbytes * mod(r - s), nbytes, base + nbytes * mod(r - s - 1), nbytes, false, false,
                     false});
  }
  run(mine, steps, DType::kFloat32, kSum, 1.0, 0, false, timeout_s);
}

void Comm::broadcast(void* data, size_t nbytes, const Desc& d, double timeout_s) {
  const Header mine = header(d, 0, 0);
  const int n = world_;
  if (n == 1) return;
  char* p = static_cast<char*>(data);
  const int dist = ((rank_ - d.root) % n + n) % n;  // position in the chain from the root
  char token = 1;
  std::vector<Step> steps;
  if (dist == 0) {  // the root sends, then waits for the last rank's token
    steps.push_back({p, nbytes, nullptr, 0, false, false, false});
    steps.push_back({nullptr, 0, &token, 1, false, false, false});
  } else if (dist < n - 1) {  // receive and forward as the bytes arrive
    steps.push_back({nullptr, 0, p, nbytes, false, false, false});
    steps.push_back({p, nbytes, nullptr, 0, false, false, false});
  } else {  // the last rank: receive, then send the token to the root once everything arrived
    steps.push_back({nullptr, 0, p, nbytes, false, false, false});
    steps.push_back({&token, 1, nullptr, 0, false, false, true});
  }
  run(mine, steps, DType::kFloat32, kSum, 1.0, 0, false, timeout_s);
}

void Comm::reduce_scatter(void* work, void* out, int64_t count, DType dtype, int op, int64_t chunk_bytes,
                          double timeout_s) {
  if (op < kSum || op > kProduct) throw std::invalid_argument("ring: bad reduce op code " + std::to_string(op));
  const Header mine = header({kReduceScatter, op, static_cast<int32_t>(dtype), count, 0}, 0, chunk_bytes);
  const int n = world_, r = rank_;
  const size_t es = dtype_size(dtype);
  const size_t bytes = static_cast<size_t>(count) * es;
  char* base = static_cast<char*>(work);
  const double scale = 1.0 / n;
  if (n == 1) {
    const void* xs[1] = {base};
    combine(op, dtype, out, xs, 1, count, op == kMean, scale);
    return;
  }
  auto mod = [n](int v) { return ((v % n) + n) % n; };
  std::vector<Step> steps;
  for (int s = 0; s < n - 1; ++s) {  // ends on block r: step s sends block r-s-1, reduces into block r-s-2
    const int a = mod(r - s - 1), b = mod(r - s - 2);
    steps.push_back({base + bytes * a, bytes, base + bytes * b, bytes, true, s == n - 2, false});
  }
  const size_t chunk = std::max<size_t>(static_cast<size_t>(std::max<int64_t>(chunk_bytes, 4096)) / es * es, es);
  run(mine, steps, dtype, op, scale, chunk, false, timeout_s);
  if (bytes) std::memcpy(out, base + bytes * r, bytes);
}

void Comm::run(const Header& mine, std::vector<Step>& steps, DType dtype, int op, double scale,
               size_t chunk_bytes, bool tiny, double timeout_s) {
  const int right = (rank_ + 1) % world_;
  const int left = (rank_ + world_ - 1) % world_;
  const size_t es = dtype_size(dtype);
  const size_t S = steps.size();
  const bool fused = !steps.empty() && steps[0].reduce;
  if (fused && stage_.size() < chunk_bytes) stage_.resize(chunk_bytes);
  const size_t cap = fused ? chunk_bytes : 0;
  Header theirs{};
  size_t hout = 0, hin = 0;
  bool hdr_ok = false;
  size_t ss = 0, soff = 0;            // send: step, offset
  size_t rs = 0, roff = 0, poff = 0;  // recv: step, bytes received, bytes processed
  double deadline = now_s() + timeout_s;
  auto skip = [&] {
    while (ss < S && soff == steps[ss].send_len) ++ss, soff = 0;
    while (hdr_ok && rs < S && poff == steps[rs].recv_len) ++rs, roff = 0, poff = 0;
  };
  // Large ring calls send from a second thread, so that the copies into the socket run beside the receive
  // and the reduce (two cores' worth of copying, as a full-duplex link needs); the main thread publishes how
  // many received bytes it has processed, which is exactly how far the sender may go (a step sends what the
  // step before received).
  size_t total = 0;
  for (const Step& st : steps) total += st.send_len;
  static const size_t thread_bytes = [] {
    const char* v = std::getenv("TORCHSTRATEGIES_RING_THREAD_BYTES");
    return v && *v ? static_cast<size_t>(std::strtoull(v, nullptr, 10)) : kThreadBytes;
  }();
  const bool threaded = !tiny && total >= thread_bytes;
  struct Shared {
    std::atomic<uint64_t> processed{0};
    std::atomic<uint32_t> epoch{0};
    std::atomic<bool> stop{false};
    std::atomic<bool> failed{false};
    RingError::Kind kind = RingError::kBroken;
    std::string msg;
  } sh;
  std::thread sender;
  auto stop_sender = [&] {
    if (!sender.joinable()) return;
    sh.stop.store(true);
    sh.epoch.fetch_add(1);
    sh.epoch.notify_all();
    sender.join();
  };
  struct Joiner {
    std::function<void()> f;
    ~Joiner() { f(); }
  } joiner{stop_sender};
  auto die = [&](RingError::Kind kind, int peer, const std::string& msg) {
    stop_sender();
    fail(kind, peer, msg);
  };
  if (threaded) {
    hout = sizeof(Header);  // the sender thread writes the descriptor
    sender = std::thread([&, right] {
      size_t h = 0, s = 0, off = 0;
      uint64_t sent = 0;
      const uint64_t first = steps[0].send_len;
      double dl = now_s() + timeout_s;
      auto record = [&](RingError::Kind kind, const std::string& msg) {
        sh.kind = kind;
        sh.msg = msg;
        sh.failed.store(true);
      };
      for (;;) {
        while (s < S && off == steps[s].send_len) ++s, off = 0;
        if ((h == sizeof(Header) && s >= S) || sh.stop.load()) return;
        const uint32_t ep = sh.epoch.load(std::memory_order_acquire);
        const uint64_t limit = first + sh.processed.load(std::memory_order_acquire);
        const size_t avail = s < S ? static_cast<size_t>(std::min<uint64_t>(steps[s].send_len - off,
                                                                            limit > sent ? limit - sent : 0))
                                   : 0;
        if (h == sizeof(Header) && avail == 0) {
          sh.epoch.wait(ep);
          dl = now_s() + timeout_s;
          continue;
        }
        const ssize_t w = send_some(send_fd_, mine, &h, avail ? steps[s].send + off : nullptr, avail);
        if (w >= 0) {
          off += static_cast<size_t>(w);
          sent += static_cast<uint64_t>(w);
          dl = now_s() + timeout_s;
          continue;
        }
        if (w == kSendFailed) return record(RingError::kPeerDead, "sending to it failed (" + err_text(errno) + ")");
        pollfd pf{send_fd_, static_cast<short>(POLLOUT | POLLIN), 0};
        const int ms = ms_left(dl);
        if (ms <= 0) return record(RingError::kTimeout, "it did not take data within the timeout");
        poll(&pf, 1, std::min(ms, 50));
        if (pf.revents & (POLLIN | POLLHUP | POLLERR)) {
          char b;
          const ssize_t g = ::recv(send_fd_, &b, 1, MSG_DONTWAIT);
          if (g == 0) return record(RingError::kPeerDead, "it closed the connection");
          if (g < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
            return record(RingError::kPeerDead, "its connection failed (" + err_text(errno) + ")");
          }
          if (g > 0) return record(RingError::kBroken, "protocol error: unexpected bytes from it");
        }
      }
    });
  }
  auto published = [&](size_t nbytes) {
    if (!threaded) return;
    sh.processed.fetch_add(nbytes, std::memory_order_release);
    sh.epoch.fetch_add(1, std::memory_order_release);
    sh.epoch.notify_one();
  };
  auto sendable = [&]() -> size_t {
    if (threaded || ss >= S) return 0;
    const Step& st = steps[ss];
    size_t lim = st.send_len;
    if (ss > 0 && rs <= ss - 1) lim = (rs == ss - 1 && !st.after_prev) ? std::min(lim, poff) : 0;
    return lim - soff;
  };
  for (;;) {
    skip();
    const bool send_done = threaded || (hout == sizeof(Header) && ss >= S);
    const bool recv_done = hdr_ok && rs >= S;
    if (threaded && sh.failed.load()) {
      stop_sender();
      fail(sh.kind, right, sh.msg);
    }
    if (send_done && recv_done) {
      if (threaded) {
        sender.join();  // it ends once everything is written, or records a failure (bounded by the timeout)
        if (sh.failed.load()) fail(sh.kind, right, sh.msg);
      }
      return;
    }
    bool moved = false;
    size_t avail = 0;
    if (!send_done) {
      avail = sendable();
      if (hout < sizeof(Header) || avail) {
        const ssize_t w = send_some(send_fd_, mine, &hout, avail ? steps[ss].send + soff : nullptr, avail);
        if (w >= 0) {
          moved = true;
          soff += static_cast<size_t>(w);
        } else if (w == kSendFailed) {
          die(RingError::kPeerDead, right, "sending to it failed (" + err_text(errno) + ")");
        }
      }
    }
    if (!recv_done) {
      iovec iov[2];
      int k = 0;
      if (hin < sizeof(Header)) iov[k++] = {reinterpret_cast<char*>(&theirs) + hin, sizeof(Header) - hin};
      char* target = nullptr;
      size_t room = 0;
      if (rs < S) {
        const Step& st = steps[rs];
        if (st.reduce) {
          target = stage_.data() + (roff - poff);
          room = std::min(cap - (roff - poff), st.recv_len - roff);
        } else if (hdr_ok || tiny) {
          // Before the descriptor is checked, bytes only go to private memory (staging, gather buffer).
          target = st.recv + roff;
          room = st.recv_len - roff;
        }
      }
      if (room) iov[k++] = {target, room};
      if (k) {
        msghdr mh{};
        mh.msg_iov = iov;
        mh.msg_iovlen = k;
        const ssize_t got = ::recvmsg(recv_fd_, &mh, MSG_DONTWAIT);
        if (got == 0) die(RingError::kPeerDead, left, "it closed the connection");
        if (got < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
          die(RingError::kPeerDead, left, "receiving from it failed (" + err_text(errno) + ")");
        }
        if (got > 0) {
          moved = true;
          size_t g = static_cast<size_t>(got);
          if (hin < sizeof(Header)) {
            const size_t h = std::min(g, sizeof(Header) - hin);
            hin += h;
            g -= h;
          }
          roff += g;
          if (!steps[rs].reduce) {
            poff = roff;
            published(g);
          }
          if (!hdr_ok && hin == sizeof(Header)) {
            if (theirs.magic != kCallMagic || theirs.group != mine.group || theirs.rank != left) {
              die(RingError::kBroken, left, "protocol error: unexpected bytes instead of a call descriptor");
            }
            if (theirs.seq != mine.seq || theirs.op != mine.op || theirs.dtype != mine.dtype ||
                theirs.count != mine.count || theirs.small_bytes != mine.small_bytes ||
                theirs.chunk_bytes != mine.chunk_bytes || theirs.kind != mine.kind || theirs.root != mine.root) {
              broken_ = true;  // the caller publishes the mismatch, then closes (the peers see EOF after it)
              RingError e(RingError::kMismatch, left, "collective mismatch");
              e.mine = mine;
              e.theirs = theirs;
              throw e;
            }
            hdr_ok = true;
          }
        }
      }
    }
    if (hdr_ok && rs < S && steps[rs].reduce && roff > poff) {
      const size_t fill = roff - poff;
      const size_t nb = fill / es * es;
      if (nb) {
        Step& st = steps[rs];
        char* out = st.recv + poff;
        const void* xs[2] = {out, stage_.data()};
        combine(op, dtype, out, xs, 2, static_cast<int64_t>(nb / es), st.scale_last && op == kMean, scale);
        poff += nb;
        published(nb);
        if (fill > nb) std::memmove(stage_.data(), stage_.data() + nb, fill - nb);
        moved = true;
      }
    }
    if (moved) {
      deadline = now_s() + timeout_s;
      continue;
    }
    // Nothing moved: wait for the sockets (bounded), watching the right neighbour for a hang-up too while
    // this call still has bytes for it. Once everything is sent, a hang-up there is not this call's failure:
    // the right neighbour may have finished this call and closed the ring over a later call's mismatch (the
    // next call here sees the closed connection), and the bytes from the left are all this call still needs.
    skip();
    const bool want_out = (hout < sizeof(Header)) || sendable() > 0;
    const bool recv_pending = !(hdr_ok && rs >= S);
    const bool watch_right = !threaded && !(hout == sizeof(Header) && ss >= S);
    pollfd pf[2] = {{watch_right ? send_fd_ : -1, static_cast<short>(POLLIN | (want_out ? POLLOUT : 0)), 0},
                    {recv_fd_, static_cast<short>(recv_pending ? POLLIN : 0), 0}};
    const int ms = ms_left(deadline);
    // With a sender thread, wake every 50 ms to see whether it failed.
    const int pr = ms > 0 ? poll(pf, 2, threaded ? std::min(ms, 50) : ms) : 0;
    if (threaded && pr == 0 && ms_left(deadline) > 0) continue;
    if (pr == 0) {
      if (threaded) stop_sender();
      const int peer = recv_pending ? left : right;
      fail(RingError::kTimeout, peer,
           recv_pending ? "no data arrived from it within the timeout"
                        : "it did not take data within the timeout");
    }
    if (pf[0].revents & (POLLIN | POLLHUP | POLLERR)) {
      char b;
      const ssize_t g = ::recv(send_fd_, &b, 1, MSG_DONTWAIT);
      if (g == 0) die(RingError::kPeerDead, right, "it closed the connection");
      if (g < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
        fail(RingError::kPeerDead, right, "its connection failed (" + err_text(errno) + ")");
      }
      if (g > 0) fail(RingError::kBroken, right, "protocol error: unexpected bytes from it");
    }
  }
}

}  // namespace ring
}  // namespace core
}  // namespace torchstrategies
