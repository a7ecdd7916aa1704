"""The public API of `keras_strategies`, imported by the package (see `__init__.py`).

Importing it installs the package's Keras hooks, which change nothing for Keras
code that never enters a strategy scope.
"""

from keras_strategies._version import check_keras as _check_keras

# First: an unsupported Keras fails here, before the modules below use its internals or install hooks.
_check_keras()

from keras_strategies import cluster_resolver  # noqa: E402  (and the imports below)
from keras_strategies import coordinator
from keras_strategies import experimental
from keras_strategies import layers
from keras_strategies.distribute import missing_names as _missing
from keras_strategies.distribute import devices as _devices
from keras_strategies import keras_integration as _keras_integration
from keras_strategies.distribute.cross_device_ops import (
    CrossDeviceOps,
    HierarchicalCopyAllReduce,
    NcclAllReduce,
    ReductionToOneDevice,
)
from keras_strategies.cluster_resolver import ClusterSpec
from keras_strategies.distribute.context import (
    ReplicaContext,
    experimental_set_strategy,
    get_replica_context,
    get_strategy,
    has_strategy,
    in_cross_replica_context,
)
from keras_strategies.distribute.devices import list_devices, set_virtual_cpu_devices
from keras_strategies.input.options import (
    InputContext,
    InputOptions,
    InputReplicationMode,
    RunOptions,
    ValueContext,
)
from keras_strategies.distribute.functions import function, value_and_grad
from keras_strategies.input.distributed_dataset import DistributedDataset, DistributedIterator
from keras_strategies.distribute.losses import compute_average_loss, scale_regularization_loss
from keras_strategies.strategies.central_storage import CentralStorageStrategy
from keras_strategies.strategies.mirrored import MirroredStrategy
from keras_strategies.multi_worker.communication import CommunicationImplementation, CommunicationOptions
from keras_strategies.multi_worker.health import LostWorkerError
from keras_strategies.strategies.multi_worker_mirrored import MultiWorkerMirroredStrategy
from keras_strategies.strategies.one_device import OneDeviceStrategy
from keras_strategies.strategies.parameter_server import ParameterServerStrategy
from keras_strategies.strategies.tpu import TPUStrategy, experimental_connect_to_cluster, initialize_tpu_system
from keras_strategies.distribute.server import Server
from keras_strategies.distribute.reduce_op import ReduceOp
from keras_strategies.distribute.strategy import Strategy, StrategyExtended
from keras_strategies.distribute.values import DistributedValues, Mirrored, PerReplica

from keras_strategies._version import __version__

_devices.configure_from_environment()
_keras_integration.install()

__all__ = [
    "CentralStorageStrategy",
    "ClusterSpec",
    "CommunicationImplementation",
    "CommunicationOptions",
    "CrossDeviceOps",
    "DistributedDataset",
    "DistributedIterator",
    "DistributedValues",
    "HierarchicalCopyAllReduce",
    "MirroredStrategy",
    "NcclAllReduce",
    "ReductionToOneDevice",
    "InputContext",
    "LostWorkerError",
    "InputOptions",
    "InputReplicationMode",
    "Mirrored",
    "MultiWorkerMirroredStrategy",
    "OneDeviceStrategy",
    "ParameterServerStrategy",
    "PerReplica",
    "ReduceOp",
    "ReplicaContext",
    "RunOptions",
    "Server",
    "Strategy",
    "StrategyExtended",
    "TPUStrategy",
    "ValueContext",
    "cluster_resolver",
    "coordinator",
    "compute_average_loss",
    "experimental",
    "layers",
    "experimental_connect_to_cluster",
    "experimental_set_strategy",
    "function",
    "get_replica_context",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
    "initialize_tpu_system",
    "list_devices",
    "scale_regularization_loss",
    "set_virtual_cpu_devices",
    "value_and_grad",
]

__getattr__ = _missing.module_getattr("keras_strategies", "tf.distribute")
