"""Cluster resolvers: where a process learns the cluster and its own role in it.

Pure-Python ports of `tf.distribute.cluster_resolver.{ClusterResolver,
TFConfigClusterResolver, SimpleClusterResolver}` (TensorFlow's
`tensorflow/python/distribute/cluster_resolver/`), so multi-worker strategies
on every backend read `TF_CONFIG` exactly as TensorFlow does.
"""

from __future__ import annotations

import abc
import json
import os
from typing import Any

from keras_strategies.cluster_resolver.cluster_spec import ClusterSpec

_TF_CONFIG_ENV = "TF_CONFIG"
_SESSION_MASTER_KEY = "session_master"
_RPC_LAYER_KEY = "rpc_layer"
_TASK_KEY = "task"


def format_master_url(master: str, rpc_layer: str | None = None) -> str:
    """`rpc_layer://master`, or `master` alone when there is no RPC layer."""
    return f"{rpc_layer}://{master}" if rpc_layer else master


def task_master(resolver: "ClusterResolver", task_type: str | None, task_id: int | None,
                rpc_layer: str | None) -> str:
    """`rpc_layer://address` of a task (the resolver's own by default), or `""` while it is unknown."""
    task_type = task_type if task_type is not None else resolver.task_type
    task_id = task_id if task_id is not None else resolver.task_id
    if task_type is None or task_id is None:
        return ""
    return format_master_url(resolver.cluster_spec().task_address(task_type, task_id), rpc_layer or resolver.rpc_layer)


def load_tf_config() -> dict[str, Any]:
    """Parses `TF_CONFIG` now (unset means `{}`), so later changes are seen."""
    raw = os.environ.get(_TF_CONFIG_ENV, "{}")
    try:
        config = json.loads(raw)
    except ValueError as err:
        raise ValueError(
            f"TF_CONFIG is not valid JSON ({err}): {raw[:200]!r}"
        ) from err
    if not isinstance(config, dict):
        raise ValueError(f"TF_CONFIG must be a JSON object, got {raw[:200]!r}")
    return config


def _tf_config_value(key: str, default: Any = None) -> Any:
    return load_tf_config().get(key, default)


class ClusterResolver(abc.ABC):
    """Abstract source of a `ClusterSpec` and of this task's type, id and RPC layer.

    As `tf.distribute.cluster_resolver.ClusterResolver`. Subclass it to read
    the cluster from elsewhere than `TF_CONFIG`: implement `cluster_spec` and
    `master`, and either override the properties or set `_task_type`,
    `_task_id` and `_rpc_layer`, which the base getters and setters use.

    Examples:
        >>> class TwoWorkers(ks.cluster_resolver.ClusterResolver):
        ...     def __init__(self, index):
        ...         self.task_type, self.task_id = "worker", index
        ...     def cluster_spec(self):
        ...         return ks.cluster_resolver.ClusterSpec({"worker": ["10.0.0.1:2222", "10.0.0.2:2222"]})
        ...     def master(self, task_type=None, task_id=None, rpc_layer=None):
        ...         return ""
        >>> resolver = TwoWorkers(1)
        >>> resolver.task_type, resolver.task_id, resolver.cluster_spec().num_tasks("worker")
        ('worker', 1, 2)

        `ks.MultiWorkerMirroredStrategy(cluster_resolver=TwoWorkers(index))` then
        joins that cluster as that worker.
    """

    @abc.abstractmethod
    def cluster_spec(self) -> ClusterSpec:
        """The cluster as it is now; implementations should not cache it."""

    @abc.abstractmethod
    def master(
        self,
        task_type: str | None = None,
        task_id: int | None = None,
        rpc_layer: str | None = None,
    ) -> str:
        """Name or URL of the session master (only meaningful for TF1-style sessions)."""

    def num_accelerators(
        self,
        task_type: str | None = None,
        task_id: int | None = None,
        config_proto: Any = None,
    ) -> dict[str, int]:
        """Accelerator cores per worker, e.g. `{"GPU": 2}`.

        TF queries devices through a session; this backend-neutral port does
        not, so it returns `{}` and strategies use the local devices instead.
        """
        del task_type, task_id, config_proto
        return {}

    @property
    def environment(self) -> str | None:
        """`"google"` inside Google, else `""`."""
        return ""

    @property
    def task_type(self) -> str | None:
        """This task's job name (`"chief"`, `"worker"`, `"ps"`, `"evaluator"`), or None."""
        return getattr(self, "_task_type", None)

    @task_type.setter
    def task_type(self, task_type: str | None) -> None:
        self._task_type = task_type

    @property
    def task_id(self) -> int | None:
        """This task's index within its job, or None."""
        return getattr(self, "_task_id", None)

    @task_id.setter
    def task_id(self, task_id: int | None) -> None:
        self._task_id = task_id

    @property
    def rpc_layer(self) -> str | None:
        """Protocol tasks use to talk to each other (e.g. `"grpc"`), or None."""
        return getattr(self, "_rpc_layer", None)

    @rpc_layer.setter
    def rpc_layer(self, rpc_layer: str | None) -> None:
        self._rpc_layer = rpc_layer


class TFConfigClusterResolver(ClusterResolver):
    """Reads the cluster and this task's role from the `TF_CONFIG` environment variable.

    As `tf.distribute.cluster_resolver.TFConfigClusterResolver`, and the
    default resolver of `ks.MultiWorkerMirroredStrategy`. `TF_CONFIG` is
    re-read on every access, so a launcher may set it after the resolver is
    built. Constructor arguments and setters override it.

    Examples:
        >>> import json, os
        >>> os.environ["TF_CONFIG"] = json.dumps({
        ...     "cluster": {"worker": ["localhost:12345", "localhost:23456"]},
        ...     "task": {"type": "worker", "index": 0}})
        >>> resolver = ks.cluster_resolver.TFConfigClusterResolver()
        >>> resolver.task_type, resolver.task_id
        ('worker', 0)
        >>> resolver.cluster_spec().as_dict()
        {'worker': ['localhost:12345', 'localhost:23456']}
        >>> del os.environ["TF_CONFIG"]
    """

    def __init__(
        self,
        task_type: str | None = None,
        task_id: int | None = None,
        rpc_layer: str | None = None,
        environment: str | None = None,
    ) -> None:
        self._task_type = task_type
        self._task_id = task_id
        self._rpc_layer = rpc_layer
        self._environment = environment

    @property
    def task_type(self) -> str | None:
        """Override, else `TF_CONFIG["task"]["type"]`, cast with `str()`; None if absent."""
        if self._task_type is not None:
            return str(self._task_type)
        task = _tf_config_value(_TASK_KEY, {})
        return str(task["type"]) if "type" in task else None

    @task_type.setter
    def task_type(self, task_type: str | None) -> None:
        self._task_type = task_type

    @property
    def task_id(self) -> int | None:
        """Override, else `TF_CONFIG["task"]["index"]`, cast with `int()`; None if absent."""
        if self._task_id is not None:
            return int(self._task_id)
        task = _tf_config_value(_TASK_KEY, {})
        return int(task["index"]) if "index" in task else None

    @task_id.setter
    def task_id(self, task_id: int | None) -> None:
        self._task_id = task_id

    @property
    def environment(self) -> str | None:
        """The constructor's `environment` (None by default, as in TF)."""
        return self._environment

    @property
    def rpc_layer(self) -> str | None:
        """Override, else `TF_CONFIG["rpc_layer"]`, else None."""
        if self._rpc_layer is not None:
            return self._rpc_layer
        return _tf_config_value(_RPC_LAYER_KEY)

    @rpc_layer.setter
    def rpc_layer(self, rpc_layer: str | None) -> None:
        self._rpc_layer = rpc_layer

    def num_accelerators(
        self,
        task_type: str | None = None,
        task_id: int | None = None,
        config_proto: Any = None,
    ) -> dict[str, int]:
        """Always `{}` here: TF_CONFIG says nothing about accelerators."""
        task_type = self.task_type if task_type is None else task_type
        task_id = self.task_id if task_id is None else task_id
        return super().num_accelerators(task_type, task_id, config_proto)

    def cluster_spec(self) -> ClusterSpec:
        """`TF_CONFIG["cluster"]`, or an empty `ClusterSpec` when absent."""
        config = load_tf_config()
        if "cluster" not in config:
            return ClusterSpec({})
        return ClusterSpec(config["cluster"])

    def master(
        self,
        task_type: str | None = None,
        task_id: int | None = None,
        rpc_layer: str | None = None,
    ) -> str:
        """`session_master` if set; `""` for a single-task cluster; else `rpc_layer://address`."""
        session_master = _tf_config_value(_SESSION_MASTER_KEY)
        if session_master is not None:
            return session_master

        spec = self.cluster_spec()
        jobs = spec.jobs
        if not jobs or (len(jobs) == 1 and len(spec.job_tasks(jobs[0])) == 1):
            return ""

        task_type = self.task_type if task_type is None else task_type
        task_id = self.task_id if task_id is None else task_id
        rpc_layer = self.rpc_layer if rpc_layer is None else rpc_layer
        return format_master_url(spec.task_address(task_type, task_id), rpc_layer)


class SimpleClusterResolver(ClusterResolver):
    """Returns exactly what it was given, as `tf.distribute.cluster_resolver.SimpleClusterResolver`.

    For clusters known in the program itself, without `TF_CONFIG`.

    Examples:
        >>> spec = ks.cluster_resolver.ClusterSpec({"worker": ["10.0.0.1:2222", "10.0.0.2:2222"]})
        >>> resolver = ks.cluster_resolver.SimpleClusterResolver(spec, task_type="worker", task_id=1)
        >>> resolver.master("worker", 1, rpc_layer="grpc")
        'grpc://10.0.0.2:2222'

        ```python
        strategy = ks.MultiWorkerMirroredStrategy(cluster_resolver=resolver)  # on 10.0.0.2
        ```
    """

    def __init__(
        self,
        cluster_spec: ClusterSpec,
        master: str = "",
        task_type: str | None = None,
        task_id: int | None = None,
        environment: str = "",
        num_accelerators: dict[str, int] | None = None,
        rpc_layer: str | None = None,
    ) -> None:
        if not isinstance(cluster_spec, ClusterSpec):
            raise TypeError(
                "cluster_spec must be a `ClusterSpec`, got "
                f"{type(cluster_spec).__name__}: {cluster_spec!r}."
            )
        if not isinstance(master, str):
            raise TypeError(f"master must be a string, got {master!r}.")
        self._cluster_spec = cluster_spec
        self._master = master
        self._task_type = task_type
        self._task_id = task_id
        self._environment = environment
        self._num_accelerators = num_accelerators
        self._rpc_layer = rpc_layer

    def cluster_spec(self) -> ClusterSpec:
        """The `ClusterSpec` given to the constructor."""
        return self._cluster_spec

    def master(
        self,
        task_type: str | None = None,
        task_id: int | None = None,
        rpc_layer: str | None = None,
    ) -> str:
        """Address of `task_type:task_id` when both are given, else the constructor's `master`."""
        if task_type is not None and task_id is not None:
            master = self._cluster_spec.task_address(task_type, task_id)
        else:
            master = self._master
        return format_master_url(master, rpc_layer=rpc_layer or self._rpc_layer)

    @property
    def environment(self) -> str:
        """The constructor's `environment`."""
        return self._environment

    def num_accelerators(
        self,
        task_type: str | None = None,
        task_id: int | None = None,
        config_proto: Any = None,
    ) -> dict[str, int]:
        """The constructor's `num_accelerators`, or `{}`; arguments are ignored."""
        del task_type, task_id, config_proto
        return {} if self._num_accelerators is None else self._num_accelerators
