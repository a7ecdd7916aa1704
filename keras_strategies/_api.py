"""The public API of `keras_strategies`, imported by the package (see `__init__.py`).

Importing it installs the package's Keras hooks, which change nothing for Keras
code that never enters a strategy scope.
"""

from keras_strategies import batch_norm as _batch_norm
from keras_strategies import cluster_resolver
from keras_strategies import experimental
from keras_strategies import _missing
from keras_strategies.multi_worker import chief_only as _chief_only
from keras_strategies import devices as _devices
from keras_strategies import loss_scaling as _loss_scaling
from keras_strategies import loss_reduction as _loss_reduction
from keras_strategies import metric_weighting as _metric_weighting
from keras_strategies import optimizer_hooks as _optimizer_hooks
from keras_strategies import replica_seeds as _replica_seeds
from keras_strategies import keras_hooks as _keras_hooks
from keras_strategies.backend import engine
from keras_strategies.cross_device_ops import (
    CrossDeviceOps,
    HierarchicalCopyAllReduce,
    NcclAllReduce,
    ReductionToOneDevice,
)
from keras_strategies.cluster_resolver import ClusterSpec
from keras_strategies.context import (
    ReplicaContext,
    experimental_set_strategy,
    get_replica_context,
    get_strategy,
    has_strategy,
    in_cross_replica_context,
)
from keras_strategies.devices import list_devices, set_virtual_cpu_devices
from keras_strategies.input.context import (
    InputContext,
    InputOptions,
    InputReplicationMode,
    RunOptions,
    ValueContext,
)
from keras_strategies.gradients import function, value_and_grad
from keras_strategies.input.distributed_dataset import DistributedDataset, DistributedIterator
from keras_strategies.losses import compute_average_loss, scale_regularization_loss
from keras_strategies.mirrored import MirroredStrategy
from keras_strategies.multi_worker.communication import CommunicationImplementation, CommunicationOptions
from keras_strategies.multi_worker.health import LostWorkerError
from keras_strategies.multi_worker_mirrored import MultiWorkerMirroredStrategy
from keras_strategies.one_device import OneDeviceStrategy
from keras_strategies.reduce_op import ReduceOp
from keras_strategies.strategy import Strategy, StrategyExtended
from keras_strategies.values import DistributedValues, Mirrored, PerReplica

from keras_strategies._version import __version__

_devices.configure_from_environment()
_keras_hooks.install()
_batch_norm.install()
_optimizer_hooks.install()
_loss_scaling.install()
_loss_reduction.install()
_metric_weighting.install()
_chief_only.install()
_replica_seeds.install()
engine.trainer.install()

__all__ = [
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
    "PerReplica",
    "ReduceOp",
    "ReplicaContext",
    "RunOptions",
    "Strategy",
    "StrategyExtended",
    "ValueContext",
    "cluster_resolver",
    "compute_average_loss",
    "experimental",
    "experimental_set_strategy",
    "function",
    "get_replica_context",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
    "list_devices",
    "scale_regularization_loss",
    "set_virtual_cpu_devices",
    "value_and_grad",
]

__getattr__ = _missing.module_getattr("keras_strategies", "tf.distribute")
