"""`ks.coordinator`: the coordinator of `ParameterServerStrategy`, as `tf.distribute.coordinator`.

`ClusterCoordinator(strategy)` schedules functions on the workers;
`RemoteValue` is what `schedule` returns; `PerWorkerValues` holds one value
per worker (a per-worker dataset or iterator).

Examples:
    ```python
    strategy = ks.ParameterServerStrategy(ks.cluster_resolver.TFConfigClusterResolver())
    coordinator = ks.coordinator.ClusterCoordinator(strategy)
    loss = coordinator.schedule(step_fn, args=(per_worker_iterator,))
    coordinator.join()
    print(loss.fetch())
    ```
"""

from __future__ import annotations

from typing import Any

from keras_strategies.coordinator.cluster_coordinator import ClusterCoordinator, PerWorkerValues, RemoteValue


def experimental_get_current_worker_index() -> Any:
    """The index of the worker that runs the current scheduled function (call it inside one)."""
    from keras_strategies.backend import engine

    return engine.parameter_server.current_worker_index()


__all__ = ["ClusterCoordinator", "PerWorkerValues", "RemoteValue", "experimental_get_current_worker_index"]
