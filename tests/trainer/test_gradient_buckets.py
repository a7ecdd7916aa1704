"""Gradient buckets (`trainer/gradient_buckets.py`): their layout, and the order in which they start.

Every worker must start the same sums in the same order whatever order its
backward pass reports the gradients in; the cross-worker sums themselves run
in the multi-worker tests (`tests/multi_worker/test_multi_worker_collectives.py`).
"""

import numpy as np

from keras_strategies.trainer import gradient_buckets


def _layout(shapes, dtypes, bucket_bytes):
    nbytes = [int(np.prod(shape)) * np.dtype(d).itemsize for shape, d in zip(shapes, dtypes)]
    return gradient_buckets.layout(dtypes, nbytes, bucket_bytes)


def test_buckets_run_from_the_last_gradient_and_split_by_size_and_dtype():
    shapes = [(64, 256), (256,), (256, 256), (256,), (256, 10), (10,)]
    assert _layout(shapes, ["float32"] * 6, 25 << 20) == [[5, 4, 3, 2, 1, 0]]
    # A bucket closes once it holds the size: (10,) + (256, 10) is 10 KB, then 256 KB, then the rest.
    assert _layout(shapes, ["float32"] * 6, 8 << 10) == [[5, 4], [3, 2], [1, 0]]
    assert _layout(shapes, ["float32"] * 6, 1) == [[5], [4], [3], [2], [1], [0]]
    assert _layout([(3,), (3,), (3,)], ["float32", "float16", "float16"], 1 << 20) == [[2, 1], [0]]
    assert _layout([], [], 1 << 20) == []


class _Sums:
    """Records the sums started, and gives each one's values doubled (what two equal workers sum)."""

    def __init__(self):
        self.started = []

    def __call__(self, values, what):
        self.started.append(([float(v[0]) for v in values], what))
        return _Done([v * 2 for v in values])


class _Done:
    def __init__(self, result):
        self._result = result

    def wait(self):
        return self._result


def _grads(count):
    return [np.full((2,), float(i)) for i in range(count)]


def test_a_bucket_starts_once_complete_and_buckets_start_in_order():
    sums = _Sums()
    buckets = gradient_buckets.GradientBuckets([[4, 3], [2], [1], [0]], sums)
    grads = _grads(5)
    buckets.ready(4, grads[4])
    assert sums.started == []
    buckets.ready(2, grads[2])  # its bucket is complete, but the one before it is not
    assert sums.started == []
    buckets.ready(3, grads[3])
    assert sums.started == [([4.0, 3.0], "gradient all-reduce"), ([2.0], "gradient all-reduce")]
    buckets.ready(3, grads[3] + 100)  # reported twice: the first counts
    buckets.ready(1, grads[1])
    buckets.ready(0, grads[0])  # the last bucket waits for the end of the backward pass
    assert [s for s, _ in sums.started] == [[4.0, 3.0], [2.0], [1.0]]
    summed = buckets.finish(grads)
    assert [s for s, _ in sums.started] == [[4.0, 3.0], [2.0], [1.0], [0.0]]
    np.testing.assert_array_equal(np.stack(summed), np.stack(grads) * 2)


def test_gradients_never_reported_are_sent_after_the_backward_pass_in_the_same_order():
    # A variable the loss does not reach gets no report: `finish` takes its (zero) gradient.
    sums = _Sums()
    buckets = gradient_buckets.GradientBuckets([[3], [2], [1], [0]], sums)
    grads = _grads(4)
    buckets.ready(3, grads[3])
    buckets.ready(1, grads[1])
    assert [s for s, _ in sums.started] == [[3.0]]
    summed = buckets.finish(grads)
    assert [s for s, _ in sums.started] == [[3.0], [2.0], [1.0], [0.0]]
    np.testing.assert_array_equal(np.stack(summed), np.stack(grads) * 2)


def test_the_last_bucket_starts_after_the_backward_pass_with_the_step_s_other_values():
    sums, last = _Sums(), _Sums()
    buckets = gradient_buckets.GradientBuckets([[2], [1, 0]], sums, last)
    grads = _grads(3)
    for index in (2, 1, 0):
        buckets.ready(index, grads[index])
    assert [s for s, _ in sums.started] == [[2.0]] and last.started == []
    np.testing.assert_array_equal(np.stack(buckets.finish(grads)), np.stack(grads) * 2)
    assert [s for s, _ in last.started] == [[1.0, 0.0]]
    assert gradient_buckets.GradientBuckets([], sums, last).finish([]) == []
