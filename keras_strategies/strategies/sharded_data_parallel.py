"""`ShardedDataParallelStrategy`: data parallelism whose optimizer state is split over the devices.

ZeRO's first stage (Rajbhandari et al., 2020): the replicas run Mirrored's
steps (each computes the gradients of its shard of the global batch, summed
across replicas), but instead of one update of every variable with the whole
optimizer state, each device keeps 1/N of the state (`sharding/optimizer_state.py`)
and updates its piece of every variable; the pieces are gathered back into
the variables. The largest optimizer state that fits is N times Mirrored's.

In a cluster (TF_CONFIG or another launcher's environment, as for
`MultiWorkerMirroredStrategy`, whose cross-worker sums it shares) the pieces
are those of all `workers x local devices` replicas; after each update the
workers all-gather their updated pieces.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import keras
import numpy as np

from keras_strategies.backend import engine
from keras_strategies.cluster_resolver.environment import resolver_from_environment
from keras_strategies.distribute.devices import default_compute_devices, resolve_devices
from keras_strategies.distribute.values import PerReplica
from keras_strategies.distribute.strategy import Strategy
from keras_strategies.multi_worker.communication import CommunicationOptions
from keras_strategies.multi_worker.worker_cluster import resolve
from keras_strategies.sharding import loss_scaling, optimizer_state
from keras_strategies.sharding.gradient_pieces import ReplicaGradients
from keras_strategies.strategies.mirrored import MirroredExtended
from keras_strategies.strategies.multi_worker_mirrored import MultiWorkerMirroredExtended, check_communication_options

STAGES = (1, 2)  # the ZeRO stages this strategy implements


class ShardedUpdates:
    """Mirrored's replica steps; the update of each variable's pieces on the devices holding their
    state. A mixin of `MirroredExtended` (one process) and `MultiWorkerMirroredExtended` (a cluster)."""

    _shards_optimizer_state = True

    def _set_stage(self, stage: int) -> None:
        self._stage = stage
        if stage >= 2:
            # The replicas' gradients are reduce-scattered after the replica program, not summed in it.
            self._default_cross_device_ops = False
            self._sums_gradients_in_update = True

    @property
    def _update_in_whole_step(self) -> bool:
        # The update touches every device: inside a step's one program only where a program may
        # place operations on several devices (a JAX step program runs on the replicas' mesh).
        return engine.capabilities.programs_span_devices

    def _piece_layout(self) -> optimizer_state.PieceLayout:
        """The pieces of this process's devices: one per local replica, in one process."""
        return optimizer_state.PieceLayout(len(self._devices))

    def _sharded(self) -> bool:
        return self.num_replicas_in_sync > 1

    def _state_for(self, optimizer: Any, variables: Sequence[Any]) -> optimizer_state.ShardedOptimizerState:
        return optimizer_state.state_for(optimizer, variables, self._devices, self._variable_device,
                                         type(self._container).__name__, self._piece_layout())

    def _prepare_update(self, optimizer: Any, variables: Sequence[Any]) -> None:
        if not self._sharded():
            return super()._prepare_update(optimizer, variables)
        self._state_for(optimizer, variables)

    @property
    def stage(self) -> int:
        """The ZeRO stage: 1, the optimizer state is sharded; 2, the summed gradients too."""
        return self._stage

    def _custom_steps_untraceable(self) -> Optional[str]:
        if self._sharded():
            return "ShardedDataParallelStrategy updates each device's piece of the optimizer state on that device"
        return super()._custom_steps_untraceable()

    def _sum_gradients(self, per_replica: list, destination: str) -> Any:
        if self._stage < 2 or not self._sharded():
            return super()._sum_gradients(per_replica, destination)
        return ReplicaGradients(per_replica)  # reduce-scattered by the update

    def _apply_update(self, optimizer: Any, grads: Any, variables: Sequence[Any]) -> None:
        if not self._sharded():
            return super()._apply_update(optimizer, grads, variables)
        state = self._state_for(optimizer, variables)
        if not isinstance(grads, ReplicaGradients) and any(isinstance(g, PerReplica) for g in grads):
            # `apply_gradients` inside `run` at stage 2: each replica's own gradients.
            grads = ReplicaGradients([[g.values[r] if isinstance(g, PerReplica) else g for g in grads]
                                      for r in range(len(self._devices))])
        elif not isinstance(grads, ReplicaGradients) and self._stage >= 2 and len(self._devices) == 1:
            # The same on a worker of one device: its one replica's own gradients, as they are.
            grads = ReplicaGradients([list(grads)])
        if not isinstance(grads, ReplicaGradients):
            state.apply(grads)
        elif any(engine.gradients.is_sliced(g) for row in grads.per_replica for g in row if g is not None):
            # An Embedding's gradient on TensorFlow: summed whole with its slices kept, as at stage 1,
            # whose pieces take slices.
            state.apply(self._summed_whole(grads.per_replica))
        else:
            state.apply_per_replica(grads.per_replica)

    def _summed_whole(self, per_replica: list) -> list:
        """The replicas' gradients summed onto the variables' device as the strategy sums them
        below stage 2 (`None` kept where a variable has no gradient)."""
        present = [j for j, g in enumerate(per_replica[0]) if g is not None]
        summed = self._summed_over_workers(
            super()._sum_gradients([[row[j] for j in present] for row in per_replica], self._variable_device))
        whole: list = [None] * len(per_replica[0])
        for j, total in zip(present, summed):
            whole[j] = total
        return whole

    def _summed_over_workers(self, values: list) -> list:
        """`values` (this process's sums) summed over every worker; as they are in one process."""
        return values

    def optimizer_state(self, optimizer: Any) -> Optional[optimizer_state.ShardedOptimizerState]:
        """`optimizer`'s state split over the devices (its pieces and their bytes), once it has updated."""
        return optimizer_state.state_of(optimizer)


class ShardedDataParallelExtended(ShardedUpdates, MirroredExtended):
    """`ShardedUpdates` on the devices of one machine."""

    def __init__(self, container, devices: Sequence[str], stage: int):
        super().__init__(container, devices, cross_device_ops=None)
        self._set_stage(stage)


class MultiWorkerShardedExtended(ShardedUpdates, MultiWorkerMirroredExtended):
    """`ShardedUpdates` over every replica of every worker: worker w's devices hold its consecutive
    pieces, and the updated pieces of all workers are all-gathered after each update."""

    def __init__(self, container, cluster: Any, options: CommunicationOptions, devices: Optional[Sequence[str]],
                 stage: int):
        local = default_compute_devices if devices is None else lambda: resolve_devices(devices)
        super().__init__(container, cluster, options, local_devices=local)
        self._set_stage(stage)

    def _piece_layout(self) -> optimizer_state.PieceLayout:
        local = len(self._devices)
        return optimizer_state.PieceLayout(self.num_replicas_in_sync, self._cluster.worker_index * local,
                                           self._pieces_of_every_worker, self._pieces_summed_over_workers,
                                           lambda values: self._cross_worker_sum(values, "sum of gradient norms"))

    def _sync_optimizer_state_from_chief(self, optimizer: Any, variables: Sequence[Any]) -> None:
        """At the start of `fit`, after BackupAndRestore may have restored the chief's backup into
        the chief's pieces alone (or kept it for pieces not made yet): the pieces are made on every
        worker, and where the chief loaded whole values, every worker loads them."""
        if not self._sharded() or optimizer is None or self._cluster.num_workers == 1:
            return
        state = self._state_for(optimizer, variables)
        if self._broadcast_from_chief(1 if state.loaded_here is not None else 0):
            own = loss_scaling.own_variables(state.scaler)  # a LossScaleOptimizer's scale and counter
            own_values = [np.asarray(keras.ops.convert_to_numpy(v.value)) for v in own]
            zeros = [np.zeros_like(v) for v in own_values] + state.whole_zeros()
            mine = own_values + state.loaded_here if self._cluster.is_chief else zeros
            chiefs = self._cross_worker_sum([np.asarray(v, z.dtype) for v, z in zip(mine, zeros)],
                                            "broadcast of the chief's optimizer state")
            chiefs = [np.asarray(keras.ops.convert_to_numpy(v)) for v in chiefs]
            for variable, value in zip(own, chiefs):
                variable.assign(value)
            state.load(chiefs[len(own):])
        state.loaded_here = None

    def _summed_over_workers(self, values: list) -> list:
        return self._cross_worker_sum(list(values), "gradient all-reduce")

    def _pieces_summed_over_workers(self, values: list) -> list:
        """This worker's row of each of `values` (`(num_workers, ...)`) summed over every worker: the
        reduce-scatter of stage 2's gradient pieces, under the watchdog (eager, between the update's
        compiled parts)."""
        return self._run_watched("reduce-scatter of the gradient pieces",
                                 lambda: engine.collectives.reduce_scatter_sum(values))

    def _pieces_of_every_worker(self, values: list) -> list:
        """`values` of every worker, stacked in worker order, under the watchdog (a lost worker is named)."""
        if engine.collectives.tracing():  # inside a compiled train step, which runs under the watchdog
            return engine.collectives.all_gather(values)
        return self._run_watched("all-gather of the updated pieces", lambda: engine.collectives.all_gather(values))


class ShardedDataParallelStrategy(Strategy):
    """Synchronous data parallelism with the optimizer state sharded across the replicas (ZeRO
    stages 1 and 2), on the devices of one machine or of every worker of a cluster.

    Each global batch is split across the devices as under `ks.MirroredStrategy`
    and the replicas' gradients are summed; each device then keeps 1/N of the
    optimizer's state (Adam's moments, momentum, ...) and updates its piece of
    every variable, and the pieces are gathered into the variables. Training,
    the logged loss and the metrics equal one device with the same global
    batch; a variable of any shape is cut into N equal flat pieces (the last
    one padded). The optimizer's update must be elementwise (SGD, Adam, AdamW,
    RMSprop, Adagrad, Adadelta, Adamax, Nadam, Ftrl, Lion); `use_ema`'s averages,
    accumulated gradients and a `LossScaleOptimizer`'s inner state are sharded
    with the slots. Checkpoints hold the state whole, so they load under any
    strategy and replica count.

    Where the launcher's environment describes a cluster (`TF_CONFIG`, or
    torchrun's, a SLURM step's or mpirun's variables), or a `cluster_resolver`
    is given, the replicas are every local device of every worker, as under
    `ks.MultiWorkerMirroredStrategy`: each worker keeps the state of its
    replicas' pieces, and the workers all-gather the updated pieces (at stage
    2 the workers reduce-scatter their replicas' summed gradient pieces first).

    Args:
        devices: Device names of this process's replicas; `None` means every
            local accelerator, or every (virtual) CPU device when there is none.
        stage: The ZeRO stage: 1, the optimizer state sharded; 2, the summed
            gradients too (reduce-scattered over every replica of every worker).
        cluster_resolver: Where a cluster and this worker's role come from, as
            for `ks.MultiWorkerMirroredStrategy`; `None` reads the launcher's
            environment (one machine without one).
        communication_options: A `ks.CommunicationOptions` for the cross-worker
            collectives (implementation, timeout).

    Examples:
        >>> strategy = ks.experimental.ShardedDataParallelStrategy(["cpu:0", "cpu:1"])
        >>> strategy.num_replicas_in_sync, strategy.extended.stage
        (2, 1)
        >>> with strategy.scope():
        ...     model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        ...     model.compile(optimizer="adam", loss="mse")
        >>> history = model.fit(np.ones((8, 4)), np.ones((8, 3)), batch_size=4, verbose=0)
        >>> strategy.extended.optimizer_state(model.optimizer).slot_bytes_per_replica()
        [64, 64]
    """

    def __init__(self, devices: Optional[Sequence[str]] = None, stage: int = 1, cluster_resolver: Any = None,
                 communication_options: Optional[CommunicationOptions] = None):
        if stage not in (1, 2, 3):
            raise ValueError(f"stage must be 1, 2 or 3 (the ZeRO stages), got {stage!r}.")
        if stage not in STAGES:
            raise ValueError(
                f"ShardedDataParallelStrategy implements stages 1 and 2 (the optimizer state, and the summed "
                f"gradients, sharded); stage {stage} (the parameters sharded too) is not available yet. "
                "Use stage=2.")
        self._cluster_resolver = cluster_resolver if cluster_resolver is not None else resolver_from_environment()
        cluster = resolve(self._cluster_resolver)
        if cluster.num_workers > 1:
            options = check_communication_options(communication_options)
            super().__init__(MultiWorkerShardedExtended(self, cluster, options, devices, stage))
            return
        resolved = default_compute_devices() if devices is None else resolve_devices(devices)
        super().__init__(ShardedDataParallelExtended(self, resolved, stage))

    @property
    def cluster_resolver(self) -> Any:
        """The cluster resolver this strategy was created with (by default the launcher's environment)."""
        return self._cluster_resolver
