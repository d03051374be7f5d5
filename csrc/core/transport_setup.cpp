// Transport set-up (rendezvous rows, the plan, the shared-memory segment, the ring) and its error path
// (turning shm / ring errors into Faults that name the rank at fault). See transport.h.
#include <errno.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <random>
#include <sstream>

#include "core/transport.h"

namespace torchstrategies {
namespace core {
namespace {

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ULL;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ULL;
  return h;
}

uint64_t random64() {
  std::random_device rd;
  return (static_cast<uint64_t>(rd()) << 32) ^ rd();
}

std::string machine_name() {
  char buf[256] = {0};
  gethostname(buf, sizeof(buf) - 1);
  return buf;
}

// 'g' (gone), 's' (stopped) or 'r' (running) for a pid on this machine.
char proc_state(int pid) {
  if (pid <= 0) return 'r';
  if (kill(pid, 0) != 0) return errno == ESRCH ? 'g' : 'r';
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%d/stat", pid);
  FILE* f = std::fopen(path, "r");
  if (!f) return 'r';
  char buf[512];
  const size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  buf[n] = '\0';
  const char* p = std::strrchr(buf, ')');
  if (!p || p[1] == '\0' || p[2] == '\0') return 'r';
  return (p[2] == 'Z' || p[2] == 'X') ? 'g' : (p[2] == 'T' || p[2] == 't') ? 's' : 'r';
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::string cur;
  for (char c : s) {
    if (c == sep) {
      out.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  out.push_back(cur);
  return out;
}

std::string clean(const std::string& s) {
  std::string out = s;
  for (char& c : out) {
    if (c == '\n' || c == '\t') c = ' ';
  }
  return out;
}

std::string seconds_text(double s) {
  std::ostringstream o;
  o << s;
  return o.str();
}

}  // namespace

const char* plan_name(Plan plan) {
  switch (plan) {
    case Plan::kShm: return "SHM";
    case Plan::kRing: return "RING";
    case Plan::kHierarchical: return "HIERARCHICAL";
  }
  return "?";
}

Transport::Transport(Config cfg, std::shared_ptr<KeyValue> store, double timeout_s)
    : cfg_(std::move(cfg)), store_(std::move(store)) {
  rendezvous(timeout_s);
  setup_shm(timeout_s);
  if (ring_rank_ >= 0 && ring_members_.size() > 1) build_ring(timeout_s);
}

Transport::~Transport() = default;

std::string Transport::ranks_text(const std::vector<int>& group_ranks) const {
  std::string s = "[";
  for (size_t i = 0; i < group_ranks.size(); ++i) {
    s += (i ? ", " : "") + std::to_string(cfg_.global_ranks[group_ranks[i]]);
  }
  return s + "]";
}

// Every rank publishes "host \t pid \t machine \t random \t name=value..." and reads everyone's row.
void Transport::rendezvous(double timeout_s) {
  const int n = cfg_.size;
  std::string row = clean(cfg_.host_id) + "\t" + std::to_string(getpid()) + "\t" +
                    std::to_string(fnv1a(machine_name())) + "\t" + std::to_string(random64());
  for (const auto& kv : cfg_.settings) row += "\t" + clean(kv.first) + "=" + clean(kv.second);
  std::vector<std::string> keys;
  for (int r = 0; r < n; ++r) keys.push_back("ts/row/" + std::to_string(r));
  std::vector<std::string> rows;
  try {
    store_->set(keys[cfg_.rank], row, timeout_s);
    rows = store_->get(keys, timeout_s);
  } catch (const StoreTimeout& e) {
    const std::vector<bool> here = store_->check_all(keys, kStoreSeconds);
    std::vector<int> missing;
    for (int r = 0; r < n && here.size() == keys.size(); ++r) {
      if (!here[r]) missing.push_back(r);
    }
    throw named_fault(Fault::kTimeout, "set-up", missing, timeout_s, e.what());
  }
  std::vector<std::vector<std::string>> fields;
  for (const auto& r : rows) fields.push_back(split(r, '\t'));
  for (int r = 0; r < n; ++r) {
    if (fields[r].size() != fields[cfg_.rank].size()) {
      throw Fault(Fault::kInvalid, "set-up of " + cfg_.desc + ": rank " + std::to_string(cfg_.global_ranks[r]) +
                                       " runs a different torchstrategies build (its set-up row differs in form)");
    }
  }
  // The settings that must agree (fields 4...): name every rank's value of the first that differs.
  for (size_t f = 4; f < fields[0].size(); ++f) {
    bool same = true;
    for (int r = 1; r < n; ++r) same = same && fields[r][f] == fields[0][f];
    if (same) continue;
    const std::string name = fields[0][f].substr(0, fields[0][f].find('='));
    std::string values;
    for (int r = 0; r < n; ++r) {
      const std::string& v = fields[r][f];
      values += (r ? ", " : "") + std::string("rank ") + std::to_string(cfg_.global_ranks[r]) + ": " +
                v.substr(v.find('=') + 1);
    }
    throw Fault(Fault::kInvalid, "set-up of " + cfg_.desc + ": " + name + " differs between ranks (" + values +
                                     "); set the same value on every rank");
  }
  std::map<std::string, int> index;
  host_of_.assign(n, 0);
  for (int r = 0; r < n; ++r) {
    auto it = index.find(fields[r][0]);
    if (it == index.end()) {
      it = index.emplace(fields[r][0], static_cast<int>(host_ranks_.size())).first;
      host_ranks_.emplace_back();
    }
    host_of_[r] = it->second;
    host_ranks_[it->second].push_back(r);
    pids_.push_back(std::stoi(fields[r][1]));
    machines_.push_back(std::stoull(fields[r][2]));
  }
  group_id_ = std::stoull(fields[0][3]);
  host_ = host_of_[cfg_.rank];
  const auto& mine = host_ranks_[host_];
  local_rank_ = static_cast<int>(std::find(mine.begin(), mine.end(), cfg_.rank) - mine.begin());
  const int nh = static_cast<int>(host_ranks_.size());
  bool shared_host = false;
  for (const auto& h : host_ranks_) shared_host = shared_host || h.size() > 1;
  switch (cfg_.impl) {
    case Impl::kAuto: plan_ = nh == 1 ? Plan::kShm : shared_host ? Plan::kHierarchical : Plan::kRing; break;
    case Impl::kShm: plan_ = Plan::kShm; break;
    case Impl::kRing: plan_ = Plan::kRing; break;
    case Impl::kHierarchical: plan_ = Plan::kHierarchical; break;
  }
  if (plan_ == Plan::kShm && nh > 1) {
    std::string hosts;
    for (const auto& kv : index) hosts += (hosts.empty() ? "" : ", ") + kv.first;
    throw Fault(Fault::kInvalid, "implementation SHM needs every rank of the group on one host; " + cfg_.desc +
                                     " spans hosts [" + hosts + "] (TORCHSTRATEGIES_HOST_ID or the hostname)");
  }
  if (plan_ == Plan::kRing) {
    for (int r = 0; r < n; ++r) ring_members_.push_back(r);
  } else if (plan_ == Plan::kHierarchical) {
    for (const auto& h : host_ranks_) ring_members_.push_back(h.front());
  }
  auto it = std::find(ring_members_.begin(), ring_members_.end(), cfg_.rank);
  ring_rank_ = it == ring_members_.end() ? -1 : static_cast<int>(it - ring_members_.begin());
}

void Transport::setup_shm(double timeout_s) {
  if (plan_ == Plan::kRing) return;
  const auto& mine = host_ranks_[host_];
  const int nl = static_cast<int>(mine.size());
  if (nl < 2) return;
  const std::string key = "ts/shm/" + std::to_string(host_);
  std::string name;
  try {
    if (local_rank_ == 0) {
      char hex[32];
      std::snprintf(hex, sizeof(hex), "%012llx", static_cast<unsigned long long>(random64() & 0xFFFFFFFFFFFFULL));
      name = "/torchstrat_" + std::to_string(getpid()) + "_" + hex;
      // The segment is unlinked once every local rank mapped it (attach), at exit and on SIGTERM.
      local_ = std::make_unique<shm::Comm>(name, 0, nl, cfg_.slot_bytes, true);
      std::vector<int> pids;
      for (int r : mine) pids.push_back(pids_[r]);
      local_->expect_pids(pids);  // a peer that dies before it maps the segment is noticed in attach
      store_->set(key, name, timeout_s);
    } else {
      name = store_->get({key}, timeout_s)[0];
      local_ = std::make_unique<shm::Comm>(name, local_rank_, nl, cfg_.slot_bytes, false);
    }
  } catch (const StoreTimeout& e) {
    throw named_fault(Fault::kTimeout, "shm set-up", {mine[0]}, timeout_s, e.what());
  } catch (const std::exception& e) {
    if (dynamic_cast<const Fault*>(&e)) throw;
    throw Fault(Fault::kInvalid, "shm set-up on " + cfg_.desc + ": " + e.what());
  }
  try {
    local_->attach(timeout_s);
  } catch (const shm::CommError& e) {
    raise(shm_fault("shm set-up (attach)", e, timeout_s));
  }
}

void Transport::build_ring(double timeout_s) {
  const int n = static_cast<int>(ring_members_.size());
  const std::string prefix = "ts/ring/" + std::to_string(epoch_) + "/";
  ring::Options o;
  o.socket_bytes = cfg_.ring_socket_bytes;
  auto comm = std::make_unique<ring::Comm>(ring_rank_, n, group_id_ ^ static_cast<uint64_t>(epoch_), o);
  const int right = (ring_rank_ + 1) % n;
  try {
    const int port = comm->listen(cfg_.ring_addr);
    const uint64_t nonce = random64() >> 1;
    store_->set(prefix + std::to_string(ring_rank_), cfg_.ring_addr + " " + std::to_string(port) + " " +
                                                         std::to_string(nonce), timeout_s);
    const auto v = split(store_->get({prefix + std::to_string(right)}, timeout_s)[0], ' ');
    comm->establish(v.at(0), std::stoi(v.at(1)), std::stoull(v.at(2)), nonce, timeout_s);
  } catch (const StoreTimeout& e) {
    broken_kind_ = Fault::kTimeout;
    broken_ = named_fault(Fault::kTimeout, "ring set-up", {ring_members_[right]}, timeout_s, e.what()).what();
    raise(Fault(broken_kind_, broken_));
  } catch (const ring::RingError& e) {
    const int peer = e.peer >= 0 && e.peer < n ? ring_members_[e.peer] : ring_members_[right];
    broken_kind_ = e.kind == ring::RingError::kTimeout ? Fault::kTimeout : Fault::kUnavailable;
    broken_ = named_fault(broken_kind_, "ring set-up", {peer}, timeout_s, e.what()).what();
    raise(Fault(broken_kind_, broken_));
  } catch (const std::exception& e) {
    throw Fault(Fault::kInvalid, "ring set-up on " + cfg_.desc + ": " + e.what());
  }
  ring_ = std::move(comm);
}

void Transport::ensure_ring(double timeout_s) {
  if (ring_ && !ring_->broken()) return;
  if (ring_) {  // the previous ring failed over a mismatch (a fault breaks the transport): build the next one
    ring_.reset();
    ++epoch_;
  }
  build_ring(timeout_s);
}

void Transport::begin(const CallDesc& d) {
  if (!broken_.empty()) {
    throw Fault(broken_kind_, cfg_.desc + " failed earlier and cannot be used again (" + broken_ +
                                  "); create a new process group");
  }
  if (local_) local_->set_call(d);
}

void Transport::raise(const Fault& f) {
  if (f.kind == Fault::kTimeout || f.kind == Fault::kUnavailable) {
    if (broken_.empty()) {
      broken_ = f.what();
      broken_kind_ = f.kind;
    }
    if (ring_) ring_->close();  // (the shared-memory group fails its peers itself; in the hierarchical plan
                                // the leader tells its host through the status record)
  }
  throw f;
}

void Transport::diagnose(std::vector<int>* gone, std::vector<int>* stopped) const {
  if (static_cast<int>(machines_.size()) != cfg_.size) return;  // before the rows are in: nothing known
  const uint64_t me = machines_[cfg_.rank];
  for (int r = 0; r < cfg_.size; ++r) {
    if (r == cfg_.rank || machines_[r] != me) continue;
    const char s = proc_state(pids_[r]);
    if (s == 'g') gone->push_back(r);
    if (s == 's') stopped->push_back(r);
  }
}

Fault Transport::named_fault(Fault::Kind kind, const char* what, std::vector<int> ranks, double timeout_s,
                             const std::string& detail) const {
  std::vector<int> gone, stopped;
  diagnose(&gone, &stopped);
  std::string why = detail;
  if (!gone.empty()) {
    kind = Fault::kUnavailable;
    ranks = gone;
    why = "process gone; " + detail;
  } else if (!stopped.empty()) {
    kind = Fault::kTimeout;
    ranks = stopped;
    why = "process stopped; " + detail;
  }
  const std::string who = ranks.empty() ? std::string(kind == Fault::kTimeout ? "not all ranks arrived"
                                                                               : "a peer is gone")
                          : kind == Fault::kTimeout ? "ranks " + ranks_text(ranks) + " did not arrive"
                                                    : "ranks " + ranks_text(ranks) + " are gone";
  const std::string within = kind == Fault::kTimeout ? " within " + seconds_text(timeout_s) + " s" : "";
  return Fault(kind, std::string(what) + " on " + cfg_.desc + ": " + who + within + " (" + why + ")");
}

std::string Transport::mismatch_text(int a, const CallDesc& da, int b, const CallDesc& db, const char* note) const {
  if (cfg_.global_ranks[a] > cfg_.global_ranks[b]) return mismatch_text(b, db, a, da, note);
  std::string diff = differences(da, db);
  if (diff.empty()) diff = note;
  return "collective mismatch on " + cfg_.desc + ": rank " + std::to_string(cfg_.global_ranks[a]) + " called " +
         describe(da) + " but rank " + std::to_string(cfg_.global_ranks[b]) + " called " + describe(db) +
         " (differs in " + diff + ")";
}

Fault Transport::shm_fault(const char* what, const shm::CommError& e, double timeout_s) {
  const auto& mine = host_ranks_[host_];
  std::vector<int> missing;
  for (int m : e.missing) {
    if (m >= 0 && m < static_cast<int>(mine.size())) missing.push_back(mine[m]);
  }
  switch (e.kind) {
    case shm::CommError::kMismatch:
      return Fault(Fault::kMismatch, mismatch_text(cfg_.rank, e.mine_call, mine.at(e.other), e.theirs_call,
                                                   "where the tensor lies (one rank's is in a shared buffer)"));
    case shm::CommError::kTimeout: return named_fault(Fault::kTimeout, what, missing, timeout_s, e.what());
    case shm::CommError::kPeerDead: return named_fault(Fault::kUnavailable, what, missing, timeout_s, e.what());
    case shm::CommError::kAborted:
      return named_fault(e.cause == shm::CommError::kTimeout ? Fault::kTimeout : Fault::kUnavailable, what, missing,
                         timeout_s, e.what());
    case shm::CommError::kBroken: break;
  }
  return Fault(Fault::kUnavailable, std::string(what) + " on " + cfg_.desc + ": " + e.what());
}

Fault Transport::ring_fault(const char* what, const ring::RingError& e, double timeout_s) {
  const int n = static_cast<int>(ring_members_.size());
  const std::string mkey = "ts/ring/" + std::to_string(epoch_) + "/mismatch";
  // Whatever is published goes to the store before the ring closes: the neighbours, seeing it close, look.
  auto publish = [&](const std::string& key, const std::string& value) {
    try {
      store_->set(key, value, kStoreSeconds);
      store_->check(key, kStoreSeconds);  // a round trip: the value is in the store before we go on
    } catch (const StoreTimeout&) {  // the others then name what they see themselves
    }
  };
  if (e.kind == ring::RingError::kMismatch) {
    const int left = ring_members_[(ring_rank_ + n - 1) % n];
    const std::string msg = mismatch_text(cfg_.rank, e.mine.call, left, e.theirs.call,
                                          "settings TORCHSTRATEGIES_RING_SMALL_BYTES / _CHUNK_BYTES");
    publish(mkey, msg);
    ring_->close();
    return Fault(Fault::kMismatch, msg);
  }
  Fault result(Fault::kUnavailable, "");
  bool found = false;
  if (store_->check(mkey, kStoreSeconds)) {  // a rank found a mismatch and closed the ring over it
    try {
      result = Fault(Fault::kMismatch, store_->get({mkey}, kStoreSeconds)[0]);
      found = true;
    } catch (const StoreTimeout&) {
    }
  }
  std::vector<int> gone, stopped;
  diagnose(&gone, &stopped);
  // A closed connection can be seen while the peer is still exiting: look again briefly.
  for (int i = 0; !found && i < 10 && gone.empty() && e.kind == ring::RingError::kPeerDead; ++i) {
    usleep(50000);
    gone.clear();
    stopped.clear();
    diagnose(&gone, &stopped);
  }
  if (!found && gone.empty() && stopped.empty() && store_->check("ts/fault", kStoreSeconds)) {
    try {  // a rank on another machine saw who is gone
      const auto v = split(store_->get({"ts/fault"}, kStoreSeconds)[0], ' ');
      result = Fault(Fault::kUnavailable, std::string(what) + " on " + cfg_.desc + ": ranks [" + v.at(0) +
                                              "] are gone (rank " + v.at(1) + " reported it; " + e.what() + ")");
      found = true;
    } catch (const std::exception&) {
    }
  }
  if (!found) {
    const int peer = e.peer >= 0 && e.peer < n ? ring_members_[e.peer] : -1;
    std::vector<int> named;
    if (peer >= 0) named.push_back(peer);
    result = named_fault(e.kind == ring::RingError::kTimeout ? Fault::kTimeout : Fault::kUnavailable, what, named,
                         timeout_s, e.what());
    const int culprit = !gone.empty() ? gone[0] : result.kind == Fault::kUnavailable ? peer : -1;
    if (culprit >= 0) {  // for the ranks that only see the ring close, on other machines
      publish("ts/fault", std::to_string(cfg_.global_ranks[culprit]) + " " +
                              std::to_string(cfg_.global_ranks[cfg_.rank]));
    }
  }
  ring_->close();
  return result;
}

// A hierarchical leader that failed tells the other hosts (their leaders wait on it in the ring).
void Transport::publish_failure(const Fault& f) {
  if (!ring_ || ring_rank_ < 0) return;
  if (f.kind == Fault::kMismatch) {
    const std::string mkey = "ts/ring/" + std::to_string(epoch_) + "/mismatch";
    try {
      store_->set(mkey, f.what(), kStoreSeconds);
      store_->check(mkey, kStoreSeconds);
    } catch (const StoreTimeout&) {
    }
  }
  ring_->close();
}

}  // namespace core
}  // namespace torchstrategies
