"""PyTorch optimizer updates: Keras' stateful `apply`, as Keras' torch trainer does."""

from __future__ import annotations

from typing import Any, Sequence


def apply_gradients(optimizer: Any, grads: Sequence[Any], variables: Sequence[Any]) -> None:
    """Applies `grads` to `variables` with `optimizer` (one update)."""
    optimizer.apply(list(grads), list(variables))


# Gradients cross workers as they are here (`gradients.pack_for_exchange`).
apply_exchanged_gradients = apply_gradients
