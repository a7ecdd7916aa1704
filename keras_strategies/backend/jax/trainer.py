"""How a Keras model's own step is called on JAX: statelessly, `step(state, data) -> (logs, state)`."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import jax

from keras_strategies.backend.common import keras_compat
from keras_strategies.backend.jax.devices import copy_to


# Per step kind: the model's state as Keras' JAX trainer passes it, with how each
# part is combined across replicas ("first": identical everywhere, "mean", "delta_sum").
_STATE = {
    "train": (("trainable_variables", "first"), ("non_trainable_variables", "mean"),
              ("optimizer_variables", "first"), ("metrics_variables", "delta_sum")),
    "test": (("trainable_variables", "first"), ("non_trainable_variables", "first"),
             ("metrics_variables", "delta_sum")),
    "predict": (("trainable_variables", "first"), ("non_trainable_variables", "first")),
}


def state_parts(model: Any, kind: str) -> list:
    """`[(variables, policy), ...]` in the order of the step's state tuple."""
    parts = []
    for name, policy in _STATE[kind]:
        variables = model.optimizer.variables if name == "optimizer_variables" else getattr(model, name)
        parts.append((list(variables), policy))
    return parts


def step_state(model: Any, kind: str) -> tuple:
    """The state tuple that Keras' JAX trainer passes to `model.<kind>_step`."""
    return tuple([v.value for v in variables] for variables, _ in state_parts(model, kind))


def call_step(model: Any, kind: str, data: Any, device: Optional[str], state: Optional[tuple] = None) -> tuple[Any, Any]:
    """Calls `model.<kind>_step` on `device`; returns `(logs or outputs, new state or None)`.

    The state goes to the replica's device first: computations follow their
    committed inputs, so replicas would otherwise all run where the variables
    live. In a compiled replica program (`device=None`) the caller passes the
    program's `state`.
    """
    if state is None:
        state = tuple([copy_to(value, device) for value in part] for part in step_state(model, kind))
    result = getattr(model, f"{kind}_step")(state, data)
    if kind == "predict":  # (outputs, non_trainable_variables); inference changes no state
        return result[0], None
    return result


def epoch_batches(data_adapter: Any) -> Callable[[], Iterable]:
    """The training batches Keras' own JAX trainer reads: NumPy's order (`fit(shuffle=True)` shuffles with NumPy's seed)."""
    return data_adapter.get_numpy_iterator


def as_keras_reads(batches: Iterable) -> Iterable:
    """The batches as Keras' own JAX trainer reads them: one batch ahead where it does (`keras_compat`)."""
    if not keras_compat.jax_reads_one_batch_ahead(jax.default_backend()):
        yield from batches
        return
    held, empty = None, True
    for batch in batches:  # Keras' `JAXEpochIterator._one_batch_ahead_iterator`, without the device copy
        if not empty:
            yield held
        held, empty = batch, False
    if not empty:
        yield held


def build_batch(data_adapter: Any, batches: Optional[Callable[[], Iterable]]) -> Optional[Any]:
    """None: Keras' own JAX trainer reads the first batch to build the model before `fit`, and so do we."""
    return None


def pipeline_order_seed() -> Optional[int]:
    """What fixes the order in which Keras' own pipeline shuffles: host RNGs, the same key on every worker.

    Every worker takes over the chief's RNG states before reading
    (`_use_chief_input_rngs`), so all read the chief's order.
    """
    return 0
