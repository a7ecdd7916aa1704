"""Gradients sent across workers in buckets while the backward pass still runs.

As torch DDP does: the gradients are laid out in buckets in reverse order
(a backward pass computes the last layers' gradients first), and a bucket's
all-reduce starts as soon as its gradients are ready, in the engine's
background threads, while the backward pass computes the others. The last
bucket starts after the backward pass, with the step's other values: a model
whose gradients fit in one bucket makes one all-reduce per step, as without
buckets, and that bucket's gradients, no longer used by autograd, may be
summed in place. Buckets start strictly in order, and their layout depends
only on the gradients' shapes and dtypes, so every worker starts the same
all-reduces in the same order whatever order its backward pass reports them in.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

# Without `CommunicationOptions.bytes_per_pack`: buckets of about this size, torch DDP's default.
# Every all-reduce has a fixed cost, and on two CPU workers sharing two cores smaller buckets did
# not make steps faster (the benchmarks page).
DEFAULT_BUCKET_BYTES = 25 << 20


def layout(dtypes: Sequence[Any], nbytes: Sequence[int], bucket_bytes: int) -> list[list[int]]:
    """Buckets of gradient indices, last gradient first: a new bucket at a change of dtype or
    once a bucket holds `bucket_bytes` (`nbytes[i]`: gradient `i`'s size)."""
    buckets: list[list[int]] = []
    size, dtype = 0, None
    for index in reversed(range(len(dtypes))):
        if not buckets or dtypes[index] != dtype or size >= bucket_bytes:
            buckets.append([])
            size, dtype = 0, dtypes[index]
        buckets[-1].append(index)
        size += nbytes[index]
    return buckets


class GradientBuckets:
    """Collects one step's gradients as the backward pass reports them (`ready`) and starts each
    bucket's cross-worker sum once it is complete; `finish` returns the summed gradients.

    `start_sum(values, what)` starts a cross-worker sum and returns an object
    whose `wait()` gives it; `start_last` (default `start_sum`) starts the last
    bucket's, in `finish`, with which the step's other values may travel: it
    is called once per step, with no values when there are no gradients.
    """

    def __init__(self, buckets: list[list[int]], start_sum: Callable[[list, str], Any],
                 start_last: Optional[Callable[[list, str], Any]] = None):
        self._buckets = buckets
        self._start_sum, self._start_last = start_sum, start_last or start_sum
        self._bucket_of = {index: b for b, bucket in enumerate(buckets) for index in bucket}
        self._grads: list = [None] * len(self._bucket_of)
        self._missing = [len(bucket) for bucket in buckets]
        self._started: list = []

    def ready(self, index: int, grad: Any) -> None:
        """The backward pass has computed gradient `index`."""
        if self._grads[index] is None:
            self._grads[index] = grad
            self._missing[self._bucket_of[index]] -= 1
            self._start_complete()

    def _start_complete(self) -> None:
        """Starts the complete buckets in order, all but the last."""
        while len(self._started) < len(self._buckets) - 1 and self._missing[len(self._started)] == 0:
            bucket = self._buckets[len(self._started)]
            self._started.append(self._start_sum([self._grads[i] for i in bucket], "gradient all-reduce"))

    def finish(self, grads: Sequence[Any]) -> list:
        """After the backward pass: `grads` (all of them, as the engine returned them) fill in the
        gradients never reported (variables the loss does not reach); then waits for every bucket
        and returns the summed gradients in their original order."""
        for index, grad in enumerate(grads):
            self.ready(index, grad)
        last = self._buckets[-1] if self._buckets else []
        self._started.append(self._start_last([self._grads[i] for i in last], "gradient all-reduce"))
        summed: list = [None] * len(self._grads)
        for bucket, started in zip(self._buckets, self._started):
            for index, value in zip(bucket, started.wait()):
                summed[index] = value
        return summed
