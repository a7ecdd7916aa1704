"""`fit` / `evaluate` / `predict` / `*_on_batch` for models built under a multi-replica strategy.

The loops follow Keras' own (callbacks, progress bar, History, validation,
`steps_per_epoch`, `initial_epoch`, `class_weight`), read any Keras input
(NumPy, `tf.data`, `PyDataset`, generators, torch `DataLoader`) as global
NumPy batches, and hand each batch to a `ReplicaStep`.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import numpy as np
import keras
from keras.src import callbacks as callbacks_module
from keras.src import tree
from keras.src.backend import config
from keras.src.trainers.data_adapters import array_slicing, data_adapter_utils
from keras.src.trainers.data_adapters.tf_dataset_adapter import TFDatasetAdapter
from keras.src.trainers.epoch_iterator import EpochIterator
from keras.src.utils.python_utils import pythonify_logs

from keras_strategies.backend import engine
from keras_strategies.backend.common import keras_compat
from keras_strategies.input import worker_sharding
from keras_strategies.input.keras_input import keras_input
from keras_strategies.keras_integration import chief_only
from keras_strategies.sharding import optimizer_state
from keras_strategies.trainer.epochs import run_epochs
from keras_strategies.trainer.custom_step import CustomStep, overrides_step
from keras_strategies.trainer.replica_step import ReplicaStep, step_variables
from keras_strategies.trainer.stopping import StopAgreement

_STEP_ATTR = "_ks_replica_step"


class _Steps:
    """Per step kind, the model's own override (run per replica) or our replica step."""

    def __init__(self, model: Any, strategy: Any):
        standard, custom = ReplicaStep(model, strategy), CustomStep(model, strategy)
        for kind in ("train", "test", "predict"):
            runner = custom if overrides_step(model, kind) else standard
            setattr(self, f"{kind}_step", getattr(runner, f"{kind}_step"))
        self.train_steps = None if overrides_step(model, "train") else standard.train_steps
        self.test_steps = None if overrides_step(model, "test") else standard.test_steps
        self.settle = standard.settle


def replica_step(model: Any, strategy: Any) -> _Steps:
    """The model's step runners, rebuilt when the model is recompiled."""
    step = getattr(model, _STEP_ATTR, None)
    key = (  # an uncompiled model (`predict` needs no `compile`) has neither attribute
        id(strategy), id(getattr(model, "optimizer", None)), id(getattr(model, "_compile_loss", None)), model.run_eagerly
    )
    if step is None or step._key != key:
        step = _Steps(model, strategy)
        step._key = key
        object.__setattr__(model, _STEP_ATTR, step)
    return step


class _LoopIterator(EpochIterator):
    """Keras' epoch iterator over the batches that the backend's own loops would read.

    `backend_batches`: the same pipeline as Keras' trainer for this backend
    (`tf.data` on TensorFlow, a `DataLoader` on torch), so that
    `fit(shuffle=True)` takes the same batches as without a strategy under the
    same seeds; on torch in every loop (`_reads_backend_pipeline`). Otherwise
    NumPy's iterator: the same order when nothing is shuffled, at a fraction of
    the cost per batch (~10 us against ~60 us for a `DataLoader` and ~300 us
    for eager `tf.data`), and under several workers the order every worker
    shares when the backend's own is not shared (drawn from the chief's RNG states).

    A `tf.data.Dataset` is always read through the backend's pipeline, shuffled or not, in
    `fit`, `evaluate` and `predict`: Keras makes two iterators per epoch (one when an epoch
    ends, one when the next begins), and on TensorFlow each one moves a dataset that reshuffles
    on every iteration to its next order; and NumPy's iterator cannot carry every element type
    (strings for a `TextVectorization` layer become object arrays that Keras cannot build from).
    """

    def __init__(self, *args: Any, backend_batches: bool, **kwargs: Any):
        super().__init__(*args, **kwargs)
        backend_batches = backend_batches or isinstance(self.data_adapter, TFDatasetAdapter)
        self._batches = engine.trainer.epoch_batches(self.data_adapter) if backend_batches else None

    def _get_iterator(self) -> Any:
        return engine.trainer.as_keras_reads(self._batches() if self._batches is not None else super()._get_iterator())

    def build_model(self, model: Any, kind: str = "train") -> None:
        """Builds the model as the backend's own loop would: from a spec (TensorFlow) or the first batch."""
        batch = engine.trainer.build_batch(self.data_adapter, self._batches)
        if batch is not None:
            _symbolic_build(model, kind, data_batch=batch)
        else:
            _symbolic_build(model, kind, iterator=self)


def _reads_backend_pipeline(strategy: Any, shuffle: bool) -> bool:
    """Whether a loop reads the backend's own pipeline (`_LoopIterator`) rather than NumPy's.

    Needed when shuffling, for the order of one device, and on every loop where
    that pipeline draws from the global generator even unshuffled (torch's
    `DataLoader`), so that later shuffles draw what they draw without a
    strategy. Several workers read it when its order is fixed by the same key
    on every worker (`engine.trainer.pipeline_order_seed`): host RNGs, whose
    states they take from the chief (JAX, torch), or TensorFlow's global seed
    for `tf.data`; else NumPy's order, drawn from the chief's RNG states.
    """
    if not (shuffle or engine.capabilities.pipeline_draws_rng):
        return False
    return strategy.extended._num_workers == 1 or strategy.extended._same_on_every_worker(
        engine.trainer.pipeline_order_seed()
    )


def _symbolic_build(model: Any, kind: str, **batch: Any) -> None:
    """Builds the model's state from a batch's shapes, as Keras' trainers do before a loop.

    A model with its own step and no forward pass (a GAN that holds its
    generator and discriminator) cannot be built that way. Keras' own
    TensorFlow trainer does not try (it builds when the step is first traced),
    so where Keras defers (`engine.capabilities.defers_build`) such a model runs
    its step unbuilt, as it does without a strategy. An optimizer whose state the strategy
    shards stays unbuilt (built in pieces at its first update).
    """
    try:
        with optimizer_state.left_unbuilt(getattr(model, "optimizer", None)):
            model._symbolic_build(**batch)
    except RuntimeError:
        if not (engine.capabilities.defers_build and overrides_step(model, kind)):
            raise


def _per_worker_input(strategy: Any, x: Any) -> bool:
    """Whether this multi-worker input is already sharded per worker (`input/worker_sharding.py`)."""
    return strategy.extended._num_workers > 1 and worker_sharding.is_worker_sharded(x)


def _loop_iterator(strategy: Any, method: str, x: Any, shuffle: bool = False, **kwargs: Any) -> _LoopIterator:
    """The loop's epoch iterator over `x`, with a clear error for an input without samples.

    Keras' own loops fail deep inside on an empty input. Not checked for
    per-worker input: there one worker's share may be empty while others have
    data (`worker_sharding.agreed_steps`).
    """
    epoch_iterator = _LoopIterator(x=x, shuffle=shuffle, backend_batches=_reads_backend_pipeline(strategy, shuffle),
                                   **kwargs)
    if epoch_iterator.data_adapter.num_batches == 0 and not _per_worker_input(strategy, x):
        raise ValueError(f"`{method}` got an input without any samples: pass at least one sample.")
    return epoch_iterator


def _require_rows(batch: Any, method: str) -> None:
    sizes = {int(leaf.shape[0]) for leaf in tree.flatten(batch) if getattr(leaf, "shape", None)}
    if 0 in sizes:
        raise ValueError(f"`{method}` got a batch of 0 samples: pass at least one sample.")


def _epoch(epoch_iterator: Any, strategy: Any, model: Any, per_worker: bool) -> Any:
    """The epoch's steps; with per-worker input, the same number on every worker."""
    if not per_worker:
        return epoch_iterator
    return worker_sharding.agreed_steps(epoch_iterator, strategy.extended._any_worker_has, model.steps_per_execution)


def _set_mode(model: Any, training: bool) -> None:
    """Torch modules track train/eval mode; other backends pass `training` explicitly."""
    mode = getattr(model, "train" if training else "eval", None)
    if callable(mode):
        mode()


def _callback_list(callbacks, model, strategy, verbose, steps, epochs=1, add_history=False):
    if isinstance(callbacks, callbacks_module.CallbackList):
        return callbacks
    extended = strategy.extended
    if not extended._is_chief:  # the chief alone prints and writes (multi_worker/chief_only.py)
        verbose = 0
        callbacks = chief_only.adapt_callbacks(list(callbacks or []), extended._cluster.task_id)
    return callbacks_module.CallbackList(
        callbacks, add_history=add_history, add_progbar=verbose != 0, verbose=verbose, epochs=epochs,
        steps=steps, model=model,
    )


def fit(model, strategy, x=None, y=None, batch_size=None, epochs=1, verbose="auto", callbacks=None,
        validation_split=0.0, validation_data=None, shuffle=True, class_weight=None, sample_weight=None,
        initial_epoch=0, steps_per_epoch=None, validation_steps=None, validation_batch_size=None,
        validation_freq=1):
    model._assert_compile_called("fit")
    max_epochs = config.max_epochs()
    if max_epochs and max_epochs < epochs:
        warnings.warn("Limiting epochs to %d" % max_epochs)
        epochs = max_epochs
    x, ordered = keras_input(strategy, x)
    shuffle = shuffle and not ordered
    if validation_split and validation_data is None:
        (x, y, sample_weight), validation_data = array_slicing.train_validation_split(
            (x, y, sample_weight), validation_split=validation_split
        )
    if validation_data is not None:
        val_x, val_y, val_sample_weight = data_adapter_utils.unpack_x_y_sample_weight(validation_data)
        val_x, _ = keras_input(strategy, val_x)

    epoch_iterator = _loop_iterator(
        strategy, "fit", x, shuffle, y=y, sample_weight=sample_weight, batch_size=batch_size,
        steps_per_epoch=steps_per_epoch, class_weight=class_weight, steps_per_execution=model.steps_per_execution,
    )
    epoch_iterator.build_model(model)
    strategy.extended._sync_variables_from_chief()
    epoch_iterator.reset()
    callbacks = _callback_list(callbacks, model, strategy, verbose, epoch_iterator.num_batches, epochs, add_history=True)
    step = replica_step(model, strategy)
    per_worker = _per_worker_input(strategy, x)
    model.stop_training = False
    callbacks.on_train_begin()
    # BackupAndRestore may have restored the chief's backup: every worker continues from the chief's state.
    strategy.extended._sync_variables_from_chief(also=step_variables(model))
    strategy.extended._sync_optimizer_state_from_chief(model.optimizer, model.trainable_variables)
    initial_epoch = strategy.extended._broadcast_from_chief(model._initial_epoch or initial_epoch)
    # A backup saved on a preemption notice (`backup_and_restore.py`) was taken inside its epoch:
    # that epoch resumes after the batches it had trained.
    trained_batches = strategy.extended._broadcast_from_chief(getattr(model, "_ks_initial_batch", 0) or 0)
    model._ks_initial_batch = 0

    def train_epoch(epoch: int) -> dict:
        nonlocal trained_batches
        _set_mode(model, True)
        logs = {}
        stop = StopAgreement(model, strategy, "stop_training")
        # Before the epoch's shuffle is drawn, when the chief's states are those of one process at
        # this point (the peek that built the model drew from them as it does there).
        strategy.extended._use_chief_input_rngs()
        with worker_sharding.per_worker_input(per_worker):
            for begin_step, end_step, batches in _epoch(epoch_iterator, strategy, model, per_worker):
                if end_step < trained_batches:
                    continue
                callbacks.on_train_batch_begin(begin_step)
                results = stop.run(step.train_step, batches, step.train_steps)
                if results is None:
                    break
                logs = results[-1]
                callbacks.on_train_batch_end(end_step, logs)
                if stop.leave_now():
                    break
        trained_batches = 0
        epoch_logs = dict(model._get_metrics_result_or_logs(logs))
        _set_mode(model, False)
        return epoch_logs

    def validate() -> dict:
        return evaluate(
            model, strategy, x=val_x, y=val_y, sample_weight=val_sample_weight,
            batch_size=validation_batch_size or batch_size, steps=validation_steps,
            callbacks=callbacks, return_dict=True,
        )

    # Keras' callbacks stop on global logs, so every worker agrees; a callback that stops one
    # worker only (a time limit, a file) stops them all: within the epoch at the next step
    # (`trainer/stopping.py`), on its last step or in `on_epoch_end`.
    return run_epochs(
        model, callbacks, epochs, initial_epoch, train_epoch, validate if validation_data is not None else None,
        validation_freq, lambda stop: strategy.extended._any_worker_has(stop, "stop agreement"),
    )


def evaluate(model, strategy, x=None, y=None, batch_size=None, verbose="auto", sample_weight=None,
             steps=None, callbacks=None, return_dict=False, **kwargs):
    kwargs.pop("_use_cached_eval_dataset", None)
    if kwargs:
        raise ValueError(f"Arguments not recognized: {kwargs}")
    model._assert_compile_called("evaluate")  # Keras' error (its torch trainer has none)
    x, _ = keras_input(strategy, x)
    epoch_iterator = _loop_iterator(
        strategy, "evaluate", x, y=y, sample_weight=sample_weight, batch_size=batch_size, steps_per_epoch=steps,
        steps_per_execution=model.steps_per_execution,
    )
    epoch_iterator.build_model(model, "test")
    strategy.extended._sync_variables_from_chief()
    epoch_iterator.reset()
    callbacks = _callback_list(callbacks, model, strategy, verbose, epoch_iterator.num_batches)
    step = replica_step(model, strategy)
    _set_mode(model, False)
    model.stop_evaluating = False
    callbacks.on_test_begin()
    logs = {}
    model.reset_metrics()
    per_worker = _per_worker_input(strategy, x)
    stop = StopAgreement(model, strategy, "stop_evaluating")
    with worker_sharding.per_worker_input(per_worker):
        for begin_step, end_step, batches in _epoch(epoch_iterator, strategy, model, per_worker):
            callbacks.on_test_batch_begin(begin_step)
            results = stop.run(step.test_step, batches, step.test_steps)
            if results is None:
                break
            logs = results[-1]
            callbacks.on_test_batch_end(end_step, logs)
            if stop.leave_now():
                break
    logs = pythonify_logs(model._get_metrics_result_or_logs(logs))
    callbacks.on_test_end(logs)
    if return_dict:
        return logs
    return model._flatten_metrics_in_order(logs)


def predict(model, strategy, x, batch_size=None, verbose="auto", steps=None, callbacks=None):
    x, _ = keras_input(strategy, x)
    epoch_iterator = _loop_iterator(
        strategy, "predict", x, batch_size=batch_size, steps_per_epoch=steps,
        steps_per_execution=model.steps_per_execution,
    )
    callbacks = _callback_list(callbacks, model, strategy, verbose, epoch_iterator.num_batches)
    strategy.extended._sync_variables_from_chief()
    step = replica_step(model, strategy)
    _set_mode(model, False)
    model.stop_predicting = False
    callbacks.on_predict_begin()
    outputs = None
    batch_outputs = None
    per_worker = _per_worker_input(strategy, x)
    stop = StopAgreement(model, strategy, "stop_predicting")
    with worker_sharding.per_worker_input(per_worker):
        for begin_step, end_step, batches in _epoch(epoch_iterator, strategy, model, per_worker):
            callbacks.on_predict_batch_begin(begin_step)
            results = stop.run(step.predict_step, batches)
            if results is None:
                break
            for result in results:
                batch_outputs = tree.map_structure(keras.ops.convert_to_numpy, result)
                if outputs is None:
                    outputs = tree.map_structure(lambda output: [output], batch_outputs)
                else:
                    tree.map_structure_up_to(batch_outputs, lambda acc, out: acc.append(out), outputs, batch_outputs)
            callbacks.on_predict_batch_end(end_step, {"outputs": batch_outputs})
            if stop.leave_now():
                break
    callbacks.on_predict_end()
    if outputs is None:
        raise ValueError("`predict` read no batch from its input: pass at least one sample.")
    return tree.map_structure_up_to(batch_outputs, np.concatenate, outputs)


def train_on_batch(model, strategy, x, y=None, sample_weight=None, class_weight=None, return_dict=False):
    model._assert_compile_called("train_on_batch")
    if class_weight is not None:
        if sample_weight is not None:
            raise ValueError(
                "Arguments `sample_weight` and `class_weight` cannot be specified at the same time. "
                f"Received: sample_weight={sample_weight}, class_weight={class_weight}"
            )
        sample_weight = data_adapter_utils.class_weight_to_sample_weights(y, class_weight)
    data = (x, y, sample_weight)
    _require_rows(data, "train_on_batch")
    _symbolic_build(model, "train", data_batch=data)
    strategy.extended._sync_variables_from_chief()
    if keras_compat.ON_BATCH_RESETS_METRICS:  # as Keras' own does
        model.reset_metrics()
    logs = pythonify_logs(replica_step(model, strategy).train_step(data))
    return logs if return_dict else model._flatten_metrics_in_order(logs)


def test_on_batch(model, strategy, x, y=None, sample_weight=None, return_dict=False):
    model._assert_compile_called("test_on_batch")
    data = (x, y, sample_weight)
    _require_rows(data, "test_on_batch")
    _symbolic_build(model, "test", data_batch=data)
    strategy.extended._sync_variables_from_chief()
    if keras_compat.ON_BATCH_RESETS_METRICS:  # as Keras' own does
        model.reset_metrics()
    logs = pythonify_logs(replica_step(model, strategy).test_step(data))
    return logs if return_dict else model._flatten_metrics_in_order(logs)


def predict_on_batch(model, strategy, x):
    _require_rows(x, "predict_on_batch")
    strategy.extended._sync_variables_from_chief()
    outputs = replica_step(model, strategy).predict_step((x,))
    return tree.map_structure(keras.ops.convert_to_numpy, outputs)


def _settling(loop: Any) -> Any:
    """`loop`, after which the model's variables are where eager code expects them, also when it
    raised (see `ReplicaStep.settle`)."""

    @functools.wraps(loop)
    def run(model: Any, strategy: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return loop(model, strategy, *args, **kwargs)
        finally:
            step = getattr(model, _STEP_ATTR, None)
            if step is not None:
                step.settle()

    return run


LOOPS = {
    name: _settling(loop) for name, loop in {
        "fit": fit,
        "evaluate": evaluate,
        "predict": predict,
        "train_on_batch": train_on_batch,
        "test_on_batch": test_on_batch,
        "predict_on_batch": predict_on_batch,
    }.items()
}
