"""JAX compilation: `jax.jit`; the replica's committed inputs decide the device."""

from __future__ import annotations

from typing import Callable

import jax


def compile_function(fn: Callable) -> Callable:
    return jax.jit(fn)


def compile_step(fn: Callable) -> Callable:
    """A user's distributed step runs eagerly: it updates stateful Keras variables,
    which `jax.jit` cannot trace (Keras' fit uses stateless steps instead)."""
    return fn
