"""`ks.Server` on the Ray engine: each `ps` and `worker` task serves as a Ray node.

ps 0 starts the Ray head at the address its task has in the cluster spec;
every other task joins it as a node carrying a resource named after its role
(`{"ps:1": 1}`, `{"worker:0": 1}`), which the chief's actors ask for, so each
actor runs on its task's node. The chief joins as a Ray driver.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from typing import Any, Optional


def _ps0_address(cluster_spec: Any) -> Optional[str]:
    from keras_strategies.backend.common.ray_parameter_server.runtime import jobs

    ps = jobs(cluster_spec).get("ps") or []
    return ps[0] if ps else None


def _listening(address: str, timeout: float = 0.5) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return True
    except OSError:
        return False


def head_address_if_serving(cluster_spec: Any) -> Optional[str]:
    """The Ray head's address when the cluster's tasks serve Ray nodes (`KS_RAY_ADDRESS` overrides), else None."""
    if os.environ.get("KS_RAY_ADDRESS"):
        return os.environ["KS_RAY_ADDRESS"]
    address = _ps0_address(cluster_spec)
    if address and os.environ.get("KS_PS_SERVE_RAY_NODES") == "1" and _listening(address):
        return address
    return None


class RayNodeServer:
    """A Ray node serving one task; `join()` waits until the node process ends."""

    def __init__(self, process: subprocess.Popen, target: str):
        self._process = process
        self.target = target

    def join(self) -> None:
        self._process.wait()

    def stop(self) -> None:
        if self._process.poll() is None:
            self._process.terminate()
            self._process.wait(timeout=30)


def serve(cluster_spec: Any, job_name: str, task_index: int, protocol: Optional[str] = None) -> RayNodeServer:
    """Starts this task's Ray node (the head on ps 0) and returns its server."""
    if job_name not in ("ps", "worker"):
        raise ValueError(f"a Ray node serves a `ps` or `worker` task; got job {job_name!r}. The chief trains instead.")
    head = _ps0_address(cluster_spec)
    if head is None:
        raise ValueError("the cluster spec has no `ps` task, whose first task starts the Ray head")
    host, _, port = head.rpartition(":")
    ray_cli = shutil.which("ray", path=os.path.dirname(sys.executable)) or shutil.which("ray") or "ray"
    resources = json.dumps({f"{job_name}:{task_index}": 1})
    command = [ray_cli, "start", "--block", "--disable-usage-stats", "--num-cpus=1", f"--resources={resources}",
               f"--node-ip-address={host}"]
    if job_name == "ps" and task_index == 0:
        command += ["--head", f"--port={port}", "--include-dashboard=false"]
    else:
        deadline = time.monotonic() + 60
        while not _listening(head) and time.monotonic() < deadline:
            time.sleep(0.2)
        command += [f"--address={head}"]
    env = dict(os.environ, KS_PS_SERVE_RAY_NODES="1")
    return RayNodeServer(subprocess.Popen(command, env=env), f"ray://{head}")
