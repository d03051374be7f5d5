"""The parameter server's wire format and gRPC transport on their own (in this process, fast)."""

from __future__ import annotations

import pytest
import torch

from torchstrategies.strategies.parameter_server import wire


def _tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(3, 4, generator=g).t(),  # not contiguous
        torch.randn(5, generator=g).bfloat16(),  # no numpy dtype
        torch.tensor([True, False, True]),
        torch.tensor(3.5, dtype=torch.float64),  # 0-d
        torch.empty(0, 3),
        torch.randn(2, 2, dtype=torch.complex64, generator=g),
        torch.arange(-3, 3, dtype=torch.int8).reshape(2, 3),
        torch.randn(4, generator=g).half(),
        torch.arange(7, dtype=torch.int64)[::2],  # strided view
        torch.randn(2, 3, generator=g, requires_grad=True),
    ]


@pytest.mark.parametrize("copy", [True, False])
def test_wire_round_trips_every_dtype_and_layout(copy):
    sent = _tensors()
    header = {"op": "push", "entries": [["1/0", "dense"]], "blob": b"\x00\xff", "n": None}
    got_header, got = wire.decode(wire.encode(header, sent), copy=copy)
    assert got_header == header
    assert len(got) == len(sent)
    for a, b in zip(sent, got, strict=True):
        assert b.dtype == a.dtype and b.shape == a.shape and not b.requires_grad
        assert torch.equal(b, a.detach()), (a, b)


def test_wire_decode_copy_owns_its_memory():
    t = torch.arange(4, dtype=torch.float32)
    data = bytearray(wire.encode({}, [t]))
    _, (owned,) = wire.decode(bytes(data))
    owned.add_(1)  # writable, and not a view of the message
    _, (again,) = wire.decode(bytes(data))
    assert again.tolist() == [0, 1, 2, 3] and owned.tolist() == [1, 2, 3, 4]
