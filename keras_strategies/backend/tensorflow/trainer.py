"""How a Keras model's own step is called here: statefully, `step(data) -> logs`."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

from keras.src.trainers.data_adapters.py_dataset_adapter import PyDatasetAdapter


def state_parts(model: Any, kind: str) -> list:
    """Stateful steps update the model's variables themselves: no state to combine."""
    return []


def call_step(model: Any, kind: str, data: Any, device: str) -> tuple[Any, Any]:
    """Calls `model.<kind>_step(data)` (on `device`, set by the replica); returns `(logs or outputs, None)`."""
    return getattr(model, f"{kind}_step")(data), None


def epoch_batches(data_adapter: Any) -> Callable[[], Iterable]:
    """The training batches Keras' own TensorFlow trainer reads: its `tf.data` pipeline.

    Built once, as Keras does, so that `fit(shuffle=True)` draws the same
    order from TensorFlow's seeds as training without a strategy.
    """
    dataset = data_adapter.get_tf_dataset()
    return lambda: dataset


def as_keras_reads(batches: Iterable) -> Iterable:
    """The batches as Keras' own TensorFlow trainer reads them: as they come."""
    return batches


def build_batch(data_adapter: Any, batches: Optional[Callable[[], Iterable]]) -> Optional[Any]:
    """What to build the model from before a loop: a `tf.data` pipeline's `element_spec`, without reading a batch.

    Keras' own TensorFlow trainer reads none before the first epoch. Reading
    one here would start an extra pass, which reshuffles a `PyDataset`, and
    with `workers` moves its enqueuer one batch on: every epoch's order would
    shift against training without a strategy. Read as NumPy batches
    (`batches` None), a `PyDataset` gives its spec through Keras' `tf.data`
    view of it, which peeks by index; other inputs are read from a fresh
    iterator, which moves nothing.
    """
    if batches is not None:
        return batches().element_spec
    if isinstance(data_adapter, PyDatasetAdapter):
        return data_adapter.get_tf_dataset().element_spec
    return None


def pipeline_order_seed() -> Optional[int]:
    """What fixes the order in which Keras' `tf.data` pipeline shuffles arrays: TensorFlow's global seed.

    Its shuffle is an op in a traced function, whose seed derives from the
    global seed alone: workers that share it read one order, the one a single
    process with that seed reads. None if unset (each process its own order).
    """
    from tensorflow.python.eager import context

    return context.global_seed()
