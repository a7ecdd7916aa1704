"""JAX gradients: `jax.value_and_grad` over the list of trainable values."""

from __future__ import annotations

from typing import Any, Callable

import jax


def value_and_grad(fn: Callable[..., tuple[Any, Any]]) -> Callable[..., tuple[tuple[Any, Any], list]]:
    """`fn(trainable, *args) -> (objective, aux)` becomes `-> ((objective, aux), grads)`."""
    return jax.value_and_grad(fn, has_aux=True)
