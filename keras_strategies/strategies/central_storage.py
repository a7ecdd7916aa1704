"""`CentralStorageStrategy`: the replicas of one machine compute, one device keeps the variables."""

from __future__ import annotations

from typing import Optional, Sequence

from keras_strategies.cluster_resolver.resolvers import TFConfigClusterResolver
from keras_strategies.distribute.devices import default_compute_devices, resolve_devices
from keras_strategies.distribute.strategy import Strategy
from keras_strategies.strategies.mirrored import MirroredExtended


class CentralStorageExtended(MirroredExtended):
    """Mirrored's replica steps; the variables, the reduced gradients and the update on one device."""

    _replicas_keep_copies = False

    def __init__(self, container, compute_devices: Sequence[str], parameter_device: str):
        super().__init__(container, compute_devices, cross_device_ops=None)
        self._parameter_device = parameter_device

    @property
    def parameter_devices(self) -> tuple:
        """The one device that holds every variable."""
        return (self._parameter_device,)

    @property
    def _variable_device(self) -> str:
        return self._parameter_device


def refuse_a_cluster() -> None:
    """Refuses a TF_CONFIG cluster of several tasks: the strategy is one machine's."""
    spec = TFConfigClusterResolver().cluster_spec()
    tasks = sum(spec.num_tasks(job) for job in spec.jobs if job != "evaluator")
    if tasks > 1:
        raise ValueError(
            f"CentralStorageStrategy trains on one machine, but TF_CONFIG describes a cluster of {tasks} "
            f"tasks ({spec.as_dict()}). Use ks.MultiWorkerMirroredStrategy or ks.ParameterServerStrategy "
            "for several machines, or unset TF_CONFIG."
        )


class CentralStorageStrategy(Strategy):
    """Synchronous training on the devices of one machine with the variables on one device,
    as `tf.distribute.experimental.CentralStorageStrategy`.

    Each global batch is split across the compute devices; every replica reads
    the one copy of each variable, the replicas' gradients are summed onto the
    parameter device and the update runs there once. Training, the logged loss
    and the metrics equal one device with the same global batch, as with
    `ks.MirroredStrategy` (whose replica steps it shares). One machine only.

    Args:
        compute_devices: Device names of the replicas; `None` means every local
            accelerator, or every (virtual) CPU device when there is none.
        parameter_device: Where the variables live; `None` means the one compute
            device when there is one, else `"cpu:0"`.

    Examples:
        >>> strategy = ks.CentralStorageStrategy(["cpu:0", "cpu:1"])
        >>> strategy.num_replicas_in_sync, strategy.extended.parameter_devices
        (2, ('cpu:0',))
        >>> with strategy.scope():
        ...     model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        ...     model.compile(optimizer="sgd", loss="mse")
        >>> history = model.fit(np.ones((8, 4)), np.ones((8, 1)), batch_size=4, verbose=0)
    """

    def __init__(self, compute_devices: Optional[Sequence[str]] = None, parameter_device: Optional[str] = None):
        refuse_a_cluster()
        devices = default_compute_devices() if compute_devices is None else resolve_devices(compute_devices)
        if parameter_device is None:
            parameter = devices[0] if len(devices) == 1 else "cpu:0"
        else:
            (parameter,) = resolve_devices([parameter_device])
        super().__init__(CentralStorageExtended(self, devices, parameter))
