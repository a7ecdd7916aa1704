"""What follows the replicas in a step, on the host device: one update and metrics of the global batch.

The replicas' gradients and loss are summed (in the replica program, or with
the strategy's `cross_device_ops`), clipped by the optimizer after that sum and
applied once; the metrics are updated once, on the whole global batch (its
predictions concatenated from the replicas' real rows), so logs equal
single-device logs; the replicas' non-trainable values are averaged.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import keras
import numpy as np
from keras import ops
from keras.src import tree

from keras_strategies.backend import engine
from keras_strategies.distribute.reduce_op import ReduceOp
from keras_strategies.distribute.values import PerReplica
from keras_strategies.keras_integration import optimizer_hooks
from keras_strategies.trainer.replica_program import with_masks
from keras_strategies.trainer.shards import Shards, as_tensors


def _is_float(value: Any) -> bool:
    return "float" in str(value.dtype)


class GlobalUpdate:
    """The host side of `model`'s steps under `strategy`: reductions, the update, the metrics."""

    def __init__(self, model: Any, strategy: Any):
        self.model = model
        self.host = strategy.extended._variable_device  # where variables live and updates run
        self.cross_device_ops = strategy.extended._cross_device_ops
        self._apply_update = strategy.extended._apply_update
        self._sum_gradients = strategy.extended._sum_gradients
        self._compiled_metrics = None

    def on_host(self, value: Any) -> Any:
        """A replica's value on the first local device, where the update and the metrics run."""
        return engine.devices.copy_to(value, self.host)

    def reduce(self, reduce_op: ReduceOp, per_replica: list) -> list:
        """Reduces lists of per-replica tensors to the primary device with the cross-device ops."""
        pairs = [(PerReplica(values), self.host) for values in zip(*per_replica)]
        return self.cross_device_ops.batch_reduce(reduce_op, pairs)

    def sum_gradients(self, per_replica: list) -> Any:
        """The replicas' gradients summed after the replica program, as the strategy's update takes them."""
        return self._sum_gradients(per_replica, self.host)

    def sums_of_first_replica(self, outputs: list) -> tuple:
        """`(grads, loss)` summed in the replica program: every replica holds them, the first's are taken."""
        return [self.on_host(g) for g in outputs[0][0]], self.on_host(outputs[0][1][0])

    def assign_non_trainable(self, per_replica: list, in_program: bool = False) -> None:
        """New non-trainable values: the mean over replicas with data for floats, replica 0 otherwise.

        Reduced with the strategy's cross-device ops, or `in_program` (inside a
        compiled whole step, where every device holds every replica's values)
        with the same sum in replica order as `ReductionToOneDevice`.
        """
        host = self.host

        def reduce(reduce_op: ReduceOp, values: Sequence[Any]) -> Any:
            if not in_program:
                return self.cross_device_ops.reduce(reduce_op, PerReplica(values), host)
            total = functools.reduce(engine.gradients.add, values)
            return ops.divide(total, ops.cast(len(values), total.dtype)) if reduce_op == ReduceOp.MEAN else total

        for variable, values in zip(self.model.non_trainable_variables, zip(*per_replica)):
            aggregation = getattr(variable, "aggregation", "none")
            if len(values) > 1 and _is_float(variable) and aggregation in ("mean", "none"):
                variable.assign(reduce(ReduceOp.MEAN, values))
            elif len(values) > 1 and aggregation == "sum":
                old = engine.devices.copy_to(variable.value, host)
                deltas = [ops.subtract(engine.devices.copy_to(v, host), old) for v in values]
                variable.assign(ops.add(old, reduce(ReduceOp.SUM, deltas)))
            else:
                variable.assign(engine.devices.copy_to(values[0], host))

    def global_predictions(self, sizes: tuple, per_replica_predictions: list) -> Any:
        """The replicas' predictions of their real rows (`sizes`), concatenated on the host device.

        `sizes` may instead say only whether each replica has rows (booleans), for shards without
        padding: each of those replicas' predictions is then taken whole, its rows unknown in a trace.
        """

        def real_rows(prediction: Any, size: Any) -> Any:  # no slicing op for a shard without padding
            if size is True:
                return self.on_host(prediction)
            rows = prediction if prediction.shape[0] == size else prediction[:size]
            return engine.compiler.with_rows(self.on_host(rows), size)

        parts = [
            tree.map_structure(lambda p: real_rows(p, size), per_replica_predictions[i])
            for i, size in enumerate(sizes) if size
        ]
        if len(parts) == 1:
            return parts[0]
        return tree.map_structure(lambda *leaves: ops.concatenate(leaves, axis=0), *parts)

    def global_batch(self, shards: Shards) -> tuple:
        """`(rows, x, y, sample_weight)` of the global batch as tensors on the host device
        (user metrics may mix them with tensors)."""
        return self.batch_tensors(self.batch_arrays(shards))

    def batch_arrays(self, shards: Shards) -> tuple:
        """`(rows, x, y, sample_weight)` of the global batch as they were read (NumPy): what a
        step compiled as a whole takes, to send to its devices in one transfer. Without the
        inputs (None) unless the model's own `compute_metrics` may read them: Keras' ignores them."""
        x = shards.x if type(self.model).compute_metrics is not keras.Model.compute_metrics else None
        return (np.array(float(shards.batch), "float32"), x, shards.y, shards.sample_weight)

    def batch_tensors(self, batch: tuple) -> tuple:
        with engine.devices.device_scope(self.host):
            return as_tensors(batch)

    def _metrics_update(self, loss, batch, x, y, predictions, sample_weight):
        model = self.model
        y_pred = with_masks(predictions)  # masked outputs count as in Keras' own step
        model._loss_tracker.update_state(loss, sample_weight=batch)
        compile_loss = getattr(model, "_compile_loss", None)
        if compile_loss is not None and compile_loss.metrics:
            # A model with several outputs also logs each output's loss (`<name>_loss`): Keras
            # updates those trackers inside the compiled loss, whose updates the replicas
            # discard, so they are updated here, on the global batch, as on one device.
            compile_loss(y, y_pred, sample_weight)
        return model.compute_metrics(x, y, y_pred, sample_weight)

    def update_metrics(self, batch: tuple, loss: Any, predictions: Any) -> dict:
        """Updates the metrics once on the global batch (`global_batch`), compiled as in Keras'
        own steps; `predictions` is `(y_pred, output masks)`."""
        model = self.model
        if self._compiled_metrics is None:
            compile_fn = (lambda fn, _: fn) if model.run_eagerly else engine.compiler.compile_stateful
            self._compiled_metrics = compile_fn(self._metrics_update, model.metrics_variables)
        rows, x, y, sample_weight = batch
        with engine.devices.device_scope(self.host):
            return self._compiled_metrics(loss, rows, x, y, predictions, sample_weight)

    def apply_and_measure(self, grads: list, loss: Any, predictions: Any, batch: tuple) -> dict:
        """Applies the summed gradients once, then updates the metrics on the global batch."""
        model = self.model
        with engine.devices.device_scope(self.host), optimizer_hooks.direct_update():
            self._apply_update(model.optimizer, grads, model.trainable_variables)
        return self.update_metrics(batch, loss, predictions)
