"""The Ray actors: parameter-server shards and workers (backend-neutral; each process runs Keras' backend).

A shard holds its pieces of the variables as Keras variables and, for every
optimizer whose variables it holds, an optimizer of the same class and
configuration built on its pieces: gradients are applied on the shard as they
arrive, without waiting for other workers. Each update carries a token (the
closure's id and the update's number in it) and is applied once, even when a
lost worker's closure runs again elsewhere.

A worker receives closures with copies of the Keras objects they use, reads
the current values before each closure, and sends its gradients
(`optimizer.apply`, which `apply_gradients` calls) and other variable changes
(metrics' `assign_add`, moving statistics) to the shards. An optimizer first
used in a closure is built by the chief on the variables it was given (as
TensorFlow creates slots at the first `apply_gradients`): the closure stops
before sending anything, and runs again from the same values and input.
"""

from __future__ import annotations

import os
import threading
import uuid
from typing import Any, Optional

import numpy as np

from keras_strategies.backend.common.ray_parameter_server.tensors import tensor_ops


def _import_keras(backend: str) -> Any:
    os.environ["KERAS_BACKEND"] = backend
    import keras

    return keras


def _numpy(keras: Any, value: Any) -> np.ndarray:
    if isinstance(value, keras.Variable):
        value = value.value
    if hasattr(value, "detach"):
        value = value.detach()
    return np.array(keras.ops.convert_to_numpy(value))


class ParameterShard:
    """One parameter server's share of the variables and the optimizers that update them."""

    def __init__(self, index: int, backend: str):
        self.index = index
        self.keras = _import_keras(backend)
        self.ops = tensor_ops(backend)
        self.values: dict = {}  # piece id -> keras.Variable
        self.optimizers: dict = {}  # optimizer key -> (optimizer, [piece ids of its trainable pieces])
        self.applied: set = set()
        self.read_buffers: dict = {}  # piece id -> earlier copies that `read` may reuse
        self.lock = threading.Lock()

    def ping(self) -> int:
        return os.getpid()

    def reset(self) -> None:
        """Forgets every variable and optimizer (a new strategy starts on the same processes)."""
        with self.lock:
            self.values.clear()
            self.read_buffers.clear()
            self.optimizers.clear()
            self.applied.clear()

    def setup(self, pieces: dict, optimizers: dict) -> None:
        """Creates pieces ({piece id: initial value}) and optimizers ({key: spec}); see `Registry`."""
        keras = self.keras
        with self.lock, self.ops.no_grad():
            for pid, value in pieces.items():
                if pid in self.values and tuple(self.values[pid].shape) == value.shape:
                    self.values[pid].assign(value)
                else:
                    self.values[pid] = keras.Variable(value, dtype=str(value.dtype), trainable=False,
                                                      name=_piece_name(pid))
            for key, spec in optimizers.items():
                import pickle

                cls = pickle.loads(spec["class"])
                optimizer = cls.from_config(spec["config"])
                trainable = []
                for pid in spec["trainable"]:
                    value = spec["values"][pid]
                    trainable.append(keras.Variable(value, dtype=str(value.dtype), name=_piece_name(pid)))
                optimizer.build(trainable)
                by_name = {v.name: v for v in optimizer.variables}
                slot_ids = {id(v) for v in _slot_set(optimizer, trainable)}
                others = [v for v in optimizer.variables if id(v) not in slot_ids]
                for pid, variable in zip(spec["trainable"], trainable):
                    self.values[pid] = variable
                for pid, (ref_pid, slot_name) in spec["slots"].items():
                    slot = by_name.get(f"{_piece_name(ref_pid)}_{slot_name}")
                    if slot is None:
                        raise RuntimeError(f"the {cls.__name__} optimizer on ps {self.index} made no '{slot_name}' "
                                           f"variable for {ref_pid}; its variables: {sorted(by_name)}")
                    self.values[pid] = slot
                for pid, position in spec["others"].items():
                    self.values[pid] = others[position]
                for pid, value in spec["values"].items():
                    self.values[pid].assign(value)
                self.optimizers[key] = (optimizer, list(spec["trainable"]))

    def read(self, pids: list, forget_tokens: bool = False) -> list:
        """Current values of `pids`; with `forget_tokens`, also forgets which updates were applied
        (the chief asks when no closure can run again: the queue is idle)."""
        with self.lock:
            if forget_tokens:
                self.applied.clear()
            return [self.ops.snapshot(self.keras, self.values[pid], self.read_buffers.setdefault(pid, []))
                    for pid in pids]

    def write(self, values: dict) -> None:
        with self.lock, self.ops.no_grad():
            for pid, value in values.items():
                self.values[pid].assign(value)

    def add(self, token: Optional[tuple], values: dict) -> None:
        with self.lock, self.ops.no_grad():
            if token is not None:
                if token in self.applied:
                    return
                self.applied.add(token)
            for pid, delta in values.items():
                variable = self.values[pid]
                variable.assign(variable.value + self.keras.ops.convert_to_tensor(delta, variable.dtype))

    def apply(self, key: int, token: Optional[tuple], grads: dict) -> None:
        """Applies `grads` ({piece id: gradient}) with optimizer `key`, once per token."""
        keras = self.keras
        with self.lock, self.ops.no_grad():
            if token is not None:
                if token in self.applied:
                    return
                self.applied.add(token)
            optimizer, pieces = self.optimizers[key]
            chosen = [pid for pid in pieces if pid in grads]
            if chosen:
                self.ops.apply(keras, optimizer, self.ops.gradients(keras, [grads[pid] for pid in chosen]),
                               [self.values[pid] for pid in chosen])
            else:
                optimizer.iterations.assign_add(1)


def _piece_name(pid: tuple) -> str:
    return f"v{pid[0]}p{pid[1]}"


def _slot_set(optimizer: Any, trainable: list) -> list:
    prefixes = [v.path.replace("/", "_") + "_" for v in trainable]
    return [v for v in optimizer.variables if any(v.name.startswith(p) for p in prefixes)]


class OptimizerNotPlaced(Exception):
    """A closure applied gradients with an optimizer that has no variables on the parameter servers yet
    (created in the scope, first used in a scheduled step): the chief builds it there, and the
    closure runs again (`BuildRequest`)."""

    def __init__(self, key: int, variables: list):
        super().__init__(f"optimizer {key} is not on the parameter servers yet")
        self.key, self.variables = key, variables


class BuildRequest:
    """What a worker answers a closure that stopped at `OptimizerNotPlaced`: which optimizer (its
    `iterations` key) to build on which variables (their keys). Nothing of the closure was sent
    to the shards; it runs again from the same values and input elements."""

    def __init__(self, key: int, variables: list):
        self.key, self.variables = key, variables


# A closure's input elements, kept so that a closure run again after a `BuildRequest` reads the
# same ones: {"taken": [(iterator id, element)], "replay": {iterator id: [elements]}}.
_CLOSURE_INPUT = threading.local()


class _NumpyIterator:
    """Iterates a worker's dataset, giving NumPy values (tf.data tensors included)."""

    def __init__(self, iterable: Any):
        self._iterator = iter(iterable)

    def __iter__(self) -> "_NumpyIterator":
        return self

    def __next__(self) -> Any:
        import keras

        state = getattr(_CLOSURE_INPUT, "state", None)
        queue = state["replay"].get(id(self)) if state is not None else None
        if queue:
            element = queue.pop(0)
        else:
            element = next(self._iterator)
            element = keras.tree.map_structure(lambda t: t.numpy() if hasattr(t, "numpy") else t, element)
        if state is not None:
            state["taken"].append((id(self), element))
        return element

    def get_next(self) -> Any:
        return next(self)


class WorkerRestarted(RuntimeError):
    """A closure reached a worker process that lacks the functions, variables and datasets sent before."""


class WorkerActor:
    """Runs closures: pulls values, runs, sends gradients and variable changes to the shards."""

    def __init__(self, index: int, backend: str, shard_names: list):
        self.index = index
        self.keras = _import_keras(backend)
        self.ops = tensor_ops(backend)
        self.shard_names = shard_names
        self.incarnation = uuid.uuid4().hex  # a restarted actor is a new process without any state
        self.shard_handles: dict = {}
        self.layout: dict = {}  # key -> [(shard, start, stop, pid)]
        self.optimizer_layout: dict = {}  # optimizer key -> {"variables": [keys], "shards": [...]}
        self.functions: dict = {}
        self.definitions: dict = {}
        self.context = threading.local()
        self._stopped: dict = {}  # closure id -> (snapshot, input elements) of a `BuildRequest`
        from keras_strategies.backend.common.ray_parameter_server import transport

        self.transport = transport
        transport.RESOURCE_BUILDER[0] = self._build_resource
        _install_apply_hook(self)

    def ping(self) -> int:
        return os.getpid()

    def reset(self) -> None:
        """Forgets every variable, function and dataset (a new strategy starts on the same processes)."""
        self.layout, self.optimizer_layout = {}, {}
        self.shard_handles.clear()
        self.functions.clear()
        self.definitions.clear()
        self._stopped.clear()
        self.transport.WORKER_VARIABLES.clear()
        self.transport.WORKER_RESOURCES.clear()

    def run(self, incarnation: Optional[str], closure_id: str, function_key: int, function_bytes: Optional[bytes],
            call_bytes: bytes, layout: Optional[tuple], definitions: dict) -> tuple:
        """Runs a closure; returns `(this process's incarnation, the result)`. `incarnation` is the process the
        chief sent its state to (None: everything comes with this call)."""
        if incarnation is not None and incarnation != self.incarnation:
            raise WorkerRestarted(f"worker {self.index} restarted since the chief last sent it its state")
        transport = self.transport
        if layout is not None:
            self.layout, self.optimizer_layout, shard_names = layout
            if shard_names != self.shard_names:  # a parameter server was started anew
                self.shard_names = list(shard_names)
                self.shard_handles.clear()
        self.definitions.update(definitions)
        if function_bytes is not None:
            self.functions[function_key] = transport.loads(function_bytes)
        fn = self.functions[function_key]
        with _worker_index(self.index):  # per-worker datasets are built while the arguments load
            args, kwargs = transport.loads(call_bytes)
        keys = [k for k in transport.WORKER_VARIABLES if k in self.layout]
        snapshot = self._pull(keys)
        # A closure that stopped for an optimizer to be built starts again from what it read then.
        earlier_snapshot, earlier_input = self._stopped.pop(closure_id, ({}, []))
        self._restore(earlier_snapshot)
        snapshot.update({key: value for key, value in earlier_snapshot.items() if key in snapshot})
        replay: dict = {}
        for iterator_id, element in earlier_input:
            replay.setdefault(iterator_id, []).append(element)
        _CLOSURE_INPUT.state = {"taken": [], "replay": replay}
        self.context.closure = (closure_id, snapshot, [0])
        try:
            with _worker_index(self.index):
                result = fn(*args, **kwargs)
            self._send_changes(closure_id, keys, snapshot)
        except OptimizerNotPlaced as request:
            self._stopped[closure_id] = (snapshot, _CLOSURE_INPUT.state["taken"])
            return self.incarnation, BuildRequest(request.key, request.variables)
        finally:
            self.context.closure = None
            _CLOSURE_INPUT.state = None
        keras = self.keras

        def convert(value: Any) -> Any:
            if isinstance(value, keras.Variable) or keras.ops.is_tensor(value):
                return _numpy(keras, value)
            return value

        return self.incarnation, keras.tree.map_structure(convert, result)

    # -- values ----------------------------------------------------------------------------

    def _restore(self, snapshot: dict) -> None:
        """Gives the worker's variables the values of `snapshot` ({key: value})."""
        variables = self.transport.WORKER_VARIABLES
        with self.ops.no_grad():
            for key, value in snapshot.items():
                if key in variables:
                    self.ops.assign(self.keras, variables[key], value)

    def _shard(self, index: int) -> Any:
        """The actor of parameter server `index` (looked up by name when first used)."""
        import ray

        if index not in self.shard_handles:
            try:
                self.shard_handles[index] = ray.get_actor(self.shard_names[index])
            except ValueError:
                from keras_strategies.backend.common.remote_errors import (
                    ParameterServerUnavailableError,
                    parameter_server_device,
                )

                raise ParameterServerUnavailableError(parameter_server_device(index), "its actor is gone") from None
        return self.shard_handles[index]

    def _call_shards(self, calls: list) -> list:
        import ray

        refs = [getattr(self._shard(shard), method).remote(*args) for shard, method, args in calls]
        results = []
        for (shard, _, _), ref in zip(calls, refs):
            try:
                results.append(ray.get(ref))
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as error:
                from keras_strategies.backend.common.remote_errors import (
                    ParameterServerUnavailableError,
                    parameter_server_device,
                )

                raise ParameterServerUnavailableError(parameter_server_device(shard), type(error).__name__) from None
        return results

    def _pull(self, keys: list) -> dict:
        """Assigns the shards' current values to the worker's variables `keys`; returns them as NumPy."""
        by_shard: dict = {}
        for key in keys:
            for shard, _, _, pid in self.layout[key]:
                by_shard.setdefault(shard, []).append(pid)
        shards = sorted(by_shard)
        results = self._call_shards([(s, "read", (by_shard[s],)) for s in shards])
        pieces = {pid: value for s, values in zip(shards, results) for pid, value in zip(by_shard[s], values)}
        snapshot = {}
        variables = self.transport.WORKER_VARIABLES
        with self.ops.no_grad():
            for key in keys:
                parts = [pieces[pid] for _, _, _, pid in self.layout[key]]
                value = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)
                self.ops.assign(self.keras, variables[key], value)
                snapshot[key] = value
        return snapshot

    def _send_changes(self, closure_id: str, keys: list, snapshot: dict) -> None:
        by_shard: dict = {}
        variables = self.transport.WORKER_VARIABLES
        for key in keys:
            before = snapshot[key]
            if before.dtype == bool or not np.issubdtype(before.dtype, np.number):
                continue
            delta = _numpy(self.keras, variables[key]) - before
            if not np.any(delta):
                continue
            for shard, start, stop, pid in self.layout[key]:
                by_shard.setdefault(shard, {})[pid] = delta if start is None else delta[start:stop]
        self._call_shards([(s, "add", ((closure_id, "end"), values)) for s, values in sorted(by_shard.items())])

    def apply(self, optimizer: Any, key: int, grads: list, variables: list) -> None:
        """The worker's `optimizer.apply`: sends the gradients to the shards, then reads the new values."""
        closure = getattr(self.context, "closure", None)
        if closure is None:
            raise RuntimeError("a parameter-server optimizer can only apply gradients inside a scheduled closure")
        closure_id, snapshot, counter = closure
        spec = self.optimizer_layout.get(key)
        keys_of = {id(v): k for k, v in self.transport.WORKER_VARIABLES.items()}
        if spec is None:  # first used here: the chief builds it, each slot beside its variable
            placed = [keys_of.get(id(variable)) for variable in variables]
            missing = [v.path for v, k in zip(variables, placed) if k is None or k not in self.layout]
            if missing:
                raise RuntimeError(f"variable {missing[0]} is not on the parameter servers: create it in "
                                   "strategy.scope() to train it with this optimizer")
            raise OptimizerNotPlaced(key, placed)
        token = (closure_id, counter[0])
        counter[0] += 1
        by_shard: dict = {shard: {} for shard in spec["shards"]}
        for grad, variable in zip(grads, variables):
            if grad is None:
                continue
            vkey = keys_of.get(id(variable))
            if vkey is None or vkey not in self.layout:
                raise RuntimeError(f"variable {variable.path} is not on the parameter servers: create it in "
                                   "strategy.scope() to train it with this optimizer")
            value = self.ops.view(self.keras, grad)  # Ray copies it when the call is sent
            for shard, start, stop, pid in self.layout[vkey]:
                by_shard[shard][pid] = value if start is None else value[start:stop]
        self._call_shards([(s, "apply", (key, token, g)) for s, g in sorted(by_shard.items())])
        for variable in variables:
            # PyTorch keeps gradients on the tensors; a Keras train step clears those of its own
            # model's module, which on a worker may be another copy: clear them once applied.
            value = getattr(variable, "value", None)
            if getattr(value, "grad", None) is not None:
                value.grad = None
        fresh = [k for k in spec["variables"] if k in self.transport.WORKER_VARIABLES]
        snapshot.update(self._pull(fresh))

    # -- per-worker resources --------------------------------------------------------------

    def _build_resource(self, key: str) -> Any:
        kind, data = self.definitions[key]
        if kind == "dataset":
            return self.transport.loads(data)()
        if kind == "iterator":
            return _NumpyIterator(self.transport._resource(data))
        raise ValueError(f"unknown worker resource kind {kind!r}")


_CURRENT_WORKER = threading.local()


class _worker_index:
    def __init__(self, index: int):
        self.index = index

    def __enter__(self) -> None:
        _CURRENT_WORKER.index = self.index

    def __exit__(self, *exc: Any) -> None:
        _CURRENT_WORKER.index = None


def current_worker_index() -> Optional[int]:
    """The index of the worker running the current closure, or None outside closures."""
    return getattr(_CURRENT_WORKER, "index", None)


def _install_apply_hook(worker: WorkerActor) -> None:
    from keras.src.optimizers import base_optimizer

    original = base_optimizer.BaseOptimizer.apply
    if getattr(original, "_ks_parameter_server", False):
        original._ks_worker[0] = worker
        return
    owner = [worker]

    def apply(self: Any, grads: Any, trainable_variables: Any = None) -> Any:
        iterations = getattr(self, "_iterations", None)
        keys_of = {id(v): k for k, v in owner[0].transport.WORKER_VARIABLES.items()}
        key = keys_of.get(id(iterations)) if iterations is not None else None
        if key is None:
            return original(self, grads, trainable_variables)
        if trainable_variables is None:
            trainable_variables = self._trainable_variables
        return owner[0].apply(self, key, list(grads), list(trainable_variables))

    apply._ks_parameter_server = True
    apply._ks_worker = owner
    base_optimizer.BaseOptimizer.apply = apply
