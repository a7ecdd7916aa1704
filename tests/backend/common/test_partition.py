"""`apply_partitioned`: one part of a list handled one way, the rest another, in the list's order;
`div_partition` and `first_axis_shards`: a variable split into shards as TensorFlow splits it."""

import re

import pytest

from keras_strategies.backend.common.partition import (
    apply_partitioned,
    div_partition,
    div_partition_offsets,
    first_axis_shards,
)


def test_each_part_is_handled_by_its_function_and_the_order_is_kept():
    calls = []

    def tag(name):
        def fn(values):
            calls.append((name, list(values)))
            return [f"{name}:{v}" for v in values]
        return fn

    result = apply_partitioned([1, 2, 3, 4, 5], lambda v: v % 2 == 0, tag("even"), tag("odd"))
    assert result == ["odd:1", "even:2", "odd:3", "even:4", "odd:5"]
    assert calls == [("even", [2, 4]), ("odd", [1, 3, 5])]  # the special part first, every time


def test_an_empty_part_is_not_passed():
    called = []
    assert apply_partitioned([1, 3], lambda v: v % 2 == 0, lambda vs: called.append(vs) or vs, lambda vs: vs) == [1, 3]
    assert called == []
    assert apply_partitioned([], bool, list, list) == []


# --- variables split into shards ------------------------------------------------------------------


def test_div_partition_gives_the_first_shards_one_row_more():
    assert div_partition(13, 5) == [3, 3, 3, 2, 2]
    assert div_partition(10, 4) == [3, 3, 2, 2]
    assert div_partition(5, 2) == [3, 2]
    assert div_partition(12, 3) == [4, 4, 4]
    assert div_partition(3, 5) == [1, 1, 1]  # never more shards than rows
    assert div_partition(7, 1) == [7]
    assert div_partition(0, 3) == [0]  # no rows: one empty shard
    for rows in range(0, 40):
        for shards in range(1, 9):
            sizes = div_partition(rows, shards)
            assert sum(sizes) == rows and max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_div_partition_offsets_bound_each_shard():
    assert div_partition_offsets(13, 5) == [0, 3, 6, 9, 11, 13]
    assert div_partition_offsets(2, 1) == [0, 2]
    assert div_partition_offsets(0, 4) == [0, 0]


@pytest.mark.parametrize("rows, shards, message", [
    (-1, 2, "`rows` must be an int >= 0, got -1."),
    (3.0, 2, "`rows` must be an int >= 0, got 3.0."),
    (3, 0, "`num_shards` must be an int >= 1, got 0."),
    (3, True, "`num_shards` must be an int >= 1, got True."),
])
def test_div_partition_rejects_bad_counts(rows, shards, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        div_partition(rows, shards)


def test_first_axis_shards_caps_the_partitioner_s_answer_at_the_rows():
    assert first_axis_shards([5, 1], (13, 1024)) == 5
    assert first_axis_shards((20, 1), (13, 1024)) == 13
    assert first_axis_shards([1, 1], (13, 1024)) == 1
    assert first_axis_shards([3], (13, 4)) == 3  # TensorFlow looks at the given entries only
    assert first_axis_shards([7], ()) == 1  # scalars are never split
    assert first_axis_shards([0, 1], (0, 3)) == 1  # no rows: one empty shard


@pytest.mark.parametrize("partitions", [[0, 1], [2, 2], [1, 3], [], None, [-1, 1], 2])
def test_first_axis_shards_refuses_what_parameter_server_strategy_cannot_split(partitions):
    message = ("variable_partitioner must return a list/tuple whose elements are 1 besides the first element "
               f"(non-zero), got: {partitions!r}")
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        first_axis_shards(partitions, (5, 3))
