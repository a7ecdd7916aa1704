"""JAX compilation: `jax.jit`; the replica's committed inputs decide the device."""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Optional, Sequence

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from keras_strategies.backend.jax import replicas
from keras_strategies.backend.jax.devices import jax_device


def compile_function(fn: Callable) -> Callable:
    return jax.jit(fn)


def compile_step(fn: Callable) -> Callable:
    """A user's distributed step runs eagerly: it updates stateful Keras variables,
    which `jax.jit` cannot trace (Keras' fit uses stateless steps instead)."""
    return fn


def compile_stateful(fn: Callable, state_variables: Sequence[Any]) -> Callable:
    """Compiles `fn`, which updates `state_variables` (e.g. metric state), as Keras' JAX
    trainer does: run statelessly under `jax.jit`, then assign the new values."""
    from keras.src.backend.common.stateless_scope import StatelessScope

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
                            keep_copies: bool, finish: Optional[Callable[[list], None]]) -> Callable:
    """A whole train or test step around the replica program as one jitted program over the
    replicas' mesh, whose `variables` stay on the mesh between steps.

    `fn(per_replica, batch, sizes)` runs the replicas (`make_replicated`), the
    optimizer update and the metric update. It is traced statelessly over the
    values of `variables`, as Keras' own JAX trainer traces its step, and runs
    on every device of the mesh (`shard_map`): each device runs its replica,
    the replica sum (`psum`) gives every device the same gradients, and each
    device applies the same update and metric update to its copy of the state,
    as under `keras.distribution.DataParallel`. The values the step assigns
    are written back afterwards, still on every device, so the next step sends
    no state: only the batch travels. `settle` brings the variables back to one
    device when a loop ends. One trace per batch shape and shard sizes.

    A train step's `fn` returns `(logs, the non-trainable values of each replica
    with rows)`; `finish(those values)` assigns them inside a group of steps
    (`call.group`, below), where the caller assigns them after a single step.
    A test step's returns its logs (`finish` is None).

    Without `keep_copies` (CentralStorage: one copy of each variable, updated
    once on its device) `fn` runs as it is: its replica program, its update
    and its metric update are jitted each on their own.
    """
    from keras.src.backend.common.stateless_scope import StatelessScope

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

    def values_on_mesh(state: list, send: Any, sharding: Any) -> tuple:
        """The state's values on the mesh, and `send` placed with `sharding`: one transfer."""
        values = [v.value for v in state]
        moving = [i for i, value in enumerate(values) if not _is_on(value, on_mesh)]
        moved, sent = jax.device_put(([values[i] for i in moving], send), (on_mesh, sharding))
        for i, value in zip(moving, moved):
            values[i] = value
        return values, sent

    def call(per_replica: Any, batch: tuple, sizes: tuple) -> Any:
        # One transfer for the batch, the shards and whatever state is not on the mesh yet.
        values, (stacked, batch) = values_on_mesh(variables, (replicas.stack(per_replica), tuple(batch)),
                                                  (split, on_mesh))
        program = program_for(on_each_device, tuple(sizes), P(replicas.AXIS))
        output, new_values = replicas.dispatch(mesh, program, values, stacked, batch)
        for variable, value in zip(variables, new_values):
            if value is not None:
                variable.assign(value)
        return output

    def group(steps: Sequence[tuple]) -> Any:
        """`steps` (each `(per_replica, batch, sizes)`, all of one signature) as one program:
        the logs after the last step."""
        stacked = replicas.stack([replicas.stack(per_replica) for per_replica, _, _ in steps])
        batches = replicas.stack([tuple(batch) for _, batch, _ in steps])
        stacked_spec = P(None, replicas.AXIS)
        values, (stacked, batches) = values_on_mesh(variables, (stacked, batches),
                                                    (NamedSharding(mesh, stacked_spec), on_mesh))
        program = program_for(group_on_each_device, tuple(steps[0][2]), stacked_spec)
        logs, final = replicas.dispatch(mesh, program, values, stacked, batches)
        for variable, value in zip(variables, final):
            variable.assign(value)
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


def _is_on(value: Any, sharding: Any) -> bool:
    return isinstance(value, jax.Array) and value.sharding == sharding


def outside_compiled() -> contextlib.AbstractContextManager:
    """Nothing to leave: a user's step runs eagerly here (see `compile_step`)."""
    return contextlib.nullcontext()


def outside_replicas() -> contextlib.AbstractContextManager:
    """Nothing to leave: replicas here run eagerly and create plain variables."""
    return contextlib.nullcontext()
