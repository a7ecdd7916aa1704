"""The Ray runtime of parameter-server training (JAX and PyTorch): shards and workers as Ray actors.

`connect` (on the chief) joins the Ray cluster the parameter servers and
workers serve (`serve`, for `ks.Server`), or starts a local Ray runtime on
127.0.0.1 when there is none, and starts one shard actor per `ps` task and one
worker actor per `worker` task. Worker actors restart when they die (Ray's
`max_restarts`); the closure queue then runs the lost closure elsewhere and
the worker rebuilds its datasets. Shard actors do not restart: a lost
parameter server is an error naming it ("/job:ps/replica:0/task:N", as
TensorFlow names it), and the next strategy of the process starts a new one.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import uuid
from typing import Any, Callable, Iterator, Mapping, Optional

import keras
import ray
from ray import cloudpickle

from keras_strategies.backend.common import patches
from keras_strategies.backend.common.ray_parameter_server import actors, transport
from keras_strategies.backend.common.ray_parameter_server.registry import Registry
from keras_strategies.backend.common.remote_errors import (
    ParameterServerUnavailableError,
    WorkerUnavailableError,
    parameter_server_device,
)

_WHEN = "while a model is built for Ray's parameter servers"
_LOST = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)


def jobs(cluster_spec: Any) -> dict:
    """{job name: [addresses]} from a ClusterSpec, a dict, or anything with `as_dict()`."""
    if hasattr(cluster_spec, "as_dict"):
        cluster_spec = cluster_spec.as_dict()
    if not isinstance(cluster_spec, Mapping):
        raise ValueError(f"expected a cluster spec (a ClusterSpec or a dict of jobs); got {cluster_spec!r}")
    result = {}
    for job, tasks in cluster_spec.items():
        if isinstance(tasks, Mapping):
            tasks = [tasks[i] for i in sorted(tasks)]
        result[job] = list(tasks)
    return result


def ensure_ray(address: Optional[str] = None) -> None:
    """Joins the Ray cluster at `address`, or starts a local Ray runtime bound to 127.0.0.1."""
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ["KERAS_BACKEND"] = keras.backend.backend()
    if address:
        ray.init(address=address, log_to_driver=False, configure_logging=False)
    else:
        # Ray turns 127.0.0.1 into the machine's network address unless it runs as a one-machine
        # cluster; then every Ray server of this runtime binds to and advertises 127.0.0.1.
        from ray._private import ray_constants

        # Ray starts its worker processes at niceness 15, as background work; here they are the
        # training itself (its workers and parameter servers), which must not yield to every other
        # process of the machine (the chief runs at the user's niceness).
        os.environ.setdefault("RAY_worker_niceness", "0")
        saved = ray_constants.ENABLE_RAY_CLUSTER
        ray_constants.ENABLE_RAY_CLUSTER = False
        try:
            ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
                     configure_logging=False, _node_ip_address="127.0.0.1")
        finally:
            ray_constants.ENABLE_RAY_CLUSTER = saved


class WorkerHandle:
    """The chief's handle on one worker actor, used by the closure queue."""

    def __init__(self, runtime: "Runtime", index: int):
        self.runtime = runtime
        self.index = index
        self.name = f"worker:{index}"
        self.actor = runtime._start_worker(index)
        self._sent_functions: set = set()
        self._sent_resources: set = set()
        self._layout_version = -1
        self._incarnation: Optional[str] = None  # the worker process that holds what was sent
        self._lock = threading.Lock()

    def _forget(self) -> None:
        with self._lock:
            self._sent_functions.clear()
            self._sent_resources.clear()
            self._layout_version = -1
            self._incarnation = None  # the next closure goes with everything, to whichever process serves

    def run(self, closure_id: str, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """Runs `fn(*args, **kwargs)` on this worker; raises `WorkerUnavailableError` if the worker is lost.

        A worker that Ray restarted while it was idle has none of what was sent to the process
        before: it refuses the closure (`WorkerRestarted`), and the closure goes again with everything.
        """
        runtime = self.runtime
        while True:
            # Again after an optimizer was built for this closure: its copy then carries the new slots.
            function_key, function_bytes, resources = runtime._pickled_function(fn)
            resources = dict(resources)
            call_bytes = transport.dumps((args, kwargs), runtime.registry.keys, resources)
            with self._lock:
                send_function = function_bytes if function_key not in self._sent_functions else None
                definitions = self._definitions(resources)
                version = runtime.registry.version
                layout = None
                if version != self._layout_version:
                    layout = (dict(runtime.registry.layout), dict(runtime.registry.optimizer_layout),
                              list(runtime.shard_names))
                incarnation = self._incarnation
            try:
                ref = self.actor.run.remote(incarnation, closure_id, function_key, send_function, call_bytes, layout,
                                            definitions)
                incarnation, result = ray.get(ref)
            except _LOST as error:
                self._forget()
                raise WorkerUnavailableError(self.name, type(error).__name__) from None
            except ray.exceptions.RayTaskError as error:
                cause = error.cause
                if isinstance(cause, actors.WorkerRestarted):
                    self._forget()
                    continue
                if isinstance(cause, BaseException):
                    if hasattr(cause, "add_note"):
                        cause.add_note(f"(raised on {self.name}; its traceback follows)\n{_remote_traceback(error)}")
                    raise cause from None
                raise
            with self._lock:
                self._sent_functions.add(function_key)
                self._sent_resources.update(definitions)
                if layout is not None:
                    self._layout_version = version
                self._incarnation = incarnation
            if isinstance(result, actors.BuildRequest):  # nothing was applied: build, then run it again
                runtime.build_optimizer(result.key, result.variables)
                continue
            return result

    def _definitions(self, resources: dict) -> dict:
        definitions = {}
        pending = list(resources.values())
        while pending:
            resource = pending.pop()
            if resource.key in self._sent_resources or resource.key in definitions:
                continue
            if resource.kind == "iterator":
                definitions[resource.key] = ("iterator", resource.payload.key)
                pending.append(resource.payload)
            else:
                definitions[resource.key] = (resource.kind, transport.dumps(resource.payload, {}, {}))
        return definitions

    def wait_until_available(self, timeout: float = 300.0) -> None:
        """Blocks until the worker actor answers again (Ray restarts it)."""
        deadline = time.monotonic() + timeout
        delay = 0.02
        while True:
            try:
                ping = self.actor.ping.remote()
            except Exception as error:  # noqa: BLE001 - Ray raises a bare Exception for an actor it no longer knows
                # (its runtime was shut down, or the actor is gone for good): asking again cannot help.
                raise WorkerUnavailableError(self.name, f"its actor cannot be reached ({error})") from None
            try:
                ray.get(ping, timeout=10)
                return
            except (ray.exceptions.GetTimeoutError, *_LOST):
                if time.monotonic() > deadline:
                    raise WorkerUnavailableError(self.name, f"did not come back within {timeout:.0f} s") from None
                time.sleep(delay)
                delay = min(delay * 2, 1.0)


class WorkerPool(list):
    """The worker handles, with the hooks that move the chief's values to and from the shards."""

    def __init__(self, runtime: "Runtime", handles: list):
        super().__init__(handles)
        self.runtime = runtime

    def before_dispatch(self) -> None:
        self.runtime.push()

    def after_join(self) -> None:
        self.runtime.pull()


class Runtime:
    """Parameter servers and workers as Ray actors, driven by the chief."""

    def __init__(self, cluster_spec: Any, task_type: Optional[str], task_id: Optional[int],
                 partitioner: Optional[Callable[..., Any]], address: Optional[str] = None):
        cluster = jobs(cluster_spec)
        self.num_ps = len(cluster.get("ps", []))
        self.num_workers = len(cluster.get("worker", []))
        if not self.num_ps:
            raise ValueError("ParameterServerStrategy needs at least one `ps` task in the cluster spec; it has none.")
        if not self.num_workers:
            raise ValueError("ParameterServerStrategy needs at least one `worker` task in the cluster spec; it has none.")
        self.task_type, self.task_id = task_type, task_id
        self.address = address
        ensure_ray(address)
        self.backend = keras.backend.backend()
        self.registry = Registry(self.num_ps, partitioner)
        self._resources = ray.cluster_resources()
        self._prefix = f"ks-{uuid.uuid4().hex[:10]}"
        self.shard_names = [f"{self._prefix}-ps-{i}" for i in range(self.num_ps)]
        self._restarts = 0
        self.shards = [self._start_shard(i) for i in range(self.num_ps)]
        ray.get([shard.ping.remote() for shard in self.shards])
        self._all_handles = [WorkerHandle(self, i) for i in range(self.num_workers)]
        self._pool = WorkerPool(self, self._all_handles)
        self._functions: dict = {}
        self._functions_lock = threading.Lock()
        self._placement_lock = threading.RLock()  # `push` from the main thread, builds from closures'
        self._scope_depth = 0

    # -- actors ----------------------------------------------------------------------------

    def _placement(self, role: str) -> dict:
        # On a cluster whose nodes serve roles (`serve`), each actor runs on its role's node.
        return {"resources": {role: 0.001}} if role in self._resources else {}

    def _start_shard(self, index: int) -> Any:
        cls = ray.remote(actors.ParameterShard)
        return cls.options(num_cpus=0, max_restarts=0, max_concurrency=4, name=self.shard_names[index],
                           **self._placement(f"ps:{index}")).remote(index, self.backend)

    def _replace_lost_shards(self, count: int) -> None:
        """Starts a new shard actor for each of the first `count` parameter servers that died (a new
        strategy restarts the cluster). A dead actor keeps its name, so the new one gets a name of its own."""
        refs = [shard.ping.remote() for shard in self.shards[:count]]
        lost = []
        for index, ref in enumerate(refs):
            try:
                ray.get(ref, timeout=30)
            except (*_LOST, ray.exceptions.GetTimeoutError):
                lost.append(index)
        for index in lost:
            with contextlib.suppress(Exception):
                ray.kill(self.shards[index], no_restart=True)
            self._restarts += 1
            self.shard_names[index] = f"{self._prefix}-ps-{index}-{self._restarts}"
            self.shards[index] = self._start_shard(index)
        ray.get([self.shards[index].ping.remote() for index in lost])

    def _start_worker(self, index: int) -> Any:
        cls = ray.remote(actors.WorkerActor)
        return cls.options(num_cpus=0, max_restarts=-1, max_task_retries=0,
                           **self._placement(f"worker:{index}")).remote(
            index, self.backend, list(self.shard_names))

    def _reuse(self, partitioner: Optional[Callable[..., Any]], num_ps: int, num_workers: int) -> "Runtime":
        """Starts over on the same actors with the first `num_ps` shards and `num_workers` workers.

        Tests share one set of processes this way; the variables and datasets of
        the previous use are forgotten.
        """
        if num_ps > len(self.shards) or num_workers > len(self._all_handles):
            raise ValueError(f"this runtime has {len(self.shards)} ps and {len(self._all_handles)} workers")
        self.registry = Registry(num_ps, partitioner)
        self.num_ps, self.num_workers = num_ps, num_workers
        self._replace_lost_shards(num_ps)
        for handle in self._all_handles:
            handle.wait_until_available()
        ray.get([s.reset.remote() for s in self.shards[:num_ps]] + [h.actor.reset.remote() for h in self._all_handles])
        for handle in self._all_handles:
            handle._forget()
        with self._functions_lock:
            self._functions.clear()
        self._pool = WorkerPool(self, self._all_handles[:num_workers])
        return self

    def shutdown(self) -> None:
        """Stops the actors (the Ray runtime stays up for the next strategy)."""
        from keras_strategies.backend.common import ray_parameter_server

        if self in ray_parameter_server._LIVE:
            ray_parameter_server._LIVE.remove(self)
        for actor in [h.actor for h in self._all_handles] + self.shards:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)

    # -- the engine interface ----------------------------------------------------------------

    @contextlib.contextmanager
    def variable_scope(self) -> Iterator[None]:
        """Variables and optimizers created inside live on the parameter servers."""
        with _tracking(self.registry):
            yield

    def native_coordinator(self) -> None:
        return None

    def workers(self) -> WorkerPool:
        return self._pool

    @property
    def num_replicas_in_sync(self) -> int:
        """One replica per worker task, as TensorFlow's strategy has on CPU workers."""
        return 1

    def compile(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Closures run eagerly on the workers (Keras variables are stateful)."""
        return fn

    def run(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """`strategy.run` on the chief: the one replica is the caller (workers use the worker copy)."""
        return fn(*args, **(kwargs or {}))

    def reduce(self, reduce_op: str, value: Any, axis: Optional[int]) -> Any:
        """One replica's value: reducing over replicas leaves it; `axis` reduces along that axis too."""
        return reduce_one_replica(reduce_op, value, axis)

    def experimental_distribute_dataset(self, dataset: Any, options: Any = None) -> Any:
        """The dataset itself: each worker iterates its own copy (call it in the per-worker dataset function)."""
        return dataset

    def distribute_datasets_from_function(self, dataset_fn: Callable[..., Any], options: Any = None) -> Any:
        """Datasets are built on the workers: this is called there, by the strategy's worker copy."""
        raise RuntimeError(
            "distribute_datasets_from_function builds a dataset on each worker: call it inside the function "
            "passed to `coordinator.create_per_worker_dataset(...)` (it runs on every worker), or pass "
            "`dataset_fn` to `create_per_worker_dataset` directly.")

    # -- values ------------------------------------------------------------------------------

    def push(self) -> None:
        """Places new variables and sends the chief's changes to the shards (before work starts)."""
        with self._placement_lock:
            pieces, optimizers = self.registry.place(lambda cls: cloudpickle.dumps(cls))
            calls = [(s, "setup", (pieces.get(s, {}), optimizers.get(s, {})))
                     for s in sorted(set(pieces) | set(optimizers))]
            changes = self.registry.changed()
            calls += [(s, "write", (values,)) for s, values in sorted(changes.items())]
            self._call(calls)

    def build_optimizer(self, key: int, variable_keys: list) -> None:
        """Builds the optimizer whose `iterations` has registry key `key` on the variables of
        `variable_keys`, where a closure first used it, and places it on the parameter servers.

        The slots are created on the chief in the registry's scope, so each is placed beside the
        piece of its variable; the variables take the shards' current values first, which the
        optimizer's placement sends back with it. Closures of other workers may ask at once:
        the first builds, the others find it built.
        """
        registry = self.registry
        with self._placement_lock:
            optimizer = next((o for o in registry.optimizers if registry.keys.get(id(o._iterations)) == key), None)
            if optimizer is None:
                raise RuntimeError("a closure applied gradients with an optimizer the chief does not know: create "
                                   "the optimizer in strategy.scope()")
            if not optimizer.built:
                variables = [registry.variables[k] for k in variable_keys]
                self._refresh(variable_keys)
                with self.variable_scope():
                    optimizer.build(variables)
            self.push()

    def _refresh(self, keys: list) -> None:
        """Gives the chief's variables `keys` the shards' current values (closures may be running)."""
        self._read_into_chief(keys, forget_tokens=False)

    def pull(self) -> None:
        """Gives the chief's variables the shards' current values (after `join`)."""
        # The queue is idle: no closure can run again, so the shards may forget their update tokens.
        self._read_into_chief(None, forget_tokens=True)

    def _read_into_chief(self, keys: Optional[list], forget_tokens: bool) -> None:
        reads = self.registry.reads(keys)
        shards = sorted(reads)
        results = self._call([(s, "read", (reads[s], forget_tokens)) for s in shards])
        self.registry.assign({pid: v for s, values in zip(shards, results) for pid, v in zip(reads[s], values)}, keys)

    def _call(self, calls: list) -> list:
        refs = [getattr(self.shards[shard], method).remote(*args) for shard, method, args in calls]
        results = []
        for (shard, _, _), ref in zip(calls, refs):
            try:
                results.append(ray.get(ref, timeout=30))
            except (*_LOST, ray.exceptions.GetTimeoutError) as error:
                raise ParameterServerUnavailableError(parameter_server_device(shard), type(error).__name__) from None
        return results

    def _pickled_function(self, fn: Callable[..., Any]) -> tuple:
        with self._functions_lock:
            key = (id(fn), self.registry.version)
            entry = self._functions.get(key)
            if entry is None:
                resources: dict = {}
                data = transport.dumps(fn, self.registry.keys, resources)
                entry = (hash(key) & 0x7FFFFFFFFFFF, data, resources, fn)
                self._functions[key] = entry
            return entry[0], entry[1], entry[2]

    def __reduce__(self):
        return (_no_runtime, ())


def reduce_one_replica(reduce_op: str, value: Any, axis: Optional[int]) -> Any:
    """`strategy.reduce` over one replica: the value, reduced along `axis` when one is given."""
    op = str(reduce_op).upper()
    if op not in ("SUM", "MEAN"):
        raise ValueError(f"reduce_op must be 'SUM' or 'MEAN', got {reduce_op!r}.")
    if axis is None:
        return value
    reduce = keras.ops.sum if op == "SUM" else keras.ops.mean
    return keras.tree.map_structure(lambda v: reduce(v, axis=axis), value)


def _no_runtime() -> None:
    return None


_TRACKING: list = []
_TRACKING_LOCK = threading.Lock()
_TRACKED = (
    (patches.declare("keras.src.backend.common.variables.Variable.__init__", "records the Keras variables a model "
                     "builds for the parameter servers", when=_WHEN), "track_variable"),
    (patches.declare("keras.src.optimizers.base_optimizer.BaseOptimizer.__init__", "records the optimizers a model "
                     "builds for the parameter servers", when=_WHEN), "track_optimizer"),
)


def _tracking_init(method: str) -> Callable:
    def wrap(original: Callable) -> Callable:
        def init(self: Any, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)
            if _TRACKING:
                getattr(_TRACKING[-1], method)(self)

        return init

    return wrap


@contextlib.contextmanager
def _tracking(registry: Registry) -> Iterator[None]:
    """Records the Keras variables and optimizers created inside in `registry`."""
    with contextlib.ExitStack() as stack:
        for patch, method in _TRACKED:
            stack.enter_context(patch.applied(_tracking_init(method)))
        with _TRACKING_LOCK:
            _TRACKING.append(registry)
        try:
            yield
        finally:
            with _TRACKING_LOCK:
                _TRACKING.remove(registry)


def _remote_traceback(error: BaseException) -> str:
    try:
        return str(error).strip()
    except Exception:  # noqa: BLE001  (a traceback is a courtesy)
        return "(no traceback)"
