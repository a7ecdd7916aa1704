"""Parameter-server training on Ray for the JAX and PyTorch engines (backend-neutral).

Roles map onto Ray as follows. Each `ps` task is one parameter-shard actor,
each `worker` task one worker actor, each a process of its own; the chief is
the Ray driver, starts the actors and runs the closure queue. Without
`KS_RAY_ADDRESS` the chief starts a local Ray runtime bound to 127.0.0.1; with
it, the chief joins that Ray cluster and places an actor on a node carrying a
resource named after its role (`{"ps:0": 1}`, `{"worker:1": 1}`) when one
exists. Ray is imported only when a runtime starts
(`pip install "keras-strategies[ray]"`).
"""

from __future__ import annotations

from typing import Any, Callable, Optional


def _runtime_module() -> Any:
    try:
        import ray  # noqa: F401
    except ImportError as error:
        raise ImportError(
            "ParameterServerStrategy on the JAX and PyTorch backends runs on Ray, which is not installed: "
            "`pip install \"keras-strategies[ray]\"` (or `pip install ray`)."
        ) from error
    from keras_strategies.backend.common.ray_parameter_server import runtime

    return runtime


def connect(cluster_spec: Any, task_type: Optional[str], task_id: Optional[int],
            partitioner: Optional[Callable[..., Any]]) -> Any:
    """The chief's `Runtime`: shard and worker actors for the cluster's `ps` and `worker` tasks."""
    runtime = _runtime_module()
    from keras_strategies.backend.common.ray_parameter_server import nodes

    return runtime.Runtime(cluster_spec, task_type, task_id, partitioner,
                           address=nodes.ray_address(cluster_spec))


def serve(cluster_spec: Any, job_name: str, task_index: int, protocol: Optional[str] = None) -> Any:
    """The `ks.Server` of a `ps` or `worker` task; its actors are started by the chief (see `nodes`)."""
    from keras_strategies.backend.common.ray_parameter_server import nodes

    return nodes.serve(cluster_spec, job_name, task_index, protocol)
