"""PyTorch runs replica steps eagerly (like Keras' torch trainer by default)."""

from __future__ import annotations

from typing import Any, Callable, Sequence


def compile_function(fn: Callable) -> Callable:
    return fn


def compile_step(fn: Callable) -> Callable:
    """A user's distributed step runs eagerly, like Keras' torch trainer by default."""
    return fn


def compile_stateful(fn: Callable, state_variables: Sequence[Any]) -> Callable:
    """Stateful updates run eagerly, like Keras' torch trainer by default."""
    return fn
