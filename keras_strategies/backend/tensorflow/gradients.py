"""TensorFlow gradients: a `GradientTape` over the list of trainable values."""

from __future__ import annotations

from typing import Any, Callable

import tensorflow as tf
from keras import ops


def value_and_grad(fn: Callable[..., tuple[Any, Any]],
                   hooks: Any = None) -> Callable[..., tuple[tuple[Any, Any], list]]:
    """`fn(trainable, *args) -> (objective, aux)` becomes `-> ((objective, aux), grads)`.

    `hooks` is accepted for the engines' common interface: callers give None, as
    gradients are not reported during the backward pass here (`Capabilities.overlaps_backward`).
    """

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


def is_sliced(value: Any) -> bool:
    """Whether `value` is an `IndexedSlices`, which reductions must keep as slices (see `add`)."""
    return isinstance(value, tf.IndexedSlices)


def add(x: Any, y: Any) -> Any:
    """`x + y` of two partial sums; `IndexedSlices` (an Embedding's gradients) concatenate.

    As `tf.distribute` adds them: the sum keeps every replica's slices, which
    Keras' optimizers treat differently from their dense sum (Adam squares
    each slice). A mix with a dense tensor is dense.
    """
    if isinstance(x, tf.IndexedSlices) and isinstance(y, tf.IndexedSlices):
        return tf.IndexedSlices(
            tf.concat([x.values, y.values], 0), tf.concat([x.indices, y.indices], 0), x.dense_shape
        )
    if isinstance(x, tf.IndexedSlices) or isinstance(y, tf.IndexedSlices):
        return ops.add(tf.convert_to_tensor(x), tf.convert_to_tensor(y))
    return ops.add(x, y)


def sliced_pieces(value: Any, shape: tuple, num_pieces: int, length: int) -> list:
    """An `IndexedSlices` gradient of a variable of `shape` cut as `flat_shards.split` cuts the
    variable: for each of `num_pieces` flat pieces of `length` elements, the slices of its elements
    (one per element of each row slice, indices within the piece). Keras' optimizers then apply
    each piece's slices as they apply the whole gradient's (Adam squares each slice before the
    duplicates add up), so the pieces' update equals the whole one."""
    row = 1
    for size in shape[1:]:
        row *= int(size)
    values = tf.reshape(value.values, [-1])
    indices = tf.reshape(tf.cast(value.indices, tf.int64)[:, None] * row + tf.range(row, dtype=tf.int64)[None, :], [-1])
    pieces = []
    for i in range(num_pieces):
        inside = (indices >= i * length) & (indices < (i + 1) * length)
        pieces.append(tf.IndexedSlices(tf.boolean_mask(values, inside), tf.boolean_mask(indices, inside) - i * length,
                                       tf.constant([length], tf.int64)))
    return pieces
