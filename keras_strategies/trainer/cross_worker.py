"""What a Keras step sends across workers: one all-reduce per step.

After each worker has reduced over its own replicas, a step needs from the
other workers: the summed gradients and loss, the new non-trainable values
(BatchNormalization statistics), and the predictions, targets and sample
weights of the whole global batch (each worker contributes its own rows), so
that every worker updates its metrics on all of it, exactly as one device
would. They travel together, packed by dtype, in one `_cross_worker_sum`. A
fingerprint of the global batch rides along to detect workers reading
different data (e.g. unseeded shuffles).
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Optional

import numpy as np
from keras import ops
import keras
from keras.src import tree

from keras_strategies.backend import engine


STOPPED = object()
"""What a step returns instead of its results when a worker asked to stop before it (`trainer/stopping.py`)."""


def _numpy(value: Any) -> np.ndarray:
    return np.asarray(keras.ops.convert_to_numpy(value))


# The batch size travels as base-64 digits and their squares: float32 sums of those stay exact
# integers for up to 4,000 workers, so equal sizes are told apart from sizes that differ by one
# row at any batch size (a relative test on B and B^2 misses 255 against 256).
_DIGITS, _DIGIT_BITS = 4, 6


def fingerprint(shards: Any) -> np.ndarray:
    """The batch size's digits and their squares, then a position-weighted checksum f and f^2 of the batch."""
    first = np.asarray(tree.flatten(shards.x)[0])
    column = first.reshape(first.shape[0], -1)[:, 0].astype("float64") if first.size else np.zeros((0,))
    f = float(np.dot(column, np.arange(1, column.shape[0] + 1)) / max(column.shape[0], 1))
    digits = [(int(shards.batch) >> (_DIGIT_BITS * k)) & (2**_DIGIT_BITS - 1) for k in range(_DIGITS)]
    return np.array(digits + [d * d for d in digits] + [f, f * f], "float32")


_warned: set = set()


def check_fingerprints(total: np.ndarray, batch: int, num_workers: int, exact: bool) -> None:
    """Compares every worker's global batch (`total`: the sum of the workers' fingerprints).

    Different batch sizes always raise `RuntimeError` (each replica's share of
    the loss would be wrong); every worker sees the same sums, so all raise at
    the same step. Different data (e.g. an unseeded shuffle) raise when
    `exact` (predictions must line up with the input), else warn once:
    training stays exact for the rows the workers actually took.
    """
    sums = [int(round(float(v))) for v in total[:2 * _DIGITS]]
    # n * sum(d^2) == sum(d)^2 exactly when every worker sent the same digit (Cauchy-Schwarz).
    sizes_differ = any(num_workers * sums[_DIGITS + k] != sums[k] ** 2 for k in range(_DIGITS))
    mean, mean_square = total[-2] / num_workers, total[-1] / num_workers
    data_differ = mean_square - mean * mean > 1e-4 * max(mean_square, 1.0)

    advice = (
        "Under MultiWorkerMirroredStrategy every worker reads the same input in the same order and "
        "takes its own slice of each global batch: give shuffles a seed (e.g. "
        "`dataset.shuffle(n, seed=1)`), or shard the input yourself with "
        "`distribute_datasets_from_function`."
    )
    if sizes_differ:
        raise RuntimeError(
            f"The workers read global batches of different sizes (this worker's has {batch} "
            f"samples; e.g. batches shuffled without a seed, which moves the partial batch). {advice}"
        )
    if data_differ:
        message = f"The workers read different global batches (e.g. an unseeded shuffle). {advice}"
        if exact:
            raise RuntimeError(message)
        if "data" not in _warned:
            _warned.add("data")
            warnings.warn(
                message + " Each worker now trains on its slice of its own batch, so an epoch "
                "may repeat some samples and skip others; losses and metrics are those of the "
                "rows actually used.",
                stacklevel=3,
            )


def batch_check(shards: Any, stop_asked: bool) -> np.ndarray:
    """What a step sends to compare the workers' batches and agree on a stop: the fingerprint, then the flag."""
    return np.append(fingerprint(shards), np.float32(stop_asked))


def stop_or_check(total: Any, shards: Any, num_workers: int, exact: bool) -> bool:
    """From the summed `batch_check`s: True when a worker asked to stop, else checks the batches."""
    total = _numpy(total)
    if total[-1] > 0:
        return True
    if shards.global_input:
        check_fingerprints(total[:-1], shards.batch, num_workers, exact)
    return False


def may_go_on(total: Any, num_workers: int) -> Any:
    """`stop_or_check` inside a compiled step: a boolean tensor, True unless a worker asked to
    stop or the workers' batch sizes differ (the host then reads `total` and stops or raises)."""
    digits, squares = ops.round(total[:_DIGITS]), ops.round(total[_DIGITS:2 * _DIGITS])
    same_sizes = ops.all(ops.equal(float(num_workers) * squares, digits * digits))
    return ops.logical_and(same_sizes, ops.less_equal(total[-1], 0.0))


def place_rows(shards: Any, local_parts: list, template: Any, capacity: int) -> Any:
    """This worker's rows placed at their position in a zero buffer of `capacity` rows.

    `local_parts` are structures of row blocks (concatenated in order);
    `template` gives the structure, trailing shapes and dtypes. The buffer has
    the same shape on every worker whatever each one's batch (`capacity` is
    agreed, see `WorkerExchange.run`): rows past it are left out.
    """

    def place(*leaves):
        reference = _numpy(leaves[-1])
        buffer = np.zeros((max(shards.batch, capacity),) + reference.shape[1:], reference.dtype)
        if len(leaves) > 1:
            local = np.concatenate([_numpy(leaf) for leaf in leaves[:-1]], axis=0)
            buffer[shards.offset:shards.offset + local.shape[0]] = local
        return buffer[:capacity]

    return tree.map_structure(place, *local_parts, template)


def own_rows(shards: Any, structure: Any, capacity: int) -> Any:
    """This worker's rows of a global-batch structure, in a zero buffer of `capacity` rows."""
    if structure is None:
        return None
    rows = structure  # per-worker input: the structure holds this worker's rows only
    if shards.global_input:
        rows = tree.map_structure(lambda leaf: np.asarray(leaf)[shards.offset:shards.offset + shards.local_rows], structure)
    return place_rows(shards, [rows], structure, capacity)


def exact_in_float32(array: np.ndarray) -> bool:
    """Whether an integer or boolean array's values travel exactly as float32 (class labels do)."""
    return array.dtype.kind in "iub" and (array.size == 0 or float(np.abs(array).max()) < 2**24)


class Exchange:
    """Named lists of tensors summed across workers together (packed by dtype).

    `start_sum(values, what, donated)` starts a cross-worker sum and returns
    an object whose `wait()` gives it (the strategy's `_start_cross_worker_sum`).
    """

    def __init__(self, start_sum: Callable[..., Any]):
        self._start_sum = start_sum
        self._parts: list = []
        self._started: Any = None
        self._result: Optional[dict] = None
        self._flat: list = []
        self._as_float: list = []  # per value: a small integer array sent as float32

    def add(self, name: str, values: list, donated: bool = False) -> None:
        """`donated=True`: the values are temporaries of the step, which the engine may sum in place."""
        self._parts.append((name, list(values), donated))

    def start(self, what: str) -> None:
        """Starts the sum; where the engine sends in the background, the caller goes on meanwhile."""
        flat = [value for _, values, _ in self._parts for value in values]
        donated = [given for _, values, given in self._parts for _ in values]
        # Small integers (class labels) travel as float32, exactly, so that a step needs one
        # collective rather than one per dtype.
        self._as_float = [isinstance(v, np.ndarray) and exact_in_float32(v) for v in flat]
        sent = [v.astype("float32") if cast else v for v, cast in zip(flat, self._as_float)]
        self._flat = flat
        self._started = self._start_sum(sent, what, donated)

    def result(self) -> dict:
        """Waits for the sum started by `start`: the summed lists by name (the same on every call)."""
        if self._result is not None:
            return self._result
        summed = self._started.wait()
        summed = [np.rint(_numpy(v)).astype(original.dtype) if cast else v
                  for v, original, cast in zip(summed, self._flat, self._as_float)]
        result, start = {}, 0
        for name, values, _ in self._parts:
            result[name] = summed[start:start + len(values)]
            start += len(values)
        self._result = result
        return result

    def run(self, what: str) -> dict:
        self.start(what)
        return self.result()


def non_trainable_payload(variables: list, per_replica: list, host: str) -> tuple[list, list]:
    """Per variable: the local sum of float values (or of deltas for `aggregation="sum"`).

    Returns `(payload, kinds)`; `kinds[i]` is "mean", "sum" or None (kept as is).
    """
    payload, kinds = [], non_trainable_kinds(variables)
    for index, (variable, kind) in enumerate(zip(variables, kinds)):
        values = [engine.devices.copy_to(ops.convert_to_tensor(state[index]), host) for state in per_replica]
        if kind == "mean":
            payload.append(sum(values[1:], values[0]) if values else ops.zeros(variable.shape, variable.dtype))
        elif kind == "sum":
            old = engine.devices.copy_to(variable.value, host)
            payload.append(sum((v - old for v in values), ops.zeros(variable.shape, variable.dtype)))
    return payload, kinds


def non_trainable_kinds(variables: list) -> list:
    """Per variable, how workers combine it: "mean" (floats), "sum" (`aggregation="sum"`) or None (kept)."""
    kinds = []
    for variable in variables:
        aggregation = getattr(variable, "aggregation", "none")
        if "float" in str(variable.dtype) and aggregation in ("mean", "none"):
            kinds.append("mean")
        else:
            kinds.append("sum" if aggregation == "sum" else None)
    return kinds


def assign_non_trainable(variables: list, kinds: list, totals: list, replicas_with_data: Any) -> None:
    """Assigns the cross-worker means (over replicas with data) and summed deltas (also inside a
    compiled program, where `replicas_with_data` is a tensor)."""
    values = iter(totals)
    for variable, kind in zip(variables, kinds):
        if kind is None:
            continue
        total = ops.convert_to_tensor(next(values))
        if kind == "mean":
            count = ops.maximum(ops.convert_to_tensor(replicas_with_data, "float32"), 1.0)
            variable.assign(ops.divide(total, ops.cast(count, total.dtype)))
        else:
            variable.assign(ops.add(variable.value, ops.cast(total, variable.dtype)))
