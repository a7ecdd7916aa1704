"""Keras' own distribution loss scaling, switched off inside our replica programs.

Keras divides mean losses (and `model.losses`) by the replica count when a
`tf.distribute` strategy is active, on the TensorFlow backend only. Our
replica steps weight each replica by its real share of the global batch
instead (see `trainer/replica_step.py` and the optimizer hook), on every
backend, so inside them Keras' scaling must be the identity. Elsewhere
Keras' functions run unchanged.
"""

from __future__ import annotations

import functools
from typing import Callable

from keras_strategies.backend.common import patches
from keras_strategies.distribute import context


def _wrap(original: Callable) -> Callable:
    @functools.wraps(original)
    def wrapper(value):
        replica_context = context.get_replica_context()
        if replica_context is not None and replica_context._in_program:
            return value
        return original(value)

    return wrapper


_WHY = "Keras' division by the replica count is off in our replica steps, which weight replicas by their rows"
_PATCHES = tuple(patches.declare(f"keras.src.losses.loss.{name}", _WHY)
                 for name in ("scale_loss_for_distribution", "unscale_loss_for_distribution"))


def install() -> None:
    """Installs the hooks (idempotent)."""
    for patch in _PATCHES:
        patch.apply(_wrap)
