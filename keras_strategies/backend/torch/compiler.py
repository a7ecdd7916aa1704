"""PyTorch runs replica steps eagerly (like Keras' torch trainer by default)."""

from __future__ import annotations

from typing import Callable


def compile_function(fn: Callable) -> Callable:
    return fn
