"""`TPUStrategy`: synchronous training on the TPU cores of one host, and the TPU set-up calls.

The strategy is `MirroredStrategy`'s (`MirroredExtended`) with static shapes:
every replica shard of a step has the per-replica rows of the largest batch so
far, a partial last batch included, padded with rows of weight 0 (see
`trainer/replica_step.py`), so each step signature compiles once. The TPU
runtime is the backend's (`engine.tpu`): JAX's TPU devices, TensorFlow's
`tf.distribute.TPUStrategy`, and on PyTorch a clear error.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from keras_strategies.backend import engine
from keras_strategies.distribute.devices import resolve_devices
from keras_strategies.distribute.strategy import Strategy
from keras_strategies.strategies.mirrored import MirroredExtended


class TPUExtended(MirroredExtended):
    """`MirroredExtended` whose replica shards have static shapes."""

    def __init__(self, container, devices: Sequence[str]):
        super().__init__(container, devices, cross_device_ops=None)

    @property
    def experimental_require_static_shapes(self) -> bool:
        """True: every step of one signature gives the replicas shards of the same shape."""
        return True


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
    (`jax.devices("tpu")`, one host), on TensorFlow TensorFlow's own
    `tf.distribute.TPUStrategy` running the replicas of the Keras steps. PyTorch
    has no TPU runtime for its torch version: constructing one raises a
    `RuntimeError` that says so. TPU hardware was not available to test this
    package on; the replica program, the static shapes and the errors are
    tested on virtual CPU devices.

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
            # Tests only (docs/development.md): the replica program on virtual CPU devices, no TPU runtime.
            self._resolver = tpu_cluster_resolver
            devices = resolve_devices(_test_devices)
        else:
            self._resolver = _resolver(tpu_cluster_resolver)
            devices = engine.tpu.replica_devices(self._resolver._handle, experimental_device_assignment,
                                                 bool(experimental_spmd_xla_partitioning))
        super().__init__(TPUExtended(self, devices))

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
    return engine.tpu.initialize_tpu_system(_resolver(cluster_resolver)._handle)
