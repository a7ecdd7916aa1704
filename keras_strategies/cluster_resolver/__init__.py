"""Cluster configuration for multi-worker strategies, as `tf.distribute.cluster_resolver`.

A cluster resolver tells `ks.MultiWorkerMirroredStrategy` the cluster's
addresses and this process's role in it; by default `TFConfigClusterResolver`
reads them from `TF_CONFIG`; `TPUClusterResolver` names the TPU of `ks.TPUStrategy` (through the
backend's TPU runtime). The others are backend-neutral: they import no TensorFlow.

Examples:
    >>> spec = ks.cluster_resolver.ClusterSpec({"worker": ["host0:2222", "host1:2222"]})
    >>> resolver = ks.cluster_resolver.SimpleClusterResolver(spec, task_type="worker", task_id=0)
    >>> resolver.cluster_spec().num_tasks("worker")
    2
"""

from keras_strategies.cluster_resolver.cluster_spec import ClusterSpec
from keras_strategies.cluster_resolver.resolvers import (
    ClusterResolver,
    SimpleClusterResolver,
    TFConfigClusterResolver,
)
from keras_strategies.cluster_resolver.tpu import TPUClusterResolver

__all__ = [
    "ClusterResolver",
    "ClusterSpec",
    "SimpleClusterResolver",
    "TFConfigClusterResolver",
    "TPUClusterResolver",
]
