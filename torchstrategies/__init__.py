"""torchstrategies: TensorFlow's tf.distribute strategies for PyTorch.

Example:
    >>> import torch, torchstrategies as ts
    >>> ts.ops.accumulate_n([torch.ones(2), torch.ones(2)])
    tensor([2., 2.])
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torchstrategies import _logging  # noqa: F401  (sets up the "torchstrategies" logger)
from torchstrategies._startup import cli_is_starting

__version__ = "0.1.0"

if TYPE_CHECKING:
    from torchstrategies._api import *  # noqa: F403
    from torchstrategies.distribute import *  # noqa: F403  (mypy cannot follow _api's `*distribute.__all__`)


def load_api() -> None:
    """Puts the public API (``torchstrategies._api.__all__``) in this package; ``import torchstrategies``
    calls it, except while the command line starts (``_startup``: ``torchstrategies --help`` imports no
    torch), whose commands call it before they run. Idempotent."""
    from torchstrategies import _api

    names = globals()
    names.update({name: getattr(_api, name) for name in _api.__all__})
    names["__all__"] = ["__version__", *_api.__all__]


if not TYPE_CHECKING:  # (mypy reads the names from _api above)

    def __getattr__(name: str) -> Any:
        """A public name not loaded yet (the command line started without the API) loads it."""
        if name.startswith("_"):
            raise AttributeError(f"module 'torchstrategies' has no attribute {name!r}")
        load_api()
        try:
            return globals()[name]
        except KeyError:
            raise AttributeError(f"module 'torchstrategies' has no attribute {name!r}") from None


if not cli_is_starting():
    load_api()
