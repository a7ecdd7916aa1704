"""Keras `fit` / `evaluate` / `predict` under `ParameterServerStrategy` (not yet written)."""

from __future__ import annotations

from typing import Any


def run_keras_method(name: str, strategy: Any, model: Any, args: tuple, kwargs: dict) -> Any:
    raise RuntimeError(f"Model.{name} under ParameterServerStrategy is not yet supported.")
