"""JAX gradients: `jax.value_and_grad` over the list of trainable values."""

from __future__ import annotations

from typing import Any, Callable

import jax
from keras import ops

from keras_strategies.backend.common.replica_variables import RecordingScope


def value_and_grad(fn: Callable[..., tuple[Any, Any]],
                   hooks: Any = None) -> Callable[..., tuple[tuple[Any, Any], list]]:
    """`fn(trainable, *args) -> (objective, aux)` becomes `-> ((objective, aux), grads)`.

    `hooks` is accepted for the engines' common interface: callers give None, as
    gradients are not reported during the backward pass here (`Capabilities.overlaps_backward`).
    """
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


def sliced_pieces(value: Any, shape: tuple, num_pieces: int, length: int) -> list:
    """Gradients here are never sliced (`is_sliced`): nothing to cut."""
    raise NotImplementedError("Gradients on this backend are dense; sliced_pieces is never needed.")
