"""Multi-worker train and test steps whose cross-worker exchange runs inside their compiled program.

Where the engine's cross-worker collectives are ops of its compiled programs
(`engine.capabilities.exchanges_in_program`: TensorFlow's `CollectiveReduceV2`), a
train step of several workers runs as one program instead of the replica
program, a host-packed exchange (`WorkerExchange.run`) and the update (a
test step likewise, without gradients, update and non-trainable values):

1. the replicas and the exchange: the same one all-reduce of the batch check
   and stop flag, the gradients, the loss, this worker's predictions, targets
   and weights placed in buffers of the agreed rows capacity, and the
   non-trainable sums (`cross_worker.py`);
2. only when the summed check lets every worker go on (`cross_worker.may_go_on`:
   no stop asked, the same batch size everywhere; `engine.compiler.run_if`),
   the optimizer update, the non-trainable assignment and the metric update on
   the global batch.

The host then reads the summed check as the eager exchange does
(`cross_worker.stop_or_check`): a stop, or workers reading different batches,
before any update was made.

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
        self._programs: dict = {}  # "train" or "test" -> its compiled step

    def applies(self, kind: str, shards: Any) -> bool:
        """Whether this batch's `kind` step can exchange inside its program (see the module docstring).

        Decided from what every worker shares (the global batch), so that all take the same path:
        every replica of every worker has rows, and the targets travel exactly as float32.
        """
        step = self._step
        return bool(
            engine.capabilities.exchanges_in_program and step._compiled and step.reduce_in_program
            and step.num_workers > 1 and not (kind == "train" and step._overlaps_backward()) and shards.global_input
            and step.strategy.num_replicas_in_sync <= shards.batch <= step.workers.rows_capacity
            and not step._eager_fallback(kind, shards) and _travel_as_float32(shards)
        )

    def run(self, kind: str, shards: Any, loss_scale: float, stop_asked: bool) -> Any:
        """The `kind` step's logs, or `cross_worker.STOPPED` when a worker asked to stop."""
        step = self._step
        program = self._programs.get(kind)
        if program is None:
            program = self._programs[kind] = engine.compiler.compile_stateful(getattr(self, f"_{kind}_program"), [])
        targets = tree.map_structure(
            lambda leaf: None if leaf is None else leaf.astype("float32"),
            tuple(cross_worker.own_rows(shards, part, step.workers.rows_capacity) for part in (shards.y, shards.sample_weight)),
        )
        dtypes = tuple(None if leaf is None else str(np.asarray(leaf).dtype)
                       for leaf in tree.flatten((shards.y, shards.sample_weight)))
        plan = (tuple(shards.sizes), int(shards.offset), int(step.workers.rows_capacity), int(shards.batch), dtypes,
                int(step.num_workers))
        rows, x, _, _ = step.host_update.batch_arrays(shards)  # the targets come from the exchange
        check = cross_worker.batch_check(shards, stop_asked)
        per_replica = step._per_replica(shards, loss_scale)

        def whole_step() -> dict:
            outputs = program(per_replica, check, targets, (rows, x), plan)
            outputs["check"] = ops.convert_to_numpy(outputs["check"])  # waits for the whole program
            return outputs

        outputs = step.strategy.extended._run_watched(_WHAT[kind], whole_step)
        if cross_worker.stop_or_check(outputs["check"], shards, step.num_workers, exact=False):
            return cross_worker.STOPPED
        return outputs["logs"]

    def _train_program(self, per_replica: list, check: Any, targets: tuple, batch: tuple, plan: tuple) -> dict:
        """The replicas, the exchange, and (when every worker may go on) the update and the metrics."""
        step = self._step
        outputs = step._train(step.program.state(), per_replica)
        grads, loss = step.host_update.sums_of_first_replica(outputs)
        auxes = [aux for _, aux in outputs]
        payload, _ = cross_worker.non_trainable_payload(
            step.model.non_trainable_variables, [aux[2] for aux in auxes], step.host
        )
        payload.append(np.array(float(len(plan[0])), "float32"))  # replicas with rows on this worker
        summed = self._exchange("train", check, grads, loss, [aux[1] for aux in auxes], targets, payload, plan)

        def update_and_measure() -> dict:
            variables = step.model.non_trainable_variables
            logs = step.host_update.apply_and_measure(summed["grads"], summed["loss"], summed["predictions"],
                                          step.host_update.batch_tensors((*batch, *summed["targets"])))
            *totals, count = summed["payload"]
            cross_worker.assign_non_trainable(variables, cross_worker.non_trainable_kinds(variables), totals, count)
            return logs

        return dict(check=summed["check"], logs=engine.compiler.run_if(summed["go_on"], update_and_measure))

    def _test_program(self, per_replica: list, check: Any, targets: tuple, batch: tuple, plan: tuple) -> dict:
        """The replicas, the exchange, and (when every worker may go on) the metrics on the global batch."""
        step = self._step
        auxes = step._test(step.program.state(), per_replica)
        loss = step.host_update.on_host(auxes[0][0])  # the loss summed in the replica program
        summed = self._exchange("test", check, [], loss, [aux[1] for aux in auxes], targets, [], plan)

        def measure() -> dict:
            return step.host_update.update_metrics(step.host_update.batch_tensors((*batch, *summed["targets"])), summed["loss"],
                                        summed["predictions"])

        return dict(check=summed["check"], logs=engine.compiler.run_if(summed["go_on"], measure))

    def _exchange(self, kind: str, check: Any, grads: list, loss: Any, predictions: list, targets: tuple,
                  payload: list, plan: tuple) -> dict:
        """One all-reduce of everything the update and the metrics need: the sums, the global
        batch's predictions and `(y, sample_weight)`; `go_on` is False when a worker asked to stop
        or the workers' batch sizes differ (`cross_worker.may_go_on`)."""
        sizes, offset, capacity, batch, dtypes, num_workers = plan
        step = self._step
        local = [tree.map_structure(lambda leaf, size=size: _first_rows(step.host_update.on_host(leaf), size), part)
                 for part, size in zip(predictions, sizes)]
        placed = tree.map_structure(lambda *leaves: _placed(leaves, offset, capacity), *local)
        flat_predictions = tree.flatten(placed)
        flat_targets = [leaf for leaf in tree.flatten(targets) if leaf is not None]
        values = [check] + list(grads) + [loss] + [_sendable(p) for p in flat_predictions] + flat_targets + payload
        summed = step.strategy.extended._cross_worker_sum(values, _WHAT[kind])
        parts, start = [], 0
        for length in (1, len(grads), 1, len(flat_predictions), len(flat_targets), len(payload)):
            parts.append(summed[start:start + length])
            start += length
        (total_check,), grads, (loss,), received, summed_targets, payload = parts
        received = [_first_rows(_received(p, original), batch) for p, original in zip(received, flat_predictions)]
        typed = iter(_first_rows(ops.cast(ops.round(t), dtype) if dtype != "float32" else t, batch)
                     for t, dtype in zip(summed_targets, [d for d in dtypes if d is not None]))
        return dict(check=total_check, go_on=cross_worker.may_go_on(total_check, num_workers), grads=list(grads),
                    loss=loss, predictions=tree.pack_sequence_as(placed, received), payload=list(payload),
                    targets=tree.pack_sequence_as(targets, [None if d is None else next(typed) for d in dtypes]))


def _travel_as_float32(shards: Any) -> bool:
    """Whether the global batch's targets and weights travel exactly as float32 (class labels do)."""
    arrays = [np.asarray(leaf) for leaf in tree.flatten((shards.y, shards.sample_weight)) if leaf is not None]
    return all(array.dtype == np.float32 or cross_worker.exact_in_float32(array) for array in arrays)


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
