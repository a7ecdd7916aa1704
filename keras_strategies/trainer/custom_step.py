"""Models that override `train_step` / `test_step` / `predict_step`, under a multi-replica strategy.

The contract: `fit` / `evaluate` / `predict` call the model's own step once
per replica, inside `strategy.run`, with that replica's shard of the global
batch (replicas without samples sit the step out). Inside it:

- compute the loss as for one device (`self.compute_loss(...)`, a mean over
  the shard): do not scale it by the number of replicas;
- `self.optimizer.apply(grads, vars)` / `apply_gradients` (or, on JAX,
  `stateless_apply`) sums the replicas' gradients, each weighted by its
  shard's share of the global batch, clips after that, and applies one
  update, so the step equals the single-device step on the global batch;
- metrics updated with `self.compute_metrics(...)` accumulate over replicas,
  and the logs are read once all replicas are done.

Stateless steps (JAX) on shards of one size run as one compiled replica
program, as Keras' own JAX trainer compiles a model's step; otherwise (uneven
shards, `run_eagerly=True`, a step JAX cannot trace, stateful steps)
replicas run eagerly, one at a time between collectives. With several
workers, each worker runs the step on its replicas' shards of the global
batch; afterwards the metric states (summed deltas) and non-trainable values
(mean) are combined across workers, so logs are global and every worker
holds the same state.
"""

from __future__ import annotations

import warnings
from typing import Any

import keras
from keras import ops
from keras.src import tree
from keras.src.trainers.data_adapters import data_adapter_utils

from keras_strategies.distribute import context
from keras_strategies.backend.common import keras_state
from keras_strategies.keras_integration import loss_reduction
from keras_strategies.backend import engine
from keras_strategies.input import padding
from keras_strategies.input.splitting import split_batch
from keras_strategies.trainer import cross_worker, worker_states
from keras_strategies.trainer.cross_worker import STOPPED
from keras_strategies.trainer.shards import as_tensors, make_shards


def overrides_step(model: Any, kind: str) -> bool:
    """True when the model's class defines its own `<kind>_step`."""
    name = f"{kind}_step"
    return getattr(type(model), name) is not getattr(keras.Model, name)


class CustomStep:
    """Runs the model's own steps per replica (see the module docstring)."""

    def __init__(self, model: Any, strategy: Any):
        self.model = model
        self.strategy = strategy
        self.devices = strategy.extended.worker_devices
        self.host = strategy.extended._variable_device  # where variables live and updates run
        self._programs: dict = {}  # step kind -> its compiled replica program (`_run_compiled`)
        self._eager_kinds: dict = {}  # step kind -> why it could not be compiled

    def _run(self, kind: str, shards: Any) -> tuple[list, list, int]:
        """Per replica, the model's step outputs and (stateless steps) new states; and how many replicas had rows."""
        sizes, batch = shards.sizes, shards.batch
        pieces = split_batch(shards.local, sizes)
        if self._compiles(kind, shards):
            try:
                results = self._run_compiled(kind, pieces, sizes[0] / batch)
            except engine.capabilities.untraceable_errors as error:
                self._eager_kinds[kind] = error
                warnings.warn(
                    f"The model's own {kind}_step could not be compiled ({type(error).__name__}: "
                    f"{str(error).splitlines()[0] if str(error) else ''}); it runs eagerly on every "
                    "replica from now on, which is slower. A step that JAX can trace (no Python "
                    "decisions on tensor values) runs as one compiled program.",
                    stacklevel=2,
                )
            else:
                return [r[0] for r in results], [r[1] for r in results], len(sizes)
        active = [i for i, size in enumerate(sizes) if size > 0]
        idle = not active
        if idle:
            # This worker has no rows of this batch, but its optimizer must still take part in the
            # cross-worker all-reduce: one replica runs a copy of a real row with gradient weight 0.
            active, pieces = [0], [padding.source_rows((shards.x, shards.y, shards.sample_weight))]
        snapshot = keras_state.capture()
        devices = [self.devices[i] for i in active]
        # Stateful steps (TF, torch) write the variables themselves; JAX's return new states.
        writes = self.strategy.extended._replica_writes(devices, record=engine.capabilities.stateful_steps)

        def replica(k, *_):
            i = active[k]
            replica_context = context.ReplicaContext(
                self.strategy, k, in_program=True, gradient_weight=0.0 if idle else sizes[i] / batch
            )
            with keras_state.installed(snapshot), context.enter_frame(self.strategy, replica_context), \
                    writes.scope(k):
                # Keras losses computed in the step reduce to the replica's share (`loss_reduction.py`);
                # the optimizer weighs its gradients by the same share, and `metric.update_state(loss)`
                # (Keras' guide) counts with it (`metric_weighting.py`).
                loss_reduction.enter_replica_loss(replica_context._gradient_weight, None, None)
                piece = as_tensors(pieces[i])
                shard = data_adapter_utils.pack_x_y_sample_weight(*piece) if kind != "predict" else (piece[0],)
                return engine.trainer.call_step(self.model, kind, shard, self.devices[i])

        run = engine.replicas.make_replicated(replica, devices, compiled=False, variables=self.model.trainable_variables)
        results = run((), [() for _ in devices])
        writes.combine()
        return [r[0] for r in results], [r[1] for r in results], 0 if idle else len(active)

    def _compiles(self, kind: str, shards: Any) -> bool:
        """Whether this step runs as one compiled replica program: stateless steps (JAX), unless
        the model runs eagerly, on shards of one size (a program has one shape per input; padding
        rows would enter the step's own means), once tracing it has not failed.

        The shards of every worker decide, not this worker's alone: every worker then takes the
        same path, and all compute the same update (compiled and eager updates can differ in the
        last bit).
        """
        return (
            not engine.capabilities.stateful_steps
            and not self.model.run_eagerly
            and not shards.uneven
            and shards.sizes[0] > 0
            and kind not in self._eager_kinds
        )

    def _run_compiled(self, kind: str, pieces: list, gradient_weight: float) -> list:
        """The model's step on every replica as one compiled program (one per step kind)."""
        if kind not in self._programs:
            snapshot = keras_state.capture()

            def replica(replica_id, state, piece):
                replica_context = context.ReplicaContext(
                    self.strategy, replica_id, in_program=True, gradient_weight=gradient_weight)
                with keras_state.installed(snapshot), context.enter_frame(self.strategy, replica_context):
                    loss_reduction.enter_replica_loss(gradient_weight, None, None)
                    shard = data_adapter_utils.pack_x_y_sample_weight(*piece) if kind != "predict" else (piece[0],)
                    return engine.trainer.call_step(self.model, kind, shard, None, state=state)

            self._programs[kind] = engine.replicas.make_replicated(replica, self.devices, compiled=True)
        state = engine.trainer.step_state(self.model, kind)
        return self._programs[kind]((state,), [(tuple(as_tensors(piece)),) for piece in pieces])

    def _combine_states(self, kind: str, states: list) -> None:
        """Stateless steps (JAX) return one state per replica; it is combined and assigned."""
        if states[0] is None:
            return
        host = self.host
        for (variables, policy), *per_replica in zip(engine.trainer.state_parts(self.model, kind), *states):
            for j, variable in enumerate(variables):
                values = [engine.devices.copy_to(ops.convert_to_tensor(part[j]), host) for part in per_replica]
                if policy == "mean" and "float" in str(variable.dtype):
                    new = ops.divide(sum(values[1:], values[0]), len(values))
                elif policy == "delta_sum":
                    old = engine.devices.copy_to(variable.value, host)
                    new = old + sum((v - old for v in values[1:]), values[0] - old)
                else:
                    new = values[0]
                variable.assign(new)

    def _shards_unless_stopped(self, kind: str, data: Any, stop_asked: bool) -> Any:
        """The step's shards, or `STOPPED` when a worker asked to stop before it (`trainer/stopping.py`).

        With several workers, one small all-reduce before the model's step
        (which applies its update inside) carries the stop flag and the batch
        fingerprint: workers that read batches of different sizes all get a
        clear error here, not a collective mismatch inside the step.
        """
        shards = make_shards(self.strategy, data, len(self.devices), with_targets=kind != "predict")
        extended = self.strategy.extended
        if extended._num_workers == 1:
            return shards
        (total,) = extended._cross_worker_sum([cross_worker.batch_check(shards, stop_asked)], "batch check")
        return STOPPED if cross_worker.stop_or_check(total, shards, extended._num_workers, kind == "predict") else shards

    def _step(self, kind: str, data: Any, stop_asked: bool) -> Any:
        shards = self._shards_unless_stopped(kind, data, stop_asked)
        if shards is STOPPED:
            return STOPPED
        across_workers = self.strategy.extended._num_workers > 1
        before = worker_states.capture(self.model, kind) if across_workers else None
        _, states, replicas_with_rows = self._run(kind, shards)
        self._combine_states(kind, states)
        if across_workers:
            worker_states.combine(self.model, kind, self.strategy.extended, before, replicas_with_rows)
        return self.model.get_metrics_result()

    def train_step(self, data: Any, stop_asked: bool = False) -> Any:
        return self._step("train", data, stop_asked)

    def test_step(self, data: Any, stop_asked: bool = False) -> Any:
        return self._step("test", data, stop_asked)

    def predict_step(self, data: Any, stop_asked: bool = False) -> Any:
        shards = self._shards_unless_stopped("predict", data, stop_asked)
        if shards is STOPPED:
            return STOPPED
        outputs, _, replicas_with_rows = self._run("predict", shards)
        idle = replicas_with_rows == 0
        host = self.host
        on_host = [tree.map_structure(lambda t: engine.devices.copy_to(ops.convert_to_tensor(t), host), o) for o in outputs]
        local = tree.map_structure(lambda *parts: ops.concatenate(parts, axis=0), *on_host) if len(on_host) > 1 else on_host[0]
        if self.strategy.extended._num_workers == 1:
            return local
        # Every worker gets the predictions of the whole global batch.
        buffers = cross_worker.place_rows(shards, [] if idle else [local], local, shards.batch)
        flat = self.strategy.extended._cross_worker_sum(tree.flatten(buffers), "predictions all-gather", donated=True)
        return tree.pack_sequence_as(buffers, [engine.devices.copy_to(ops.convert_to_tensor(f), host) for f in flat])

