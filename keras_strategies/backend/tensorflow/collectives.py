"""Cross-worker collectives on TensorFlow: `tf.distribute.MultiWorkerMirroredStrategy`'s own engine.

`initialize` builds a TF `MultiWorkerMirroredStrategy` for the cluster, which
starts the gRPC server, enables TF collective ops and the coordination
service (whose key-value store carries our heartbeats). Reductions use its
host collective launcher (`CollectiveReduceV2`, packed by `bytes_per_pack`),
eagerly or inside a `tf.function`.
"""

from __future__ import annotations

from typing import Any, Optional

import tensorflow as tf

from keras_strategies.multi_worker import packing

_state: dict = {}


# TF's own collective timeout is only a backstop: our watchdog enforces `timeout_seconds` and
# names the worker. When TF aborted a collective at the same moment, the process sometimes died
# inside TF's abort without any message (seen once in the suite's hung-worker test).
TF_TIMEOUT_MARGIN_SECONDS = 30.0


def _tf_options(options: Any) -> tf.distribute.experimental.CommunicationOptions:
    implementation = getattr(tf.distribute.experimental.CommunicationImplementation, options.implementation.value)
    return tf.distribute.experimental.CommunicationOptions(
        bytes_per_pack=options.bytes_per_pack,
        timeout_seconds=options.effective_timeout + TF_TIMEOUT_MARGIN_SECONDS,
        implementation=implementation,
    )


def local_task() -> Optional[tuple]:
    """`(job, task index)` of this process once it has joined a cluster, else `None`."""
    return _state.get("task")


def initialize(cluster: Any, options: Any) -> None:
    """Joins the cluster (blocks until every worker has started)."""
    from tensorflow.python.eager import context as tf_context

    if tf_context.context()._context_handle is not None:  # noqa: SLF001 - TF has no public check
        raise RuntimeError(
            "Create ks.MultiWorkerMirroredStrategy at program startup, before any TensorFlow "
            "operation runs: TensorFlow can only join a cluster before it initialises."
        )
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(cluster.cluster_spec.as_dict()),
        task_type=cluster.task_type,
        task_id=cluster.task_id,
        rpc_layer=cluster.rpc_layer or "grpc",
    )
    strategy = tf.distribute.MultiWorkerMirroredStrategy(
        cluster_resolver=resolver, communication_options=_tf_options(options)
    )
    _state["strategy"] = strategy
    _state["launcher"] = strategy.extended._host_cross_device_ops._launchers[0]  # noqa: SLF001
    _state["device"] = strategy.extended._worker_device  # noqa: SLF001
    _state["bytes_per_pack"] = options.bytes_per_pack
    _state["task"] = (cluster.task_type, int(cluster.task_id))
    _state["eager_fn"] = tf.function(_packed_all_reduce, reduce_retracing=True)


def _packed_all_reduce(tensors: list) -> list:
    """One collective per pack (graph mode, where TF packs).

    Packs are per dtype. With `bytes_per_pack` TF splits them by size;
    without, tensors of at least `packing.SEPARATE_BYTES` go alone (no copy
    into a pack and out of it) and the rest share one pack.
    """
    from tensorflow.python.distribute import cross_device_utils

    launcher, bytes_per_pack = _state["launcher"], _state["bytes_per_pack"]
    order: list = []
    packs: list = []
    for indices in packing.group_by_dtype(tensors):
        if bytes_per_pack:
            group = [tensors[i] for i in indices]
            for pack in cross_device_utils.group_by_size(group, bytes_per_pack):
                packs.append(pack)
            order.extend(indices)
            continue
        sizes = [(tensors[i].shape.num_elements() or 0) * tensors[i].dtype.size for i in indices]
        alone, rest = packing.plan([tensors[i].dtype for i in indices], sizes,
                                   [tensors[i].shape.is_fully_defined() for i in indices])
        for group in [[k] for k in alone] + rest:
            packs.append([tensors[indices[k]] for k in group])
            order.extend(indices[k] for k in group)
    outputs: list = [None] * len(tensors)
    for i, value in zip(order, launcher.batch_all_reduce(packs)):
        outputs[i] = value
    return outputs


def tracing() -> bool:
    """True inside a `tf.function` (collectives then become graph ops)."""
    return not tf.executing_eagerly()


def all_reduce_sum(values: list, donated: Any = False) -> list:
    """Element-wise sums of `values` over all workers (same shapes and dtypes on every worker).

    `donated` is accepted for the engines' common interface: TF's collectives
    write their own outputs. Works eagerly (through a cached `tf.function`, so the tensors are packed)
    and inside a `tf.function` (e.g. a `merge_call` of a compiled custom step).
    """
    with tf.device(_state["device"]):
        tensors = [tf.convert_to_tensor(v) for v in values]
        if tf.executing_eagerly():
            return list(_state["eager_fn"](tensors))
        return _packed_all_reduce(tensors)


def kv_set(key: str, value: str) -> None:
    from tensorflow.python.eager import context as tf_context

    # TF's key-value store refuses to overwrite: replace the key.
    try:
        tf_context.context().delete_config_key_value(key)
    except tf.errors.OpError:
        pass
    tf_context.context().set_config_key_value(key, value)


def kv_try_get(key: str) -> Optional[str]:
    from tensorflow.python.eager import context as tf_context

    try:
        return tf_context.context().get_config_key_value(key, timeout_in_ms=50)
    except (tf.errors.DeadlineExceededError, tf.errors.NotFoundError):
        return None


def shutdown() -> None:
    _state.clear()
