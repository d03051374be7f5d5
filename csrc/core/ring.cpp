// Torch-free ring all-reduce over TCP: see ring.h for the protocol. This file: the connections and each
// collective's steps; ring_call.cpp runs a call's steps (Comm::run).
#include "core/ring.h"

#include "core/ring_io.h"

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
#include <thread>

#include <algorithm>

namespace torchstrategies {
namespace core {
namespace ring {
namespace {

constexpr uint32_t kHelloMagic = 0x52484c4f;  // hello from the left neighbour
constexpr uint32_t kAckMagic = 0x5241434b;

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
  h.call = d;
  h.small_bytes = small_bytes;
  h.chunk_bytes = chunk_bytes;
  return h;
}

void Comm::all_reduce(void* data, int64_t count, DType dtype, int op, int64_t small_bytes, int64_t chunk_bytes,
                      const Desc& d, double timeout_s) {
  if (op < kSum || op > kProduct) throw std::invalid_argument("ring: bad reduce op code " + std::to_string(op));
  const Header mine = header(d, small_bytes, chunk_bytes);
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

void Comm::broadcast(void* data, size_t nbytes, int root, const Desc& d, double timeout_s) {
  const Header mine = header(d, 0, 0);
  const int n = world_;
  if (n == 1) return;
  char* p = static_cast<char*>(data);
  const int dist = ((rank_ - root) % n + n) % n;  // position in the chain from the root
  // Once the last rank has all the bytes, every rank has checked its left neighbour's descriptor: its token
  // then goes round the ring (last -> root -> 1 -> ... -> n-2), so no rank returns before that.
  char token = 1;
  std::vector<Step> steps;
  if (dist == 0) {  // the root sends, waits for the last rank's token and passes it on
    steps.push_back({p, nbytes, nullptr, 0, false, false, false});
    steps.push_back({nullptr, 0, &token, 1, false, false, false});
    if (n > 2) steps.push_back({&token, 1, nullptr, 0, false, false, true});
  } else if (dist < n - 1) {  // receive and forward as the bytes arrive, then the token
    steps.push_back({nullptr, 0, p, nbytes, false, false, false});
    steps.push_back({p, nbytes, &token, 1, false, false, false});
    if (dist < n - 2) steps.push_back({&token, 1, nullptr, 0, false, false, true});
  } else {  // the last rank: receive, then send the token to the root once everything arrived
    steps.push_back({nullptr, 0, p, nbytes, false, false, false});
    steps.push_back({&token, 1, nullptr, 0, false, false, true});
  }
  run(mine, steps, DType::kFloat32, kSum, 1.0, 0, false, timeout_s);
}

void Comm::reduce_scatter(void* work, void* out, int64_t count, DType dtype, int op, int64_t chunk_bytes,
                          const Desc& d, double timeout_s) {
  if (op < kSum || op > kProduct) throw std::invalid_argument("ring: bad reduce op code " + std::to_string(op));
  const Header mine = header(d, 0, chunk_bytes);
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

}  // namespace ring
}  // namespace core
}  // namespace torchstrategies
