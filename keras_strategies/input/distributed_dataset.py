"""Distributed datasets: each element is one global step, split into one value per replica.

`experimental_distribute_dataset` takes batches of the *global* batch size
and splits each across the replicas (sizes differ by at most one; replicas
beyond the batch size get empty batches). `distribute_datasets_from_function`
takes a dataset batched *per replica* and gives each replica the next element.
Iteration stops only when no replica has data, so no sample is dropped.
With several workers, every worker reads the same global batches and takes
its replicas' shards (`experimental_distribute_dataset`), or builds its own
pipeline from `InputContext.input_pipeline_id` (`distribute_datasets_from_function`);
each step the workers agree whether any of them still has data.
Sources: `tf.data.Dataset` (on every backend), `NumpyDataset`, `keras.utils.PyDataset`,
or any Python iterable of batches (NumPy structures or backend tensors).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Optional

import numpy as np
from keras import ops
from keras.src import tree

from keras_strategies.backend import engine
from keras_strategies.input.options import InputContext, InputOptions, InputReplicationMode
from keras_strategies.input.splitting import batch_size_of, shard_sizes, split_batch
from keras_strategies.distribute.values import PerReplica, regroup, tag_strategy


def _batches(source: Any) -> Iterator[Any]:
    """Iterates any supported source as NumPy structures."""
    # A list is an iterable of batches; an array, or a tuple/dict of arrays, is unbatched data.
    if isinstance(source, np.ndarray) or (isinstance(source, (tuple, dict)) and source and all(
        isinstance(leaf, np.ndarray) for leaf in tree.flatten(source)
    )):
        raise ValueError(
            "Distribute a dataset of batches, not raw arrays: e.g. "
            "`strategy.experimental_distribute_dataset(strategy.make_experimental_numpy_dataset((x, y)).batch(64))`."
        )
    if hasattr(source, "as_numpy_iterator"):  # tf.data.Dataset
        return iter(source.as_numpy_iterator())
    if hasattr(source, "__getitem__") and hasattr(source, "num_batches"):  # keras.utils.PyDataset
        return (source[i] for i in range(source.num_batches))
    return (tree.map_structure(lambda leaf: ops.convert_to_numpy(leaf), batch) for batch in source)


def _empty_like(structure: Any) -> Any:
    return tree.map_structure(lambda leaf: np.zeros((0,) + np.shape(leaf)[1:], dtype=np.asarray(leaf).dtype), structure)


class OptionalValue:
    """What `get_next_as_optional` returns: a value, or nothing at the end of the data."""

    def __init__(self, value: Any = None, has_value: bool = False):
        self._value, self._has_value = value, has_value

    def has_value(self) -> bool:
        return self._has_value

    def get_value(self) -> Any:
        if not self._has_value:
            raise ValueError("The optional has no value: the distributed iterator is exhausted.")
        return self._value


class DistributedIterator:
    """Iterator over global steps; each element holds one value per replica.

    As `tf.distribute.DistributedIterator`: `iter(dist_dataset)` returns one.
    Iterate it in Python (batches are split on the host), and call a
    compiled step once per element.

    Examples:
        >>> strategy = ks.MirroredStrategy(["cpu:0", "cpu:1"])
        >>> dataset = strategy.make_experimental_numpy_dataset(np.ones((8, 1), "float32")).batch(4)
        >>> iterator = iter(strategy.experimental_distribute_dataset(dataset))
        >>> batch = next(iterator)
        >>> [tuple(shard.shape) for shard in batch.values]
        [(2, 1), (2, 1)]
    """

    def __init__(self, next_step: Callable[[], Any], dataset: "DistributedDataset"):
        self._next_step = next_step
        self._dataset = dataset

    @property
    def element_spec(self) -> Any:
        """The type of one element (see `DistributedDataset.element_spec`)."""
        return self._dataset.element_spec

    def __iter__(self) -> "DistributedIterator":
        return self

    def __next__(self) -> Any:
        return self._next()

    def get_next(self) -> Any:
        """The next element; raises `StopIteration` at the end (as `next(iterator)`).

        Examples:
            >>> strategy = ks.MirroredStrategy(["cpu:0", "cpu:1"])
            >>> dataset = strategy.make_experimental_numpy_dataset(np.ones((4, 1), "float32")).batch(4)
            >>> iterator = iter(strategy.experimental_distribute_dataset(dataset))
            >>> len(iterator.get_next().values)
            2
        """
        return self._next()

    def get_next_as_optional(self) -> OptionalValue:
        """The next element as an optional: `has_value()` is False at the end instead of raising.

        Examples:
            >>> strategy = ks.MirroredStrategy(["cpu:0", "cpu:1"])
            >>> dataset = strategy.make_experimental_numpy_dataset(np.ones((4, 1), "float32")).batch(4)
            >>> iterator = iter(strategy.experimental_distribute_dataset(dataset))
            >>> iterator.get_next_as_optional().has_value(), iterator.get_next_as_optional().has_value()
            (True, False)
        """
        try:
            return OptionalValue(self._next(), True)
        except StopIteration:
            return OptionalValue()

    def _next(self) -> Any:
        _refuse_while_tracing()
        return self._next_step()


def _refuse_while_tracing() -> None:
    """Read while tracing, one batch would be baked into the program and repeated."""
    if engine.collectives.tracing():
        raise RuntimeError(
            "A distributed dataset cannot be iterated inside a compiled function "
            "(`tf.function`, `ks.function`, `jax.jit`): its batches are split on the host. "
            "Take the batches in Python and call the compiled step once per batch, e.g. "
            "`for batch in dist_dataset: step(batch)`, instead of `next(iterator)` in a "
            "`tf.range` loop or `for batch in dist_dataset` inside the function."
        )


class DistributedDataset:
    """What `experimental_distribute_dataset` and `distribute_datasets_from_function` return.

    As `tf.distribute.DistributedDataset`: iterate it (`for`, `iter`) for one
    distributed value per step, each leaf a `PerReplica` with every replica's
    part, and pass that to `strategy.run`. Iteration stops when no replica
    (of any worker) has data left; nothing is dropped. Get it from the
    strategy; do not construct it.

    Examples:
        >>> strategy = ks.MirroredStrategy(["cpu:0", "cpu:1"])
        >>> x = np.arange(6, dtype="float32").reshape(6, 1)
        >>> dataset = strategy.make_experimental_numpy_dataset(x).batch(4)  # batches of 4 and 2
        >>> for batch in strategy.experimental_distribute_dataset(dataset):
        ...     sums = strategy.run(lambda shard: keras.ops.sum(shard), args=(batch,))
        ...     print(float(strategy.reduce("sum", sums, axis=None)))
        6.0
        9.0
    """

    def __init__(self, strategy: Any, options: Optional[InputOptions]):
        self._strategy = strategy
        self._options = options or InputOptions()
        self._devices = strategy.extended.worker_devices

    def _place(self, per_replica_values: list) -> Any:
        """One structure whose leaves hold each replica's value on that replica's device."""
        fetch = self._options.experimental_fetch_to_device is not False
        flat = [tree.flatten(v) for v in per_replica_values]
        leaves = [(i, j) for i, values in enumerate(flat) for j, leaf in enumerate(values) if leaf is not None]
        if fetch:  # every shard to its replica's device at once
            moved = engine.devices.place_each([flat[i][j] for i, j in leaves], [self._devices[i] for i, _ in leaves])
        else:
            moved = [ops.convert_to_tensor(flat[i][j]) for i, j in leaves]
        for (i, j), value in zip(leaves, moved):
            flat[i][j] = value
        placed = [tree.pack_sequence_as(v, values) for v, values in zip(per_replica_values, flat)]
        return tag_strategy(placed[0] if len(placed) == 1 else regroup(placed, PerReplica), self._strategy)

    def _next_on_every_worker(self, batches: Iterator[Any]) -> Any:
        """The next element; with several workers, iteration ends only when every worker's ends.

        A worker whose input ran out first gets an empty batch (shaped like its
        last one) while others still have data, so no worker waits forever.
        """
        try:
            element, has_data = next(batches), True
            self._last = element
        except StopIteration:
            element, has_data = None, False
        if not self._strategy.extended._any_worker_has(has_data):
            raise StopIteration
        if has_data:
            return element
        if getattr(self, "_last", None) is None:
            raise RuntimeError(
                "This worker's input is empty while other workers still have data; every "
                "worker needs at least one batch to take part in the steps."
            )
        return _empty_like(self._last)

    @property
    def element_spec(self) -> Any:
        """The type of one element, as `tf.distribute.DistributedDataset.element_spec`.

        The source `tf.data.Dataset`'s spec with an unknown batch size (shards
        differ), each leaf a `PerReplica` of one spec per local replica (with
        one replica, the spec itself). On TensorFlow it serves as a
        `tf.function` `input_signature`, as in TensorFlow's input guide.
        """
        spec = getattr(self._dataset, "element_spec", None)
        if spec is None:
            raise ValueError(
                f"element_spec is known for a distributed tf.data.Dataset; this one reads a "
                f"{type(self._dataset).__name__}."
            )
        from keras.src.utils.module_utils import tensorflow as tf

        def per_replica(leaf: Any) -> Any:
            if isinstance(leaf, tf.TensorSpec) and leaf.shape.rank:
                leaf = tf.TensorSpec((None,) + tuple(leaf.shape[1:]), leaf.dtype, leaf.name)
            return leaf if len(self._devices) == 1 else PerReplica([leaf] * len(self._devices))

        return tf.nest.map_structure(per_replica, spec)

    def reduce(self, initial_state: Any, reduce_func: Callable[[Any, Any], Any]) -> Any:
        """Folds `reduce_func(state, element)` over the elements, from `initial_state`.

        Examples:
            >>> strategy = ks.MirroredStrategy(["cpu:0", "cpu:1"])
            >>> dataset = strategy.make_experimental_numpy_dataset(np.ones((8, 1), "float32")).batch(4)
            >>> strategy.experimental_distribute_dataset(dataset).reduce(0, lambda steps, _: steps + 1)
            2
        """
        state = initial_state
        for element in self:
            state = reduce_func(state, element)
        return state


class GlobalBatchDataset(DistributedDataset):
    """`strategy.experimental_distribute_dataset(dataset)`: global batches split across replicas."""

    def __init__(self, strategy: Any, dataset: Any, options: Optional[InputOptions] = None):
        super().__init__(strategy, options)
        if self._options.experimental_replication_mode == InputReplicationMode.PER_REPLICA:
            raise NotImplementedError(
                "InputReplicationMode.PER_REPLICA is only supported with "
                "`distribute_datasets_from_function`."
            )
        self._dataset = dataset

    def __iter__(self) -> DistributedIterator:
        _refuse_while_tracing()
        batches = _batches(self._dataset)
        extended = self._strategy.extended
        num_local, worker = len(self._devices), extended._worker_index

        def next_step():
            batch = self._next_on_every_worker(batches)
            # Every worker reads the same global batch and takes its replicas' consecutive shards.
            sizes = shard_sizes(batch_size_of(batch), num_local * extended._num_workers)
            offset = sum(sizes[:worker * num_local])
            mine = sizes[worker * num_local:(worker + 1) * num_local]
            batch = tree.map_structure(lambda leaf: leaf[offset:offset + sum(mine)], batch)
            return self._place(split_batch(batch, mine))

        return DistributedIterator(next_step, self)


class DistributedDatasetsFromFunction(DistributedDataset):
    """`strategy.distribute_datasets_from_function(fn)`: each replica takes the next per-replica batch."""

    def __init__(self, strategy: Any, dataset_fn: Callable[[InputContext], Any], options: Optional[InputOptions] = None):
        super().__init__(strategy, options)
        extended = strategy.extended
        context = InputContext(num_input_pipelines=extended._num_workers, input_pipeline_id=extended._worker_index,
                               num_replicas_in_sync=strategy.num_replicas_in_sync)
        self._dataset = dataset_fn(context)

    def __iter__(self) -> DistributedIterator:
        _refuse_while_tracing()
        batches = _batches(self._dataset)
        num_replicas = len(self._devices)

        def next_step():
            elements = []
            for _ in range(num_replicas):
                try:
                    elements.append(next(batches))
                except StopIteration:
                    break
            if elements:
                self._last = elements[0]
            if not self._strategy.extended._any_worker_has(bool(elements)):
                raise StopIteration
            if not elements and getattr(self, "_last", None) is None:
                raise RuntimeError(
                    "This worker's input pipeline is empty while other workers still have data; "
                    "every input pipeline needs at least one batch."
                )
            template = elements[0] if elements else self._last
            elements += [_empty_like(template)] * (num_replicas - len(elements))
            return self._place(elements)

        return DistributedIterator(next_step, self)
