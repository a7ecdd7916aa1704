"""One training, evaluation or prediction step of a Keras model, split across replicas.

All replicas run the same function together through the backend's replica
engine (`engine.replicas`): the model's stateless forward pass (and gradient)
on the replica's shard, with in-step collectives available (synchronised
BatchNormalization). Each replica's objective is weighted so that summing over
replicas gives exactly the single-device loss of the global batch:

    objective_i = (data_loss_i + add_loss_terms_i) * rows_i / B + weight_regularizers / num_replicas

(`data_loss_i` is the compiled loss of the shard, a mean over its `rows_i`
rows, or whatever each loss's reduction makes exact once weighted, see
`loss_reduction.py`; padding rows, copies of real rows (`input/padding.py`),
carry sample weight 0, the row mask when there are no user weights; weight regularisers count once in total; `add_loss`
terms are taken as per-batch means, so constants and means are exact, while a
term that *sums* over the batch is scaled by the shard's share). No weight
reaches padding rows in an `add_loss` term, a loss function's own batch mean or
an overridden `compute_loss`: where the engine pads uneven shards to one shape
(JAX), a model with such terms runs its uneven steps eagerly, unpadded.
Gradients (and the loss) are summed across replicas, clipped by the optimizer
after that sum, and applied once: inside the replica program with the engine's
all-reduce (`engine.replicas.all_reduce_sum`, NCCL between GPUs) when the
strategy uses its default cross-device ops, else after the program with the
`cross_device_ops` the user chose. The replicas' non-trainable values are
averaged with the strategy's `cross_device_ops` either way. Metrics are updated
once, on the whole global batch, so logs equal single-device logs.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Any, Callable, Optional, Sequence

import keras
import numpy as np
from keras import ops
from keras.src import backend as keras_backend
from keras.src.backend.common import masking as keras_masking
from keras.src import tree
from keras.src.optimizers.loss_scale_optimizer import LossScaleOptimizer
from keras.src.trainers.data_adapters import data_adapter_utils

from keras_strategies.distribute import context
from keras_strategies.backend.common import keras_state
from keras_strategies.keras_integration import loss_reduction
from keras_strategies.keras_integration import optimizer_hooks
from keras_strategies.backend import engine
from keras_strategies.input import padding, worker_sharding
from keras_strategies.trainer import cross_worker, gradient_buckets
from keras_strategies.trainer.cross_worker import STOPPED
from keras_strategies.trainer.exchange_in_program import ExchangeInProgram
from keras_strategies.input.splitting import batch_size_of, shard_sizes, split_batch
from keras_strategies.distribute.reduce_op import ReduceOp
from keras_strategies.distribute.values import PerReplica


def _is_float(value: Any) -> bool:
    return "float" in str(value.dtype)


def as_tensors(structure: Any) -> Any:
    """The leaves of a shard as backend tensors, as Keras' own trainers hand them to a step.

    Shards are cut as NumPy arrays; a model's `call` may mix its inputs with
    tensors (`r - x` in an autoencoder's `add_loss`), which fails on PyTorch
    with a NumPy `x`. Inside a compiled replica program they already are tensors.
    """
    return tree.map_structure(lambda leaf: None if leaf is None else ops.convert_to_tensor(leaf), structure)


def _overrides_compute_loss(model: Any) -> bool:
    return getattr(type(model), "compute_loss", None) is not keras.Model.compute_loss


def _output_masks(y_pred: Any) -> dict:
    """The Keras masks of the outputs, by flat index: they leave the replica program beside the
    predictions (a tensor's mask attribute does not) and are set again for the metrics."""
    leaves = tree.flatten(y_pred)
    masks = {str(i): keras_masking.get_keras_mask(leaf) for i, leaf in enumerate(leaves)}
    return {key: mask for key, mask in masks.items() if mask is not None}


def _with_masks(predictions: Any) -> Any:
    """`(y_pred, masks)` from a replica step: `y_pred` with its Keras masks set."""
    y_pred, masks = predictions
    leaves = tree.flatten(y_pred)
    for key, mask in masks.items():
        keras_masking.set_keras_mask(leaves[int(key)], mask)
    return y_pred


class Shards:
    """A global batch cut into per-replica shards, padded where the engine needs it."""

    def __init__(self, data: Any, num_replicas: int, with_targets: bool, num_workers: int = 1, worker_index: int = 0,
                 worker_rows: Any = None, equal_shapes: Optional[bool] = None, min_rows: int = 0):
        data = tree.map_structure(lambda leaf: None if leaf is None else engine.replicas.batch_leaf(leaf), data)
        if with_targets:
            self.x, self.y, self.sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
        else:
            self.x, self.y, self.sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)[0], None, None
        # `worker_rows`: per-worker input, where `data` holds this worker's rows only and
        # `worker_rows[i]` is worker i's batch size (the global batch is their concatenation).
        self.global_input = worker_rows is None
        if self.global_input:
            self.batch = batch_size_of(self.x)
            # The global batch is split over every replica of every worker; this worker takes
            # the consecutive shards of its own replicas, rows [offset, offset + local_rows).
            all_sizes = shard_sizes(self.batch, num_replicas * num_workers)
            self.offset = sum(all_sizes[:worker_index * num_replicas])
        else:
            self.batch = int(sum(worker_rows))
            all_sizes = [size for rows in worker_rows for size in shard_sizes(int(rows), num_replicas)]
            self.offset = int(sum(worker_rows[:worker_index]))
        self.sizes = all_sizes[worker_index * num_replicas:(worker_index + 1) * num_replicas]
        # Static shapes (TPUStrategy): every shard padded to at least `min_rows` rows, so that a partial
        # last batch has the shape of the full ones. Padded to one shape, shards then get padding rows
        # when their sizes differ or fall short of `min_rows`: `uneven` (the same on every worker, so
        # every worker takes the same path through a step).
        self.min_rows = min_rows
        self.uneven = len(set(all_sizes)) > 1 or min_rows > max(all_sizes, default=0)
        self.local_rows = sum(self.sizes)
        local = (self.x, self.y, self.sample_weight)
        if num_workers > 1 and self.global_input:
            local = tree.map_structure(
                lambda leaf: None if leaf is None else leaf[self.offset:self.offset + self.local_rows], local
            )
        self.local = local  # this worker's rows, unpadded
        self.cut(engine.capabilities.equal_shards if equal_shapes is None else equal_shapes)

    def cut(self, equal_shapes: bool) -> None:
        """Cuts `per_replica`: padded to one shape (`equal_shapes`) or each at its own size."""
        if equal_shapes:
            self.rows = [max(max(self.sizes), 1, self.min_rows)] * len(self.sizes)
        else:
            self.rows = [max(size, 1) for size in self.sizes]  # an empty replica runs one padding row
        self.padded = self.rows != self.sizes
        pieces = split_batch(self.local, self.sizes)
        source = padding.source_rows((self.x, self.y)) if self.padded else None
        self.per_replica = []
        for (x, y, weight), size, rows in zip(pieces, self.sizes, self.rows):
            mask = None
            if self.padded:
                mask = np.zeros((rows,), "float32")
                mask[:size] = 1.0
                x, y = padding.pad_with_copies((x, y), rows, source)
                weight = padding.pad_with_zeros(weight, rows)
            self.per_replica.append((x, y, weight, mask))

    @property
    def active(self) -> list[int]:
        return replicas_with_rows(self.sizes)

    def unpad(self, replica_id: int, structure: Any) -> Any:
        size = self.sizes[replica_id]
        return tree.map_structure(lambda leaf: leaf[:size], structure)


def replicas_with_rows(sizes: Sequence[int]) -> list[int]:
    """The replicas that got rows of the batch (one without rows runs a padding row)."""
    return [i for i, size in enumerate(sizes) if size > 0]


def make_shards(strategy: Any, data: Any, num_local: int, with_targets: bool,
                equal_shapes: Optional[bool] = None, min_rows: int = 0) -> Shards:
    """This worker's shards of a global batch (of its own batch, with per-worker input), padded to
    one shape if `equal_shapes` (default: where the engine needs it), of at least `min_rows` rows."""
    extended = strategy.extended
    worker_rows = None
    if worker_sharding.active():  # per-worker input: the workers tell each other their batch sizes
        rows = np.zeros((extended._num_workers,), "float32")
        rows[extended._worker_index] = batch_size_of(data_adapter_utils.unpack_x_y_sample_weight(data)[0])
        (rows,) = extended._cross_worker_sum([rows], "batch sizes of per-worker input")
        worker_rows = [int(round(float(r))) for r in ops.convert_to_numpy(rows)]
    return Shards(data, num_local, with_targets, extended._num_workers, extended._worker_index, worker_rows,
                  equal_shapes, min_rows)


def step_variables(model: Any) -> list:
    """Every variable a whole step reads or assigns: the model's, the optimizer's, the metrics'."""
    optimizer = getattr(model, "optimizer", None)
    variables = list(model.trainable_variables) + list(model.non_trainable_variables)
    variables += list(optimizer.variables) if optimizer is not None else []
    seen: set = set()
    return [v for v in variables + list(model.metrics_variables) if not (id(v) in seen or seen.add(id(v)))]


class ReplicaStep:
    """Runs `train` / `test` / `predict` steps of `model` on the strategy's replicas."""

    def __init__(self, model: Any, strategy: Any):
        self.model = model
        self.strategy = strategy
        self.devices = strategy.extended.worker_devices
        self.host = strategy.extended._variable_device  # where variables live and updates run
        self.cross_device_ops = strategy.extended._cross_device_ops
        self.reduce_in_program = getattr(strategy.extended, "_default_cross_device_ops", False)
        self.num_workers = strategy.extended._num_workers
        self._compiled = compiled = not model.run_eagerly
        # Static shapes (TPUStrategy): the compiled programs' shards have the per-replica rows of the
        # largest batch so far, on every engine (eager steps take each shard at its own size).
        self._static_shapes = compiled and strategy.extended.experimental_require_static_shapes
        self._static_rows: dict = {}  # step kind -> rows of every shard
        # Replicas may run in threads (one at a time): Keras' thread-local settings follow them.
        self._keras_state: dict = {}
        self._compiled_metrics = None
        self._compiled_steps: dict = {}  # step kind -> the whole step, compiled (`_compiled_step`)
        self._unsettled = False  # whether a whole step ran since the last `settle`
        self._rows_capacity = 0  # rows of the exchanged prediction buffers, the same on every worker
        self._backward_hooks: Optional[_OverlappedExchange] = None  # the train step's, while its replica runs
        self._bucket_layouts: dict = {}  # bytes per bucket -> the gradients' buckets
        self._exchange_in_program = ExchangeInProgram(self)  # several workers, where the engine can
        make = functools.partial(engine.replicas.make_replicated, devices=self.devices, compiled=compiled)
        self._train = make(self._replica_train)
        self._test = make(self._replica_test)
        self._predict = make(self._replica_predict)
        # An engine whose compiled programs need one shard shape (JAX) pads uneven shards with rows
        # of weight 0. Terms those weights cannot reach (an `add_loss` term, a loss function's own
        # batch mean, an overridden `compute_loss`) would count the padding rows, so a model with
        # such terms runs its steps on uneven shards eagerly, each shard at its own size.
        self._uneven_runs: dict = {}
        if compiled and (engine.capabilities.equal_shards or self._static_shapes):
            eager = functools.partial(engine.replicas.make_replicated, devices=self.devices, compiled=False)
            self._uneven_runs = {"train": eager(self._replica_train), "test": eager(self._replica_test)}
        self._padding_enters: dict = {}  # step kind -> whether padding rows would enter its objective
        self._largest_batch, self._warned_eager = 0, False
        self._checked_inputs: set = set()

    # --- what every replica runs (stateless) ----------------------------------------
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
        self._padding_enters[kind] = self._padding_enters.get(kind, False) or bool(
            len(losses) > count or context.get_replica_context()._scalar_loss or _overrides_compute_loss(model)
        )
        weights = ops.cast(weights, keras.backend.standardize_dtype(total.dtype))  # a float64 model's loss too
        objective = (total - penalty) * weights[0] + penalty * weights[1]
        return objective * weights[2], (objective, (y_pred, _output_masks(y_pred)), new_non_trainable)

    def _local_sum(self, value: Any) -> Any:
        """Sum over this worker's replicas, inside the replica program."""
        return self.strategy.extended._local_all_reduce(context.get_replica_context(), ReduceOp.SUM, value)

    def _replica_train(self, replica_id, trainable, non_trainable, metrics, x, y, sample_weight, mask, weights):
        with self._enter(replica_id, mask):
            x, y, sample_weight = as_tensors((x, y, sample_weight))
            sample_weight = loss_reduction.enter_replica_loss(weights[0], as_tensors(mask), sample_weight)
            grad_fn = engine.gradients.value_and_grad(functools.partial(self._objective, training=True),
                                                      hooks=self._backward_hooks)
            (_, aux), grads = grad_fn(trainable, non_trainable, metrics, x, y, sample_weight, weights)
            if self.reduce_in_program:
                grads, loss = self._local_sum([list(grads), aux[0]])
                aux = (loss,) + tuple(aux[1:])
        return grads, aux

    def _replica_test(self, replica_id, trainable, non_trainable, metrics, x, y, sample_weight, mask, weights):
        with self._enter(replica_id, mask):
            x, y, sample_weight = as_tensors((x, y, sample_weight))
            sample_weight = loss_reduction.enter_replica_loss(weights[0], as_tensors(mask), sample_weight)
            _, aux = self._objective(trainable, non_trainable, metrics, x, y, sample_weight, weights, training=False)
            if self.reduce_in_program:
                aux = (self._local_sum(aux[0]),) + tuple(aux[1:])
        return aux

    def _replica_predict(self, replica_id, trainable, non_trainable, x, mask):
        with self._enter(replica_id, mask):
            x = as_tensors(x)
            kwargs = {"training": False} if self.model._call_has_training_arg else {}
            y_pred, _ = self.model.stateless_call(trainable, non_trainable, x, **kwargs)
        return y_pred

    # --- cross-replica helpers ----------------------------------------------------------
    def _state(self, with_metrics: bool = True) -> tuple:
        model = self.model
        self._keras_state = keras_state.capture()
        state = ([v.value for v in model.trainable_variables], [v.value for v in model.non_trainable_variables])
        return state + ([v.value for v in model.metrics_variables],) if with_metrics else state

    def _loss_scale(self) -> float:
        """What Keras' own step multiplies the loss by (`optimizer.scale_loss`) before differentiating:
        a `LossScaleOptimizer`'s dynamic scale or an optimizer's `loss_scale_factor`, which
        `apply` divides out of the gradients again."""
        optimizer = self.model.optimizer
        if not isinstance(optimizer, LossScaleOptimizer) and getattr(optimizer, "loss_scale_factor", None) is None:
            return 1.0  # no blocking read of a constant 1 every step
        return float(ops.convert_to_numpy(optimizer.scale_loss(ops.convert_to_tensor(1.0, "float32"))))

    def _weights(self, shards: Shards, loss_scale: float) -> list:
        """Per replica: its share of the batch (0 without real rows, so that `add_loss` terms of a
        padding row count nowhere), the share of the weight regularisers, the loss scale."""
        return [
            np.array([rows / shards.batch if size else 0.0, 1.0 / self.strategy.num_replicas_in_sync, loss_scale], "float32")
            for rows, size in zip(shards.rows, shards.sizes)
        ]

    def _reduce(self, reduce_op: ReduceOp, per_replica: list) -> list:
        """Reduces lists of per-replica tensors to the primary device with the cross-device ops."""
        pairs = [(PerReplica(values), self.host) for values in zip(*per_replica)]
        return self.cross_device_ops.batch_reduce(reduce_op, pairs)

    def _assign_non_trainable(self, per_replica: list, in_program: bool = False) -> None:
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

    def _global_predictions(self, sizes: tuple, per_replica_predictions: list) -> Any:
        """The replicas' predictions of their real rows (`sizes`), concatenated on the host device."""

        def real_rows(prediction: Any, size: int) -> Any:  # no slicing op for a shard without padding
            rows = prediction if prediction.shape[0] == size else prediction[:size]
            return engine.compiler.with_rows(self._on_host(rows), size)

        parts = [
            tree.map_structure(lambda p: real_rows(p, size), per_replica_predictions[i])
            for i, size in enumerate(sizes) if size
        ]
        if len(parts) == 1:
            return parts[0]
        return tree.map_structure(lambda *leaves: ops.concatenate(leaves, axis=0), *parts)

    def _metrics_update(self, loss, batch, x, y, predictions, sample_weight):
        model = self.model
        y_pred = _with_masks(predictions)  # masked outputs count as in Keras' own step
        model._loss_tracker.update_state(loss, sample_weight=batch)
        compile_loss = getattr(model, "_compile_loss", None)
        if compile_loss is not None and compile_loss.metrics:
            # A model with several outputs also logs each output's loss (`<name>_loss`): Keras
            # updates those trackers inside the compiled loss, whose updates the replicas
            # discard, so they are updated here, on the global batch, as on one device.
            compile_loss(y, y_pred, sample_weight)
        return model.compute_metrics(x, y, y_pred, sample_weight)

    def _global_batch(self, shards: Shards) -> tuple:
        """`(rows, x, y, sample_weight)` of the global batch as tensors on the host device
        (user metrics may mix them with tensors)."""
        return self._batch_tensors(self._batch_arrays(shards))

    def _batch_arrays(self, shards: Shards) -> tuple:
        """`(rows, x, y, sample_weight)` of the global batch as they were read (NumPy): what a
        step compiled as a whole takes, to send to its devices in one transfer. Without the
        inputs (None) unless the model's own `compute_metrics` may read them: Keras' ignores them."""
        x = shards.x if type(self.model).compute_metrics is not keras.Model.compute_metrics else None
        return (np.array(float(shards.batch), "float32"), x, shards.y, shards.sample_weight)

    def _batch_tensors(self, batch: tuple) -> tuple:
        with engine.devices.device_scope(self.host):
            return as_tensors(batch)

    def _update_metrics(self, batch: tuple, loss: Any, predictions: Any) -> dict:
        """Updates the metrics once on the global batch (`_global_batch`), compiled as in Keras'
        own steps; `predictions` is `(y_pred, output masks)`."""
        model = self.model
        if self._compiled_metrics is None:
            compile_fn = (lambda fn, _: fn) if model.run_eagerly else engine.compiler.compile_stateful
            self._compiled_metrics = compile_fn(self._metrics_update, model.metrics_variables)
        rows, x, y, sample_weight = batch
        with engine.devices.device_scope(self.host):
            return self._compiled_metrics(loss, rows, x, y, predictions, sample_weight)

    # --- steps ----------------------------------------------------------------------------
    def _shards(self, data: Any, kind: str) -> Shards:
        with_targets = kind != "predict"
        # Eager replica threads take shards of any shapes; compiled programs, what the engine needs;
        # static shapes, the per-replica rows of the largest batch so far.
        if self._static_shapes:
            batch = batch_size_of(data_adapter_utils.unpack_x_y_sample_weight(data)[0])
            # `data` is the global batch, split over every worker's replicas (or, with per-worker
            # input, this worker's own batch, split over its replicas).
            replicas = len(self.devices) if worker_sharding.active() else self.strategy.num_replicas_in_sync
            rows = self._static_rows[kind] = max(self._static_rows.get(kind, 0), -(-batch // replicas))
            shards = make_shards(self.strategy, data, len(self.devices), with_targets, True, rows)
        else:
            shards = make_shards(self.strategy, data, len(self.devices), with_targets, None if self._compiled else False)
        self._check_inputs(shards.x)
        return shards

    def _check_inputs(self, x: Any) -> None:
        """Keras' check of the inputs against the model's input spec, once per input signature.

        Replicas call the model statelessly (`call`, not `__call__`), and in a
        TensorFlow trace their shards' shapes may be unknown, so a batch with
        the wrong number of features failed deep inside TensorFlow's graph
        instead of with Keras' `ValueError`.
        """
        signature = tuple(tuple(np.shape(leaf)[1:]) for leaf in tree.flatten(x))
        if signature not in self._checked_inputs:
            # A `Sequential` model checks through the functional model it wraps.
            (getattr(self.model, "_functional", None) or self.model)._assert_input_compatibility(x)
            self._checked_inputs.add(signature)

    def _per_replica(self, shards: Shards, loss_scale: float) -> list:
        return [args + (w,) for args, w in zip(shards.per_replica, self._weights(shards, loss_scale))]

    def _run_on_replicas(self, kind: str, shards: Shards, loss_scale: float, full_batch: bool = False) -> list:
        """Runs the `kind` step on the replicas: compiled, or, where padding rows would enter the
        objective on uneven shards, eagerly on shards of their own sizes (`shards` is re-cut).
        `full_batch`: the batch is as large as any before it (see `_is_full_batch`)."""
        compiled, eager_run = getattr(self, f"_{kind}"), self._uneven_runs.get(kind)

        def run(replica_function: Callable) -> list:
            return replica_function(self._state(), self._per_replica(shards, loss_scale))

        if eager_run is None:
            return run(compiled)
        eager = lambda: shards.uneven and self._padding_enters.get(kind, False)  # noqa: E731
        if kind == "train":
            self._warn_if_every_step_is_eager(shards, eager(), full_batch)
        outputs = None if eager() else run(compiled)
        # Also when the objective was first traced just now, and padding rows entered it.
        if eager():
            shards.cut(equal_shapes=False)
            outputs = run(eager_run)
        return outputs

    def _is_full_batch(self, shards: Shards) -> bool:
        """Whether this train batch is as large as every one before it (not a partial last one)."""
        full = shards.batch >= self._largest_batch > 0
        self._largest_batch = max(self._largest_batch, shards.batch)
        return full

    def _warn_if_every_step_is_eager(self, shards: Shards, eager: bool, full: bool) -> None:
        """Eager steps are slower: fine for a partial last batch, worth a word when full batches are uneven."""
        if eager and full and not self._warned_eager:
            self._warned_eager = True
            replicas = self.strategy.num_replicas_in_sync
            warnings.warn(
                f"Batches of {shards.batch} rows do not split evenly over {replicas} replicas, and this model has "
                "loss terms that padding rows would enter (an `add_loss` term, a loss function that returns one "
                "value for the whole batch, or its own `compute_loss`), so its training steps run eagerly, which "
                f"is slower. For compiled steps, use a batch size divisible by {replicas}.", stacklevel=3)

    def _one_program(self, kind: str, shards: Shards) -> bool:
        """Whether the whole `kind` step can be one compiled program (`_train_and_update`,
        `_test_and_measure`, `_predict_all`): one worker, sums made in the replica program, and
        no eager fallback for this batch."""
        return self._whole_steps() and not self._eager_fallback(kind, shards)

    def _eager_fallback(self, kind: str, shards: Shards) -> bool:
        """Whether this batch's `kind` step may run eagerly on uneven shards (`_run_on_replicas`)."""
        return kind in self._uneven_runs and shards.uneven and self._padding_enters.get(kind) is not False

    def _whole_steps(self) -> bool:
        """What a whole compiled step needs of every batch: compiled steps, sums made in the replica
        program, one worker."""
        return self._compiled and self.reduce_in_program and self.num_workers == 1

    def _compiled_step(self, kind: str) -> Callable:
        """`_train_and_update`, `_test_and_measure` or `_predict_all`, compiled as a whole on first use."""
        self._unsettled = True  # the step about to run may leave the variables on the replicas' devices
        if kind not in self._compiled_steps:
            function = {"train": self._train_and_update, "test": self._test_and_measure}.get(kind, self._predict_all)
            finish = functools.partial(self._assign_non_trainable, in_program=True) if kind == "train" else None
            self._compiled_steps[kind] = engine.compiler.compile_replicated_step(
                function, step_variables(self.model), self.devices,
                getattr(self.strategy.extended, "_replicas_keep_copies", False), finish,
            )
        return self._compiled_steps[kind]

    def settle(self) -> None:
        """Brings the variables back to the host device if a whole compiled step left them on the
        replicas' devices (JAX keeps them there between steps): for eager code after a loop."""
        if self._unsettled:
            self._unsettled = False
            engine.compiler.settle(step_variables(self.model), self.host)

    def _train_and_update(self, per_replica: list, batch: tuple, sizes: tuple) -> tuple:
        """The train step after the batch is cut, one worker: the replica program (gradients summed
        in it), the optimizer update, the global predictions and the metric update.

        `engine.compiler.compile_replicated_step` compiles it as a whole where the engine can
        (TensorFlow: one dispatch instead of four); the non-trainable values of the replicas with
        rows come back for `_assign_non_trainable`.
        """
        outputs = self._train(self._state(), per_replica)
        grads, loss = self._sums_of_first_replica(outputs)
        predictions = self._global_predictions(sizes, [aux[1] for _, aux in outputs])
        logs = self._apply_and_measure(grads, loss, predictions, self._batch_tensors(batch))
        return logs, [outputs[i][1][2] for i in replicas_with_rows(sizes)]

    def _sums_of_first_replica(self, outputs: list) -> tuple:
        """`(grads, loss)` summed in the replica program: every replica holds them, the first's are taken."""
        return [self._on_host(g) for g in outputs[0][0]], self._on_host(outputs[0][1][0])

    def _on_host(self, value: Any) -> Any:
        """A replica's value on the first local device, where the update and the metrics run."""
        return engine.devices.copy_to(value, self.host)

    def _apply_and_measure(self, grads: list, loss: Any, predictions: Any, batch: tuple) -> dict:
        """Applies the summed gradients once, then updates the metrics on the global batch."""
        model = self.model
        with engine.devices.device_scope(self.host), optimizer_hooks.direct_update():
            engine.optimizer.apply_gradients(model.optimizer, grads, model.trainable_variables)
        return self._update_metrics(batch, loss, predictions)

    def train_steps(self, batches: Sequence[Any]) -> Optional[dict]:
        """Several train steps (`steps_per_execution`) as one compiled program where the engine
        runs groups of steps (JAX): the logs after the last, as Keras' own steps report a group;
        None when they cannot run as one program, and each takes `train_step` instead.

        A group needs one worker, a whole-step program for every batch, the same shard sizes
        and shapes in every batch (a partial last group runs step by step), and a loss scale
        that does not change between steps (no `LossScaleOptimizer`).
        """
        model = self.model
        if isinstance(model.optimizer, LossScaleOptimizer) or self._loss_scale() != 1.0:
            return None
        if self._compiled and not model.optimizer.built:  # no variables are created inside a compiled step
            model.optimizer.build(model.trainable_variables)
        return self._steps_as_one("train", batches)

    def test_steps(self, batches: Sequence[Any]) -> Optional[dict]:
        """Several test steps as one compiled program (see `train_steps`): the logs after the last."""
        return self._steps_as_one("test", batches)

    def _steps_as_one(self, kind: str, batches: Sequence[Any]) -> Optional[dict]:
        if len(batches) < 2 or not self._whole_steps():  # before any batch is cut
            return None
        group = engine.compiler.step_group(self._compiled_step(kind))
        if group is None:
            return None
        cut = [self._shards(data, kind) for data in batches]
        signatures = {(tuple(s.sizes), tuple(np.shape(leaf) for leaf in tree.flatten(s.per_replica))) for s in cut}
        if len(signatures) != 1 or not all(self._one_program(kind, shards) for shards in cut):
            return None
        if kind == "train":
            for shards in cut:
                self._is_full_batch(shards)
        return group([(self._per_replica(s, 1.0), self._batch_arrays(s), tuple(s.sizes)) for s in cut])

    def train_step(self, data: Any, stop_asked: bool = False) -> Any:
        model = self.model
        shards = self._shards(data, "train")
        loss_scale, full_batch = self._loss_scale(), self._is_full_batch(shards)
        if self._one_program("train", shards):
            if not model.optimizer.built:  # no variables are created inside a compiled step
                model.optimizer.build(model.trainable_variables)
            logs, non_trainable = self._compiled_step("train")(
                self._per_replica(shards, loss_scale), self._batch_arrays(shards), tuple(shards.sizes)
            )
            self._assign_non_trainable(non_trainable)
            return logs
        self.settle()
        if self._exchange_in_program.applies("train", shards):
            return self._exchange_in_program.run("train", shards, loss_scale, stop_asked)
        if self._overlaps_backward():
            exchanged = self._overlapped_run(shards, loss_scale, full_batch, stop_asked)
        else:
            outputs = self._run_on_replicas("train", shards, loss_scale, full_batch)
            if self.reduce_in_program:
                grads, loss = self._sums_of_first_replica(outputs)
            else:
                grads = self._reduce(ReduceOp.SUM, [grads for grads, _ in outputs])
                (loss,) = self._reduce(ReduceOp.SUM, [[aux[0]] for _, aux in outputs])
            non_trainable = [outputs[i][1][2] for i in shards.active]
            predictions = [aux[1] for _, aux in outputs]
            if self.num_workers > 1:
                exchanged = self._exchange(shards, grads, loss, predictions, non_trainable, stop_asked)
            else:
                exchanged = (grads, loss, self._global_predictions(tuple(shards.sizes), predictions),
                             functools.partial(self._assign_non_trainable, non_trainable))
        if exchanged is STOPPED:  # no update, no metrics: as if the step had not run
            return STOPPED
        grads, loss, global_predictions, finish = exchanged
        logs = self._apply_and_measure(grads, loss, global_predictions, self._global_batch(shards))
        finish()
        return logs

    def _overlaps_backward(self) -> bool:
        """Whether train steps send across workers during the backward pass: several workers, one
        local replica, and an engine that reports gradients as its backward pass computes them."""
        return self.num_workers > 1 and len(self.devices) == 1 and engine.capabilities.overlaps_backward

    def _overlapped_run(self, shards: Shards, loss_scale: float, full_batch: bool, stop_asked: bool) -> Any:
        """The replica and the exchange of `train_step`, the exchange running during the backward
        pass (see `_OverlappedExchange`): `_exchange`'s result."""
        overlapped = self._backward_hooks = _OverlappedExchange(self, shards, stop_asked)
        try:
            outputs = self._run_on_replicas("train", shards, loss_scale, full_batch)
        finally:
            self._backward_hooks = None
        return overlapped.finish(list(outputs[0][0]))

    def _test_and_measure(self, per_replica: list, batch: tuple, sizes: tuple) -> dict:
        """The test step after the batch is cut, one worker: the replica program (the loss summed
        in it), the global predictions and the metric update (see `_train_and_update`)."""
        outputs = self._test(self._state(), per_replica)
        loss = self._on_host(outputs[0][0])  # summed in the replica program
        return self._update_metrics(self._batch_tensors(batch), loss, self._global_predictions(sizes, [aux[1] for aux in outputs]))

    def test_step(self, data: Any, stop_asked: bool = False) -> Any:
        shards = self._shards(data, "test")
        if self._one_program("test", shards):
            return self._compiled_step("test")(self._per_replica(shards, 1.0), self._batch_arrays(shards), tuple(shards.sizes))
        self.settle()
        if self._exchange_in_program.applies("test", shards):
            return self._exchange_in_program.run("test", shards, 1.0, stop_asked)
        outputs = self._run_on_replicas("test", shards, 1.0)
        if self.reduce_in_program:
            loss = self._on_host(outputs[0][0])
        else:
            (loss,) = self._reduce(ReduceOp.SUM, [[aux[0]] for aux in outputs])
        predictions = [aux[1] for aux in outputs]
        if self.num_workers > 1:
            exchanged = self._exchange(shards, [], loss, predictions, stop_asked=stop_asked)
            if exchanged is STOPPED:
                return STOPPED
            _, loss, global_predictions, _ = exchanged
        else:
            global_predictions = self._global_predictions(tuple(shards.sizes), predictions)
        return self._update_metrics(self._global_batch(shards), loss, global_predictions)

    def _predict_all(self, per_replica: list, batch: tuple, sizes: tuple) -> Any:
        """The predict step after the batch is cut, one worker: the replica program and the global
        predictions (`batch` is empty: see `_train_and_update`)."""
        return self._global_predictions(sizes, self._predict(self._state(with_metrics=False), per_replica))

    def predict_step(self, data: Any, stop_asked: bool = False) -> Any:
        shards = self._shards(data, "predict")
        per_replica = [(x, mask) for x, _, _, mask in shards.per_replica]
        if self._one_program("predict", shards):
            return self._compiled_step("predict")(per_replica, (), tuple(shards.sizes))
        self.settle()
        outputs = self._predict(self._state(with_metrics=False), per_replica)
        if self.num_workers > 1:
            exchanged = self._exchange(shards, [], None, outputs, stop_asked=stop_asked)
            return exchanged if exchanged is STOPPED else exchanged[2]
        return self._global_predictions(tuple(shards.sizes), outputs)

    def _add_rows(self, exchange: cross_worker.Exchange, shards: Shards, local_parts: list, template: Any) -> tuple:
        """Adds the global batch's predictions, targets and weights in buffers of the agreed row count."""
        buffers = cross_worker.place_rows(shards, local_parts, template, self._rows_capacity)
        exchange.add("predictions", tree.flatten(buffers), donated=True)
        # Targets and weights of the rows every worker actually used: exact metrics even when
        # workers read different batches.
        targets = tuple(cross_worker.own_rows(shards, part, self._rows_capacity) for part in (shards.y, shards.sample_weight))
        exchange.add("targets", [leaf for leaf in tree.flatten(targets) if leaf is not None], donated=True)
        return buffers, targets

    def _exchange(self, shards: Shards, grads: list, loss: Any, predictions: list, non_trainable: Any = None,
                  stop_asked: bool = False):
        """One all-reduce across workers of everything the step needs (see `cross_worker.py`).

        Returns `(grads, loss, global predictions, finish)`; `finish()` assigns the
        non-trainable values once the update is applied. Returns `STOPPED` when a
        worker asked to stop before this step (its flag rides along).
        """
        return self._finish_exchange(self._start_exchange(shards, grads, loss, predictions, non_trainable, stop_asked))

    def _start_exchange(self, shards: Shards, grads: list, loss: Any, predictions: list, non_trainable: Any = None,
                        stop_asked: bool = False, training: bool = False) -> dict:
        """Starts `_exchange`'s all-reduce; `_finish_exchange` waits for it. `training`: a train
        step whose gradients come later, in buckets (`_OverlappedExchange`), which starts it.

        The rows (predictions, targets) travel in buffers of an agreed number
        of rows, so that the all-reduce has the same shapes on every worker even
        when their batches differ in size, which the fingerprint then reports
        clearly. A global batch larger than that number (the first step, a
        larger batch size) grows it on every worker and sends the rows again.
        """
        what = "gradient all-reduce" if grads or training else "predictions all-gather"
        exchange = cross_worker.Exchange(self.strategy.extended._start_cross_worker_sum)
        # The stop flag rides with the fingerprint: no extra operand (on JAX, one gloo call each).
        exchange.add("check", [cross_worker.batch_check(shards, stop_asked)])
        exchange.add("grads", grads, donated=True)
        exchange.add("loss", [] if loss is None else [loss], donated=True)
        local_parts = [shards.unpad(i, predictions[i]) for i in shards.active]
        buffers, targets = self._add_rows(exchange, shards, local_parts, predictions[0])
        kinds: list = []
        if non_trainable is not None:
            variables = self.model.non_trainable_variables
            payload, kinds = cross_worker.non_trainable_payload(variables, non_trainable, self.host)
            exchange.add("non_trainable", payload + [np.array(float(len(shards.active)), "float32")])
        if not training:
            exchange.start(what)
        exact = not (grads or training) and loss is None  # predict: the outputs must line up with the input
        return dict(exchange=exchange, what=what, shards=shards, exact=exact, loss=loss, predictions=predictions,
                    local_parts=local_parts, buffers=buffers, targets=targets, non_trainable=non_trainable, kinds=kinds)

    def _finish_exchange(self, started: dict):
        """Waits for `_start_exchange`'s all-reduce: `_exchange`'s result."""
        shards, host = started["shards"], self.host
        buffers, targets = started["buffers"], started["targets"]
        result = started["exchange"].result()
        if cross_worker.stop_or_check(result["check"][0], shards, self.num_workers, started["exact"]):
            return STOPPED
        if shards.batch > self._rows_capacity:  # the same batch size on every worker (checked above)
            self._rows_capacity = shards.batch
            again = cross_worker.Exchange(self.strategy.extended._start_cross_worker_sum)
            buffers, targets = self._add_rows(again, shards, started["local_parts"], started["predictions"][0])
            result.update(again.run(started["what"]))
        rows = lambda value: ops.convert_to_numpy(value)[:shards.batch]  # noqa: E731
        on_host = lambda value: engine.devices.copy_to(ops.convert_to_tensor(value), host)  # noqa: E731
        y_pred = tree.pack_sequence_as(buffers, [on_host(rows(p)) for p in result["predictions"]])
        # Paired by `flatten` order: Keras' torch `map_structure` visits dicts in insertion order,
        # its `flatten` sorts their keys.
        summed_targets = iter(result["targets"])
        flat_targets = [None if leaf is None else rows(next(summed_targets)) for leaf in tree.flatten(targets)]
        shards.y, shards.sample_weight = tree.pack_sequence_as(targets, flat_targets)
        non_trainable, kinds = started["non_trainable"], started["kinds"]

        def finish() -> None:
            if non_trainable is not None:
                *totals, count = result["non_trainable"]
                cross_worker.assign_non_trainable(self.model.non_trainable_variables, kinds, totals,
                                                  float(ops.convert_to_numpy(count)))

        loss = started["loss"]
        loss = on_host(result["loss"][0]) if loss is not None else None
        return [on_host(g) for g in result["grads"]], loss, y_pred, finish


class _OverlappedExchange:
    """A multi-worker train step's exchange that runs during the backward pass (one local replica,
    an engine that reports gradients as it computes them, `engine.capabilities.overlaps_backward`).

    The gradients go in buckets as the backward pass computes them
    (`gradient_buckets.py`), as torch DDP sends them; the step's other values
    (batch check, loss, predictions, targets, non-trainable values), ready
    after the forward pass, travel with the last bucket, after the backward
    pass. (Sent on their own when the forward pass ended, they made the
    benchmarks' MLP step slower: one more collective per step, for a backward
    pass too short to hide it.)
    """

    def __init__(self, step: ReplicaStep, shards: Shards, stop_asked: bool):
        self._step, self._shards, self._stop_asked = step, shards, stop_asked
        trainable = step.model.trainable_variables
        options = step.strategy.extended._communication_options
        bucket_bytes = options.bytes_per_pack or gradient_buckets.DEFAULT_BUCKET_BYTES
        layout = step._bucket_layouts.get(bucket_bytes)
        if layout is None:
            dtypes = [keras.backend.standardize_dtype(v.dtype) for v in trainable]
            nbytes = [int(np.prod(v.shape)) * np.dtype(d).itemsize for v, d in zip(trainable, dtypes)]
            layout = step._bucket_layouts[bucket_bytes] = gradient_buckets.layout(dtypes, nbytes, bucket_bytes)
        # The step's exchange, kept where the last bucket finds it: the buckets must not refer to
        # this object, whose cycle would keep the step's autograd graph alive until a collection.
        self._exchange: dict = {}
        self.buckets = gradient_buckets.GradientBuckets(layout, step.strategy.extended._start_cross_worker_sum,
                                                        functools.partial(_start_last_bucket, self._exchange))

    def before_backward(self, aux: Any) -> None:
        shards = self._shards
        non_trainable = [aux[2]] if shards.active else []
        self._exchange["started"] = self._step._start_exchange(shards, [], aux[0], [aux[1]], non_trainable,
                                                               self._stop_asked, training=True)

    def ready(self, index: int, grad: Any) -> None:
        self.buckets.ready(index, grad)

    def finish(self, grads: list):
        """After the backward pass (`grads`: this worker's): `_exchange`'s result."""
        summed = self.buckets.finish(grads)
        exchanged = self._step._finish_exchange(self._exchange["started"])
        if exchanged is STOPPED:
            return STOPPED
        _, loss, global_predictions, finish = exchanged
        return [self._step._on_host(g) for g in summed], loss, global_predictions, finish


def _start_last_bucket(exchange: dict, values: list, what: str) -> "_Bucket":
    """Starts the last bucket's sum with the step's other values (`exchange["started"]`, see
    `ReplicaStep._start_exchange`): one all-reduce. The backward pass is over: its gradients are
    the step's own, which the engine may sum in place."""
    started = exchange["started"]["exchange"]
    started.add("bucket", values, donated=True)
    started.start(what)
    return _Bucket(started)


class _Bucket:
    """The last gradient bucket's sums, from the step's exchange that carries them."""

    def __init__(self, exchange: cross_worker.Exchange):
        self._exchange = exchange

    def wait(self) -> list:
        return self._exchange.result()["bucket"]
