"""A multi-worker step's exchange: one all-reduce across workers of everything the step needs.

Gradients, the loss, the global batch's predictions, targets and weights (in
buffers of an agreed row count, see `cross_worker.py`), the replicas'
non-trainable values and a fingerprint of the batch that carries the stop
flag travel together. Where the engine reports gradients as its backward pass
computes them (one local replica), they go in buckets during that pass
(`OverlappedExchange`), as torch DDP sends them. Where the engine can run the
exchange inside the compiled step, `exchange_in_program.py` does instead.
"""

from __future__ import annotations

import functools
from typing import Any

import keras
import numpy as np
from keras import ops
from keras.src import tree

from keras_strategies.backend import engine
from keras_strategies.trainer import cross_worker, gradient_buckets
from keras_strategies.trainer.cross_worker import STOPPED
from keras_strategies.trainer.global_update import GlobalUpdate
from keras_strategies.trainer.shards import Shards


class WorkerExchange:
    """The cross-worker exchanges of `model`'s steps under a multi-worker `strategy`."""

    def __init__(self, model: Any, strategy: Any, update: GlobalUpdate):
        self.model = model
        self.strategy = strategy
        self.host = update.host
        self.on_host = update.on_host
        self.num_workers = strategy.extended._num_workers
        self.rows_capacity = 0  # rows of the exchanged prediction buffers, the same on every worker
        self.bucket_layouts: dict = {}  # bytes per bucket -> the gradients' buckets

    def _add_rows(self, exchange: cross_worker.Exchange, shards: Shards, local_parts: list, template: Any) -> tuple:
        """Adds the global batch's predictions, targets and weights in buffers of the agreed row count."""
        buffers = cross_worker.place_rows(shards, local_parts, template, self.rows_capacity)
        exchange.add("predictions", tree.flatten(buffers), donated=True)
        # Targets and weights of the rows every worker actually used: exact metrics even when
        # workers read different batches.
        targets = tuple(cross_worker.own_rows(shards, part, self.rows_capacity) for part in (shards.y, shards.sample_weight))
        exchange.add("targets", [leaf for leaf in tree.flatten(targets) if leaf is not None], donated=True)
        return buffers, targets

    def run(self, shards: Shards, grads: list, loss: Any, predictions: list, non_trainable: Any = None,
            stop_asked: bool = False):
        """The step's exchange: `(grads, loss, global predictions, finish)`.

        `finish()` assigns the non-trainable values once the update is applied.
        Returns `STOPPED` when a worker asked to stop before this step (its flag
        rides along).
        """
        return self.finish(self.start(shards, grads, loss, predictions, non_trainable, stop_asked))

    def start(self, shards: Shards, grads: list, loss: Any, predictions: list, non_trainable: Any = None,
              stop_asked: bool = False, training: bool = False) -> dict:
        """Starts `run`'s all-reduce; `finish` waits for it. `training`: a train step whose
        gradients come later, in buckets (`OverlappedExchange`), which starts it.

        The rows (predictions, targets) travel in buffers of an agreed number
        of rows, so that the all-reduce has the same shapes on every worker even
        when their batches differ in size, which the fingerprint then reports
        clearly. A global batch larger than that number (the first step, a
        larger batch size) grows it on every worker and sends the rows again.
        """
        what = "gradient all-reduce" if grads or training else "predictions all-gather"
        exchange = cross_worker.Exchange(self.strategy.extended._start_cross_worker_sum)
        # The stop flag rides with the fingerprint: no extra operand (on JAX, one gloo call each).
        exchange.add("check", [cross_worker.batch_check(shards, stop_asked)])
        # Gradients the strategy reduces across the workers in its update (reduce-scattered, at
        # ShardedDataParallelStrategy's stage 2) go to it as they are.
        own_gradients = grads if self.strategy.extended._sums_gradients_in_update else None
        exchange.add("grads", [] if own_gradients is not None else grads, donated=True)
        exchange.add("loss", [] if loss is None else [loss], donated=True)
        local_parts = [shards.unpad(i, predictions[i]) for i in shards.active]
        buffers, targets = self._add_rows(exchange, shards, local_parts, predictions[0])
        kinds: list = []
        if non_trainable is not None:
            variables = self.model.non_trainable_variables
            payload, kinds = cross_worker.non_trainable_payload(variables, non_trainable, self.host)
            exchange.add("non_trainable", payload + [np.array(float(len(shards.active)), "float32")])
        if not training:
            exchange.start(what)
        exact = not (grads or training) and loss is None  # predict: the outputs must line up with the input
        return dict(exchange=exchange, what=what, shards=shards, exact=exact, loss=loss, predictions=predictions,
                    own_gradients=own_gradients,
                    local_parts=local_parts, buffers=buffers, targets=targets, non_trainable=non_trainable, kinds=kinds)

    def finish(self, started: dict):
        """Waits for `start`'s all-reduce: `run`'s result."""
        shards, host = started["shards"], self.host
        buffers, targets = started["buffers"], started["targets"]
        result = started["exchange"].result()
        if cross_worker.stop_or_check(result["check"][0], shards, self.num_workers, started["exact"]):
            return STOPPED
        if shards.batch > self.rows_capacity:  # the same batch size on every worker (checked above)
            self.rows_capacity = shards.batch
            again = cross_worker.Exchange(self.strategy.extended._start_cross_worker_sum)
            buffers, targets = self._add_rows(again, shards, started["local_parts"], started["predictions"][0])
            result.update(again.run(started["what"]))
        rows = lambda value: ops.convert_to_numpy(value)[:shards.batch]  # noqa: E731
        on_host = lambda value: engine.devices.copy_to(ops.convert_to_tensor(value), host)  # noqa: E731
        y_pred = tree.pack_sequence_as(buffers, [on_host(rows(p)) for p in result["predictions"]])
        # Paired by `flatten` order: Keras' torch `map_structure` visits dicts in insertion order,
        # its `flatten` sorts their keys.
        summed_targets = iter(result["targets"])
        flat_targets = [None if leaf is None else rows(next(summed_targets)) for leaf in tree.flatten(targets)]
        shards.y, shards.sample_weight = tree.pack_sequence_as(targets, flat_targets)
        non_trainable, kinds = started["non_trainable"], started["kinds"]

        def finish() -> None:
            if non_trainable is not None:
                *totals, count = result["non_trainable"]
                cross_worker.assign_non_trainable(self.model.non_trainable_variables, kinds, totals,
                                                  float(ops.convert_to_numpy(count)))

        loss = started["loss"]
        loss = on_host(result["loss"][0]) if loss is not None else None
        grads = started["own_gradients"]
        if grads is None:
            grads = [on_host(g) for g in result["grads"]]
        return grads, loss, y_pred, finish


class OverlappedExchange:
    """A multi-worker train step's exchange that runs during the backward pass (one local replica,
    an engine that reports gradients as it computes them, `engine.capabilities.overlaps_backward`).

    The gradients go in buckets as the backward pass computes them
    (`gradient_buckets.py`), as torch DDP sends them; the step's other values
    (batch check, loss, predictions, targets, non-trainable values), ready
    after the forward pass, travel with the last bucket, after the backward
    pass. (Sent on their own when the forward pass ended, they made the
    benchmarks' MLP step slower: one more collective per step, for a backward
    pass too short to hide it.)
    """

    def __init__(self, exchange: WorkerExchange, shards: Shards, stop_asked: bool):
        self._exchange, self._shards, self._stop_asked = exchange, shards, stop_asked
        trainable = exchange.model.trainable_variables
        options = exchange.strategy.extended._communication_options
        bucket_bytes = options.bytes_per_pack or gradient_buckets.DEFAULT_BUCKET_BYTES
        layout = exchange.bucket_layouts.get(bucket_bytes)
        if layout is None:
            dtypes = [keras.backend.standardize_dtype(v.dtype) for v in trainable]
            nbytes = [int(np.prod(v.shape)) * np.dtype(d).itemsize for v, d in zip(trainable, dtypes)]
            layout = exchange.bucket_layouts[bucket_bytes] = gradient_buckets.layout(dtypes, nbytes, bucket_bytes)
        # The step's exchange, kept where the last bucket finds it: the buckets must not refer to
        # this object, whose cycle would keep the step's autograd graph alive until a collection.
        self._started: dict = {}
        self.buckets = gradient_buckets.GradientBuckets(layout, exchange.strategy.extended._start_cross_worker_sum,
                                                        functools.partial(_start_last_bucket, self._started))

    def before_backward(self, aux: Any) -> None:
        shards = self._shards
        non_trainable = [aux[2]] if shards.active else []
        self._started["started"] = self._exchange.start(shards, [], aux[0], [aux[1]], non_trainable,
                                                        self._stop_asked, training=True)

    def ready(self, index: int, grad: Any) -> None:
        self.buckets.ready(index, grad)

    def finish(self, grads: list):
        """After the backward pass (`grads`: this worker's): `WorkerExchange.run`'s result."""
        summed = self.buckets.finish(grads)
        exchanged = self._exchange.finish(self._started["started"])
        if exchanged is STOPPED:
            return STOPPED
        _, loss, global_predictions, finish = exchanged
        return [self._exchange.on_host(g) for g in summed], loss, global_predictions, finish


def _start_last_bucket(exchange: dict, values: list, what: str) -> "_Bucket":
    """Starts the last bucket's sum with the step's other values (`exchange["started"]`, see
    `WorkerExchange.start`): one all-reduce. The backward pass is over: its gradients are
    the step's own, which the engine may sum in place."""
    started = exchange["started"]["exchange"]
    started.add("bucket", values, donated=True)
    started.start(what)
    return _Bucket(started)


class _Bucket:
    """The last gradient bucket's sums, from the step's exchange that carries them."""

    def __init__(self, exchange: cross_worker.Exchange):
        self._exchange = exchange

    def wait(self) -> list:
        return self._exchange.result()["bucket"]
