"""The checkpoint file: a 48-byte header (magic, payload length, SHA-256 of the payload) and the payload
(``torch.save`` of the state). :func:`read` checks the header, the length and the checksum before it decodes
anything, decodes with ``weights_only=True`` only, and turns every failure into a :class:`CheckpointError`
naming the file and what is wrong with it.

Files of the first format (a bare ``torch.save`` zip, no checksum) are still read.
"""

from __future__ import annotations

import hashlib
import io
import os
import struct
from typing import Any

import torch

from torchstrategies.errors import CheckpointError

__all__ = ["FORMAT", "write", "read"]

FORMAT = "torchstrategies-checkpoint-1"   # the state's "format" entry (the payload's layout, unchanged)
_MAGIC = b"TSCKPT\x00\x02"                # file format 2: the header below
_HEADER = struct.Struct("<8sQ32s")        # magic, payload length, sha256(payload)
_ZIP = b"PK\x03\x04"                      # format 1: torch.save's zip, as it is


def write(f: Any, state: dict[str, Any]) -> None:
    """Writes ``state`` to the open binary file ``f``: the header, then ``torch.save(state)``'s bytes (the
    caller renames the file into place)."""
    buf = io.BytesIO()
    torch.save(state, buf)
    payload = buf.getbuffer()  # no copy of the bytes
    f.write(_HEADER.pack(_MAGIC, len(payload), hashlib.sha256(payload).digest()))
    f.write(payload)


def read(path: str) -> dict[str, Any]:
    """The state in the checkpoint file ``path``, checked: header, length, checksum, format.

    Raises:
        FileNotFoundError: there is no file at ``path``.
        CheckpointError: the file is empty, truncated, changed after it was written (checksum), not a
            checkpoint, or its payload cannot be decoded as weights (never unpickled otherwise).
    """
    if not os.path.exists(path):
        raise FileNotFoundError(f"Checkpoint.restore: no checkpoint at {path!r}")
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(_HEADER.size)
        if size == 0:
            raise CheckpointError(f"checkpoint {path!r} is empty (0 bytes): its save never wrote it")
        if head.startswith(_ZIP):
            f.seek(0)
            return _checked(path, _decode(path, f.read(), "file"))
        if head[:len(_MAGIC)] != _MAGIC[:len(head)]:
            raise CheckpointError(f"checkpoint {path!r} is not a torchstrategies checkpoint (it starts with "
                                  f"{head[:8]!r}, expected {_MAGIC!r})")
        if size < _HEADER.size:
            raise CheckpointError(f"checkpoint {path!r} is truncated at byte {size} of its "
                                  f"{_HEADER.size}-byte header")
        _, length, digest = _HEADER.unpack(head)
        whole = _HEADER.size + length
        if size < whole:
            raise CheckpointError(f"checkpoint {path!r} is truncated at byte {size} of {whole}")
        if size > whole:
            raise CheckpointError(f"checkpoint {path!r} has {size - whole} bytes after its end (byte {whole}): "
                                  "it was changed after it was written")
        payload = f.read(length)
    got = hashlib.sha256(payload).digest()
    if got != digest:
        raise CheckpointError(f"checkpoint {path!r}: checksum mismatch (the payload's SHA-256 is {got.hex()[:16]}..., "
                              f"written {digest.hex()[:16]}...): the file was changed after it was written")
    return _checked(path, _decode(path, payload, "payload"))


def _decode(path: str, blob: bytes, what: str) -> Any:
    try:
        return torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - torch's reasons (and its advice to unpickle) are not the file's
        raise CheckpointError(f"checkpoint {path!r}: its {what} ({len(blob)} bytes) cannot be decoded as "
                              f"tensors and plain values ({type(exc).__name__}); the file is damaged or not a "
                              "checkpoint") from None


def _checked(path: str, state: Any) -> dict[str, Any]:
    if (not isinstance(state, dict) or state.get("format") != FORMAT or not isinstance(state.get("objects"), dict)
            or not isinstance(state.get("ints"), dict)):
        raise CheckpointError(f"checkpoint {path!r} is not a torchstrategies checkpoint (no {FORMAT!r} state)")
    return state
