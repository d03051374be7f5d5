"""``ts.coordinator``: the cluster coordinator of ParameterServerStrategy (``tf.distribute.coordinator``).

The names are those of :mod:`torchstrategies.parameter_server.coordinator` (its ``__all__`` is the one list).

Example:
    >>> import torchstrategies as ts
    >>> ts.coordinator.ClusterCoordinator.__name__
    'ClusterCoordinator'
"""

from torchstrategies.parameter_server.coordinator import *  # noqa: F403
from torchstrategies.parameter_server.coordinator import __all__  # noqa: F401
