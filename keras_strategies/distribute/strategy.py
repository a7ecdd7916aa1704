"""`Strategy`, `StrategyExtended` and the default strategy, shared by every backend.

A strategy owns a list of replica devices. `scope()` makes it current (and the
variables, models and optimizers built inside belong to it); `run` calls a
function once per replica in replica context; `reduce` / `gather` combine
per-replica results on the host. Collectives between replicas are delegated to
the extended object, which subclasses specialise per strategy.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from typing import Any, Callable, Iterator, Optional, Sequence

from keras import distribution as keras_distribution
from keras import ops

from keras_strategies.distribute import context, traced_function
from keras_strategies.distribute.cross_replica_helpers import CrossReplicaHelpers
from keras_strategies.distribute.reductions import HostReductions
from keras_strategies.distribute.workers import OneWorker
from keras_strategies.backend import engine
from keras_strategies.input.options import ValueContext
from keras_strategies.distribute.reduce_op import ReduceOp
from keras_strategies.backend.common.replica_variables import ReplicaWrites, outside_replica_scope
from keras_strategies.distribute.values import (
    DistributedValues,
    PerReplica,
    is_distributed,
    map_structure,
    regroup,
    tag_strategy,
    select_replica,
)


# Every live strategy's internals, in the order they were made: the same order on every worker,
# whose syncs must run the same collectives in the same order (a set's order may differ).
_LIVE_EXTENDED: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()
_MADE = itertools.count()


def sync_new_variables_from_chief() -> None:
    """Gives new variables of every live strategy the chief's values (multi-worker only)."""
    for _, extended in sorted(_LIVE_EXTENDED.items()):
        extended._sync_variables_from_chief()


class StrategyExtended(CrossReplicaHelpers, HostReductions, OneWorker):
    """A strategy's internals, `strategy.extended`, as `tf.distribute.StrategyExtended`.

    Devices of the replicas and the cross-replica operations that custom
    optimizers and training loops use (`reduce_to`, `broadcast_to`, `update`).
    Get it from a strategy; do not construct it.

    Its parts, one module each: tf.distribute's cross-replica helpers
    (`cross_replica_helpers.py`), `reduce` and `gather` on the host
    (`reductions.py`), the workers (`workers.py`: one, unless a multi-worker
    strategy overrides them); here the devices, the variables created in
    scope, running a function on every replica and Keras' methods.

    Examples:
        >>> strategy = ks.MirroredStrategy(["cpu:0", "cpu:1"])
        >>> strategy.extended.worker_devices
        ('cpu:0', 'cpu:1')
        >>> per_replica = strategy.run(lambda: keras.ops.ones((2,)))
        >>> total = strategy.extended.reduce_to("sum", per_replica, destinations="cpu:0")
        >>> keras.ops.convert_to_numpy(total).tolist()
        [2.0, 2.0]
    """

    def __init__(self, container_strategy: "Strategy", devices: Sequence[str], place_variables: bool = False):
        self._container = container_strategy
        self._devices = tuple(devices)
        self._variables: list = []
        _LIVE_EXTENDED[next(_MADE)] = self
        # Strategies that own devices keep variables (and cross-replica results) on the first one.
        self._place_variables = place_variables

    # --- devices -------------------------------------------------------------
    @property
    def worker_devices(self) -> tuple:
        """The compute devices of this worker's replicas, in replica order.

        Examples:
            >>> ks.MirroredStrategy(["cpu:0", "cpu:1"]).extended.worker_devices
            ('cpu:0', 'cpu:1')
        """
        return self._devices

    @property
    def parameter_devices(self) -> tuple:
        """The devices holding variables (the replica devices: each reads its own copy)."""
        return self._devices

    @property
    def host_device(self) -> str:
        """Where cross-replica results (`reduce`, `gather`) are placed: the variables' device."""
        return self._variable_device if self._place_variables else "cpu:0"

    @property
    def _variable_device(self) -> str:
        """Where the variables live and their updates run: the first replica device here."""
        return self._devices[0]

    @property
    def num_replicas_in_sync(self) -> int:
        """The number of replicas of all workers, as `Strategy.num_replicas_in_sync`."""
        return len(self._devices)

    @property
    def experimental_require_static_shapes(self) -> bool:
        """False: batches of any size may be distributed (TPU strategies need static shapes)."""
        return False

    @property
    def should_checkpoint(self) -> bool:
        """Whether this worker should save checkpoints (with several workers: the chief only)."""
        return True

    @property
    def should_save_summary(self) -> bool:
        """Whether this worker should write summaries (with several workers: the chief only)."""
        return True

    def variable_created_in_scope(self, variable: Any) -> bool:
        """True only for variables created inside this strategy's scope.

        Examples:
            >>> strategy = ks.MirroredStrategy(["cpu:0", "cpu:1"])
            >>> with strategy.scope():
            ...     inside = keras.Variable(1.0)
            >>> outside = keras.Variable(1.0)
            >>> strategy.extended.variable_created_in_scope(inside), strategy.extended.variable_created_in_scope(outside)
            (True, False)
        """
        return getattr(variable, "_ks_strategy", None) is self._container

    def _track(self, obj: Any) -> bool:
        """Remembers variables created in scope (weakly), to mirror them on replica devices;
        whether `obj` is one."""
        from keras.src.backend.common.variables import Variable

        if not isinstance(obj, Variable):
            return False
        self._variables.append(weakref.ref(obj))
        return True

    def _scope_variables(self) -> list:
        alive = [ref() for ref in self._variables]
        self._variables = [weakref.ref(v) for v in alive if v is not None]
        return [v for v in alive if v is not None]

    def _replica_writes(self, devices: Sequence[str], record: bool = True) -> ReplicaWrites:
        """Scopes that keep the variable writes of replicas on `devices` apart until the run ends.

        With several workers even one local replica records its writes: they
        are combined with the other workers' (`_combine_writes`). `record=False`
        for steps that write no variables.
        """
        record = record and (len(devices) > 1 or self._num_workers > 1)
        return ReplicaWrites(devices, engine.replicas.replica_view, engine.replicas.onto, record)

    def _combine_writes(self, writes: ReplicaWrites) -> None:
        """Writes the replicas' combined values to the primaries at the end of `run`."""
        writes.combine()

    @contextlib.contextmanager
    def _scope_placement(self) -> Iterator[None]:
        """Device placement while in `scope()`: the first device, for strategies that own devices."""
        if not self._place_variables:
            yield
            return
        with engine.devices.device_scope(self._variable_device):
            yield

    # --- replica execution ---------------------------------------------------
    def _custom_steps_untraceable(self) -> Optional[str]:
        """Why `ks.function` cannot trace a step on these replicas as one program, or None."""
        if self._num_workers > 1:
            return "its strategy has several workers, whose collectives meet eagerly"
        return None

    def _call_for_each_replica(self, fn: Callable, args: tuple, kwargs: dict) -> Any:
        results = []
        # A worker's one replica runs together with the other workers' replicas: collectives
        # (e.g. synchronized BatchNormalization's sums) meet across workers.
        together = self._num_workers > 1
        writes = self._replica_writes(self._devices)
        for replica_id, device in enumerate(self._devices):
            replica_context = context.ReplicaContext(self._container, replica_id, in_program=together)
            with context.enter_frame(self._container, replica_context), engine.devices.device_scope(device), \
                    writes.scope(replica_id):
                results.append(fn(*select_replica(replica_id, args), **select_replica(replica_id, kwargs)))
        self._combine_writes(writes)
        return regroup(results)

    def _merge_call(self, replica_context: "context.ReplicaContext", merge_fn: Callable, args: tuple, kwargs: dict) -> Any:
        if len(self._devices) != 1:
            raise NotImplementedError(f"{type(self).__name__} has no merge_call for several replicas.")
        with context.enter_frame(self._container, None), outside_replica_scope():
            return merge_fn(self._container, *args, **kwargs)

    def _all_reduce(self, replica_context: "context.ReplicaContext", reduce_op: ReduceOp, value: Any) -> Any:
        if self.num_replicas_in_sync != 1:
            raise NotImplementedError(f"{type(self).__name__} has no all_reduce for several replicas.")
        return value

    def _local_all_reduce(self, replica_context: "context.ReplicaContext", reduce_op: ReduceOp, value: Any) -> Any:
        """All-reduce over this worker's replicas only (inside one compiled replica program)."""
        return self._all_reduce(replica_context, reduce_op, value)

    def _synchronized_sum(self, replica_context: "context.ReplicaContext", value: Any) -> Any:
        """Sum over every replica of every worker inside a replica program, differentiable
        (the statistics of synchronized BatchNormalization)."""
        return self._local_all_reduce(replica_context, ReduceOp.SUM, value)

    def _all_gather(self, replica_context: "context.ReplicaContext", value: Any, axis: int) -> Any:
        if self.num_replicas_in_sync != 1:
            raise NotImplementedError(f"{type(self).__name__} has no all_gather for several replicas.")
        return value

    # --- updates ------------------------------------------------------------
    # Whether `fit` may compile the optimizer update into one program with the replicas' step;
    # a strategy that updates each device's shard of the state on that device says no.
    _update_in_whole_step = True
    # Whether `apply_gradients` inside `run` hands each replica's own gradients to `_apply_update`
    # (which sums them), instead of summing them across the replicas first.
    _sums_gradients_in_update = False

    def _prepare_update(self, optimizer: Any, variables: Sequence[Any]) -> None:
        """Makes the optimizer's state before an update compiled into a step (which creates no variables)."""
        if not optimizer.built:
            optimizer.build(variables)

    def _apply_update(self, optimizer: Any, grads: Sequence[Any], variables: Sequence[Any]) -> None:
        """The one update of `variables` with the gradients summed over every replica, on the host
        device: the optimizer's own (`fit`'s update and `apply_gradients` inside `run` both come here).
        `grads` is what `_sum_gradients` made, or per-replica values (`_sums_gradients_in_update`)."""
        engine.optimizer.apply_gradients(optimizer, grads, variables)

    # --- Keras integration --------------------------------------------------
    def _run_keras_method(self, name: str, method: Callable, model: Any, args: tuple, kwargs: dict) -> Any:
        """Runs a Keras `fit`/`evaluate`/`predict`/`*_on_batch` call of a model built in scope.

        With one replica the model's own step runs in that replica's context,
        on its device; multi-replica strategies override this.
        """
        if self.num_replicas_in_sync != 1:
            raise NotImplementedError(f"{type(self).__name__} cannot run Keras `{name}` yet.")
        replica_context = context.ReplicaContext(self._container, 0, runs_keras_method=True)
        with self._container.scope(), context.enter_frame(self._container, replica_context):
            with engine.devices.device_scope(self._devices[0]):
                return method(model, *args, **kwargs)


class Strategy:
    """Base class of every strategy, with the API of `tf.distribute.Strategy`.

    A strategy owns the replica devices. Build models and optimizers in
    `scope()` and train with Keras' `fit`, or write a custom loop with
    `run`, `reduce` and a distributed dataset. Use a subclass:
    `OneDeviceStrategy`, `MirroredStrategy` or `MultiWorkerMirroredStrategy`.

    Examples:
        >>> strategy = ks.MirroredStrategy(["cpu:0", "cpu:1"])
        >>> isinstance(strategy, ks.Strategy)
        True
        >>> def replica_fn():
        ...     return float(ks.get_replica_context().replica_id_in_sync_group + 1)
        >>> float(strategy.reduce("sum", strategy.run(replica_fn), axis=None))
        3.0
    """

    def __init__(self, extended: StrategyExtended):
        self._extended = extended
        self._default_replica_context = context.ReplicaContext(self, 0)

    @property
    def extended(self) -> StrategyExtended:
        """The `StrategyExtended` of this strategy: devices and cross-replica operations.

        Examples:
            >>> ks.MirroredStrategy(["cpu:0", "cpu:1"]).extended.worker_devices
            ('cpu:0', 'cpu:1')
        """
        return self._extended

    @property
    def num_replicas_in_sync(self) -> int:
        """How many replicas' gradients are combined in each step (all workers).

        Scale the global batch size with it.

        Examples:
            >>> strategy = ks.MirroredStrategy(["cpu:0", "cpu:1"])
            >>> strategy.num_replicas_in_sync
            2
            >>> global_batch_size = 32 * strategy.num_replicas_in_sync
        """
        return self._extended.num_replicas_in_sync

    @property
    def cluster_resolver(self) -> Any:
        """The cluster resolver of multi-worker strategies, else `None`.

        Examples:
            >>> print(ks.MirroredStrategy(["cpu:0"]).cluster_resolver)
            None
        """
        return None

    @contextlib.contextmanager
    def scope(self) -> Iterator[Strategy]:
        """Makes this strategy current; what is built inside belongs to it.

        Create models, optimizers and metrics inside the scope: their variables
        are then mirrored on the replicas, and `fit` / `evaluate` / `predict`
        run on every replica. Nesting the same strategy's scope is fine;
        entering another strategy's scope inside it raises `RuntimeError`.

        Examples:
            >>> strategy = ks.MirroredStrategy(["cpu:0", "cpu:1"])
            >>> with strategy.scope():
            ...     model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
            ...     model.compile(optimizer="sgd", loss="mse")
            ...     print(ks.get_strategy() is strategy)
            True
            >>> history = model.fit(np.ones((8, 4)), np.ones((8, 1)), batch_size=4, verbose=0)
        """
        current = context.get_strategy() if context.current_frames() else None
        if current is self:
            yield self
            return
        if current is not None:
            raise RuntimeError(
                f"Mixing different distribution strategies: a {type(current).__name__} scope "
                f"is active and a {type(self).__name__} scope was entered inside it. Leave the "
                "first scope (or use the same strategy object) before entering another."
            )
        if not is_default(self):
            _refuse_keras_distribution(self)
        replica_context = self._default_replica_context if is_default(self) else None
        with context.enter_frame(self, replica_context), self._extended._scope_placement():
            yield self

    def run(self, fn: Callable, args: tuple = (), kwargs: Optional[dict] = None, options: Any = None) -> Any:
        """Calls `fn` once per replica in replica context and regroups the results.

        `PerReplica` arguments (such as the elements of a distributed dataset)
        are unpacked per replica; other arguments are passed unchanged to every
        replica. The result has the structure of `fn`'s, each leaf a `PerReplica`
        (or the value itself when every replica returns the same object or number).

        Args:
            fn: The replica function.
            args: Positional arguments of `fn` (a tuple: `args=(batch,)`).
            kwargs: Keyword arguments of `fn`.
            options: A `ks.RunOptions`; accepted for compatibility, unused.

        Examples:
            >>> strategy = ks.MirroredStrategy(["cpu:0", "cpu:1"])
            >>> def replica_fn(scale):
            ...     return scale * ks.get_replica_context().replica_id_in_sync_group
            >>> strategy.run(replica_fn, args=(10,))
            PerReplica:{
              0: 0,
              1: 10
            }
        """
        if not isinstance(args, (tuple, list)):
            raise TypeError(
                f"`args` of `strategy.run` must be a tuple (or list) of arguments for `fn`, got "
                f"{type(args).__name__}: pass one argument as `args=(value,)`."
            )
        if kwargs is not None and not isinstance(kwargs, dict):
            raise TypeError(f"`kwargs` of `strategy.run` must be a dict, got {type(kwargs).__name__}.")
        return self._extended._call_for_each_replica(fn, tuple(args), dict(kwargs or {}))

    def reduce(self, reduce_op: ReduceOp | str, value: Any, axis: Optional[int]) -> Any:
        """Combines per-replica values across replicas (and along `axis`, if given) on the host.

        With `axis`, `MEAN` divides by the total number of elements along that
        axis over all replicas, so uneven shards are weighted correctly.

        Args:
            reduce_op: `ks.ReduceOp.SUM` or `MEAN`, or `"sum"` / `"mean"`.
            value: A (nested structure of) `PerReplica` values, as `run` returns.
            axis: `None` to reduce element-wise over replicas; an axis to also
                reduce along it (over every replica's rows).

        Examples:
            >>> strategy = ks.MirroredStrategy(["cpu:0", "cpu:1"])
            >>> per_replica = strategy.run(lambda: keras.ops.ones((3,)))
            >>> keras.ops.convert_to_numpy(strategy.reduce("sum", per_replica, axis=None)).tolist()
            [2.0, 2.0, 2.0]
            >>> float(strategy.reduce(ks.ReduceOp.MEAN, per_replica, axis=0))
            1.0
        """
        op = ReduceOp.parse(reduce_op)
        if axis is not None:
            traced_function.note_rows_enter("strategy.reduce along an axis of per-replica rows", value)
        return map_structure(lambda v: self._extended._reduce(op, v, axis), value)

    def gather(self, value: Any, axis: int) -> Any:
        """Concatenates per-replica values along `axis` on the host (shards may differ in size).

        Examples:
            >>> strategy = ks.MirroredStrategy(["cpu:0", "cpu:1"])
            >>> per_replica = strategy.run(lambda: keras.ops.ones((2, 3)))
            >>> tuple(strategy.gather(per_replica, axis=0).shape)
            (4, 3)
        """
        if context.get_replica_context() is not None and not is_default(self) and context.has_strategy():
            raise RuntimeError("`strategy.gather` is for cross-replica context; inside `run` use "
                               "`ks.get_replica_context().all_gather`.")
        traced_function.note_rows_enter("strategy.gather of per-replica rows", value)
        return map_structure(lambda v: self._extended._gather(v, axis), value)

    def experimental_local_results(self, value: Any) -> tuple:
        """This worker's per-replica components of `value` (a plain value gives `(value,)`).

        Examples:
            >>> strategy = ks.MirroredStrategy(["cpu:0", "cpu:1"])
            >>> per_replica = strategy.run(lambda: ks.get_replica_context().replica_id_in_sync_group)
            >>> strategy.experimental_local_results(per_replica)
            (0, 1)
        """
        if isinstance(value, DistributedValues):
            return value.values
        leaves_are_distributed = []
        map_structure(lambda v: leaves_are_distributed.append(is_distributed(v)), value)
        if any(leaves_are_distributed):
            return tuple(select_replica(i, value) for i in range(len(self._extended.worker_devices)))
        return (value,)

    def experimental_distribute_dataset(self, dataset: Any, options: Any = None) -> Any:
        """Splits each global batch of `dataset` across the replicas.

        `dataset` yields batches of the *global* batch size: a `tf.data.Dataset`
        (on every backend), `make_experimental_numpy_dataset(...)`, a
        `keras.utils.PyDataset` or any iterable of batches. Shard sizes differ
        by at most one and no sample is dropped. With several workers, every
        worker reads the same batches and takes its replicas' shards.

        Args:
            dataset: The source of global batches.
            options: A `ks.InputOptions`.

        Returns:
            A `ks.DistributedDataset`; each element is one step, each leaf a `PerReplica`.

        Examples:
            >>> strategy = ks.MirroredStrategy(["cpu:0", "cpu:1"])
            >>> x = np.arange(8, dtype="float32").reshape(8, 1)
            >>> dataset = strategy.make_experimental_numpy_dataset(x).batch(4)  # global batches
            >>> for batch in strategy.experimental_distribute_dataset(dataset):
            ...     print([tuple(shard.shape) for shard in strategy.experimental_local_results(batch)])
            [(2, 1), (2, 1)]
            [(2, 1), (2, 1)]
        """
        from keras_strategies.input.distributed_dataset import GlobalBatchDataset

        return GlobalBatchDataset(self, dataset, options)

    def distribute_datasets_from_function(self, dataset_fn: Callable, options: Any = None) -> Any:
        """Calls `dataset_fn(InputContext)`; its per-replica batches go to the replicas in turn.

        `dataset_fn` is called once per worker and returns a dataset batched
        *per replica* (see `InputContext.get_per_replica_batch_size`); with
        several workers, shard it with `input_context.input_pipeline_id`.

        Args:
            dataset_fn: A function of a `ks.InputContext` returning a dataset.
            options: A `ks.InputOptions`.

        Returns:
            A `ks.DistributedDataset`.

        Examples:
            >>> strategy = ks.MirroredStrategy(["cpu:0", "cpu:1"])
            >>> def dataset_fn(input_context):
            ...     batch_size = input_context.get_per_replica_batch_size(4)  # 2
            ...     x = np.arange(8, dtype="float32").reshape(8, 1)
            ...     x = x[input_context.input_pipeline_id::input_context.num_input_pipelines]
            ...     return strategy.make_experimental_numpy_dataset(x).batch(batch_size)
            >>> dist_dataset = strategy.distribute_datasets_from_function(dataset_fn)
            >>> [len(strategy.experimental_local_results(batch)) for batch in dist_dataset]
            [2, 2]
        """
        from keras_strategies.input.distributed_dataset import DistributedDatasetsFromFunction

        return DistributedDatasetsFromFunction(self, dataset_fn, options)

    experimental_distribute_datasets_from_function = distribute_datasets_from_function

    def make_experimental_numpy_dataset(self, numpy_input: Any) -> Any:
        """A dataset of the rows of `numpy_input` (arrays or a structure of them), sliced lazily.

        It has `batch`, `shuffle` and `repeat`, as a `tf.data.Dataset` made with
        `from_tensor_slices`, on every backend.

        Examples:
            >>> strategy = ks.MirroredStrategy(["cpu:0", "cpu:1"])
            >>> x, y = np.ones((10, 3), "float32"), np.zeros((10,), "int32")
            >>> dataset = strategy.make_experimental_numpy_dataset((x, y)).shuffle(10).batch(4)
            >>> len(dataset)
            3
        """
        from keras_strategies.input.numpy_dataset import NumpyDataset

        return NumpyDataset(numpy_input)

    def experimental_distribute_values_from_function(self, value_fn: Callable[[ValueContext], Any]) -> Any:
        """Calls `value_fn(ValueContext)` once per replica and returns the values as `PerReplica`.

        Examples:
            >>> strategy = ks.MirroredStrategy(["cpu:0", "cpu:1"])
            >>> values = strategy.experimental_distribute_values_from_function(
            ...     lambda ctx: ctx.replica_id_in_sync_group * 10)
            >>> strategy.experimental_local_results(values)
            (0, 10)
        """
        values = []
        devices = self._extended.worker_devices
        first = self._extended._worker_index * len(devices)  # this worker's replicas are consecutive
        for replica_id, device in enumerate(devices):
            with engine.devices.device_scope(device):
                values.append(value_fn(ValueContext(first + replica_id, self.num_replicas_in_sync)))
        return tag_strategy(values[0] if len(values) == 1 else PerReplica(values), self)

    def group(self, value: Any, name: Optional[str] = None) -> Any:
        """The local results of `value` (TensorFlow groups them into one op; eager code needs nothing).

        Examples:
            >>> strategy = ks.MirroredStrategy(["cpu:0", "cpu:1"])
            >>> strategy.group(strategy.run(lambda: ks.get_replica_context().replica_id_in_sync_group))
            (0, 1)
        """
        return self.experimental_local_results(value)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(devices={list(self._extended.worker_devices)})"


class _DefaultExtended(StrategyExtended):
    def _on_host(self, value: Any) -> Any:
        return ops.convert_to_tensor(value)  # no placement: values stay where they are

    def _custom_steps_untraceable(self) -> Optional[str]:
        # Without a strategy Keras' own code runs unchanged (no hook lifts an optimizer's first
        # variables out of a trace), so a step runs as written.
        return "no strategy is in use"

    def variable_created_in_scope(self, variable: Any) -> bool:
        return getattr(variable, "_ks_strategy", None) is None


class _DefaultStrategy(Strategy):
    """The pass-through strategy current outside every scope: one replica, no placement."""

    _is_default_strategy = True

    def __init__(self):
        super().__init__(_DefaultExtended(self, ["cpu:0"]))

    def run(self, fn: Callable, args: tuple = (), kwargs: Optional[dict] = None, options: Any = None) -> Any:
        with context.enter_frame(self, self._default_replica_context):
            return fn(*args, **(kwargs or {}))

    def __repr__(self) -> str:
        return "DefaultStrategy()"


context.register_default_strategy(_DefaultStrategy)
default_strategy = context.default_strategy
is_default = context.is_default


def _refuse_keras_distribution(strategy: "Strategy") -> None:
    """Keras' own distribution API and a strategy would both place variables and split batches.

    Together they fail deep inside the backend (on JAX, a jitted step gets
    arguments on different devices), so the scope refuses the mix.
    """
    active = keras_distribution.distribution()
    if active is not None:
        raise RuntimeError(
            f"keras.distribution is set to {type(active).__name__}, which places variables and splits "
            f"batches itself, as {type(strategy).__name__} does: use one of them. Call "
            "keras.distribution.set_distribution(None) before using the strategy, or train without it."
        )
