"""``bench allreduce --hosts``: the all-reduce across network namespaces on rate-limited links (issue 49).

The end-to-end tests need root, ``ip``/``tc``, veth and tbf (skipped with the reason otherwise); they use
small sizes and assert no time. A run that completes has had every case's sum checked on every rank (the
worker stops the run with a RuntimeError on a wrong sum, see allreduce_worker._check_all_reduce).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from torchstrategies.bench import allreduce_hosts, netns
from torchstrategies_cli import main as cli

UNAVAILABLE = netns.available()
needs_netns = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"network namespaces: {UNAVAILABLE}")
# veth bytes per call against the plan's payload: headers (GSO: ~0.1%), ACKs of the other direction, two gloo
# barriers per case; a wrong plan (RING's 1.5x on 2 hosts x 2 ranks, or each rank sending) is far outside.
SLACK = (0.99, 1.06)


def _dead_segments() -> set[str]:
    """/dev/shm segments of ours whose creating process is gone (others' tests may hold live ones)."""
    out = set()
    for name in os.listdir("/dev/shm"):
        m = re.match(r"^(?:torchstrat|tstrat)\w*?_(\d+)_", name)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            out.add(name)
    return out


@needs_netns
@pytest.mark.timeout(600)
def test_two_hosts_of_two_ranks_hierarchical_sends_each_byte_across_once_per_host():
    dead_before = _dead_segments()
    r = allreduce_hosts.run(hosts=2, nproc=4, link="1gbit", sizes=[1 << 20], rounds=1, progress=False,
                            timeout=400)
    rows = {row["implementation"]: row for row in r.rows}
    assert set(rows) == {"gloo", "ring", "hierarchical"}
    size = 1 << 20
    assert rows["ring"]["link_theory"] == pytest.approx(1.5 * size)  # 2(n-1)/n with n = 4 ranks
    assert rows["hierarchical"]["link_theory"] == pytest.approx(1.0 * size)  # 2(H-1)/H with H = 2 hosts
    for impl in ("ring", "hierarchical"):
        for host, sent in rows[impl]["link_tx_per_call"].items():
            assert SLACK[0] <= sent / rows[impl]["link_theory"] <= SLACK[1], (impl, host, sent)
    assert rows["hierarchical"]["link_bytes_per_host"] < 0.75 * rows["ring"]["link_bytes_per_host"]
    assert r.meta["hierarchical_plan"] == "HIERARCHICAL" and r.meta["rank_hosts"] == ["host0"] * 2 + ["host1"] * 2
    assert r.meta["rtt_seconds"] > 0 and 0 < rows["ring"]["fraction_of_line_rate"]
    assert netns.namespaces_of(os.getpid()) == []
    assert _dead_segments() <= dead_before


@needs_netns
@pytest.mark.timeout(600)
def test_three_hosts_of_one_rank_ring_bytes_match_the_theory():
    r = allreduce_hosts.run(hosts=3, link="10gbit", sizes=[3 << 18], implementations=["ring"], rounds=1,
                            progress=False, timeout=400)
    ring = next(row for row in r.rows if row["implementation"] == "ring")
    assert ring["link_theory"] == pytest.approx(4 / 3 * (3 << 18))
    assert len(ring["link_tx_per_call"]) == 3
    for sent in ring["link_tx_per_call"].values():
        assert SLACK[0] <= sent / ring["link_theory"] <= SLACK[1]
    assert netns.namespaces_of(os.getpid()) == []


# How the bench is stopped: (signal, to its whole process group (a terminal's Ctrl-C) or to its pid, how often,
# what the bench inherited for SIGINT). "ignored": a shell starts a background job (`cmd &` in a script) with
# SIGINT ignored; "again and again": Ctrl-C pressed every 50 ms until it stops, so some land in the cleanup.
STOPS = {
    "SIGTERM": (signal.SIGTERM, "pid", "once", signal.SIG_DFL),
    "Ctrl-C": (signal.SIGINT, "group", "once", signal.SIG_DFL),
    "Ctrl-C again and again": (signal.SIGINT, "group", "again", signal.SIG_DFL),
    "SIGINT to a background job that inherited it ignored": (signal.SIGINT, "pid", "once", signal.SIG_IGN),
}


def _ranks_in(names: list[str]) -> list[str]:
    return [p for n in names for p in subprocess.run(["ip", "netns", "pids", n], capture_output=True,
                                                     text=True).stdout.split()]


@needs_netns
@pytest.mark.timeout(300)
@pytest.mark.parametrize("stop", sorted(STOPS))
def test_a_stopped_run_exits_and_removes_its_namespaces_and_ranks(stop, tmp_path):
    signum, target, how, inherited = STOPS[stop]
    cmd = [sys.executable, "-m", "torchstrategies", "bench", "allreduce", "--hosts", "2", "--link", "10mbit",
           "--size", "16MiB", "--repeats", "1", "--no-progress"]  # 16 MiB at 10 Mbit/s: a run of minutes
    out = open(tmp_path / "out.txt", "w+")
    child = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, inherited))
    send = (lambda: os.killpg(child.pid, signum)) if target == "group" else (lambda: child.send_signal(signum))
    try:
        deadline = time.monotonic() + 200
        pids: list[str] = []
        while time.monotonic() < deadline and not pids:  # wait until the ranks run in the hosts
            time.sleep(0.5)
            pids = _ranks_in([n for n in netns.namespaces_of(child.pid) if "-h" in n])
            assert child.poll() is None, out.seek(0) or out.read()[-3000:]
        assert pids, "the ranks never started"
        send()
        stopped_by = time.monotonic() + 30
        while how == "again" and child.poll() is None and time.monotonic() < stopped_by:
            time.sleep(0.05)
            with contextlib.suppress(ProcessLookupError):
                send()
        try:
            child.wait(max(0.0, stopped_by - time.monotonic()))
        except subprocess.TimeoutExpired:
            pytest.fail(f"{stop}: the bench did not stop within 30 s")
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
        leftover = netns.namespaces_of(child.pid)
        for n in leftover:
            subprocess.run(["ip", "netns", "del", n], capture_output=True)
    assert leftover == []
    time.sleep(0.5)
    assert [p for p in pids if os.path.exists(f"/proc/{p}")] == []
    out.seek(0)
    text = out.read()
    if how == "once":  # (pressed again and again, a late Ctrl-C may land in click's own exit)
        assert child.returncode == (1 if signum == signal.SIGINT else 128 + signum), text[-3000:]
        assert ("Aborted!" in text) == (signum == signal.SIGINT), text[-3000:]


class _StopLandsHere:
    """Python drops an exception raised in a ``__del__`` (printed as "Exception ignored in"), as it drops one
    raised in a fork hook: where the CI saw a Ctrl-C land (logging's hook, while ``subprocess`` forked a rank)."""

    def __init__(self, signum: int) -> None:
        self.signum = signum

    def __del__(self) -> None:
        signal.raise_signal(self.signum)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_stop_whose_exception_python_dropped_still_stops_the_bench(signum):
    went_on, before = [], signal.getsignal(signum)
    with pytest.raises((KeyboardInterrupt, SystemExit)) as stopped:
        with netns.handle_signals():
            _StopLandsHere(signum)  # made and dropped at once: its __del__ raises the stop, and Python drops it
            went_on.append(True)
    assert went_on == [True]  # the dropped exception did not stop the block: the block's end does
    if signum == signal.SIGINT:
        assert stopped.type is KeyboardInterrupt
    else:
        assert stopped.type is SystemExit and stopped.value.code == 128 + signum
    assert signal.getsignal(signum) == before  # the handler from before is back


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_failure_after_a_dropped_stop_is_reported_as_the_stop_it_caused():
    with pytest.raises(KeyboardInterrupt) as stopped:
        with netns.handle_signals():
            _StopLandsHere(signal.SIGINT)
            raise RuntimeError("allreduce across 2 hosts: exit codes [-2, None]")  # the ranks got the Ctrl-C
    assert isinstance(stopped.value.__cause__, RuntimeError)


def test_an_error_without_a_stop_passes_through_unchanged():
    with pytest.raises(RuntimeError, match="no stop here"), netns.handle_signals():
        raise RuntimeError("no stop here")


@needs_netns
@pytest.mark.timeout(120)
def test_a_stale_run_s_namespaces_are_swept_when_a_network_is_made():
    gone = subprocess.Popen(["true"])
    gone.wait()
    stale = f"{netns.PREFIX}{gone.pid}-h0"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        with netns.Network(hosts=2, rate_bits=10**9) as net:
            assert stale in net.swept
            assert stale not in netns.namespaces_of()
    finally:
        subprocess.run(["ip", "netns", "del", stale], capture_output=True)


@needs_netns
@pytest.mark.timeout(120)
def test_the_delay_hub_delays_the_round_trip():
    probe = ("import socket,time\nc=socket.create_connection(('10.213.0.2',5000),timeout=30)\n"
             "c.setsockopt(socket.IPPROTO_TCP,socket.TCP_NODELAY,1)\nts=[]\n"
             "for _ in range(5):\n t=time.perf_counter();c.sendall(b'x');c.recv(1);ts.append(time.perf_counter()-t)\n"
             "print(min(ts))")
    echo = ("import socket\ns=socket.create_server(('10.213.0.2',5000));print('up',flush=True)\n"
            "c,_=s.accept()\nwhile (b:=c.recv(1)):\n c.sendall(b)")
    with netns.Network(hosts=2, rate_bits=10**9, delay_ms=5) as net:
        server = net.popen(1, [sys.executable, "-c", echo], env=dict(os.environ), stdout=subprocess.PIPE)
        assert server.stdout is not None and server.stdout.readline().strip() == "up"
        out = subprocess.run(["ip", "netns", "exec", net.names[0], sys.executable, "-c", probe],
                             capture_output=True, text=True, timeout=60)
    assert float(out.stdout) >= 0.010  # 5 ms each way, at least
    assert netns.namespaces_of(os.getpid()) == []


def test_without_root_it_says_so_plainly(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert "needs root" in (netns.available() or "")
    res = CliRunner().invoke(cli, ["bench", "allreduce", "--hosts", "2", "--size", "4KiB", "--no-progress"])
    assert res.exit_code != 0
    assert "NetworkUnavailable" in res.output and "needs root" in res.output


def test_without_ip_it_says_so_plainly(monkeypatch):
    monkeypatch.setattr(netns.shutil, "which", lambda tool: None if tool == "ip" else "/bin/" + tool)
    monkeypatch.setattr(netns.os, "geteuid", lambda: 0)
    assert "no `ip` on PATH" in (netns.available() or "")


def test_link_theory_is_once_per_host_for_hierarchical_and_per_edge_for_the_ring():
    mib = 1 << 20
    assert allreduce_hosts.link_theory("ring", mib, hosts=2, ranks_per_host=2) == 1.5 * mib
    assert allreduce_hosts.link_theory("hierarchical", mib, hosts=2, ranks_per_host=2) == 1.0 * mib
    assert allreduce_hosts.link_theory("auto", mib, hosts=2, ranks_per_host=2) == 1.0 * mib
    assert allreduce_hosts.link_theory("auto", mib, hosts=4, ranks_per_host=1) == 1.5 * mib
    assert allreduce_hosts.link_theory("gloo", mib, hosts=2, ranks_per_host=1) is None


def test_rates_parse_in_tc_spelling_and_bad_arguments_are_named():
    assert netns.parse_rate("1gbit") == 10**9 and netns.parse_rate("2.5Gbit/s") == 2_500_000_000
    with pytest.raises(ValueError, match="'fast' is not a rate"):
        netns.parse_rate("fast")
    with pytest.raises(ValueError, match="multiple of hosts=2"):
        allreduce_hosts.run(hosts=2, nproc=3)
    with pytest.raises(ValueError, match=r"\['shm'\] need one host"):
        allreduce_hosts.run(hosts=2, implementations=["shm"])
    res = CliRunner().invoke(cli, ["bench", "allreduce", "--link", "1gbit"])
    assert res.exit_code != 0 and "--link and --delay-ms need --hosts N" in res.output


@needs_netns
@pytest.mark.timeout(600)
def test_bench_train_runs_across_hosts_and_reports_against_no_comm():
    from torchstrategies.bench import train

    r = train.run(nproc=2, hosts=2, link="1gbit", strategies=["ddp", "mwms-pack-4MiB", "no-comm"], steps=2,
                  warmup=1, rounds=1, progress=False)
    assert [row["runner"] for row in r.rows] == ["ddp", "mwms-pack-4MiB", "no-comm"]
    assert r.meta["hosts"] == 2 and "across 2 hosts" in r.title
    assert all(row["samples/s"] > 0 for row in r.rows) and r.rows[-1]["% of no-comm"] == 100.0
    assert netns.namespaces_of(os.getpid()) == []
