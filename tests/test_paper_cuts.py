"""The paper cuts a new user hit (issue 39, item 5): each has a check here that failed before the fix."""

from __future__ import annotations

import ast
import io
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from harness import run_ranks

from torchstrategies_cli import main

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "torchstrategies"


# ---------------------------------------------------------------- logging: docs and code agree
def _code_loggers() -> set[str]:
    names = set()
    for f in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "getLogger" and node.args
                    and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
                names.add(node.args[0].value)
    return {n for n in names if n.startswith("torchstrategies.")}


def test_the_loggers_docs_logging_names_are_the_ones_the_code_uses():
    text = (ROOT / "docs" / "logging.md").read_text()
    table = set(re.findall(r"^\| `(torchstrategies\.[a-z_]+)` \|", text, re.MULTILINE))
    in_examples = set(re.findall(r"(?:INFO|ERROR|WARNING|DEBUG) (torchstrategies\.[a-z_]+):", text))
    assert table == _code_loggers()
    assert in_examples - {"torchstrategies.example"} <= table


def _chosen_implementation_body(rank: int, world: int) -> str:
    import torch.distributed as dist  # noqa: F401

    from torchstrategies import _logging, collectives

    buf = io.StringIO()
    _logging.configure("INFO", stream=buf, force=True)
    collectives.new_group(collectives.CommunicationOptions(implementation="AUTO"))
    return buf.getvalue()


@pytest.mark.timeout(90)
def test_the_chosen_implementation_is_logged_at_info_as_docs_logging_shows():
    out = run_ranks(_chosen_implementation_body, 2, timeout=80)[0]
    assert re.search(r"INFO torchstrategies\.collectives: implementation (SHM|RING|HIERARCHICAL) \(asked AUTO\) "
                     r"for 2 ranks of ", out), out


# ---------------------------------------------------------------- the command line
@pytest.mark.parametrize("args", [["bench", "train", "--strategy", "no-such-row", "--no-in-process"],
                                  ["bench", "allreduce", "--simulate-hosts", "3", "--nproc", "2"]])
def test_a_value_a_benchmark_refuses_exits_2_as_docs_cli_says(args):
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 2, r.output
    assert "Error:" in r.output and "Traceback" not in r.output


def test_an_unknown_implementation_is_not_offered_tree_which_was_removed():
    import torchstrategies as ts

    with pytest.raises(ValueError, match="'bogus'") as err:
        ts.CommunicationOptions(implementation="bogus")
    assert "TREE" not in str(err.value) and "RING" in str(err.value)


def test_env_lists_every_subpackage_and_every_benchmark_module():
    from torchstrategies.cli.bench_cmds import BENCH_MODULES
    from torchstrategies.env_info import collect

    modules = collect()["modules"]
    subpackages = {f"torchstrategies.{p.parent.name}" for p in PKG.glob("*/__init__.py")} - {
        "torchstrategies.bench", "torchstrategies.cli"}
    assert subpackages | set(BENCH_MODULES.values()) <= set(modules)
    assert all(modules.values())


def test_readme_states_the_python_versions_pyproject_supports():
    pyproject = (ROOT / "pyproject.toml").read_text()
    floor = re.search(r'requires-python\s*=\s*">=(3\.\d+)"', pyproject).group(1)
    readme = (ROOT / "README.md").read_text()
    stated = re.findall(r"Python (3\.\d+)", readme)
    assert stated and all(v == floor for v in stated), (floor, stated)


# ---------------------------------------------------------------- nothing reaches outside the library
def test_no_module_reads_cpythons_private_environ_mapping():
    offenders = [str(f.relative_to(ROOT)) for f in PKG.rglob("*.py") if re.search(r"environ\b.*_data\b|"
                 r"getattr\(os\.environ", f.read_text())]
    assert offenders == []


def test_malloc_is_left_alone_unless_the_user_turns_the_switch_on(monkeypatch):
    import ctypes

    from torchstrategies.parameter_server.rpc import transport

    opened = []
    monkeypatch.setattr(ctypes, "CDLL", lambda name: opened.append(name) or pytest.fail("mallopt called"))
    monkeypatch.setattr(transport, "_malloc_tuned", False)
    monkeypatch.delenv("TORCHSTRATEGIES_PS_TUNE_MALLOC", raising=False)
    transport.tune_malloc()
    assert opened == []


def test_grpc_streams_use_grpcs_public_api_by_default():
    code = ("from torchstrategies.parameter_server.rpc import streams; print(streams._use_own_thread)")
    env = {k: v for k, v in __import__("os").environ.items() if k != "TORCHSTRATEGIES_PS_STREAM"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "False"


def test_the_creation_tracker_says_its_hooks_install_with_the_first_strategy_not_on_import():
    from torchstrategies.distribute import creation

    doc = creation.__doc__ or ""
    assert "on import" not in doc and "first strategy" in doc


# ---------------------------------------------------------------- the Makefile
def test_the_makefile_builds_with_the_venvs_ninja_and_installs_the_integrations_with_the_pinned_torch():
    makefile = (ROOT / "Makefile").read_text()
    assert 'WITH_VENV_PATH := PATH="$(abspath $(VENV))/bin:$$PATH"' in makefile
    for line in makefile.splitlines():
        if line.startswith("\t") and ("setup.py" in line or ("pip install" in line and "-e ." in line)):
            assert "$(WITH_VENV_PATH) $(PY)" in line, line
    deps = makefile[makefile.index("$(DEPS_STAMP):"):makefile.index("touch $@")]
    assert '"$(TORCH)"' in deps and all(p in deps for p in ("accelerate", "transformers", "lightning"))


def _extension_count(env: dict[str, str]) -> int:
    code = ("import runpy, setuptools; seen = {}; setuptools.setup = lambda **kw: seen.update(kw); "
            "runpy.run_path('setup.py', run_name='__main__'); print(len(seen['ext_modules']))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={**__import__("os").environ, **env})
    return int(out.stdout.strip().splitlines()[-1])


def test_the_first_make_compiles_the_extension_once():
    """pip's editable build compiles in a temporary directory of its own, so the Makefile's editable install
    builds the Python package only and `build_ext --inplace` is the one compile."""
    makefile = (ROOT / "Makefile").read_text()
    install = next(line for line in makefile.splitlines() if line.startswith("\t") and "pip install" in line
                   and "-e ." in line)
    assert "TORCHSTRATEGIES_NO_EXTENSION=1" in install
    assert _extension_count({"TORCHSTRATEGIES_NO_EXTENSION": "1"}) == 0
    assert _extension_count({"TORCHSTRATEGIES_NO_EXTENSION": ""}) == 1
