"""Chief-only side effects under `MultiWorkerMirroredStrategy` (as tf.distribute does them).

Every worker runs the same program, but only the chief should leave files
behind and print progress. On the other workers:

- `ModelCheckpoint` and `TensorBoard` write into `workertemp_<task_id>`
  directories next to the chief's paths, removed when training ends;
- `BackupAndRestore` never writes or deletes: every worker resumes from the
  chief's backup (the weights are then broadcast from the chief, so other
  machines need no shared file system);
- `model.save(...)` / `model.save_weights(...)` write to such a temporary
  location, which is removed at once;
- the progress bar is off (`verbose=0`).
"""

from __future__ import annotations

import functools
import os
import shutil
from typing import Any, Callable

import keras
from keras.src.callbacks import BackupAndRestore, ModelCheckpoint, TensorBoard


def worker_temp_path(path: str, task_id: Any) -> str:
    """`dir/name` -> `dir/workertemp_<task_id>/name` (TensorFlow's naming)."""
    directory, name = os.path.split(os.fspath(path))
    return os.path.join(directory, f"workertemp_{task_id}", name)


def _remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.exists(path):
        os.remove(path)


class _RemoveWorkerTemp(keras.callbacks.Callback):
    """Removes this worker's temporary directories when training ends."""

    def __init__(self, paths: list):
        super().__init__()
        self._paths = paths

    def on_train_end(self, logs=None):
        for path in self._paths:
            _remove(path)


def _no_op(*args: Any, **kwargs: Any) -> None:
    return None


def adapt_callbacks(callbacks: list, task_id: Any) -> list:
    """The callbacks of a non-chief worker: writes redirected or dropped (see module docstring)."""
    temp_dirs = []
    for callback in callbacks:
        if isinstance(callback, ModelCheckpoint):
            callback.filepath = worker_temp_path(callback.filepath, task_id)
            temp_dirs.append(os.path.dirname(callback.filepath))
        elif isinstance(callback, TensorBoard):
            callback.log_dir = os.path.join(callback.log_dir, f"workertemp_{task_id}")
            temp_dirs.append(callback.log_dir)
        elif isinstance(callback, BackupAndRestore):
            callback._save_model = _no_op  # noqa: SLF001 - the chief alone writes backups
            callback.on_train_end = _no_op  # ...and deletes them
    return list(callbacks) + ([_RemoveWorkerTemp(temp_dirs)] if temp_dirs else [])


def _non_chief_task(model: Any):
    from keras_strategies.keras_hooks import strategy_of

    strategy = strategy_of(model)
    extended = getattr(strategy, "extended", None)
    if extended is None or extended._num_workers == 1 or extended._is_chief:
        return None
    return extended._cluster.task_id


def _wrap_save(original: Callable) -> Callable:
    @functools.wraps(original)
    def save(self, filepath, *args, **kwargs):
        task_id = _non_chief_task(self)
        if task_id is None or not isinstance(filepath, (str, os.PathLike)):
            return original(self, filepath, *args, **kwargs)
        temp = worker_temp_path(filepath, task_id)
        os.makedirs(os.path.dirname(temp), exist_ok=True)
        try:
            return original(self, temp, *args, **kwargs)
        finally:
            _remove(os.path.dirname(temp))

    save._ks_original = original
    return save


def install() -> None:
    """Installs the `Model.save` / `save_weights` hooks (idempotent)."""
    for name in ("save", "save_weights"):
        method = getattr(keras.Model, name)
        if not hasattr(method, "_ks_original"):
            setattr(keras.Model, name, _wrap_save(method))
