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

from keras.src.losses import loss as keras_loss

from keras_strategies.distribute import context


def _wrap(original: Callable) -> Callable:
    @functools.wraps(original)
    def wrapper(value):
        replica_context = context.get_replica_context()
        if replica_context is not None and replica_context._in_program:
            return value
        return original(value)

    wrapper._ks_original = original
    return wrapper


def install() -> None:
    """Installs the hooks (idempotent)."""
    if hasattr(keras_loss.scale_loss_for_distribution, "_ks_original"):
        return
    keras_loss.scale_loss_for_distribution = _wrap(keras_loss.scale_loss_for_distribution)
    keras_loss.unscale_loss_for_distribution = _wrap(keras_loss.unscale_loss_for_distribution)
