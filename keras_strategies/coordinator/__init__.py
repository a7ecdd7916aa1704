"""`ks.coordinator`: the coordinator of `ParameterServerStrategy`, as `tf.distribute.coordinator`.

`ClusterCoordinator(strategy)` schedules functions on the workers;
`RemoteValue` is what `schedule` returns; `PerWorkerValues` holds one value
per worker (a per-worker dataset or iterator).
"""

from __future__ import annotations

import abc
from typing import Any

from keras_strategies.coordinator.cluster_coordinator import ClusterCoordinator

try:
    from keras_strategies.coordinator.remote_value import RemoteValue
    from keras_strategies.coordinator.values import PerWorkerValues
except ModuleNotFoundError as _error:
    if not (_error.name or "").startswith("keras_strategies.coordinator."):
        raise

    class RemoteValue(abc.ABC):  # type: ignore[no-redef]
        """The value of a scheduled function: `fetch()` waits and gives it as NumPy, `get()` as is."""

        @abc.abstractmethod
        def fetch(self) -> Any:
            """Waits for the value and returns it as NumPy."""

        @abc.abstractmethod
        def get(self) -> Any:
            """Waits for the value and returns it."""

    class PerWorkerValues(abc.ABC):  # type: ignore[no-redef]
        """One value per worker, such as a per-worker dataset's iterators."""


def experimental_get_current_worker_index() -> Any:
    """The index of the worker that runs the current scheduled function (call it inside one)."""
    from keras_strategies.strategies.parameter_server import parameter_server_engine

    return parameter_server_engine().current_worker_index()


__all__ = ["ClusterCoordinator", "PerWorkerValues", "RemoteValue", "experimental_get_current_worker_index"]
