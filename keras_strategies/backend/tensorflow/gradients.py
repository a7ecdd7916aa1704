"""TensorFlow gradients: a `GradientTape` over the list of trainable values."""

from __future__ import annotations

from typing import Any, Callable

import tensorflow as tf


def value_and_grad(fn: Callable[..., tuple[Any, Any]]) -> Callable[..., tuple[tuple[Any, Any], list]]:
    """`fn(trainable, *args) -> (objective, aux)` becomes `-> ((objective, aux), grads)`."""

    def wrapped(trainable, *args):
        trainable = [tf.convert_to_tensor(t) for t in trainable]
        with tf.GradientTape() as tape:
            tape.watch(trainable)
            objective, aux = fn(trainable, *args)
        grads = tape.gradient(objective, trainable, unconnected_gradients=tf.UnconnectedGradients.ZERO)
        return (objective, aux), grads

    return wrapped
