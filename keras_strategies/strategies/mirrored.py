"""`MirroredStrategy`: synchronous data parallelism over the devices of one machine."""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

from keras_strategies.distribute.reduce_op import ReduceOp
from keras_strategies.backend.common.replica_variables import ReplicaWrites, outside_replica_scope
from keras_strategies.distribute import context, traced_function
from keras_strategies.backend.common import keras_state
from keras_strategies.distribute.values import PerReplica, map_structure, regroup, select_replica
from keras_strategies.backend import engine
from keras_strategies.distribute.cross_device_ops import CrossDeviceOps, select_cross_device_ops
from keras_strategies.distribute.devices import default_compute_devices, resolve_devices
from keras_strategies.distribute.strategy import Strategy, StrategyExtended


class MirroredExtended(StrategyExtended):
    # Every replica may keep a copy of each variable (a compiled Keras step on JAX keeps them on
    # the replicas' devices between steps); CentralStorage keeps one copy, on its parameter device.
    _replicas_keep_copies = True

    def __init__(self, container, devices: Sequence[str], cross_device_ops: Optional[CrossDeviceOps]):
        super().__init__(container, devices, place_variables=True)
        if cross_device_ops is not None and not isinstance(cross_device_ops, CrossDeviceOps):
            raise ValueError(
                f"cross_device_ops must be a ks.CrossDeviceOps (e.g. ks.ReductionToOneDevice()), "
                f"got {cross_device_ops!r}."
            )
        self._cross_device_ops = cross_device_ops or select_cross_device_ops(self._devices)
        # With the default choice, Keras steps sum gradients and loss inside the replica program
        # with the backend's own all-reduce; an explicit choice sums them after it.
        self._default_cross_device_ops = cross_device_ops is None

    def _sum_gradients(self, per_replica: list, destination: str) -> Any:
        """The replicas' gradients (one list per replica) summed after the replica program onto
        `destination` with the cross-device ops: the gradients `_apply_update` takes."""
        pairs = [(PerReplica(values), destination) for values in zip(*per_replica)]
        return self._cross_device_ops.batch_reduce(ReduceOp.SUM, pairs)

    def _custom_steps_untraceable(self) -> Optional[str]:
        if not self._replicas_keep_copies:
            return f"{type(self._container).__name__} keeps one copy of each variable, on its parameter device"
        return super()._custom_steps_untraceable()

    def _call_for_each_replica(self, fn, args, kwargs):
        if len(self._devices) == 1:
            return super()._call_for_each_replica(fn, args, kwargs)
        if traced_function.traced_strategy() is self._container:
            return self._call_in_traced_step(fn, args, kwargs)
        snapshot = keras_state.capture()
        strategy = self._container
        writes = self._replica_writes(self._devices)

        def replica(replica_id, *_):
            replica_context = context.ReplicaContext(strategy, replica_id, in_program=True)
            with keras_state.installed(snapshot), context.enter_frame(strategy, replica_context), \
                    writes.scope(replica_id):
                return fn(*select_replica(replica_id, args), **select_replica(replica_id, kwargs))

        run = engine.replicas.make_replicated(replica, self._devices, compiled=False, variables=self._scope_variables())
        results = run((), [() for _ in self._devices])
        self._combine_writes(writes)
        return regroup(results)

    def _call_in_traced_step(self, fn, args, kwargs):
        """`run` inside a step `ks.function` compiles as one program over the replicas' mesh: this
        device's replica runs inline, its writes are combined with the other replicas' in the program."""
        strategy = self._container
        writes = ReplicaWrites(self._devices[:1], lambda value, device: value, lambda value, primary: value, record=True)

        row_mask = traced_function.traced_row_mask()

        def replica(replica_id, *_):
            replica_context = context.ReplicaContext(strategy, replica_id, row_mask=row_mask, in_program=True)
            if row_mask is not None:
                replica_context._rows_left_out = set()
            with context.enter_frame(strategy, replica_context):
                with writes.scope(0):
                    output = fn(*select_replica(0, args), **select_replica(0, kwargs))
                if row_mask is not None and any(id(v) not in replica_context._rows_left_out for v in writes.written(0)):
                    traced_function.note_rows_enter("the replica function writes state from the rows")
                writes.combine(engine.replicas.combine_writes_in_program)
            return output

        run = engine.replicas.make_replicated(replica, self._devices, compiled=True)
        return regroup(run((), engine.replicas.StackedShards(())), arrays_stay_distributed=True)

    def _merge_call(self, replica_context, merge_fn, args, kwargs):
        if self.num_replicas_in_sync == 1:
            return super()._merge_call(replica_context, merge_fn, args, kwargs)
        # Even one local replica (of several workers) merges through the engine, which leaves
        # the backend's replica context (TensorFlow's optimizer needs its cross-replica context).
        strategy = self._container

        def merge(per_replica):
            merged_args, merged_kwargs = regroup(per_replica)
            with context.enter_frame(strategy, None), outside_replica_scope():
                return merge_fn(strategy, *merged_args, **merged_kwargs)

        return engine.replicas.merge_call(merge, (tuple(args), dict(kwargs)))

    def _local_all_reduce(self, replica_context, reduce_op, value):
        if len(self._devices) == 1:
            return value
        if not replica_context._in_program:
            raise NotImplementedError(
                "ReplicaContext.all_reduce needs the replicas to run together, inside "
                "strategy.run or a Keras step of this strategy."
            )

        leaves: list = []
        map_structure(leaves.append, value)
        totals = engine.replicas.all_reduce_sums(leaves)  # one call: cheaper on some engines than one per leaf
        if reduce_op == ReduceOp.MEAN:
            totals = [total / len(self._devices) for total in totals]
        found = iter(totals)
        return map_structure(lambda _: next(found), value)

    def _all_reduce(self, replica_context, reduce_op, value):
        return self._local_all_reduce(replica_context, reduce_op, value)

    def _all_gather(self, replica_context, value, axis):
        if len(self._devices) == 1:
            return value
        if not replica_context._in_program:
            raise NotImplementedError(
                "ReplicaContext.all_gather needs the replicas to run together, inside "
                "strategy.run or a Keras step of this strategy."
            )
        traced_function.note_rows_enter("an all_gather of the shard's rows", value)
        return map_structure(lambda leaf: engine.replicas.all_gather(leaf, axis), value)

    def _run_keras_method(self, name: str, method: Callable, model: Any, args: tuple, kwargs: dict) -> Any:
        if self.num_replicas_in_sync == 1:
            # Nothing to split or reduce: Keras' own compiled step, on the one device.
            return super()._run_keras_method(name, method, model, args, kwargs)
        from keras_strategies.trainer.loops import LOOPS

        with self._container.scope():
            return LOOPS[name](model, self._container, *args, **kwargs)


class MirroredStrategy(Strategy):
    """Synchronous training on several devices of one machine, as `tf.distribute.MirroredStrategy`.

    Each global batch is split across the replicas; gradients are summed
    and one identical update is applied, so training matches that of one
    device with the same global batch (up to floating-point rounding). The
    methods are those of `ks.Strategy`.

    With `cross_device_ops=None`, Keras' steps sum gradients and loss inside
    the replica step with the backend's own all-reduce (NCCL between GPUs); a
    `cross_device_ops` you pass sums them instead. `cross_device_ops` (when
    `None`, chosen as TensorFlow does: `NcclAllReduce` between GPUs, else
    `ReductionToOneDevice`) also averages the replicas' non-trainable values,
    such as BatchNormalization's statistics.

    Args:
        devices: Device names (`["gpu:0", "gpu:1"]`); `None` means every local
            accelerator, or every (virtual) CPU device when there is none.
        cross_device_ops: How gradients are summed between devices (a
            `ks.CrossDeviceOps`); `None` sums them in the replica step, as above.

    Examples:
        >>> strategy = ks.MirroredStrategy(["cpu:0", "cpu:1"])
        >>> strategy.num_replicas_in_sync
        2
        >>> with strategy.scope():
        ...     model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        ...     model.compile(optimizer="sgd", loss="mse")
        >>> history = model.fit(np.ones((8, 4)), np.ones((8, 1)), batch_size=4, verbose=0)  # 2 rows per replica
    """

    def __init__(self, devices: Optional[Sequence[str]] = None, cross_device_ops: Optional[CrossDeviceOps] = None):
        chosen = default_compute_devices() if devices is None else resolve_devices(devices)
        super().__init__(MirroredExtended(self, chosen, cross_device_ops))
