"""The benchmarks' torchrun launcher: progress lines, failures with stderr, no pipe deadlock."""

from __future__ import annotations

import os
import sys

import pytest

from torchstrategies.bench.launch import environment, job_env, run_job, run_torchrun, worker_spec

# 200 KB on stderr before any stdout: more than a pipe buffer holds, so a piped stderr would block.
_CHATTY = ("import sys; sys.stderr.write('x' * 200_000 + 'LAST-ERR'); sys.stderr.flush(); "
           "print('PROGRESS 1 a'); print('PROGRESS 2 b'); sys.exit({rc})")


@pytest.mark.timeout(60)
def test_a_chatty_successful_job_finishes():
    run_torchrun([sys.executable, "-c", _CHATTY.format(rc=0)], dict(os.environ), total=2, desc="t", progress=True)


@pytest.mark.timeout(60)
def test_a_failed_job_raises_with_the_tail_of_its_stderr():
    with pytest.raises(RuntimeError, match=r"(?s)t: torchrun exited with 3:.*LAST-ERR"):
        run_torchrun([sys.executable, "-c", _CHATTY.format(rc=3)], dict(os.environ), total=2, desc="t",
                     progress=False)


@pytest.mark.timeout(60)
def test_a_job_past_its_timeout_is_stopped_and_named():
    cmd = [sys.executable, "-c", "import sys, time; sys.stderr.write('STILL-HERE'); sys.stderr.flush(); time.sleep(50)"]
    with pytest.raises(RuntimeError, match=r"(?s)t: torchrun did not finish within 1 s:.*STILL-HERE"):
        run_torchrun(cmd, dict(os.environ), total=1, desc="t", progress=False, timeout=1)


def test_worker_spec_reads_back_what_run_job_passes():
    assert worker_spec(["--spec", '{"steps": 3}', "--json", "/tmp/out.json"]) == ({"steps": 3}, "/tmp/out.json")


@pytest.mark.timeout(60)
def test_run_job_names_a_job_that_wrote_no_results(monkeypatch):
    import torchstrategies.bench.launch as launch

    monkeypatch.setattr(launch, "run_torchrun", lambda *a, **k: None)  # a job that "succeeds" silently
    with pytest.raises(RuntimeError, match="t: the job wrote no results"):
        run_job("some.module", 2, [], job_env(), total=1, desc="t", progress=False)


def test_environment_sets_inside_and_puts_back_what_was_there_even_on_an_error(monkeypatch):
    monkeypatch.setenv("TS_TEST_KNOB_SET", "before")
    monkeypatch.delenv("TS_TEST_KNOB_UNSET", raising=False)
    with pytest.raises(RuntimeError, match="inside"), environment({"TS_TEST_KNOB_SET": "1", "TS_TEST_KNOB_UNSET": "2"}):
        assert os.environ["TS_TEST_KNOB_SET"] == "1" and os.environ["TS_TEST_KNOB_UNSET"] == "2"
        raise RuntimeError("inside")
    assert os.environ["TS_TEST_KNOB_SET"] == "before"
    assert "TS_TEST_KNOB_UNSET" not in os.environ
