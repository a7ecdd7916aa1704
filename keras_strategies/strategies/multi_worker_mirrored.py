"""`MultiWorkerMirroredStrategy`: synchronous data parallelism across processes and machines.

Each worker (process) runs a `MirroredStrategy` over its local devices; after
the local reduction, one cross-worker all-reduce on the backend's own engine
(TF collective ops, `jax.distributed` + gloo, `torch.distributed` + gloo)
completes the sum over all `num_workers x local devices` replicas. Every
worker reads the same input, takes its slice of each global batch and
applies the same update, so all workers hold identical weights.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional, Sequence

import numpy as np
from keras import ops
import keras
from keras.src import tree

from keras_strategies.backend import engine
from keras_strategies.cluster_resolver.environment import resolver_from_environment
from keras_strategies.distribute.devices import default_compute_devices
from keras_strategies.input import worker_sharding
from keras_strategies.strategies.mirrored import MirroredExtended
from keras_strategies.keras_integration import chief_only
from keras_strategies.multi_worker.worker_cluster import WorkerCluster, joined_cluster, resolve, set_joined_cluster
from keras_strategies.multi_worker.communication import CommunicationImplementation, CommunicationOptions
from keras_strategies.multi_worker.health import HealthMonitor
from keras_strategies.multi_worker.joining import JoinWatch
from keras_strategies.distribute.reduce_op import ReduceOp
from keras_strategies.backend.common.pending import Finished
from keras_strategies.backend.common.replica_variables import FIRST
from keras_strategies.distribute.strategy import Strategy
from keras_strategies.distribute.values import PerReplica, is_distributed


def _to_numpy(value: Any) -> np.ndarray:
    return np.asarray(keras.ops.convert_to_numpy(value))


def join_cluster(cluster: WorkerCluster, options: CommunicationOptions) -> None:
    """Joins the cluster once per process; a later strategy for the same cluster shares it.

    Every engine joins one cluster per process (`jax.distributed`, the torch process group,
    TensorFlow's cluster), so a second strategy for another cluster is refused.
    """
    joined = joined_cluster()
    if joined is None:
        with JoinWatch(cluster, options.effective_timeout):
            engine.collectives.initialize(cluster, options)
        set_joined_cluster(cluster)
    elif (joined.addresses, joined.worker_index) != (cluster.addresses, cluster.worker_index):
        raise RuntimeError(
            f"This process already joined a cluster as {joined.describe(joined.worker_index)} of "
            f"{list(joined.addresses)}; it cannot join another ({cluster.describe(cluster.worker_index)} "
            f"of {list(cluster.addresses)}). A process belongs to one cluster: create every "
            "ks.MultiWorkerMirroredStrategy of a program from the same TF_CONFIG or cluster resolver."
        )


def _watched(monitor: Any, what: str, wait: Callable[[], Any]) -> Any:
    """`wait()`, which waits for cross-worker collectives, under the watchdog: a lost worker
    raises `LostWorkerError` naming it, and the watchdog bounds the wait."""
    monitor.begin(what)
    try:
        result = wait()
    except Exception as error:  # noqa: BLE001 - re-raised, naming the lost worker
        raise monitor.failed(error) from error
    monitor.end()
    return result


class _PendingSum:
    """A cross-worker sum under way; `wait()` returns it (see `_watched`)."""

    def __init__(self, monitor: Any, started: Any, what: str):
        self._monitor, self._started, self._what = monitor, started, what

    def wait(self) -> list:
        return _watched(self._monitor, self._what, self._started.wait)


class MultiWorkerMirroredExtended(MirroredExtended):
    def __init__(self, container, cluster: WorkerCluster, options: CommunicationOptions,
                 local_devices: Callable[[], list] = default_compute_devices):
        if cluster.num_workers > 1:  # joins the cluster before anything initialises the backend's devices
            join_cluster(cluster, options)
        super().__init__(container, local_devices(), cross_device_ops=None)
        self._cluster = cluster
        self._communication_options = options
        self._monitor: Optional[HealthMonitor] = None
        self._synced: dict = {}  # id(variable) -> weakref, for variables broadcast from the chief
        self._unsynced: list = []  # variables created since the last sync (several workers only)
        if cluster.num_workers > 1:
            chief_only.tolerate_concurrent_makedirs()
            self._monitor = HealthMonitor(
                cluster, engine.collectives.kv_set, engine.collectives.kv_try_get, options.effective_timeout
            )
            self._check_same_devices()

    # --- cluster ----------------------------------------------------------------------------
    @property
    def _num_workers(self) -> int:
        return self._cluster.num_workers

    @property
    def _worker_index(self) -> int:
        return self._cluster.worker_index

    @property
    def _is_chief(self) -> bool:
        return self._cluster.is_chief

    @property
    def num_replicas_in_sync(self) -> int:
        return len(self._devices) * self._cluster.num_workers

    @property
    def should_checkpoint(self) -> bool:
        return self._cluster.is_chief

    @property
    def should_save_summary(self) -> bool:
        return self._cluster.is_chief

    @property
    def experimental_between_graph(self) -> bool:
        return True

    def _in_multi_worker_mode(self) -> bool:
        return self._cluster.num_workers > 1

    def _rows_from_every_worker(self, numbers: list, what: str) -> np.ndarray:
        """`numbers` of every worker, one row per worker (an all-reduce of rows only one worker fills)."""
        rows = np.zeros((self._cluster.num_workers, len(numbers)), "float32")
        rows[self._cluster.worker_index] = numbers
        return _to_numpy(self._cross_worker_sum([rows], what)[0])

    def _described(self, rows: np.ndarray, unit: Callable[[np.ndarray], str]) -> str:
        return ", ".join(f"{self._cluster.names[i]}: {unit(row)}" for i, row in enumerate(rows))

    def _check_same_devices(self) -> None:
        counts = self._rows_from_every_worker([len(self._devices)], "device count check")
        if len(set(counts[:, 0].tolist())) != 1:
            described = self._described(counts, lambda row: str(int(row[0])))
            raise ValueError(
                f"Every worker must have the same number of replica devices; got {described}. "
                "Give each worker the same devices (e.g. KERAS_STRATEGIES_CPU_DEVICES)."
            )

    def _run_keras_method(self, name: str, method: Callable, model: Any, args: tuple, kwargs: dict) -> Any:
        with chief_only.quiet(self._cluster.num_workers > 1 and not self._cluster.is_chief):
            return super()._run_keras_method(name, method, model, args, kwargs)

    # --- cross-worker collectives ---------------------------------------------------------------
    def _cross_worker_sum(self, values: list, what: str = "all-reduce", donated: Any = False) -> list:
        if self._cluster.num_workers == 1 or not values:
            return list(values)
        if engine.collectives.tracing():
            return engine.collectives.all_reduce_sum(list(values), donated)  # inside a compiled function
        return self._start_cross_worker_sum(values, what, donated).wait()

    def _start_cross_worker_sum(self, values: list, what: str = "all-reduce", donated: Any = False) -> Any:
        """Starts `_cross_worker_sum` (eagerly, several workers); `.wait()` gives the sums.

        Where the engine sends in the background (PyTorch), the caller goes on
        meanwhile: a train step sends its gradients during the backward pass.
        Every worker must start the same sums in the same order.
        """
        if self._cluster.num_workers == 1 or not values:
            return Finished(list(values))
        self._monitor.begin(what)
        try:
            started = engine.collectives.start_all_reduce_sum(list(values), donated)
        except Exception as error:  # noqa: BLE001 - re-raised, naming the lost worker
            raise self._monitor.failed(error) from error
        # Completed in `wait`; the watchdog watches the wait, not the caller's work in between.
        self._monitor.end(completed=False)
        return _PendingSum(self._monitor, started, what)

    def _run_watched(self, what: str, program: Callable[[], Any]) -> Any:
        """`program()`, which runs cross-worker collectives inside a compiled program and waits for
        them, under the watchdog as `_cross_worker_sum`: a lost worker raises `LostWorkerError`."""
        return program() if self._monitor is None else _watched(self._monitor, what, program)

    def _cross_worker_gather(self, value: Any, axis: int) -> Any:
        """`value` of every worker concatenated along `axis` (sizes along `axis` may differ)."""
        if self._cluster.num_workers == 1:
            return value
        array = _to_numpy(value)
        workers, me = self._cluster.num_workers, self._cluster.worker_index
        sizes = np.zeros((workers,), "float32")
        sizes[me] = array.shape[axis]
        array = np.moveaxis(array, axis, 0)
        sizes, = self._cross_worker_sum([sizes], "all-gather sizes")
        sizes = [int(s) for s in _to_numpy(sizes)]
        buffer = np.zeros((workers, max(sizes)) + array.shape[1:], array.dtype)
        buffer[me, : array.shape[0]] = array
        (buffer,) = self._cross_worker_sum([buffer], "all-gather")
        buffer = _to_numpy(buffer)
        gathered = np.concatenate([buffer[i, : sizes[i]] for i in range(workers)], axis=0)
        return ops.convert_to_tensor(np.moveaxis(gathered, 0, axis))

    def _reduce(self, reduce_op, value, axis):
        if self._cluster.num_workers > 1 and len(self._devices) == 1 and not is_distributed(value):
            # One local replica: `strategy.run` returns its plain value, still one of many (as in TF).
            value = PerReplica([value])
        return super()._reduce(reduce_op, value, axis)

    def _all_reduce(self, replica_context, reduce_op, value):
        if self._cluster.num_workers == 1:
            return super()._all_reduce(replica_context, reduce_op, value)
        summed = self._differentiable_global_sum(value, "all_reduce in strategy.run")
        if reduce_op == ReduceOp.MEAN:
            summed = tree.map_structure(lambda s: s / self.num_replicas_in_sync, summed)
        return summed

    def _synchronized_sum(self, replica_context, value):
        if self._cluster.num_workers == 1:
            return super()._synchronized_sum(replica_context, value)
        return self._differentiable_global_sum(value, "synchronized BatchNormalization")

    def _differentiable_global_sum(self, value: Any, what: str) -> Any:
        """The sum of `value` over every replica of every worker; its gradient is the same sum.

        The engine adds the gradient rule to `_global_total` (replica threads) or
        to the bare cross-worker sum (TF graphs, JAX's compiled replica programs).
        """
        summed = engine.replicas.global_sum(
            tree.flatten(value),
            across_workers=lambda values: self._cross_worker_sum(values, what),
            over_all_replicas=lambda values: self._global_total(values, what),
        )
        return tree.pack_sequence_as(value, summed)

    def _global_total(self, value: Any, what: str) -> Any:
        """The sum of `value` over every replica of every worker, given to each replica (not differentiable)."""

        def total(per_replica: list) -> Any:
            flat = [tree.flatten(v) for v in per_replica]
            summed = self._cross_worker_sum([self._local_sum(leaves) for leaves in zip(*flat)], what)
            return tree.pack_sequence_as(per_replica[0], summed)

        return self._local_then_merge(total, value)

    def _all_gather(self, replica_context, value, axis):
        if self._cluster.num_workers == 1:
            return super()._all_gather(replica_context, value, axis)

        def gather(per_replica: list) -> Any:
            flat = [tree.flatten(v) for v in per_replica]
            out = []
            for leaves in zip(*flat):
                local = ops.concatenate([self._on_host(l) for l in leaves], axis=axis) if len(leaves) > 1 else leaves[0]
                out.append(self._cross_worker_gather(local, axis))
            return tree.pack_sequence_as(per_replica[0], out)

        return self._local_then_merge(gather, value)

    def _local_then_merge(self, fn: Callable[[list], Any], value: Any) -> Any:
        """`fn(values of this worker's replicas)` once per worker, its result given to every replica."""
        if len(self._devices) == 1:
            return fn([value])
        result = engine.replicas.merge_call(fn, value)
        if engine.collectives.tracing():
            return result
        # Each replica gets the result where its own value was (as the engines' local all-reduce does).
        devices = [engine.devices.device_of(ops.convert_to_tensor(leaf)) for leaf in tree.flatten(value)]
        placed = [engine.devices.copy_to(ops.convert_to_tensor(leaf), device)
                  for leaf, device in zip(tree.flatten(result), devices)]
        return tree.pack_sequence_as(result, placed)

    # --- initial values from the chief -------------------------------------------------------------
    def _any_worker_has(self, flag: bool, what: str = "end-of-input agreement") -> bool:
        if self._cluster.num_workers == 1:
            return flag
        (total,) = self._cross_worker_sum([np.array([1.0 if flag else 0.0], "float32")], what)
        return float(_to_numpy(total)[0]) > 0

    def _broadcast_from_chief(self, number: int) -> int:
        if self._cluster.num_workers == 1:
            return number
        value = np.array([float(number) if self._cluster.is_chief else 0.0], "float32")
        return int(round(float(_to_numpy(self._cross_worker_sum([value], "broadcast from the chief")[0])[0])))

    def _same_on_every_worker(self, key: Optional[int]) -> bool:
        """Whether every worker has this same `key` (None on any worker: no), in 16-bit pieces."""
        pieces = [0.0] * 5 if key is None else [1.0] + [float((key >> shift) & 0xFFFF) for shift in (0, 16, 32, 48)]
        rows = self._rows_from_every_worker(pieces, "input order check")
        return bool(rows[:, 0].all()) and len({tuple(row) for row in rows.tolist()}) == 1

    def _use_chief_input_rngs(self) -> None:
        """Every worker takes over the chief's states of the RNGs Keras' input adapters shuffle with.

        So all read the same order, the one a single process seeded as the
        chief draws; nothing is drawn for it.
        """
        if self._cluster.num_workers == 1:
            return
        states = worker_sharding.host_rng_states() if self._cluster.is_chief else b""
        worker_sharding.set_host_rng_states(self._broadcast_bytes_from_chief(states))

    def _broadcast_bytes_from_chief(self, data: bytes) -> bytes:
        """The chief's `data` (other workers pass anything): its length, then its bytes, summed as floats."""
        size = self._broadcast_from_chief(len(data))
        payload = np.zeros((size,), "float32")
        if self._cluster.is_chief:
            payload[:] = np.frombuffer(data, np.uint8)
        (total,) = self._cross_worker_sum([payload], "broadcast from the chief")
        return np.rint(_to_numpy(total)).astype(np.uint8).tobytes()

    def _track(self, obj: Any) -> bool:
        """Also holds each new variable until the next sync (see `_sync_variables_from_chief`)."""
        tracked = super()._track(obj)
        if tracked and self._cluster.num_workers > 1:
            self._unsynced.append(obj)
        return tracked

    def _sync_variables_from_chief(self, also: Sequence[Any] = ()) -> None:
        """Overwrites the variables created since the last sync, and `also`, with the chief's values.

        New variables are held until they are synced, so every worker sends the same list even
        when a model was dropped meanwhile and one worker's garbage collector has freed it and
        another's not yet (a full collection instead costs a quarter of a second per call).
        `also` must be the same list on every worker: `fit` passes its model's state, which a
        callback may have restored on the chief alone.
        """
        if self._cluster.num_workers == 1 or engine.collectives.tracing() or not (self._unsynced or also):
            return
        unsynced, self._unsynced = self._unsynced, []
        chosen = {id(v): v for v in unsynced if self._synced.get(id(v), lambda: None)() is not v}
        chosen.update((id(v), v) for v in also)
        fresh = list(chosen.values())
        if not fresh:
            return
        signatures = self._rows_from_every_worker(
            [len(fresh), sum(int(np.prod(v.shape)) for v in fresh)], "variable list check"
        )
        if len({tuple(row) for row in signatures.tolist()}) != 1:
            described = self._described(signatures, lambda row: f"{int(row[0])} variable(s), {int(row[1])} values")
            raise RuntimeError(
                f"The workers created different variables in the strategy scope ({described}). Every "
                "worker must run the same program and build the same models and optimizers, in the "
                "same order."
            )
        chief = self._cluster.is_chief
        values = [_to_numpy(v.value) if chief else np.zeros(v.shape, _to_numpy(v.value).dtype) for v in fresh]
        summed = self._cross_worker_sum(values, "broadcast of the chief's initial values")
        for variable, value in zip(fresh, summed):
            variable.assign(_to_numpy(value))
            self._synced[id(variable)] = weakref.ref(variable)

    def _custom_steps_untraceable(self) -> Optional[str]:
        return "MultiWorkerMirroredStrategy's replicas meet the other workers' in eager collectives"

    def _call_for_each_replica(self, fn, args, kwargs):
        self._sync_variables_from_chief()
        return super()._call_for_each_replica(fn, args, kwargs)

    def _combine_writes(self, writes) -> None:
        writes.combine(self._written_across_workers if self._cluster.num_workers > 1 else None)

    def _written_across_workers(self, items: list) -> list:
        """Every worker's combined writes of one `run`: metric changes add up, float values average.

        Eagerly, the workers first compare how many values they wrote (one small
        collective per `run`), so that different writes give a clear error
        rather than a collective mismatch; a traced program is the same on
        every worker.
        """
        if engine.collectives.tracing():
            if not items:
                return items
        else:
            sizes = self._rows_from_every_worker(
                [len(items), sum(int(np.prod(variable.shape)) for variable, *_ in items)], "written variables check"
            )
            if len({tuple(row) for row in sizes.tolist()}) != 1:
                described = self._described(sizes, lambda row: f"{int(row[0])} variable(s), {int(row[1])} values")
                raise RuntimeError(
                    f"The workers wrote different variables in strategy.run ({described}). Every worker "
                    "must run the same replica function on the same models."
                )
            if not items:
                return items
        chief = self._cluster.is_chief
        # The cluster's first replica is the chief's: for FIRST values the others send zeros.
        sent = [ops.zeros_like(value) if kind == FIRST and not chief else value for _, kind, value, _ in items]
        weights = ops.stack([ops.cast(weight, "float32") for *_, weight in items])
        *summed, total_weights = self._cross_worker_sum(sent + [weights], "variables written in strategy.run")
        return [(variable, kind, total, total_weights[i])
                for i, ((variable, kind, _, _), total) in enumerate(zip(items, summed))]


def check_communication_options(options: Optional[CommunicationOptions]) -> CommunicationOptions:
    """`options` (by default `CommunicationOptions()`), refused with the fix when unusable here."""
    if options is None:
        options = CommunicationOptions()
    if not isinstance(options, CommunicationOptions):
        raise ValueError(f"communication_options must be a ks.CommunicationOptions, got {options!r}.")
    if options.implementation == CommunicationImplementation.NCCL and not engine.devices.has_gpu():
        raise ValueError(
            "CommunicationImplementation.NCCL needs GPUs, and this machine has none. "
            "Use CommunicationImplementation.AUTO or RING."
        )
    return options


class MultiWorkerMirroredStrategy(Strategy):
    """Synchronous training on the devices of several workers, as `tf.distribute.MultiWorkerMirroredStrategy`.

    Create the strategy at program start, before the backend runs any
    operation: it joins the cluster (blocking until every worker has
    started). Each worker uses all its local accelerators, else all its
    (virtual) CPU devices; `num_replicas_in_sync` is workers x local devices.
    Every worker runs the same program; only the chief leaves Keras'
    checkpoints, saved models and logs behind and prints progress. The
    methods are those of `ks.Strategy`.

    Args:
        cluster_resolver: Where the cluster and this worker's role come from;
            `None` uses the launcher's environment: `TF_CONFIG`
            (`ks.cluster_resolver.TFConfigClusterResolver`), else torchrun's,
            a SLURM step's or mpirun's variables (`TorchrunClusterResolver`,
            `SlurmClusterResolver`, `MPIClusterResolver`). Without any, this is
            one local worker.
        communication_options: A `ks.CommunicationOptions` for the cross-worker
            collectives (implementation, timeout).

    Examples:
        Each worker runs the same script, here started on this machine by
        `python -m keras_strategies.launch --workers 2 train.py`:

        ```python
        # train.py
        import keras
        import keras_strategies as ks

        strategy = ks.MultiWorkerMirroredStrategy()  # reads TF_CONFIG (or torchrun's, srun's variables)
        with strategy.scope():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
            model.compile(optimizer="sgd", loss="mse")
        model.fit(x, y, batch_size=64, epochs=3)  # 64 rows per step over all workers
        ```
    """

    def __init__(self, cluster_resolver: Any = None, communication_options: Optional[CommunicationOptions] = None):
        communication_options = check_communication_options(communication_options)
        self._cluster_resolver = cluster_resolver if cluster_resolver is not None else resolver_from_environment()
        cluster = resolve(self._cluster_resolver)
        super().__init__(MultiWorkerMirroredExtended(self, cluster, communication_options))

    @property
    def cluster_resolver(self) -> Any:
        """The cluster resolver this strategy was created with (by default the launcher's, see `__init__`)."""
        return self._cluster_resolver

    def __repr__(self) -> str:
        cluster = self._extended._cluster
        return (
            f"MultiWorkerMirroredStrategy(worker={cluster.worker_index}/{cluster.num_workers}, "
            f"devices={list(self._extended.worker_devices)})"
        )


__all__ = ["CommunicationImplementation", "CommunicationOptions", "MultiWorkerMirroredStrategy"]
