"""JAX compilation: `jax.jit`; the replica's committed inputs decide the device."""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator, Optional, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from keras.src.backend.common.stateless_scope import StatelessScope, in_stateless_scope
from keras.src.backend.common.variables import get_autocast_scope

from keras_strategies.backend.common.replica_variables import outside_stateless_scopes
from keras_strategies.backend.jax import replicas
from keras_strategies.backend.jax.devices import jax_device


def compile_function(fn: Callable) -> Callable:
    return jax.jit(fn)


def compile_step(fn: Callable) -> Callable:
    """A user's distributed step as it is: `custom_step_program` compiles it where it can
    (`distribute/traced_function.py`); this is what runs otherwise, eagerly."""
    return fn


def compile_stateful(fn: Callable, state_variables: Sequence[Any]) -> Callable:
    """Compiles `fn`, which updates `state_variables` (e.g. metric state), as Keras' JAX
    trainer does: run statelessly under `jax.jit`, then assign the new values."""
    state_variables = list(state_variables)

    def pure(values, *args):
        with StatelessScope(state_mapping=list(zip(state_variables, values))) as scope:
            output = fn(*args)
        new_values = [scope.get_current_value(v) for v in state_variables]
        return output, [old if new is None else new for old, new in zip(values, new_values)]

    jitted = jax.jit(pure)

    def call(*args):
        output, new_values = jitted([v.value for v in state_variables], *args)
        for variable, value in zip(state_variables, new_values):
            variable.assign(value)
        return output

    return call


def with_rows(value: Any, rows: int) -> Any:
    """`value` as it is: its shape is always concrete here."""
    return value


def compile_replicated_step(fn: Callable, variables: Sequence[Any], devices: Sequence[str],
                            keep_copies: bool, finish: Optional[Callable[[list], None]],
                            any_batch_size: bool = False) -> Callable:
    """A whole train, test or predict step around the replica program as one jitted program over
    the replicas' mesh, whose `variables` stay on the mesh between steps.

    `fn(per_replica, batch, sizes)` runs the replicas (`make_replicated`), the
    optimizer update and the metric update. It is traced statelessly over the
    values of `variables`, as Keras' own JAX trainer traces its step, and runs
    on every device of the mesh (`shard_map`): each device runs its replica,
    the replica sum (`psum`) gives every device the same gradients, and each
    device applies the same update and metric update to its copy of the state,
    as under `keras.distribution.DataParallel`. The values the step assigns
    are written back afterwards, still on every device, so the next step sends
    no state: only the batch travels. `settle` brings the variables back to one
    device when a loop ends. One trace per batch shape and shard sizes, `any_batch_size` or not
    (XLA compiles static shapes).

    A train step's `fn` returns `(logs, the non-trainable values of each replica
    with rows)`; `finish(those values)` assigns them inside a group of steps
    (`call.group`, below), where the caller assigns them after a single step.
    A test step's returns its logs, a predict step's the global batch's
    predictions (`finish` is None).

    Without `keep_copies` (CentralStorage: one copy of each variable, updated
    once on its device) `fn` runs as it is: its replica program, its update
    and its metric update are jitted each on their own.
    """
    if not keep_copies:
        return fn

    variables = list(variables)
    mesh = replicas.mesh_of(devices)
    on_mesh, split = NamedSharding(mesh, P()), NamedSharding(mesh, P(replicas.AXIS))

    def traced_step(values, stacked, batch, sizes, in_group):
        """`fn` over `values` of `variables`: its output, the values given, the values after it."""
        with StatelessScope(state_mapping=list(zip(variables, values))) as scope:
            given = [scope.state_mapping[id(v)] for v in variables]
            output = fn(replicas.StackedShards(stacked), batch, sizes)
            if in_group and finish is not None:
                # Inside a group, the non-trainable values are assigned in each step, where the next reads them.
                output, non_trainable = output
                finish(non_trainable)
        return output, given, [scope.get_current_value(v) for v in variables]

    def on_each_device(sizes, values, stacked, batch):
        output, given, new_values = traced_step(values, stacked, batch, sizes, in_group=False)
        # Only what the step assigned comes back (None: an empty pytree, no output).
        return output, [None if new is old else new for new, old in zip(new_values, given)]

    def group_on_each_device(sizes, values, stacked_steps, batches):
        # The steps of a group in one `lax.scan`, the state carried from step to step.
        def one_step(carry, inputs):
            logs, _, new_values = traced_step(carry, *inputs, sizes, in_group=True)
            return [jax.numpy.asarray(new, old.dtype) for new, old in zip(new_values, carry)], logs

        final, logs = jax.lax.scan(one_step, list(values), (stacked_steps, batches))
        return jax.tree_util.tree_map(lambda per_step: per_step[-1], logs), final

    programs: dict = {}  # (step or group, shard sizes) -> its program

    def program_for(on_each: Callable, sizes: tuple, stacked_spec: Any) -> Callable:
        if (on_each, sizes) not in programs:
            program = jax.shard_map(functools.partial(on_each, sizes), mesh=mesh,
                                    in_specs=(P(), stacked_spec, P()), out_specs=P(), check_vma=False)
            programs[on_each, sizes] = jax.jit(program)
        return programs[on_each, sizes]

    repeated = _RepeatedArrays(largest=64)  # a whole step's small arrays: weights, batch size

    def values_on_mesh(state: list, send: tuple, shardings: tuple, direct: bool) -> tuple:
        """The state's values on the mesh, and each part of `send` placed with its sharding: one
        transfer, without the small arrays that repeat from step to step (`_RepeatedArrays`)."""
        values = [_read(v, direct) for v in state]
        moving = [i for i, value in enumerate(values) if not _is_on(value, on_mesh)]
        parts = [jax.tree_util.tree_flatten(part) for part in send]
        leaves = [leaf for part, _ in parts for leaf in part]
        targets = [sharding for (part, _), sharding in zip(parts, shardings) for _ in part]
        placed, sending = repeated.lookup(leaves, targets)
        moved, sent = jax.device_put(([values[i] for i in moving], [leaves[i] for i in sending]),
                                     (on_mesh, [targets[i] for i in sending]))
        for i, value in zip(moving, moved):
            values[i] = value
        repeated.keep(placed, sending, leaves, targets, sent)
        placed = iter(placed)
        return values, tuple(jax.tree_util.tree_unflatten(treedef, [next(placed) for _ in part]) for part, treedef in parts)

    def call(per_replica: Any, batch: tuple, sizes: tuple) -> Any:
        # One transfer for the batch, the shards and whatever state is not on the mesh yet; the
        # state read and written directly where no scope intervenes (`_direct`).
        direct = _direct()
        values, (stacked, batch) = values_on_mesh(variables, (replicas.stack(per_replica), tuple(batch)),
                                                  (split, on_mesh), direct)
        program = program_for(on_each_device, tuple(sizes), P(replicas.AXIS))
        output, new_values = replicas.dispatch(mesh, program, values, stacked, batch)
        for variable, value in zip(variables, new_values):
            if value is not None:
                _write(variable, value, direct)
        return output

    def group(steps: Sequence[tuple]) -> Any:
        """`steps` (each `(per_replica, batch, sizes)`, all of one signature) as one program:
        the logs after the last step."""
        stacked = replicas.stack([replicas.stack(per_replica) for per_replica, _, _ in steps])
        batches = replicas.stack([tuple(batch) for _, batch, _ in steps])
        stacked_spec = P(None, replicas.AXIS)
        direct = _direct()
        values, (stacked, batches) = values_on_mesh(variables, (stacked, batches),
                                                    (NamedSharding(mesh, stacked_spec), on_mesh), direct)
        program = program_for(group_on_each_device, tuple(steps[0][2]), stacked_spec)
        logs, final = replicas.dispatch(mesh, program, values, stacked, batches)
        for variable, value in zip(variables, final):
            _write(variable, value, direct)
        return logs

    call.group = group
    return call


def step_group(compiled_step: Callable) -> Optional[Callable]:
    """What runs a group of steps (`steps_per_execution`) as one program: a whole step that
    keeps the state on the mesh can (`call.group`); None for one that cannot."""
    return getattr(compiled_step, "group", None)


def settle(variables: Sequence[Any], device: str) -> None:
    """Brings variables that a compiled step left on the replicas' mesh back to `device`, where
    eager code (a custom loop's update, a user's computation) expects them; one transfer."""
    target = jax_device(device)
    away = [v for v in variables if isinstance(v.value, jax.Array) and v.value.sharding.device_set != {target}]
    if away:
        for variable, value in zip(away, jax.device_put([v.value for v in away], target)):
            variable.assign(value)


class _RepeatedArrays:
    """Small host arrays a step sends every time, though they rarely change (the replicas'
    weights of the loss, the batch size, the row masks of a partial batch), kept on the mesh by
    value: each transfer costs about 60 µs however small, and the host sends one per array.
    `largest`: the elements of an array kept."""

    KEPT = 64  # arrays kept at most

    def __init__(self, largest: int):
        self._largest = largest
        self._kept: dict = {}

    def _key(self, leaf: Any, sharding: Any) -> Any:
        if isinstance(leaf, np.ndarray) and leaf.size <= self._largest and leaf.dtype != object:
            return sharding, leaf.dtype.str, leaf.shape, leaf.tobytes()
        return None

    def lookup(self, leaves: list, shardings: list) -> tuple[list, list]:
        """The leaves already on the mesh (None where not), and the indices of those to send."""
        placed = [self._kept.get(self._key(leaf, sharding)) for leaf, sharding in zip(leaves, shardings)]
        return placed, [i for i, array in enumerate(placed) if array is None]

    def keep(self, placed: list, sending: list, leaves: list, shardings: list, sent: list) -> None:
        """Fills `placed` with what was `sent`, keeping the small ones for the next calls."""
        for i, array in zip(sending, sent):
            placed[i] = array
            key = self._key(leaves[i], shardings[i])
            if key is not None:
                if len(self._kept) >= self.KEPT:
                    self._kept.clear()
                self._kept[key] = array


def _direct() -> bool:
    """Whether variables can be read and written as their arrays: outside Keras' stateless and
    autocast scopes a variable's value is its array, and a compiled step's new values have the
    variables' shapes and dtypes, so `assign`'s conversion and checks hold. Reading and writing
    the arrays directly saves about 0.2 ms a step of a 28-variable model."""
    return not in_stateless_scope() and get_autocast_scope() is None


def _read(variable: Any, direct: bool) -> Any:
    """A variable's value: its array itself when `direct` (no scope can change what it reads)."""
    return variable._value if direct else variable.value


def _write(variable: Any, value: Any, direct: bool) -> None:
    """Assigns a compiled step's new value (of the variable's shape and dtype); see `_direct`."""
    if direct:
        variable._direct_assign(value)
    else:
        variable.assign(value)


def _is_on(value: Any, sharding: Any) -> bool:
    return isinstance(value, jax.Array) and value.sharding == sharding


@contextlib.contextmanager
def outside_compiled() -> Iterator[None]:
    """Runs its block outside any trace and stateless scope (as TensorFlow's `init_scope`):
    variables created there (an optimizer's, first used inside a compiled step) exist once,
    with concrete initial values."""
    with outside_stateless_scopes(), jax.ensure_compile_time_eval():
        yield


def outside_replicas() -> contextlib.AbstractContextManager:
    """Computes its block's values concretely, also inside a compiled replica program: a
    variable a replica creates there gets concrete initial values."""
    return jax.ensure_compile_time_eval()


class _StepScope(StatelessScope):
    """A compiled custom step's scope over the values of its variables: it notes every other
    variable that the step reads or assigns (`unmapped`), which the step needs as state too."""

    def __init__(self, state_mapping: list):
        super().__init__(state_mapping=state_mapping)
        self.given = dict(self.state_mapping)
        self.unmapped: dict = {}

    def get_current_value(self, variable: Any) -> Any:
        value = super().get_current_value(variable)
        if value is None:
            self.unmapped[id(variable)] = variable
        return value

    def add_update(self, update: tuple) -> None:
        super().add_update(update)
        if id(update[0]) not in self.given:
            self.unmapped[id(update[0])] = update[0]


class CustomStepProgram:
    """A custom training step (`ks.function`) compiled as one program over the replicas' mesh.

    `body(blocks, replicated)` runs on every device (`shard_map`): `blocks`
    holds the device's own component of each per-replica argument (given as
    one list of components per argument, in replica order; a component of
    rank 0 comes as a block of one), `replicated` the arguments every replica
    shares. Components already on their replicas' devices are put together
    where they are, without a copy. It is traced statelessly over the values
    of the variables it reads and writes, as Keras' own JAX trainer traces
    its step; those variables are found by tracing (a first trace notes them,
    the program is traced again with them as its state). Their values stay on
    the mesh between calls: a variable still holding what the last call left
    needs no transfer. Variables read back on the first device, where eager
    code expects them. One program per `key` (the arguments' signature).
    """

    def __init__(self, devices: Sequence[str]):
        self._mesh = mesh = replicas.mesh_of(devices)
        self._on_mesh, self._split = NamedSharding(mesh, P()), NamedSharding(mesh, P(replicas.AXIS))
        self._first = mesh.devices.flat[0]
        self._programs: dict = {}  # key -> (variables, the jitted program)
        self._on_mesh_copies: dict = {}  # id(variable) -> (its value on the first device, that value on the mesh)
        self._repeated = _RepeatedArrays(largest=4096)  # the row masks, which the same shard sizes repeat

    def _traced(self, body: Callable, variables: list) -> tuple[Callable, list]:
        """The jitted program of `body` over `variables`, and the other variables its trace touched."""
        found: list = []

        def on_each_device(values, stacked, replicated):
            with _StepScope(list(zip(variables, values))) as scope:
                output = body(stacked, replicated)
            found[:] = list(scope.unmapped.values())
            new_values = [scope.state_mapping[id(v)] for v in variables]
            # Only what the step assigned comes back (None: an empty pytree, no output).
            return output, [None if new is scope.given[id(v)] else new for v, new in zip(variables, new_values)]

        program = jax.shard_map(on_each_device, mesh=self._mesh, in_specs=(P(), P(replicas.AXIS), P()),
                                out_specs=P(), check_vma=False)
        return jax.jit(program), found

    def prepare(self, body: Callable, key: Any, stacked: list, replicated: list, variables: Sequence[Any]) -> None:
        """Traces `body` for `key` (once): `variables` and those the traces find are its state."""
        if key in self._programs:
            return
        state = list(variables)
        for _ in range(4):  # a trace may create variables (an optimizer's), which the next one maps
            program, found = self._traced(body, state)
            program.trace(*self._placed(state, stacked, replicated))
            if not found:
                break
            state += [v for v in found if all(v is not s for s in state)]
        else:
            raise RuntimeError("The step kept touching new variables at every trace.")
        self._programs[key] = (state, program)

    def __call__(self, key: Any, stacked: list, replicated: list) -> Any:
        """The output of the program prepared for `key` on these arguments, its assignments made."""
        state, program = self._programs[key]
        direct = _direct()  # the arrays read and written directly where no scope intervenes
        values, stacked, replicated = self._placed(state, stacked, replicated, direct)
        output, new_values = replicas.dispatch(self._mesh, program, values, stacked, replicated)
        for variable, value in zip(state, new_values):
            if value is not None:
                own = self._own_copy(value)
                _write(variable, own, direct)
                self._on_mesh_copies[id(variable)] = (_read(variable, direct), value)
        return jax.tree_util.tree_map(self._own_copy, output)

    def _own_copy(self, value: jax.Array) -> jax.Array:
        """The first device's copy of a value replicated on the mesh (no transfer)."""
        if self._mesh.size == 1:  # the value is on that device already
            return value
        own = value.addressable_data(0)  # the mesh's order: the first device's
        return own if own.sharding.device_set == {self._first} else jax.device_put(value, self._first)

    def _split_over_mesh(self, components: list) -> Any:
        """The replicas' components as one array split over the mesh along its first axis: put
        together where they are when each is on its replica's device, else a host array."""
        first = components[0]
        if getattr(first, "ndim", 0) and all(
            isinstance(c, jax.Array) and c.shape == first.shape and c.sharding.device_set == {device}
            for c, device in zip(components, self._mesh.devices.flat)
        ):
            shape = (first.shape[0] * len(components),) + tuple(first.shape[1:])
            return jax.make_array_from_single_device_arrays(shape, self._split, list(components))
        arrays = [np.asarray(c) for c in components]
        return np.concatenate(arrays) if arrays[0].ndim else np.stack(arrays)

    def _in_place(self, value: Any) -> bool:
        """Whether a replicated argument is on every device of the mesh already (on a mesh of one
        device: on that device, as a one-device strategy's dataset places its batches)."""
        if not isinstance(value, jax.Array):
            return False
        return value.sharding == self._on_mesh or (self._mesh.size == 1 and value.sharding.device_set == {self._first})

    def _placed(self, state: list, per_replica: list, replicated: list, direct: bool = False) -> tuple:
        """The state's values, the per-replica arguments (split) and the replicated ones on the
        mesh: one transfer for what is not there yet (`direct`: see `__call__`)."""
        stacked = [self._split_over_mesh(components) for components in per_replica]
        values, moving = [], []
        for i, variable in enumerate(state):
            value = _read(variable, direct)
            kept = self._on_mesh_copies.get(id(variable))
            if kept is not None and kept[0] is value:
                value = kept[1]
            elif not _is_on(value, self._on_mesh):
                moving.append(i)
            values.append(value)
        on_host = [i for i, array in enumerate(stacked) if not isinstance(array, jax.Array)]
        host_arrays, splits = [stacked[i] for i in on_host], [self._split] * len(on_host)
        found, sending = self._repeated.lookup(host_arrays, splits)  # small ones sent before
        replicated = list(replicated)
        copying = [i for i, array in enumerate(replicated) if not self._in_place(array)]
        moved, sent, copied = [], [], []
        if moving or sending or copying:
            moved, sent, copied = jax.device_put(
                ([values[i] for i in moving], [host_arrays[j] for j in sending], [replicated[i] for i in copying]),
                (self._on_mesh, self._split, self._on_mesh),
            )
        self._repeated.keep(found, sending, host_arrays, splits, sent)
        for i, array in zip(on_host, found):
            stacked[i] = array
        for i, array in zip(copying, copied):
            replicated[i] = array
        for i, value in zip(moving, moved):
            self._on_mesh_copies[id(state[i])] = (values[i], value)  # read again next call: no transfer
            values[i] = value
        return values, stacked, replicated


def custom_step_program(devices: Sequence[str]) -> Optional[CustomStepProgram]:
    """What compiles a custom step over `devices` (`distribute/traced_function.py`)."""
    return CustomStepProgram(devices)

