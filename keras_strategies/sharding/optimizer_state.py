"""An optimizer's state split over the replicas' devices (ZeRO stage 1).

Every trainable variable is cut into N equal flat pieces (`flat_shards`);
device i keeps piece i of each, with its own copy of the optimizer (same
class and configuration) built on those pieces, so the device holds 1/N of
every slot (Adam's moments, momentum, ...) and the optimizer itself is never
built whole. An update unscales and clips the whole summed gradients as the
optimizer itself would (norms need the whole gradient), then each device
updates its piece of every variable with its piece of the gradients, and the
pieces are gathered back into the variables.

That equals the optimizer's own update where the update is elementwise
(SGD, Adam, AdamW, RMSprop, Adagrad, Adadelta, Adamax, Nadam, Ftrl, Lion);
optimizers that read whole rows or norms of a variable (Adafactor, Lamb,
Muon) are refused. Saving writes the state whole, in the order of the
optimizer's own variables, so it loads under any strategy and replica count.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator, Optional, Sequence

import keras
import numpy as np
from keras.src.optimizers.loss_scale_optimizer import LossScaleOptimizer

from keras_strategies.backend import engine
from keras_strategies.backend.common import replica_variables
from keras_strategies.distribute import context
from keras_strategies.sharding import flat_shards
from keras_strategies.sharding.gradient_pieces import GradientPieces, unscale_and_clip

_STATE = "_ks_sharded_state"
_PENDING = "_ks_pending_whole_state"  # whole values loaded before the pieces existed
_ELEMENTWISE = ("SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adadelta", "Adamax", "Nadam", "Ftrl", "Lion")


def check_optimizer(optimizer: Any, strategy_name: str) -> None:
    """Refuses, with the reason, an optimizer whose state cannot be updated in pieces."""
    name = type(optimizer).__name__
    if isinstance(optimizer, LossScaleOptimizer):
        raise ValueError(
            f"{strategy_name} does not shard a LossScaleOptimizer's state yet. For mixed precision use the "
            "'mixed_bfloat16' policy (which needs no loss scaling), or ks.MirroredStrategy.")
    if not isinstance(optimizer, tuple(getattr(keras.optimizers, n) for n in _ELEMENTWISE)):
        raise ValueError(
            f"{strategy_name} updates each device's piece of a variable on its own, which equals the whole "
            f"update only for optimizers whose update is elementwise ({', '.join(_ELEMENTWISE)}); {name} reads "
            "whole rows or norms of a variable. Use one of those, or ks.MirroredStrategy.")
    if getattr(optimizer, "use_ema", False):
        raise ValueError(f"{strategy_name} does not shard use_ema's moving averages yet: compile with "
                         f"{name}(use_ema=False), or use ks.MirroredStrategy.")
    if getattr(optimizer, "gradient_accumulation_steps", None):
        raise ValueError(f"{strategy_name} does not shard gradient accumulators yet: compile with "
                         f"{name}(gradient_accumulation_steps=None), or use ks.MirroredStrategy.")


def state_of(optimizer: Any) -> Optional["ShardedOptimizerState"]:
    """The sharded state of `optimizer`, if a sharded strategy has split it."""
    return getattr(optimizer, _STATE, None)


def keep_pending(optimizer: Any, values: list) -> None:
    """Whole values loaded into `optimizer` before its pieces exist: they initialise the pieces."""
    object.__setattr__(optimizer, _PENDING, values)


@contextlib.contextmanager
def _outside_strategies() -> Iterator[None]:
    """Where the pieces are made: plain variables on the device named, outside every strategy,
    replica and compiled trace (the strategy would place them on its host device)."""
    with replica_variables.outside_stateless_scopes(), context.enter_frame(context.default_strategy(), None), \
            engine.compiler.outside_compiled(), engine.compiler.outside_replicas():
        yield


def _nbytes(value: Any) -> int:
    """The bytes an array (or variable) stores, from its shape and dtype (also inside a trace)."""
    return math.prod(value.shape) * np.dtype(keras.backend.standardize_dtype(value.dtype)).itemsize


def _numpy(value: Any) -> np.ndarray:
    return np.asarray(keras.ops.convert_to_numpy(getattr(value, "value", value)))


class ShardedOptimizerState:
    """`optimizer`'s state for `variables`, one piece per device of `devices`; updates run there."""

    def __init__(self, optimizer: Any, variables: Sequence[Any], devices: Sequence[str], host: str):
        self.optimizer, self.variables = optimizer, list(variables)
        self.devices, self.host = tuple(devices), host
        self.pieces: list = []  # pieces[i][j]: device i's piece of variable j
        self.optimizers: list = []  # device i's copy of the optimizer, built on pieces[i]
        self.references: list = []  # for each variable of a copy: the variable it mirrors (an index) or None
        # The bytes of summed gradients each device held in the last update: whole after an all-reduce
        # (stage 1), one piece after a reduce-scatter (stage 2).
        self.gradient_bytes: list = [0] * len(self.devices)
        with _outside_strategies():
            self._make_pieces()

    def _make_pieces(self) -> None:
        """The pieces and the optimizer's copies, initialised from any whole state it holds or loaded."""
        optimizer = self.optimizer
        config = dict(optimizer.get_config(), clipnorm=None, clipvalue=None, global_clipnorm=None,
                      loss_scale_factor=None)
        for i, device in enumerate(self.devices):
            with engine.devices.device_scope(device):
                pieces = [keras.Variable(np.zeros((flat_shards.piece_length(v.shape, len(self.devices)),),
                                                  keras.backend.standardize_dtype(v.dtype)),
                                         name=v.name, trainable=True) for v in self.variables]
                copy = type(optimizer).from_config(config)
                self._exclude_like(copy, pieces)
                references = self._build(copy, pieces, {id(p): j for j, p in enumerate(pieces)})
            self.pieces.append(pieces)
            self.optimizers.append(copy)
            self.references = references
        pending = getattr(optimizer, _PENDING, None)
        if pending is not None:
            object.__setattr__(optimizer, _PENDING, None)
            self.load(pending)
        elif optimizer.built:  # built whole before (e.g. by Keras when loading a model): its values
            self.load([_numpy(v) for v in optimizer.variables])
        object.__setattr__(optimizer, _STATE, self)

    def _exclude_like(self, copy: Any, pieces: list) -> None:
        """The pieces of variables excluded from weight decay (by variable) are excluded in the copy."""
        excluded = getattr(self.optimizer, "_exclude_from_weight_decay", None)
        if excluded:
            keys = {copy._var_key(p) for v, p in zip(self.variables, pieces) if self.optimizer._var_key(v) in excluded}
            copy._exclude_from_weight_decay = set(getattr(copy, "_exclude_from_weight_decay", None) or ()) | keys
        pattern = getattr(self.optimizer, "_exclude_from_weight_decay_pattern", None)
        if pattern is not None:  # by name: the pieces have their variables' names
            copy._exclude_from_weight_decay_pattern = pattern

    @staticmethod
    def _build(copy: Any, pieces: list, index_of: dict) -> list:
        """Builds `copy` on `pieces`, recording which piece each of its variables was made from."""
        made_from: dict = {}
        add_from_reference = copy.add_variable_from_reference

        def recording(reference_variable, *args, **kwargs):
            variable = add_from_reference(reference_variable, *args, **kwargs)
            made_from[id(variable)] = index_of.get(id(reference_variable))
            return variable

        vars(copy)["add_variable_from_reference"] = recording  # this copy only, while it builds
        try:
            copy.build(pieces)
        finally:
            del vars(copy)["add_variable_from_reference"]
        return [made_from.get(id(v)) for v in copy.variables]

    # -- updates ---------------------------------------------------------------------------

    def apply(self, grads: Sequence[Any]) -> None:
        """One update of the variables with the whole summed `grads` (on the host device), unscaled
        and clipped there by the optimizer's own code, then cut into each device's pieces."""
        optimizer, host, n = self.optimizer, self.host, len(self.devices)
        present = [j for j, g in enumerate(grads) if g is not None]
        with engine.devices.device_scope(host):
            whole = [grads[j] for j in present]
            if optimizer.loss_scale_factor is not None:
                whole = [g / optimizer.loss_scale_factor for g in whole]
            whole = dict(zip(present, optimizer._clip_gradients(whole)))
            cut = {j: flat_shards.split(keras.ops.convert_to_tensor(g), n) for j, g in whole.items()}
        pieces = [[engine.devices.copy_to(cut[j][i], device) if j in cut else None for j in range(len(grads))]
                  for i, device in enumerate(self.devices)]
        # The replicas' all-reduce left the whole sum on every device.
        self.gradient_bytes = [sum(_nbytes(g) for g in whole.values())] * n
        self._update(GradientPieces(pieces, self.devices))

    def apply_pieces(self, gradients: GradientPieces) -> None:
        """One update with summed gradients already in pieces on their devices (reduce-scattered),
        unscaled and clipped in pieces (`gradient_pieces.unscale_and_clip`)."""
        self.gradient_bytes = [sum(_nbytes(g) for g in row if g is not None) for row in gradients.pieces]
        self._update(unscale_and_clip(self.optimizer, gradients, self.host))

    def _update(self, gradients: GradientPieces) -> None:
        """Each device updates its pieces of the variables; the pieces are gathered into the variables."""
        optimizer, host, n = self.optimizer, self.host, len(self.devices)
        present = gradients.present
        with engine.devices.device_scope(host):
            variable_pieces = {j: flat_shards.split(self.variables[j].value, n) for j in present}
            iterations = optimizer.iterations.value
            learning_rate = None if callable(optimizer._learning_rate) else optimizer._learning_rate
        for i, (device, copy, pieces) in enumerate(zip(self.devices, self.optimizers, self.pieces)):
            with engine.devices.device_scope(device):
                copy.iterations.assign(engine.devices.copy_to(iterations, device))
                if learning_rate is not None:
                    copy._learning_rate.assign(engine.devices.copy_to(getattr(learning_rate, "value", learning_rate),
                                                                      device))
                for j in present:
                    pieces[j].assign(engine.devices.copy_to(variable_pieces[j][i], device))
                engine.optimizer.apply_gradients(
                    copy, [gradients.pieces[i][j] for j in present], [pieces[j] for j in present])
        with engine.devices.device_scope(host):
            for j in present:
                variable = self.variables[j]
                variable.assign(flat_shards.join(
                    [engine.devices.copy_to(pieces[j].value, host) for pieces in self.pieces], variable.shape))
                if variable.constraint is not None:
                    variable.assign(variable.constraint(variable))
            optimizer.iterations.assign_add(1)

    # -- what each device holds ------------------------------------------------------------

    def bytes_per_replica(self) -> list:
        """The bytes of optimizer state each device holds (its copy's variables, as stored)."""
        return [sum(_nbytes(v) for v in copy.variables) for copy in self.optimizers]

    def slot_bytes_per_replica(self) -> list:
        """The bytes of the slots (the state that grows with the model) each device holds."""
        return [sum(_nbytes(v) for v, ref in zip(copy.variables, self.references) if ref is not None)
                for copy in self.optimizers]

    # -- whole values, for checkpoints -----------------------------------------------------

    def whole_values(self) -> list:
        """The state as the optimizer built whole would hold it, in the order of its variables."""
        values = []
        for k, reference in enumerate(self.references):
            first = self.optimizers[0].variables[k]
            if reference is None:
                values.append(_numpy(self._own_scalar(first)))
                continue
            shape = tuple(self.variables[reference].shape)
            flat = np.concatenate([_numpy(copy.variables[k]) for copy in self.optimizers])
            values.append(flat[:math.prod(shape)].reshape(shape))
        return values

    def _own_scalar(self, variable: Any) -> Any:
        """The optimizer's own iterations and learning rate stand for its copies'."""
        copy = self.optimizers[0]
        if variable is copy.iterations:
            return self.optimizer.iterations
        if variable is getattr(copy, "_learning_rate", None) and not callable(self.optimizer._learning_rate):
            return self.optimizer._learning_rate
        return variable

    def load(self, values: Sequence[Any]) -> None:
        """Loads whole values (`whole_values`' order) into the pieces."""
        expected = len(self.references)
        if len(values) != expected:
            raise ValueError(
                f"The saved state of optimizer '{self.optimizer.name}' has {len(values)} variables, but this "
                f"optimizer has {expected} for these {len(self.variables)} trainable variables: it was saved "
                "for another model or another optimizer.")
        n = len(self.devices)
        for k, (reference, value) in enumerate(zip(self.references, values)):
            value = np.asarray(value)
            own = self._own_scalar(self.optimizers[0].variables[k])
            if reference is None and own is not self.optimizers[0].variables[k]:
                own.assign(value)
            for i, (device, copy) in enumerate(zip(self.devices, self.optimizers)):
                variable = copy.variables[k]
                if reference is not None:
                    length = flat_shards.piece_length(value.shape, n)
                    flat = np.zeros((length * n,), value.dtype)
                    flat[:value.size] = value.reshape(-1)
                    value_i = flat[i * length:(i + 1) * length]
                else:
                    value_i = value
                with engine.devices.device_scope(device):
                    variable.assign(engine.devices.copy_to(keras.ops.convert_to_tensor(value_i, variable.dtype), device))


def state_for(optimizer: Any, variables: Sequence[Any], devices: Sequence[str], host: str,
              strategy_name: str) -> ShardedOptimizerState:
    """`optimizer`'s sharded state for `variables`, made at its first update."""
    state = state_of(optimizer)
    if state is None or [id(v) for v in state.variables] != [id(v) for v in variables]:
        check_optimizer(optimizer, strategy_name)
        state = ShardedOptimizerState(optimizer, variables, devices, host)
    return state


def shards_state(optimizer: Any) -> bool:
    """Whether `optimizer`'s state is (or will be) split over devices: its strategy shards it."""
    strategy = context.strategy_of(getattr(optimizer, "iterations", None)) or context.get_strategy()
    return bool(getattr(strategy.extended, "_shards_optimizer_state", False)) and strategy.num_replicas_in_sync > 1


def whole_state(optimizer: Any) -> Optional[list]:
    """`optimizer`'s state whole (NumPy, in the order of its own variables built whole), if it is split."""
    state = state_of(optimizer)
    return None if state is None else state.whole_values()


def load_whole_state(optimizer: Any, values: Sequence[Any]) -> bool:
    """Loads whole saved values into `optimizer`'s pieces, or keeps them for its first update when its
    strategy shards its state and it has no pieces yet; False when its state is not split."""
    state = state_of(optimizer)
    if state is not None:
        state.load(values)
        return True
    if not optimizer.built and len(values) > len(optimizer.variables) and shards_state(optimizer):
        values = [np.asarray(v) for v in values]
        # An optimizer's own variables (iterations, learning rate) come first in its whole state.
        for variable, value in zip(optimizer.variables, values):
            if tuple(variable.shape) == value.shape:
                variable.assign(value)
        keep_pending(optimizer, values)
        return True
    return False


@contextlib.contextmanager
def left_unbuilt(optimizer: Any) -> Iterator[None]:
    """Keras builds an unbuilt optimizer whole with its model (`Trainer._symbolic_build`); one whose
    strategy shards its state is built in pieces at its first update instead, never whole."""
    if optimizer is None or optimizer.built or not shards_state(optimizer):
        yield
        return
    optimizer.built = True  # seen as built by the block only
    try:
        yield
    finally:
        optimizer.built = False
