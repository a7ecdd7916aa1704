"""`ks.Server` and the Ray cluster on the Ray engine.

The chief starts the parameter-server and worker actors itself: on a local Ray
runtime bound to 127.0.0.1, or, when `KS_RAY_ADDRESS` names a running Ray
cluster, on that cluster, where an actor runs on a node that carries a
resource named after its role (`ray start --resources='{"ps:0": 1}'`) if
there is one. The `ps` and `worker` tasks of `TF_CONFIG` therefore have
nothing to serve: their `ks.Server(...).join()` waits until the task is
stopped, so that one script runs on every task as with TensorFlow.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Optional


def ray_address(cluster_spec: Any) -> Optional[str]:
    """The address of the Ray cluster to join (`KS_RAY_ADDRESS`), or None for a local runtime."""
    return os.environ.get("KS_RAY_ADDRESS") or None


class IdleServer:
    """The server of a `ps` or `worker` task on the Ray engine: `join()` waits until the task is stopped."""

    def __init__(self, job_name: str, task_index: int):
        self.target = f"ray://{job_name}:{task_index}"
        self._stopped = threading.Event()

    def join(self) -> None:
        self._stopped.wait()

    def stop(self) -> None:
        self._stopped.set()


def serve(cluster_spec: Any, job_name: str, task_index: int, protocol: Optional[str] = None) -> IdleServer:
    """The server of task `job_name:task_index`; its actors are started by the chief."""
    if job_name not in ("ps", "worker"):
        raise ValueError(f"ks.Server serves a `ps` or `worker` task; got job {job_name!r}. The chief trains instead.")
    return IdleServer(job_name, task_index)
