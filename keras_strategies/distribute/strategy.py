"""`Strategy`, `StrategyExtended` and the default strategy, shared by every backend.

A strategy owns a list of replica devices. `scope()` makes it current (and the
variables, models and optimizers built inside belong to it); `run` calls a
function once per replica in replica context; `reduce` / `gather` combine
per-replica results on the host. Collectives between replicas are delegated to
the extended object, which subclasses specialise per strategy.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Iterator, Optional, Sequence

from keras import distribution as keras_distribution
from keras import ops

from keras_strategies.distribute import context
from keras_strategies.backend import engine
from keras_strategies.input.options import ValueContext
from keras_strategies.distribute.reduce_op import ReduceOp
from keras_strategies.backend.common.replica_variables import ReplicaWrites, outside_replica_scope
from keras_strategies.distribute.values import (
    DistributedValues,
    Mirrored,
    PerReplica,
    is_distributed,
    map_structure,
    regroup,
    select_replica,
)


_LIVE_EXTENDED: "weakref.WeakSet" = weakref.WeakSet()


def sync_new_variables_from_chief() -> None:
    """Gives new variables of every live strategy the chief's values (multi-worker only)."""
    for extended in list(_LIVE_EXTENDED):
        extended._sync_variables_from_chief()


class StrategyExtended:
    """Strategy internals (`strategy.extended`): devices, per-replica calls, reductions."""

    def __init__(self, container_strategy: "Strategy", devices: Sequence[str], place_variables: bool = False):
        self._container = container_strategy
        self._devices = tuple(devices)
        self._variables: list = []
        self._new_variables = False  # created since the last `_sync_variables_from_chief`
        _LIVE_EXTENDED.add(self)
        # Strategies that own devices keep variables (and cross-replica results) on the first one.
        self._place_variables = place_variables

    # --- devices -------------------------------------------------------------
    @property
    def worker_devices(self) -> tuple:
        """The compute devices of this worker's replicas, in replica order."""
        return self._devices

    @property
    def parameter_devices(self) -> tuple:
        """The devices holding variables."""
        return self._devices

    @property
    def host_device(self) -> str:
        """Where cross-replica results (`reduce`, `gather`) are placed."""
        return self._devices[0] if self._place_variables else "cpu:0"

    @property
    def num_replicas_in_sync(self) -> int:
        return len(self._devices)

    @property
    def experimental_require_static_shapes(self) -> bool:
        return False

    @property
    def should_checkpoint(self) -> bool:
        return True

    @property
    def should_save_summary(self) -> bool:
        return True

    def variable_created_in_scope(self, variable: Any) -> bool:
        """True only for variables created inside this strategy's scope."""
        return getattr(variable, "_ks_strategy", None) is self._container

    # --- tf.distribute's cross-replica helpers (custom optimizers and loops use them) --------------
    def _destination_devices(self, destinations: Any) -> tuple:
        """The devices `destinations` names: a device string, a variable (of this scope: every
        replica device; else the host) or a list of these."""
        if isinstance(destinations, str):
            return (destinations,)
        if isinstance(destinations, (list, tuple)):
            return tuple(device for d in destinations for device in self._destination_devices(d))
        if isinstance(destinations, DistributedValues) or self.variable_created_in_scope(destinations):
            return self.worker_devices
        return (self.host_device,)

    def _mirrored_to(self, value: Any, destinations: Any) -> Any:
        devices = self._destination_devices(destinations)
        copies = [engine.devices.copy_to(ops.convert_to_tensor(value), device) for device in devices]
        return copies[0] if len(copies) == 1 else Mirrored(copies)

    def _check_cross_replica(self, name: str) -> None:
        if context.has_strategy() and context.get_replica_context() is not None:
            raise RuntimeError(
                f"`strategy.extended.{name}` is for cross-replica context; inside `strategy.run` use "
                "`ks.get_replica_context().all_reduce` (or `merge_call`)."
            )

    def reduce_to(self, reduce_op: "ReduceOp | str", value: Any, destinations: Any, options: Any = None) -> Any:
        """`value` reduced across replicas (and workers), mirrored on `destinations`."""
        self._check_cross_replica("reduce_to")
        return self._mirrored_to(self._reduce(ReduceOp.parse(reduce_op), value, None), destinations)

    def batch_reduce_to(self, reduce_op: "ReduceOp | str", value_destination_pairs: Sequence[tuple],
                        options: Any = None) -> list:
        """`reduce_to` for each `(value, destinations)` pair."""
        return [self.reduce_to(reduce_op, value, destinations, options) for value, destinations in value_destination_pairs]

    def broadcast_to(self, tensor: Any, destinations: Any) -> Any:
        """`tensor` mirrored on `destinations`."""
        return self._mirrored_to(tensor, destinations)

    def update(self, var: Any, fn: Callable, args: tuple = (), kwargs: Optional[dict] = None, group: bool = True) -> Any:
        """Runs `fn(var, *args, **kwargs)` once: a strategy's variable is one Keras variable,
        copied to the replicas at each step. Mirrored arguments give their first copy."""
        self._check_cross_replica("update")
        first = lambda value: value.values[0] if isinstance(value, Mirrored) else value  # noqa: E731
        args, kwargs = map_structure(first, tuple(args)), map_structure(first, dict(kwargs or {}))
        return fn(var, *args, **kwargs)

    def value_container(self, value: Any) -> Any:
        """The distributed variable of `value`: a strategy's variables are their own container."""
        return value

    def read_var(self, var: Any) -> Any:
        """The variable's value in cross-replica context."""
        return var.value

    @contextlib.contextmanager
    def colocate_vars_with(self, colocate_with_variable: Any) -> Iterator[None]:
        """Variables created inside sit with `colocate_with_variable`: every variable of a
        strategy already lives on its parameter devices, so nothing to change."""
        if context.get_cross_replica_context() is not self._container:
            raise RuntimeError("`colocate_vars_with` must be used inside the strategy's `scope()`.")
        yield

    def _track(self, obj: Any) -> None:
        """Remembers variables created in scope (weakly), to mirror them on replica devices."""
        from keras.src.backend.common.variables import Variable

        if isinstance(obj, Variable):
            self._variables.append(weakref.ref(obj))
            self._new_variables = True

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
        with engine.devices.device_scope(self._devices[0]):
            yield

    # --- replica execution ---------------------------------------------------
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

    # --- workers (multi-worker strategies override) -------------------------------
    @property
    def _num_workers(self) -> int:
        return 1

    @property
    def _worker_index(self) -> int:
        return 0

    @property
    def _is_chief(self) -> bool:
        return True

    def _cross_worker_sum(self, values: list, what: str = "all-reduce", donated: Any = False) -> list:
        """Element-wise sums of a list of tensors over all workers (one worker: unchanged).

        `donated` (a bool, or one per value) hands the values over: the engine
        may then sum them in place instead of copying them.
        """
        return values

    def _any_worker_has(self, flag: bool, what: str = "end-of-input agreement") -> bool:
        """Whether `flag` is true on any worker (one worker: `flag`)."""
        return flag

    def _sync_variables_from_chief(self, force: bool = False) -> None:
        """Gives every worker the chief's variable values (one worker: nothing to do)."""

    def _broadcast_from_chief(self, number: int) -> int:
        """The chief's value of a small integer (one worker: `number`)."""
        return number

    def _use_chief_input_rngs(self) -> None:
        """Makes every worker's input shuffles draw as the chief's (one worker: nothing to do)."""

    def _all_gather(self, replica_context: "context.ReplicaContext", value: Any, axis: int) -> Any:
        if self.num_replicas_in_sync != 1:
            raise NotImplementedError(f"{type(self).__name__} has no all_gather for several replicas.")
        return value

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

    # --- cross-replica reductions --------------------------------------------
    def _on_host(self, value: Any) -> Any:
        return engine.devices.copy_to(ops.convert_to_tensor(value), self.host_device)

    def _local_sum(self, components: Sequence[Any]) -> Any:
        """Sum of this worker's components on the host."""
        total = self._on_host(components[0])
        for component in components[1:]:
            total = engine.gradients.add(total, self._on_host(component))
        return total

    def _cross_replica_sum(self, components: Sequence[Any]) -> Any:
        """Sum over every replica of every worker, on the host."""
        (total,) = self._cross_worker_sum([self._local_sum(components)], "strategy.reduce")
        return self._on_host(total)

    def _reduce(self, reduce_op: ReduceOp, value: Any, axis: Optional[int]) -> Any:
        if not is_distributed(value):
            if reduce_op == ReduceOp.SUM and self.num_replicas_in_sync > 1:
                raise ValueError(
                    f"A non-DistributedValues value {value!r} cannot be reduced with the given "
                    f"reduce op {reduce_op}: with {self.num_replicas_in_sync} replicas its sum "
                    "is ambiguous. Reduce the per-replica result of `strategy.run` instead."
                )
            value = self._on_host(value)  # the same on every replica (and worker): nothing to sum
            if axis is None:
                return value
            total = ops.sum(value, axis=axis)
            return total if reduce_op == ReduceOp.SUM else ops.divide(total, ops.cast(ops.shape(value)[axis], total.dtype))
        else:
            components = list(value.values)
            replica_count = self.num_replicas_in_sync
        if axis is None:
            total = self._cross_replica_sum(components)
            if reduce_op == ReduceOp.MEAN:
                total = ops.divide(total, ops.cast(replica_count, total.dtype))
            return total
        sums = [ops.sum(ops.convert_to_tensor(c), axis=axis) for c in components]
        total = self._cross_replica_sum(sums)
        if reduce_op == ReduceOp.SUM:
            return total
        count = self._cross_replica_sum([ops.convert_to_tensor(ops.shape(c)[axis], "float32") for c in components])
        return ops.divide(total, ops.cast(count, total.dtype))

    def _cross_worker_gather(self, value: Any, axis: int) -> Any:
        """`value` of every worker concatenated along `axis` (one worker: unchanged)."""
        return value

    def _gather(self, value: Any, axis: int) -> Any:
        components = value.values if is_distributed(value) else (value,)
        tensors = [self._on_host(c) for c in components]
        if any(len(t.shape) == 0 for t in tensors):
            raise ValueError(
                "`gather` needs values of rank >= 1 (it concatenates along `axis`); got a "
                "scalar. Reshape the per-replica value to rank 1 first."
            )
        local = ops.concatenate(tensors, axis=axis) if len(tensors) > 1 else tensors[0]
        return self._on_host(self._cross_worker_gather(local, axis))


class Strategy:
    """Base class of every strategy (same API as `tf.distribute.Strategy`)."""

    def __init__(self, extended: StrategyExtended):
        self._extended = extended
        self._default_replica_context = context.ReplicaContext(self, 0)

    @property
    def extended(self) -> StrategyExtended:
        return self._extended

    @property
    def num_replicas_in_sync(self) -> int:
        """How many replicas' gradients are combined in each step (all workers)."""
        return self._extended.num_replicas_in_sync

    @property
    def cluster_resolver(self) -> Any:
        """The cluster resolver of multi-worker strategies, else `None`."""
        return None

    @contextlib.contextmanager
    def scope(self) -> Iterator["Strategy"]:
        """Makes this strategy current; what is built inside belongs to it.

        Nesting the same strategy's scope is fine; entering another strategy's
        scope while this one is active raises `RuntimeError`.
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

        `PerReplica` arguments are unpacked per replica; other arguments are
        passed unchanged to every replica.
        """
        if not isinstance(args, (tuple, list)):
            raise TypeError(
                f"`args` of `strategy.run` must be a tuple (or list) of arguments for `fn`, got "
                f"{type(args).__name__}: pass one argument as `args=(value,)`."
            )
        if kwargs is not None and not isinstance(kwargs, dict):
            raise TypeError(f"`kwargs` of `strategy.run` must be a dict, got {type(kwargs).__name__}.")
        return self._extended._call_for_each_replica(fn, tuple(args), dict(kwargs or {}))

    def reduce(self, reduce_op: "ReduceOp | str", value: Any, axis: Optional[int]) -> Any:
        """Combines per-replica values across replicas (and along `axis`, if given) on the host.

        With `axis`, `MEAN` divides by the total number of elements along that
        axis over all replicas, so uneven shards are weighted correctly.
        """
        op = ReduceOp.parse(reduce_op)
        return map_structure(lambda v: self._extended._reduce(op, v, axis), value)

    def gather(self, value: Any, axis: int) -> Any:
        """Concatenates per-replica values along `axis` on the host (shards may differ in size)."""
        if context.get_replica_context() is not None and not is_default(self) and context.has_strategy():
            raise RuntimeError("`strategy.gather` is for cross-replica context; inside `run` use "
                               "`ks.get_replica_context().all_gather`.")
        return map_structure(lambda v: self._extended._gather(v, axis), value)

    def experimental_local_results(self, value: Any) -> tuple:
        """This worker's per-replica components of `value` (a plain value gives `(value,)`)."""
        if isinstance(value, DistributedValues):
            return value.values
        leaves_are_distributed = []
        map_structure(lambda v: leaves_are_distributed.append(is_distributed(v)), value)
        if any(leaves_are_distributed):
            return tuple(select_replica(i, value) for i in range(len(self._extended.worker_devices)))
        return (value,)

    def experimental_distribute_dataset(self, dataset: Any, options: Any = None) -> Any:
        """Splits each global batch of `dataset` across the replicas (see `input/distributed_dataset.py`)."""
        from keras_strategies.input.distributed_dataset import GlobalBatchDataset

        return GlobalBatchDataset(self, dataset, options)

    def distribute_datasets_from_function(self, dataset_fn: Callable, options: Any = None) -> Any:
        """Calls `dataset_fn(InputContext)`; its per-replica batches go to the replicas in turn."""
        from keras_strategies.input.distributed_dataset import DistributedDatasetsFromFunction

        return DistributedDatasetsFromFunction(self, dataset_fn, options)

    experimental_distribute_datasets_from_function = distribute_datasets_from_function

    def make_experimental_numpy_dataset(self, numpy_input: Any) -> Any:
        """A dataset of the rows of `numpy_input` (arrays or a structure of them), sliced lazily."""
        from keras_strategies.input.numpy_dataset import NumpyDataset

        return NumpyDataset(numpy_input)

    def experimental_distribute_values_from_function(self, value_fn: Callable[[ValueContext], Any]) -> Any:
        """Calls `value_fn(ValueContext)` once per replica and returns the values as `PerReplica`."""
        values = []
        devices = self._extended.worker_devices
        first = self._extended._worker_index * len(devices)  # this worker's replicas are consecutive
        for replica_id, device in enumerate(devices):
            with engine.devices.device_scope(device):
                values.append(value_fn(ValueContext(first + replica_id, self.num_replicas_in_sync)))
        return values[0] if len(values) == 1 else PerReplica(values)

    def group(self, value: Any, name: Optional[str] = None) -> Any:
        """The local results of `value` (TF groups them into one op; eager code needs nothing)."""
        return self.experimental_local_results(value)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(devices={list(self._extended.worker_devices)})"


class _DefaultExtended(StrategyExtended):
    def _on_host(self, value: Any) -> Any:
        return ops.convert_to_tensor(value)  # no placement: values stay where they are

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
