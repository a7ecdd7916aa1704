"""This process's place in a multi-worker cluster, resolved once from a cluster resolver."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from keras_strategies.cluster_resolver import roles


@dataclass(frozen=True)
class WorkerCluster:
    """The training workers (chief first, then workers) and which one this process is.

    `worker_index` is TF's `id_in_cluster`: 0 for the chief (or worker 0 when
    there is no chief), so every engine uses it as its rank.
    """

    num_workers: int
    worker_index: int
    task_type: Optional[str]
    task_id: Optional[int]
    addresses: tuple  # by worker index
    names: tuple  # "chief 0", "worker 1", ... by worker index
    is_chief: bool
    cluster_spec: Any
    rpc_layer: Optional[str]

    @property
    def chief_address(self) -> str:
        return self.addresses[0]

    @property
    def local(self) -> bool:
        return self.num_workers == 1 and self.task_type is None

    def describe(self, worker_index: int) -> str:
        """`"worker 1 (127.0.0.1:2223)"`."""
        return f"{self.names[worker_index]} ({self.addresses[worker_index]})"


LOCAL_CLUSTER = WorkerCluster(1, 0, None, None, ("localhost",), ("local worker",), True, None, None)
"""One process on its own (a strategy without a cluster)."""

_joined: dict = {}  # the cluster this process joined ("cluster": WorkerCluster)


def joined_cluster() -> Optional[WorkerCluster]:
    """The cluster this process joined (through its engine's collectives), or None."""
    return _joined.get("cluster")


def set_joined_cluster(cluster: WorkerCluster) -> None:
    _joined["cluster"] = cluster


def resolve(resolver: Any) -> WorkerCluster:
    """Validates the resolver's cluster with TF's rules and orders the training workers."""
    spec = roles.normalize_cluster_spec(resolver.cluster_spec())
    task_type, task_id = resolver.task_type, resolver.task_id
    if spec and task_type == "evaluator":
        # A side-car outside the training cluster (TF's rules): as in TensorFlow, its strategy
        # runs alone on its own devices, as the chief of nothing, so the script the workers run
        # can build, load and evaluate models there unchanged.
        roles.validate_cluster_spec(spec, task_type, task_id)
        address = spec.task_address(task_type, int(task_id)) if task_type in spec.jobs else "localhost"
        name = f"evaluator {int(task_id)}"
        return WorkerCluster(1, 0, task_type, int(task_id), (address,), (name,), True, spec, None)
    if spec and task_type == "ps":
        roles.validate_cluster_spec(spec, task_type, task_id)
        raise ValueError(
            f"MultiWorkerMirroredStrategy runs on `chief` and `worker` tasks (and alone on an "
            f"evaluator); this task is {task_type!r} {task_id}. Start parameter servers with their own code."
        )
    spec = roles.validate_multi_worker_config(spec, task_type, task_id)
    if not spec:
        return LOCAL_CLUSTER
    task_id = int(task_id)
    jobs = [job for job in ("chief", "worker") if job in spec.jobs]
    addresses, names = [], []
    for job in jobs:
        for index in spec.task_indices(job):
            addresses.append(spec.task_address(job, index))
            names.append(f"{job} {index}")
    worker_index = roles.id_in_cluster(spec, task_type, task_id)
    return WorkerCluster(
        num_workers=len(addresses),
        worker_index=worker_index,
        task_type=task_type,
        task_id=task_id,
        addresses=tuple(addresses),
        names=tuple(names),
        is_chief=roles.is_chief(spec, task_type, task_id),
        cluster_spec=spec,
        rpc_layer=getattr(resolver, "rpc_layer", None),
    )
