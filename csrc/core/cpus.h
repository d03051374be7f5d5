// How many CPUs this process can run on at the same time: the CPUs of its affinity mask (taskset, cpuset,
// a container's --cpuset-cpus), capped by its cgroup's CPU quota (a container's --cpus, Kubernetes' CPU
// limit: cgroup v2 cpu.max, v1 cpu.cfs_quota_us / cpu.cfs_period_us, the smallest along the cgroup's
// ancestors), at least 1. The host's CPU count (std::thread::hardware_concurrency, sysconf) says neither:
// a 1-CPU container on a 64-core host would spin as if 64 CPUs were free. Torch-free.
#pragma once

#include <string>

namespace torchstrategies::core {

// The usable CPUs of this process as they are now (reads the affinity mask and the cgroup files).
int usable_cpus();

// The same with the cgroup files read under `cgroup_root` (normally /sys/fs/cgroup) for the memberships
// written in `proc_self_cgroup` (the text of /proc/self/cgroup): what tests point at a fake tree.
int usable_cpus(const std::string& cgroup_root, const std::string& proc_self_cgroup);

}  // namespace torchstrategies::core
