"""JAX gradients: `jax.value_and_grad` over the list of trainable values."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from keras import ops

from keras_strategies.backend.jax import flat_buffers
from keras_strategies.multi_worker import packing
from keras_strategies.replica_variables import RecordingScope


def value_and_grad(fn: Callable[..., tuple[Any, Any]]) -> Callable[..., tuple[tuple[Any, Any], list]]:
    """`fn(trainable, *args) -> (objective, aux)` becomes `-> ((objective, aux), grads)`."""
    return jax.value_and_grad(fn, has_aux=True)


def variables_value_and_grad(fn: Callable[..., Any], variables: list, args: tuple, kwargs: dict) -> tuple[Any, list]:
    """`(fn(*args, **kwargs), d fn / d variables)` for Keras variables.

    JAX differentiates functions of arrays, so `fn` runs with the variables
    mapped to traced values (Keras' `StatelessScope`); other variables that it
    assigns (e.g. BatchNormalization statistics) are updated afterwards.
    """
    differentiated = {id(v) for v in variables}

    def pure(values):
        with RecordingScope(list(zip(variables, values))) as scope:
            output = fn(*args, **kwargs)
        value = output[0] if isinstance(output, tuple) else output
        updates = [(v, scope.get_current_value(v)) for k, v in scope.assigned.items() if k not in differentiated]
        return value, (output, updates)

    (_, (output, updates)), grads = jax.value_and_grad(pure, has_aux=True)([v.value for v in variables])
    for variable, new_value in updates:
        variable.assign(new_value)
    return output, grads


# `x + y` of two partial sums (TensorFlow's `IndexedSlices` need more).
add = ops.add


def is_sliced(value: Any) -> bool:
    """Gradients here are always dense (TensorFlow's may be `IndexedSlices`)."""
    return False


def packs_for_exchange(values: Sequence[Any]) -> bool:
    """Whether gradients shaped like `values` (gradients or their variables) cross workers in one
    buffer per dtype.

    XLA's CPU runtime makes one gloo call per operand of an all-reduce, and each
    call costs about as much as copying a megabyte. The exchange sends each
    gradient of `packing.SEPARATE_BYTES` or more on its own (one call each) and
    the rest in one small pack: with two or more such gradients, one buffer of
    all of them saves calls; with fewer it would only add copies.
    """
    sizes = [int(np.prod(v.shape, dtype=np.int64)) * jnp.dtype(v.dtype).itemsize for v in values]
    return sum(size >= packing.SEPARATE_BYTES for size in sizes) >= 2


def pack_for_exchange(grads: Sequence[Any]) -> list:
    """The gradients as they cross workers: one flat buffer per dtype where that saves gloo calls
    (`packs_for_exchange`), made inside the replica program, whose own copies of them it replaces.
    `optimizer.apply_exchanged_gradients` cuts them back inside the jitted update."""
    if not packs_for_exchange(grads):
        return list(grads)
    return list(flat_buffers.concatenated(grads, flat_buffers.layout_of(grads)))
