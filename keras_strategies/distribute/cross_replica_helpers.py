"""tf.distribute's cross-replica helpers of `strategy.extended`, which custom optimizers and loops use.

`reduce_to`, `batch_reduce_to`, `broadcast_to`, `update`, `value_container`,
`read_var` and `colocate_vars_with`, with `tf.distribute.StrategyExtended`'s
signatures. A mixin of `StrategyExtended` (`strategy.py`): it reads the
devices (`worker_devices`, `host_device`), `variable_created_in_scope` and
the reductions of `reductions.py`.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional, Sequence

from keras import ops

from keras_strategies.backend import engine
from keras_strategies.distribute import context
from keras_strategies.distribute.reduce_op import ReduceOp
from keras_strategies.distribute.values import DistributedValues, Mirrored, map_structure


class CrossReplicaHelpers:
    """The cross-replica helpers of `StrategyExtended` (see the module docstring)."""

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

    def reduce_to(self, reduce_op: ReduceOp | str, value: Any, destinations: Any, options: Any = None) -> Any:
        """`value` reduced across replicas (and workers), mirrored on `destinations`.

        Call it in cross-replica context (for example in a `merge_call` function);
        inside `strategy.run` use `ReplicaContext.all_reduce`.

        Args:
            reduce_op: `ks.ReduceOp.SUM` or `MEAN`, or `"sum"` / `"mean"`.
            value: A `PerReplica` value, or a tensor that is the same on every replica.
            destinations: A device name, a list of them, or a variable (a variable of
                this scope means every replica device).
            options: Accepted for compatibility; unused.

        Examples:
            >>> strategy = ks.MirroredStrategy(["cpu:0", "cpu:1"])
            >>> per_replica = strategy.run(lambda: keras.ops.ones((2,)))
            >>> total = strategy.extended.reduce_to("sum", per_replica, destinations="cpu:0")
            >>> keras.ops.convert_to_numpy(total).tolist()
            [2.0, 2.0]
        """
        self._check_cross_replica("reduce_to")
        return self._mirrored_to(self._reduce(ReduceOp.parse(reduce_op), value, None), destinations)

    def batch_reduce_to(self, reduce_op: ReduceOp | str, value_destination_pairs: Sequence[tuple],
                        options: Any = None) -> list:
        """`reduce_to` for each `(value, destinations)` pair; returns the results in order.

        Examples:
            >>> strategy = ks.MirroredStrategy(["cpu:0", "cpu:1"])
            >>> a, b = strategy.run(lambda: (keras.ops.ones(()), keras.ops.zeros(())))
            >>> [float(v) for v in strategy.extended.batch_reduce_to("sum", [(a, "cpu:0"), (b, "cpu:0")])]
            [2.0, 0.0]
        """
        return [self.reduce_to(reduce_op, value, destinations, options) for value, destinations in value_destination_pairs]

    def broadcast_to(self, tensor: Any, destinations: Any) -> Any:
        """`tensor` copied to each device of `destinations` (a `Mirrored` for several).

        Examples:
            >>> strategy = ks.MirroredStrategy(["cpu:0", "cpu:1"])
            >>> mirrored = strategy.extended.broadcast_to(keras.ops.ones(()), destinations=["cpu:0", "cpu:1"])
            >>> len(mirrored.values)
            2
        """
        return self._mirrored_to(tensor, destinations)

    def update(self, var: Any, fn: Callable, args: tuple = (), kwargs: Optional[dict] = None, group: bool = True) -> Any:
        """Runs `fn(var, *args, **kwargs)` once, in cross-replica context.

        A strategy's variable is one Keras variable, copied to the replicas at
        each step, so one update is enough; `Mirrored` arguments give their first copy.

        Examples:
            >>> strategy = ks.MirroredStrategy(["cpu:0", "cpu:1"])
            >>> with strategy.scope():
            ...     v = keras.Variable(1.0)
            >>> _ = strategy.extended.update(v, lambda var, delta: var.assign_add(delta), args=(2.0,))
            >>> float(v.numpy())
            3.0
        """
        self._check_cross_replica("update")
        first = lambda value: value.values[0] if isinstance(value, Mirrored) else value  # noqa: E731
        args, kwargs = map_structure(first, tuple(args)), map_structure(first, dict(kwargs or {}))
        return fn(var, *args, **kwargs)

    def value_container(self, value: Any) -> Any:
        """The distributed variable of `value`: a strategy's variables are their own container.

        Examples:
            >>> strategy = ks.MirroredStrategy(["cpu:0", "cpu:1"])
            >>> with strategy.scope():
            ...     v = keras.Variable(1.0)
            >>> strategy.extended.value_container(v) is v
            True
        """
        return value

    def read_var(self, var: Any) -> Any:
        """The variable's value in cross-replica context.

        Examples:
            >>> strategy = ks.MirroredStrategy(["cpu:0", "cpu:1"])
            >>> with strategy.scope():
            ...     v = keras.Variable(2.0)
            >>> float(keras.ops.convert_to_numpy(strategy.extended.read_var(v)))
            2.0
        """
        return var.value

    @contextlib.contextmanager
    def colocate_vars_with(self, colocate_with_variable: Any) -> Iterator[None]:
        """A scope whose new variables sit with `colocate_with_variable`.

        Every variable of a strategy already lives on its parameter devices, so
        this only checks that it is used inside the strategy's `scope()`.

        Examples:
            >>> strategy = ks.MirroredStrategy(["cpu:0", "cpu:1"])
            >>> with strategy.scope():
            ...     v = keras.Variable(1.0)
            ...     with strategy.extended.colocate_vars_with(v):
            ...         slot = keras.Variable(0.0)
        """
        if context.get_cross_replica_context() is not self._container:
            raise RuntimeError("`colocate_vars_with` must be used inside the strategy's `scope()`.")
        yield
