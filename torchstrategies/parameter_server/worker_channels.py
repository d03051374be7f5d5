"""A worker's channels to the ps tasks (``PsChannels``): one client per ps, requests fanned out in parallel."""

from __future__ import annotations

import threading

import torch

from torchstrategies.errors import UnavailableError
from torchstrategies.parameter_server.rpc.auth import TASK, JobAuth
from torchstrategies.parameter_server.rpc.client import RpcClient
from torchstrategies.parameter_server.rpc.transport import RemoteError

__all__ = ["PsChannels"]

Reply = tuple[dict, list[torch.Tensor]]


class PsChannels:
    """One authenticated client per ps task, opened on first use at the address the chief sent (``setup``).

    A channel that broke stays broken: the ps is then unavailable to this worker (a ps does not come back).

    Args:
        auth: the job's credentials (this worker authenticates as a task).
        timeout: the deadline of every request, until ``setup`` gives the chief's.
    """

    def __init__(self, auth: JobAuth, timeout: float):
        self.auth = auth
        self.timeout = timeout
        self.worker_index = -1
        self.addresses: list[tuple[str, str]] = []  # (address, instance) per ps, from the chief
        self._clients: dict[int, RpcClient] = {}
        self._lock = threading.Lock()

    def setup(self, addresses: list[tuple[str, str]], worker_index: int, timeout: float) -> None:
        """What the chief's ``setup`` request says: where each ps is, this worker's index, the deadline."""
        self.addresses = addresses
        self.worker_index = worker_index
        self.timeout = timeout

    def call(self, ps: int, header: dict, tensors: list[torch.Tensor] | None = None) -> Reply:
        """One request to ps ``ps``; an error it raised is raised here."""
        client = self._client(ps)
        try:
            return client.call(header, tensors)
        except RemoteError as e:
            raise e.exc from None

    def fan_out(self, requests: dict[int, tuple[dict, list]]) -> dict[int, Reply]:
        """Sends one request per ps, in parallel when there are several; raises the first error."""
        if len(requests) <= 1:
            return {ps: self.call(ps, h, t) for ps, (h, t) in requests.items()}
        results: dict[int, Reply] = {}
        errors: list[BaseException] = []

        def run(ps, h, t):
            try:
                results[ps] = self.call(ps, h, t)
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(ps, h, t)) for ps, (h, t) in requests.items()]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        if errors:
            raise errors[0]
        return results

    def close(self) -> None:
        with self._lock:
            for c in self._clients.values():
                c.close()
            self._clients.clear()

    def _client(self, ps: int) -> RpcClient:
        with self._lock:
            c = self._clients.get(ps)
            if c is None or c.broken:
                if c is not None and c.broken:
                    raise UnavailableError(f"ps:{ps} is unavailable (an earlier request failed)")
                if ps >= len(self.addresses):
                    raise UnavailableError(f"worker {self.worker_index} was not told where ps:{ps} is")
                address, instance = self.addresses[ps]
                c = RpcClient(address, f"ps:{ps}", self.timeout, self.auth, TASK, instance=instance,
                              hello={"op": "hello"})
                self._clients[ps] = c
            return c
