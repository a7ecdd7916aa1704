"""Parameter-server training on Ray for the JAX and PyTorch engines (backend-neutral).

Roles map onto Ray as follows. Each `ps` task is one parameter-shard actor,
each `worker` task one worker actor; the chief is the Ray driver and runs the
closure queue. When the tasks serve with `ks.Server` (`serve`), ps 0 starts
the Ray head and every other task joins it as a Ray node carrying a resource
named after its role (`ps:1`, `worker:0`), so each actor runs on its task's
node; otherwise the chief starts a local Ray runtime on 127.0.0.1 and the
actors run in processes of their own there. Ray is imported only when a
runtime starts (`pip install "keras-strategies[ray]"`).
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

    return runtime.Runtime(cluster_spec, task_type, task_id, partitioner, address=nodes.head_address_if_serving(cluster_spec))


def serve(cluster_spec: Any, job_name: str, task_index: int, protocol: Optional[str] = None) -> Any:
    """Serves one `ps` or `worker` task as a Ray node (ps 0 starts the head); see `nodes.serve`."""
    _runtime_module()
    from keras_strategies.backend.common.ray_parameter_server import nodes

    return nodes.serve(cluster_spec, job_name, task_index, protocol)
