"""The first build says once that it compiles and about how long, and shows the compiler's lines only when
it fails (issue 52, item 4): ``build_quiet.py``, which setup.py wraps around ninja's build."""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_BUILD = """
    import subprocess, sys
    sys.path.insert(0, {root!r})
    from build_quiet import quiet_build
    with quiet_build("compiling the C++ extension (about 6 minutes: 18 files on 2 cores)", {log!r}):
        # what ninja prints: a kilobyte-long command per file, then the compiler's own messages
        subprocess.run(["sh", "-c", "for i in 1 2 3 4 5 6; do echo \\"[$i/6] c++ -O3 -fPIC -I/a/very/long/path "
                        "csrc/file$i.cpp -o build/file$i.o\\"; done; echo 'warning: unused' >&2"], check=True)
        print("setuptools: copying _C.so")
        if {fail!r}:
            subprocess.run(["sh", "-c", "echo 'csrc/ops.cpp:7:3: error: expected ; before }}' >&2"])
            raise SystemExit("error: command 'ninja' failed with exit code 1")
"""


def _build(tmp_path: Path, fail: bool, verbose: bool = False) -> subprocess.CompletedProcess:
    log = tmp_path / "build" / "extension-build.log"
    script = tmp_path / "b.py"
    script.write_text(textwrap.dedent(_BUILD.format(root=str(ROOT), log=str(log), fail=fail)))
    env = {k: v for k, v in os.environ.items() if k != "TORCHSTRATEGIES_BUILD_VERBOSE"}
    if verbose:
        env["TORCHSTRATEGIES_BUILD_VERBOSE"] = "1"
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=60)


def test_a_build_says_one_line_and_keeps_the_compilers_lines_in_the_log(tmp_path):
    p = _build(tmp_path, fail=False)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines() == [
        "compiling the C++ extension (about 6 minutes: 18 files on 2 cores); the compiler's output goes to "
        f"{tmp_path / 'build' / 'extension-build.log'}"]
    assert p.stderr == ""
    log = (tmp_path / "build" / "extension-build.log").read_text()
    assert "[6/6] c++ -O3" in log and "warning: unused" in log and "copying _C.so" in log


def test_a_failed_build_shows_the_compilers_lines(tmp_path):
    p = _build(tmp_path, fail=True)
    assert p.returncode != 0
    assert "the build failed; the last" in p.stderr and "csrc/ops.cpp:7:3: error: expected" in p.stderr
    assert "[6/6] c++ -O3" in p.stderr and "ninja' failed" in p.stderr


def test_the_verbose_switch_shows_everything(tmp_path):
    p = _build(tmp_path, fail=False, verbose=True)
    assert "[6/6] c++ -O3" in p.stdout and "warning: unused" in p.stderr
    assert not (tmp_path / "build" / "extension-build.log").exists()


def test_the_estimate_and_what_is_out_of_date(tmp_path):
    sys.path.insert(0, str(ROOT))
    from build_quiet import estimate_minutes, out_of_date

    assert estimate_minutes(18, 2) == 6 and estimate_minutes(1, 16) == 1
    src, so = tmp_path / "a.cpp", tmp_path / "_C.so"
    src.write_text("")
    assert out_of_date(str(so), [str(src)])      # never built: the first build
    so.write_text("")
    os.utime(src, (1, 1))
    assert not out_of_date(str(so), [str(src)])  # built after the source: ninja has nothing to do
    os.utime(src, None)
    os.utime(so, (1, 1))
    assert out_of_date(str(so), [str(src)])      # a source changed: ninja rebuilds that file only


def test_setup_builds_through_the_quiet_wrapper_with_ninja():
    seen: dict = {}
    import setuptools

    real, setuptools.setup = setuptools.setup, lambda **kw: seen.update(kw)
    try:
        runpy.run_path(str(ROOT / "setup.py"), run_name="__main__")
    finally:
        setuptools.setup = real
    command = seen["cmdclass"]["build_ext"]
    assert any(c.__name__ == "QuietBuildExtension" for c in command.__mro__)
    assert command(__import__("setuptools").Distribution()).use_ninja  # ninja's incremental rebuilds stay
