"""`ks.Server`: serves a `worker` or `ps` task of a parameter-server cluster, as `tf.distribute.Server`."""

from __future__ import annotations

from typing import Any, Optional

from keras_strategies.backend import engine


class Server:
    """A task of a `ParameterServerStrategy` cluster, as `tf.distribute.Server`.

    The `worker` and `ps` tasks run `ks.Server(...).join()` and wait for the
    chief's work; the chief creates the `ks.ParameterServerStrategy`.

    Args:
        server_or_cluster_def: The cluster: a `ks.ClusterSpec`, a dict of job
            names to addresses, or the engine's own cluster or server definition.
        job_name: This task's job, `"worker"` or `"ps"`.
        task_index: This task's index in its job.
        protocol: The engine's protocol (TensorFlow: `"grpc"`, the default).
        config: The engine's configuration (TensorFlow: a `tf.compat.v1.ConfigProto`).
        start: Whether to start serving at once.

    Examples:
        ```python
        cluster = ks.cluster_resolver.TFConfigClusterResolver()
        if cluster.task_type in ("worker", "ps"):
            ks.Server(cluster.cluster_spec(), job_name=cluster.task_type,
                      task_index=cluster.task_id, protocol=cluster.rpc_layer or "grpc",
                      start=True).join()
        ```
    """

    def __init__(self, server_or_cluster_def: Any, job_name: Optional[str] = None, task_index: Optional[int] = None,
                 protocol: Optional[str] = None, config: Any = None, start: bool = True):
        from keras_strategies.cluster_resolver.roles import normalize_cluster_spec
        definition = server_or_cluster_def
        if isinstance(definition, dict) or hasattr(definition, "as_dict"):
            spec = normalize_cluster_spec(definition)
            if job_name is None and len(spec.jobs) == 1:
                job_name = spec.jobs[0]
            if job_name not in spec.jobs:
                raise ValueError(f"job_name {job_name!r} is not a job of the cluster {spec.as_dict()}.")
            if task_index is None:
                task_index = 0
            if not 0 <= task_index < spec.num_tasks(job_name):
                raise ValueError(
                    f"task_index {task_index} is out of range for job {job_name!r}, which has "
                    f"{spec.num_tasks(job_name)} task(s)."
                )
            definition = spec
        self._server = engine.parameter_server.serve(definition, job_name, task_index, protocol, config, start)

    def start(self) -> None:
        """Starts serving (when created with `start=False`)."""
        self._server.start()

    def join(self) -> None:
        """Serves until the process is stopped."""
        self._server.join()

    @property
    def target(self) -> str:
        """This server's address for clients (`grpc://host:port` on TensorFlow)."""
        return self._server.target
