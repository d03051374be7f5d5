"""``torchstrategies env``: what this machine has, for bug reports."""

from __future__ import annotations

import json
from typing import Any

import click

__all__ = ["env", "render"]


def _yes(v: object) -> str:
    if v is True:
        return "yes"
    if v is False:
        return "no"
    return "-" if v is None else str(v)


def render(info: dict[str, Any]) -> None:
    """Prints ``env_info.collect()``'s dict as one aligned rich table."""
    from rich.console import Console
    from rich.table import Table

    t = Table(title="torchstrategies env", show_header=False)
    t.add_column("item", style="bold")
    t.add_column("value")
    ts, cpu, cuda, dist, ext = (
        info["torchstrategies"],
        info["cpu"],
        info["cuda"],
        info["distributed"],
        info["extension"],
    )
    t.add_row("torchstrategies", f"{ts['version']} ({ts['path']})")
    t.add_row("python", f"{info['python']['version']} ({info['python']['executable']})")
    t.add_row("platform", info["platform"])
    t.add_row("torch", info["torch"]["version"])
    cores = f"{cpu.get('usable_cores')} usable / {cpu.get('logical_cores')} logical"
    if cpu.get("physical_cores"):
        cores += f" / {cpu['physical_cores']} physical"
    t.add_row(
        "cpu",
        f"{cpu.get('processor')} ({cpu.get('machine')}); {cores}; torch threads "
        f"{cpu.get('torch_threads')}" + (f"; {cpu['memory_gib']} GiB RAM" if "memory_gib" in cpu else ""),
    )
    t.add_row("torch built with CUDA", _yes(cuda["torch_built_with_cuda"] or False))
    t.add_row(
        "CUDA available",
        _yes(cuda["available"])
        + (f": {cuda['device_count']} device(s) {', '.join(cuda['devices'])}" if cuda["available"] else ""),
    )
    t.add_row("CUDA_HOME (nvcc)", _yes(cuda.get("cuda_home")))
    if dist.get("available"):
        nccl = _yes(dist["nccl"]) + (f" {dist['nccl_version']}" if dist.get("nccl_version") else "")
        t.add_row("torch.distributed", f"gloo {_yes(dist['gloo'])}, nccl {nccl}, mpi {_yes(dist['mpi'])}")
    else:
        t.add_row("torch.distributed", "not available")
    if ext["built"]:
        t.add_row("extension _C", f"built, with CUDA: {_yes(ext['with_cuda'])} ({ext['path']})")
        ops = ext["ops"]
        t.add_row(
            "registered ops", "\n".join(f"{name} [{', '.join(keys)}]" for name, keys in ops.items()) or "none"
        )
    else:
        t.add_row("extension _C", f"NOT built: {ext['error']}")
    t.add_row("modules", "\n".join(f"{name}: {_yes(ok)}" for name, ok in info["modules"].items()))
    host = info["host"]
    t.add_row("host", f"{host['hostname']} (host id: {host['host_id']})")
    t.add_row(
        "environment", "\n".join(f"{k}={v}" for k, v in info["env"].items()) or "(none of interest set)"
    )
    from torchstrategies.bench.report import print_table

    print_table(t, Console())


def env(ctx: click.Context, json_path: str | None) -> None:
    """``torchstrategies env`` (options: ``torchstrategies_cli``): prints what this machine has, or writes it as
    JSON (``json_path`` ``-``: stdout only)."""
    from torchstrategies.env_info import collect

    info = collect()
    if json_path == "-":
        click.echo(json.dumps(info, indent=2, default=str))
        return
    render(info)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(info, f, indent=2, default=str)
        click.echo(f"written to {json_path}")
