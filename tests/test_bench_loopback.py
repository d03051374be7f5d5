"""The loopback roofline's sockets, in one process (two ranks on threads, a dict for the store)."""

from __future__ import annotations

import socket
import threading

import pytest

from torchstrategies.bench.loopback import LoopbackRing, ring_bytes


class _Store:
    """The two calls LoopbackRing makes on a c10d store: set(key, str) and a blocking get(key) -> bytes."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.cv = threading.Condition()

    def set(self, key: str, value: str) -> None:
        with self.cv:
            self.data[key] = value.encode()
            self.cv.notify_all()

    def get(self, key: str) -> bytes:
        with self.cv:
            assert self.cv.wait_for(lambda: key in self.data, timeout=20), key
            return self.data[key]


def test_ring_bytes_is_what_one_ring_all_reduce_sends_per_rank():
    assert ring_bytes(4096, 2) == 4096
    assert ring_bytes(4096, 4) == 6144
    assert ring_bytes(4096, 1) == 0


@pytest.mark.timeout(60)
def test_a_stray_connection_without_the_token_is_dropped_and_the_ring_still_works():
    store = _Store()
    rings: dict[int, LoopbackRing] = {}
    errors: list[BaseException] = []

    def make(rank: int) -> None:
        try:
            rings[rank] = LoopbackRing(store, rank, 2, timeout=20)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    t0 = threading.Thread(target=make, args=(0,))
    t0.start()
    host, port, _ = store.get("torchstrategies/bench/loopback/0").decode().split(":")
    assert host == "127.0.0.1"  # never a wildcard
    stray = socket.create_connection((host, int(port)), timeout=20)
    stray.sendall(b"x" * 16)  # a wrong token
    t1 = threading.Thread(target=make, args=(1,))
    t1.start()
    t0.join(30)
    t1.join(30)
    assert not errors, errors
    assert stray.recv(1) == b""  # closed without anything read past the token
    stray.close()
    payload = {r: bytes([r + 1]) * 300_000 for r in (0, 1)}  # more than one send() moves at once
    got = {r: bytearray(300_000) for r in (0, 1)}
    threads = [threading.Thread(target=rings[r].exchange, args=(memoryview(payload[r]), memoryview(got[r])))
               for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert bytes(got[0]) == payload[1] and bytes(got[1]) == payload[0]
    for ring in rings.values():
        ring.close()


def test_exchange_refuses_views_of_different_lengths():
    store = _Store()
    rings: dict[int, LoopbackRing] = {}
    threads = [threading.Thread(target=lambda r=r: rings.__setitem__(r, LoopbackRing(store, r, 2, 20)))
               for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    with pytest.raises(ValueError, match="send and recv must have the same length, got 4 and 3"):
        rings[0].exchange(memoryview(b"abcd"), memoryview(bytearray(3)))
    for ring in rings.values():
        ring.close()


def test_a_world_of_one_is_refused():
    with pytest.raises(ValueError, match="world >= 2 .* got rank 0, world 1"):
        LoopbackRing(_Store(), 0, 1)
