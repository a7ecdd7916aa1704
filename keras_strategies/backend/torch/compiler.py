"""PyTorch runs replica steps eagerly (like Keras' torch trainer by default)."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional, Sequence


def compile_function(fn: Callable) -> Callable:
    return fn


def compile_step(fn: Callable) -> Callable:
    """A user's distributed step runs eagerly, like Keras' torch trainer by default."""
    return fn


def compile_stateful(fn: Callable, state_variables: Sequence[Any]) -> Callable:
    """Stateful updates run eagerly, like Keras' torch trainer by default."""
    return fn


def with_rows(value: Any, rows: int) -> Any:
    """`value` as it is: its shape is always concrete here."""
    return value


def compile_replicated_step(fn: Callable, variables: Sequence[Any], devices: Sequence[str],
                            keep_copies: bool, finish: Optional[Callable[[list], None]],
                            any_batch_size: bool = False) -> Callable:
    """A whole train, test or predict step around the replica program runs eagerly, like the rest
    (`variables`, `devices`, `keep_copies` and `finish` matter to JAX's engine only, `any_batch_size`
    to TensorFlow's)."""
    return fn


def outside_compiled() -> contextlib.AbstractContextManager:
    """Nothing to leave: a user's step runs eagerly here (see `compile_step`)."""
    return contextlib.nullcontext()


def outside_replicas() -> contextlib.AbstractContextManager:
    """Nothing to leave: replicas here run eagerly and create plain variables."""
    return contextlib.nullcontext()


def settle(variables: Sequence[Any], device: str) -> None:
    """Nothing to bring back: compiled steps here leave variables where they live."""


def step_group(compiled_step: Callable) -> None:
    """None: each step of a `steps_per_execution` group runs on its own here."""
    return None

