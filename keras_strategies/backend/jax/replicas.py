"""JAX replicas: one SPMD program over a device mesh (`jax.shard_map`).

Every replica runs the same traced function on its shard; `all_reduce` is
`jax.lax.psum` over the replica axis, JAX's own collective, differentiable
(XLA runs it with NCCL on GPUs).
SPMD needs equal shard shapes, so callers pad shards to the same size and
pass a mask (see `Capabilities.equal_shards`).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from keras.src import tree

from keras_strategies.backend.common import partition, replica_threads
from keras_strategies.backend.common.replica_variables import FIRST
from keras_strategies.backend.jax import nccl, shared_state
from keras_strategies.backend.jax.devices import device_of, device_scope, jax_device

AXIS = "replica"

_in_replica_program = {"active": False, "devices": 1}


def batch_leaf(value: Any) -> Any:
    """A leaf of a global batch, ready to be cut into shards: as it is.

    The engine's arrays are immutable, so their slices share no state.
    """
    return value


# A leaf of a global batch cut into its shards' rows (slices share the batch's memory).
split_rows = partition.row_slices


def _on_device_of(values: list, reference: Any) -> list:
    devices = jnp.asarray(reference).devices()
    if len(devices) != 1:
        return values
    (device,) = devices
    return [jax.device_put(v, device) for v in values]


def _own_gpus(per_replica: list) -> Optional[list]:
    """Each replica's GPU (`"gpu:<i>"`) when every replica's values sit on one GPU of its own and
    match the other replicas' in shape and dtype (what one NCCL all-reduce needs), else `None`."""
    names = []
    for values in per_replica:
        if not values or not all(isinstance(v, jax.Array) for v in values):
            return None
        found = {d for v in values for d in v.devices()}
        if len(found) != 1 or next(iter(found)).platform not in ("gpu", "cuda", "rocm"):
            return None
        names.append(device_of(values[0]))
    same = all(len({(v.shape, v.dtype) for v in leaf}) == 1 for leaf in zip(*per_replica))
    return names if same and len(set(names)) == len(names) else None


def _thread_sum(values: list) -> list:
    """Sums of `values` over the eager replica threads, each on the device of its own value: one
    XLA all-reduce (NCCL) when each replica has its own GPU (replica 0 runs it for all), else
    the copies added. Every replica sees the same exchanged values, so all take the same path."""
    per_replica = replica_threads.exchange(list(values))
    gpus = _own_gpus(per_replica)
    if gpus is not None:
        _, replica_id = replica_threads.current()
        leaves = [list(leaf) for leaf in zip(*per_replica)]
        sums = nccl.all_reduce_sum(leaves, gpus) if replica_id == 0 else None
        return [value_sums[replica_id] for value_sums in replica_threads.exchange(sums)[0]]
    totals = []
    for i, value in enumerate(values):
        parts = _on_device_of([replica[i] for replica in per_replica], value)
        total = parts[0]
        for part in parts[1:]:
            total = total + part
        totals.append(total)
    return totals


def _differentiated_eagerly(sum_over_replicas: Callable[[list], list], values: list) -> list:
    """`sum_over_replicas(values)` between eager replica threads, differentiable.

    Each replica thread differentiates its own function (`jax.value_and_grad`
    without `jit`), so the sum cannot exchange traced values: it runs as a
    `custom_vjp` whose forward and backward rules get concrete arrays and
    exchange those; the gradient is the same sum of the incoming gradients
    (`psum`'s rule). Synchronized BatchNormalization in JAX custom loops.
    """

    @jax.custom_vjp
    def total(*leaves):
        return tuple(sum_over_replicas(_concrete(leaves)))

    def backward(_, grads):
        return tuple(sum_over_replicas(_concrete(grads)))

    total.defvjp(lambda *leaves: (total(*leaves), None), backward)
    return list(total(*[jnp.asarray(v) for v in values]))


def _concrete(leaves: Sequence[Any]) -> list:
    if any(isinstance(leaf, jax.core.Tracer) for leaf in leaves):
        raise NotImplementedError(
            "A sum over replicas cannot run inside a function that JAX compiles or vectorises "
            "(jax.jit, jax.vmap) within strategy.run: replicas are threads that meet eagerly. "
            "Call the model eagerly inside strategy.run (ks.value_and_grad differentiates it)."
        )
    return list(leaves)


def _program_sums(values: list) -> list:
    """`psum` of `values` in one collective; the results are noted as the same on every device
    (inside a step compiled as a whole, `make_replicated` then gathers none of them)."""
    totals = _packed_psum(list(values))
    _in_replica_program["shared"].update(id(total) for total in totals)
    return totals


def _packed_psum(values: list) -> list:
    """`psum` of `values` as one collective, with the arrays of each dtype packed into one
    buffer on CPU devices.

    XLA's CPU runtime sums the operands of an all-reduce one after the other, each
    a meeting of the devices' threads; virtual CPU devices share the cores, so
    every meeting costs scheduling (one buffer: about 5% of a small MLP's step on
    4 devices). Elsewhere XLA combines the operands itself. Weakly typed values
    (Python numbers) are summed as they are, so they keep their type.
    """
    values = list(values)
    packable = [i for i, v in enumerate(values) if _packable(v)]
    if len(packable) < 2 or not _on_xla_cpu():
        return jax.lax.psum(values, AXIS)
    groups: dict = {}
    for i in packable:
        groups.setdefault(values[i].dtype, []).append(i)
    rest = sorted(set(range(len(values))) - set(packable))
    packs = [jnp.concatenate([jnp.ravel(values[i]) for i in members]) for members in groups.values()]
    summed_packs, summed_rest = jax.lax.psum((packs, [values[i] for i in rest]), AXIS)
    totals: list = [None] * len(values)
    for i, total in zip(rest, summed_rest):
        totals[i] = total
    for members, pack in zip(groups.values(), summed_packs):
        offset = 0
        for i in members:
            size = values[i].size
            totals[i] = pack[offset:offset + size].reshape(values[i].shape)
            offset += size
    return totals


def _on_xla_cpu() -> bool:
    """Whether replica programs run on XLA's CPU runtime, which the collectives above work around."""
    return jax.devices()[0].platform == "cpu"


_abstract = getattr(jax, "typeof", None) or jax.core.get_aval  # jax.typeof from JAX 0.4.38


def _packable(value: Any) -> bool:
    return (isinstance(value, (jax.Array, jax.core.Tracer)) and not _abstract(value).weak_type
            and value.size > 0)


def _gathered(value: Any, replica_id: Any, count: int) -> Any:
    """Every replica's `value`, stacked along a new first axis (inside a replica program).

    On CPU devices as a sum of blocks, each replica's own in zeros: XLA
    schedules a collective as early as its inputs allow, and an all-gather of
    a step's predictions came between the forward and the backward pass, where
    the devices, which share the cores, waited for the slowest once more. A sum
    joins the step's other sums at its end (XLA combines them). Adding zeros
    changes no value.
    """
    if not _on_xla_cpu() or not jnp.issubdtype(value.dtype, jnp.number):
        return jax.lax.all_gather(value, AXIS)
    blocks = jnp.zeros((count,) + tuple(value.shape), value.dtype)
    return jax.lax.psum(jax.lax.dynamic_update_index_in_dim(blocks, value, replica_id, 0), AXIS)


def all_reduce_sum(value: Any) -> Any:
    """Sum of `value` over the replicas: `psum` in a compiled program, an exchange between
    eager replica threads otherwise; differentiable in both."""
    if _in_replica_program["active"]:
        return _program_sums([value])[0]
    if replica_threads.current()[0] is None:
        return value
    return _differentiated_eagerly(_thread_sum, [value])[0]


class _HostSum:
    """Where the devices of a replica program meet to sum across workers, from a host callback.

    Each device's callback brings its replica's values; the last to arrive
    adds them in replica order, runs the cross-worker sum once, and every
    device returns the result. One object per call site in the program; it
    serves every execution of that program.
    """

    def __init__(self, devices: int, cross_worker: Callable[[list], list]):
        self._devices, self._cross_worker = devices, cross_worker
        self._condition = threading.Condition()
        self._arrived: dict = {}
        self._generation = 0
        self._outcome: Any = None

    def __call__(self, replica_id: Any, *leaves: Any) -> list:
        with self._condition:
            generation = self._generation
            self._arrived[int(replica_id)] = [np.asarray(leaf) for leaf in leaves]
            if len(self._arrived) == self._devices:
                per_replica = [self._arrived[i] for i in sorted(self._arrived)]
                self._arrived = {}
                try:
                    totals = self._cross_worker([sum(parts[1:], parts[0]) for parts in zip(*per_replica)])
                    self._outcome = [np.asarray(t).astype(l.dtype) for t, l in zip(totals, per_replica[0])]
                except BaseException as error:  # noqa: BLE001 - every device raises it
                    self._outcome = error
                self._generation += 1
                self._condition.notify_all()
            else:
                while self._generation == generation:
                    self._condition.wait()
            if isinstance(self._outcome, BaseException):
                raise self._outcome
            return self._outcome

    def run(self, leaves: Sequence[Any]) -> list:
        shapes = [jax.ShapeDtypeStruct(jnp.shape(leaf), jnp.result_type(leaf)) for leaf in leaves]
        # Ordered: every worker's program makes its cross-worker sums in the same order.
        return io_callback(self, shapes, jax.lax.axis_index(AXIS), *leaves, ordered=True)


def global_sum(values: list, across_workers: Callable[[list], list], over_all_replicas: Callable[[list], list]) -> list:
    """Sums of `values` over every replica of every worker (inside a replica function).

    In a compiled replica program the local devices meet in a host callback
    that runs `across_workers(arrays)` (a sum over the workers, eager), and
    the sum is differentiable: its gradient is the same global sum of the
    incoming gradients (synchronized BatchNormalization across workers).
    Between eager replica threads it is the strategy's
    `over_all_replicas(arrays)`, given the same gradient rule.
    """
    if not _in_replica_program["active"]:
        return _differentiated_eagerly(over_all_replicas, values)
    forward = _HostSum(_in_replica_program["devices"], across_workers)
    backward = _HostSum(_in_replica_program["devices"], across_workers)

    @jax.custom_vjp
    def total(*leaves):
        return forward.run(leaves)

    total.defvjp(lambda *leaves: (forward.run(leaves), None), lambda _, grads: tuple(backward.run(grads)))
    return list(total(*[jnp.asarray(v) for v in values]))


def all_reduce_sums(values: list) -> list:
    """`all_reduce_sum` of each of `values` (one collective in a compiled program)."""
    if _in_replica_program["active"]:
        return _program_sums(values)
    return [all_reduce_sum(value) for value in values]


def all_gather(value: Any, axis: int) -> Any:
    """`value` of every replica concatenated along `axis` (equal shapes in a compiled program)."""
    if _in_replica_program["active"]:
        return jax.lax.all_gather(value, AXIS, axis=axis, tiled=True)
    values = _on_device_of(replica_threads.exchange(jnp.asarray(value)), value)
    return jnp.concatenate(values, axis=axis)


def merge_call(fn: Callable[[list], Any], value: Any) -> Any:
    """`fn(values of every replica)` once, its result returned to every replica.

    Between eager replica threads one replica runs it. In a compiled replica
    program every device runs it on the replicas' values gathered (the same
    on every device), so each gets the same result, as each applies the same
    update to its own copy of the state.
    """
    if _in_replica_program["active"]:
        count = _in_replica_program["devices"]

        def of_each_replica(leaf: Any) -> list:
            if not isinstance(leaf, (jax.Array, jax.core.Tracer)):
                return [leaf] * count
            gathered = jax.lax.all_gather(leaf, AXIS)
            return [gathered[i] for i in range(count)]

        per_leaf = [of_each_replica(leaf) for leaf in tree.flatten(value)]
        return fn([tree.pack_sequence_as(value, [copies[i] for copies in per_leaf]) for i in range(count)])
    return replica_threads.merge_call(fn, value)


def combine_writes_in_program(items: list) -> list:
    """Every replica's `(variable, kind, value, weight)` writes combined, inside a compiled replica
    program: changes and weighted values summed, weights summed, FIRST values taken from replica 0."""
    if not items:
        return items
    summed = [i for i, (_, kind, _, _) in enumerate(items) if kind != FIRST]
    weights = jnp.stack([jnp.asarray(weight, "float32") for *_, weight in items])
    *totals, weights = _packed_psum([items[i][2] for i in summed] + [weights])
    values = [None] * len(items)
    for i, total in zip(summed, totals):
        values[i] = total
    for i, (_, kind, value, _) in enumerate(items):
        if kind == FIRST:
            values[i] = jax.lax.all_gather(value, AXIS)[0]
    return [(variable, kind, values[i], weights[i]) for i, (variable, kind, _, _) in enumerate(items)]


def replica_view(value: Any, device: str) -> jax.Array:
    """A primary variable's value as a replica reads it: on the replica's device (computations follow their inputs)."""
    return jax.device_put(value, jax_device(device))


def onto(value: Any, like: Any) -> jax.Array:
    """`value` on the device of `like`."""
    return jax.device_put(value, next(iter(like.devices())))


def replica_device_scope(replica_id: Any, devices: Sequence[str]) -> contextlib.AbstractContextManager:
    """Where Keras creates a replica's tensors in a replicated step: nothing to set.

    JAX places computations with their inputs (and a compiled program's with its mesh).
    """
    return contextlib.nullcontext()


def make_replicated(fn: Callable, devices: Sequence[str], compiled: bool, variables: Sequence[Any] = ()) -> Callable:
    """`run(shared, per_replica)` calls `fn(replica_id, *shared, *per_replica[i])` on every replica.

    Compiled: one jitted SPMD program; `shared` is replicated on the mesh and
    `per_replica` entries must have equal shapes. Eager: replica threads (any
    Python code, any shapes). Results come back as one entry per replica.
    `variables` matters to engines whose replicas share per-variable state (torch's `.grad`).
    """
    if not compiled:
        def run_eagerly(shared: tuple, per_replica: Sequence[tuple]) -> list:
            if len(devices) == 1:
                with device_scope(devices[0]):
                    return [fn(0, *shared, *per_replica[0])]
            # Each replica reads the shared state on its own device, as in a compiled program:
            # computations follow committed inputs, and the replica's sums live on its device.
            return replica_threads.run(
                lambda i: fn(i, *jax.device_put(tuple(shared), jax_device(devices[i])), *per_replica[i]),
                len(devices), lambda i: device_scope(devices[i]),
            )

        return run_eagerly
    mesh = mesh_of(devices)
    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P(AXIS))

    # Each device's block of an output is its replica's value as it is, so that reading it back
    # takes no indexing op per value (one dispatch each, a third of a small step's host time);
    # scalars get an axis, which flags recorded when the program is traced take off again (by the
    # outputs' global shapes: a program traced for several shapes keeps one set per trace).
    scalar_flags: dict = {}
    count = len(devices)

    def run_own_replica(shared, stacked) -> tuple:
        """This device's replica of `fn` on its block of `stacked`; and the ids of its outputs that
        the replica sum left the same on every device (`_program_sums`)."""
        own = tree.map_structure(lambda leaf: None if leaf is None else leaf[0], stacked)
        _in_replica_program.update(active=True, devices=count, shared=set())
        replica_id = jax.lax.axis_index(AXIS)
        try:
            outputs = fn(replica_id, *shared, *own)
        finally:
            _in_replica_program["active"] = False
            shared_ids = _in_replica_program.pop("shared")
        return outputs, shared_ids, replica_id

    def body(layout, treedef, buffers, stacked):
        shared = jax.tree_util.tree_unflatten(treedef, shared_state.unpack(buffers, layout))
        outputs, _, _ = run_own_replica(shared, stacked)
        leaves = tree.flatten(outputs)
        scalars = [leaf is not None and jnp.ndim(leaf) == 0 for leaf in leaves]
        blocks = [jnp.expand_dims(leaf, 0) if scalar else leaf for leaf, scalar in zip(leaves, scalars)]
        global_shapes = tuple(
            None if block is None else (jnp.shape(block)[0] * count,) + tuple(jnp.shape(block)[1:]) for block in blocks
        )
        scalar_flags[global_shapes] = scalars
        return tree.pack_sequence_as(outputs, blocks)

    programs: dict = {}  # (layout, treedef) of the shared state -> its program

    def program_for(layout: tuple, treedef: Any) -> Callable:
        if (layout, treedef) not in programs:
            traced = functools.partial(body, layout, treedef)
            program = jax.shard_map(traced, mesh=mesh, in_specs=(P(), P(AXIS)), out_specs=P(AXIS), check_vma=False)
            programs[layout, treedef] = jax.jit(program)
        return programs[layout, treedef]

    def scalars_of(leaves: list) -> list:
        return scalar_flags[tuple(None if leaf is None else tuple(leaf.shape) for leaf in leaves)]

    def run_in_step(shared: tuple, shards: StackedShards) -> list:
        # Inside a step compiled as a whole (`compiler.compile_replicated_step`), which runs on
        # each device of the mesh: this device's replica runs inline, and each output is given to
        # every replica's entry as the replica sum left it (the same on every device) or gathered.
        outputs, shared_ids, replica_id = run_own_replica(shared, shards.stacked)
        per_replica: list = [[] for _ in devices]
        for leaf in tree.flatten(outputs):
            if not isinstance(leaf, (jax.Array, jax.core.Tracer)) or id(leaf) in shared_ids:
                copies = [leaf] * count
            else:
                everyone = _gathered(leaf, replica_id, count)
                copies = [everyone[i] for i in range(count)]
            for values, copy in zip(per_replica, copies):
                values.append(copy)
        return [tree.pack_sequence_as(outputs, values) for values in per_replica]

    host = mesh.devices.flat[0]

    def run(shared: tuple, per_replica: Sequence[tuple]) -> list:
        if isinstance(per_replica, StackedShards):
            return run_in_step(shared, per_replica)
        stacked = stack(per_replica)
        leaves, treedef = jax.tree_util.tree_flatten(tuple(shared))
        layout = shared_state.layout_of(leaves)
        # One transfer for the batch and the state: a `device_put` per array costs a dispatch each.
        buffers, stacked = jax.device_put((shared_state.pack(leaves, layout, host), tuple(stacked)), (replicated, split))
        outputs = dispatch(mesh, program_for(layout, treedef), buffers, stacked)
        leaves = tree.flatten(outputs)
        per_replica: list = [[] for _ in devices]
        for leaf, scalar in zip(leaves, scalars_of(leaves)):
            blocks = {} if leaf is None else {shard.device: shard.data for shard in leaf.addressable_shards}
            for values, device in zip(per_replica, mesh.devices.flat):
                value = blocks.get(device)
                values.append(value.reshape(()) if scalar and value is not None else value)
        return [tree.pack_sequence_as(outputs, values) for values in per_replica]

    return run


# XLA's CPU runtime can deadlock when several programs with collectives over the same devices
# are in flight at once (the devices' threads wait in the rendezvous of different programs; seen
# with 4 virtual devices on 2 cores, also under `keras.distribution.DataParallel`). On CPU
# devices a replica program is therefore dispatched once the previous one has finished (the next
# one's inputs are prepared while it runs); accelerators queue programs as usual.
_in_flight: list = []


def dispatch(mesh: Mesh, program: Callable, *args: Any) -> Any:
    """`program(*args)` over `mesh`, one at a time on CPU devices (see `_in_flight`)."""
    if _in_flight:
        jax.block_until_ready(_in_flight.pop())
    outputs = program(*args)
    if all(device.platform == "cpu" for device in mesh.devices.flat):
        _in_flight.append(outputs)
    return outputs


def mesh_of(devices: Sequence[str]) -> Mesh:
    """The one-axis mesh of the replicas' devices (meshes of the same devices are equal)."""
    return Mesh(np.array([jax_device(d) for d in devices]), (AXIS,))


def stack(per_replica: Sequence[tuple]) -> tuple:
    """The replicas' arguments stacked on a new leading axis, one NumPy array per leaf."""
    return tree.map_structure(
        lambda *leaves: None if leaves[0] is None else np.stack([np.asarray(l) for l in leaves]), *per_replica
    )


class StackedShards:
    """This device's replica arguments inside a step compiled as a whole, as a block of the stack
    of every replica's (leading axis 1); a replicated function given it runs that replica inline."""

    def __init__(self, stacked: tuple):
        self.stacked = stacked
