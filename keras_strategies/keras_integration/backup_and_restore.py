"""`BackupAndRestore` backups that are whole or absent, and saved before a preemption.

Keras writes a backup as two files, the weights and then the epoch they belong
to. A worker stopped between the two (the launcher stops every worker as soon
as one dies, at any moment) leaves the weights of epoch e beside the epoch
number of e - 1, and the restarted job trains epoch e twice. Here both files are
written under temporary names and then renamed into place, with SIGTERM and
SIGINT held back for the two renames. The multi-worker save barrier is left out:
no worker reads a backup while training, and a barrier after the weights is
exactly where a lost worker would leave the chief stranded.

`BackupAndRestore(..., save_before_preemption=True)` (tf.keras' argument) also
backs up when a worker gets SIGTERM: every worker stops at the same step
(`failure_handling/step_agreement.py`), the chief writes the backup with the
batches trained in the epoch, and all exit with code 42. A restarted `fit` of
a strategy's model resumes after those batches, as if never stopped.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import threading
from typing import Callable, Iterator

from keras.src.saving import saving_api
from keras.src.utils import file_utils

from keras_strategies.backend.common import patches
from keras_strategies.keras_integration.ownership import strategy_of
from keras_strategies.sharding import optimizer_state

_HELD_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_TRAINED_BATCHES = "ks_trained_batches"  # metadata of a backup taken inside an epoch


@contextlib.contextmanager
def _stop_signals_held() -> Iterator[None]:
    """SIGTERM / SIGINT that arrive inside are delivered when it ends (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list = []
    previous = {sig: signal.signal(sig, lambda signum, frame: received.append(signum)) for sig in _HELD_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for signum in received:
            signal.raise_signal(signum)


def _wrap_save_model(original: Callable) -> Callable:
    @functools.wraps(original)
    def _save_model(self):
        if strategy_of(self.model) is None:
            return original(self)
        if not file_utils.exists(self.backup_dir):
            file_utils.makedirs(self.backup_dir)
        if getattr(self, "double_checkpoint", False):
            for path, previous in ((self._weights_path, self._prev_weights_path),
                                   (self._training_metadata_path, self._prev_training_metadata_path)):
                if file_utils.exists(path):
                    file_utils.copy(path, previous)
        pending_weights = os.path.join(self.backup_dir, "pending.weights.h5")
        pending_metadata = self._training_metadata_path + ".pending"
        save_weights = getattr(saving_api.save_weights, "_ks_original", saving_api.save_weights)
        save_weights(self.model, pending_weights, overwrite=True)
        metadata = {"epoch": self._current_epoch, "batch": self._last_batch_seen}
        if getattr(self, "_ks_trained_batches", 0):
            metadata[_TRAINED_BATCHES] = self._ks_trained_batches
        with open(pending_metadata, "w") as file:
            json.dump(metadata, file)
        with _stop_signals_held():
            os.replace(pending_weights, self._weights_path)
            os.replace(pending_metadata, self._training_metadata_path)

    return _save_model


def _wrap_init(original: Callable) -> Callable:
    @functools.wraps(original)
    def __init__(self, *args, save_before_preemption: bool = False, **kwargs):
        original(self, *args, **kwargs)
        if not isinstance(save_before_preemption, bool):
            raise ValueError(f"save_before_preemption must be True or False, got {save_before_preemption!r}.")
        self.save_before_preemption = save_before_preemption
        self._ks_preemption = None

    return __init__


def _wrap_load_model(original: Callable) -> Callable:
    @functools.wraps(original)
    def _load_model(self):
        # Variables made while Keras reads a backup are the reader's own (a throwaway optimizer
        # whose state it loads into the model's): they are left out of the check that every
        # worker created the same variables. A worker may restore a backup that others lack (it
        # saved an epoch the chief did not reach); the chief's state is broadcast after it.
        extended = getattr(strategy_of(self.model), "extended", None)
        unsynced = getattr(extended, "_unsynced", None)
        before = len(unsynced) if unsynced is not None else 0
        # Keras builds an unbuilt optimizer whole before it loads; one whose state is split over
        # devices takes the backup's state into its pieces instead.
        with optimizer_state.left_unbuilt(getattr(self.model, "optimizer", None)):
            original(self)
        if unsynced is not None and extended._unsynced is unsynced:
            del unsynced[before:]
        if strategy_of(self.model) is not None and file_utils.exists(self._training_metadata_path):
            with open(self._training_metadata_path) as file:
                self.model._ks_initial_batch = int(json.load(file).get(_TRAINED_BATCHES, 0))

    return _load_model


def _preemption_point(model):
    """The termination notice and the step agreement of one `fit` (see the module docstring)."""
    from keras_strategies.failure_handling.preemption_handler import PreemptionPoint
    from keras_strategies.failure_handling.termination import TerminationConfig
    from keras_strategies.multi_worker.worker_cluster import LOCAL_CLUSTER

    strategy = strategy_of(model)
    cluster = getattr(strategy.extended, "_cluster", None) if strategy is not None else None
    return PreemptionPoint(cluster or LOCAL_CLUSTER, TerminationConfig())


def _wrap_on_train_begin(original: Callable) -> Callable:
    @functools.wraps(original)
    def on_train_begin(self, logs=None):
        original(self, logs)
        if getattr(self, "save_before_preemption", False):
            self._ks_preemption, self._ks_boundaries = _preemption_point(self.model), 0

    return on_train_begin


def _wrap_on_epoch_begin(original: Callable) -> Callable:
    @functools.wraps(original)
    def on_epoch_begin(self, epoch, logs=None):
        self._ks_epoch = epoch
        return original(self, epoch, logs)

    return on_epoch_begin


def _wrap_on_train_batch_end(original: Callable) -> Callable:
    @functools.wraps(original)
    def on_train_batch_end(self, batch, logs=None):
        original(self, batch, logs)
        preemption = getattr(self, "_ks_preemption", None)
        if preemption is None:
            return
        self._ks_boundaries += 1
        if not preemption.due(self._ks_boundaries):
            return

        def save():
            # The backup of a preempted epoch: Keras resumes at its epoch, `fit` after its batches.
            self._current_epoch, self._last_batch_seen = getattr(self, "_ks_epoch", 0), batch
            self._ks_trained_batches = batch + 1
            self._save_model()
            self._ks_trained_batches = 0

        preemption.save_and_exit(save)

    return on_train_batch_end


def _wrap_on_train_end(original: Callable) -> Callable:
    @functools.wraps(original)
    def on_train_end(self, logs=None):
        preemption = getattr(self, "_ks_preemption", None)
        if preemption is not None:
            preemption.close()
            self._ks_preemption = None
        return original(self, logs)

    return on_train_end


_PRE = "tf.keras' `save_before_preemption=True`: on SIGTERM every worker backs up at the same step and exits"
_B = "keras.src.callbacks.backup_and_restore.BackupAndRestore"
_PATCHES = (
    (patches.declare(f"{_B}.__init__", f"{_PRE} (the argument)"), _wrap_init),
    (patches.declare(f"{_B}._save_model", "a backup is whole or absent: a worker stopped while saving never leaves "
                     "weights beside the previous epoch's number"), _wrap_save_model),
    (patches.declare(f"{_B}._load_model", "`fit` resumes after the batches a preempted epoch trained; variables "
                     "Keras makes while reading a backup are left out of the workers' same-variables check"),
     _wrap_load_model),
    (patches.declare(f"{_B}.on_train_begin", f"{_PRE} (the termination notice is armed)"), _wrap_on_train_begin),
    (patches.declare(f"{_B}.on_epoch_begin", f"{_PRE} (the epoch a preemption backup records; Keras' class "
                     "inherits `Callback`'s no-op)"), _wrap_on_epoch_begin),
    (patches.declare(f"{_B}.on_train_batch_end", f"{_PRE} (the step where every worker backs up)"),
     _wrap_on_train_batch_end),
    (patches.declare(f"{_B}.on_train_end", f"{_PRE} (the termination notice is closed)"), _wrap_on_train_end),
)


def install() -> None:
    """Installs the hooks (idempotent)."""
    for patch, wrap in _PATCHES:
        patch.apply(wrap)
