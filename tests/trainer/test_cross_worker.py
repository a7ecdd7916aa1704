"""What a step sends across workers: the batch check and the row buffers (`trainer/cross_worker.py`).

The all-reduce itself runs in the multi-worker tests; here the sums the
workers would get are formed directly from each worker's fingerprint.
"""

import types

import numpy as np
import pytest

from keras_strategies.trainer import cross_worker


def _batch(rows, first=0.0):
    """A global batch of `rows` rows whose first feature starts at `first`."""
    x = (first + np.arange(rows, dtype="float32"))[:, None] * np.ones((1, 3), "float32")
    return types.SimpleNamespace(x=x, batch=rows)


def _total(*batches):
    return sum(cross_worker.fingerprint(b) for b in batches)


@pytest.mark.parametrize("sizes", [(256, 255), (16, 2), (4096, 4095), (100_000, 99_999), (7, 7, 8), (9, 3, 6)])
def test_batch_sizes_that_differ_by_even_one_row_raise_on_every_worker(sizes):
    batches = [_batch(n) for n in sizes]
    total = _total(*batches)
    for batch in batches:  # every worker sees the same sums, so each raises
        with pytest.raises(RuntimeError, match=f"different sizes \\(this worker's has {batch.batch} samples"):
            cross_worker.check_fingerprints(total, batch.batch, len(sizes), exact=False)


@pytest.mark.parametrize("rows, workers", [(256, 2), (100_000, 3), (1, 8), (0, 2)])
def test_identical_batches_on_every_worker_pass_the_check(rows, workers):
    total = _total(*[_batch(rows)] * workers)
    cross_worker.check_fingerprints(total, rows, workers, exact=True)


def test_the_same_size_with_other_data_warns_when_training_and_raises_for_predictions():
    total = _total(_batch(16), _batch(16, first=100.0))
    with pytest.raises(RuntimeError, match="different global batches"):
        cross_worker.check_fingerprints(total, 16, 2, exact=True)
    cross_worker._warned.discard("data")
    with pytest.warns(UserWarning, match="different global batches"):
        cross_worker.check_fingerprints(total, 16, 2, exact=False)


def test_rows_are_placed_in_a_buffer_of_the_agreed_size():
    # Worker 1 of 2 holds rows [3, 5) of a global batch of 5; buffers of 8, 5 and 4 rows.
    shards = types.SimpleNamespace(batch=5, offset=3)
    local = np.array([[1.0], [2.0]], "float32")
    template = np.zeros((2, 1), "float32")
    expected = np.array([0, 0, 0, 1, 2, 0, 0, 0], "float32")[:, None]
    for capacity in (8, 5, 4):
        placed = cross_worker.place_rows(shards, [local], template, capacity)
        assert placed.shape == (capacity, 1) and placed.dtype == np.float32
        np.testing.assert_array_equal(placed, expected[:capacity])
    np.testing.assert_array_equal(cross_worker.place_rows(shards, [], template, 6), np.zeros((6, 1), "float32"))


@pytest.mark.parametrize("sizes, stops, go_on", [
    ((256, 256), (0, 0), True),
    ((100_000,) * 3, (0, 0, 0), True),
    ((256, 255), (0, 0), False),
    ((7, 7, 8), (0, 0, 0), False),
    ((16, 16), (0, 1), False),
])
def test_inside_a_program_a_step_goes_on_only_with_the_same_batch_size_everywhere_and_no_stop(sizes, stops, go_on):
    from keras import ops

    total = sum(cross_worker.batch_check(_batch(n), bool(stop)) for n, stop in zip(sizes, stops))
    decided = cross_worker.may_go_on(ops.convert_to_tensor(total), len(sizes))
    assert bool(ops.convert_to_numpy(decided)) is go_on
