"""Chief-only side effects under `MultiWorkerMirroredStrategy` (as tf.distribute does them).

Every worker runs the same program, but only the chief should leave files
behind and print progress. On the other workers:

- `ModelCheckpoint`, `TensorBoard` and `CSVLogger` write into
  `workertemp_<task_id>` directories next to the chief's paths, removed when
  training ends;
- `BackupAndRestore` backs up into such a directory too, and every worker
  resumes from the chief's backup (its weights and epoch are broadcast from
  the chief, so other machines need no shared file system);
- `model.save(...)` / `model.save_weights(...)`, and the functions they call
  (`keras.saving.save_model` / `save_weights`, `keras.models.save_model`),
  write to such a temporary location, which is removed at once; every worker
  returns from a save only when the chief's file is complete;
- the progress bar is off (`verbose=0`), and Keras' messages (a callback's
  `verbose=1`: "saving model to ...", "reducing learning rate ...") are not
  printed.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
from typing import Any, Callable, Iterator, Sequence

import keras
import numpy as np
from keras.src.callbacks import BackupAndRestore, CSVLogger, ModelCheckpoint, TensorBoard


from keras_strategies.backend.common import patches


def worker_temp_path(path: str, task_id: Any) -> str:
    """`dir/name` -> `dir/workertemp_<task_id>/name` (TensorFlow's naming)."""
    directory, name = os.path.split(os.fspath(path))
    return os.path.join(directory, f"workertemp_{task_id}", name)


def _redirected_dir(directory: str, task_id: Any) -> str:
    """A callback's `dir` -> `dir/workertemp_<task_id>`, unless a first `fit` redirected it already."""
    directory = os.fspath(directory)
    temp = f"workertemp_{task_id}"
    return directory if os.path.basename(directory) == temp else os.path.join(directory, temp)


def _redirected_path(path: str, task_id: Any) -> str:
    directory, name = os.path.split(os.fspath(path))
    return os.path.join(_redirected_dir(directory, task_id), name)


def _remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.exists(path):
        os.remove(path)


class _WorkerTempDirs(keras.callbacks.Callback):
    """Makes this worker's temporary directories when training begins, or removes them when it ends.

    Placed first in the callback list to make (CSVLogger opens its file in an existing
    directory), last to remove (after the other callbacks have closed their files).
    """

    def __init__(self, make: Sequence[str] = (), remove: Sequence[str] = ()):
        super().__init__()
        self._make, self._remove = list(make), list(remove)

    def on_train_begin(self, logs=None):
        for path in self._make:
            os.makedirs(path, exist_ok=True)

    def on_train_end(self, logs=None):
        for path in self._remove:
            _remove(path)


_PRINT_MSG = patches.declare("keras.src.utils.io_utils.print_msg", "a non-chief worker's callbacks print nothing "
                             "(they would repeat the chief's lines, naming their temporary paths)",
                             when="while a non-chief worker runs `fit`, `evaluate` or `predict`")


def _silent(original: Callable) -> Callable:
    def print_msg(message, line_break=True):
        return None

    return print_msg


@contextlib.contextmanager
def quiet(enabled: bool) -> Iterator[None]:
    """Keras' own messages (`io_utils.print_msg`, which callbacks print with) are dropped for the duration.

    A non-chief worker's callbacks would repeat the chief's lines, naming its temporary paths.
    Warnings and the program's own output are left alone.
    """
    with _PRINT_MSG.applied(_silent) if enabled else contextlib.nullcontext():
        yield


def adapt_callbacks(callbacks: list, task_id: Any) -> list:
    """The callbacks of a non-chief worker: writes redirected or dropped (see module docstring)."""
    temp_dirs, made_dirs = [], []
    for callback in callbacks:
        if isinstance(callback, ModelCheckpoint):
            callback.filepath = _redirected_path(callback.filepath, task_id)
            temp_dirs.append(os.path.dirname(callback.filepath))
        elif isinstance(callback, CSVLogger):
            callback.filename = _redirected_path(callback.filename, task_id)
            temp_dirs.append(os.path.dirname(callback.filename))
            made_dirs.append(temp_dirs[-1])
        elif isinstance(callback, TensorBoard):
            callback.log_dir = _redirected_dir(callback.log_dir, task_id)
            temp_dirs.append(callback.log_dir)
        elif isinstance(callback, BackupAndRestore):
            # Backups go to a temporary directory: restoring takes the chief's state (broadcast
            # after `on_train_begin`), and every worker still makes the same `save` calls.
            backup_dir = _redirected_path(callback.backup_dir, task_id)
            callback.backup_dir = backup_dir
            for name in ("_weights_path", "_training_metadata_path", "_prev_weights_path", "_prev_training_metadata_path"):
                if hasattr(callback, name):
                    setattr(callback, name, os.path.join(backup_dir, os.path.basename(getattr(callback, name))))
            temp_dirs.append(os.path.dirname(backup_dir))
    return ([_WorkerTempDirs(make=made_dirs)] if made_dirs else []) + list(callbacks) + (
        [_WorkerTempDirs(remove=temp_dirs)] if temp_dirs else [])


def _multi_worker_extended(model: Any):
    from keras_strategies.keras_integration.ownership import strategy_of

    extended = getattr(strategy_of(model), "extended", None)
    return extended if extended is not None and extended._num_workers > 1 else None


def _wrap_save(original: Callable) -> Callable:
    """`saving_api.save_model` / `save_weights(model, filepath, ...)`, chief-only under several workers."""

    @functools.wraps(original)
    def save(model, filepath, *args, **kwargs):
        extended = _multi_worker_extended(model)
        if extended is None or not isinstance(filepath, (str, os.PathLike)):
            return original(model, filepath, *args, **kwargs)
        try:
            if extended._is_chief:
                return original(model, filepath, *args, **kwargs)
            temp = worker_temp_path(filepath, extended._cluster.task_id)
            os.makedirs(os.path.dirname(temp), exist_ok=True)
            try:
                return original(model, temp, *args, **kwargs)
            finally:
                _remove(os.path.dirname(temp))
        finally:
            # Every worker returns once the chief's file is complete (then it may be loaded).
            extended._cross_worker_sum([np.zeros((1,), "float32")], "model.save barrier")

    return save


_concurrent_workers = False  # set once this process has joined a multi-worker cluster


def tolerate_concurrent_makedirs() -> None:
    """Makes Keras' `file_utils.makedirs` accept a directory another worker just created.

    Keras checks `exists(dir)` and then creates it; a non-chief creating
    `dir/workertemp_<id>` in between made the chief's `ModelCheckpoint` fail
    with `FileExistsError`. Called when a multi-worker cluster is joined; until
    then the replacement installed by `install()` is Keras' own behaviour.
    """
    global _concurrent_workers
    _concurrent_workers = True


def _wrap_makedirs(original: Callable) -> Callable:
    @functools.wraps(original)
    def makedirs(path):
        try:
            return original(path)
        except FileExistsError:
            if _concurrent_workers and os.path.isdir(path):
                return None
            raise

    return makedirs


_PUBLIC_SAVING_MODULES = ("keras.saving", "keras.models", "keras._tf_keras.keras.saving", "keras._tf_keras.keras.models")
# `Model.save` / `save_weights` call these, so wrapping them covers the methods, `ModelCheckpoint`,
# `BackupAndRestore` and the public functions; the public names were bound when Keras was imported
# and are rebound too (a public module imported later binds the wrapped function itself).
_SAVES = tuple(
    patches.declare(f"keras.src.saving.saving_api.{name}", "only the chief's file is kept under "
                    "MultiWorkerMirroredStrategy", aliases=_PUBLIC_SAVING_MODULES)
    for name in ("save_model", "save_weights")
)
_MAKEDIRS = patches.declare("keras.src.utils.file_utils.makedirs", "once a multi-worker cluster is joined, a directory "
                            "another worker created between Keras' check and its creation is accepted")


def install() -> None:
    """Installs the save hooks (idempotent)."""
    for patch in _SAVES:
        patch.apply(_wrap_save)
    _MAKEDIRS.apply(_wrap_makedirs)
