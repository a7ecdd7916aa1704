"""Partitions: part of a list handled one way and the rest another; variables split into shards.

Reductions treat TensorFlow's `IndexedSlices` (an Embedding's gradients) apart
from dense tensors: slices are gathered or concatenated, dense tensors packed
and summed. Both parts run in a fixed order (the special part first), so that
every worker issues its collectives in the same sequence.

ParameterServerStrategy splits a variable along its first axis into the
number of shards a partitioner returns, with TensorFlow's "div" rule: the first
`rows % shards` shards get one row more (13 rows over 5 shards: 3, 3, 3, 2, 2).
Every engine uses the same functions, so shards match TensorFlow's everywhere.
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Sequence


def apply_partitioned(values: Sequence[Any], predicate: Callable[[Any], bool], special: Callable[[list], list],
                      rest: Callable[[list], list]) -> list:
    """`special` of the values where `predicate` holds, then `rest` of the others, in `values`' order.

    Each function takes a list and returns one result per item; an empty part is not passed.
    """
    chosen = [i for i, value in enumerate(values) if predicate(value)]
    taken = set(chosen)
    others = [i for i in range(len(values)) if i not in taken]
    outputs: list = [None] * len(values)
    for indices, fn in ((chosen, special), (others, rest)):
        if indices:
            for i, result in zip(indices, fn([values[i] for i in indices])):
                outputs[i] = result
    return outputs


def row_slices(value: Any, sizes: Sequence[int]) -> list:
    """`value` cut along its first axis into consecutive pieces of `sizes` rows, from row 0."""
    pieces, start = [], 0
    for size in sizes:
        pieces.append(value[start:start + size])
        start += size
    return pieces


def first_axis_shards(partitions: Sequence[int], shape: Sequence[int]) -> int:
    """How many shards a variable of `shape` gets from a partitioner's result `partitions`.

    The result must split the first axis only (every other entry 1, the first
    >= 1), as ParameterServerStrategy requires; it is capped at the number of
    rows. Scalars are never split (call no partitioner for them), and a variable
    without rows is one empty shard.
    """
    shape = [int(d) for d in shape]
    if not shape:
        return 1
    partitions = list(partitions) if isinstance(partitions, (list, tuple)) else partitions
    empty = shape[0] == 0
    if (
        not isinstance(partitions, list)
        or not partitions
        or any(p != 1 for p in partitions[1:])
        or not (partitions[0] >= 1 or (empty and partitions[0] == 0))
    ):
        raise ValueError(
            "variable_partitioner must return a list/tuple whose elements are 1"
            f" besides the first element (non-zero), got: {partitions!r}"
            f" (for a variable of shape {tuple(shape)})"
        )
    return 1 if empty else min(int(partitions[0]), shape[0])


def div_partition(rows: int, num_shards: int) -> list[int]:
    """Rows per shard when `rows` rows are split into `num_shards` shards, TensorFlow's way.

    At most `rows` shards; the first `rows % shards` shards get one row more.
    No rows give one empty shard.

    >>> div_partition(13, 5)
    [3, 3, 3, 2, 2]
    >>> div_partition(3, 5)
    [1, 1, 1]
    """
    rows, num_shards = _integer("rows", rows, 0), _integer("num_shards", num_shards, 1)
    shards = max(1, min(num_shards, rows))
    base, extra = divmod(rows, shards)
    return [base + 1 if i < extra else base for i in range(shards)]


def div_partition_offsets(rows: int, num_shards: int) -> list[int]:
    """The first row of each shard of `div_partition`, then `rows`: shard i is rows `[o[i], o[i+1])`.

    >>> div_partition_offsets(13, 5)
    [0, 3, 6, 9, 11, 13]
    """
    offsets = [0]
    for size in div_partition(rows, num_shards):
        offsets.append(offsets[-1] + size)
    return offsets


def _integer(name: str, value: Any, minimum: int) -> int:
    try:
        number = operator.index(value) if not isinstance(value, bool) else None
    except TypeError:
        number = None
    if number is None or number < minimum:
        raise ValueError(f"`{name}` must be an int >= {minimum}, got {value!r}.")
    return number
