"""The paper cuts of a newcomer's walk (issue 52): each has a check here (or in test_docs.py's walk of the
docs' commands, or test_harness.py) that failed before the fix."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from harness import run_ranks

ROOT = Path(__file__).resolve().parent.parent


def _clean_env(**extra: str) -> dict[str, str]:
    """This environment without a launcher's variables (a plain `python script.py`)."""
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "GROUP_RANK", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT")
    env = {k: v for k, v in os.environ.items() if k not in launcher}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env.update(extra)
    return env


# ---------------------------------------------------------------- 2. the DDP / Lightning / Accelerate route logs
def _records_of_a_group_made_by_init_process_group(rank: int, world: int) -> tuple[str, str]:
    import torch
    import torch.distributed as dist

    from torchstrategies import _logging, collectives

    buf = io.StringIO()
    _logging.configure("INFO", stream=buf, force=True)
    dist.init_process_group("torchstrategies")
    dist.all_reduce(torch.ones(4))           # all DDP calls: our API is never used
    after_ddp = buf.getvalue()
    collectives.all_reduce(torch.ones(4))    # our API on the same group then logs no second record
    dist.destroy_process_group()
    return after_ddp, buf.getvalue()


@pytest.mark.timeout(120)
def test_a_group_made_by_init_process_group_logs_its_implementation_once_at_info():
    after_ddp, after_all = run_ranks(_records_of_a_group_made_by_init_process_group, 2, init_process_group=False,
                                     timeout=100)[0]
    record = "INFO torchstrategies.collectives: implementation SHM (asked AUTO) for 2 ranks of world"
    assert after_ddp.count("torchstrategies.collectives: implementation") == 1 and record in after_ddp, after_ddp
    assert after_all.count("torchstrategies.collectives: implementation") == 1, after_all


# ---------------------------------------------------------------- 8. accelerator() under plain python
@pytest.mark.timeout(120)
def test_the_accelerate_route_runs_one_process_under_plain_python_as_accelerator_does():
    pytest.importorskip("accelerate")
    code = ("import torch.distributed as dist\n"
            "from torchstrategies.integrations import accelerator\n"
            "acc = accelerator(cpu=True)\n"
            "assert acc.num_processes == 1 and acc.process_index == 0, (acc.num_processes, acc.process_index)\n"
            "assert not dist.is_initialized()\n"
            "print(acc.prepare(torch.nn.Linear(2, 1))(torch.ones(1, 2)).shape)\n")
    p = subprocess.run([sys.executable, "-c", "import torch\n" + code], capture_output=True, text=True,
                       env=_clean_env(), cwd=ROOT, timeout=110)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert "torch.Size([1, 1])" in p.stdout


# ---------------------------------------------------------------- 6. --help imports no torch
def _command_paths() -> list[list[str]]:
    """Every command of the parser: [], ["bench"], ["bench", "allreduce"], ..."""
    import click

    from torchstrategies_cli import main

    paths: list[list[str]] = []

    def walk(cmd: click.Command, path: list[str]) -> None:
        paths.append(path)
        if isinstance(cmd, click.Group):
            for name, sub in sorted(cmd.commands.items()):
                walk(sub, [*path, name])

    walk(main, [])
    return paths


def _leaf_commands() -> dict[str, object]:
    import click

    from torchstrategies_cli import main

    out = {}
    for path in _command_paths():
        cmd: click.Command = main
        for name in path:
            assert isinstance(cmd, click.Group)
            cmd = cmd.commands[name]
        if not isinstance(cmd, click.Group):
            out[" ".join(path)] = cmd
    return out


_HELP_WITHOUT_TORCH = """
import sys
from torchstrategies_cli import main
try:
    main(sys.argv[1:], prog_name="torchstrategies")
except SystemExit as done:
    assert done.code in (0, None), done.code
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "torchstrategies"))
assert not loaded, loaded
"""


@pytest.mark.parametrize("path", _command_paths(), ids=lambda p: " ".join(p) or "torchstrategies")
def test_the_help_of_every_command_imports_neither_torch_nor_the_package(path):
    p = subprocess.run([sys.executable, "-c", _HELP_WITHOUT_TORCH, *path, "--help"], capture_output=True,
                       text=True, env=_clean_env(), cwd=ROOT, timeout=60)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "Usage: torchstrategies" in p.stdout and "--help" in p.stdout


def test_version_imports_no_torch():
    p = subprocess.run([sys.executable, "-c", _HELP_WITHOUT_TORCH, "--version"], capture_output=True, text=True,
                       env=_clean_env(), cwd=ROOT, timeout=60)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.startswith("torchstrategies, version ")


def test_the_console_script_is_the_torch_free_parser():
    import tomllib

    from torchstrategies_cli import main

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    module, _, attr = project["project"]["scripts"]["torchstrategies"].partition(":")
    assert (module, attr) == ("torchstrategies_cli", "main")
    assert getattr(__import__(module), attr) is main
    from setuptools import find_packages

    found = find_packages(str(ROOT), include=project["tool"]["setuptools"]["packages"]["find"]["include"])
    assert {"torchstrategies", "torchstrategies.cli", "torchstrategies_cli"} <= set(found)


@pytest.mark.parametrize("name", sorted(_leaf_commands()))
def test_every_command_s_options_are_exactly_what_its_implementation_takes(name):
    """No drift between the parser (torchstrategies_cli) and the function a command runs (torchstrategies.cli):
    it is called as ``function(ctx, **every option)``, so each side must name the same parameters."""
    import inspect

    from torchstrategies_cli._command import ImplCommand

    cmd = _leaf_commands()[name]
    assert isinstance(cmd, ImplCommand), f"{name} is not an ImplCommand (its body would load at import)"
    params = list(inspect.signature(cmd.implementation()).parameters.values())
    assert params and params[0].name == "ctx", f"{cmd.target} must take the click context first"
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params), cmd.target
    assert {p.name for p in params[1:]} == {p.name for p in cmd.params if p.name}, cmd.target


@pytest.mark.timeout(150)
def test_python_m_torchstrategies_runs_the_same_parser():
    def help_of(module: str) -> str:
        p = subprocess.run([sys.executable, "-m", module, "bench", "--help"], capture_output=True, text=True,
                           env=_clean_env(), cwd=ROOT, timeout=140)
        assert p.returncode == 0, p.stderr[-3000:]
        return p.stdout

    assert help_of("torchstrategies") == help_of("torchstrategies_cli")


# ---------------------------------------------------------------- 6. the commands run with the API loaded
@pytest.mark.timeout(150)
def test_a_command_that_runs_loads_the_api_and_torch():
    p = subprocess.run([sys.executable, "-m", "torchstrategies", "env", "--json", "-"], capture_output=True,
                       text=True, env=_clean_env(), cwd=ROOT, timeout=140)
    assert p.returncode == 0, p.stderr[-3000:]
    assert '"accumulate_n"' in p.stdout or "accumulate_n" in p.stdout


# ---------------------------------------------------------------- 3. tables in a file or a pipe
def test_a_table_printed_to_a_file_keeps_every_row_on_one_line_and_uses_the_terminal_width_only_on_one():
    from rich.console import Console

    from torchstrategies.bench.report import BenchResult

    r = BenchResult("kernels", ["threads", "N", "elements", "method", "median (ms)", "% of copy roofline"],
                    rows=[{"threads": 1, "N": 8, "elements": 16777216, "method": "accumulate_n (fused, one pass)",
                           "median (ms)": 17.15, "% of copy roofline": 96.0}])
    to_file = io.StringIO()
    r.print(Console(file=to_file, width=40))  # what rich assumes for a pipe: a width that is not there
    row = [ln for ln in to_file.getvalue().splitlines() if "accumulate_n" in ln]
    assert len(row) == 1 and "accumulate_n (fused, one pass)" in row[0] and "17.15" in row[0], to_file.getvalue()
    assert not set("│┃━─┏┡└") & set(to_file.getvalue())  # a plain layout: no box drawing in a file
    on_terminal = io.StringIO()
    r.print(Console(file=on_terminal, width=40, force_terminal=True))
    shown = re.sub(r"\x1b\[[0-9;]*m", "", on_terminal.getvalue())  # without the colour codes
    assert max(len(ln) for ln in shown.splitlines()) <= 40  # fitted to the terminal
