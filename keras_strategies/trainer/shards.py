"""A global batch cut into per-replica shards: this worker's rows, split over its replicas.

The split is `input/splitting.py`'s (the first `B mod N` replicas take one row
more); where the engine's compiled programs need one shard shape (JAX) or the
strategy static shapes (TPU), shards are padded with copies of real rows that
carry weight 0 (`input/padding.py`) and a row mask. With several workers the
global batch is split over every replica of every worker, and this worker
takes its own consecutive shards (or, with per-worker input, its own batch).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np
from keras import ops
from keras.src import tree
from keras.src.trainers.data_adapters import data_adapter_utils

from keras_strategies.backend import engine
from keras_strategies.input import padding, worker_sharding
from keras_strategies.input.splitting import batch_size_of, shard_sizes, split_batch


def as_tensors(structure: Any) -> Any:
    """The leaves of a shard as backend tensors, as Keras' own trainers hand them to a step.

    Shards are cut as NumPy arrays; a model's `call` may mix its inputs with
    tensors (`r - x` in an autoencoder's `add_loss`), which fails on PyTorch
    with a NumPy `x`. Inside a compiled replica program they already are tensors.
    """
    return tree.map_structure(lambda leaf: None if leaf is None else ops.convert_to_tensor(leaf), structure)


class Shards:
    """A global batch cut into per-replica shards, padded where the engine needs it."""

    def __init__(self, data: Any, num_replicas: int, with_targets: bool, num_workers: int = 1, worker_index: int = 0,
                 worker_rows: Any = None, equal_shapes: Optional[bool] = None, min_rows: int = 0):
        data = tree.map_structure(lambda leaf: None if leaf is None else engine.replicas.batch_leaf(leaf), data)
        if with_targets:
            self.x, self.y, self.sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
        else:
            self.x, self.y, self.sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)[0], None, None
        # `worker_rows`: per-worker input, where `data` holds this worker's rows only and
        # `worker_rows[i]` is worker i's batch size (the global batch is their concatenation).
        self.global_input = worker_rows is None
        if self.global_input:
            self.batch = batch_size_of(self.x)
            # The global batch is split over every replica of every worker; this worker takes
            # the consecutive shards of its own replicas, rows [offset, offset + local_rows).
            all_sizes = shard_sizes(self.batch, num_replicas * num_workers)
            self.offset = sum(all_sizes[:worker_index * num_replicas])
        else:
            self.batch = int(sum(worker_rows))
            all_sizes = [size for rows in worker_rows for size in shard_sizes(int(rows), num_replicas)]
            self.offset = int(sum(worker_rows[:worker_index]))
        self.sizes = all_sizes[worker_index * num_replicas:(worker_index + 1) * num_replicas]
        # Static shapes (TPUStrategy): every shard padded to at least `min_rows` rows, so that a partial
        # last batch has the shape of the full ones. Padded to one shape, shards then get padding rows
        # when their sizes differ or fall short of `min_rows`: `uneven` (the same on every worker, so
        # every worker takes the same path through a step).
        self.min_rows = min_rows
        self.uneven = len(set(all_sizes)) > 1 or min_rows > max(all_sizes, default=0)
        self.local_rows = sum(self.sizes)
        local = (self.x, self.y, self.sample_weight)
        if num_workers > 1 and self.global_input:
            local = tree.map_structure(
                lambda leaf: None if leaf is None else leaf[self.offset:self.offset + self.local_rows], local
            )
        self.local = local  # this worker's rows, unpadded
        self.cut(engine.capabilities.equal_shards if equal_shapes is None else equal_shapes)

    def cut(self, equal_shapes: bool) -> None:
        """Cuts `per_replica`: padded to one shape (`equal_shapes`) or each at its own size."""
        if equal_shapes:
            self.rows = [max(max(self.sizes), 1, self.min_rows)] * len(self.sizes)
        else:
            self.rows = [max(size, 1) for size in self.sizes]  # an empty replica runs one padding row
        self.padded = self.rows != self.sizes
        pieces = split_batch(self.local, self.sizes)
        source = padding.source_rows((self.x, self.y)) if self.padded else None
        self.per_replica = []
        for (x, y, weight), size, rows in zip(pieces, self.sizes, self.rows):
            mask = None
            if self.padded:
                mask = np.zeros((rows,), "float32")
                mask[:size] = 1.0
                x, y = padding.pad_with_copies((x, y), rows, source)
                weight = padding.pad_with_zeros(weight, rows)
            self.per_replica.append((x, y, weight, mask))

    @property
    def active(self) -> list[int]:
        return replicas_with_rows(self.sizes)

    def unpad(self, replica_id: int, structure: Any) -> Any:
        size = self.sizes[replica_id]
        return tree.map_structure(lambda leaf: leaf[:size], structure)


def replicas_with_rows(sizes: Sequence[int]) -> list[int]:
    """The replicas that got rows of the batch (one without rows runs a padding row)."""
    return [i for i, size in enumerate(sizes) if size > 0]


def make_shards(strategy: Any, data: Any, num_local: int, with_targets: bool,
                equal_shapes: Optional[bool] = None, min_rows: int = 0) -> Shards:
    """This worker's shards of a global batch (of its own batch, with per-worker input), padded to
    one shape if `equal_shapes` (default: where the engine needs it), of at least `min_rows` rows."""
    extended = strategy.extended
    worker_rows = None
    if worker_sharding.active():  # per-worker input: the workers tell each other their batch sizes
        rows = np.zeros((extended._num_workers,), "float32")
        rows[extended._worker_index] = batch_size_of(data_adapter_utils.unpack_x_y_sample_weight(data)[0])
        (rows,) = extended._cross_worker_sum([rows], "batch sizes of per-worker input")
        worker_rows = [int(round(float(r))) for r in ops.convert_to_numpy(rows)]
    return Shards(data, num_local, with_targets, extended._num_workers, extended._worker_index, worker_rows,
                  equal_shapes, min_rows)
