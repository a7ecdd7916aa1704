"""`ks.experimental.Checkpoint` and `CheckpointManager`: `tf.train`'s checkpoints for every backend.

TensorFlow's custom-loop recipes (preemption handling among them) save a
`tf.train.Checkpoint(model=..., optimizer=...)`, which exists only on
TensorFlow. These two keep that shape on JAX and PyTorch: a checkpoint names
Keras objects, writes the values of all their variables to one `.npz` file
(whole or absent: written aside, then renamed) and reads them back into the
same objects.
"""

from __future__ import annotations

import os
import re
from typing import Any, Optional

import numpy as np
import keras

from keras_strategies.sharding import optimizer_state

_SUFFIX = ".npz"


def _trainable_variables(objects: dict) -> list:
    variables = []
    for obj in objects.values():
        variables.extend(getattr(obj, "trainable_variables", None) or [])
    return variables


class Checkpoint:
    """The variables of named Keras objects, saved to and restored from one file.

    Objects are Keras models and layers, optimizers, metrics, single Keras
    variables or anything with a `variables` list. An optimizer that has not
    built its slots yet is built over the checkpoint's trainable variables
    before a restore (as Keras' `BackupAndRestore` does), so a restore can come
    before the first step.

    Args:
        **objects: The objects to save, by name (`model=model, optimizer=optimizer`).

    Examples:
        ```python
        checkpoint = ks.experimental.Checkpoint(model=model, optimizer=optimizer)
        path = checkpoint.save("/tmp/ckpt/step")  # "/tmp/ckpt/step-1"
        checkpoint.restore(path)
        ```
    """

    def __init__(self, **objects: Any):
        if not objects:
            raise ValueError("ks.experimental.Checkpoint needs at least one object, e.g. Checkpoint(model=model).")
        for name, obj in objects.items():
            if not (hasattr(obj, "variables") or hasattr(obj, "assign")):
                raise ValueError(
                    f"Checkpoint({name}=...) got {type(obj).__name__!r}, which has no variables. Pass Keras "
                    "models, layers, optimizers, metrics or variables."
                )
        self._objects = dict(objects)
        self.save_counter = 0

    def _variables(self, name: str) -> list:
        obj = self._objects[name]
        return [obj] if hasattr(obj, "assign") and not hasattr(obj, "variables") else list(obj.variables)

    def write(self, file_prefix: str) -> str:
        """Writes every variable's value to `file_prefix + ".npz"`; returns `file_prefix`."""
        values = {}
        for name in self._objects:
            whole = optimizer_state.whole_state(self._objects[name])  # an optimizer's state split over devices
            if whole is None:
                whole = [np.asarray(keras.ops.convert_to_numpy(v.value)) for v in self._variables(name)]
            for i, value in enumerate(whole):
                values[f"{name}/{i}"] = value
        directory = os.path.dirname(os.path.abspath(file_prefix))
        os.makedirs(directory, exist_ok=True)
        pending = f"{file_prefix}.pending{_SUFFIX}"
        np.savez(pending, **values)
        os.replace(pending, file_prefix + _SUFFIX)
        return file_prefix

    def save(self, file_prefix: str) -> str:
        """Writes a numbered checkpoint, `f"{file_prefix}-{n}"` for the n-th save; returns its path."""
        self.save_counter += 1
        return self.write(f"{file_prefix}-{self.save_counter}")

    def read(self, save_path: str) -> "Checkpoint":
        """Assigns the values saved at `save_path` (a path `write` or `save` returned)."""
        file = save_path if save_path.endswith(_SUFFIX) else save_path + _SUFFIX
        if not os.path.exists(file):
            raise FileNotFoundError(f"No checkpoint at {save_path!r} (looked for {file!r}).")
        with np.load(file) as saved:
            stored = {name: sorted((k for k in saved.files if k.split("/")[0] == name),
                                   key=lambda k: int(k.split("/")[1])) for name in self._objects}
            for name, keys in stored.items():
                variables = self._variables(name)
                obj = self._objects[name]
                if isinstance(obj, keras.optimizers.Optimizer) and optimizer_state.load_whole_state(
                        obj, [saved[key] for key in keys]):
                    continue  # into the pieces of a state split over devices
                if len(keys) > len(variables) and getattr(obj, "built", True) is False and hasattr(obj, "build"):
                    obj.build(_trainable_variables(self._objects))  # an optimizer before its first step
                    variables = self._variables(name)
                if len(keys) != len(variables):
                    raise ValueError(
                        f"The checkpoint {save_path!r} holds {len(keys)} variable(s) for {name!r}, which has "
                        f"{len(variables)}. Restore into the same kind of objects that were saved (same "
                        "model and optimizer)."
                    )
                for key, variable in zip(keys, variables):
                    value = saved[key]
                    if tuple(value.shape) != tuple(variable.shape):
                        raise ValueError(
                            f"The checkpoint {save_path!r} holds shape {tuple(value.shape)} for {key!r}; "
                            f"the variable {variable.path!r} has shape {tuple(variable.shape)}."
                        )
                    variable.assign(value)
        return self

    restore = read


class CheckpointManager:
    """Numbered checkpoints of one `Checkpoint` in a directory, keeping the newest `max_to_keep`.

    As `tf.train.CheckpointManager`: `save()` writes `<directory>/ckpt-<n>`,
    `latest_checkpoint` is the newest one (also after a restart), and
    `restore_or_initialize()` restores it if there is one.

    Examples:
        ```python
        manager = ks.experimental.CheckpointManager(checkpoint, "/tmp/ckpt", max_to_keep=3)
        manager.restore_or_initialize()  # the newest checkpoint, if any
        manager.save()  # "/tmp/ckpt/ckpt-1", then ckpt-2, ...
        ```
    """

    def __init__(self, checkpoint: Checkpoint, directory: str, max_to_keep: Optional[int] = 5,
                 checkpoint_name: str = "ckpt"):
        if not isinstance(checkpoint, Checkpoint):
            raise ValueError(
                f"CheckpointManager manages a ks.experimental.Checkpoint, got {type(checkpoint).__name__!r}."
            )
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"max_to_keep must be at least 1 or None (keep all), got {max_to_keep!r}.")
        self.checkpoint = checkpoint
        self.directory = directory
        self._max_to_keep = max_to_keep
        self._name = checkpoint_name
        self._pattern = re.compile(rf"^{re.escape(checkpoint_name)}-(\d+){re.escape(_SUFFIX)}$")

    def _numbers(self) -> list:
        if not os.path.isdir(self.directory):
            return []
        found = (self._pattern.match(name) for name in os.listdir(self.directory))
        return sorted(int(match.group(1)) for match in found if match)

    @property
    def checkpoints(self) -> list:
        """The paths of the kept checkpoints, oldest first."""
        return [os.path.join(self.directory, f"{self._name}-{n}") for n in self._numbers()]

    @property
    def latest_checkpoint(self) -> Optional[str]:
        """The newest checkpoint's path, or None."""
        paths = self.checkpoints
        return paths[-1] if paths else None

    def save(self, checkpoint_number: Optional[int] = None) -> str:
        """Writes `ckpt-<checkpoint_number>` (default: one more than the newest) and drops the oldest."""
        numbers = self._numbers()
        if checkpoint_number is None:
            checkpoint_number = (numbers[-1] if numbers else 0) + 1
        path = self.checkpoint.write(os.path.join(self.directory, f"{self._name}-{int(checkpoint_number)}"))
        if self._max_to_keep is not None:
            for old in self.checkpoints[:-self._max_to_keep]:
                os.remove(old + _SUFFIX)
        return path

    def restore_or_initialize(self) -> Optional[str]:
        """Restores the newest checkpoint and returns its path; None when there is none."""
        latest = self.latest_checkpoint
        if latest is not None:
            self.checkpoint.read(latest)
        return latest


def checkpoint_number(path: Optional[str]) -> int:
    """The number at the end of a managed checkpoint's path (`.../ckpt-12` -> 12), 0 for None."""
    if path is None:
        return 0
    match = re.search(r"-(\d+)(?:\.npz)?$", path)
    return int(match.group(1)) if match else 0
