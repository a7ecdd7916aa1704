"""What every replica runs in a step, statelessly: the model's forward pass (and gradient) on its shard.

The engine runs these functions on all replicas together
(`engine.replicas.make_replicated`), with in-step collectives available
(synchronised BatchNormalization). Each replica's objective is weighted so that
summing over replicas gives exactly the single-device loss of the global batch
(see `replica_step.py`); the values a replica returns (gradients, loss,
predictions with their Keras masks, new non-trainable values) are combined on
the host by `global_update.py`.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Optional, Sequence

import keras
from keras import ops
from keras.src import backend as keras_backend
from keras.src import tree
from keras.src.backend.common import masking as keras_masking

from keras_strategies.backend import engine
from keras_strategies.backend.common import keras_state
from keras_strategies.distribute import context
from keras_strategies.distribute.reduce_op import ReduceOp
from keras_strategies.keras_integration import loss_reduction
from keras_strategies.trainer.shards import as_tensors


def _overrides_compute_loss(model: Any) -> bool:
    return getattr(type(model), "compute_loss", None) is not keras.Model.compute_loss


def _output_masks(y_pred: Any) -> dict:
    """The Keras masks of the outputs, by flat index: they leave the replica program beside the
    predictions (a tensor's mask attribute does not) and are set again for the metrics."""
    leaves = tree.flatten(y_pred)
    masks = {str(i): keras_masking.get_keras_mask(leaf) for i, leaf in enumerate(leaves)}
    return {key: mask for key, mask in masks.items() if mask is not None}


def with_masks(predictions: Any) -> Any:
    """`(y_pred, masks)` from a replica step: `y_pred` with its Keras masks set."""
    y_pred, masks = predictions
    leaves = tree.flatten(y_pred)
    for key, mask in masks.items():
        keras_masking.set_keras_mask(leaves[int(key)], mask)
    return y_pred


class ReplicaProgram:
    """The per-replica `train` / `test` / `predict` functions of `model` on `devices`.

    `reduce_in_program`: gradients and the loss are summed over this worker's
    replicas inside the program (the strategy's default cross-device ops).
    """

    def __init__(self, model: Any, strategy: Any, devices: Sequence[str], reduce_in_program: bool):
        self.model = model
        self.strategy = strategy
        self.devices = devices
        self.reduce_in_program = reduce_in_program
        # Replicas may run in threads (one at a time): Keras' thread-local settings follow them.
        self._keras_state: dict = {}
        # An engine that reports gradients as the backward pass computes them calls these
        # (`worker_exchange.OverlappedExchange`), set while a multi-worker train step runs.
        self.backward_hooks: Optional[Any] = None
        # Step kind -> whether padding rows would enter its objective (an `add_loss` term, a loss
        # function's own batch mean, an overridden `compute_loss`): known once it was traced.
        self.padding_enters: dict = {}

    def state(self, with_metrics: bool = True) -> tuple:
        """The variables' values the replicas take (and Keras' thread-local settings, captured now)."""
        model = self.model
        self._keras_state = keras_state.capture()
        state = ([v.value for v in model.trainable_variables], [v.value for v in model.non_trainable_variables])
        return state + ([v.value for v in model.metrics_variables],) if with_metrics else state

    @contextlib.contextmanager
    def _enter(self, replica_id: Any, mask: Any):
        replica_context = context.ReplicaContext(self.strategy, replica_id, row_mask=mask, in_program=True)
        with keras_state.installed(self._keras_state), context.enter_frame(self.strategy, replica_context), \
                engine.replicas.replica_device_scope(replica_id, self.devices):
            yield

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
        # `model.losses` lists `add_loss` terms first and weight regularisers last.
        count = sum(1 for v in model.trainable_weights if getattr(v, "regularizer", None) is not None)
        regularization = losses[len(losses) - count:] if count else []
        penalty = functools.reduce(ops.add, [model._aggregate_additional_loss(l) for l in regularization]) if regularization else 0.0
        kind = "train" if training else "test"
        self.padding_enters[kind] = self.padding_enters.get(kind, False) or bool(
            len(losses) > count or context.get_replica_context()._scalar_loss or _overrides_compute_loss(model)
        )
        weights = ops.cast(weights, keras.backend.standardize_dtype(total.dtype))  # a float64 model's loss too
        objective = (total - penalty) * weights[0] + penalty * weights[1]
        return objective * weights[2], (objective, (y_pred, _output_masks(y_pred)), new_non_trainable)

    def _local_sum(self, value: Any) -> Any:
        """Sum over this worker's replicas, inside the replica program."""
        return self.strategy.extended._local_all_reduce(context.get_replica_context(), ReduceOp.SUM, value)

    def train(self, replica_id, trainable, non_trainable, metrics, x, y, sample_weight, mask, weights):
        """`(grads, (loss, (y_pred, masks), new non-trainable values))` of one replica."""
        with self._enter(replica_id, mask):
            x, y, sample_weight = as_tensors((x, y, sample_weight))
            sample_weight = loss_reduction.enter_replica_loss(weights[0], as_tensors(mask), sample_weight)
            grad_fn = engine.gradients.value_and_grad(functools.partial(self._objective, training=True),
                                                      hooks=self.backward_hooks)
            (_, aux), grads = grad_fn(trainable, non_trainable, metrics, x, y, sample_weight, weights)
            if self.reduce_in_program:
                grads, loss = self._local_sum([list(grads), aux[0]])
                aux = (loss,) + tuple(aux[1:])
        return grads, aux

    def test(self, replica_id, trainable, non_trainable, metrics, x, y, sample_weight, mask, weights):
        """`(loss, (y_pred, masks), new non-trainable values)` of one replica."""
        with self._enter(replica_id, mask):
            x, y, sample_weight = as_tensors((x, y, sample_weight))
            sample_weight = loss_reduction.enter_replica_loss(weights[0], as_tensors(mask), sample_weight)
            _, aux = self._objective(trainable, non_trainable, metrics, x, y, sample_weight, weights, training=False)
            if self.reduce_in_program:
                aux = (self._local_sum(aux[0]),) + tuple(aux[1:])
        return aux

    def predict(self, replica_id, trainable, non_trainable, x, mask):
        """One replica's predictions."""
        with self._enter(replica_id, mask):
            x = as_tensors(x)
            kwargs = {"training": False} if self.model._call_has_training_arg else {}
            y_pred, _ = self.model.stateless_call(trainable, non_trainable, x, **kwargs)
        return y_pred
