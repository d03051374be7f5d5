"""How ParameterServerStrategy plugs into the tf.distribute core (``torchstrategies.distribute``).

ParameterServerStrategy is a ``distribute.Strategy`` whose ``StrategyExtended``
(:class:`ParameterServerExtended`) has one local replica and these creation hooks:

* ``_create_parameter``: notes each parameter registered under ``scope()`` (its value is not final yet);
* ``_on_module_created``: places the module's parameters on the ps tasks (at the outermost scope exit);
* ``_create_variable``: ``ts.Variable(...)`` under the scope becomes a :class:`PSVariable` on a ps.

``scope()``, ``run``, ``reduce``, ``get_strategy()`` and the contexts are the core's. Optimizers need no
hook: an optimizer over scope parameters is recognised when a scheduled function uses it.
"""

from __future__ import annotations

from torchstrategies.distribute.distribute_lib import StrategyExtended

__all__ = ["ParameterServerExtended"]


class ParameterServerExtended(StrategyExtended):
    """The core hooks of ParameterServerStrategy (see the module docstring)."""

    def __init__(self, strategy):
        super().__init__(strategy)
        self._registry = strategy._registry
        self._cluster_resolver = strategy._cluster_resolver
        self._num_replicas_in_sync = 1

    def _create_parameter(self, module, name, param):
        self._registry.track_scope_param(module, name, param)
        return None

    def _on_module_created(self, module):
        self._registry.place_pending()

    def _create_variable(self, initial_value, synchronization, aggregation, trainable, name):
        return self._registry.create_variable(initial_value, synchronization, aggregation, trainable, name)
