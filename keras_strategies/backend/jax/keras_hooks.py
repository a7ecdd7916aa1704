"""The Keras methods this engine replaces: none (listed in `keras_strategies.keras_integration`)."""

from __future__ import annotations

from typing import Any

# (Keras method, why), for the table of `keras_strategies.keras_integration`.
REPLACED: tuple = ()


def install(strategy_context: Any) -> None:
    """Nothing to replace on JAX: Keras' JAX trainer is already stateless."""
