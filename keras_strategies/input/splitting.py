"""Splitting a global batch across replicas without dropping or repeating samples.

Shard sizes differ by at most one and the first `batch % replicas` replicas
get the extra sample; a batch smaller than the replica count leaves the last
replicas empty. Concatenating the shards in replica order gives the batch back.
"""

from __future__ import annotations

from typing import Any, Sequence

from keras.src import tree

from keras_strategies.backend import engine


def shard_sizes(batch_size: int, num_shards: int) -> list[int]:
    """Balanced sizes: `shard_sizes(10, 4) == [3, 3, 2, 2]`, `shard_sizes(2, 3) == [1, 1, 0]`."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}.")
    base, extra = divmod(int(batch_size), num_shards)
    return [base + (1 if i < extra else 0) for i in range(num_shards)]


def batch_size_of(structure: Any) -> int:
    """The common leading dimension of every array in `structure`.

    Raises `ValueError` naming the sizes when arrays disagree, since splitting
    them would silently misalign inputs, targets and weights.
    """
    sizes = {int(leaf.shape[0]) for leaf in tree.flatten(structure) if leaf is not None and len(leaf.shape) > 0}
    if not sizes:
        raise ValueError("Cannot split a batch that has no array with a batch dimension.")
    if len(sizes) > 1:
        raise ValueError(
            f"All arrays of a batch must have the same first dimension to be split across "
            f"replicas; got sizes {sorted(sizes)}."
        )
    return sizes.pop()


def split_batch(structure: Any, sizes: Sequence[int]) -> list[Any]:
    """One slice of `structure` per shard, along axis 0 (`None` leaves stay `None`); each leaf is
    cut by its engine at once (`engine.replicas.split_rows`)."""
    pieces = [None if leaf is None else engine.replicas.split_rows(leaf, sizes) for leaf in tree.flatten(structure)]
    return [tree.pack_sequence_as(structure, [None if p is None else p[i] for p in pieces]) for i in range(len(sizes))]
