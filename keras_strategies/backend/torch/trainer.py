"""How a Keras model's own step is called here: statefully, `step(data) -> logs`."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

# The step writes the model's variables itself (see `keras_strategies.replica_variables`).
STATEFUL_STEPS = True


def state_parts(model: Any, kind: str) -> list:
    """Stateful steps update the model's variables themselves: no state to combine."""
    return []


def call_step(model: Any, kind: str, data: Any, device: str) -> tuple[Any, Any]:
    """Calls `model.<kind>_step(data)` (on `device`, set by the replica); returns `(logs or outputs, None)`."""
    return getattr(model, f"{kind}_step")(data), None


def epoch_batches(data_adapter: Any) -> Callable[[], Iterable]:
    """The training batches Keras' own torch trainer reads: its `DataLoader`.

    So that `fit(shuffle=True)` draws the same order from torch's seed as
    training without a strategy.
    """
    return data_adapter.get_torch_dataloader


def build_batch(batches: Callable[[], Iterable]) -> Optional[Any]:
    """None: Keras' own PyTorch trainer reads the first batch to build the model before `fit`, and so do we."""
    return None
