"""The epoch loop of `fit`, shared by every strategy.

Synchronous strategies (`loops.py`) and `ParameterServerStrategy`
(`parameter_server.py`) differ in how an epoch's steps run, not in what
happens around them: metrics reset, `on_epoch_begin`, validation on the epochs
Keras' `validation_freq` selects (an int or a list of epochs), `val_` logs,
`on_epoch_end`, stopping, `use_ema`'s final averages and `on_train_end`. One
loop keeps the two `fit`s from drifting apart.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from keras.src import optimizers as optimizers_module


def run_epochs(model: Any, callbacks: Any, epochs: int, initial_epoch: int, train_epoch: Callable[[int], dict],
               validate: Optional[Callable[[], dict]] = None, validation_freq: Any = 1,
               agree_to_stop: Callable[[bool], bool] = bool) -> Any:
    """Runs epochs `initial_epoch .. epochs - 1` after `callbacks.on_train_begin()`; returns the History.

    Args:
        model: The compiled model.
        callbacks: Its `CallbackList`.
        epochs: The index of the epoch after the last.
        initial_epoch: The first epoch to run.
        train_epoch: Runs one epoch's steps (the argument is its index) and returns its logs.
        validate: Evaluates the validation data and returns its logs (None: no validation).
        validation_freq: Keras' `validation_freq`: every n-th epoch, or a list of epochs (from 1).
        agree_to_stop: Whether to stop, from this process' `model.stop_training`: with several
            workers, every worker's answer, so that all of them leave together.
    """
    logs: dict = {}
    for epoch in range(initial_epoch, epochs):
        model.reset_metrics()
        callbacks.on_epoch_begin(epoch)
        epoch_logs = dict(train_epoch(epoch))
        if validate is not None and model._should_eval(epoch, validation_freq):
            epoch_logs.update({f"val_{name}": value for name, value in validate().items()})
        callbacks.on_epoch_end(epoch, epoch_logs)
        logs = epoch_logs
        model.stop_training = agree_to_stop(bool(model.stop_training))
        if model.stop_training:
            break
    if isinstance(model.optimizer, optimizers_module.Optimizer) and epochs > 0:
        model.optimizer.finalize_variable_values(model.trainable_weights)  # use_ema's averages
    callbacks.on_train_end(logs=logs)
    return model.history
