"""`strategy.reduce` and `strategy.gather` of per-replica values, on the host device.

A replica's values are summed on this worker, then across workers
(`workers.py`); `MEAN` divides by the replica count (or, along an axis, by the
number of elements). A mixin of `StrategyExtended` (`strategy.py`).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from keras import ops

from keras_strategies.backend import engine
from keras_strategies.distribute.reduce_op import ReduceOp
from keras_strategies.distribute.values import is_distributed


class HostReductions:
    """The reductions of `StrategyExtended` (see the module docstring)."""

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
