"""`TPUStrategy`: synchronous training on the TPU cores of a host or a slice, and the TPU set-up calls.

On one host the strategy is `MirroredStrategy`'s (`MirroredExtended`), on the
hosts of a TPU slice `MultiWorkerMirroredStrategy`'s (each host a worker of
one cluster, joined as Cloud TPU's environment names them), both with static shapes:
every replica shard of a step has the per-replica rows of the largest batch so
far, a partial last batch included, padded with rows of weight 0 (see
`trainer/replica_step.py`), so each step signature compiles once. The TPU
runtime is the backend's (`engine.tpu`): JAX's TPU devices, TensorFlow's
`tf.distribute.TPUStrategy`, and on PyTorch a clear error.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

from keras_strategies.backend import engine
from keras_strategies.cluster_resolver.cluster_spec import ClusterSpec
from keras_strategies.cluster_resolver.resolvers import SimpleClusterResolver
from keras_strategies.distribute.devices import resolve_devices
from keras_strategies.distribute.strategy import Strategy
from keras_strategies.multi_worker.communication import CommunicationOptions
from keras_strategies.multi_worker.worker_cluster import WorkerCluster, resolve
from keras_strategies.strategies.mirrored import MirroredExtended
from keras_strategies.strategies.multi_worker_mirrored import MultiWorkerMirroredExtended, join_cluster


class _StaticShapes:
    @property
    def experimental_require_static_shapes(self) -> bool:
        """True: every step of one signature gives the replicas shards of the same shape."""
        return True


class TPUExtended(_StaticShapes, MirroredExtended):
    """`MirroredExtended` whose replica shards have static shapes: the cores of one host."""

    def __init__(self, container, devices: Sequence[str]):
        super().__init__(container, devices, cross_device_ops=None)


class TPUHostsExtended(_StaticShapes, MultiWorkerMirroredExtended):
    """`MultiWorkerMirroredExtended` whose replica shards have static shapes: the hosts of a TPU
    slice as the workers of one cluster, each with the cores of its host."""

    def __init__(self, container, cluster: WorkerCluster, local_devices: Callable[[], list]):
        super().__init__(container, cluster, CommunicationOptions(), local_devices)


def _hosts_cluster(handle: Any) -> Optional[WorkerCluster]:
    """The cluster of the TPU slice's hosts (`engine.tpu.hosts`), or None on one host."""
    addresses, index = engine.tpu.hosts(handle)
    if not addresses:
        return None
    return resolve(SimpleClusterResolver(ClusterSpec({"worker": addresses}), task_type="worker", task_id=index))


def _resolver(tpu_cluster_resolver: Any) -> Any:
    from keras_strategies.cluster_resolver.tpu import TPUClusterResolver

    if tpu_cluster_resolver is None:
        return TPUClusterResolver(tpu="")
    if not isinstance(tpu_cluster_resolver, TPUClusterResolver):
        raise TypeError(
            "tpu_cluster_resolver must be a ks.cluster_resolver.TPUClusterResolver, got "
            f"{type(tpu_cluster_resolver).__name__}."
        )
    return tpu_cluster_resolver


class TPUStrategy(Strategy):
    """Synchronous training on TPU cores, as `tf.distribute.TPUStrategy`.

    One replica per TPU core of this host. Each global batch is split across
    the replicas and one identical update is applied, as with
    `MirroredStrategy`. TPUs compile one program per shape, so every shard of a
    step has the per-replica rows of the largest batch so far: a partial last
    batch is padded with rows of weight 0 and trains exactly, without
    `drop_remainder=True`. `extended.experimental_require_static_shapes` is True.

    The TPU runtime is the backend's: on JAX the TPU devices of this host
    (`jax.devices("tpu")`), on TensorFlow TensorFlow's own
    `tf.distribute.TPUStrategy` running the replicas of the Keras steps. On a
    JAX slice of several hosts (Cloud TPU's `TPU_WORKER_HOSTNAMES` and
    `TPU_WORKER_ID`), every host runs the program and the strategy joins them
    as the workers of one cluster, as `MultiWorkerMirroredStrategy`. PyTorch
    has no TPU runtime for its torch version: constructing one raises a
    `RuntimeError` that says so. TPU hardware was not available to test this
    package on; the replica program, the static shapes and the errors are
    tested on virtual CPU devices, a slice's hosts as processes on 127.0.0.1.

    Args:
        tpu_cluster_resolver: A `ks.cluster_resolver.TPUClusterResolver`;
            `None` resolves the TPU of this Cloud TPU VM.
        experimental_device_assignment: TensorFlow's `DeviceAssignment`
            (TensorFlow only; JAX places one replica on each core).
        experimental_spmd_xla_partitioning: TensorFlow only, as there.

    Raises:
        ValueError: No TPU name is given and this machine has no TPU.
        RuntimeError: No TPU is found, or the backend is PyTorch.

    Examples:
        As in TensorFlow's TPU guide, with `tf.distribute`, `tf.config` and
        `tf.tpu.experimental` replaced by `ks`:

        ```python
        resolver = ks.cluster_resolver.TPUClusterResolver(tpu="")
        ks.experimental_connect_to_cluster(resolver)
        ks.initialize_tpu_system(resolver)
        strategy = ks.TPUStrategy(resolver)
        with strategy.scope():
            model = keras.Sequential([keras.Input((784,)), keras.layers.Dense(10)])
            model.compile(optimizer="adam", loss="mse", steps_per_execution=50)
        model.fit(x, y, batch_size=1024, epochs=5)  # no drop_remainder needed
        ```
    """

    def __init__(self, tpu_cluster_resolver: Any = None, experimental_device_assignment: Any = None,
                 experimental_spmd_xla_partitioning: bool = False, *, _test_devices: Optional[Sequence[str]] = None):
        engine.tpu.check_runtime()
        if _test_devices is not None:
            # Tests only (docs/development.md): the replica program on virtual CPU devices, no TPU
            # runtime; the hosts of a slice, from Cloud TPU's environment, as below.
            self._resolver, handle = tpu_cluster_resolver, None
            local_devices = lambda: resolve_devices(_test_devices)  # noqa: E731
        else:
            self._resolver = _resolver(tpu_cluster_resolver)
            handle = self._resolver._handle
            local_devices = lambda: engine.tpu.replica_devices(  # noqa: E731
                handle, experimental_device_assignment, bool(experimental_spmd_xla_partitioning))
        cluster = _hosts_cluster(handle)
        if cluster is None:
            super().__init__(TPUExtended(self, local_devices()))
        else:  # joins the slice's hosts before JAX sees its devices
            super().__init__(TPUHostsExtended(self, cluster, local_devices))

    @property
    def cluster_resolver(self) -> Any:
        """The `TPUClusterResolver` this strategy runs on.

        Examples:
            ```python
            strategy = ks.TPUStrategy(resolver)
            assert strategy.cluster_resolver is resolver
            ```
        """
        return self._resolver


def experimental_connect_to_cluster(cluster_spec_or_resolver: Any, job_name: str = "localhost", task_index: int = 0,
                                    protocol: Any = None, make_master_device_default: bool = True,
                                    cluster_device_filters: Any = None) -> None:
    """Connects this program to the TPU's hosts, as `tf.config.experimental_connect_to_cluster`.

    On TensorFlow, TensorFlow's own call for a remote TPU (this host's chips
    need nothing); on JAX there is nothing to connect, the chips of this TPU
    VM are JAX's devices. The other arguments are accepted for compatibility.

    Examples:
        ```python
        resolver = ks.cluster_resolver.TPUClusterResolver(tpu="")
        ks.experimental_connect_to_cluster(resolver)
        ```
    """
    engine.tpu.connect_to_cluster(_resolver(cluster_spec_or_resolver)._handle)


def initialize_tpu_system(cluster_resolver: Any = None) -> Any:
    """Initialises the TPU system, as `tf.tpu.experimental.initialize_tpu_system`.

    Returns TensorFlow's TPU topology on TensorFlow, `None` on JAX (which
    initialises its TPUs itself and only checks here that it sees them).

    Raises:
        RuntimeError: "TPUs not found in the cluster." when there is no TPU.

    Examples:
        ```python
        resolver = ks.cluster_resolver.TPUClusterResolver(tpu="")
        ks.initialize_tpu_system(resolver)
        ```
    """
    handle = _resolver(cluster_resolver)._handle
    cluster = _hosts_cluster(handle)
    if cluster is not None:  # JAX's devices of a slice of several hosts exist once the hosts have joined
        join_cluster(cluster, CommunicationOptions())
    return engine.tpu.initialize_tpu_system(handle)
