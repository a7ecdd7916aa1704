"""`ParameterServerStrategy`: asynchronous training with parameter servers and a coordinator.

The chief (coordinator) creates the strategy; variables created in its
`scope()` live on the parameter servers; a `ks.coordinator.ClusterCoordinator`
schedules training steps on the workers, each of which reads the current
values and sends its update to the parameter servers without waiting for the
other workers. The backend's engine (`backend/<name>/parameter_server.py`)
does the placement, the dispatch and the serving; this front end validates
the cluster and gives the `tf.distribute` API.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

from keras_strategies.backend import engine
from keras_strategies.cluster_resolver import TFConfigClusterResolver
from keras_strategies.cluster_resolver.roles import validate_parameter_server_config
from keras_strategies.distribute import context
from keras_strategies.distribute.reduce_op import ReduceOp
from keras_strategies.distribute.strategy import Strategy, StrategyExtended
from keras_strategies.keras_integration.optimizer_hooks import direct_update


class ParameterServerExtended(StrategyExtended):
    """`strategy.extended` of `ParameterServerStrategy`: the engine's runtime and the cluster."""

    def __init__(self, container: "ParameterServerStrategy", runtime: Any, cluster_spec: Any):
        super().__init__(container, ("cpu:0",), place_variables=False)
        self._runtime = runtime
        self._cluster_spec = cluster_spec

    @property
    def num_replicas_in_sync(self) -> int:
        return self._runtime.num_replicas_in_sync

    @property
    def parameter_devices(self) -> tuple:
        """The parameter-server tasks that hold the variables."""
        return tuple(f"/job:ps/replica:0/task:{i}" for i in range(self._cluster_spec.num_tasks("ps")))

    @property
    def _num_workers(self) -> int:
        return self._cluster_spec.num_tasks("worker")

    @contextlib.contextmanager
    def _scope_placement(self) -> Iterator[None]:
        with self._runtime.variable_scope():
            yield

    def _custom_steps_untraceable(self) -> Optional[str]:
        return "ParameterServerStrategy's steps run on its workers, from the coordinator"

    def _call_for_each_replica(self, fn: Callable, args: tuple, kwargs: dict) -> Any:
        strategy = self._container

        def replica_fn(*args: Any, **kwargs: Any) -> Any:
            # The engine's replica (on TensorFlow, in a thread of TF's own) applies updates with
            # Keras' optimizer as it is: each worker's update goes to the parameter servers.
            with context.enter_frame(strategy, context.ReplicaContext(strategy, 0)), direct_update():
                return fn(*args, **kwargs)

        return self._runtime.run(replica_fn, args, kwargs)

    def _reduce(self, reduce_op: ReduceOp, value: Any, axis: Optional[int]) -> Any:
        return self._runtime.reduce(reduce_op.value, value, axis)

    def _run_keras_method(self, name: str, method: Callable, model: Any, args: tuple, kwargs: dict) -> Any:
        from keras_strategies.trainer import parameter_server

        return parameter_server.run_keras_method(name, self._container, method, model, args, kwargs)


class ParameterServerStrategy(Strategy):
    """Asynchronous data parallelism with parameter servers, as `tf.distribute.ParameterServerStrategy`.

    Create it on the chief (the coordinator) of a cluster with `worker` and `ps`
    tasks; those tasks run `ks.Server(...).join()`. Variables (of the model,
    the optimizer, the metrics) created in `scope()` live on the parameter
    servers, round-robin over them or split along their first axis by
    `variable_partitioner`. Training steps are scheduled on the workers with
    `ks.coordinator.ClusterCoordinator(strategy)`, or by `Model.fit`.

    Args:
        cluster_resolver: Where the cluster comes from; `None` reads `TF_CONFIG`
            (`ks.cluster_resolver.TFConfigClusterResolver`).
        variable_partitioner: `None` (each variable on one parameter server) or a
            partitioner from `ks.experimental.partitioners`.

    Examples:
        >>> resolver = ks.cluster_resolver.SimpleClusterResolver(
        ...     ks.ClusterSpec({"chief": ["127.0.0.1:2222"], "worker": ["127.0.0.1:2223"]}),
        ...     task_type="chief", task_id=0)
        >>> ks.ParameterServerStrategy(resolver)
        Traceback (most recent call last):
        ...
        ValueError: There must be at least one ps.
    """

    _is_parameter_server_strategy = True

    def __init__(self, cluster_resolver: Any = None, variable_partitioner: Optional[Callable] = None):
        resolver = cluster_resolver if cluster_resolver is not None else TFConfigClusterResolver()
        spec = validate_parameter_server_config(resolver.cluster_spec(), resolver.task_type, resolver.task_id)
        if resolver.task_type in ("worker", "ps"):
            raise ValueError(
                f"ParameterServerStrategy is created on the chief (the coordinator), not on a "
                f"{resolver.task_type!r} task: there run `ks.Server(cluster_spec, job_name="
                f"{resolver.task_type!r}, task_index={resolver.task_id}).join()`."
            )
        if variable_partitioner is not None and not callable(variable_partitioner):
            raise ValueError(
                "variable_partitioner must be None or a partitioner (a callable such as "
                f"ks.experimental.partitioners.FixedShardsPartitioner(2)), got {variable_partitioner!r}."
            )
        runtime = engine.parameter_server.connect(spec, resolver.task_type, resolver.task_id, variable_partitioner,
                                                  getattr(resolver, "rpc_layer", None))
        self._cluster_resolver = resolver
        self._variable_partitioner = variable_partitioner
        super().__init__(ParameterServerExtended(self, runtime, spec))

    @property
    def cluster_resolver(self) -> Any:
        """The cluster resolver the strategy was created with."""
        return self._cluster_resolver

    def experimental_distribute_dataset(self, dataset: Any, options: Any = None) -> Any:
        """The engine's distributed dataset; create it inside the function passed to
        `ClusterCoordinator.create_per_worker_dataset` to read it on the workers."""
        return self._extended._runtime.experimental_distribute_dataset(dataset, options)

    def distribute_datasets_from_function(self, dataset_fn: Callable, options: Any = None) -> Any:
        """Calls `dataset_fn(InputContext)` on each worker, inside the function passed to
        `ClusterCoordinator.create_per_worker_dataset`."""
        return self._extended._runtime.distribute_datasets_from_function(dataset_fn, options)

    experimental_distribute_datasets_from_function = distribute_datasets_from_function

    def reduce(self, reduce_op: ReduceOp | str, value: Any, axis: Optional[int]) -> Any:
        """Combines the per-replica results of `run` (inside a scheduled function, on the worker)."""
        return self._extended._reduce(ReduceOp.parse(reduce_op), value, axis)

    def _ks_worker_copy(self) -> "WorkerStrategy":
        """What a scheduled function that captures the strategy sees on a worker (engines that
        send closures to their workers, such as Ray's, replace the strategy with it)."""
        return WorkerStrategy(self._extended._num_workers)

    def __repr__(self) -> str:
        spec = self._extended._cluster_spec
        return (f"ParameterServerStrategy(workers={spec.num_tasks('worker')}, "
                f"ps={spec.num_tasks('ps')})")


class WorkerStrategy:
    """The strategy inside a scheduled function on a worker: one replica, the worker's own input.

    `run(fn, args, kwargs)` calls `fn` (the worker's one replica); `reduce` of its
    value over replicas is the value (reduced along `axis` when given).
    """

    num_replicas_in_sync = 1

    def __init__(self, num_workers: int):
        self._num_workers = num_workers

    def run(self, fn: Callable, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        """Runs `fn` on this worker's one replica."""
        return fn(*(args or ()), **(kwargs or {}))

    def reduce(self, reduce_op: ReduceOp | str, value: Any, axis: Optional[int]) -> Any:
        """One replica's `value`; with `axis`, summed or averaged along it."""
        op = ReduceOp.parse(reduce_op)
        if axis is None:
            return value
        import keras

        reduce = keras.ops.sum if op == ReduceOp.SUM else keras.ops.mean
        return keras.tree.map_structure(lambda v: reduce(v, axis=axis), value)

    def scope(self) -> contextlib.AbstractContextManager:
        """Nothing to place on a worker: its variables are copies of the parameter servers'."""
        return contextlib.nullcontext()

    def experimental_distribute_dataset(self, dataset: Any, options: Any = None) -> Any:
        """This worker's dataset as it is (its one replica reads every element)."""
        return dataset

    def distribute_datasets_from_function(self, dataset_fn: Callable, options: Any = None) -> Any:
        """`dataset_fn(InputContext)` with this worker's input pipeline."""
        from keras_strategies.coordinator import experimental_get_current_worker_index
        from keras_strategies.input.options import InputContext

        context_ = InputContext(num_input_pipelines=self._num_workers,
                                input_pipeline_id=experimental_get_current_worker_index(), num_replicas_in_sync=1)
        return dataset_fn(context_)

    experimental_distribute_datasets_from_function = distribute_datasets_from_function

    def __repr__(self) -> str:
        return f"WorkerStrategy(workers={self._num_workers})"
