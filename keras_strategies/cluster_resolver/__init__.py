"""Cluster configuration for multi-worker strategies, mirroring `tf.distribute.cluster_resolver`.

Backend-neutral: nothing here imports TensorFlow.
"""

from keras_strategies.cluster_resolver.cluster_spec import ClusterSpec
from keras_strategies.cluster_resolver.resolvers import (
    ClusterResolver,
    SimpleClusterResolver,
    TFConfigClusterResolver,
)

__all__ = [
    "ClusterResolver",
    "ClusterSpec",
    "SimpleClusterResolver",
    "TFConfigClusterResolver",
]
