"""Parameter-server training on TensorFlow's own runtime.

`tf.distribute.ParameterServerStrategy` places the variables created in its
scope on the parameter servers (round-robin, or split by a partitioner),
`tf.distribute.coordinator.ClusterCoordinator` dispatches closures to the
workers with TensorFlow's queue, retries and failure handling, and
`tf.distribute.Server` serves the worker and ps tasks. This module adds what
Keras 3 needs on top: a Keras variable whose value TensorFlow split into
shards (a `ShardedVariable`) gets gradients and updates.
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Any, Callable, Optional

import numpy as np
import tensorflow as tf
from keras.src.backend.common.stateless_scope import in_stateless_scope
from keras.src.optimizers import base_optimizer
from tensorflow.python.distribute import ps_values, sharded_variable

from keras_strategies.backend.common import patches

# Every task needs it for TensorFlow's coordinator to see a lost worker as a retryable failure.
_FAIL_FAST = ("GRPC_FAIL_FAST", "use_caller")


def _tf_cluster_spec(cluster_spec: Any) -> tf.train.ClusterSpec:
    if isinstance(cluster_spec, tf.train.ClusterSpec):
        return cluster_spec
    as_dict = cluster_spec.as_dict() if hasattr(cluster_spec, "as_dict") else dict(cluster_spec)
    return tf.train.ClusterSpec(as_dict)


def _server_config(cluster: tf.train.ClusterSpec, config: Any) -> Any:
    """TensorFlow's tutorial gives each task at least `workers + 1` inter-op threads: with
    fewer (2 on a 2-core machine) closures of several workers wait on one another for ever."""
    if config is not None:
        return config
    config = tf.compat.v1.ConfigProto()
    workers = len(cluster.as_dict().get("worker", []))
    config.inter_op_parallelism_threads = max(4, workers + 1)
    return config


def serve(cluster_spec: Any, job_name: Optional[str], task_index: Optional[int], protocol: Optional[str],
          config: Any = None, start: bool = True) -> Any:
    """A `tf.distribute.Server` for a `worker` or `ps` task (`join()` serves for ever)."""
    os.environ.setdefault(*_FAIL_FAST)
    if isinstance(cluster_spec, tf.train.ServerDef):
        return tf.distribute.Server(cluster_spec, protocol=protocol, config=config, start=start)
    cluster = _tf_cluster_spec(cluster_spec)
    return tf.distribute.Server(
        cluster, job_name=job_name, task_index=task_index, protocol=protocol or "grpc",
        config=_server_config(cluster, config), start=start,
    )


_connected: dict = {}  # the cluster this process joined as its chief: {"cluster": dict}


class _Strategy(tf.distribute.ParameterServerStrategy):
    """TensorFlow's strategy, which a process may create again for the cluster it joined.

    TensorFlow connects the chief to the cluster in each constructor, and a
    second connection fails ("Could not start gRPC server": the chief's port
    is taken); a second strategy (another partitioner, a new model) reuses
    the connection. A process joins one cluster.
    """

    def _connect_to_cluster(self, coordinator_name: str) -> None:
        cluster = self._cluster_resolver.cluster_spec().as_dict()
        joined = _connected.get("cluster")
        if joined is None:
            super()._connect_to_cluster(coordinator_name)
            _connected["cluster"] = cluster
            return
        if joined != cluster:
            raise RuntimeError(
                f"This process already joined the parameter-server cluster {joined} as its chief; it "
                f"cannot join another ({cluster}). A process coordinates one cluster: create every "
                "ks.ParameterServerStrategy of a program for the same cluster."
            )
        self._num_workers = len(cluster.get("worker", ()))
        self._num_ps = len(cluster.get("ps", ()))


class Runtime:
    """The chief's connection to a TensorFlow parameter-server cluster."""

    def __init__(self, cluster_spec: Any, task_type: Optional[str], task_id: Optional[int],
                 partitioner: Optional[Callable], rpc_layer: Optional[str]):
        os.environ.setdefault(*_FAIL_FAST)
        resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
            _tf_cluster_spec(cluster_spec), task_type=task_type, task_id=task_id, rpc_layer=rpc_layer or "grpc"
        )
        self.strategy = _Strategy(resolver, variable_partitioner=partitioner)
        self._coordinator = None
        if partitioner is not None:
            _install_sharded_gradients()

    @property
    def num_replicas_in_sync(self) -> int:
        return self.strategy.num_replicas_in_sync

    def variable_scope(self) -> contextlib.AbstractContextManager:
        """TensorFlow's scope: variables created in it are placed on the parameter servers."""
        return self.strategy.scope()

    def native_coordinator(self) -> Any:
        """TensorFlow's own `ClusterCoordinator` (one per strategy)."""
        if self._coordinator is None:
            self._coordinator = tf.distribute.coordinator.ClusterCoordinator(self.strategy)
        return self._coordinator

    def workers(self) -> list:
        return []  # TensorFlow's coordinator dispatches to the workers itself

    def compile(self, fn: Callable) -> Callable:
        """A function the coordinator can schedule: a `tf.function`."""
        return tf.function(fn)

    def run(self, fn: Callable, args: tuple, kwargs: dict) -> Any:
        return self.strategy.run(fn, args=args, kwargs=kwargs)

    def reduce(self, reduce_op: str, value: Any, axis: Optional[int]) -> Any:
        return self.strategy.reduce(getattr(tf.distribute.ReduceOp, reduce_op), value, axis=axis)

    def experimental_distribute_dataset(self, dataset: Any, options: Any = None) -> Any:
        return self.strategy.experimental_distribute_dataset(dataset, _tf_input_options(options))

    def distribute_datasets_from_function(self, dataset_fn: Callable, options: Any = None) -> Any:
        return self.strategy.distribute_datasets_from_function(dataset_fn, _tf_input_options(options))

    @property
    def remote_value_types(self) -> tuple:
        return (tf.distribute.experimental.coordinator.RemoteValue,)


def connect(cluster_spec: Any, task_type: Optional[str], task_id: Optional[int],
            partitioner: Optional[Callable] = None, rpc_layer: Optional[str] = None) -> Runtime:
    """Connects the chief to the cluster's workers and parameter servers."""
    return Runtime(cluster_spec, task_type, task_id, partitioner, rpc_layer)


def current_worker_index() -> Any:
    """The index of the worker running the current scheduled function (inside it)."""
    return tf.distribute.coordinator.experimental_get_current_worker_index()


def _tf_input_options(options: Any) -> Any:
    if options is None or isinstance(options, tf.distribute.InputOptions):
        return options
    return tf.distribute.InputOptions(
        experimental_fetch_to_device=getattr(options, "experimental_fetch_to_device", None),
        experimental_per_replica_buffer_size=getattr(options, "experimental_per_replica_buffer_size", 1),
    )


# --- Keras variables split into shards --------------------------------------------------------

def _shards(source: Any) -> Optional[list]:
    """The shard variables of a Keras variable (or `ShardedVariable`) TensorFlow split, else None."""
    value = getattr(source, "_value", source)
    if isinstance(value, sharded_variable.ShardedVariable):
        return list(value.variables)
    return None


def _concat_shard_gradients(grads: list, shards: list) -> Any:
    if all(g is None for g in grads):
        return None
    dense = [tf.zeros_like(s) if g is None else tf.convert_to_tensor(g) for g, s in zip(grads, shards)]
    return tf.concat(dense, axis=0)


def _wrap_gradient(original: Callable) -> Callable:
    """`tape.gradient` for sources whose value TensorFlow split into shards.

    TensorFlow differentiates with respect to each shard (a variable on its
    parameter server); Keras holds the split variable as one, so its gradient
    is the shards' gradients put back together along the first axis, and the
    optimizer's update (`assign_sub`) is split again by TensorFlow.
    """

    @functools.wraps(original)
    def gradient(self, target, sources, output_gradients=None, unconnected_gradients=tf.UnconnectedGradients.NONE):
        flat = tf.nest.flatten(sources)
        split = [_shards(s) for s in flat]
        if not any(s is not None for s in split):
            return original(self, target, sources, output_gradients, unconnected_gradients)
        expanded = [v for s, shards in zip(flat, split) for v in (shards if shards is not None else [s])]
        flat_grads = original(self, target, expanded, output_gradients, unconnected_gradients)
        grads, i = [], 0
        for s, shards in zip(flat, split):
            if shards is None:
                grads.append(flat_grads[i])
                i += 1
            else:
                grads.append(_concat_shard_gradients(flat_grads[i:i + len(shards)], shards))
                i += len(shards)
        return tf.nest.pack_sequence_as(sources, grads)

    return gradient


def _wrap_add_variable_from_reference(original: Callable) -> Callable:
    """An optimizer's slot for a split variable: TensorFlow cannot colocate a variable with a
    `ShardedVariable`; created without colocation, the slot is split by the same partitioner
    into shards of the same sizes."""

    @functools.wraps(original)
    def add_variable_from_reference(self, reference_variable, *args, **kwargs):
        if _shards(reference_variable) is None:
            return original(self, reference_variable, *args, **kwargs)
        return base_optimizer.BaseOptimizer.add_variable_from_reference(self, reference_variable, *args, **kwargs)

    return add_variable_from_reference


def _wrap_distributed_update_step(original: Callable) -> Callable:
    """The optimizer's update of a split variable: TensorFlow's `extended.update` colocates with
    the variable, which a `ShardedVariable` refuses; the update itself needs no colocation (each
    shard's assignment runs on its parameter server), so it is made directly."""

    @functools.wraps(original)
    def _distributed_tf_update_step(self, distribution, grads_and_vars, learning_rate):
        grads_and_vars = list(grads_and_vars)
        split = [(g, v) for g, v in grads_and_vars if _shards(v) is not None]
        for grad, var in split:
            self.update_step(grad, var, learning_rate)
        whole = [(g, v) for g, v in grads_and_vars if _shards(v) is None]
        if whole:
            return original(self, distribution, whole, learning_rate)

    return _distributed_tf_update_step


def _on_parameter_servers(variable: Any) -> bool:
    return isinstance(getattr(variable, "_value", None), (ps_values.CachingVariable, sharded_variable.ShardedVariable))


def _wrap_increment(original: Callable, method: str) -> Callable:
    """`assign_add` / `assign_sub` of a Keras variable on the parameter servers, made atomic.

    Keras reads, adds and assigns; workers updating the same variable at once
    (`optimizer.iterations`, a metric's totals) would then lose increments.
    TensorFlow's own `assign_add` is one operation on the parameter server.
    """

    @functools.wraps(original)
    def increment(self, value):
        if not _on_parameter_servers(self) or in_stateless_scope():
            return original(self, value)
        value = self._convert_to_tensor(value, dtype=self._dtype)
        return getattr(self._value, method)(tf.cast(value, self._value.dtype))

    return increment


def _wrap_array(original: Callable) -> Callable:
    """`np.asarray(variable)` (Keras' saving, `get_weights`) of a variable split into shards: the
    shards put together (a `ShardedVariable` has no `__array__`)."""

    @functools.wraps(original)
    def __array__(self, dtype=None, *args, **kwargs):
        if _shards(self) is None:
            return original(self, dtype, *args, **kwargs)
        return np.asarray(self._value.numpy(), dtype=dtype)

    return __array__


_TF_OPTIMIZER = "keras.src.backend.tensorflow.optimizer.TFOptimizer"
_TF_VARIABLE = "keras.src.backend.tensorflow.Variable"  # the class Keras' backend package exports, wherever it lives
_INCREMENT = "ParameterServerStrategy: one atomic update on the parameter server (workers lost increments)"
_PATCHES = (
    *((patches.declare(f"{_TF_VARIABLE}.{name}", _INCREMENT),
       functools.partial(_wrap_increment, method=name)) for name in ("assign_add", "assign_sub")),
    (patches.declare(f"{_TF_VARIABLE}.__array__", "ParameterServerStrategy: a variable "
                     "split by a partitioner reads as one array (saving, get_weights)"), _wrap_array),
    (patches.declare(f"{_TF_OPTIMIZER}.add_variable_from_reference", "ParameterServerStrategy: a split variable's "
                     "slots are split by the same partitioner"), _wrap_add_variable_from_reference),
    (patches.declare(f"{_TF_OPTIMIZER}._distributed_tf_update_step", "ParameterServerStrategy: a variable split by "
                     "a partitioner is updated without colocation"), _wrap_distributed_update_step),
)
_GRADIENT = patches.declare(
    "tensorflow.python.eager.backprop.GradientTape.gradient",
    "ParameterServerStrategy with a partitioner: a split Keras variable gets one gradient, put together from its shards",
    when="once a ParameterServerStrategy with a partitioner connects")


def install_keras_hooks() -> None:
    """Installs, once, the Keras replacements for variables on the parameter servers; each
    changes nothing for other variables."""
    for patch, wrap in _PATCHES:
        patch.apply(wrap)


def _install_sharded_gradients() -> None:
    """`tf.GradientTape.gradient` for Keras variables split by a partitioner, installed when a
    strategy with a partitioner connects (see `_wrap_gradient`)."""
    _GRADIENT.apply(_wrap_gradient)
