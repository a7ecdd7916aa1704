"""TensorFlow replicas: `tf.distribute.MirroredStrategy.run`, TensorFlow's own engine.

Each replica function runs in TensorFlow's replica context (inside a
`tf.function` when compiled), so `all_reduce` is TensorFlow's cross-device
all-reduce, differentiable as in `tf.distribute`: `tf.distribute.NcclAllReduce`
between GPUs, `ReductionToOneDevice` otherwise.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any, Callable, Iterator, Sequence

import tensorflow as tf
from keras.src import tree

from keras_strategies.backend.common import partition
from keras_strategies.backend.tensorflow import gradients


_strategies: dict = {}


def batch_leaf(value: Any) -> Any:
    """A leaf of a global batch, ready to be cut into shards: as it is.

    The engine's tensors are immutable, so their slices share no state.
    """
    return value


def split_rows(value: Any, sizes: Sequence[int]) -> list:
    """A leaf of a global batch cut into its shards' rows: one `tf.split` for a dense tensor (an
    eager slice costs about 70 us, so four shards' slices cost more than the split), else slices."""
    if not isinstance(value, tf.Tensor) or value.shape.rank in (None, 0):
        return partition.row_slices(value, sizes)
    rest = int(value.shape[0]) - sum(sizes) if value.shape[0] is not None else None
    if rest is None or rest < 0:
        return partition.row_slices(value, sizes)
    pieces = tf.split(value, list(sizes) + [rest]) if rest else tf.split(value, list(sizes))
    return pieces[:len(sizes)]


def in_step_cross_device_ops(devices: Sequence[str]) -> tf.distribute.CrossDeviceOps:
    """What TensorFlow's replica context all-reduces with in our steps: NCCL between several GPUs
    (TensorFlow's own `NcclAllReduce`), else copies reduced on one device."""
    if len(devices) > 1 and all(d.startswith("gpu:") for d in devices):
        return tf.distribute.NcclAllReduce()
    return tf.distribute.ReductionToOneDevice()


def _tf_strategy(devices: Sequence[str]) -> tf.distribute.MirroredStrategy:
    key = tuple(devices)
    if key not in _strategies:
        names = [f"/device:{d.split(':')[0].upper()}:{d.split(':')[1]}" for d in devices]
        _strategies[key] = tf.distribute.MirroredStrategy(names, cross_device_ops=in_step_cross_device_ops(devices))
    return _strategies[key]


def _replica_id() -> int:
    return int(tf.get_static_value(tf.distribute.get_replica_context().replica_id_in_sync_group))


def all_reduce_sum(value: Any) -> Any:
    """Sum of `value` over the replicas of the current run (inside a replica function)."""
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return value
    return context.all_reduce(tf.distribute.ReduceOp.SUM, value)


def global_sum(values: list, across_workers: Callable[[list], list], over_all_replicas: Callable[[list], list]) -> list:
    """Sums of `values` over every replica of every worker, differentiable (inside a replica function).

    In a graph, the local sum is TensorFlow's all-reduce (its gradient is the
    all-reduce of the gradients) and each replica's cross-worker part,
    `across_workers(tensors)`, gets the same rule (the launcher's ordering
    token orders the replicas' collectives alike on every worker).
    Eagerly, TF runs the replicas in threads whose collectives would race, so
    the sum is the strategy's `over_all_replicas` (one merge, one
    cross-worker sum per worker), with the same gradient rule.

    `IndexedSlices` (an Embedding's gradients, summed by the optimizer) are
    gradients already: they are summed as they are, without a rule, and come
    back as `IndexedSlices` holding every replica's slices, as in TF.
    """
    if any(map(gradients.is_sliced, values)):
        return partition.apply_partitioned(
            values, gradients.is_sliced,
            lambda slices: over_all_replicas(slices) if tf.executing_eagerly() else across_workers(all_reduce_sum(slices)),
            lambda dense: global_sum(dense, across_workers, over_all_replicas),
        )
    tensors = [tf.convert_to_tensor(v) for v in values]
    if tf.executing_eagerly():
        return _with_sum_gradient(over_all_replicas, tensors)
    return _with_sum_gradient(across_workers, all_reduce_sum(tensors))


def _with_sum_gradient(total: Callable[[list], list], tensors: list) -> list:
    """`total(tensors)`, whose gradient is `total` of the incoming gradients."""

    @tf.custom_gradient
    def summed(*inputs):
        def grad(*upstream):
            return total([tf.zeros_like(t) if g is None else g for g, t in zip(upstream, inputs)])

        # Eagerly, a tape would ask the collective's compiled function for its own gradient.
        return total([tf.stop_gradient(t) for t in inputs]), grad

    return list(summed(*tensors))


def all_reduce_sums(values: list) -> list:
    """`all_reduce_sum` of each of `values`."""
    return [all_reduce_sum(value) for value in values]


def all_gather(value: Any, axis: int) -> Any:
    """`value` of every replica concatenated along `axis` (shard sizes may differ)."""
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return tf.convert_to_tensor(value)
    return context.all_gather(value, axis=axis)


def merge_call(fn: Callable[[list], Any], value: Any) -> Any:
    """`fn(values of every replica)` once, in TensorFlow's cross-replica context."""
    context = tf.distribute.get_replica_context()
    if context is None or not tf.distribute.has_strategy():
        return fn([value])

    def merge_fn(strategy, value):
        def component(leaf, replica_id):
            local = strategy.experimental_local_results(leaf)
            return local[replica_id] if len(local) > 1 else local[0]

        return fn([tree.map_structure(lambda v: component(v, i), value) for i in range(strategy.num_replicas_in_sync)])

    return context.merge_call(merge_fn, args=(value,))


def replica_view(value: Any, device: str) -> Any:
    """A primary variable as a replica reads it: the variable itself (TensorFlow copies across devices)."""
    return value


def onto(value: Any, like: Any) -> Any:
    """`value` for arithmetic with `like` (TensorFlow copies across devices itself)."""
    return value


class _EagerOverheadFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "eagerly has significant overhead" not in record.getMessage()


@contextlib.contextmanager
def _without_eager_overhead_warning() -> Iterator[None]:
    """Hides TF's "Using MirroredStrategy eagerly has significant overhead" for our eager runs.

    They are eager by design (a model's own `train_step`, `run_eagerly=True`, a
    custom loop outside `ks.function`), and the warning names TF calls
    (`call_for_each_replica`, `experimental_run`) the user never made: a
    model with its own `train_step` printed it five times in every `fit`.
    """
    logger, hidden = tf.get_logger(), _EagerOverheadFilter()
    logger.addFilter(hidden)
    try:
        yield
    finally:
        logger.removeFilter(hidden)


def _any_batch_size(value: Any) -> Any:
    """`value` with an unknown batch size in a replicated step of ours.

    With shards of different sizes, TF's relaxed retracing gives a replica whose
    size did not change a static shape and the others an unknown one, and its
    gradients then differ in structure: a synchronized BatchNormalization after
    a convolution made one more backward all-reduce on some replicas than on
    others, and the program failed ("Dimension 0 in both shapes must be
    equal"). Every replica now sees the same unknown batch size.
    """
    if tf.executing_eagerly() or not isinstance(value, tf.Tensor) or value.shape.rank in (None, 0):
        return value
    return tf.raw_ops.PlaceholderWithDefault(input=value, shape=[None] + value.shape.as_list()[1:])


def replica_device_scope(replica_id: Any, devices: Sequence[str]) -> contextlib.AbstractContextManager:
    """Where Keras creates a replica's tensors in a replicated step: nothing to set.

    TensorFlow's strategy places each replica itself.
    """
    return contextlib.nullcontext()


def make_replicated(fn: Callable, devices: Sequence[str], compiled: bool, variables: Sequence[Any] = ()) -> Callable:
    """`run(shared, per_replica)` calls `fn(replica_id, *shared, *per_replica[i])` on every replica.

    `variables` matters to engines whose replicas share per-variable state (torch's `.grad`).
    """
    strategy = _tf_strategy(devices)
    # TensorFlow runs TPU replicas only inside a `tf.function`, on the static shapes the TPU compiles for.
    tpu = isinstance(strategy, tf.distribute.TPUStrategy)

    def step(shared, distributed):
        def replica_fn(shared, own):
            if compiled and not tpu:  # our steps; a user's `run` keeps TF's shapes
                own = tree.map_structure(_any_batch_size, own)
            return fn(_replica_id(), *shared, *own)

        return strategy.run(replica_fn, args=(shared, distributed))

    if compiled or tpu:
        # A partial has no `__code__`: TF counts traces per code object, so every replicated step
        # (train, test, predict, of every model) would share one count and warn of "frequent
        # retracing" after a few first traces; this way each function has its own count.
        step = tf.function(functools.partial(step), reduce_retracing=True, autograph=False)

    def run(shared: tuple, per_replica: Sequence[tuple]) -> list:
        distributed = strategy.experimental_distribute_values_from_function(
            lambda ctx: per_replica[ctx.replica_id_in_sync_group]
        )
        with contextlib.nullcontext() if compiled else _without_eager_overhead_warning():
            outputs = step(shared, distributed)

        def component(value, replica_id):
            if value is None:
                return None
            local = strategy.experimental_local_results(value)
            return local[replica_id] if len(local) > 1 else local[0]  # identical outputs collapse to one

        return [tree.map_structure(lambda v: component(v, i), outputs) for i in range(len(devices))]

    return run
