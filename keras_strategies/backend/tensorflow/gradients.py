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


def variables_value_and_grad(fn: Callable[..., Any], variables: list, args: tuple, kwargs: dict) -> tuple[Any, list]:
    """`(fn(*args, **kwargs), d fn / d variables)` for Keras variables, with a `GradientTape`."""
    targets = [getattr(v, "value", v) for v in variables]
    with tf.GradientTape() as tape:
        tape.watch(targets)
        output = fn(*args, **kwargs)
    value = output[0] if isinstance(output, tuple) else output
    grads = tape.gradient(value, targets, unconnected_gradients=tf.UnconnectedGradients.ZERO)
    return output, grads
