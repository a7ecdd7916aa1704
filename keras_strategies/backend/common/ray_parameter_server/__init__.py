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


_LIVE: list = []  # the runtime this process started, reused by later strategies


def connect(cluster_spec: Any, task_type: Optional[str], task_id: Optional[int],
            partitioner: Optional[Callable[..., Any]] = None, rpc_layer: Optional[str] = None) -> Any:
    """The chief's `Runtime`: shard and worker actors for the cluster's `ps` and `worker` tasks.

    A later strategy of the same process starts over on the actors of the first
    when they are enough for its cluster (the earlier strategy's variables are
    forgotten), so a process pays for Ray and its actors once.
    """
    del rpc_layer  # Ray has its own transport
    runtime = _runtime_module()
    from keras_strategies.backend.common.ray_parameter_server import nodes

    address = nodes.ray_address(cluster_spec)
    cluster = runtime.jobs(cluster_spec)
    num_ps, num_workers = len(cluster.get("ps", [])), len(cluster.get("worker", []))
    for live in _LIVE:
        if (live.address == address and 0 < num_ps <= len(live.shards)
                and 0 < num_workers <= len(live._all_handles)):
            live.task_type, live.task_id = task_type, task_id
            return live._reuse(partitioner, num_ps, num_workers)
    created = runtime.Runtime(cluster_spec, task_type, task_id, partitioner, address=address)
    _LIVE.append(created)
    return created


def serve(cluster_spec: Any, job_name: str, task_index: int, protocol: Optional[str] = None,
          config: Any = None, start: bool = True) -> Any:
    """The `ks.Server` of a `ps` or `worker` task; its actors are started by the chief (see `nodes`)."""
    del config, start  # nothing to configure or start: the chief starts the actors
    from keras_strategies.backend.common.ray_parameter_server import nodes

    return nodes.serve(cluster_spec, job_name, task_index, protocol)


def current_worker_index() -> int:
    """The index of the worker running the current scheduled function; RuntimeError outside one."""
    from keras_strategies.backend.common.ray_parameter_server.actors import current_worker_index as index

    value = index()
    if value is None:
        raise RuntimeError(
            "experimental_get_current_worker_index() is only available inside a function scheduled with "
            "`coordinator.schedule(...)`, which runs on a worker."
        )
    return value
