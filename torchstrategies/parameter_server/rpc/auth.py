"""Who may talk to a parameter-server job: the job secret, mutual TLS and signed rendezvous entries.

Configured by the launch, through the environment of every task (never through the rendezvous store):

* ``TORCHSTRATEGIES_PS_SECRET`` (or ``TORCHSTRATEGIES_PS_SECRET_FILE``, a file holding it): a per-job
  secret. It never crosses the network: each connection runs a mutual challenge-response on it and every
  call and message carries a single-use MAC made with the session key it yields (``session.py``). The
  entries published in the rendezvous store are signed with it (:meth:`JobAuth.sign`), so whoever can write
  to the store cannot redirect a task.
* ``TORCHSTRATEGIES_PS_TLS_CERT``, ``TORCHSTRATEGIES_PS_TLS_KEY``, ``TORCHSTRATEGIES_PS_TLS_CA`` (PEM files):
  mutual TLS. Servers require a client certificate signed by the CA; clients check the server's
  (``TORCHSTRATEGIES_PS_TLS_SERVER_NAME`` overrides the name checked, for certificates issued to one name).

One of the two is required. With TLS and no secret, every peer holding a certificate of the CA is trusted
with every role and entries are not signed (a redirected address then fails the TLS handshake instead).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
import warnings
from dataclasses import dataclass

__all__ = ["JobAuth", "AUTH_KEY", "CHIEF", "TASK", "with_job_secret"]

AUTH_KEY = "x-ts-auth"
CHIEF = "chief"
TASK = "task"

_ENV_SECRET = "TORCHSTRATEGIES_PS_SECRET"
_ENV_SECRET_FILE = "TORCHSTRATEGIES_PS_SECRET_FILE"
_ENV_TLS = ("TORCHSTRATEGIES_PS_TLS_CERT", "TORCHSTRATEGIES_PS_TLS_KEY", "TORCHSTRATEGIES_PS_TLS_CA")


def with_job_secret(env: dict[str, str]) -> dict[str, str]:
    """``env`` plus a fresh random job secret, unless it already names a secret or TLS files.

    For launchers that start every task of a job on this host (the benchmarks, the demo, tests): the
    secret reaches the tasks through their environment only.
    """
    import secrets

    if not (env.get(_ENV_SECRET) or env.get(_ENV_SECRET_FILE) or env.get(_ENV_TLS[0])):
        env = {**env, _ENV_SECRET: secrets.token_hex(32)}
    return env


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ValueError(f"cannot read {what} {path!r}: {exc}") from None


def _warn_if_shared(path: str) -> None:
    """Warns when the secret file's group or other users may read or write it (as ssh does for a key)."""
    mode = stat.S_IMODE(os.stat(path).st_mode)
    if mode & 0o077:
        warnings.warn(
            f"{_ENV_SECRET_FILE} {path!r} is accessible to other users (mode {mode:04o}): anyone who reads it "
            f"can act as any task of this job. Fix: chmod 600 {path}",
            UserWarning,
            stacklevel=3,
        )


@dataclass(frozen=True)
class JobAuth:
    """The job's credentials, as the launch configured them (:meth:`from_env`)."""

    secret: bytes | None
    tls_cert: bytes | None = None
    tls_key: bytes | None = None
    tls_ca: bytes | None = None
    tls_server_name: str | None = None

    @classmethod
    def from_env(cls) -> JobAuth:
        """Reads the secret and the TLS files named by the environment.

        Raises:
            ValueError: neither a secret nor TLS is configured, the secret is too short, a file cannot be
                read, or only some of the TLS variables are set.
        """
        secret: bytes | None = None
        if os.environ.get(_ENV_SECRET):
            secret = os.environ[_ENV_SECRET].encode()
        elif os.environ.get(_ENV_SECRET_FILE):
            path = os.environ[_ENV_SECRET_FILE]
            secret = _read(path, _ENV_SECRET_FILE).strip()
            _warn_if_shared(path)
        if secret is not None and len(secret) < 16:
            raise ValueError(
                f"the parameter-server job secret ({_ENV_SECRET}) must be at least 16 bytes, got "
                f"{len(secret)}; use e.g. `python -c 'import secrets; print(secrets.token_hex(32))'`"
            )
        tls = [os.environ.get(n) for n in _ENV_TLS]
        if any(tls) and not all(tls):
            missing = [n for n, v in zip(_ENV_TLS, tls, strict=True) if not v]
            raise ValueError(f"mutual TLS needs all of {list(_ENV_TLS)}; missing {missing}")
        cert = key = ca = None
        if all(tls):
            cert, key, ca = (_read(p, n) for p, n in zip(tls, _ENV_TLS, strict=True))  # type: ignore[arg-type]
        if secret is None and cert is None:
            raise ValueError(
                f"a ParameterServerStrategy job needs credentials: set {_ENV_SECRET} (or "
                f"{_ENV_SECRET_FILE}) to the same random secret on every task, e.g. `export "
                f"{_ENV_SECRET}=$(python -c 'import secrets; print(secrets.token_hex(32))')` before "
                f"torchrun, and/or mutual TLS with {list(_ENV_TLS)}"
            )
        return cls(secret, cert, key, ca, os.environ.get("TORCHSTRATEGIES_PS_TLS_SERVER_NAME") or None)

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    # ---- signed rendezvous entries ---------------------------------------------------------------
    def sign(self, key: str, value: str) -> str:
        """``value|signature`` for the store entry ``key`` (``value`` unchanged without a secret)."""
        if self.secret is None:
            return value
        mac = hmac.new(self.secret, f"{key}\n{value}".encode(), hashlib.sha256).hexdigest()
        return f"{value}|{mac}"

    def verify(self, key: str, signed: str) -> str:
        """The value of a signed store entry.

        Raises:
            ValueError: the signature is missing or wrong (someone else wrote the entry).
        """
        if self.secret is None:
            return signed
        value, _, mac = signed.rpartition("|")
        good = hmac.new(self.secret, f"{key}\n{value}".encode(), hashlib.sha256).hexdigest()
        if not mac or not hmac.compare_digest(mac, good):
            raise ValueError(
                f"the rendezvous entry {key!r} is not signed with this job's secret "
                f"(value {signed[:80]!r}); it was not written by a task of this job"
            )
        return value

    # ---- gRPC credentials ------------------------------------------------------------------------
    def server_credentials(self):
        import grpc

        assert self.tls_cert is not None and self.tls_key is not None
        return grpc.ssl_server_credentials(
            [(self.tls_key, self.tls_cert)], root_certificates=self.tls_ca, require_client_auth=True
        )

    def channel_credentials(self):
        import grpc

        return grpc.ssl_channel_credentials(
            root_certificates=self.tls_ca, private_key=self.tls_key, certificate_chain=self.tls_cert
        )
