#include "core/cpus.h"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <sstream>

namespace torchstrategies::core {
namespace {

int affinity_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return CPU_COUNT(&set);
  return static_cast<int>(std::max<long>(1, sysconf(_SC_NPROCESSORS_ONLN)));
}

std::string read_file(const std::string& path) {
  std::ifstream f(path);
  std::stringstream s;
  s << f.rdbuf();
  return f ? s.str() : std::string();
}

// ceil(quota / period) for one cgroup directory, or +inf where it sets no quota ("max", -1, no file).
double quota_cpus(const std::string& dir, bool v2) {
  double quota = -1, period = 0;
  if (v2) {
    std::istringstream in(read_file(dir + "/cpu.max"));
    std::string q;
    if (!(in >> q >> period) || q == "max") return std::numeric_limits<double>::infinity();
    quota = std::atof(q.c_str());
  } else {
    const std::string q = read_file(dir + "/cpu.cfs_quota_us"), p = read_file(dir + "/cpu.cfs_period_us");
    if (q.empty() || p.empty()) return std::numeric_limits<double>::infinity();
    quota = std::atof(q.c_str());
    period = std::atof(p.c_str());
  }
  if (quota <= 0 || period <= 0) return std::numeric_limits<double>::infinity();
  return std::ceil(quota / period);
}

// The smallest quota on `path` and its ancestors inside the hierarchy mounted at `mount`.
double hierarchy_cpus(const std::string& mount, std::string path, bool v2) {
  double best = std::numeric_limits<double>::infinity();
  while (true) {
    best = std::min(best, quota_cpus(mount + path, v2));
    if (path.empty() || path == "/") break;
    const auto slash = path.find_last_of('/');
    path = slash == std::string::npos ? std::string() : path.substr(0, slash);
  }
  return best;
}

}  // namespace

int usable_cpus(const std::string& cgroup_root, const std::string& proc_self_cgroup) {
  double limit = affinity_cpus();
  std::istringstream lines(proc_self_cgroup);
  for (std::string line; std::getline(lines, line);) {
    // "hierarchy-id:controllers:path"; cgroup v2 is "0::path", v1 names its controllers ("cpu,cpuacct").
    const auto a = line.find(':'), b = line.find(':', a + 1);
    if (a == std::string::npos || b == std::string::npos) continue;
    const std::string controllers = line.substr(a + 1, b - a - 1), path = line.substr(b + 1);
    if (controllers.empty()) {
      limit = std::min(limit, hierarchy_cpus(cgroup_root, path, true));
      continue;
    }
    std::istringstream names(controllers);
    for (std::string name; std::getline(names, name, ',');) {
      if (name == "cpu") limit = std::min(limit, hierarchy_cpus(cgroup_root + "/" + controllers, path, false));
    }
  }
  return static_cast<int>(std::max(1.0, limit));
}

int usable_cpus() { return usable_cpus("/sys/fs/cgroup", read_file("/proc/self/cgroup")); }

}  // namespace torchstrategies::core
