"""`ClusterCoordinator`: schedules functions on the workers of a `ParameterServerStrategy`.

One coordinator per strategy. This front end checks the arguments and
delegates: on TensorFlow to TensorFlow's own `ClusterCoordinator` (its queue,
retries and failure handling), on the other backends to the closure queue of
`keras_strategies.coordinator.closure_queue` over the engine's workers.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from keras.src import tree

from keras_strategies.coordinator.closure_queue import ClosureQueue
from keras_strategies.coordinator.remote_value import RemoteValue
from keras_strategies.coordinator.values import PerWorkerValues


def remote_value_types(strategy: Any = None) -> tuple:
    """The classes of values that `schedule` returns (ours and the engine's)."""
    types = (RemoteValue,)
    if strategy is not None:
        types += tuple(getattr(strategy.extended._runtime, "remote_value_types", ()))
    return types


def _compiled(fn: Any) -> Any:
    """The `tf.function` inside a `ks.function`: TensorFlow's own coordinator schedules only a
    `tf.function` (and traces a dataset function as one), so it gets the compiled function.
    (The `ks.function` wrapper only syncs multi-worker variables, which this strategy has not.)"""
    return getattr(fn, "_ks_compiled", fn)


def _register_engine_types(runtime: Any) -> None:
    """`isinstance(value, ks.coordinator.RemoteValue)` holds for the engine's own values too."""
    for cls in getattr(runtime, "remote_value_types", ()):
        RemoteValue.register(cls)


class ClusterCoordinator:
    """Schedules functions on the workers, as `tf.distribute.coordinator.ClusterCoordinator`.

    `schedule(fn, args)` queues `fn` and returns a `RemoteValue` at once; a
    worker runs it (at least once) against the variables on the parameter
    servers. `join()` waits for every scheduled function; `join`, `done` and
    `schedule` raise the first error of a scheduled function. There is one
    coordinator per strategy: `ClusterCoordinator(strategy)` returns it.

    Args:
        strategy: A `ks.ParameterServerStrategy`.

    Examples:
        ```python
        coordinator = ks.coordinator.ClusterCoordinator(strategy)
        per_worker_dataset = coordinator.create_per_worker_dataset(dataset_fn)
        per_worker_iterator = iter(per_worker_dataset)
        for _ in range(steps):
            coordinator.schedule(step_fn, args=(per_worker_iterator,))
        coordinator.join()
        ```
    """

    def __new__(cls, strategy: Any) -> "ClusterCoordinator":
        if not getattr(strategy, "_is_parameter_server_strategy", False):
            raise ValueError(
                "Only `ks.ParameterServerStrategy` is supported to work with `ClusterCoordinator` "
                f"currently, got {type(strategy).__name__}."
            )
        existing = getattr(strategy, "_ks_coordinator", None)
        if existing is not None:
            return existing
        coordinator = super().__new__(cls)
        runtime = strategy.extended._runtime
        native = runtime.native_coordinator()
        _register_engine_types(runtime)
        coordinator._strategy = strategy
        coordinator._impl = native if native is not None else ClosureQueue(runtime.workers())
        coordinator._native = native is not None
        strategy._ks_coordinator = coordinator
        return coordinator

    def __init__(self, strategy: Any):
        del strategy  # set up once, in `__new__`

    @property
    def strategy(self) -> Any:
        """The `ParameterServerStrategy` this coordinator schedules for."""
        return self._strategy

    def schedule(self, fn: Callable, args: Optional[tuple] = None, kwargs: Optional[dict] = None) -> Any:
        """Queues `fn(*args, **kwargs)` on some worker; returns its `RemoteValue` at once.

        Args:
            fn: The function to run on a worker (on TensorFlow a `tf.function`).
            args: Positional arguments; a per-worker iterator is read on the worker that runs `fn`.
            kwargs: Keyword arguments.
        """
        if not callable(fn):
            raise TypeError(
                f"`schedule` needs a function to run on a worker, got {type(fn).__name__}: {fn!r}."
            )
        if args is not None and not isinstance(args, (tuple, list)):
            raise TypeError(
                f"`args` of `schedule` must be a tuple of arguments, got {type(args).__name__}: "
                "pass one argument as `args=(value,)`."
            )
        if kwargs is not None and not isinstance(kwargs, dict):
            raise TypeError(f"`kwargs` of `schedule` must be a dict, got {type(kwargs).__name__}.")
        remote = remote_value_types(self._strategy)
        if any(isinstance(leaf, remote) for leaf in tree.flatten((tuple(args or ()), dict(kwargs or {})))):
            raise ValueError(
                "`schedule` does not take a RemoteValue as an argument: call `.fetch()` on it first "
                "(after `join()`), or compute the value inside the scheduled function."
            )
        return self._impl.schedule(_compiled(fn) if self._native else fn, args=args, kwargs=kwargs)

    def join(self) -> None:
        """Waits until every scheduled function has run; raises the first error of one."""
        return self._impl.join()

    def done(self) -> bool:
        """Whether every scheduled function has run (non-blocking); raises the first error of one."""
        return self._impl.done()

    def fetch(self, val: Any) -> Any:
        """The values of a (nested structure of) `RemoteValue`s, as NumPy; waits for them."""
        return self._impl.fetch(val)

    def create_per_worker_dataset(self, dataset_fn: Any) -> Any:
        """A dataset on every worker from `dataset_fn` (a function returning a dataset, or a
        dataset); `iter(...)` of it gives the per-worker iterator to pass to `schedule`."""
        return self._impl.create_per_worker_dataset(_compiled(dataset_fn) if self._native else dataset_fn)

    def __repr__(self) -> str:
        return f"ClusterCoordinator({self._strategy!r})"
