"""`ClusterSpec`: the jobs of a cluster and the addresses of their tasks.

A pure-Python port of `tf.train.ClusterSpec` (TensorFlow's `tensorflow/python/training/server_lib.py`)
so that every backend describes a multi-worker cluster the same way, without
importing TensorFlow. The `ClusterDef` protobuf is not used; a real
`tf.train.ClusterSpec` or `ClusterDef` is still accepted by duck typing.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence, Union

JobTasks = Union[Sequence[str], Mapping[int, str]]
ClusterLike = Union["ClusterSpec", Mapping[str, JobTasks]]


class ClusterSpecTypeError(TypeError, ValueError):
    """Bad input to `ClusterSpec`.

    TF raises `TypeError` here; subclassing `ValueError` too lets callers that
    validate configuration with `except ValueError` catch it as well.
    """


def _as_str(value: Any, what: str) -> str:
    """TF accepts `str` or `bytes` job names and addresses; we store `str`."""
    if isinstance(value, str):
        return value
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("utf-8")
    raise ClusterSpecTypeError(f"{what} {value!r} must be bytes or unicode")


def _task_index(index: Any, job_name: str) -> int:
    """Sparse task indices are cast with `int()`, as TF does (`"1"` -> 1)."""
    try:
        value = int(index)
    except (TypeError, ValueError):
        raise ClusterSpecTypeError(
            f"Task index {index!r} of job {job_name!r} must be an integer."
        ) from None
    if value < 0:
        raise ClusterSpecTypeError(
            f"Task index {index!r} of job {job_name!r} must be non-negative."
        )
    return value


def _job_tasks(job_name: str, tasks: Any) -> dict[int, str]:
    """Normalises one job's tasks to `{index: address}`."""
    if isinstance(tasks, (list, tuple)):
        items = enumerate(tasks)
    elif isinstance(tasks, Mapping):
        items = ((_task_index(i, job_name), t) for i, t in tasks.items())
    else:
        raise ClusterSpecTypeError(
            f"The tasks for job {job_name!r} must be a list or a dictionary "
            f"from integers to strings, got {tasks!r}."
        )
    return {i: _as_str(t, "Task address") for i, t in items}


def _from_foreign(cluster: Any) -> dict[str, dict[int, str]] | None:
    """Reads a `tf.train.ClusterSpec` or `ClusterDef` without importing TF."""
    if callable(getattr(cluster, "as_cluster_def", None)):
        cluster = cluster.as_cluster_def()
    jobs = getattr(cluster, "job", None)
    if jobs is None or isinstance(cluster, Mapping):
        return None
    return {
        _as_str(job.name, "Job name"): _job_tasks(job.name, dict(job.tasks))
        for job in jobs
    }


class ClusterSpec:
    """A cluster as a set of tasks organised into jobs, as `tf.train.ClusterSpec`.

    Also `ks.ClusterSpec`. Backend-neutral: it does not import TensorFlow.

    Args:
        cluster: A dict mapping job names to a list of addresses (dense) or
            to `{task_index: address}` (sparse), or another `ClusterSpec`.

    Examples:
        >>> spec = ks.ClusterSpec({"chief": ["host0:2222"], "worker": ["host1:2222", "host2:2222"]})
        >>> spec.jobs, spec.num_tasks("worker"), spec.task_address("worker", 1)
        (['chief', 'worker'], 2, 'host2:2222')
    """

    def __init__(self, cluster: ClusterLike) -> None:
        if isinstance(cluster, ClusterSpec):
            # TF copies through a `ClusterDef`, which orders jobs by name.
            self._cluster_spec = {
                job: dict(cluster._cluster_spec[job]) for job in sorted(cluster.jobs)
            }
        elif isinstance(cluster, Mapping):
            self._cluster_spec = {}
            for job_name, tasks in cluster.items():
                job_name = _as_str(job_name, "Job name")
                self._cluster_spec[job_name] = _job_tasks(job_name, tasks)
        else:
            foreign = _from_foreign(cluster)
            if foreign is None:
                raise ClusterSpecTypeError(
                    "`cluster` must be a dictionary mapping one or more job names "
                    "to lists of network addresses, or a `ClusterSpec`; got "
                    f"{cluster!r}."
                )
            self._cluster_spec = {job: foreign[job] for job in sorted(foreign)}

    def __bool__(self) -> bool:
        return bool(self._cluster_spec)

    def __eq__(self, other: object) -> bool:
        # Same as TF: compares the internal `{job: {index: address}}` form, so
        # a dict of lists is *not* equal; compare `as_dict()` for that.
        if isinstance(other, ClusterSpec):
            other = other._cluster_spec
        return self._cluster_spec == other

    __hash__ = None  # type: ignore[assignment]  # mutable-looking, like TF

    def __repr__(self) -> str:
        items = self.as_dict()
        body = ", ".join(f"{k!r}: {items[k]!r}" for k in sorted(items))
        return "ClusterSpec({" + body + "})"

    def _job(self, job_name: str) -> dict[int, str]:
        try:
            return self._cluster_spec[job_name]
        except (KeyError, TypeError):
            raise ValueError(f"No such job in cluster: {job_name!r}") from None

    def as_dict(self) -> dict[str, list[str | None] | dict[int, str]]:
        """`{job: [addresses]}` for dense jobs and `{job: {index: address}}` for sparse ones.

        Examples:
            >>> ks.ClusterSpec({"worker": {0: "host0:2222", 2: "host2:2222"}}).as_dict()
            {'worker': {0: 'host0:2222', 2: 'host2:2222'}}
        """
        ret: dict[str, Any] = {}
        for job in self.jobs:
            indices = self.task_indices(job)
            if not indices:
                ret[job] = {}
            elif max(indices) + 1 == len(indices):
                ret[job] = self.job_tasks(job)
            else:
                ret[job] = {i: self.task_address(job, i) for i in indices}
        return ret

    @property
    def jobs(self) -> list[str]:
        """Job names, in the order they were given."""
        return list(self._cluster_spec)

    def num_tasks(self, job_name: str) -> int:
        """Number of tasks defined in `job_name` (sparse jobs count only defined tasks)."""
        return len(self._job(job_name))

    def task_indices(self, job_name: str) -> list[int]:
        """Sorted task indices defined in `job_name`."""
        return sorted(self._job(job_name))

    def task_address(self, job_name: str, task_index: int) -> str:
        """Address of task `task_index` of `job_name`."""
        job = self._job(job_name)
        try:
            return job[task_index]
        except (KeyError, TypeError):
            raise ValueError(
                f"No task with index {task_index!r} in job {job_name!r}"
            ) from None

    def job_tasks(self, job_name: str) -> list[str | None]:
        """Addresses indexed by task id; `None` fills the gaps of a sparse job."""
        job = self._job(job_name)
        ret: list[str | None] = [None] * (max(job) + 1 if job else 0)
        for i, address in job.items():
            ret[i] = address
        return ret
