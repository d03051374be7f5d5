"""The closure queue's contract in one process (TF's _CoordinatedClosureQueue tests), and max_staleness."""

from __future__ import annotations

import os
import threading

import pytest

from torchstrategies.errors import CancelledError, UnavailableError
from torchstrategies.parameter_server.closure_queue import ClosureQueue
from torchstrategies.parameter_server.remote_value import RemoteValue, RemoteValueStatus
from torchstrategies.parameter_server.rpc.rendezvous import store_prefix

os.environ.setdefault("TORCHSTRATEGIES_PS_SECRET", "test-job-secret-0123456789abcdef")   # the launch sets it


class _Closure:
    def __init__(self, tag):
        self.tag = tag
        self.remote_value = RemoteValue()

    def mark_cancelled(self):
        self.remote_value._mark_cancelled()


def test_wait_returns_after_all_finished_and_done_reports_it():
    q = ClosureQueue(1)
    q.put(_Closure(0))
    assert q.done() is False
    c = q.get(0)
    assert c.tag == 0 and q.done() is False
    assert q.wait(timeout=0.05) is False          # still in flight
    q.mark_finished(0)
    assert q.wait() is True and q.done() is True


def test_error_is_raised_once_cancels_queued_and_is_cleared():
    q = ClosureQueue(1)
    first, queued = _Closure(0), [_Closure(i) for i in range(1, 4)]
    q.put(first)
    for c in queued:
        q.put(c)
    assert q.get(0) is first
    q.mark_failed(ValueError("closure error"))
    with pytest.raises(ValueError, match="closure error"):
        q.wait()
    for c in queued:
        with pytest.raises(CancelledError):
            c.remote_value.fetch()
    assert q.wait() is True                       # cleared
    q.put(_Closure(9))                            # and scheduling works again
    assert q.get(0).tag == 9


def test_pending_error_is_raised_by_put_and_done():
    q = ClosureQueue(1)
    q.put(_Closure(0))
    q.get(0)
    q.mark_failed(KeyError("x"))
    late = _Closure(1)
    with pytest.raises(KeyError):
        q.put(late)
    with pytest.raises(CancelledError):           # the closure put with the error pending is cancelled
        late.remote_value.get()
    q.put(_Closure(2))
    q.get(0)
    q.mark_failed(KeyError("y"))
    with pytest.raises(KeyError):
        q.done()
    assert q.done() is True


def test_put_back_requeues_in_front_and_marks_aborted():
    q = ClosureQueue(2)
    a, b = _Closure("a"), _Closure("b")
    q.put(a)
    q.put(b)
    assert q.get(0) is a
    q.put_back(a)                                  # its worker died
    assert a.remote_value.status is RemoteValueStatus.ABORTED
    assert q.get(1) is a                           # runs again, first
    q.mark_finished(1)
    a.remote_value._set_value(1)
    assert a.remote_value.status is RemoteValueStatus.READY and a.remote_value.get() == 1


def test_fatal_error_is_sticky():
    q = ClosureQueue(1)
    queued = _Closure(0)
    q.put(queued)
    q.set_fatal("ps:0 is unavailable")
    for call in (q.done, q.wait, lambda: q.put(_Closure(1))):
        with pytest.raises(UnavailableError, match="ps:0"):
            call()
    with pytest.raises(CancelledError):
        queued.remote_value.fetch()


def test_max_staleness_holds_back_a_worker_that_is_ahead():
    q = ClosureQueue(2, max_staleness=1)
    for i in range(6):
        q.put(_Closure(i))
    for _ in range(2):                             # worker 0 completes two closures, worker 1 none
        q.get(0)
        q.mark_finished(0)
    assert q.get(0, timeout=0.01) is None          # 2 ahead of the slowest live worker > 1: it waits
    q.set_live(1, False)                           # a dead worker does not hold the others back
    assert q.get(0, timeout=0.01) is not None
    q.mark_finished(0)
    q.set_live(1, True)                            # w0 has completed 3, w1 0
    assert q.get(0, timeout=0.01) is None
    q.get(1)                                       # the slowest worker may always start
    q.mark_finished(1)                             # w1: 1, still 2 behind
    assert q.get(0, timeout=0.01) is None
    got = []
    t = threading.Thread(target=lambda: got.append(q.get(0, timeout=10.0)))
    t.start()                                      # w0 blocks until w1 catches up
    q.get(1)
    q.mark_finished(1)                             # w1: 2, w0 is 1 ahead: released
    t.join(15)
    assert got and got[0] is not None


def test_remote_value_get_timeout_and_fetch_numpy():
    import torch

    rv = RemoteValue()
    from torchstrategies.errors import DeadlineExceededError

    with pytest.raises(DeadlineExceededError):
        rv.get(timeout=0.01)
    rv._set_value({"loss": torch.tensor([1.5])})
    assert rv.fetch()["loss"].tolist() == [1.5] and type(rv.fetch()["loss"]).__module__ == "numpy"
    assert isinstance(rv.get()["loss"], torch.Tensor)


def _in_process_server(task_type, lease_timeout, timeout=5.0):
    """A Server in this process, with a rendezvous store hosted here (no chief process)."""
    import datetime

    import torch.distributed as dist

    import torchstrategies as ts
    from torchstrategies.parameter_server import Server

    store = dist.TCPStore("127.0.0.1", 0, 3, True, datetime.timedelta(seconds=10), wait_for_workers=False)
    port = store.port  # bound by the store itself: no other process can take it in between
    spec = {"chief": [f"127.0.0.1:{port}"], "ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]}
    resolver = ts.cluster_resolver.SimpleClusterResolver(spec, task_type=task_type, task_id=0)
    return store, Server(resolver, timeout=timeout, lease_timeout=lease_timeout)


def test_server_gives_up_when_the_chief_stops_sending_heartbeats():
    from torchstrategies.parameter_server.rpc.auth import CHIEF, JobAuth
    from torchstrategies.parameter_server.rpc.client import RpcClient

    store, server = _in_process_server("ps", lease_timeout=1.0)
    address = store.get(f"{store_prefix()}/addr/ps/0").decode().split("|")[0]
    chief = RpcClient(address, "ps:0", 5.0, JobAuth.from_env(), CHIEF, instance=server.instance,
                      hello={"op": "hello"})                                                    # then silent
    with pytest.raises(UnavailableError, match="no message from the chief"):
        server.join()
    chief.close()


def test_server_join_returns_after_shutdown_and_raises_when_the_chief_disconnects():
    from torchstrategies.parameter_server.rpc.auth import CHIEF, JobAuth
    from torchstrategies.parameter_server.rpc.client import RpcClient

    store, server = _in_process_server("worker", lease_timeout=30.0)
    address = store.get(f"{store_prefix()}/addr/worker/0").decode().split("|")[0]
    chief = RpcClient(address, "worker:0", 5.0, JobAuth.from_env(), CHIEF, instance=server.instance,
                      hello={"op": "hello"})
    chief.call({"op": "shutdown"})
    server.join()                                   # an orderly shutdown: returns
    store2, server2 = _in_process_server("worker", lease_timeout=30.0)
    address2 = store2.get(f"{store_prefix()}/addr/worker/0").decode().split("|")[0]
    chief2 = RpcClient(address2, "worker:0", 5.0, JobAuth.from_env(), CHIEF, instance=server2.instance,
                       hello={"op": "hello"})
    chief2.watch()
    chief2.close()                                  # the chief's Watch stream ends without a shutdown
    with pytest.raises(UnavailableError, match="Watch stream ended"):
        server2.join()
