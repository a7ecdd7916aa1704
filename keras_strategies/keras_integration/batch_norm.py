"""BatchNormalization inside multi-replica steps: masked and synchronised batch statistics.

Replica shards may carry padding rows (equal shapes for SPMD, or a placeholder
row for an empty replica); their statistics must ignore them. With
`synchronized=True` the statistics are those of the whole global batch, summed
over replicas with the strategy's collectives, on every backend (Keras itself
synchronises only on TensorFlow), across workers too under
MultiWorkerMirroredStrategy. Outside a multi-replica step Keras' own code
runs unchanged, and outside every strategy scope `synchronized=True` meets
Keras' own check (`ks.layers.SyncBatchNormalization` is the layer that
synchronises wherever it is built).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from keras import ops

from keras_strategies.distribute import context
from keras_strategies.backend import engine
from keras_strategies.backend.common import patches
from keras_strategies.backend.common.replica_variables import weigh_writes
from keras_strategies.keras_integration.row_mask import spread_rows


def _global_sum(replica_context: Any, values: list) -> list:
    """Sums over every replica of every worker (differentiable, also in a model's own `train_step`)."""
    extended = replica_context.strategy.extended
    return replica_context._differentiable(lambda v: extended._synchronized_sum(replica_context, v), values)


def _replica_moments(layer: Any, inputs: Any, mask: Any, replica_context: Any, synchronized: bool):
    dtype = "float32" if str(inputs.dtype) in ("float16", "bfloat16") else inputs.dtype
    values = ops.cast(inputs, dtype)
    weights = spread_rows(replica_context._row_mask, values, dtype) if replica_context._row_mask is not None else ops.ones_like(values)
    if mask is not None:
        weights = weights * ops.cast(ops.broadcast_to(ops.expand_dims(mask, -1), ops.shape(values)), dtype)
    axes = layer._reduction_axes
    total = ops.sum(values * weights, axes, keepdims=True)
    count = ops.sum(weights, axes, keepdims=True)
    if synchronized:
        total, count = _global_sum(replica_context, [total, count])
    count = ops.maximum(count, ops.ones_like(count))  # an all-padding shard: no NaN
    mean = total / count
    squares = ops.sum(ops.square((values - mean) * weights), axes, keepdims=True)
    if synchronized:
        (squares,) = _global_sum(replica_context, [squares])
    variance = squares / count
    return ops.cast(ops.squeeze(mean), inputs.dtype), ops.cast(ops.squeeze(variance), inputs.dtype)


def _wrap_moments(original: Callable) -> Callable:
    @functools.wraps(original)
    def _moments(self, inputs, mask):
        replica_context = context.get_replica_context()
        in_program = replica_context is not None and replica_context._in_program
        if in_program and (replica_context._row_mask is not None or self.synchronized):
            replica_context._leaves_rows_out([self.moving_mean, self.moving_variance])
            synchronized = self.synchronized and replica_context.num_replicas_in_sync > 1
            if not synchronized and replica_context._row_mask is not None:
                # A replica whose shard is all padding does not count in the mean of the statistics.
                weigh_writes([self.moving_mean, self.moving_variance],
                             lambda: ops.cast(ops.greater(ops.sum(replica_context._row_mask), 0), "float32"))
            return _replica_moments(self, inputs, mask, replica_context, synchronized)
        if replica_context is not None and replica_context.num_replicas_in_sync > 1:
            # Own statistics per replica, averaged into the moving ones at the end of the run:
            # a replica with an empty shard (whose statistics are NaN) does not count.
            weigh_writes([self.moving_mean, self.moving_variance],
                         lambda: ops.cast(ops.greater(ops.shape(inputs)[0], 0), "float32"))
            if inputs.shape[0] == 0:
                # Keras' statistics of no rows are NaN (0 / 0), and the normalisation's gradient
                # for `gamma` multiplies the mean by a sum of no rows: NaN * 0 would reach the update.
                return _replica_moments(self, inputs, mask, replica_context, synchronized=False)
        if self.synchronized and not engine.capabilities.native_sync_batch_norm:
            # One replica: the global statistics are the local ones.
            self.synchronized = False
            try:
                return original(self, inputs, mask)
            finally:
                self.synchronized = True
        return original(self, inputs, mask)

    return _moments


def _wrap_init(original: Callable) -> Callable:
    # Not `functools.wraps`: Keras inspects `__init__` for its auto-config and must see
    # this function's own signature, not the wrapped one.
    def __init__(self, *args, synchronized=False, **kwargs):
        if synchronized and not context.has_strategy():
            # Outside every strategy: Keras' own behaviour (off TensorFlow it refuses the argument;
            # `ks.layers.SyncBatchNormalization` synchronises anywhere).
            return original(self, *args, synchronized=synchronized, **kwargs)
        # In a strategy's scope this package provides synchronized=True on every backend.
        original(self, *args, synchronized=False, **kwargs)
        self.synchronized = synchronized

    __init__.__doc__ = original.__doc__
    return __init__


_BN = "keras.src.layers.normalization.batch_normalization.BatchNormalization"
_INIT = patches.declare(f"{_BN}.__init__", "`synchronized=True` inside a strategy's scope on every backend "
                        "(outside every scope Keras' own check runs)")
_MOMENTS = patches.declare(f"{_BN}._moments", "batch statistics leave padding rows out and are synchronised "
                           "across replicas")


def install() -> None:
    """Installs the BatchNormalization hooks (idempotent)."""
    _MOMENTS.apply(_wrap_moments)
    _INIT.apply(_wrap_init)
