"""Cross-worker collectives on JAX: `jax.distributed` with gloo CPU collectives.

Process id = the worker's index (chief 0); the chief's `TF_CONFIG` address
hosts the coordination service, whose key-value store carries our
heartbeats. A sum over workers is a jitted reduction over a mesh with one
device per process, which XLA lowers to a cross-process all-reduce.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import distributed, xla_bridge
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from keras_strategies.multi_worker import packing

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
        jax.distributed.initialize(
            coordinator_address=cluster.chief_address,
            num_processes=cluster.num_workers,
            process_id=cluster.worker_index,
            initialization_timeout=timeout,
            heartbeat_timeout_seconds=timeout,
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
        replicated=NamedSharding(mesh, P()),
        client=distributed.global_state.client,
    )


@functools.lru_cache(maxsize=None)
def _sum_program(replicated: Any) -> Any:
    return jax.jit(lambda stacked: jnp.sum(stacked, axis=0), out_shardings=replicated)


def _all_reduce_flat(flat: np.ndarray) -> np.ndarray:
    local = jax.device_put(flat[None], _state["device"])
    stacked = jax.make_array_from_single_device_arrays(
        (len(_state["mesh"].devices),) + flat.shape, _state["split"], [local]
    )
    total = _sum_program(_state["replicated"])(stacked)
    return np.asarray(total.addressable_data(0))


def tracing() -> bool:
    """True while JAX traces a function: host collectives cannot run there."""
    from jax._src import core

    return not core.trace_state_clean()


def all_reduce_sum(values: list) -> list:
    """Element-wise sums of `values` over all workers: one all-reduce per dtype (eager only)."""
    if tracing():
        raise NotImplementedError(
            "Cross-worker collectives cannot run inside a compiled JAX function: call them "
            "eagerly (a custom training loop on JAX runs `strategy.run` eagerly)."
        )
    return packing.packed_sum(
        [np.asarray(v) for v in values],
        lambda arrays: np.concatenate([a.reshape(-1) for a in arrays]),
        _all_reduce_flat,
        lambda piece, like: jnp.asarray(piece.reshape(like.shape)),
    )


def kv_set(key: str, value: str) -> None:
    _state["client"].key_value_set(key, value, allow_overwrite=True)


def kv_try_get(key: str) -> Optional[str]:
    try:
        return _state["client"].key_value_try_get(key)
    except Exception:  # noqa: BLE001 - jaxlib raises its own error type for a missing key
        return None


def shutdown() -> None:
    _state.clear()
