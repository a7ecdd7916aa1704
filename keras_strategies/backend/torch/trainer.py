"""How a Keras model's own step is called here: statefully, `step(data) -> logs`."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional


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


def as_keras_reads(batches: Iterable) -> Iterable:
    """The batches as Keras' own PyTorch trainer reads them: as they come."""
    return batches


def build_batch(data_adapter: Any, batches: Optional[Callable[[], Iterable]]) -> Optional[Any]:
    """None: Keras' own PyTorch trainer reads the first batch to build the model before `fit`, and so do we."""
    return None


def pipeline_order_seed() -> Optional[int]:
    """What fixes the order in which Keras' own pipeline shuffles: host RNGs, the same key on every worker.

    Every worker takes over the chief's RNG states before reading
    (`_use_chief_input_rngs`), so all read the chief's order.
    """
    return 0
