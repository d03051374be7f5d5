"""The parameter server's message schema: a small, versioned, explicit binary format (no pickle).

Every gRPC request and reply body of the ps, worker and control services is a 48-byte authentication frame
(``session.py``: a sequence number, the length of the part it covers, a MAC) followed by one message::

    offset 0   b"TSPS"             magic
    offset 4   u16 version         (VERSION; a reader rejects any other)
    offset 6   u16 reserved        (0)
    offset 8   u32 header length   (H)
    offset 12  header              H bytes of UTF-8 JSON: an object; ``{"$b": i}`` stands for blob i,
                                   and the keys "_blobs" (list of blob lengths) and "_tensors" (list of
                                   [dtype name, shape]) describe what follows
    then       blobs               opaque byte strings, back to back
    then       tensors             raw little-endian tensor bytes, contiguous, back to back

Why this and not protobuf messages: the headers differ per request (a push lists (key, kind) entries, an
exec carries blobs) and are a few hundred bytes, while the tensors are most of the bytes; a protobuf
``bytes`` field would copy each tensor once more, and the generated classes would add a codegen step for
no extra checking. The gRPC methods use generic handlers that hand us the raw request bytes, so nothing is
parsed before the authentication checks (see ``session.py``), and :func:`decode` checks every length against
the bytes actually received (already bounded by gRPC's ``max_receive_message_length``) before it slices or
allocates anything. JSON parsing never runs code; dtypes come from an allow-list.
"""

from __future__ import annotations

import functools
import json
import struct
import warnings
from collections.abc import Callable
from typing import Any

import torch

from torchstrategies import errors

__all__ = ["VERSION", "WireError", "encode", "decode", "encode_error", "decode_error"]

VERSION = 1
_MAGIC = b"TSPS"
_FIXED = struct.Struct("<4sHHI")

_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float32",
        "float64",
        "float16",
        "bfloat16",
        "int8",
        "uint8",
        "int16",
        "int32",
        "int64",
        "bool",
        "complex64",
        "complex128",
    )
}
_NAMES = {v: k for k, v in _DTYPES.items()}
_dumps = functools.partial(json.dumps, separators=(",", ":"), allow_nan=True)


# decode(copy=False) views the (read-only) received bytes; the ps never writes to those tensors.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)


class WireError(ValueError):
    """A message that does not follow the schema (wrong magic or version, inconsistent lengths)."""


# dtypes numpy has no type for travel as same-sized integers (their bytes unchanged).
_NUMPY_STANDIN = {torch.bfloat16: torch.int16}


def _to_bytes(t: torch.Tensor) -> Any:
    """A buffer over ``t``'s bytes (no copy for a contiguous CPU tensor)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    standin = _NUMPY_STANDIN.get(t.dtype)
    if standin is not None:
        t = t.view(standin)
    return t.numpy()  # a C-contiguous array: b"".join reads its raw bytes


def encode(
    header: dict[str, Any],
    tensors: list[torch.Tensor] | None = None,
    seal: Callable[[bytes], bytes] | None = None,
) -> bytes:
    """One message: ``header`` (JSON types, bytes and tuples allowed) and ``tensors`` as raw bytes.

    ``seal(covered) -> frame``: the message starts with ``frame``, computed over ``covered`` (the preamble,
    the header and the blobs: everything but the tensor bytes), see ``session.py``.
    """
    blobs: list[bytes] = []

    def blob(x: object) -> dict[str, int]:  # json calls this for what it cannot encode itself
        if isinstance(x, (bytes, bytearray, memoryview)):
            blobs.append(bytes(x))
            return {"$b": len(blobs) - 1}
        raise TypeError(f"a parameter-server message header cannot hold {type(x).__name__} ({x!r:.80})")

    tensors = tensors or []
    metas = []
    for t in tensors:
        name = _NAMES.get(t.dtype)
        if name is None:
            raise WireError(
                f"dtype {t.dtype} cannot be sent to a parameter server (allowed: {sorted(_DTYPES)})"
            )
        metas.append([name, list(t.shape)])
    if not isinstance(header, dict):
        raise TypeError(f"a message header is a dict, got {type(header).__name__}")
    text = _dumps(header, default=blob)  # C encoder: walks the header without a Python recursion
    tail = _dumps({"_blobs": [len(b) for b in blobs], "_tensors": metas})
    head = (text[:-1] + "," + tail[1:] if len(header) else tail).encode()
    parts: list[Any] = [_FIXED.pack(_MAGIC, VERSION, 0, len(head)), head, *blobs]
    if seal is not None:
        covered = b"".join(parts)
        parts = [seal(covered), covered]
    parts.extend(_to_bytes(t) for t in tensors)
    return b"".join(parts)


def _nbytes(dtype: torch.dtype, shape: list[Any]) -> int:
    n = 1
    for s in shape:
        if not isinstance(s, int) or isinstance(s, bool) or s < 0:
            raise WireError(f"bad tensor shape {shape!r}")
        n *= s
    return n * dtype.itemsize


def decode(
    data: bytes, copy: bool = True, offset: int = 0, covered: int | None = None
) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """Parses the message at ``data[offset:]``; every length is checked against the bytes received before
    anything is sliced. ``covered``: the message's first ``covered`` bytes were authenticated (its frame,
    see ``session.py``); the preamble, header and blobs must then end exactly there.

    ``copy=False`` makes the tensors views of ``data`` itself (no copy): for requests a server only reads
    (a ps copies assigned values into its shards and reads pushed gradients). Such tensors must not be
    written to.

    Raises:
        WireError: the message does not follow the schema.
    """
    body, raw_header, pos = _read_header(data, offset)
    sizes, layout = _layout(body)
    tensor_sizes = [_nbytes(d, s) for d, s in layout]
    if covered is not None and pos + sum(sizes) != offset + covered:
        raise WireError(
            f"the authenticated part of the message ({covered} bytes) does not end where its header and "
            f"blobs end ({pos + sum(sizes) - offset} bytes)"
        )
    if sum(sizes) + sum(tensor_sizes) != len(data) - pos:
        raise WireError(
            f"lengths in the header ({sum(sizes) + sum(tensor_sizes)} bytes) do not match the "
            f"{len(data) - pos} bytes received"
        )
    view = memoryview(data)
    blobs = []
    for n in sizes:
        blobs.append(bytes(view[pos : pos + n]))
        pos += n
    tensors = _read_tensors(data, pos, layout, tensor_sizes, copy)
    if not blobs and b'"$b"' not in raw_header:
        return body, tensors  # nothing to substitute: skip the walk
    return _with_blobs(body, blobs), tensors


def _read_header(data: bytes, offset: int) -> tuple[dict[str, Any], bytes, int]:
    """The preamble and JSON header at ``data[offset:]``: ``(header, its raw bytes, where the blobs start)``."""
    size = len(data) - offset
    if size < _FIXED.size:
        raise WireError(f"message of {size} bytes is shorter than the {_FIXED.size}-byte preamble")
    magic, version, _, hlen = _FIXED.unpack_from(data, offset)
    if magic != _MAGIC:
        raise WireError(f"not a torchstrategies ps message (magic {magic!r})")
    if version != VERSION:
        raise WireError(f"message schema version {version}, this build speaks version {VERSION}")
    pos = offset + _FIXED.size
    if hlen > len(data) - pos:
        raise WireError(f"header length {hlen} exceeds the {len(data) - pos} bytes received")
    raw_header = bytes(memoryview(data)[pos : pos + hlen])
    try:
        body = json.loads(raw_header)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WireError(f"header is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise WireError("header is not a JSON object")
    return body, raw_header, pos + hlen


def _layout(body: dict[str, Any]) -> tuple[list[int], list[tuple[torch.dtype, list[int]]]]:
    """Takes the blob lengths and tensor descriptions out of ``body`` and checks them."""
    blob_lens = body.pop("_blobs", [])
    metas = body.pop("_tensors", [])
    if not isinstance(blob_lens, list) or not isinstance(metas, list):
        raise WireError("header's _blobs/_tensors are not lists")
    sizes: list[int] = []
    layout: list[tuple[torch.dtype, list[int]]] = []
    for n in blob_lens:
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise WireError(f"bad blob length {n!r}")
        sizes.append(n)
    for meta in metas:
        if not (
            isinstance(meta, list) and len(meta) == 2 and meta[0] in _DTYPES and isinstance(meta[1], list)
        ):
            raise WireError(f"bad tensor description {meta!r}")
        layout.append((_DTYPES[meta[0]], meta[1]))
    return sizes, layout


def _read_tensors(data: bytes, pos: int, layout: list[tuple[torch.dtype, list[int]]], sizes: list[int],
                  copy: bool) -> list[torch.Tensor]:
    """The tensors whose bytes start at ``data[pos]`` (lengths already checked against ``data``)."""
    tensors: list[torch.Tensor] = []
    if not layout:
        return tensors
    buf: bytes | bytearray = data
    off = pos
    if copy:
        buf, off = bytearray(memoryview(data)[pos:]), 0  # one copy: writable memory the tensors can own
    for (dtype, shape), n in zip(layout, sizes, strict=True):
        store = torch.uint8 if dtype == torch.bool else dtype
        if n == 0:
            t = torch.empty(shape, dtype=store)
        else:
            t = torch.frombuffer(buf, dtype=store, count=n // store.itemsize, offset=off).view(shape)
        tensors.append(t.view(torch.bool) if dtype == torch.bool else t)
        off += n
    return tensors


def _with_blobs(x: Any, blobs: list[bytes]) -> Any:
    """``x`` with each ``{"$b": i}`` replaced by ``blobs[i]``."""
    if isinstance(x, dict):
        if len(x) == 1 and "$b" in x:
            i = x["$b"]
            if not isinstance(i, int) or not 0 <= i < len(blobs):
                raise WireError(f"blob reference {i!r} out of range")
            return blobs[i]
        return {k: _with_blobs(v, blobs) for k, v in x.items()}
    if isinstance(x, list):
        return [_with_blobs(v, blobs) for v in x]
    return x


# ---- errors carried in a reply ---------------------------------------------------------------------
def _known_errors() -> dict[str, type[BaseException]]:
    known: dict[str, type[BaseException]] = {
        c.__name__: c
        for c in (
            ValueError,
            KeyError,
            TypeError,
            RuntimeError,
            IndexError,
            NotImplementedError,
            AssertionError,
            ZeroDivisionError,
            ArithmeticError,
            StopIteration,
            TimeoutError,
        )
    }
    known.update({n: getattr(errors, n) for n in errors.__all__})
    return known


def encode_error(exc: BaseException, text: str) -> dict[str, Any]:
    """The reply header for a handler that raised: the type's name, the message and the traceback text."""
    msg = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
    return {"ok": False, "error_type": type(exc).__name__, "error_message": str(msg), "text": text}


def decode_error(reply: dict[str, Any]) -> BaseException:
    """Rebuilds a reply's error as a builtin or torchstrategies exception (others become RuntimeError)."""
    name = str(reply.get("error_type", "RuntimeError"))
    message = str(reply.get("error_message", reply.get("text", "remote error")))
    cls = _known_errors().get(name)
    if cls is None:
        return RuntimeError(f"{name}: {message}")
    try:
        return cls(message)
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{name}: {message}")
