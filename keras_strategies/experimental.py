"""`ks.experimental`: the names of `tf.distribute.experimental` that this package provides.

TensorFlow's multi-worker guide spells the communication options
`tf.distribute.experimental.CommunicationOptions(implementation=
tf.distribute.experimental.CommunicationImplementation.RING)`; with
`s/tf.distribute/ks/` that must keep working. The names TensorFlow keeps here
for compatibility (`CollectiveCommunication`, the experimental
`MultiWorkerMirroredStrategy`, `TPUStrategy`) are the same objects as the stable ones, as in
TensorFlow. Preemption handling for custom loops (`PreemptionCheckpointHandler`,
`TerminationConfig`) saves a `Checkpoint` / `CheckpointManager`, the portable
counterparts of `tf.train`'s. `ks.experimental.partitioners` holds the variable partitioners of
ParameterServerStrategy (`import keras_strategies.experimental.partitioners`
works too). `ShardedDataParallelStrategy` is this package's own: data parallelism with the
optimizer state sharded across the devices (ZeRO). Strategies and tools this package does not provide raise an
`AttributeError` that says so.

Examples:
    >>> options = ks.experimental.CommunicationOptions(
    ...     implementation=ks.experimental.CommunicationImplementation.RING)
    >>> ks.experimental.CommunicationOptions is ks.CommunicationOptions
    True
    >>> ks.experimental.CollectiveCommunication is ks.CommunicationImplementation
    True
"""

from __future__ import annotations

import sys as _sys

from keras_strategies import coordinator
from keras_strategies.distribute import missing_names as _missing
from keras_strategies.distribute import partitioners
from keras_strategies.failure_handling.checkpoint import Checkpoint, CheckpointManager
from keras_strategies.failure_handling.preemption_handler import PreemptionCheckpointHandler
from keras_strategies.failure_handling.termination import TerminationConfig
from keras_strategies.input.dataset_creator import DatasetCreator
from keras_strategies.input.options import ValueContext
from keras_strategies.multi_worker.communication import CommunicationImplementation, CommunicationOptions
from keras_strategies.strategies.central_storage import CentralStorageStrategy
from keras_strategies.strategies.multi_worker_mirrored import MultiWorkerMirroredStrategy
from keras_strategies.strategies.parameter_server import ParameterServerStrategy
from keras_strategies.strategies.sharded_data_parallel import ShardedDataParallelStrategy
from keras_strategies.strategies.tpu import TPUStrategy

CollectiveCommunication = CommunicationImplementation
"""TensorFlow's older name for `CommunicationImplementation`: the same enum."""

__all__ = [
    "CentralStorageStrategy",
    "Checkpoint",
    "CheckpointManager",
    "CollectiveCommunication",
    "CommunicationImplementation",
    "CommunicationOptions",
    "DatasetCreator",
    "MultiWorkerMirroredStrategy",
    "ParameterServerStrategy",
    "PreemptionCheckpointHandler",
    "ShardedDataParallelStrategy",
    "TPUStrategy",
    "TerminationConfig",
    "ValueContext",
    "coordinator",
    "partitioners",
]

# `import keras_strategies.experimental.partitioners` and `from ... import`, as with TensorFlow's module.
_sys.modules.setdefault(f"{__name__}.partitioners", partitioners)

__getattr__ = _missing.module_getattr("keras_strategies.experimental", "tf.distribute.experimental")
