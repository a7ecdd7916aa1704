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

Replicas run eagerly, one at a time between collectives.
"""

from __future__ import annotations

from typing import Any

import keras
from keras import ops
from keras.src import tree
from keras.src.trainers.data_adapters import data_adapter_utils

from keras_strategies import context, keras_state
from keras_strategies.backend import engine
from keras_strategies.input.splitting import batch_size_of, shard_sizes, split_batch


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

    def _run(self, kind: str, data: Any) -> tuple[list, list]:
        x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
        batch = batch_size_of(x)
        sizes = shard_sizes(batch, len(self.devices))
        pieces = split_batch((x, y, sample_weight), sizes)
        active = [i for i, size in enumerate(sizes) if size > 0]
        snapshot = keras_state.capture()

        def replica(k, *_):
            i = active[k]
            replica_context = context.ReplicaContext(
                self.strategy, k, in_program=True, gradient_weight=sizes[i] / batch
            )
            with keras_state.installed(snapshot), context.enter_frame(self.strategy, replica_context):
                shard = data_adapter_utils.pack_x_y_sample_weight(*pieces[i]) if kind != "predict" else (pieces[i][0],)
                return engine.trainer.call_step(self.model, kind, shard)

        devices = [self.devices[i] for i in active]
        run = engine.replicas.make_replicated(replica, devices, compiled=False)
        results = run((), [() for _ in devices])
        return [r[0] for r in results], [r[1] for r in results]

    def _combine_states(self, kind: str, states: list) -> None:
        """Stateless steps (JAX) return one state per replica; it is combined and assigned."""
        if states[0] is None:
            return
        host = self.devices[0]
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

    def train_step(self, data: Any) -> dict:
        _, states = self._run("train", data)
        self._combine_states("train", states)
        return self.model.get_metrics_result()

    def test_step(self, data: Any) -> dict:
        _, states = self._run("test", data)
        self._combine_states("test", states)
        return self.model.get_metrics_result()

    def predict_step(self, data: Any) -> Any:
        outputs, _ = self._run("predict", data)
        host = self.devices[0]
        on_host = [tree.map_structure(lambda t: engine.devices.copy_to(ops.convert_to_tensor(t), host), o) for o in outputs]
        return tree.map_structure(lambda *parts: ops.concatenate(parts, axis=0), *on_host) if len(on_host) > 1 else on_host[0]
