"""Cross-worker collectives on JAX: `jax.distributed` with gloo CPU collectives.

Process id = the worker's index (chief 0); the chief's `TF_CONFIG` address
hosts the coordination service, whose key-value store carries our
heartbeats. A sum over workers is one compiled `psum` over a mesh with one
device per process, which XLA lowers to a cross-process all-reduce.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import array as jax_array
from jax._src import core, distributed, xla_bridge
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from keras_strategies.backend.common import loopback, packing, pending, timeouts
from keras_strategies.backend.jax import coordination_service

_state: dict = {}


def initialize(cluster: Any, options: Any) -> None:
    """Joins the cluster (blocks until every worker has connected, up to the timeout)."""
    if distributed.global_state.client is None:
        if xla_bridge.backends_are_initialized():
            raise RuntimeError(
                "Create ks.MultiWorkerMirroredStrategy at program startup, before any JAX "
                "operation runs: jax.distributed must initialise before JAX's devices."
            )
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        timeout = int(max(options.effective_timeout, 10))
        with coordination_service.in_own_process(distributed, cluster.worker_index == 0):
            jax.distributed.initialize(
                coordinator_address=cluster.chief_address,
                num_processes=cluster.num_workers,
                process_id=cluster.worker_index,
                initialization_timeout=int(timeout + timeouts.ENGINE_MARGIN_SECONDS),
                # JAX's own heartbeats abort the process (a C++ check failure) when a peer stops; ours
                # (multi_worker/health.py) name it first, with a clear error.
                heartbeat_timeout_seconds=int(timeout + timeouts.ENGINE_MARGIN_SECONDS),
                # The coordinator listens on every interface unless told; a cluster on loopback keeps it there.
                coordinator_bind_address=cluster.chief_address if loopback.all_loopback(cluster.addresses) else None,
            )
    first_of_each = {}
    for device in sorted(jax.devices(), key=lambda d: (d.process_index, d.id)):
        first_of_each.setdefault(device.process_index, device)
    devices = [first_of_each[i] for i in sorted(first_of_each)]
    mesh = Mesh(np.array(devices), ("workers",))
    _state.update(
        mesh=mesh,
        device=first_of_each[jax.process_index()],
        split=NamedSharding(mesh, P("workers")),
        client=distributed.global_state.client,
    )


def tracing() -> bool:
    """True while JAX traces a function: host collectives cannot run there."""
    return not core.trace_state_clean()


def _sum_program(shapes: tuple, dtypes: tuple) -> Callable:
    """A compiled sum over workers of blocks with these local shapes (cached per signature).

    Inside one program: large blocks are reduced as they are, small ones are
    packed per dtype first, all in one (tuple) all-reduce; the outputs are
    replicated, so each worker's result is a local buffer (no host round trip).
    """
    key = (shapes, dtypes)
    programs = _state.setdefault("programs", {})
    if key in programs:
        return programs[key]
    nbytes = [int(np.prod(shape)) * np.dtype(dtype).itemsize for shape, dtype in zip(shapes, dtypes)]
    alone, groups = packing.plan(dtypes, nbytes, [True] * len(shapes))

    def reduce(*blocks):
        blocks = [jnp.reshape(b, shape) for b, shape in zip(blocks, shapes)]
        packs = [jnp.concatenate([jnp.ravel(blocks[i]) for i in group]) for group in groups]
        summed = jax.lax.psum([blocks[i] for i in alone] + packs, "workers")
        outputs: list = [None] * len(blocks)
        for i, total in zip(alone, summed):
            outputs[i] = total
        for group, total in zip(groups, summed[len(alone):]):
            offset = 0
            for i in group:
                size = int(np.prod(shapes[i]))
                outputs[i] = jnp.reshape(total[offset:offset + size], shapes[i])
                offset += size
        return outputs

    program = jax.jit(jax.shard_map(reduce, mesh=_state["mesh"], in_specs=P("workers"), out_specs=P(),
                                    check_vma=False))
    programs[key] = program
    return program


def _worker_block(block: jax.Array) -> jax.Array:
    """`block` as this worker's block of a global array split over the workers (no copy).

    What `jax.make_array_from_single_device_arrays` does, without its checks
    and with the abstract value cached per shape: for ten gradients that
    function took ~0.3 ms on a loaded 2-core machine, a tenth of a whole 1 MB
    all-reduce. Falls back to it if JAX's internals change.
    """
    key = (block.shape, block.dtype)
    avals = _state.setdefault("avals", {})
    aval = avals.get(key)
    split = _state["split"]
    global_shape = (len(_state["mesh"].devices) * block.shape[0],) + tuple(block.shape[1:])
    try:
        if aval is None:
            aval = avals[key] = core.update_aval_with_sharding(core.ShapedArray(global_shape, block.dtype), split)
        return jax_array.ArrayImpl(aval, split, [block], committed=True, _skip_checks=True)
    except (AttributeError, TypeError):
        return jax.make_array_from_single_device_arrays(global_shape, split, [block])


def all_reduce_sum(values: list, donated: Any = False) -> list:
    """Element-wise sums of `values` over all workers: one compiled all-reduce (eager only).

    Each worker's arrays become its blocks of global arrays without a copy.
    `donated` is accepted for the engines' common interface: JAX arrays are
    immutable, and the program writes its own outputs.
    """
    return _run_across_workers(_sum_program, values)


def _run_across_workers(make_program: Callable, values: list) -> list:
    """`make_program(shapes, dtypes)` run on `values` as this worker's blocks (eager only)."""
    if tracing():
        raise NotImplementedError(
            "Cross-worker collectives cannot run inside a compiled JAX function: call them "
            "eagerly (a custom training loop on JAX runs `strategy.run` eagerly)."
        )
    device = _state["device"]
    local = [v if isinstance(v, jax.Array) and v.devices() == {device} else jax.device_put(v, device) for v in values]
    shapes = tuple(tuple(a.shape) for a in local)
    global_arrays = [_worker_block(a if a.ndim else jnp.reshape(a, (1,))) for a in local]
    program = make_program(shapes, tuple(a.dtype for a in local))
    # Wait for the result: the CPU runtime may run independent programs concurrently, and
    # collectives must run in the same order on every worker (and the watchdog must see them).
    return jax.block_until_ready([out.addressable_data(0) for out in program(*global_arrays)])


def _gather_program(shapes: tuple, dtypes: tuple) -> Callable:
    """A compiled all-gather over workers of blocks with these local shapes (cached per signature):
    each output `(num_workers, *shape)`, replicated."""
    key = ("gather", shapes, dtypes)
    programs = _state.setdefault("programs", {})
    if key not in programs:
        def gather(*blocks):
            return [jax.lax.all_gather(jnp.reshape(b, shape), "workers") for b, shape in zip(blocks, shapes)]

        programs[key] = jax.jit(jax.shard_map(gather, mesh=_state["mesh"], in_specs=P("workers"), out_specs=P(),
                                              check_vma=False))
    return programs[key]


def all_gather(values: list) -> list:
    """Each of `values` from every worker, stacked in worker order: `(num_workers, *shape)`; one
    compiled all-gather (eager only, as `all_reduce_sum`)."""
    return _run_across_workers(_gather_program, values)


def _scatter_program(shapes: tuple, dtypes: tuple) -> Callable:
    """A compiled reduce-scatter over workers of blocks `(num_workers, *shape)` (cached per
    signature): each worker's output block `(1, *shape)`, the sum of every worker's row w."""
    key = ("scatter", shapes, dtypes)
    programs = _state.setdefault("programs", {})
    if key not in programs:
        def scatter(*blocks):
            return [jax.lax.psum_scatter(b, "workers", scatter_dimension=0, tiled=True) for b in blocks]

        programs[key] = jax.jit(jax.shard_map(scatter, mesh=_state["mesh"], in_specs=P("workers"),
                                              out_specs=P("workers"), check_vma=False))
    return programs[key]


def reduce_scatter_sum(values: list) -> list:
    """This worker's row of each of `values` (`(num_workers, *shape)`), summed over the workers;
    one compiled reduce-scatter (eager only, as `all_reduce_sum`)."""
    rows = _run_across_workers(_scatter_program, values)
    return [jnp.reshape(row, tuple(jnp.shape(value))[1:]) for row, value in zip(rows, values)]


def start_all_reduce_sum(values: list, donated: Any = False) -> pending.Finished:
    """`all_reduce_sum(values, donated)` as a pending result (the engines' common interface).

    JAX runs it at once: its cross-worker sum is a compiled program that the
    CPU runtime must finish before the next collective (see `all_reduce_sum`).
    """
    return pending.Finished(all_reduce_sum(values, donated))


def kv_set(key: str, value: str) -> None:
    _state["client"].key_value_set(key, value, allow_overwrite=True)


def kv_try_get(key: str) -> Optional[str]:
    try:
        return _state["client"].key_value_try_get(key)
    except Exception:  # noqa: BLE001 - jaxlib raises its own error type for a missing key
        return None


def shutdown() -> None:
    _state.clear()
