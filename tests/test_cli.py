"""The ``torchstrategies`` command line: bench wiring, compare's advice, env, errors for missing parts.

Wiring tests use stand-in bench modules (tests/cli_fakes.py) with known numbers; the tests at the end run
the real bench modules on tiny sizes once they are in the build.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from tests import cli_fakes
from torchstrategies_cli import main
from torchstrategies_cli._options import parse_size

ROOT = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
MPL_REASON = "--plot needs matplotlib, from the test extra: pip install -e '.[test]'"


def invoke(args: list[str]):
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    return result


def assert_png(path: Path) -> None:
    assert path.is_file(), f"{path} was not written"
    assert path.read_bytes()[:8] == PNG_MAGIC


# ---------------------------------------------------------------- sizes


@pytest.mark.parametrize(
    "text,expected",
    [
        ("100", 100),
        ("64K", 65536),
        ("4KiB", 4096),
        ("4 kib", 4096),
        ("1M", 1 << 20),
        ("16MiB", 16 << 20),
        ("1G", 1 << 30),
        (7, 7),
        ("0.5K", 512),
    ],
)
def test_parse_size_accepts_binary_units(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "abc", "4 XB", "-3", "1.3K"])
def test_parse_size_rejects_non_sizes_naming_the_value(bad):
    with pytest.raises(ValueError, match="size"):
        parse_size(bad)


# ---------------------------------------------------------------- bench wiring (stand-in modules)


def test_bench_kernels_prints_table_writes_json_and_png(monkeypatch, tmp_path):
    pytest.importorskip("matplotlib", reason=MPL_REASON)
    calls = cli_fakes.install(monkeypatch, "kernels")
    js, png = tmp_path / "k.json", tmp_path / "sub" / "k.png"
    r = invoke(
        [
            "bench",
            "kernels",
            "--n",
            "2",
            "--size",
            "1K",
            "--size",
            "1M",
            "--repeats",
            "3",
            "--json",
            str(js),
            "--plot",
            str(png),
            "--no-progress",
        ]
    )
    assert r.exit_code == 0, r.output
    # The options reached run() under its own parameter names, as lists.
    assert calls["kernels"] == [{"ns": [2], "sizes": [1024, 1 << 20], "repeats": 3, "progress": False}]
    for name in ("add_n", "tree_reduce", "accumulate_n", "copy (roofline)"):
        assert name in r.output
    data = json.loads(js.read_text())
    assert data["columns"] == ["kernel", "N", "elements", "median (ms)"]
    assert len(data["rows"]) == 8
    assert_png(png)


def test_bench_kernels_leaves_unset_options_to_the_module(monkeypatch):
    calls = cli_fakes.install(monkeypatch, "kernels")
    r = invoke(["bench", "kernels"])
    assert r.exit_code == 0, r.output
    assert calls["kernels"] == [{"ns": (2,), "sizes": (1024, 1 << 20), "repeats": 5, "progress": True}]


def test_bench_option_the_module_does_not_take_is_a_usage_error(monkeypatch):
    cli_fakes.install(monkeypatch, "allreduce")
    r = invoke(["bench", "allreduce", "--repeats", "3"])
    assert r.exit_code == 2
    assert "--repeats is not supported by torchstrategies.bench.allreduce.run" in r.output


def test_bench_allreduce_passes_nproc_sizes_and_impls(monkeypatch, tmp_path):
    calls = cli_fakes.install(monkeypatch, "allreduce")
    js = tmp_path / "a.json"
    r = invoke(
        [
            "bench",
            "allreduce",
            "--nproc",
            "3",
            "--size",
            "4KiB",
            "--impl",
            "shm",
            "--impl",
            "gloo",
            "--json",
            str(js),
        ]
    )
    assert r.exit_code == 0, r.output
    assert calls["allreduce"] == [{"nproc": 3, "sizes": [4096], "implementations": ["shm", "gloo"]}]
    assert "all-reduce, 3 ranks" in r.output
    assert {row["implementation"] for row in json.loads(js.read_text())["rows"]} == {"gloo", "shm", "ring"}


def test_bench_allreduce_passes_simulate_hosts_only_when_given(monkeypatch):
    calls = cli_fakes.install(monkeypatch, "allreduce")
    assert invoke(["bench", "allreduce", "--nproc", "4", "--simulate-hosts", "2"]).exit_code == 0
    assert invoke(["bench", "allreduce", "--nproc", "4"]).exit_code == 0
    assert calls["allreduce"][0]["simulate_hosts"] == 2
    assert "simulate_hosts" not in calls["allreduce"][1]


def test_a_benchmark_that_fails_is_one_error_line_not_a_traceback(monkeypatch):
    calls = cli_fakes.install(monkeypatch, "allreduce")
    mod = sys.modules["torchstrategies.bench.allreduce"]

    def broken(nproc=2, progress=True):
        calls["allreduce"].append(nproc)
        raise RuntimeError("allreduce benchmark failed (exit 1): torchrun ...")

    monkeypatch.setattr(mod, "run", broken)
    r = CliRunner().invoke(main, ["bench", "allreduce"])
    assert calls["allreduce"] == [2]
    assert r.exit_code == 1
    assert (
        "Error: torchstrategies.bench.allreduce.run failed: RuntimeError: allreduce benchmark failed"
        in r.output
    )
    assert "Traceback" not in r.output


def test_bench_train_without_plot_function_says_not_available(monkeypatch, tmp_path):
    calls = cli_fakes.install(monkeypatch, "train")
    r = invoke(
        [
            "bench",
            "train",
            "--strategy",
            "ddp",
            "--strategy",
            "mwms",
            "--steps",
            "4",
            "--plot",
            str(tmp_path / "t.png"),
        ]
    )
    assert calls["train"] == [{"nproc": 2, "strategies": ["ddp", "mwms"], "steps": 4}]
    assert "mwms" in r.output  # the table printed before the plot step
    assert r.exit_code == 1
    assert "not available in this build: torchstrategies.bench.train.plot" in r.output


def test_bench_train_ps_passes_its_options_under_the_modules_names(monkeypatch):
    calls = cli_fakes.install(monkeypatch, "train-ps")
    args = ["bench", "train-ps", "--nproc", "5", "--num-ps", "2", "--steps", "3", "--repeats", "2", "--batch-size", "8"]
    r = invoke(args + ["--markdown"])
    assert r.exit_code == 0, r.output
    assert calls["train-ps"] == [{"nproc": 5, "num_ps": 2, "steps": 3, "rounds": 2, "batch": 8}]
    assert "| ps-async | 5.00 |" in r.output  # --markdown: the same table as Markdown
    assert invoke(["bench", "train-ps"]).exit_code == 0
    assert calls["train-ps"][1] == {"nproc": 4, "num_ps": 1, "steps": 100, "rounds": 3, "batch": 64}


def test_bench_train_ps_needs_a_worker_beside_the_chief_and_the_ps():
    assert invoke(["bench", "train-ps", "--nproc", "2"]).exit_code == 2  # below the chief, 1 ps and 1 worker


@pytest.mark.parametrize(
    "cmd", [["bench", "kernels"], ["bench", "allreduce", "--nproc", "2"], ["bench", "train", "--nproc", "2"]]
)
def test_bench_command_without_its_module_fails_with_a_clear_message(monkeypatch, cmd):
    cli_fakes.hide(monkeypatch, "kernels", "allreduce", "train")
    r = invoke(cmd)
    assert r.exit_code == 1
    assert "Error: not available in this build: torchstrategies.bench._absent_" + cmd[1] in r.output
    assert "Traceback" not in r.output


# ---------------------------------------------------------------- compare


def _advice_rows(path: Path) -> dict[tuple[str, str, str], str]:
    advice = json.loads(path.read_text())["advice"]
    return {(r["bench"], r["group"], r["size"]): r["use"] for r in advice["rows"]}


def test_compare_names_the_fastest_kernel_and_allreduce_per_size(monkeypatch, tmp_path):
    pytest.importorskip("matplotlib", reason=MPL_REASON)
    cli_fakes.install(monkeypatch, "kernels", "allreduce")
    js, png = tmp_path / "c.json", tmp_path / "c.png"
    r = invoke(["compare", "--json", str(js), "--plot", str(png), "--no-progress"])
    assert r.exit_code == 0, r.output
    rows = _advice_rows(js)
    # The roofline copy is a reference, not a candidate, though it is the fastest row.
    assert rows == {
        ("kernels", "N=2", "1024"): "tree_reduce",
        ("kernels", "N=2", str(1 << 20)): "accumulate_n",
        ("allreduce", "", "4 KiB"): "shm",
        ("allreduce", "", "1024 KiB"): "ring",
    }
    assert "Which to use" in r.output
    assert "allreduce: 4 KiB: shm, 1024 KiB: ring" in r.output
    assert_png(png)
    assert set(json.loads(js.read_text())["results"]) == {"kernels", "allreduce"}


def test_compare_passes_repeats_only_to_benchmarks_that_take_it(monkeypatch, tmp_path):
    calls = cli_fakes.install(monkeypatch, "kernels", "allreduce")  # the allreduce fake has no repeats
    r = invoke(["compare", "--repeats", "4", "--no-plot"])
    assert r.exit_code == 0, r.output
    assert calls["kernels"][0]["repeats"] == 4 and len(calls["allreduce"]) == 1


def test_compare_reads_saved_results_instead_of_running(monkeypatch, tmp_path):
    cli_fakes.install(monkeypatch, "kernels", "allreduce")
    kj, aj = tmp_path / "k.json", tmp_path / "a.json"
    assert invoke(["bench", "kernels", "--json", str(kj)]).exit_code == 0
    assert invoke(["bench", "allreduce", "--json", str(aj)]).exit_code == 0
    cli_fakes.hide(monkeypatch, "kernels", "allreduce")  # nothing can run now
    js = tmp_path / "c.json"
    r = invoke(
        ["compare", "--kernels-from", str(kj), "--allreduce-from", str(aj), "--json", str(js), "--no-plot"]
    )
    assert r.exit_code == 0, r.output
    assert _advice_rows(js)[("allreduce", "", "4 KiB")] == "shm"


def test_compare_with_one_benchmark_missing_uses_the_other_and_says_so(monkeypatch, tmp_path):
    pytest.importorskip("matplotlib", reason=MPL_REASON)
    cli_fakes.install(monkeypatch, "kernels")
    cli_fakes.hide(monkeypatch, "allreduce")
    js = tmp_path / "c.json"
    r = invoke(["compare", "--json", str(js), "--plot", str(tmp_path / "c.png")])
    assert r.exit_code == 0, r.output
    assert {b for b, _, _ in _advice_rows(js)} == {"kernels"}
    assert "not available in this build: torchstrategies.bench._absent_allreduce" in r.output


def test_compare_with_nothing_available_fails_cleanly(monkeypatch):
    cli_fakes.hide(monkeypatch, "kernels", "allreduce")
    r = invoke(["compare", "--no-plot"])
    assert r.exit_code == 1
    assert "not available in this build" in r.output and "Traceback" not in r.output


# ---------------------------------------------------------------- env


def test_env_json_reports_torch_extension_ops_and_host(monkeypatch):
    monkeypatch.setenv("TORCHSTRATEGIES_HOST_ID", "simulated-host-7")
    r = invoke(["env", "--json", "-"])
    assert r.exit_code == 0, r.output
    info = json.loads(r.output)
    assert info["torch"]["version"] == torch.__version__
    assert info["cuda"]["available"] == torch.cuda.is_available()
    assert info["distributed"]["gloo"] == torch.distributed.is_gloo_available()
    assert info["extension"]["built"] is True
    from torchstrategies import _C

    assert info["extension"]["with_cuda"] == bool(_C.with_cuda)
    assert "CPU" in info["extension"]["ops"]["accumulate_n"]
    assert set(info["extension"]["ops"]) >= {"accumulate_n", "tree_reduce", "accumulate_"}
    assert info["host"]["host_id"] == "simulated-host-7"
    assert info["env"]["TORCHSTRATEGIES_HOST_ID"] == "simulated-host-7"
    assert info["cpu"]["logical_cores"] >= 1


def test_env_table_and_json_file(tmp_path):
    js = tmp_path / "env.json"
    r = invoke(["env", "--json", str(js)])
    assert r.exit_code == 0, r.output
    assert "registered ops" in r.output and "accumulate_n" in r.output
    assert json.loads(js.read_text())["torch"]["version"] == torch.__version__


# ---------------------------------------------------------------- the real bench modules, tiny sizes
# These run once the module is in the build (each lands with its own branch); until then they skip.


def _needs(module: str):
    from torchstrategies.cli._common import module_available

    return pytest.mark.skipif(not module_available(module), reason=f"{module} is not in this build yet")


@pytest.fixture(scope="module")
def real_results(tmp_path_factory):
    """Runs each available real bench once, on tiny sizes; {name: (CliRunner result, json path, png path)}."""
    pytest.importorskip("matplotlib", reason=MPL_REASON)
    from torchstrategies.cli._common import module_available

    d = tmp_path_factory.mktemp("real")
    argv = {
        "kernels": [
            "bench",
            "kernels",
            "--n",
            "2",
            "--n",
            "3",
            "--size",
            "1K",
            "--size",
            "4K",
            "--repeats",
            "2",
        ],
        "allreduce": ["bench", "allreduce", "--nproc", "2", "--size", "4KiB", "--size", "64KiB"],
        "train": [
            "bench", "train", "--nproc", "2", "--steps", "2", "--repeats", "1", "--parameter-server",
            "--no-in-process",
        ],
    }
    out = {}
    for name, args in argv.items():
        if module_available(f"torchstrategies.bench.{name}"):
            js, png = d / f"{name}.json", d / f"{name}.png"
            out[name] = (invoke(args + ["--no-progress", "--json", str(js), "--plot", str(png)]), js, png)
    return out


@_needs("torchstrategies.bench.kernels")
@pytest.mark.timeout(300)
def test_real_bench_kernels_tiny(real_results):
    output, rows = _real_rows(real_results, "kernels")
    assert {(row["N"], row["elements"]) for row in rows} == {(2, 1024), (3, 1024), (2, 4096), (3, 4096)}
    assert "accumulate_n" in output and "tree_reduce" in output


@_needs("torchstrategies.bench.allreduce")
@pytest.mark.timeout(300)
def test_real_bench_allreduce_tiny(real_results):
    output, rows = _real_rows(real_results, "allreduce")
    assert rows and "gloo" in output.lower()


@_needs("torchstrategies.bench.train")
@pytest.mark.timeout(300)
def test_real_bench_train_tiny(real_results):
    _, rows = _real_rows(real_results, "train")
    names = " ".join(str(v) for row in rows for v in row.values()).lower()
    assert "ddp" in names and "parameterserver" in names.replace(" ", "").replace("_", "")


def _real_rows(real_results, name: str) -> tuple[str, list[dict]]:
    """The output and JSON rows of a real bench run; it exited 0 and drew its PNG."""
    r, js, png = real_results[name]
    assert r.exit_code == 0, r.output
    assert_png(png)
    return r.output, json.loads(js.read_text())["rows"]


@pytest.mark.timeout(300)
def test_real_compare_advises_from_the_real_results(real_results, tmp_path):
    if not {"kernels", "allreduce"} & set(real_results):
        pytest.skip(
            "neither torchstrategies.bench.kernels nor torchstrategies.bench.allreduce is in this build yet"
        )
    args = ["compare"]
    if "kernels" in real_results:
        args += ["--kernels-from", str(real_results["kernels"][1])]
    if "allreduce" in real_results:
        args += ["--allreduce-from", str(real_results["allreduce"][1])]
    js, png = tmp_path / "c.json", tmp_path / "c.png"
    r = invoke(args + ["--json", str(js), "--plot", str(png)])
    assert r.exit_code == 0, r.output
    rows = json.loads(js.read_text())["advice"]["rows"]
    if "kernels" in real_results:
        kernel_rows = [x for x in rows if x["bench"] == "kernels"]
        assert len(kernel_rows) == 4  # one winner per (N, size)
        assert {x["use"] for x in kernel_rows} <= {
            "add_n",
            "add_ loop",
            "stack+sum",
            "tree_reduce",
            "accumulate_n",
        }
    if "allreduce" in real_results:
        ar_rows = [x for x in rows if x["bench"] == "allreduce"]
        assert len(ar_rows) == 2  # one winner per message size (4 KiB, 64 KiB)
    assert_png(png)
