"""One training, evaluation or prediction step of a Keras model, split across replicas.

Each replica runs the model's stateless forward pass (and gradient) on its
shard of the global batch, on its own device, compiled by the backend engine.
Its objective is weighted so that summing over replicas gives exactly the
single-device loss of the global batch, whatever the shard sizes:

    objective_i = data_loss_i * n_i / B + additional_losses / active_replicas

(`data_loss_i` is the compiled loss of shard i, a mean over its n_i samples;
regularisers and `add_loss` terms count once in total). Gradients are then
summed with the strategy's cross-device ops, clipped by the optimizer after
that sum, and applied once. Metrics are updated once, on the whole global
batch, so logs equal single-device logs.
"""

from __future__ import annotations

import functools
from typing import Any

from keras import ops
from keras.src import backend as keras_backend
from keras.src import tree
from keras.src.trainers.data_adapters import data_adapter_utils

from keras_strategies import context
from keras_strategies.backend import engine
from keras_strategies.batch_splitting import batch_size_of, shard_sizes, split_batch
from keras_strategies.reduce_op import ReduceOp
from keras_strategies.values import PerReplica


def _is_float(value: Any) -> bool:
    return "float" in str(value.dtype)


def _uses_sum_reduction(model: Any) -> bool:
    """True when every compiled loss sums (rather than averages) over the batch."""
    compile_loss = getattr(model, "_compile_loss", None)
    flat = getattr(compile_loss, "_flat_losses", None) or []
    reductions = {getattr(entry.loss, "reduction", None) for entry in flat}
    return reductions == {"sum"}


class ReplicaStep:
    """Runs `train` / `test` / `predict` steps of `model` on the strategy's replicas."""

    def __init__(self, model: Any, strategy: Any):
        self.model = model
        self.strategy = strategy
        self.devices = strategy.extended.worker_devices
        self.cross_device_ops = strategy.extended._cross_device_ops
        compile_fn = (lambda fn: fn) if model.run_eagerly else engine.compiler.compile_function
        self._train_fn = compile_fn(engine.gradients.value_and_grad(functools.partial(self._objective, training=True)))
        self._test_fn = compile_fn(functools.partial(self._objective, training=False))
        self._predict_fn = compile_fn(self._forward)

    # --- per-replica, stateless ------------------------------------------------
    def _forward(self, trainable, non_trainable, x):
        kwargs = {"training": False} if self.model._call_has_training_arg else {}
        y_pred, _ = self.model.stateless_call(trainable, non_trainable, x, **kwargs)
        return y_pred

    def _objective(self, trainable, non_trainable, metrics, x, y, sample_weight, weights, training):
        model = self.model
        kwargs = {"training": training} if model._call_has_training_arg else {}
        y_pred, new_non_trainable, losses = model.stateless_call(
            trainable, non_trainable, x, return_losses=True, **kwargs
        )
        mapping = list(zip(model.trainable_variables, trainable))
        mapping += list(zip(model.non_trainable_variables, new_non_trainable))
        mapping += list(zip(model.metrics_variables, metrics))
        if losses:
            model._losses_override = list(losses)
        try:
            with keras_backend.StatelessScope(state_mapping=mapping):
                total = model._compute_loss(x, y, y_pred, sample_weight=sample_weight, training=training)
        finally:
            if losses:
                model._losses_override = []
        additional = functools.reduce(ops.add, [model._aggregate_additional_loss(l) for l in losses]) if losses else 0.0
        data_weight, additional_weight, loss_scale = weights[0], weights[1], weights[2]
        objective = (total - additional) * data_weight + additional * additional_weight
        return objective * loss_scale, (objective, y_pred, new_non_trainable)

    # --- helpers -----------------------------------------------------------------
    def _shards(self, data: Any):
        x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
        batch = batch_size_of(x)
        sizes = shard_sizes(batch, len(self.devices))
        shards = split_batch((x, y, sample_weight), sizes)
        active = [i for i, size in enumerate(sizes) if size > 0]
        return (x, y, sample_weight), batch, sizes, shards, active

    def _on(self, device: str, structure: Any) -> Any:
        def move(leaf):
            if leaf is None:
                return None
            return engine.devices.copy_to(ops.convert_to_tensor(leaf), device)

        return tree.map_structure(move, structure)

    def _weights(self, size: int, batch: int, active: int, loss_scale: float):
        data_weight = 1.0 if _uses_sum_reduction(self.model) else size / batch
        return ops.convert_to_tensor([data_weight, 1.0 / active, loss_scale], "float32")

    def _sum_across_replicas(self, per_replica: list, destination: str) -> Any:
        """Sums lists of per-replica tensors with the strategy's cross-device ops."""
        pairs = [(PerReplica(values), destination) for values in zip(*per_replica)]
        return self.cross_device_ops.batch_reduce(ReduceOp.SUM, pairs)

    def _loss_scale(self) -> float:
        optimizer = self.model.optimizer
        if optimizer is None or not hasattr(optimizer, "scale_loss"):
            return 1.0
        return float(ops.convert_to_numpy(optimizer.scale_loss(ops.convert_to_tensor(1.0, "float32"))))

    def _run_replicas(self, fn, data, with_state):
        model = self.model
        (x, y, sample_weight), batch, sizes, shards, active = self._shards(data)
        trainable = [v.value for v in model.trainable_variables]
        non_trainable = [v.value for v in model.non_trainable_variables]
        metrics = [v.value for v in model.metrics_variables]
        loss_scale = self._loss_scale() if with_state else 1.0
        outputs = []
        for i in active:
            device = self.devices[i]
            replica_context = context.ReplicaContext(self.strategy, i)
            with context.enter_frame(self.strategy, replica_context), engine.devices.device_scope(device):
                args = self._on(device, (trainable, non_trainable, metrics) + tuple(shards[i]))
                weights = engine.devices.copy_to(self._weights(sizes[i], batch, len(active), loss_scale), device)
                outputs.append(fn(*args, weights))
        return (x, y, sample_weight), batch, active, outputs

    def _assign_non_trainable(self, per_replica: list) -> None:
        """New non-trainable values: mean over replicas for floats, replica 0 otherwise."""
        host = self.devices[0]
        for variable, values in zip(self.model.non_trainable_variables, zip(*per_replica)):
            aggregation = getattr(variable, "aggregation", "none")
            if _is_float(variable) and aggregation in ("mean", "none") and len(values) > 1:
                variable.assign(self.cross_device_ops.reduce(ReduceOp.MEAN, PerReplica(values), host))
            elif aggregation == "sum" and len(values) > 1:
                old = variable.value
                deltas = PerReplica([ops.subtract(v, engine.devices.copy_to(old, self.devices[0])) for v in values])
                variable.assign(ops.add(old, self.cross_device_ops.reduce(ReduceOp.SUM, deltas, host)))
            else:
                variable.assign(engine.devices.copy_to(values[0], host))

    def _concat_predictions(self, per_replica_predictions: list) -> Any:
        host = self.devices[0]
        if len(per_replica_predictions) == 1:
            return self._on(host, per_replica_predictions[0])
        return tree.map_structure(
            lambda *parts: ops.concatenate([engine.devices.copy_to(p, host) for p in parts], axis=0),
            *per_replica_predictions,
        )

    def _update_metrics(self, loss, x, y, y_pred, sample_weight, batch):
        model = self.model
        with engine.devices.device_scope(self.devices[0]):
            model._loss_tracker.update_state(loss, sample_weight=batch)
            return model.compute_metrics(x, y, y_pred, sample_weight)

    # --- steps -------------------------------------------------------------------
    def train_step(self, data: Any) -> dict:
        model = self.model
        (x, y, sample_weight), batch, active, outputs = self._run_replicas(self._train_fn, data, with_state=True)
        host = self.devices[0]
        grads = self._sum_across_replicas([grads for (_, _), grads in outputs], host)
        (loss,) = self._sum_across_replicas([[aux[0]] for (_, aux), _ in outputs], host)
        with engine.devices.device_scope(host):
            model.optimizer.apply(grads, model.trainable_variables)
        self._assign_non_trainable([aux[2] for (_, aux), _ in outputs])
        y_pred = self._concat_predictions([aux[1] for (_, aux), _ in outputs])
        return self._update_metrics(loss, x, y, y_pred, sample_weight, batch)

    def test_step(self, data: Any) -> dict:
        (x, y, sample_weight), batch, active, outputs = self._run_replicas(self._test_fn, data, with_state=False)
        host = self.devices[0]
        (loss,) = self._sum_across_replicas([[aux[0]] for _, aux in outputs], host)
        y_pred = self._concat_predictions([aux[1] for _, aux in outputs])
        return self._update_metrics(loss, x, y, y_pred, sample_weight, batch)

    def predict_step(self, data: Any) -> Any:
        model = self.model
        x, _, _ = data_adapter_utils.unpack_x_y_sample_weight(data)
        batch = batch_size_of(x)
        sizes = shard_sizes(batch, len(self.devices))
        trainable = [v.value for v in model.trainable_variables]
        non_trainable = [v.value for v in model.non_trainable_variables]
        outputs = []
        for i, shard in enumerate(split_batch(x, sizes)):
            if sizes[i] == 0:
                continue
            device = self.devices[i]
            with context.enter_frame(self.strategy, context.ReplicaContext(self.strategy, i)), engine.devices.device_scope(device):
                outputs.append(self._predict_fn(*self._on(device, (trainable, non_trainable, shard))))
        return self._concat_predictions(outputs)
