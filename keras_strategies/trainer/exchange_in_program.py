"""Multi-worker train and test steps whose cross-worker exchange runs inside their compiled program.

Where the engine's cross-worker collectives are ops of its compiled programs
(`engine.compiler.EXCHANGES_IN_PROGRAM`: TensorFlow's `CollectiveReduceV2`), a
train step of several workers runs as two programs instead of the replica
program, a host-packed exchange (`ReplicaStep._exchange`) and the update (a
test step likewise, without gradients, update and non-trainable values):

1. the replicas and the exchange: the same one all-reduce of the batch check
   and stop flag, the gradients, the loss, this worker's predictions, targets
   and weights placed in buffers of the agreed rows capacity, and the
   non-trainable sums (`cross_worker.py`);
2. after the host has read the summed check (a stop, workers reading different
   batches: `cross_worker.stop_or_check`, as the eager exchange does, before
   any update), the optimizer update, the non-trainable assignment and the
   metric update on the global batch.

The eager exchange stays for what this one leaves to it: the first step (which
agrees the rows capacity), a batch larger than that capacity, per-worker input,
a global batch with fewer rows than replicas, targets that do not travel
exactly as float32, and the backward-overlapped exchange of engines that report
gradients as they go. Every worker decides from the global batch, so all take
the same path and make the same collectives.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from keras import ops
from keras.src import tree

from keras_strategies.backend import engine
from keras_strategies.trainer import cross_worker

# What a step's exchange is called in errors (as the eager exchange calls it).
_WHAT = {"train": "gradient all-reduce", "test": "predictions all-gather"}


class ExchangeInProgram:
    """The train and test steps of `step` (a `ReplicaStep` of several workers) with the exchange
    in their compiled program."""

    def __init__(self, step: Any):
        self._step = step
        self._exchange_program: Any = None
        self._update_programs: dict = {}  # "train" or "test" -> its second program

    def applies(self, kind: str, shards: Any) -> bool:
        """Whether this batch's `kind` step can exchange inside its program (see the module docstring).

        Decided from what every worker shares (the global batch), so that all take the same path:
        every replica of every worker has rows, and the targets travel exactly as float32.
        """
        step = self._step
        return bool(
            engine.compiler.EXCHANGES_IN_PROGRAM and step._compiled and step.reduce_in_program
            and step.num_workers > 1 and not (kind == "train" and step._overlaps_backward()) and shards.global_input
            and step.strategy.num_replicas_in_sync <= shards.batch <= step._rows_capacity
            and not step._eager_fallback(kind, shards) and _travel_as_float32(shards)
        )

    def run(self, kind: str, shards: Any, loss_scale: float, stop_asked: bool) -> Any:
        """The `kind` step's logs, or `cross_worker.STOPPED` when a worker asked to stop."""
        step = self._step
        targets_structure = tuple(cross_worker.own_rows(shards, part, step._rows_capacity)
                                  for part in (shards.y, shards.sample_weight))
        targets = [leaf for leaf in tree.flatten(targets_structure) if leaf is not None]
        if self._exchange_program is None:
            self._exchange_program = engine.compiler.compile_stateful(self._replicas_and_exchange, [])
            self._update_programs = {"train": engine.compiler.compile_stateful(self._update_and_measure, []),
                                     "test": engine.compiler.compile_stateful(self._measure, [])}
        plan = (kind, tuple(shards.sizes), int(shards.offset), int(step._rows_capacity), int(shards.batch),
                tuple(str(t.dtype) for t in targets))
        sent = [t.astype("float32") for t in targets]
        check = cross_worker.batch_check(shards, stop_asked)
        per_replica = step._per_replica(shards, loss_scale)

        def exchange() -> dict:
            summed = self._exchange_program(per_replica, check, sent, plan)
            summed["check"] = ops.convert_to_numpy(summed["check"])  # waits for the whole program
            return summed

        summed = step.strategy.extended._run_watched(_WHAT[kind], exchange)
        if cross_worker.stop_or_check(summed["check"], shards, step.num_workers, exact=False):
            return cross_worker.STOPPED
        shards.y, shards.sample_weight = tree.pack_sequence_as(
            targets_structure, _with_none(tree.flatten(targets_structure), summed["targets"])
        )
        return self._update_programs[kind](summed["grads"], summed["loss"], summed["predictions"],
                                           step._batch_arrays(shards), summed["non_trainable"])

    def _replicas_and_exchange(self, per_replica: list, check: Any, targets: list, plan: tuple) -> dict:
        """Program 1: the replicas, then one all-reduce of everything the update and the metrics need."""
        kind, sizes, offset, capacity, batch, target_dtypes = plan
        step = self._step
        if kind == "train":
            outputs = step._train(step._state(), per_replica)
            grads, loss = step._sums_of_first_replica(outputs)
            auxes = [aux for _, aux in outputs]
            payload, _ = cross_worker.non_trainable_payload(
                step.model.non_trainable_variables, [aux[2] for aux in auxes], step.host
            )
            payload.append(np.array(float(len(sizes)), "float32"))  # replicas with rows on this worker
        else:
            auxes = step._test(step._state(), per_replica)
            grads, loss, payload = [], step._on_host(auxes[0][0]), []  # the loss summed in the replica program
        local = [tree.map_structure(lambda leaf, size=size: _first_rows(step._on_host(leaf), size), aux[1])
                 for aux, size in zip(auxes, sizes)]
        placed = tree.map_structure(lambda *leaves: _placed(leaves, offset, capacity), *local)
        flat_predictions = tree.flatten(placed)
        values = [check] + list(grads) + [loss] + [_sendable(p) for p in flat_predictions] + list(targets) + payload
        summed = step.strategy.extended._cross_worker_sum(values, _WHAT[kind])
        parts, start = [], 0
        for length in (1, len(grads), 1, len(flat_predictions), len(targets), len(payload)):
            parts.append(summed[start:start + length])
            start += length
        (total_check,), grads, (loss,), predictions, summed_targets, non_trainable = parts
        predictions = [_first_rows(_received(p, original), batch) for p, original in zip(predictions, flat_predictions)]
        summed_targets = [_first_rows(ops.cast(ops.round(t), dtype) if dtype != "float32" else t, batch)
                          for t, dtype in zip(summed_targets, target_dtypes)]
        return dict(check=total_check, grads=list(grads), loss=loss, predictions=tree.pack_sequence_as(placed, predictions),
                    targets=summed_targets, non_trainable=list(non_trainable))

    def _update_and_measure(self, grads: list, loss: Any, predictions: Any, batch: tuple, non_trainable: list) -> dict:
        """Program 2 of a train step: the update, the non-trainable assignment and the metrics,
        as after the eager exchange."""
        step = self._step
        variables = step.model.non_trainable_variables
        logs = step._apply_and_measure(grads, loss, predictions, step._batch_tensors(batch))
        *totals, count = non_trainable
        cross_worker.assign_non_trainable(variables, cross_worker.non_trainable_kinds(variables), totals, count)
        return logs

    def _measure(self, grads: list, loss: Any, predictions: Any, batch: tuple, non_trainable: list) -> dict:
        """Program 2 of a test step: the metric update (no gradients, no non-trainable values)."""
        step = self._step
        return step._update_metrics(step._batch_tensors(batch), loss, predictions)


def _travel_as_float32(shards: Any) -> bool:
    """Whether the global batch's targets and weights travel exactly as float32 (class labels do)."""
    arrays = [np.asarray(leaf) for leaf in tree.flatten((shards.y, shards.sample_weight)) if leaf is not None]
    return all(array.dtype == np.float32 or cross_worker.exact_in_float32(array) for array in arrays)


def _with_none(leaves: list, values: list) -> list:
    """`leaves` with each non-None leaf replaced by the next of `values`."""
    values = iter(values)
    return [None if leaf is None else next(values) for leaf in leaves]


def _first_rows(value: Any, rows: int) -> Any:
    """The first `rows` rows of `value`, with that static row count."""
    if value.shape[0] != rows:
        value = value[:rows]
    return engine.compiler.with_rows(value, rows)


def _placed(leaves: tuple, offset: int, capacity: int) -> Any:
    """This worker's rows (its replicas' blocks in order) at `offset` in zeros of `capacity` rows."""
    local = leaves[0] if len(leaves) == 1 else ops.concatenate(leaves, axis=0)
    rows = int(local.shape[0])
    widths = [[offset, capacity - offset - rows]] + [[0, 0]] * (len(local.shape) - 1)
    return engine.compiler.with_rows(ops.pad(local, widths), capacity)


def _sendable(value: Any) -> Any:
    """Booleans (output masks) travel as float32, which sums exactly (one worker holds each row)."""
    return ops.cast(value, "float32") if "bool" in str(value.dtype) else value


def _received(value: Any, original: Any) -> Any:
    return ops.cast(value, "bool") if "bool" in str(original.dtype) else value
