"""`use_ema`'s moving averages of an optimizer whose state `ShardedDataParallelStrategy` splits.

Each device's copy of the optimizer keeps the averages of its pieces of the
variables (`sharding/optimizer_state.py`); the optimizer itself holds none.
`optimizer.finalize_variable_values(...)` (which `fit` calls after its last
epoch, and a custom loop calls itself) writes the averages into the
variables from those pieces. Other optimizers run Keras' own method unchanged.
"""

from __future__ import annotations

import functools
from typing import Callable

from keras_strategies.backend.common import patches
from keras_strategies.sharding import optimizer_state

_FINALIZE = patches.declare(
    "keras.src.optimizers.base_optimizer.BaseOptimizer.finalize_variable_values",
    "an optimizer whose state ShardedDataParallelStrategy splits keeps use_ema's averages in pieces on the "
    "devices: they are written into the variables from there")


def _wrap_finalize(original: Callable) -> Callable:
    @functools.wraps(original)
    def finalize_variable_values(self, var_list):
        state = optimizer_state.state_of(self)
        if state is None:
            return original(self, var_list)
        state.finalize_variable_values()

    return finalize_variable_values


def install() -> None:
    """Installs the hook (idempotent)."""
    _FINALIZE.apply(_wrap_finalize)
