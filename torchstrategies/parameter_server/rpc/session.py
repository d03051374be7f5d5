"""Per-connection sessions: a mutual challenge-response on the job secret, then single-use call MACs.

No credential that can be used twice ever crosses the network, and neither side sends anything that proves
more than "I took part in this one handshake" before the other side has proven it holds the job secret.

Handshake (``Auth/Handshake``, one unauthenticated call whose body is never read; see ``transport.py``)::

    client -> server   x-ts-hello: "<role>.<Nc>"            role "chief" or "task", Nc: 32 fresh random bytes
    server -> client   sid (16 B) | Ns (32 B) | proof (32 B)  sid, Ns: fresh random bytes

    transcript = "ts-ps/2" | identity | role | Nc | Ns | sid     (identity: "<task>|<instance>" of the server,
                                                                 e.g. "worker:1|9f3c...", from its signed
                                                                 rendezvous entry)
    proof      = HMAC(secret, "server-proof" | transcript)      the client checks it before it sends anything
    K          = HMAC(secret, "session-key"  | transcript)      never sent

The server proves it holds the secret AND that it is the task instance the client expects (a stale address,
a replayed rendezvous entry or a relay to another instance fails here). The client proves it holds the secret
with its first call: every call (a unary call, or a stream when it opens) carries, in its metadata,

    x-ts-auth: "<sid>.<seq>.<HMAC(K, 'call' | method path | seq)>"

checked before gRPC reads the body, and every message (a request, and its reply) starts with a 48-byte
frame ``b"TSA2" | u64 seq | u32 n | HMAC(K, 'request' or 'reply' | seq | n | the next n bytes)``, where
the n bytes are the message's preamble, header and blobs (everything but the raw tensor bytes, see
``wire.py``). ``seq`` comes from the client's one counter per session; the server accepts each ``seq``
once (a sliding window of :data:`WINDOW` numbers), so a captured call or message replayed later, on this
connection or another, is refused. A reply is bound to its request's ``seq``.

What the MACs do not cover: the raw tensor bytes of a message (hashing every gradient and parameter would cost
more than sending it); without TLS, an attacker who can modify traffic in flight can change tensor values,
but cannot run code, call a method, or replay anything. Use TLS against such an attacker.

With TLS and no secret, :class:`OpenSession` stands in: no handshake, frames carry no MAC, TLS authenticates
the peers and protects the connection.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import itertools
import re
import secrets
import struct
import threading

__all__ = [
    "AuthError",
    "Session",
    "OpenSession",
    "SessionTable",
    "client_hello",
    "client_session",
    "FRAME",
    "WINDOW",
    "HELLO_KEY",
]

HELLO_KEY = "x-ts-hello"
FRAME = 48
WINDOW = 4096  # how far (in sequence numbers) a call may arrive out of order
_MAGIC = b"TSA2"
_FRAME = struct.Struct("<4sQI32s")
_NONCE = 32
_SID = 16
_REPLY = _SID + _NONCE + 32
_HELLO = re.compile(r"(chief|task)\.([0-9a-f]{64})")
_ROLES = ("chief", "task")
_NO_MAC = b"\x00" * 32


class AuthError(ValueError):
    """A handshake, call credential or message frame that does not check out."""


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"\n".join(parts), hashlib.sha256).digest()


def _transcript(identity: str, role: str, nc: bytes, ns: bytes, sid: bytes) -> bytes:
    return b"\n".join((b"ts-ps/2", identity.encode(), role.encode(), nc, ns, sid))


class Session:
    """One side of an authenticated session (``K``, its id and the sequence numbers).

    The client draws every ``seq`` from :meth:`next_seq`; the server checks each one once (:meth:`accept`).
    """

    def __init__(self, sid: bytes, key: bytes, role: str):
        self.sid = sid
        self.sid_hex = sid.hex()
        self.role = role
        self._key = key
        self._next = itertools.count(1)
        self._lock = threading.Lock()
        self._top = 0  # highest seq accepted
        self._seen = 0  # bit i: seq (top - i) was accepted
        self.proven = False  # the client has made one valid call

    # ---- client side ---------------------------------------------------------------------------------
    def next_seq(self) -> int:
        return next(self._next)  # itertools.count is atomic under the GIL

    def call_credential(self, path: str) -> str:
        """The ``x-ts-auth`` value for one call of ``path`` (good once)."""
        seq = self.next_seq()
        return f"{self.sid_hex}.{seq}.{_mac(self._key, b'call', path.encode(), str(seq).encode()).hex()}"

    def sealer(self, seq: int, reply: bool = False):
        """``seal(covered) -> frame`` for the message with sequence number ``seq`` (see ``wire.encode``)."""
        label = b"reply" if reply else b"request"

        def seal(covered: bytes) -> bytes:
            n = len(covered)
            return _FRAME.pack(_MAGIC, seq, n, self._frame_mac(label, seq, n, covered))

        return seal

    def _frame_mac(self, label: bytes, seq: int, n: int, covered) -> bytes:
        m = hmac.new(self._key, b"\n".join((label, str(seq).encode(), str(n).encode(), b"")), hashlib.sha256)
        m.update(covered)
        return m.digest()

    # ---- server side ---------------------------------------------------------------------------------
    def check_call(self, path: str, seq: int, mac_hex: str) -> bool:
        good = _mac(self._key, b"call", path.encode(), str(seq).encode()).hex()
        if not hmac.compare_digest(mac_hex, good):
            return False
        return self.accept(seq)

    def accept(self, seq: int) -> bool:
        """Marks ``seq`` used; False if it was used before or is older than the window."""
        with self._lock:
            if seq > self._top:
                shift = seq - self._top
                self._seen = ((self._seen << shift) | 1) & ((1 << WINDOW) - 1) if shift < WINDOW else 1
                self._top = seq
                return True
            back = self._top - seq
            if seq <= 0 or back >= WINDOW or self._seen >> back & 1:
                return False
            self._seen |= 1 << back
            return True

    # ---- both sides: message frames ------------------------------------------------------------------
    def open(self, data, reply_to: int | None = None) -> tuple[int, int]:
        """Checks a message's frame; returns ``(seq, n)``: the wire message starts at :data:`FRAME` and its
        first ``n`` bytes are covered. A request's ``seq`` is accepted once; a reply must answer
        ``reply_to``.

        Raises:
            AuthError: no frame, a wrong MAC, a replayed or too old ``seq``, or a reply to another request.
        """
        if len(data) < FRAME:
            raise AuthError(f"message of {len(data)} bytes has no authentication frame")
        magic, seq, n, mac = _FRAME.unpack_from(data, 0)
        if magic != _MAGIC or n > len(data) - FRAME:
            raise AuthError("message has no valid authentication frame")
        label = b"request" if reply_to is None else b"reply"
        good = self._frame_mac(label, seq, n, memoryview(data)[FRAME : FRAME + n])
        if not hmac.compare_digest(mac, good):
            raise AuthError(f"message {seq} is not authenticated by this session")
        if reply_to is None:
            if not self.accept(seq):
                raise AuthError(f"message {seq} was replayed (its sequence number was used before)")
        elif seq != reply_to:
            raise AuthError(f"reply to message {seq} arrived for request {reply_to}")
        return seq, n


class OpenSession(Session):
    """TLS without a job secret: every peer with a certificate of the job's CA is trusted (as the chief);
    frames carry no MAC and sequence numbers are not checked (TLS protects the connection)."""

    def __init__(self) -> None:
        super().__init__(b"", b"", "chief")

    def call_credential(self, path: str) -> str:
        return ""

    def _frame_mac(self, label: bytes, seq: int, n: int, covered) -> bytes:
        return _NO_MAC

    def accept(self, seq: int) -> bool:
        return True


# ---- the handshake -----------------------------------------------------------------------------------
def client_hello(role: str) -> tuple[str, bytes]:
    """The ``x-ts-hello`` value for ``role`` and the nonce to keep for :func:`client_session`."""
    if role not in _ROLES:
        raise ValueError(f"role must be one of {_ROLES}, got {role!r}")
    nc = secrets.token_bytes(_NONCE)
    return f"{role}.{nc.hex()}", nc


def client_session(secret: bytes, identity: str, role: str, nc: bytes, reply: bytes) -> Session:
    """Checks the server's handshake reply; the session if the server proved it is ``identity`` of this job.

    Raises:
        AuthError: the reply is malformed or its proof does not match.
    """
    if len(reply) != _REPLY:
        raise AuthError(f"handshake reply of {len(reply)} bytes, expected {_REPLY}")
    sid, ns, proof = reply[:_SID], reply[_SID : _SID + _NONCE], reply[_SID + _NONCE :]
    t = _transcript(identity, role, nc, ns, sid)
    if not hmac.compare_digest(proof, _mac(secret, b"server-proof", t)):
        raise AuthError(
            f"the server did not prove that it is {identity!r} of this job (it does not hold the job secret, "
            "or it is another task or an older instance of it)"
        )
    return Session(sid, _mac(secret, b"session-key", t), role)


class SessionTable:
    """A server's sessions. Handshakes from anyone create *pending* sessions (at most ``max_pending``, the
    oldest dropped first); a session's first valid call promotes it (at most ``max_proven``, least recently
    used dropped first), so strangers flooding handshakes cannot push out the job's own sessions."""

    def __init__(self, secret: bytes, identity: str, max_pending: int = 1024, max_proven: int = 4096):
        self._secret = secret
        self.identity = identity
        self._pending: collections.OrderedDict[str, Session] = collections.OrderedDict()
        self._proven: collections.OrderedDict[str, Session] = collections.OrderedDict()
        self._max = (max_pending, max_proven)
        self._lock = threading.Lock()

    def handshake(self, hello: str | None) -> bytes:
        """The reply to a client's ``x-ts-hello``.

        Raises:
            AuthError: the hello is missing or malformed.
        """
        m = _HELLO.fullmatch(hello or "")
        if m is None:
            raise AuthError("missing or malformed handshake")
        role, nc = m.group(1), bytes.fromhex(m.group(2))
        sid, ns = secrets.token_bytes(_SID), secrets.token_bytes(_NONCE)
        t = _transcript(self.identity, role, nc, ns, sid)
        session = Session(sid, _mac(self._secret, b"session-key", t), role)
        with self._lock:
            self._pending[session.sid_hex] = session
            while len(self._pending) > self._max[0]:
                self._pending.popitem(last=False)
        return sid + ns + _mac(self._secret, b"server-proof", t)

    def check_call(self, path: str, credential: str | None) -> Session | None:
        """The session whose key made this call's ``x-ts-auth`` credential (its ``seq`` now used), or None."""
        parts = (credential or "").split(".")
        if len(parts) != 3 or not parts[1].isdigit() or len(parts[1]) > 19:
            return None
        sid, seq, mac = parts[0], int(parts[1]), parts[2]
        with self._lock:
            session = self._proven.get(sid) or self._pending.get(sid)
        if session is None or not session.check_call(path, seq, mac):
            return None
        with self._lock:
            if not session.proven:
                session.proven = True
                self._pending.pop(sid, None)
                self._proven[sid] = session
                while len(self._proven) > self._max[1]:
                    self._proven.popitem(last=False)
            elif sid in self._proven:
                self._proven.move_to_end(sid)
        return session
