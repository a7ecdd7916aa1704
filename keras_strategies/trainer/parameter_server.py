"""Keras `fit` / `evaluate` / `predict` for models built under `ParameterServerStrategy`.

`fit` builds the input on every worker (`create_per_worker_dataset`),
schedules one closure per `steps_per_execution` steps with the coordinator,
joins at each epoch end and gives the callbacks epoch-level logs on the chief
(read from the metrics, which live on the parameter servers). `evaluate`,
`predict` and the `*_on_batch` methods run on the chief, whose reads and
writes of the variables go to the parameter servers.
"""

from __future__ import annotations

import contextlib
import math
import threading
from typing import Any, Callable, Iterator, Optional

import numpy as np
from keras.src import callbacks as callbacks_module
from keras.src import tree
from keras.src.models import model as keras_model
from keras.src.trainers.data_adapters import data_adapter_utils
from keras.src.utils.python_utils import pythonify_logs

from keras_strategies.backend import engine
from keras_strategies.distribute import context
from keras_strategies.input.options import InputContext
from keras_strategies.trainer.epochs import run_epochs

# Keras' own callbacks that do their work at epoch ends under the defaults (batch hooks idle).
_EPOCH_LEVEL = (
    callbacks_module.History, callbacks_module.ProgbarLogger, callbacks_module.ModelCheckpoint,
    callbacks_module.BackupAndRestore, callbacks_module.EarlyStopping, callbacks_module.TensorBoard,
    callbacks_module.CSVLogger, callbacks_module.ReduceLROnPlateau, callbacks_module.LearningRateScheduler,
    callbacks_module.TerminateOnNaN, callbacks_module.LambdaCallback, callbacks_module.RemoteMonitor,
)
_BATCH_HOOKS = ("on_batch_begin", "on_batch_end", "on_train_batch_begin", "on_train_batch_end")


def run_keras_method(name: str, strategy: Any, method: Callable, model: Any, args: tuple, kwargs: dict) -> Any:
    """`Model.<name>` of a model built under `strategy`."""
    if getattr(model, "run_eagerly", False):
        raise ValueError(
            "`run_eagerly=True` is not supported with ParameterServerStrategy: each step runs on a "
            "worker as a compiled function. Compile the model without `run_eagerly`."
        )
    if name == "fit":
        return fit(model, strategy, *args, **kwargs)
    return run_on_chief(method, model, *args, **kwargs)


def run_on_chief(method: Callable, model: Any, *args: Any, **kwargs: Any) -> Any:
    """Keras' own `method` on the chief, outside every strategy scope (see `on_chief`).

    Called inside `strategy.scope()`, it runs in a thread of its own: scopes (ours,
    TensorFlow's, Keras') belong to the thread that entered them.
    """
    if not context.has_strategy():
        with on_chief(model):
            return method(model, *args, **kwargs)
    outcome: dict = {}

    def target() -> None:
        try:
            with on_chief(model):
                outcome["value"] = method(model, *args, **kwargs)
        except BaseException as error:  # noqa: BLE001 - re-raised in the caller's thread
            outcome["error"] = error

    thread = threading.Thread(target=target, name=f"ks-chief-{getattr(method, '__name__', 'method')}")
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


@contextlib.contextmanager
def on_chief(model: Any) -> Iterator[None]:
    """Runs Keras' own loop on the chief, outside the strategy: every read and write of a
    variable goes to its parameter server. (Keras' TensorFlow trainer remembers the strategy a
    model was created under and would distribute the input with it.)"""
    remembered = model.__dict__.get("_distribute_strategy")
    if remembered is None:
        yield
        return
    model._distribute_strategy = None
    try:
        yield
    finally:
        model._distribute_strategy = remembered


def _dataset_fn(x: Any, y: Any, sample_weight: Any, batch_size: Optional[int], shuffle: bool,
                steps_per_epoch: Optional[int]) -> tuple[Any, int]:
    """`(dataset_fn(input_context) or a dataset, steps per epoch)` for `fit`'s input, repeated without end."""
    import tensorflow as tf

    if isinstance(x, tf.data.Dataset):
        if y is not None or sample_weight is not None:
            raise ValueError("`y` and `sample_weight` must be None when `x` is a tf.data.Dataset.")
        cardinality = int(x.cardinality())
        if steps_per_epoch is None:
            if cardinality < 0:
                raise ValueError(
                    "`steps_per_epoch` is required for an input without a known length (an endless "
                    "or unknown-length tf.data.Dataset) under ParameterServerStrategy: pass "
                    "`steps_per_epoch=N`."
                )
            steps_per_epoch = cardinality
        # A dataset object (not a function capturing it): the coordinator sends its graph to the workers.
        return (x.repeat() if cardinality != tf.data.INFINITE_CARDINALITY else x), steps_per_epoch
    if callable(x):  # a dataset function of an InputContext (as with DatasetCreator)
        if steps_per_epoch is None:
            raise ValueError(
                "`steps_per_epoch` is required when `fit` gets a dataset function under "
                "ParameterServerStrategy (its length is unknown): pass `steps_per_epoch=N`."
            )
        return (lambda context: x(context)), steps_per_epoch
    if x is None:
        raise ValueError("`fit` needs an input `x`.")
    arrays = data_adapter_utils.pack_x_y_sample_weight(x, y, sample_weight)
    arrays = tree.map_structure(np.asarray, arrays)
    rows = int(tree.flatten(arrays)[0].shape[0])
    if rows == 0:
        raise ValueError("`fit` got an input without any samples: pass at least one sample.")
    batch_size = batch_size or 32
    if steps_per_epoch is None:
        steps_per_epoch = math.ceil(rows / batch_size)

    def dataset_fn(context: Any) -> Any:
        dataset = tf.data.Dataset.from_tensor_slices(arrays)
        if shuffle:
            dataset = dataset.shuffle(rows, reshuffle_each_iteration=True)
        return dataset.batch(batch_size).repeat()

    return dataset_fn, steps_per_epoch


def _check_callbacks(callbacks: Any) -> None:
    """Refuses callbacks that need per-step logs or batch hooks, which `fit` never calls here."""
    for callback in list(callbacks or []):
        setting = _batch_setting(callback)
        if setting is not None:
            given, fix = setting
            raise ValueError(
                f"Callback {type(callback).__name__} with {given} acts on batches, but under "
                "ParameterServerStrategy `fit` schedules steps on the workers and gives callbacks "
                f"epoch-level logs only. Pass {fix}."
            )
        if isinstance(callback, _EPOCH_LEVEL):
            continue
        overridden = [hook for hook in _BATCH_HOOKS
                      if getattr(type(callback), hook, None) is not getattr(callbacks_module.Callback, hook)]
        if overridden:
            raise ValueError(
                f"Callback {type(callback).__name__} overrides {', '.join(overridden)}, but under "
                "ParameterServerStrategy `fit` schedules steps on the workers and gives callbacks "
                "epoch-level logs only. Move its work to `on_epoch_end`, or train with a custom loop."
            )


def _batch_setting(callback: Any) -> Optional[tuple]:
    """`(the batch-level setting, its epoch-level fix)` of one of Keras' epoch-level callbacks, or None."""
    if isinstance(callback, (callbacks_module.ModelCheckpoint, callbacks_module.BackupAndRestore)):
        if callback.save_freq not in ("epoch", False):
            return f"save_freq={callback.save_freq!r}", "save_freq='epoch'"
    if isinstance(callback, callbacks_module.TensorBoard):
        if callback.update_freq != "epoch":
            return f"update_freq={callback.update_freq!r}", "update_freq='epoch'"
        if getattr(callback, "_should_trace", False):
            return f"profile_batch={callback._start_batch}", "profile_batch=0"
    return None


def _make_train_function(model: Any, strategy: Any, steps: int) -> Callable:
    """One closure: `steps` training steps on the worker that runs it; returns the last logs."""
    runtime = strategy.extended._runtime

    # Where Keras' `train_step` is stateless (JAX: it returns new values instead of applying them),
    # the step is written with `ks.value_and_grad` and `optimizer.apply_gradients`.
    train_step = model.train_step if engine.capabilities.stateful_steps else _stateful_train_step(model)

    def train_function(iterator: Any) -> Any:
        logs = None
        for _ in range(steps):
            logs = strategy.run(train_step, args=(next(iterator),))
        return logs

    return runtime.compile(train_function)


def _stateful_train_step(model: Any) -> Callable:
    """Keras' training step (loss, gradients, `optimizer.apply_gradients`, metrics) applied in place."""
    from keras_strategies.distribute.functions import value_and_grad

    def train_step(data: Any) -> Any:
        x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)

        def compute() -> tuple:
            y_pred = model(x, training=True)
            loss = model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True)
            return loss, y_pred

        (loss, y_pred), grads = value_and_grad(compute, model.trainable_variables)
        model._loss_tracker.update_state(loss, sample_weight=tree.flatten(x)[0].shape[0])
        model.optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return model.compute_metrics(x, y, y_pred, sample_weight)

    return train_step


def fit(model: Any, strategy: Any, x: Any = None, y: Any = None, batch_size: Optional[int] = None, epochs: int = 1,
        verbose: Any = "auto", callbacks: Any = None, validation_split: float = 0.0, validation_data: Any = None,
        shuffle: bool = True, class_weight: Any = None, sample_weight: Any = None, initial_epoch: int = 0,
        steps_per_epoch: Optional[int] = None, validation_steps: Optional[int] = None,
        validation_batch_size: Optional[int] = None, validation_freq: Any = 1) -> Any:
    """`Model.fit` under `ParameterServerStrategy` (see the module docstring)."""
    from keras_strategies.coordinator import ClusterCoordinator

    if class_weight is not None:
        raise ValueError("`class_weight` is not supported with ParameterServerStrategy: pass `sample_weight`.")
    if validation_split:
        raise ValueError(
            "`validation_split` is not supported with ParameterServerStrategy: pass `validation_data`."
        )
    _check_callbacks(callbacks)
    dataset_fn, steps_per_epoch = _dataset_fn(x, y, sample_weight, batch_size, shuffle, steps_per_epoch)
    coordinator = ClusterCoordinator(strategy)

    # Built on the chief, in scope, before any step: every variable lives on the parameter servers.
    if callable(dataset_fn):
        spec = dataset_fn(InputContext()).element_spec
        options = getattr(x, "input_options", None)  # a DatasetCreator's
        per_worker = coordinator.create_per_worker_dataset(
            lambda: strategy.distribute_datasets_from_function(dataset_fn, options)
        )
    else:
        spec = dataset_fn.element_spec
        per_worker = coordinator.create_per_worker_dataset(strategy.experimental_distribute_dataset(dataset_fn))
    with strategy.scope():
        model._symbolic_build(data_batch=spec)
    iterator = iter(per_worker)
    per_closure = max(1, int(getattr(model, "steps_per_execution", 1) or 1))
    functions: dict = {}

    verbose = 2 if verbose == "auto" else verbose
    if not isinstance(callbacks, callbacks_module.CallbackList):
        callbacks = callbacks_module.CallbackList(
            callbacks, add_history=True, add_progbar=verbose != 0, verbose=verbose, epochs=epochs,
            steps=steps_per_epoch, model=model,
        )
    model.stop_training = False
    callbacks.on_train_begin()
    initial_epoch = getattr(model, "_initial_epoch", None) or initial_epoch  # set by BackupAndRestore

    def train_epoch(epoch: int) -> dict:
        scheduled = 0
        while scheduled < steps_per_epoch:
            steps = min(per_closure, steps_per_epoch - scheduled)
            if steps not in functions:
                functions[steps] = _make_train_function(model, strategy, steps)
            coordinator.schedule(functions[steps], args=(iterator,))
            scheduled += steps
        coordinator.join()
        return dict(pythonify_logs(model.get_metrics_result()))

    def validate() -> dict:
        val_x, val_y, val_sample_weight = data_adapter_utils.unpack_x_y_sample_weight(validation_data)
        return run_on_chief(
            keras_model.Model.evaluate._ks_original, model, x=val_x, y=val_y, sample_weight=val_sample_weight,
            batch_size=validation_batch_size or batch_size, steps=validation_steps, verbose=0, return_dict=True,
        )

    return run_epochs(model, callbacks, epochs, initial_epoch, train_epoch,
                      validate if validation_data is not None else None, validation_freq)
