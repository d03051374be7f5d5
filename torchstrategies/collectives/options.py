"""``CommunicationOptions`` and ``CommunicationImplementation``, as ``tf.distribute.experimental``'s.

Example:
    >>> import torchstrategies as ts
    >>> opts = ts.CommunicationOptions(bytes_per_pack=50 << 20, implementation="shm")
    >>> opts.implementation
    <CommunicationImplementation.SHM: 'SHM'>
    >>> opts.merge(ts.CommunicationOptions(timeout_seconds=10)).timeout_seconds
    10
"""

from __future__ import annotations

import enum

from torchstrategies._enum_names import parse

__all__ = ["CommunicationImplementation", "CommunicationOptions"]


class CommunicationImplementation(enum.Enum):
    """How collectives move data between processes.

    AUTO, SHM, RING and HIERARCHICAL (an extension to TF's enum: SHM inside each host, the ring between one
    leader per host) run on the "torchstrategies" torch.distributed backend, which resolves AUTO from the
    hosts of the group (docs/collectives.md); NCCL and GLOO are torch.distributed's own backends. TREE was
    removed (it lost to gloo's own all-reduce): asking for it raises ValueError.
    """

    AUTO = "AUTO"
    RING = "RING"
    NCCL = "NCCL"
    TREE = "TREE"
    SHM = "SHM"
    GLOO = "GLOO"
    HIERARCHICAL = "HIERARCHICAL"

    @classmethod
    def from_any(cls, value: CommunicationImplementation | str) -> CommunicationImplementation:
        """Accepts the enum or its name in any case; raises ValueError otherwise."""
        offered = ", ".join(n for n in cls.__members__ if n != "TREE")  # TREE was removed: never offered
        return parse(cls, value,
                     "Invalid communication implementation {value}: expected one of " + offered + " (or their names)")


class CommunicationOptions:
    """Options for cross-process collectives (TF's ``tf.distribute.experimental.CommunicationOptions``).

    Args:
        bytes_per_pack: tensors are packed per dtype into buckets of about this many bytes before
            reducing; 0 packs each dtype into one bucket. Negative values raise ValueError.
        timeout_seconds: a collective that does not finish in time raises
            ``torchstrategies.errors.DeadlineExceededError``. None: the process group's timeout.
        implementation: a ``CommunicationImplementation`` or its name.

    Example:
        >>> CommunicationOptions(bytes_per_pack=1 << 20, timeout_seconds=30, implementation="RING")
        CommunicationOptions(bytes_per_pack=1048576, timeout_seconds=30, implementation=RING)
    """

    def __init__(
        self,
        bytes_per_pack: int = 0,
        timeout_seconds: float | None = None,
        implementation: CommunicationImplementation | str = CommunicationImplementation.AUTO,
    ) -> None:
        if isinstance(bytes_per_pack, bool) or not isinstance(bytes_per_pack, int):
            raise ValueError(f"bytes_per_pack must be a non-negative int, got {bytes_per_pack!r}")
        if bytes_per_pack < 0:
            raise ValueError(f"bytes_per_pack must be non-negative, got {bytes_per_pack}")
        if timeout_seconds is not None:
            if isinstance(timeout_seconds, bool) or not isinstance(timeout_seconds, (int, float)):
                raise ValueError(f"timeout_seconds must be a positive number or None, got {timeout_seconds!r}")
            if not timeout_seconds > 0:
                raise ValueError(f"timeout_seconds must be positive, got {timeout_seconds}")
        self.bytes_per_pack = bytes_per_pack
        self.timeout_seconds = timeout_seconds
        self.implementation = CommunicationImplementation.from_any(implementation)
        # Which fields were given explicitly, for merge().
        self._set = {
            "bytes_per_pack": bytes_per_pack != 0,
            "timeout_seconds": timeout_seconds is not None,
            "implementation": self.implementation is not CommunicationImplementation.AUTO,
        }

    def merge(self, options: CommunicationOptions | None) -> CommunicationOptions:
        """Returns new options: the non-default fields of ``options`` override ours (TF semantics)."""
        if options is None:
            return self
        if not isinstance(options, CommunicationOptions):
            raise TypeError(f"merge expects CommunicationOptions or None, got {type(options).__name__}")
        return CommunicationOptions(
            bytes_per_pack=options.bytes_per_pack if options._set["bytes_per_pack"] else self.bytes_per_pack,
            timeout_seconds=(
                options.timeout_seconds if options._set["timeout_seconds"] else self.timeout_seconds
            ),
            implementation=(
                options.implementation if options._set["implementation"] else self.implementation
            ),
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CommunicationOptions) and (
            self.bytes_per_pack, self.timeout_seconds, self.implementation
        ) == (other.bytes_per_pack, other.timeout_seconds, other.implementation)

    def __hash__(self) -> int:
        return hash((self.bytes_per_pack, self.timeout_seconds, self.implementation))

    def __repr__(self) -> str:
        return (
            f"CommunicationOptions(bytes_per_pack={self.bytes_per_pack}, "
            f"timeout_seconds={self.timeout_seconds}, implementation={self.implementation.name})"
        )
