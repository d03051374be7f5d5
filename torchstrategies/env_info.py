"""What this machine has, for bug reports: ``torchstrategies env`` prints :func:`collect`'s result.

Example:
    >>> from torchstrategies.env_info import collect
    >>> info = collect()
    >>> sorted(info)[:3]
    ['cpu', 'cuda', 'distributed']
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import platform
import socket
import sys
from typing import Any

__all__ = ["collect", "host_id", "cpu_model", "registered_ops", "ENV_VARS", "ENV_PREFIXES"]

# Environment variables worth seeing in a bug report (values of unset ones are omitted).
ENV_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TF_CONFIG",
    "CUDA_VISIBLE_DEVICES",
    "CUDA_HOME",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "GLOO_SOCKET_IFNAME",
)
ENV_PREFIXES = ("TORCHSTRATEGIES_", "NCCL_", "TORCHELASTIC_")

# Devices' keys report the kernel a call dispatches to (a CompositeExplicitAutograd kernel serves them all);
# Autograd, an alias key, reports a kernel registered for it.
_DEVICE_KEYS = ("CPU", "CUDA", "Meta")


def host_id() -> str:
    """This process's host identity: ``TORCHSTRATEGIES_HOST_ID`` if set (to simulate hosts), else hostname."""
    override = os.environ.get("TORCHSTRATEGIES_HOST_ID")
    return override if override else socket.gethostname()


def registered_ops() -> dict[str, list[str]]:
    """``torchstrategies::`` ops registered with torch, each with the dispatch keys that have a kernel (a
    device's key also when the kernel is registered for every device, as ``agreement_piece``'s is)."""
    import torch

    ops: dict[str, list[str]] = {}
    for name in sorted(torch._C._dispatch_get_all_op_names()):
        if not name.startswith("torchstrategies::"):
            continue
        keys = [k for k in _DEVICE_KEYS if torch._C._dispatch_has_computed_kernel_for_dispatch_key(name, k)]
        if torch._C._dispatch_has_kernel_for_dispatch_key(name, "Autograd"):
            keys.append("Autograd")
        ops[name.split("::", 1)[1]] = keys
    return ops


def _cpu() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"logical_cores": os.cpu_count()}
    try:
        info["usable_cores"] = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        info["usable_cores"] = os.cpu_count()
    try:
        import psutil

        info["physical_cores"] = psutil.cpu_count(logical=False)
        info["memory_gib"] = round(psutil.virtual_memory().total / 2**30, 1)
    except Exception:  # noqa: BLE001 - psutil is optional
        pass
    info["torch_threads"] = torch.get_num_threads()
    info["machine"] = platform.machine()
    info["processor"] = cpu_model()
    return info


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else ``platform.processor()``, else ``"unknown"``."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _cuda() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "torch_built_with_cuda": torch.version.cuda,
        "available": torch.cuda.is_available(),
        "device_count": 0,
        "devices": [],
    }
    if info["available"]:
        info["device_count"] = torch.cuda.device_count()
        info["devices"] = [torch.cuda.get_device_name(i) for i in range(info["device_count"])]
    try:
        from torch.utils.cpp_extension import CUDA_HOME

        info["cuda_home"] = CUDA_HOME
    except Exception:  # noqa: BLE001
        info["cuda_home"] = None
    return info


def _distributed() -> dict[str, Any]:
    import torch.distributed as dist

    if not dist.is_available():
        return {"available": False}
    info: dict[str, Any] = {
        "available": True,
        "gloo": dist.is_gloo_available(),
        "nccl": dist.is_nccl_available(),
        "mpi": dist.is_mpi_available(),
    }
    if info["nccl"]:
        try:
            import torch.cuda.nccl as nccl

            info["nccl_version"] = ".".join(str(x) for x in nccl.version())
        except Exception:  # noqa: BLE001
            pass
    return info


def _extension() -> dict[str, Any]:
    try:
        c = importlib.import_module("torchstrategies._C")
    except ImportError as exc:
        return {"built": False, "error": str(exc)}
    return {
        "built": True,
        "path": getattr(c, "__file__", None),
        "with_cuda": bool(getattr(c, "with_cuda", False)),
        "ops": registered_ops(),
    }


def _modules() -> dict[str, bool]:
    """Which optional parts of torchstrategies are in this build (they land branch by branch)."""
    names = (
        "torchstrategies.collectives",
        "torchstrategies.distribute",
        "torchstrategies.strategies",
        "torchstrategies.parameter_server",
        "torchstrategies.nn",
        "torchstrategies.cluster_resolver",
        "torchstrategies.checkpoint",
        "torchstrategies.bench.kernels",
        "torchstrategies.bench.allreduce",
        "torchstrategies.bench.train",
        "torchstrategies.bench.train_ps",
        "torchstrategies.bench.train_inproc",
        "torchstrategies.bench.fault_tolerance",
        "torchstrategies.bench.agreement_cost",
    )
    return {n: importlib.util.find_spec(n) is not None for n in names}


def collect() -> dict[str, Any]:
    """Everything ``torchstrategies env`` shows, as a JSON-serializable dict."""
    import torch

    try:
        from torchstrategies import __version__ as ts_version
    except Exception:  # noqa: BLE001
        ts_version = "unknown"
    env = {k: os.environ[k] for k in ENV_VARS if k in os.environ}
    env.update({k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)})
    return {
        "torchstrategies": {"version": ts_version, "path": os.path.dirname(os.path.abspath(__file__))},
        "python": {"version": platform.python_version(), "executable": sys.executable},
        "platform": platform.platform(),
        "torch": {"version": torch.__version__, "debug": bool(torch.version.debug)},
        "cpu": _cpu(),
        "cuda": _cuda(),
        "distributed": _distributed(),
        "extension": _extension(),
        "modules": _modules(),
        "host": {"hostname": socket.gethostname(), "host_id": host_id()},
        "env": env,
    }
