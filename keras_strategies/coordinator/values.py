"""Values that exist once per worker: `PerWorkerValues` and the per-worker datasets built from them."""

from __future__ import annotations

import inspect
import itertools
from typing import Any, Callable, Sequence

_resource_ids = itertools.count()


class PerWorkerValues:
    """One value per worker (for example each worker's dataset iterator).

    Passed to `schedule`, it becomes the value of the worker that runs the closure.
    """

    def __init__(self, values: Sequence[Any]):
        self._values = tuple(values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"PerWorkerValues({list(self._values)!r})"


class PerWorkerIterator(PerWorkerValues):
    """Each worker's iterator over its dataset: pass it to `schedule` and call `next()` on it in the function."""

    def __iter__(self) -> "PerWorkerIterator":
        return self

    def __next__(self) -> Any:
        raise TypeError(
            "A per-worker iterator is read on the workers: pass it to `coordinator.schedule(fn, args=(iterator,))` "
            "and call `next(iterator)` inside `fn`."
        )


class WorkerResource:
    """A value built on a worker from a definition kept by the chief (a dataset or an iterator).

    The worker builds it when a closure first needs it, and again after the
    worker restarts, so a lost worker's datasets are rebuilt when it comes back.
    `kind` is "dataset" (`payload` a function returning an iterable) or
    "iterator" (`payload` the `WorkerResource` of a dataset).
    """

    _ks_worker_resource = True  # how engines, which do not import this module, recognise it

    def __init__(self, worker_index: int, kind: str, payload: Any):
        self.key = f"r{next(_resource_ids)}"
        self.worker_index = worker_index
        self.kind = kind
        self.payload = payload

    def __repr__(self) -> str:
        return f"<{self.kind} on worker {self.worker_index}>"


class PerWorkerDataset:
    """The dataset of `create_per_worker_dataset`: built on every worker; `iter()` gives per-worker iterators."""

    def __init__(self, dataset_fn: Callable[..., Any], num_workers: int, input_context_fn: Callable[[int], Any]):
        fns = []
        wants_context = _takes_one_argument(dataset_fn)
        for index in range(num_workers):
            fns.append(_Bound(dataset_fn, input_context_fn(index)) if wants_context else dataset_fn)
        self._datasets = PerWorkerValues([WorkerResource(i, "dataset", fn) for i, fn in enumerate(fns)])

    def __iter__(self) -> "PerWorkerIterator":
        return PerWorkerIterator([WorkerResource(d.worker_index, "iterator", d) for d in self._datasets._values])

    def __repr__(self) -> str:
        return f"<PerWorkerDataset on {len(self._datasets)} workers>"


class GraphDataset:
    """A `tf.data.Dataset` as a picklable function that rebuilds it from its graph (on a worker).

    Datasets whose functions hold Python state (`py_function`, generators) have no
    graph to send: build those inside a dataset function instead.
    """

    def __init__(self, dataset: Any):
        import tensorflow as tf

        try:
            graph = dataset._as_serialized_graph(
                external_state_policy=tf.data.experimental.ExternalStatePolicy.FAIL)
        except Exception as error:  # noqa: BLE001 - TensorFlow raises several kinds here
            raise ValueError(
                "This tf.data.Dataset cannot be sent to the workers (it holds state of the chief's Python "
                f"process: {error}). Pass a function that builds the dataset instead."
            ) from error
        self.graph = graph.numpy()
        self.element_spec = dataset.element_spec

    def __call__(self) -> Any:
        import tensorflow as tf

        return tf.data.experimental.from_variant(tf.raw_ops.DatasetFromGraph(graph_def=self.graph),
                                                 structure=self.element_spec)


class _Bound:
    """`fn(argument)` as a picklable callable without arguments."""

    def __init__(self, fn: Callable[[Any], Any], argument: Any):
        self.fn, self.argument = fn, argument

    def __call__(self) -> Any:
        return self.fn(self.argument)


def _takes_one_argument(fn: Callable[..., Any]) -> bool:
    try:
        parameters = [p for p in inspect.signature(fn).parameters.values()
                      if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        return False
    return len(parameters) == 1


def experimental_get_current_worker_index() -> int:
    """The index of the worker running the current scheduled function (Ray engine).

    Raises RuntimeError outside a scheduled function.
    """
    from keras_strategies.backend.common.ray_parameter_server.actors import current_worker_index

    index = current_worker_index()
    if index is None:
        raise RuntimeError(
            "experimental_get_current_worker_index() is only available inside a function scheduled with "
            "`coordinator.schedule(...)`, which runs on a worker."
        )
    return index
