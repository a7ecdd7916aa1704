"""An optimizer's state split over the replicas' devices (ZeRO stage 1).

Every trainable variable is cut into N equal flat pieces (`flat_shards`);
device i keeps piece i of each, with its own copy of the optimizer (same
class and configuration) built on those pieces, so the device holds 1/N of
every slot (Adam's moments, momentum, ...) and the optimizer itself is never
built whole. An update unscales and clips the whole summed gradients as the
optimizer itself would (norms need the whole gradient), then each device
updates its piece of every variable with its piece of the gradients, and the
pieces are gathered back into the variables.

In a cluster of several workers the pieces are those of every replica of
every worker (`PieceLayout`): worker w's local devices hold its consecutive
pieces, and the updated pieces of all workers are all-gathered across them
with the engine's collective (`engine.collectives.all_gather`).

That equals the optimizer's own update where the update is elementwise
(SGD, Adam, AdamW, RMSprop, Adagrad, Adadelta, Adamax, Nadam, Ftrl, Lion);
optimizers that read whole rows or norms of a variable (Adafactor, Lamb,
Muon) are refused. `use_ema`'s averages and accumulated gradients are pieces
of the copies like their slots; a `LossScaleOptimizer`'s inner optimizer is
the one sharded (`loss_scaling`). Saving writes the state whole, in the order
of the optimizer's own variables, so it loads under any strategy and replica
count.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from typing import Any, Callable, Iterator, Optional, Sequence

import keras
import numpy as np
from keras import ops

from keras_strategies.backend import engine
from keras_strategies.backend.common import replica_variables
from keras_strategies.distribute import context
from keras_strategies.sharding import flat_shards
from keras_strategies.sharding import gradient_pieces
from keras_strategies.sharding import loss_scaling
from keras_strategies.sharding.scattered_update import ScatteredUpdate

_STATE = "_ks_sharded_state"
_PENDING = "_ks_pending_whole_state"  # whole values loaded before the pieces existed
_LEFT_UNBUILT = "_ks_left_unbuilt"  # seen as built inside `left_unbuilt` only
_ELEMENTWISE = ("SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adadelta", "Adamax", "Nadam", "Ftrl", "Lion")


def check_optimizer(optimizer: Any, strategy_name: str) -> None:
    """Refuses, with the reason, an optimizer whose state cannot be updated in pieces (of a
    `LossScaleOptimizer`, its inner optimizer)."""
    _, optimizer = loss_scaling.scaler_and_inner(optimizer)
    name = type(optimizer).__name__
    if not isinstance(optimizer, tuple(getattr(keras.optimizers, n) for n in _ELEMENTWISE)):
        raise ValueError(
            f"{strategy_name} updates each device's piece of a variable on its own, which equals the whole "
            f"update only for optimizers whose update is elementwise ({', '.join(_ELEMENTWISE)}); {name} reads "
            "whole rows or norms of a variable. Use one of those, or ks.MirroredStrategy.")
    if getattr(optimizer, "gradient_accumulation_steps", None) and gradient_pieces.clipping(optimizer) in ("norm",
                                                                                                           "global"):
        raise ValueError(
            f"{strategy_name} keeps the accumulated gradients in pieces, but {name}'s clipnorm or global_clipnorm "
            "reads norms of whole accumulated gradients: with gradient_accumulation_steps use clipvalue (or no "
            "clipping), or ks.MirroredStrategy.")


def state_of(optimizer: Any) -> Optional["ShardedOptimizerState"]:
    """The sharded state of `optimizer` (of a `LossScaleOptimizer`'s inner optimizer), if a sharded
    strategy has split it."""
    return getattr(loss_scaling.scaler_and_inner(optimizer)[1], _STATE, None)


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
    return math.prod(value.shape) * flat_shards.itemsize(value)


def _numpy(value: Any) -> np.ndarray:
    return np.asarray(keras.ops.convert_to_numpy(getattr(value, "value", value)))


@dataclasses.dataclass(frozen=True)
class PieceLayout:
    """Which pieces this process's devices hold: `num_pieces` in all (every replica of every worker),
    this process's from `first` on, one per local device; `across_workers` all-gathers a list of
    local arrays from every worker (stacked in worker order), `scattered_across_workers`
    reduce-scatters arrays `(num_workers, ...)` (this worker's row summed over the workers) and
    `summed_across_workers` all-reduces; all None in one process."""

    num_pieces: int
    first: int = 0
    across_workers: Optional[Callable[[list], list]] = None
    scattered_across_workers: Optional[Callable[[list], list]] = None
    summed_across_workers: Optional[Callable[[list], list]] = None


class WholeValues:
    """The sharded state whole, as the optimizer built whole would hold it (checkpoints): read
    from and loaded into the pieces of a `ShardedOptimizerState`."""

    optimizer: Any
    variables: list
    devices: tuple
    layout: PieceLayout
    optimizers: list
    references: list
    loaded_here: Optional[list]

    def whole_values(self) -> list:
        """The state as the optimizer built whole would hold it, in the order of its variables."""
        sliced = [k for k, reference in enumerate(self.references) if reference is not None]
        local = [np.concatenate([_numpy(copy.variables[k]) for copy in self.optimizers]) for k in sliced]
        if self.layout.across_workers is not None:  # every worker's pieces, in worker order
            local = [_numpy(stacked).reshape(-1) for stacked in self.layout.across_workers(local)]
        flats = dict(zip(sliced, local))
        values = []
        for k, reference in enumerate(self.references):
            if reference is None:
                values.append(_numpy(self._own_scalar(self.optimizers[0].variables[k])))
                continue
            shape = tuple(self.variables[reference].shape)
            values.append(flats[k][:math.prod(shape)].reshape(shape))
        return values

    def _own_scalar(self, variable: Any) -> Any:
        """The optimizer's own iterations and learning rate stand for its copies'."""
        copy = self.optimizers[0]
        if variable is copy._iterations:  # (`iterations` counts accumulated steps where gradients accumulate)
            return self.optimizer._iterations
        if variable is getattr(copy, "_learning_rate", None) and not callable(self.optimizer._learning_rate):
            return self.optimizer._learning_rate
        return variable

    def whole_zeros(self) -> list:
        """Zeros shaped and typed as `whole_values()`: what a worker that loaded nothing sends when the
        workers take the chief's loaded values."""
        zeros = []
        for k, reference in enumerate(self.references):
            variable = self.optimizers[0].variables[k]
            shape = variable.shape if reference is None else self.variables[reference].shape
            zeros.append(np.zeros(tuple(shape), keras.backend.standardize_dtype(variable.dtype)))
        return zeros

    def load(self, values: Sequence[Any]) -> None:
        """Loads whole values (`whole_values`' order) into the pieces."""
        expected = len(self.references)
        if len(values) != expected:
            raise ValueError(
                f"The saved state of optimizer '{self.optimizer.name}' has {len(values)} variables, but this "
                f"optimizer has {expected} for these {len(self.variables)} trainable variables: it was saved "
                "for another model or another optimizer.")
        n, first = self.layout.num_pieces, self.layout.first
        if self.layout.across_workers is not None:
            self.loaded_here = [np.asarray(v) for v in values]
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
                    value_i = flat[(first + i) * length:(first + i + 1) * length]
                else:
                    value_i = value
                with engine.devices.device_scope(device):
                    variable.assign(engine.devices.copy_to(keras.ops.convert_to_tensor(value_i, variable.dtype), device))


class ShardedOptimizerState(ScatteredUpdate, WholeValues):
    """`optimizer`'s state for `variables`, one piece per device of `devices`; updates run there."""

    def __init__(self, optimizer: Any, variables: Sequence[Any], devices: Sequence[str], host: str,
                 layout: Optional[PieceLayout] = None, scaler: Optional[Any] = None):
        self.optimizer, self.variables = optimizer, list(variables)
        self.scaler = scaler  # a LossScaleOptimizer around `optimizer`: its scale unscales the gradients
        self.devices, self.host = tuple(devices), host
        self.layout = layout or PieceLayout(len(self.devices))
        self.pieces: list = []  # pieces[i][j]: device i's piece of variable j
        self.optimizers: list = []  # device i's copy of the optimizer, built on pieces[i]
        self.references: list = []  # for each variable of a copy: the variable it mirrors (an index) or None
        # The bytes of summed gradients each device held in the last update: whole after an all-reduce
        # (stage 1), one piece after a reduce-scatter (stage 2).
        self.gradient_bytes: list = [0] * len(self.devices)
        self._parts: dict = {}  # the compiled parts of an update (see "updates" below)
        # Whole values this worker alone loaded (a chief restoring a backup), until the workers sync.
        self.loaded_here: Optional[list] = None
        self._programs: dict = {}  # whole updates, as one program where the engine compiles those
        self._joined: Optional[tuple] = None  # (present, the values the last join assigned them)
        with _outside_strategies():
            self._make_pieces()

    def _make_pieces(self) -> None:
        """The pieces and the optimizer's copies, initialised from any whole state it holds or loaded."""
        optimizer = self.optimizer
        # The whole summed gradients are unscaled and clipped before they are cut, except where they
        # accumulate: then each copy clips its accumulated pieces (elementwise, `check_optimizer`).
        config = dict(optimizer.get_config(), clipnorm=None, global_clipnorm=None, loss_scale_factor=None,
                      clipvalue=optimizer.clipvalue if self._accumulates else None)
        for i, device in enumerate(self.devices):
            with engine.devices.device_scope(device):
                pieces = [keras.Variable(np.zeros((flat_shards.piece_length(v.shape, self.layout.num_pieces),),
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

    @property
    def _accumulates(self) -> bool:
        """Whether the optimizer accumulates gradients over several steps (in its copies' pieces)."""
        return bool(self.optimizer.gradient_accumulation_steps)

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
    #
    # An update is three kinds of compiled programs: one on the host device that cuts the whole
    # variables (and, at stage 1, the clipped summed gradients) into pieces, one per device that
    # updates its pieces with its copy of the optimizer, and one on the host that joins the pieces
    # into the variables; between them, one batched transfer each way. Where one compiled program
    # may place its operations on several devices (`engine.capabilities.programs_span_devices`),
    # the whole update is that one program.

    def apply(self, grads: Sequence[Any]) -> None:
        """One update of the variables with the whole summed `grads` (on the host device), unscaled
        and clipped there by the optimizer's own code, then cut into each device's pieces."""
        present = tuple(j for j, g in enumerate(grads) if g is not None)
        # The replicas' all-reduce left the whole sum on every device.
        # (An Embedding's gradient on TensorFlow is sliced: its dense bytes, as `_cut` makes it dense.)
        self.gradient_bytes = [sum(_nbytes(self.variables[j]) for j in present)] * len(self.devices)
        self._run(("whole", present), self._apply_whole, [grads[j] for j in present], present)

    def _run(self, key: tuple, update: Any, grads: Any, present: tuple) -> None:
        # Cross-worker collectives run eagerly, between the compiled parts.
        if not engine.capabilities.programs_span_devices or self.layout.across_workers is not None:
            return update(grads, present)
        program = self._programs.get(key)
        if program is None:
            state = [*self.variables, self.optimizer._iterations, *loss_scaling.own_variables(self.scaler)]
            state += [v for copy, pieces in zip(self.optimizers, self.pieces) for v in [*pieces, *copy.variables]]
            program = self._programs[key] = engine.compiler.compile_stateful(
                lambda g: update(g, present), state)
        program(grads)

    def _apply_whole(self, grads: list, present: tuple) -> None:
        current = self._pieces_current(present)
        cut = self._part(f"cut-{current}", present, functools.partial(self._cut, present))
        cut_variables, cut_grads, finite = cut(self._to_cut(present, current), grads, self._scale())
        self._update(cut_variables, cut_grads, present, grads_elsewhere=True, finite=finite)

    def _scale(self) -> list:
        """The loss scale the gradients are unscaled by, where a LossScaleOptimizer's changes: `[scale]`."""
        return [] if self.scaler is None else [self.scaler.dynamic_scale.value]

    def _part(self, name: str, present: tuple, fn: Any, state: Sequence[Any] = ()) -> Any:
        """`fn` compiled (once per `name`, variables with gradients and device) as one program."""
        key = (name, present)
        if key not in self._parts:
            self._parts[key] = engine.compiler.compile_stateful(fn, list(state))
        return self._parts[key]

    def _cut(self, present: tuple, values: list, grads: Optional[list], scale: Sequence[Any] = ()) -> tuple:
        """On the host device: the `values` of the `present` variables (none where the pieces are
        current) and their whole gradients (unscaled, by `scale` where given, and clipped by the
        optimizer) cut into pieces, `[piece i of each] for each device i`; and with `scale`, whether
        the gradients are finite."""
        n, optimizer = self.layout.num_pieces, self.optimizer
        own = range(self.layout.first, self.layout.first + len(self.devices))  # this process's pieces
        with engine.devices.device_scope(self.host):
            cut_values = [flat_shards.split(v, n) for v in values]
            if grads is None:
                return [[cut[i] for cut in cut_values] for i in own], None, None
            finite = None
            if scale:
                finite = self.scaler.check_finite(grads)
                grads = [ops.divide(g, scale[0]) for g in grads]
            elif optimizer.loss_scale_factor is not None:
                grads = [g / optimizer.loss_scale_factor for g in grads]
            cut_grads = [self._split_gradient(g, tuple(self.variables[j].shape), n)
                         for g, j in zip(grads if self._accumulates else optimizer._clip_gradients(grads), present)]
            return ([[cut[i] for cut in cut_values] for i in own],
                    [[cut[i] for cut in cut_grads] for i in own], finite)

    @staticmethod
    def _split_gradient(grad: Any, shape: tuple, n: int) -> list:
        """A whole gradient cut as its variable; a sliced one (an Embedding's on TensorFlow) into the
        slices of each piece, which the optimizer's copies apply as the optimizer applies slices."""
        if engine.gradients.is_sliced(grad):
            return engine.gradients.sliced_pieces(grad, shape, n, flat_shards.piece_length(shape, n))
        # (Clipping may have made a sliced one dense, of a shape known only when it runs.)
        return flat_shards.split(ops.reshape(ops.convert_to_tensor(grad), shape), n)

    def _on_each(self, per_device: list) -> list:
        """`per_device[i]` (a list of values) on device i, for every device: one batched transfer."""
        values = [value for values in per_device for value in values]
        placed = engine.devices.place_each(values, [device for device, values in zip(self.devices, per_device)
                                                    for _ in values])
        out, start = [], 0
        for values in per_device:
            out.append(placed[start:start + len(values)])
            start += len(values)
        return out

    def _update(self, cut_variables: list, grads: list, present: tuple, factors: Optional[list] = None,
                clip: bool = False, grads_elsewhere: bool = False, finite: Any = None) -> None:
        """Each device updates its pieces (`grads[i]`: its gradient pieces, there unless
        `grads_elsewhere`, clipped first with `factors` when `clip`; kept only where `finite`, when
        given); the pieces are gathered into the variables."""
        optimizer = self.optimizer
        scalars = [optimizer._iterations.value]
        if not callable(optimizer._learning_rate):
            scalars.append(optimizer._learning_rate.value)
        factors = list(factors or [])
        flags = [] if finite is None else [finite]
        # One transfer of everything the devices take: their variable pieces, the step's scalars
        # (clipping factors, whether the gradients are finite) and, from the host, their gradient pieces.
        inputs = self._on_each([[*cut_variables[i], *scalars, *factors, *flags, *(grads[i] if grads_elsewhere else ())]
                                for i in range(len(self.devices))])
        cut = len(cut_variables[0])  # each variable, or none where the pieces hold the variables (`_pieces_current`)
        for i, (device, copy, pieces) in enumerate(zip(self.devices, self.optimizers, self.pieces)):
            on_device = inputs[i]
            extra = len(scalars) + len(factors) + len(flags)
            grads_i = on_device[cut + extra:] if grads_elsewhere else grads[i]
            own = [pieces[j] for j in present]
            step = self._part(f"update-{i}-{clip}-{cut}-{bool(flags)}", present,
                              self._device_update(copy, own, len(scalars), clip, bool(flags)), [*own, *copy.variables])
            with engine.devices.device_scope(device):
                step(on_device[:cut], grads_i, on_device[cut:cut + extra])
        self._gather_into_variables(present, counts_step=True, finite=finite)

    def _gather_into_variables(self, present: tuple, counts_step: bool, finite: Any = None) -> None:
        """The devices' pieces of the `present` variables joined into them on the host (and the
        optimizer's step counted, after an update: where `finite` is given, if it holds, and the
        loss scale's step too)."""
        optimizer, host = self.optimizer, self.host
        gathered = engine.devices.place_each([pieces[j].value for pieces in self.pieces for j in present],
                                             [host] * (len(present) * len(self.pieces)))
        gathered = self._from_every_worker(gathered)
        flags = [] if finite is None else [finite]
        join = self._part(f"join-{counts_step}-{bool(flags)}", present,
                          lambda values, flags: self._join(values, present, counts_step, flags),
                          [*(self.variables[j] for j in present), optimizer._iterations,
                           *loss_scaling.own_variables(self.scaler)])
        with engine.devices.device_scope(host):
            join(gathered, flags)
        self._joined = None
        if engine.capabilities.immutable_values and all(self.variables[j].constraint is None for j in present):
            self._joined = (present, [self.variables[j].value for j in present])

    def _pieces_current(self, present: tuple) -> bool:
        """Whether the devices' pieces of the `present` variables hold what those variables hold:
        the last join assigned them (unconstrained) and nothing has written them since
        (`engine.capabilities.immutable_values`). Then the update cuts no variable."""
        if self._joined is None or self._joined[0] != present:
            return False
        return all(self.variables[j].value is value for j, value in zip(present, self._joined[1]))

    def _to_cut(self, present: tuple, current: bool) -> list:
        """The variables' values that the update cuts into the devices' pieces (none where current)."""
        return [] if current else [self.variables[j].value for j in present]

    def _from_every_worker(self, local: list) -> list:
        """Every worker's values of `local` (one list per local device, flattened), in the order of
        their pieces: worker 0's devices, then worker 1's, ... (as is, in one process)."""
        if self.layout.across_workers is None:
            return local
        stacked = self.layout.across_workers(list(local))
        return [value[w] for w in range(self.layout.num_pieces // len(self.devices)) for value in stacked]

    def _device_update(self, copy: Any, own: list, num_scalars: int, clip: bool, masked: bool) -> Any:
        optimizer = self.optimizer

        def update(variable_pieces: list, grads: list, scalars: list) -> None:
            for piece, value in zip(own, variable_pieces):
                piece.assign(value)
            copy._iterations.assign(scalars[0])
            if num_scalars > 1:
                copy._learning_rate.assign(scalars[1])
            factors = scalars[num_scalars:len(scalars) - masked]
            if clip:
                grads = [gradient_pieces.clip_piece(optimizer, g, k, factors) for k, g in enumerate(grads)]
            if masked:  # a LossScaleOptimizer's step: kept only where the gradients were finite
                loss_scaling.kept_if_finite(scalars[-1], lambda: copy.apply(grads, own), [*own, *copy.variables])
            else:
                copy.apply(grads, own)

        return update

    def finalize_variable_values(self) -> None:
        """`use_ema`'s end of training (`optimizer.finalize_variable_values`): each device overwrites
        its pieces with their moving averages, which are joined into the variables."""
        if not self.optimizer.use_ema:
            return
        for device, copy, pieces in zip(self.devices, self.optimizers, self.pieces):
            with _outside_strategies(), engine.devices.device_scope(device):
                copy.finalize_variable_values(pieces)
        self._gather_into_variables(tuple(range(len(self.variables))), counts_step=False)

    def _join(self, gathered: list, present: tuple, counts_step: bool = True, flags: Sequence[Any] = ()) -> None:
        """On the host device: the variables assigned their joined pieces (then their constraints;
        with `flags`, `[finite]`, only after a step whose gradients were finite)."""
        k = len(present)
        for position, j in enumerate(present):
            variable = self.variables[j]
            variable.assign(flat_shards.join([gathered[i * k + position] for i in range(self.layout.num_pieces)],
                                             variable.shape))
            if variable.constraint is not None:
                constrained = variable.constraint(variable)
                variable.assign(ops.where(flags[0], constrained, variable.value) if flags else constrained)
        if counts_step and flags:
            self.optimizer._iterations.assign_add(ops.cast(flags[0], self.optimizer._iterations.dtype))
            loss_scaling.next_scale(self.scaler, flags[0])
        elif counts_step:
            self.optimizer._iterations.assign_add(1)

    # -- what each device holds ------------------------------------------------------------

    def bytes_per_replica(self) -> list:
        """The bytes of optimizer state each device holds (its copy's variables, as stored)."""
        return [sum(_nbytes(v) for v in copy.variables) for copy in self.optimizers]

    def slot_bytes_per_replica(self) -> list:
        """The bytes of the slots (the state that grows with the model) each device holds."""
        return [sum(_nbytes(v) for v, ref in zip(copy.variables, self.references) if ref is not None)
                for copy in self.optimizers]


def state_for(optimizer: Any, variables: Sequence[Any], devices: Sequence[str], host: str,
              strategy_name: str, layout: Optional[PieceLayout] = None) -> ShardedOptimizerState:
    """`optimizer`'s sharded state for `variables`, made at its first update (of a
    `LossScaleOptimizer`: its inner optimizer's, with its own variables built whole beside)."""
    state = state_of(optimizer)
    if state is None or [id(v) for v in state.variables] != [id(v) for v in variables]:
        check_optimizer(optimizer, strategy_name)
        scaler, inner = loss_scaling.scaler_and_inner(optimizer)
        if scaler is not None:
            with engine.compiler.outside_compiled(), engine.devices.device_scope(host):
                loss_scaling.build_own(scaler, variables)
            _load_pending_scaler(scaler, inner)
        state = ShardedOptimizerState(inner, variables, devices, host, layout, scaler)
    return state


def _load_pending_scaler(scaler: Any, inner: Any) -> None:
    """Whole values a LossScaleOptimizer loaded before it was built: its own now, its inner
    optimizer's for the pieces."""
    pending = getattr(scaler, _PENDING, None)
    if pending is None:
        return
    object.__setattr__(scaler, _PENDING, None)
    own = loss_scaling.own_variables(scaler)
    for variable, value in zip(own, pending):
        variable.assign(value)
    keep_pending(inner, list(pending[len(own):]))


def shards_state(optimizer: Any) -> bool:
    """Whether `optimizer`'s state is (or will be) split over devices: its strategy shards it."""
    return strategy_shards_state(context.strategy_of(getattr(optimizer, "_iterations", None)) or context.get_strategy())


def strategy_shards_state(strategy: Any) -> bool:
    """Whether `strategy` splits an optimizer's state over its replicas."""
    return bool(getattr(strategy.extended, "_shards_optimizer_state", False)) and strategy.num_replicas_in_sync > 1


def whole_state(optimizer: Any) -> Optional[list]:
    """`optimizer`'s state whole (NumPy, in the order of its own variables built whole), if it is split."""
    state = state_of(optimizer)
    if state is None:
        return None
    own = [_numpy(v) for v in loss_scaling.own_variables(loss_scaling.scaler_and_inner(optimizer)[0])]
    return own + state.whole_values()


def load_whole_state(optimizer: Any, values: Sequence[Any]) -> bool:
    """Loads whole saved values into `optimizer`'s pieces, or keeps them for its first update when its
    strategy shards its state and it has no pieces yet; False when its state is not split."""
    state = state_of(optimizer)
    scaler, _ = loss_scaling.scaler_and_inner(optimizer)
    own = loss_scaling.own_variables(scaler)
    if state is not None:
        for variable, value in zip(own, values):
            variable.assign(value)
        state.load(values[len(own):])
        return True
    unbuilt = not optimizer.built or getattr(optimizer, _LEFT_UNBUILT, False)
    if scaler is not None and unbuilt and shards_state(optimizer):
        keep_pending(optimizer, [np.asarray(v) for v in values])  # its own variables are not made yet
        return True
    if unbuilt and len(values) > len(optimizer.variables) and shards_state(optimizer):
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
    """Keras builds an unbuilt optimizer whole with its model (`Trainer._symbolic_build`) and before
    BackupAndRestore loads a backup; one whose strategy shards its state is built in pieces at its
    first update instead, never whole (a backup's state waits for the pieces, `load_whole_state`)."""
    if optimizer is None or optimizer.built or not shards_state(optimizer):
        yield
        return
    optimizer.built = True  # seen as built by the block only
    object.__setattr__(optimizer, _LEFT_UNBUILT, True)
    try:
        yield
    finally:
        optimizer.built = False
        object.__setattr__(optimizer, _LEFT_UNBUILT, False)
