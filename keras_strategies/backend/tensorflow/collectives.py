"""Cross-worker collectives on TensorFlow: `tf.distribute.MultiWorkerMirroredStrategy`'s own engine.

`initialize` builds a TF `MultiWorkerMirroredStrategy` for the cluster, which
starts the gRPC server, enables TF collective ops and the coordination
service (whose key-value store carries our heartbeats). Reductions are TF's
`CollectiveReduceV2` ops, one pack per dtype (split by `bytes_per_pack`): inside a
user's `tf.function` through the strategy's collective launcher, eagerly
through one compiled program per signature with instance keys of its own.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import tensorflow as tf

from keras_strategies.backend.common import packing, partition, pending
from keras_strategies.backend.tensorflow import gradients

_state: dict = {}

# Eager collectives use a group of their own (TF's launcher numbers its groups from 1), and
# keep programs and instance keys for at most this many signatures (see `_eager_program`).
EAGER_GROUP_KEY = 1_000_000_007
MAX_KEYED_SIGNATURES = 256


# TF's own collective timeout is only a backstop: our watchdog enforces `timeout_seconds` and
# names the worker. When TF aborted a collective at the same moment, the process sometimes died
# inside TF's abort without any message (seen once in the suite's hung-worker test).
TF_TIMEOUT_MARGIN_SECONDS = 30.0

_HALF_FLOATS = (tf.float16, tf.bfloat16)


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
    tf_options = _tf_options(options)
    strategy = tf.distribute.MultiWorkerMirroredStrategy(cluster_resolver=resolver, communication_options=tf_options)
    _state["strategy"] = strategy
    _state["launcher"] = strategy.extended._host_cross_device_ops._launchers[0]  # noqa: SLF001
    _state["device"] = strategy.extended._worker_device  # noqa: SLF001
    _state["bytes_per_pack"] = options.bytes_per_pack
    _state["task"] = (cluster.task_type, int(cluster.task_id))
    _state["eager_fn"] = tf.function(_packed_all_reduce, reduce_retracing=True)
    _state["gather_programs"] = {}  # signature -> its compiled all-gather (`all_gather`)
    _state["num_workers"] = cluster.num_workers
    _state["worker_index"] = cluster.worker_index
    # The eager programs' collectives take the launcher's settings.
    _state["hint"] = tf_options.implementation.value.lower()
    _state["timeout"] = float(tf_options.timeout_seconds)
    _state["keyed"] = {}
    _state["next_key"] = 1


def _pack_plan(tensors: list) -> list:
    """Index groups of `tensors`, one collective each: one per dtype, split by `bytes_per_pack`.

    As TF's own MultiWorkerMirroredStrategy packs. Each TF collective has a
    fixed cost of ~1 ms between CPU workers (gRPC round trips), more than
    copying even a large gradient into the pack: measured on 16 MB in 10
    tensors, one pack beat sending the large ones alone.
    """
    from tensorflow.python.distribute import cross_device_utils

    bytes_per_pack = _state["bytes_per_pack"]
    groups: list = []
    for indices in packing.group_by_dtype(tensors):
        start = 0
        for pack in cross_device_utils.group_by_size([tensors[i] for i in indices], bytes_per_pack):
            groups.append(indices[start:start + len(pack)])
            start += len(pack)
    return groups


def _packed_all_reduce(tensors: list) -> list:
    """One collective per pack through TF's launcher (inside a user's `tf.function`).

    The launcher gives every collective a fresh instance key at call time, so
    a traced step stays correct however each worker retraces it.
    """
    groups = _pack_plan(tensors)
    summed = _state["launcher"].batch_all_reduce([[tensors[i] for i in group] for group in groups])
    outputs: list = [None] * len(tensors)
    for i, value in zip([i for group in groups for i in group], summed):
        outputs[i] = value
    return outputs


def _all_reduce_with_keys(tensors: list, first_key: int) -> list:
    """One `CollectiveReduceV2` per pack, with instance keys `first_key + pack index` (the eager path)."""
    outputs: list = [None] * len(tensors)
    with tf.device(_state["device"]):
        for index, group in enumerate(_pack_plan(tensors)):
            pack = [tensors[i] for i in group]
            alone = len(pack) == 1 and pack[0].shape.rank
            flat = pack[0] if alone else tf.concat([tf.reshape(t, [-1]) for t in pack], 0)
            summed = tf.raw_ops.CollectiveReduceV2(
                input=flat, group_size=_state["num_workers"], group_key=EAGER_GROUP_KEY,
                instance_key=first_key + index, ordering_token=[], merge_op="Add", final_op="Id",
                communication_hint=_state["hint"], timeout_seconds=_state["timeout"],
            )
            parts = [summed] if alone else tf.split(summed, [t.shape.num_elements() for t in pack])
            for i, part in zip(group, parts):
                outputs[i] = tf.reshape(part, tensors[i].shape)
    return outputs


def _eager_program(tensors: list) -> Callable[[list], list]:
    """The compiled all-reduce of this exact signature, with instance keys of its own.

    TF resolves a collective's parameters once per instance key: a fresh key
    per call (the launcher's way) costs ~1 ms per collective on a CPU worker,
    as much as a whole 1 MB all-reduce. A key must keep its shapes, so each
    exact signature gets its own program and block of keys (at most one
    collective per tensor), handed out in the order the signatures first
    appear: the same on every worker, since all run the same collectives in
    the same order. Past `MAX_KEYED_SIGNATURES` signatures, the launcher's
    program (relaxed shapes, fresh keys) takes the rest. The program is
    called through its concrete function's flat call when TF has one, which
    skips ~0.25 ms of argument binding for ten tensors.
    """
    signature = tuple((tuple(t.shape), t.dtype) for t in tensors)
    programs = _state["keyed"]
    program = programs.get(signature)
    if program is None:
        if len(programs) >= MAX_KEYED_SIGNATURES:
            return _state["eager_fn"]
        compiled = tf.function(functools.partial(_all_reduce_with_keys, first_key=_state["next_key"]))
        _state["next_key"] += len(tensors)
        concrete = compiled.get_concrete_function(tensors)
        call_flat = getattr(concrete, "_call_flat", None)
        if call_flat is None:
            program = compiled
        else:
            captured = concrete.captured_inputs
            program = lambda ts: call_flat(ts, captured)  # noqa: E731
        programs[signature] = program
    return program


def tracing() -> bool:
    """True inside a `tf.function` (collectives then become graph ops)."""
    return not tf.executing_eagerly()


def all_reduce_sum(values: list, donated: Any = False) -> list:
    """Element-wise sums of `values` over all workers (same shapes and dtypes on every worker).

    `donated` is accepted for the engines' common interface: TF's collectives
    write their own outputs. An `IndexedSlices` (the gradient of an Embedding)
    is gathered, as TF's own strategy does: the result holds every worker's
    slices, as one process's gradient holds every row's, and Keras' optimizers
    on TensorFlow treat those differently from their dense sum (Adam squares
    each slice). Works eagerly (through a compiled program per signature, so the
    tensors are packed) and inside a `tf.function` (e.g. a `merge_call` of a compiled custom step).
    """
    with tf.device(_state["device"]):
        return partition.apply_partitioned(
            values, gradients.is_sliced,
            lambda slices: [_state["launcher"].all_reduce_indexed_slices(s) for s in slices], _all_reduce_dense,
        )


def _all_reduce_dense(values: list) -> list:
    tensors = [tf.convert_to_tensor(v) for v in values]
    dtypes = [t.dtype for t in tensors]
    # TF's CPU collectives crash the process on half floats: they travel as float32 (exact).
    tensors = [tf.cast(t, tf.float32) if t.dtype in _HALF_FLOATS else t for t in tensors]
    summed = _eager_program(tensors)(tensors) if tf.executing_eagerly() else _packed_all_reduce(tensors)
    return [value if value.dtype == dtype else tf.cast(value, dtype) for value, dtype in zip(summed, dtypes)]


def start_all_reduce_sum(values: list, donated: Any = False) -> pending.Finished:
    """`all_reduce_sum(values, donated)` as a pending result (the engines' common interface).

    TensorFlow runs it at once: its eager collectives are compiled programs
    whose order on every worker is kept by running them one after another.
    """
    return pending.Finished(all_reduce_sum(values, donated))


def _all_gather_in_graph(tensors: list) -> list:
    """One `CollectiveGatherV2` per dtype through TF's launcher (fresh instance keys at call time),
    of the tensors packed flat: `(num_workers, *shape)` each. Empty packs are not sent (TF's CPU
    collectives crash the process on empty tensors)."""
    workers = _state["num_workers"]
    outputs: list = [None] * len(tensors)
    for group in packing.group_by_dtype(tensors):
        sizes = [tensors[i].shape.num_elements() for i in group]
        if sum(sizes):
            flat = tf.concat([tf.reshape(tensors[i], [-1]) for i in group], 0)
            stacked = tf.reshape(_state["launcher"].all_gather(tf.expand_dims(flat, 0), axis=0), [workers, -1])
            parts = tf.split(stacked, sizes, axis=1)
        else:
            parts = [tf.zeros([workers, 0], tensors[i].dtype) for i in group]
        for i, part in zip(group, parts):
            outputs[i] = tf.reshape(part, [workers, *tensors[i].shape])
    return outputs


def all_gather(values: list) -> list:
    """Each of `values` from every worker, stacked in worker order: `(num_workers, *shape)`.

    TF's collective all-gather, one per dtype, in one compiled program
    (eagerly) or in the graph being traced; half floats travel as float32
    (exact), as in `all_reduce_sum`.
    """
    with tf.device(_state["device"]):
        tensors = [tf.convert_to_tensor(v) for v in values]
        dtypes = [t.dtype for t in tensors]
        tensors = [tf.cast(t, tf.float32) if t.dtype in _HALF_FLOATS else t for t in tensors]
        # Inside a compiled step (the cross-worker exchange of a train step), ops of its graph.
        if tf.executing_eagerly():  # one program per exact signature: the packs need static sizes
            signature = tuple((tuple(t.shape), t.dtype) for t in tensors)
            program = _state["gather_programs"].setdefault(signature, tf.function(_all_gather_in_graph))
            gathered = program(tensors)
        else:
            gathered = _all_gather_in_graph(tensors)
    return [value if value.dtype == dtype else tf.cast(value, dtype) for value, dtype in zip(gathered, dtypes)]


def _reduce_scatter_with_keys(tensors: list, first_key: int) -> list:
    """One collective sum per dtype, with instance keys `first_key + dtype index`, of the values
    packed `(num_workers, -1)` side by side (row w of the pack is every value's row w): this
    worker's summed row of each value. Empty packs are not sent, as in `_all_gather_in_graph`.

    TF's `CollectiveReduceScatterV2` has no CPU implementation ("CollectiveRegistry::Lookup did
    not find collective implementation"), so the pack is all-reduced (`CollectiveReduceV2`) and
    this worker keeps its row: the same sums, with the whole pack sent."""
    workers, row = _state["num_workers"], _state["worker_index"]
    outputs: list = [None] * len(tensors)
    for index, group in enumerate(packing.group_by_dtype(tensors)):
        sizes = [tensors[i].shape[1:].num_elements() for i in group]
        if sum(sizes):
            pack = tf.concat([tf.reshape(tensors[i], [workers, size]) for i, size in zip(group, sizes)], 1)
            summed = tf.raw_ops.CollectiveReduceV2(
                input=pack, group_size=workers, group_key=EAGER_GROUP_KEY,
                instance_key=first_key + index, ordering_token=[], merge_op="Add", final_op="Id",
                communication_hint=_state["hint"], timeout_seconds=_state["timeout"],
            )
            parts = tf.split(summed[row], sizes)
        else:
            parts = [tf.zeros([0], tensors[i].dtype) for i in group]
        for i, part in zip(group, parts):
            outputs[i] = tf.reshape(part, tensors[i].shape[1:])
    return outputs


def reduce_scatter_sum(values: list) -> list:
    """This worker's row of each of `values` (`(num_workers, *shape)`), summed over the workers.

    TF's collective sum, one per dtype (see `_reduce_scatter_with_keys`), in one compiled program per
    exact signature with a block of instance keys of its own (handed out in the
    order the signatures first appear, the same on every worker, as for the
    all-reduce's keyed programs); half floats travel as float32 (exact).
    """
    with tf.device(_state["device"]):
        tensors = [tf.convert_to_tensor(v) for v in values]
        dtypes = [t.dtype for t in tensors]
        tensors = [tf.cast(t, tf.float32) if t.dtype in _HALF_FLOATS else t for t in tensors]
        signature = tuple((tuple(t.shape), t.dtype) for t in tensors)
        programs = _state.setdefault("scatter_programs", {})
        if signature not in programs:
            programs[signature] = tf.function(functools.partial(_reduce_scatter_with_keys, first_key=_state["next_key"]))
            _state["next_key"] += len(tensors)
        summed = programs[signature](tensors)
    return [value if value.dtype == dtype else tf.cast(value, dtype) for value, dtype in zip(summed, dtypes)]


def kv_set(key: str, value: str) -> None:
    from tensorflow.python.eager import context as tf_context

    # TF's key-value store refuses to overwrite: replace the key.
    try:
        tf_context.context().delete_config_key_value(key)
    except tf.errors.OpError:
        pass
    try:
        tf_context.context().set_config_key_value(key, value)
    except tf.errors.DeadlineExceededError:
        pass  # a busy chief answered late: no sign that it is gone (the next beat tries again)


def kv_try_get(key: str) -> Optional[str]:
    from tensorflow.python.eager import context as tf_context

    try:
        return tf_context.context().get_config_key_value(key, timeout_in_ms=50)
    except (tf.errors.DeadlineExceededError, tf.errors.NotFoundError):
        return None


def shutdown() -> None:
    _state.clear()
