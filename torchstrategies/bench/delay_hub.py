"""A userspace hub that delays every frame: the switch of :class:`~torchstrategies.bench.netns.Network` when
a one-way delay is asked for (this kernel has no ``netem``).

    ip netns exec SWITCH python -m torchstrategies.bench.delay_hub --delay-ms 1 p0 p1

One ``AF_PACKET`` socket per port; every frame that arrives on a port is sent out of every other port
``--delay-ms`` later (a hub: the hosts' interfaces drop frames for other addresses). One thread, a queue
ordered by due time. Frames leave through the ports' qdiscs, so a ``tbf`` rate still applies. Each frame is
read and written with its ``virtio_net_hdr`` (``PACKET_VNET_HDR``), so a checksum or segmentation the sender
left to the device is still done by the kernel on the way out. It is meant for small messages (a few frames
per call): each frame costs some microseconds of Python.
"""

from __future__ import annotations

import argparse
import heapq
import select
import socket
import sys
import time

ETH_P_ALL = 0x0003
PACKET_OUTGOING = 4
SOL_PACKET = 263
PACKET_VNET_HDR = 15  # frames carry a virtio_net_hdr: a checksum the sender left to offload stays to do


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--delay-ms", type=float, required=True)
    p.add_argument("ports", nargs="+")
    a = p.parse_args(argv)
    delay = a.delay_ms / 1e3
    socks = []
    for port in a.ports:
        s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        s.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)
        s.bind((port, ETH_P_ALL))
        s.setblocking(False)
        socks.append(s)
    print("ready", flush=True)
    queue: list[tuple[float, int, int, bytes]] = []  # (due, sequence, source port, frame)
    seq = 0
    poller = select.poll()
    for s in socks:
        poller.register(s, select.POLLIN)
    by_fd = {s.fileno(): i for i, s in enumerate(socks)}
    while True:
        now = time.monotonic()
        while queue and queue[0][0] <= now:
            _, _, src, frame = heapq.heappop(queue)
            for i, s in enumerate(socks):
                if i != src:
                    try:
                        s.send(frame)
                    except (BlockingIOError, OSError):
                        pass  # a full queue drops the frame, as a switch would; TCP resends it
        timeout_ms = max(0.0, (queue[0][0] - time.monotonic()) * 1e3) if queue else 1000.0
        for fd, _ in poller.poll(timeout_ms):
            s = socks[by_fd[fd]]
            while True:
                try:
                    frame, addr = s.recvfrom(65536)
                except BlockingIOError:
                    break
                if addr[2] == PACKET_OUTGOING:
                    continue  # our own send, seen again
                seq += 1
                heapq.heappush(queue, (time.monotonic() + delay, seq, by_fd[fd], frame))


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except KeyboardInterrupt:
        pass
