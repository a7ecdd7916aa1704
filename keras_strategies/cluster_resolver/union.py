"""`UnionResolver`: one cluster from several resolvers, as TensorFlow's `UnionClusterResolver`."""

from __future__ import annotations

from typing import Any, Optional

from keras_strategies.cluster_resolver.cluster_spec import ClusterSpec
from keras_strategies.cluster_resolver.resolvers import ClusterResolver, format_master_url


class UnionResolver(ClusterResolver):
    """Merges the clusters of several resolvers; the other properties come from the first one.

    As `tf.distribute.cluster_resolver.UnionResolver`: jobs of different
    resolvers are combined; a job that several resolvers list is concatenated
    in order when every resolver lists it as a list, else merged by task index
    (a `KeyError` on a duplicate index). `task_type`, `task_id` and
    `rpc_layer` can be overridden by keyword.

    Examples:
        >>> chief = ks.cluster_resolver.SimpleClusterResolver(
        ...     ks.cluster_resolver.ClusterSpec({"chief": ["host0:2222"]}), task_type="worker", task_id=1)
        >>> workers = ks.cluster_resolver.SimpleClusterResolver(
        ...     ks.cluster_resolver.ClusterSpec({"worker": ["host1:2222", "host2:2222"]}))
        >>> union = ks.cluster_resolver.UnionResolver(chief, workers)
        >>> union.cluster_spec().as_dict(), union.task_type, union.task_id
        ({'chief': ['host0:2222'], 'worker': ['host1:2222', 'host2:2222']}, 'worker', 1)
    """

    def __init__(self, *resolvers: ClusterResolver, rpc_layer: Optional[str] = None, task_type: Optional[str] = None,
                 task_id: Optional[int] = None):
        if not resolvers:
            raise ValueError("At least one ClusterResolver is required.")
        for resolver in resolvers:
            if not isinstance(resolver, ClusterResolver):
                raise TypeError(f"All arguments must be a sub-class of `ClusterResolver`, got {type(resolver).__name__}.")
        self._resolvers = resolvers
        self._rpc_layer, self._task_type, self._task_id = rpc_layer, task_type, task_id

    def cluster_spec(self) -> ClusterSpec:
        """The jobs of every resolver, merged as the class docstring says."""
        specs = [resolver.cluster_spec().as_dict() for resolver in self._resolvers]
        as_list = {job: all(isinstance(spec[job], list) for spec in specs if job in spec)
                   for spec in specs for job in spec}
        merged: dict[str, Any] = {job: [] if is_list else {} for job, is_list in as_list.items()}
        for spec in specs:
            for job, tasks in spec.items():
                if as_list[job]:
                    merged[job].extend(tasks)
                    continue
                tasks = dict(enumerate(tasks)) if isinstance(tasks, list) else dict(tasks)
                duplicate = set(tasks) & set(merged[job])
                if duplicate:
                    raise KeyError(f"Duplicate keys detected when merging two ClusterSpecs: {duplicate!r}")
                merged[job].update(tasks)
        return ClusterSpec(merged)

    def master(self, task_type: Optional[str] = None, task_id: Optional[int] = None,
               rpc_layer: Optional[str] = None) -> str:
        """The address of a task when both are given, else the first resolver's master."""
        if task_type is not None and task_id is not None:
            return format_master_url(self.cluster_spec().task_address(task_type, task_id), rpc_layer or self.rpc_layer)
        return self._resolvers[0].master(rpc_layer=rpc_layer)

    @property
    def task_type(self) -> Optional[str]:
        """The override, else the first resolver's task type."""
        return self._task_type or self._resolvers[0].task_type

    @task_type.setter
    def task_type(self, task_type: Optional[str]) -> None:
        self._task_type = task_type

    @property
    def task_id(self) -> Optional[int]:
        """The override, else the first resolver's task id."""
        return self._task_id if self._task_id is not None else self._resolvers[0].task_id

    @task_id.setter
    def task_id(self, task_id: Optional[int]) -> None:
        self._task_id = task_id

    @property
    def rpc_layer(self) -> Optional[str]:
        """The override, else the first resolver's RPC layer."""
        return self._rpc_layer or self._resolvers[0].rpc_layer

    @rpc_layer.setter
    def rpc_layer(self, rpc_layer: Optional[str]) -> None:
        self._rpc_layer = rpc_layer

    @property
    def environment(self) -> Optional[str]:
        """The first resolver's environment."""
        return self._resolvers[0].environment

    def num_accelerators(self, task_type: Optional[str] = None, task_id: Optional[int] = None,
                         config_proto: Any = None) -> dict[str, int]:
        """The first resolver's accelerators."""
        return self._resolvers[0].num_accelerators(task_type, task_id, config_proto)
