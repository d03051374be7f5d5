"""The CPUs a process may use (csrc/core/cpus.h): its affinity mask capped by its cgroup's CPU quota, which
decide whether the replicas' hand-over (_C.Baton) and the shared-memory barrier spin. A 1-CPU container on
a many-core host must not spin as if the host's CPUs were free."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from torchstrategies._ext import _C


def _tree(tmp_path, files: dict[str, str]) -> str:
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return str(tmp_path)


def test_a_process_with_one_cpu_in_its_affinity_mask_has_one_usable_cpu_and_never_spins():
    code = ("import os; os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]}); "
            "from torchstrategies._ext import _C; print(_C.usable_cpus(), _C.Baton.spin_us)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["1", "0"]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="this process has one usable CPU")
def test_a_process_with_several_cpus_spins_before_it_sleeps():
    assert _C.usable_cpus() == min(len(os.sched_getaffinity(0)), _C.usable_cpus())
    assert _C.Baton.spin_us > 0


def test_a_cgroup_v2_quota_of_half_a_cpu_leaves_one_usable_cpu(tmp_path):
    root = _tree(tmp_path, {"job/step/cpu.max": "max 100000\n", "job/cpu.max": "50000 100000\n"})
    assert _C.usable_cpus_in(root, "0::/job/step\n") == 1   # the parent's quota binds its children


def test_a_cgroup_v2_quota_rounds_up_and_never_exceeds_the_affinity_mask(tmp_path):
    affinity = len(os.sched_getaffinity(0))
    root = _tree(tmp_path, {"job/cpu.max": "150000 100000\n"})
    assert _C.usable_cpus_in(root, "0::/job\n") == min(affinity, 2)
    unlimited = _tree(tmp_path / "u", {"job/cpu.max": "max 100000\n"})
    assert _C.usable_cpus_in(unlimited, "0::/job\n") == affinity


def test_a_cgroup_v1_cpu_quota_is_read_from_its_controllers_hierarchy(tmp_path):
    root = _tree(tmp_path, {
        "cpu,cpuacct/cpu.cfs_quota_us": "-1\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n",
        "cpu,cpuacct/a/cpu.cfs_quota_us": "100000\n", "cpu,cpuacct/a/cpu.cfs_period_us": "100000\n",
        "memory/a/cpu.cfs_quota_us": "1\n",   # another controller's hierarchy is not read
    })
    text = "4:memory:/a\n3:cpu,cpuacct:/a\n0::/\n"
    assert _C.usable_cpus_in(root, text) == 1
    assert _C.usable_cpus_in(root, "3:cpu,cpuacct:/\n") == len(os.sched_getaffinity(0))


def test_missing_or_unreadable_cgroup_files_leave_the_affinity_mask(tmp_path):
    assert _C.usable_cpus_in(str(tmp_path), "garbage\n0::/nowhere\n") == len(os.sched_getaffinity(0))
