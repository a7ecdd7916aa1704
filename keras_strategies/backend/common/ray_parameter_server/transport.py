"""Sending closures, with the Keras objects they capture, from the chief to the workers.

A closure is pickled (cloudpickle) with copies of the model, optimizer and
metrics it uses. Keras variables that live on the parameter servers pickle as
their registry key: on a worker, every pickled copy of one variable becomes
the same worker-side variable (`WORKER_VARIABLES`), whose value the worker
pulls before each closure. Keras' own pickling of models, metrics and
optimizers (a saved `.keras` file each) would copy them apart from each other;
here they pickle as plain objects so that they keep sharing variables.
"""

from __future__ import annotations

import io
import os
import pickle
import sys
from typing import Any, Callable, Mapping

import keras
from keras.src.saving.keras_saveable import KerasSaveable
from keras.src.utils.tracking import TrackedDict, TrackedList, TrackedSet
from ray import cloudpickle

# Worker side: registry key -> the worker's copy of that variable.
WORKER_VARIABLES: dict = {}
# Worker side: resource key -> built resource (datasets, iterators), and its builder.
WORKER_RESOURCES: dict = {}
RESOURCE_BUILDER: list = [None]


def _variable(key: int, cls: type) -> Any:
    existing = WORKER_VARIABLES.get(key)
    if existing is not None:
        return existing
    variable = cls.__new__(cls)
    WORKER_VARIABLES[key] = variable
    return variable


def _set_variable_state(variable: Any, state: dict) -> None:
    if not getattr(variable, "_ks_restored", False):
        variable.__dict__.update(state)
        variable._ks_restored = True


def _new(cls: type) -> Any:
    return cls.__new__(cls)


def _set_container(obj: Any, state: tuple) -> None:
    attributes, items = state
    obj.__dict__.update(attributes)
    if isinstance(obj, list):
        list.extend(obj, items)
    elif isinstance(obj, dict):
        dict.update(obj, items)
    else:
        set.update(obj, items)


def _set_optimizer(optimizer: Any, state: dict) -> None:
    optimizer.__dict__.update(state)
    # Keras keys an optimizer's variables by id(), which changes with the copy.
    if "_trainable_variables" in state:
        optimizer._trainable_variables_indices = {
            optimizer._var_key(v): i for i, v in enumerate(optimizer._trainable_variables)}


def _resource(key: str) -> Any:
    if key not in WORKER_RESOURCES:
        WORKER_RESOURCES[key] = RESOURCE_BUILDER[0](key)
    return WORKER_RESOURCES[key]


class _Pickler(cloudpickle.Pickler):
    def __init__(self, file: io.BytesIO, keys: Mapping[int, int], resources: dict):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._keys = keys
        self._resources = resources

    def reducer_override(self, obj: Any) -> Any:
        replace = getattr(type(obj), "_ks_worker_copy", None)
        if replace is not None and not isinstance(obj, type):
            return (_identity, (obj._ks_worker_copy(),))
        if isinstance(obj, keras.Variable):
            key = self._keys.get(id(obj))
            if key is not None:
                return (_variable, (key, type(obj)), obj.__getstate__(), None, None, _set_variable_state)
            return super().reducer_override(obj)
        if isinstance(obj, keras.optimizers.Optimizer):
            return (_new, (type(obj),), obj.__getstate__(), None, None, _set_optimizer)
        if isinstance(obj, KerasSaveable) and type(obj).__reduce__ is KerasSaveable.__reduce__:
            return (_new, (type(obj),), obj.__getstate__())
        if isinstance(obj, (TrackedList, TrackedDict, TrackedSet)):
            base = list if isinstance(obj, TrackedList) else dict if isinstance(obj, TrackedDict) else set
            return (_new, (type(obj),), (dict(obj.__dict__), base(obj)), None, None, _set_container)
        if getattr(type(obj), "_ks_worker_resource", False):
            self._resources[obj.key] = obj
            return (_resource, (obj.key,))
        return super().reducer_override(obj)


def _identity(value: Any) -> Any:
    return value


def dumps(obj: Any, keys: Mapping[int, int], resources: dict) -> bytes:
    """Pickles `obj` for a worker; `resources` receives the worker resources it refers to (key -> resource)."""
    _by_value(obj)
    buffer = io.BytesIO()
    _Pickler(buffer, keys, resources).dump(obj)
    return buffer.getvalue()


def loads(data: bytes) -> Any:
    return pickle.loads(data)


def _by_value(obj: Any) -> None:
    """The user's own modules (scripts, tests, local helpers) travel by value: workers need not import them.

    Installed packages (under the interpreter's prefix) and keras_strategies travel by reference.
    """
    prefixes = tuple({os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)})
    for name, module in list(sys.modules.items()):
        if name in _BY_VALUE or name == "__main__" or module is None:
            continue
        _BY_VALUE.add(name)
        path = getattr(module, "__file__", None)
        if not path or name.split(".")[0] in ("keras_strategies", "keras", "ray"):
            continue
        path = os.path.realpath(path)
        if path.startswith(prefixes) or "site-packages" in path or "dist-packages" in path:
            continue
        try:
            cloudpickle.register_pickle_by_value(module)
        except (ValueError, TypeError):
            pass


_BY_VALUE: set = set()


def to_numpy(structure: Any, convert: Callable[[Any], Any]) -> Any:
    """`structure` with every tensor or variable replaced by a NumPy array."""
    return keras.tree.map_structure(convert, structure)
