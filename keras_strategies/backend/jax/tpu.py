"""JAX's TPU runtime: the TPU chips JAX sees on this host (`jax.devices("tpu")`).

JAX runs on a Cloud TPU VM's own chips; it has no client for TensorFlow's
remote TPU nodes (a TPU name or a `grpc://` address), so those are refused
with a clear error. The messages without a TPU are TensorFlow's own.

On a TPU slice of several hosts, every host runs the same program, and
Cloud TPU's environment names the hosts (`TPU_WORKER_HOSTNAMES`) and this
one (`TPU_WORKER_ID`), as JAX's own `jax.distributed.initialize()` reads it:
the strategy joins them as the workers of one cluster (`hosts`).
"""

from __future__ import annotations

import os
from typing import Any, Optional

import jax

from keras_strategies.backend.jax import devices as jax_devices

# The port of the cluster's coordinator on the first host when Cloud TPU's host names carry none:
# JAX's own choice on Cloud TPU (jax._src.clusters.cloud_tpu_cluster.coordinator_port).
COORDINATOR_PORT = 8482
NO_TPU_NAME = "Please provide a TPU Name to connect to."
NOT_FOUND = "TPUs not found in the cluster."


def check_runtime() -> None:
    """JAX has a TPU runtime (`jax[tpu]`): nothing to refuse."""


def _local_tpus() -> list[str]:
    return [name for name in jax_devices.list_devices() if name.startswith("tpu:")]


def resolve(tpu: Optional[str], **_: Any) -> dict:
    """What a `TPUClusterResolver(tpu=...)` names, as `{"master": ..., "local": True}`.

    No name (or `TPU_NAME`) means the chips of this TPU VM; `"local"` means the same.
    """
    name = tpu if tpu else os.environ.get("TPU_NAME", "")
    if name in ("", "local"):
        addresses, index = hosts(None)
        if addresses:  # several hosts: JAX's devices wait until they have joined (TPUStrategy)
            return {"master": "", "local": True, "hosts": addresses, "index": index}
        if not name and not _local_tpus():
            raise ValueError(
                f"{NO_TPU_NAME} JAX sees no TPU on this machine (its devices: "
                f"{jax_devices.list_devices()}); on a Cloud TPU VM, install `jax[tpu]`."
            )
        return {"master": "", "local": True}
    raise ValueError(
        f"JAX cannot connect to the TPU {name!r}: it runs on the chips of the TPU VM it runs on, "
        "not on a remote TPU node. Run the program on the TPU VM with "
        "`ks.cluster_resolver.TPUClusterResolver(tpu='local')` (or no name)."
    )


def master(handle: Any) -> str:
    return handle["master"]


def cluster_spec(handle: Any) -> dict:
    """The slice's hosts as workers; one host, no remote jobs: an empty cluster, as TensorFlow's
    resolver for `tpu='local'`."""
    addresses, _ = hosts(handle)
    return {"worker": addresses} if addresses else {}


def hosts(handle: Any) -> tuple[list, int]:
    """The hosts of this TPU slice (`host:port`, in Cloud TPU's order) and this host's index in
    them, from Cloud TPU's environment (`TPU_WORKER_HOSTNAMES`, `TPU_WORKER_ID`); `([], 0)` on
    one host. A name without a port gets `COORDINATOR_PORT`."""
    if isinstance(handle, dict) and "hosts" in handle:
        return list(handle["hosts"]), int(handle["index"])
    names = [n.strip() for n in os.environ.get("TPU_WORKER_HOSTNAMES", "").split(",") if n.strip()]
    if len(names) < 2:
        return [], 0
    index = os.environ.get("TPU_WORKER_ID", "")
    if not index.isdigit() or int(index) >= len(names):
        raise ValueError(
            f"TPU_WORKER_HOSTNAMES names {len(names)} hosts, but TPU_WORKER_ID is {index!r}: set it to this "
            f"host's index among them (0 to {len(names) - 1}), as Cloud TPU does."
        )
    return [n if ":" in n else f"{n}:{COORDINATOR_PORT}" for n in names], int(index)


def num_accelerators(handle: Any) -> dict:
    count = len(_local_tpus())
    return {"TPU": count} if count else {}


def connect_to_cluster(handle: Any) -> None:
    """Nothing to connect: the chips of this host are JAX's local devices."""


def _found_tpus() -> list[str]:
    """This host's TPU devices; TensorFlow's error when there are none."""
    found = _local_tpus()
    if not found:
        raise RuntimeError(
            f"{NOT_FOUND} JAX sees no TPU device on this machine (its devices: {jax_devices.list_devices()}); "
            "on a Cloud TPU VM, install `jax[tpu]`."
        )
    return found


def initialize_tpu_system(handle: Any) -> Any:
    """Checks that JAX sees TPU chips (JAX initialises them itself)."""
    _found_tpus()
    return None


def replica_devices(handle: Any, device_assignment: Any, spmd: bool) -> list[str]:
    """The TPU cores the replicas run on: every TPU device of this host, in JAX's order."""
    if device_assignment is not None or spmd:
        raise NotImplementedError(
            "TPUStrategy on JAX takes no device assignment and no SPMD partitioning: each TPU "
            "core of this host runs one replica."
        )
    if jax.process_count() > 1 and not hosts(handle)[0]:
        raise RuntimeError(
            f"This program runs in {jax.process_count()} processes (jax.distributed), but Cloud TPU's "
            "environment names no hosts: set TPU_WORKER_HOSTNAMES (every host, in order) and "
            "TPU_WORKER_ID (this host's index), as on a Cloud TPU slice, so that TPUStrategy "
            "can join them."
        )
    return _found_tpus()

