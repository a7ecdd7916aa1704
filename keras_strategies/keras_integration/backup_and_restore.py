"""`BackupAndRestore` backups that are whole or absent, for models of a strategy.

Keras writes a backup as two files, the weights and then the epoch they belong
to. A worker stopped between the two (the launcher stops every worker as soon
as one dies, at any moment) leaves the weights of epoch e beside the epoch
number of e - 1, and the restarted job trains epoch e twice. Here both files are
written under temporary names and then renamed into place, with SIGTERM and
SIGINT held back for the two renames. The multi-worker save barrier is left out:
no worker reads a backup while training, and a barrier after the weights is
exactly where a lost worker would leave the chief stranded.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import threading
from typing import Callable, Iterator

from keras.src.callbacks.backup_and_restore import BackupAndRestore
from keras.src.saving import saving_api
from keras.src.utils import file_utils

from keras_strategies.keras_integration.ownership import strategy_of

_HELD_SIGNALS = (signal.SIGTERM, signal.SIGINT)


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
        with open(pending_metadata, "w") as file:
            json.dump({"epoch": self._current_epoch, "batch": self._last_batch_seen}, file)
        with _stop_signals_held():
            os.replace(pending_weights, self._weights_path)
            os.replace(pending_metadata, self._training_metadata_path)

    _save_model._ks_original = original
    return _save_model


def install() -> None:
    """Installs the hook (idempotent)."""
    if not hasattr(BackupAndRestore._save_model, "_ks_original"):
        BackupAndRestore._save_model = _wrap_save_model(BackupAndRestore._save_model)
