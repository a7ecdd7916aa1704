"""One training, evaluation or prediction step of a Keras model, split across replicas.

`ReplicaStep` drives a step from its parts: the batch cut into shards
(`shards.py`), what every replica runs (`replica_program.py`), what follows on
the host device (`global_update.py`) and, with several workers, what they
exchange (`worker_exchange.py`, or `exchange_in_program.py` inside the
compiled step). All replicas run the same function together through the backend's replica
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

import functools
import warnings
from typing import Any, Callable, Optional, Sequence

import numpy as np
from keras.src import tree
from keras.src.optimizers.loss_scale_optimizer import LossScaleOptimizer
from keras.src.trainers.data_adapters import data_adapter_utils
from keras import ops

from keras_strategies.backend import engine
from keras_strategies.input import worker_sharding
from keras_strategies.input.splitting import batch_size_of
from keras_strategies.distribute.reduce_op import ReduceOp
from keras_strategies.trainer.cross_worker import STOPPED
from keras_strategies.trainer.exchange_in_program import ExchangeInProgram
from keras_strategies.trainer.global_update import GlobalUpdate
from keras_strategies.trainer.replica_program import ReplicaProgram
from keras_strategies.trainer.shards import Shards, make_shards, replicas_with_rows
from keras_strategies.trainer.worker_exchange import OverlappedExchange, WorkerExchange


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
        self.reduce_in_program = getattr(strategy.extended, "_default_cross_device_ops", False)
        self.num_workers = strategy.extended._num_workers
        self._compiled = compiled = not model.run_eagerly
        # The parts: what every replica runs, what follows on the host, what workers exchange.
        self.program = ReplicaProgram(model, strategy, self.devices, self.reduce_in_program)
        self.host_update = GlobalUpdate(model, strategy)
        self.workers = WorkerExchange(model, strategy, self.host_update)
        self._exchange_in_program = ExchangeInProgram(self)  # several workers, where the engine can
        # Static shapes (TPUStrategy): the compiled programs' shards have the per-replica rows of the
        # largest batch so far, on every engine (eager steps take each shard at its own size).
        self._static_shapes = compiled and strategy.extended.experimental_require_static_shapes
        self._static_rows: dict = {}  # step kind -> rows of every shard
        self._compiled_steps: dict = {}  # step kind -> the whole step, compiled (`_compiled_step`)
        self._unsettled = False  # whether a whole step ran since the last `settle`
        make = functools.partial(engine.replicas.make_replicated, devices=self.devices, compiled=compiled)
        self._train = make(self.program.train)
        self._test = make(self.program.test)
        self._predict = make(self.program.predict)
        # An engine whose compiled programs need one shard shape (JAX) pads uneven shards with rows
        # of weight 0. Terms those weights cannot reach (an `add_loss` term, a loss function's own
        # batch mean, an overridden `compute_loss`) would count the padding rows, so a model with
        # such terms runs its steps on uneven shards eagerly, each shard at its own size.
        self._uneven_runs: dict = {}
        if compiled and (engine.capabilities.equal_shards or self._static_shapes):
            eager = functools.partial(engine.replicas.make_replicated, devices=self.devices, compiled=False)
            self._uneven_runs = {"train": eager(self.program.train), "test": eager(self.program.test)}
        self._largest_batch, self._warned_eager = 0, False
        self._checked_inputs: set = set()

    # --- the shards and their weights ---------------------------------------------------
    def _loss_scale(self) -> float:
        """What Keras' own step multiplies the loss by (`optimizer.scale_loss`) before differentiating:
        a `LossScaleOptimizer`'s dynamic scale or an optimizer's `loss_scale_factor`, which
        `apply` divides out of the gradients again."""
        optimizer = self.model.optimizer
        if not isinstance(optimizer, LossScaleOptimizer) and getattr(optimizer, "loss_scale_factor", None) is None:
            return 1.0  # no blocking read of a constant 1 every step
        if isinstance(optimizer, LossScaleOptimizer) and not optimizer.built:
            # Unbuilt, it scales by its initial scale; built (in pieces, under a sharded strategy), by
            # the scale a checkpoint may have loaded into it.
            self.strategy.extended._prepare_update(optimizer, self.model.trainable_variables)
        return float(ops.convert_to_numpy(optimizer.scale_loss(ops.convert_to_tensor(1.0, "float32"))))

    def _weights(self, shards: Shards, loss_scale: float) -> list:
        """Per replica: its share of the batch (0 without real rows, so that `add_loss` terms of a
        padding row count nowhere), the share of the weight regularisers, the loss scale."""
        return [
            np.array([rows / shards.batch if size else 0.0, 1.0 / self.strategy.num_replicas_in_sync, loss_scale], "float32")
            for rows, size in zip(shards.rows, shards.sizes)
        ]

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
            return replica_function(self.program.state(), self._per_replica(shards, loss_scale))

        if eager_run is None:
            return run(compiled)
        eager = lambda: shards.uneven and self.program.padding_enters.get(kind, False)  # noqa: E731
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
        return kind in self._uneven_runs and shards.uneven and self.program.padding_enters.get(kind) is not False

    def _whole_steps(self) -> bool:
        """What a whole compiled step needs of every batch: compiled steps, sums made in the replica
        program, one worker."""
        extended = self.strategy.extended
        return (self._compiled and (self.reduce_in_program or extended._sums_gradients_in_update)
                and self.num_workers == 1 and extended._update_in_whole_step)

    def _compiled_step(self, kind: str) -> Callable:
        """`_train_and_update`, `_test_and_measure` or `_predict_all`, compiled as a whole on first use."""
        self._unsettled = True  # the step about to run may leave the variables on the replicas' devices
        if kind not in self._compiled_steps:
            function = {"train": self._train_and_update, "test": self._test_and_measure}.get(kind, self._predict_all)
            finish = functools.partial(self.host_update.assign_non_trainable, in_program=True) if kind == "train" else None
            self._compiled_steps[kind] = engine.compiler.compile_replicated_step(
                function, step_variables(self.model), self.devices,
                getattr(self.strategy.extended, "_replicas_keep_copies", False), finish,
                any_batch_size=kind == "predict",
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
        rows come back for `GlobalUpdate.assign_non_trainable`.
        """
        outputs = self._train(self.program.state(), per_replica)
        if self.reduce_in_program:
            grads, loss = self.host_update.sums_of_first_replica(outputs)
        else:  # the strategy sums the gradients in its update (reduce-scatters them)
            grads = self.host_update.sum_gradients([grads for grads, _ in outputs])
            (loss,) = self.host_update.reduce(ReduceOp.SUM, [[aux[0]] for _, aux in outputs])
        predictions = self.host_update.global_predictions(sizes, [aux[1] for _, aux in outputs])
        logs = self.host_update.apply_and_measure(grads, loss, predictions, self.host_update.batch_tensors(batch))
        return logs, [outputs[i][1][2] for i in replicas_with_rows(sizes)]

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
        if self._whole_steps():  # no variables are created inside a compiled step
            self.strategy.extended._prepare_update(model.optimizer, model.trainable_variables)
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
        return group([(self._per_replica(s, 1.0), self.host_update.batch_arrays(s), tuple(s.sizes)) for s in cut])

    def train_step(self, data: Any, stop_asked: bool = False) -> Any:
        model = self.model
        shards = self._shards(data, "train")
        loss_scale, full_batch = self._loss_scale(), self._is_full_batch(shards)
        if self._one_program("train", shards):
            # No variables are created inside a compiled step.
            self.strategy.extended._prepare_update(model.optimizer, model.trainable_variables)
            logs, non_trainable = self._compiled_step("train")(
                self._per_replica(shards, loss_scale), self.host_update.batch_arrays(shards), tuple(shards.sizes)
            )
            self.host_update.assign_non_trainable(non_trainable)
            return logs
        self.settle()
        if self._exchange_in_program.applies("train", shards):
            return self._exchange_in_program.run("train", shards, loss_scale, stop_asked)
        if self._overlaps_backward():
            exchanged = self._overlapped_run(shards, loss_scale, full_batch, stop_asked)
        else:
            outputs = self._run_on_replicas("train", shards, loss_scale, full_batch)
            if self.reduce_in_program:
                grads, loss = self.host_update.sums_of_first_replica(outputs)
            else:
                grads = self.host_update.sum_gradients([grads for grads, _ in outputs])
                (loss,) = self.host_update.reduce(ReduceOp.SUM, [[aux[0]] for _, aux in outputs])
            non_trainable = [outputs[i][1][2] for i in shards.active]
            predictions = [aux[1] for _, aux in outputs]
            if self.num_workers > 1:
                exchanged = self.workers.run(shards, grads, loss, predictions, non_trainable, stop_asked)
            else:
                exchanged = (grads, loss, self.host_update.global_predictions(tuple(shards.sizes), predictions),
                             functools.partial(self.host_update.assign_non_trainable, non_trainable))
        if exchanged is STOPPED:  # no update, no metrics: as if the step had not run
            return STOPPED
        grads, loss, global_predictions, finish = exchanged
        logs = self.host_update.apply_and_measure(grads, loss, global_predictions, self.host_update.global_batch(shards))
        finish()
        return logs

    def _overlaps_backward(self) -> bool:
        """Whether train steps send across workers during the backward pass: several workers, one
        local replica, an engine that reports gradients as its backward pass computes them, and a
        strategy whose update takes the gradients summed (not each replica's own, to reduce-scatter)."""
        return (self.num_workers > 1 and len(self.devices) == 1 and engine.capabilities.overlaps_backward
                and not self.strategy.extended._sums_gradients_in_update)

    def _overlapped_run(self, shards: Shards, loss_scale: float, full_batch: bool, stop_asked: bool) -> Any:
        """The replica and the exchange of `train_step`, the exchange running during the backward
        pass (see `worker_exchange.OverlappedExchange`): `WorkerExchange.run`'s result."""
        overlapped = self.program.backward_hooks = OverlappedExchange(self.workers, shards, stop_asked)
        try:
            outputs = self._run_on_replicas("train", shards, loss_scale, full_batch)
        finally:
            self.program.backward_hooks = None
        return overlapped.finish(list(outputs[0][0]))

    def _test_and_measure(self, per_replica: list, batch: tuple, sizes: tuple) -> dict:
        """The test step after the batch is cut, one worker: the replica program (the loss summed
        in it), the global predictions and the metric update (see `_train_and_update`)."""
        outputs = self._test(self.program.state(), per_replica)
        if self.reduce_in_program:
            loss = self.host_update.on_host(outputs[0][0])  # summed in the replica program
        else:
            (loss,) = self.host_update.reduce(ReduceOp.SUM, [[aux[0]] for aux in outputs])
        return self.host_update.update_metrics(self.host_update.batch_tensors(batch), loss, self.host_update.global_predictions(sizes, [aux[1] for aux in outputs]))

    def test_step(self, data: Any, stop_asked: bool = False) -> Any:
        shards = self._shards(data, "test")
        if self._one_program("test", shards):
            return self._compiled_step("test")(self._per_replica(shards, 1.0), self.host_update.batch_arrays(shards), tuple(shards.sizes))
        self.settle()
        if self._exchange_in_program.applies("test", shards):
            return self._exchange_in_program.run("test", shards, 1.0, stop_asked)
        outputs = self._run_on_replicas("test", shards, 1.0)
        if self.reduce_in_program:
            loss = self.host_update.on_host(outputs[0][0])
        else:
            (loss,) = self.host_update.reduce(ReduceOp.SUM, [[aux[0]] for aux in outputs])
        predictions = [aux[1] for aux in outputs]
        if self.num_workers > 1:
            exchanged = self.workers.run(shards, [], loss, predictions, stop_asked=stop_asked)
            if exchanged is STOPPED:
                return STOPPED
            _, loss, global_predictions, _ = exchanged
        else:
            global_predictions = self.host_update.global_predictions(tuple(shards.sizes), predictions)
        return self.host_update.update_metrics(self.host_update.global_batch(shards), loss, global_predictions)

    def _predict_all(self, per_replica: list, batch: tuple, sizes: tuple) -> Any:
        """The predict step after the batch is cut, one worker: the replica program and the global
        predictions (`batch` is empty: see `_train_and_update`)."""
        return self.host_update.global_predictions(sizes, self._predict(self.program.state(with_metrics=False), per_replica))

    def predict_step(self, data: Any, stop_asked: bool = False) -> Any:
        shards = self._shards(data, "predict")
        per_replica = [(x, mask) for x, _, _, mask in shards.per_replica]
        if self._one_program("predict", shards):
            # Unpadded shards need only which replicas have rows: one trace for any batch size.
            sizes = tuple(shards.sizes) if shards.padded else tuple(size > 0 for size in shards.sizes)
            return self._compiled_step("predict")(per_replica, (), sizes)
        self.settle()
        outputs = self._predict(self.program.state(with_metrics=False), per_replica)
        if self.num_workers > 1:
            exchanged = self.workers.run(shards, [], None, outputs, stop_asked=stop_asked)
            return exchanged if exchanged is STOPPED else exchanged[2]
        return self.host_update.global_predictions(tuple(shards.sizes), outputs)
