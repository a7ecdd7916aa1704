"""PyTorch optimizer updates: Keras' stateful `apply`, as Keras' torch trainer does."""

from __future__ import annotations

from typing import Any, Sequence


def apply_gradients(optimizer: Any, grads: Sequence[Any], variables: Sequence[Any]) -> None:
    """Applies `grads` to `variables` with `optimizer` (one update)."""
    optimizer.apply(list(grads), list(variables))
