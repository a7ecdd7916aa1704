"""Roles in a multi-worker cluster: validation, chief, worker ids and leaders.

A port of TensorFlow's `tensorflow/python/distribute/multi_worker_util.py`
with the same rules and error texts, so multi-worker strategies on every
backend accept and reject the same `TF_CONFIG` clusters as TensorFlow.
"""

from __future__ import annotations

from typing import Any

from keras_strategies.cluster_resolver.cluster_spec import ClusterSpec

ALLOWED_TASK_TYPES = ("chief", "worker", "evaluator", "ps", None)


def normalize_cluster_spec(cluster_spec: Any) -> ClusterSpec:
    """Turns a dict (or a real `tf.train.ClusterSpec`/`ClusterDef`) into a `ClusterSpec`."""
    if isinstance(cluster_spec, ClusterSpec):
        return cluster_spec
    foreign = hasattr(cluster_spec, "as_cluster_def") or hasattr(cluster_spec, "job")
    if isinstance(cluster_spec, dict) or foreign:
        return ClusterSpec(cluster_spec)
    raise ValueError(
        "`cluster_spec' should be dict or a `tf.train.ClusterSpec` or a "
        f"`tf.train.ClusterDef` object, got {cluster_spec!r}"
    )


def task_count(cluster_spec: Any, task_type: str | None) -> int:
    """Number of `task_type` tasks, 0 when the job is absent."""
    try:
        return normalize_cluster_spec(cluster_spec).num_tasks(task_type)
    except ValueError:
        return 0


def validate_cluster_spec(cluster_spec: Any, task_type: str | None, task_id: int | None) -> None:
    """Raises ValueError, with TF's texts, for a cluster MWMS/PSS would reject.

    Checks: only chief/worker/evaluator/ps jobs; a known `task_type` present in
    the cluster (an evaluator may be absent); at most one chief and one
    evaluator; `task_id` below the number of tasks of `task_type`.
    """
    spec = normalize_cluster_spec(cluster_spec)

    if any(job not in ALLOWED_TASK_TYPES for job in spec.jobs):
        raise ValueError(
            "Disallowed task type found in cluster spec. Allowed types are "
            f"{ALLOWED_TASK_TYPES} and the cluster spec is {spec}."
        )
    if task_type not in ALLOWED_TASK_TYPES:
        raise ValueError(
            f"Unrecognized task_type: {task_type}, valid task types are: "
            f"{ALLOWED_TASK_TYPES}"
        )
    if task_type and task_type not in spec.jobs and task_type != "evaluator":
        raise ValueError("`task_type` %r not found in cluster_spec." % task_type)
    if task_count(spec, "chief") > 1:
        raise ValueError("There must be at most one 'chief' job.")
    if task_count(spec, "evaluator") > 1:
        raise ValueError("There must be at most one 'evaluator' job.")
    if task_type in spec.jobs and task_id >= task_count(spec, task_type):
        raise ValueError(
            "The `task_id` %d exceeds the maximum id of %s." % (task_id, task_type)
        )


def is_chief(cluster_spec: Any, task_type: str | None, task_id: int | None) -> bool:
    """Whether this task does the chief's extra work (checkpoints, summaries).

    The chief and the (stand-alone) evaluator are chiefs; worker 0 is chief
    only when the cluster has no `chief` job.
    """
    validate_cluster_spec(cluster_spec, task_type, task_id)
    spec = normalize_cluster_spec(cluster_spec)
    if task_type in ("chief", "evaluator"):
        return True
    return "chief" not in spec.jobs and task_type == "worker" and task_id == 0


def worker_count(cluster_spec: Any, task_type: str | None) -> int:
    """Workers in this task's training cluster: #chief + #worker, or #evaluator."""
    validate_cluster_spec(cluster_spec, task_type, task_id=0)
    spec = normalize_cluster_spec(cluster_spec)
    if task_type not in ("chief", "worker", "evaluator"):
        raise ValueError("Unexpected `task_type` %r" % task_type)
    if task_type == "evaluator":
        # The evaluator is its own cluster; TF raises KeyError when it is absent.
        return task_count(spec, "evaluator")
    return task_count(spec, "chief") + task_count(spec, "worker")


def id_in_cluster(cluster_spec: Any, task_type: str | None, task_id: int | None) -> int:
    """A unique id in `[0, worker_count)`: chief 0, worker i -> i + #chief, evaluator i."""
    validate_cluster_spec(cluster_spec, task_type, task_id)
    spec = normalize_cluster_spec(cluster_spec)
    if task_type == "chief":
        return 0
    if task_type == "worker":
        return task_id + task_count(spec, "chief")
    if task_type == "evaluator":
        return task_id
    raise ValueError("There is no id for task_type %r" % task_type)


def collective_leader(cluster_spec: Any, task_type: str | None, task_id: int | None) -> str:
    """Device of the task that leads collective ops; `""` when local or the evaluator."""
    spec = normalize_cluster_spec(cluster_spec)
    if not spec:
        return ""
    validate_cluster_spec(spec, task_type, task_id)
    if task_type == "evaluator":
        return ""
    if "chief" in spec.jobs:
        return "/job:chief/replica:0/task:0"
    if "worker" not in spec.jobs:
        raise ValueError(f"No `chief` or `worker` job in cluster_spec {spec}.")
    return "/job:worker/replica:0/task:0"


def coordination_leader(cluster_spec: Any) -> str:
    """Task that hosts the coordination service: ps 0, else chief, else worker 0."""
    spec = normalize_cluster_spec(cluster_spec)
    if not spec:
        return ""
    for job in ("ps", "chief", "worker"):
        if job in spec.jobs:
            return f"/job:{job}/replica:0/task:0"
    raise ValueError(f"No `ps`, `chief` or `worker` job in cluster_spec {spec}.")


def validate_multi_worker_config(
    cluster_spec: Any, task_type: str | None, task_id: int | None
) -> ClusterSpec:
    """MultiWorkerMirroredStrategy's checks, in TF's order; returns the normalised spec.

    An empty cluster means local (single-worker) training and is accepted.
    """
    spec = normalize_cluster_spec(cluster_spec)
    if not spec:
        return spec
    if task_type is None or task_id is None:
        raise ValueError(
            "When `cluster_spec` is given, you must also specify "
            "`task_type` and `task_id`."
        )
    id_in_cluster(spec, task_type, task_id)
    if not worker_count(spec, task_type):
        raise ValueError(
            "No `worker`, `chief` or `evaluator` tasks can be found in `cluster_spec`."
        )
    return spec


def validate_parameter_server_config(
    cluster_spec: Any, task_type: str | None = None, task_id: int | None = None
) -> ClusterSpec:
    """ParameterServerStrategy's checks: non-empty cluster, valid roles, >= 1 ps and worker."""
    spec = normalize_cluster_spec(cluster_spec)
    if not spec:
        raise ValueError(
            "Cluster spec must be non-empty in "
            "`tf.distribute.cluster_resolver.ClusterResolver`."
        )
    validate_cluster_spec(spec, task_type, task_id)
    if task_count(spec, "ps") < 1:
        raise ValueError("There must be at least one ps.")
    if task_count(spec, "worker") < 1:
        raise ValueError("There must be at least one worker.")
    return spec
