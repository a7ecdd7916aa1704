"""The Keras functions this engine replaces: none (the patch registry lists the others)."""

from __future__ import annotations

from typing import Any


def install(strategy_context: Any) -> None:
    """Nothing to replace on JAX: Keras' JAX trainer is already stateless."""
