"""Whole checkpoints of an optimizer whose state `ShardedDataParallelStrategy` splits over devices.

Such an optimizer is never built whole: its state lives in pieces, one per
device (`sharding/optimizer_state.py`). `model.save`, `save_weights` and
`BackupAndRestore` reach an optimizer's state through its `save_own_variables`
/ `load_own_variables`; these write the pieces joined, exactly as the
optimizer built whole would, and load whole values into the pieces, so a
checkpoint loads under any strategy and any replica count. `load_model`
under such a strategy leaves the optimizer unbuilt (Keras would build it
whole before loading its state), so the state waits for the pieces. Other
optimizers and models run Keras' own methods unchanged.
"""

from __future__ import annotations

import functools
from typing import Callable

from keras_strategies.backend.common import patches
from keras_strategies.distribute import context
from keras_strategies.sharding import optimizer_state

_BASE = "keras.src.optimizers.base_optimizer.BaseOptimizer"
_SAVE = patches.declare(f"{_BASE}.save_own_variables", "an optimizer whose state ShardedDataParallelStrategy "
                        "splits over devices saves it whole (loadable under any strategy)")
_LOAD = patches.declare(f"{_BASE}.load_own_variables", "whole saved optimizer state loads into the pieces "
                        "ShardedDataParallelStrategy keeps on each device")
_COMPILE_FROM_CONFIG = patches.declare(
    "keras.src.trainers.trainer.Trainer.compile_from_config",
    "a model loaded under ShardedDataParallelStrategy leaves its optimizer unbuilt: the saved state "
    "goes to the pieces, never to a whole copy", moved=("keras.src.trainers.trainer.BaseTrainer.compile_from_config",))


def _wrap_save(original: Callable) -> Callable:
    @functools.wraps(original)
    def save_own_variables(self, store):
        values = optimizer_state.whole_state(self)
        if values is None:
            return original(self, store)
        for i, value in enumerate(values):
            store[str(i)] = value

    return save_own_variables


def _wrap_load(original: Callable) -> Callable:
    @functools.wraps(original)
    def load_own_variables(self, store):
        if optimizer_state.state_of(self) is None and not optimizer_state.shards_state(self):
            return original(self, store)
        values = [store[str(i)] for i in range(len(store.keys()))]
        if not optimizer_state.load_whole_state(self, values):
            return original(self, store)

    return load_own_variables


def _wrap_compile_from_config(original: Callable) -> Callable:
    @functools.wraps(original)
    def compile_from_config(self, config):
        strategy = context.strategy_of(self) or context.get_strategy()
        if not self.built or not optimizer_state.strategy_shards_state(strategy):
            return original(self, config)
        # Keras builds a built model's optimizer whole once compiled, before loading its state;
        # seen unbuilt, the model leaves that to the first update, which builds it in pieces.
        self.built = False
        try:
            return original(self, config)
        finally:
            self.built = True

    return compile_from_config


def install() -> None:
    """Installs the whole-checkpoint hooks (idempotent)."""
    _SAVE.apply(_wrap_save)
    _LOAD.apply(_wrap_load)
    _COMPILE_FROM_CONFIG.apply(_wrap_compile_from_config)
