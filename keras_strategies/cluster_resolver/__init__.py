"""Cluster configuration for multi-worker strategies, as `tf.distribute.cluster_resolver`.

A cluster resolver tells `ks.MultiWorkerMirroredStrategy` the cluster's
addresses and this process's role in it. Given none, the strategy uses the
resolver of the launcher that started the process: `TF_CONFIG`
(`TFConfigClusterResolver`), torchrun (`TorchrunClusterResolver`), a SLURM
step (`SlurmClusterResolver`) or mpirun (`MPIClusterResolver`), else one local
worker. `TPUClusterResolver` names the TPU of `ks.TPUStrategy` (through the
backend's TPU runtime). The others are backend-neutral: they import no TensorFlow.

Examples:
    >>> spec = ks.cluster_resolver.ClusterSpec({"worker": ["host0:2222", "host1:2222"]})
    >>> resolver = ks.cluster_resolver.SimpleClusterResolver(spec, task_type="worker", task_id=0)
    >>> resolver.cluster_spec().num_tasks("worker")
    2
"""

from keras_strategies.cluster_resolver.cluster_spec import ClusterSpec
from keras_strategies.cluster_resolver.launchers import MPIClusterResolver, TorchrunClusterResolver
from keras_strategies.cluster_resolver.resolvers import (
    ClusterResolver,
    SimpleClusterResolver,
    TFConfigClusterResolver,
)
from keras_strategies.cluster_resolver.slurm import SlurmClusterResolver
from keras_strategies.cluster_resolver.tpu import TPUClusterResolver
from keras_strategies.cluster_resolver.union import UnionResolver
from keras_strategies.distribute import missing_names as _missing

__all__ = [
    "ClusterResolver",
    "ClusterSpec",
    "MPIClusterResolver",
    "SimpleClusterResolver",
    "SlurmClusterResolver",
    "TFConfigClusterResolver",
    "TPUClusterResolver",
    "TorchrunClusterResolver",
    "UnionResolver",
]

__getattr__ = _missing.module_getattr(
    "keras_strategies.cluster_resolver", "tf.distribute.cluster_resolver", _missing.NOT_PROVIDED_RESOLVERS
)
