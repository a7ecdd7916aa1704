"""JAX compilation: `jax.jit`; the replica's committed inputs decide the device."""

from __future__ import annotations

from typing import Callable

import jax


def compile_function(fn: Callable) -> Callable:
    return jax.jit(fn)
