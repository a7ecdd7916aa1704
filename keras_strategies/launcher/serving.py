"""The worker and ps tasks of a parameter-server cluster whose chief is the caller.

`launch(..., chief=True, ps=N)` runs every task of a parameter-server job,
the chief included, and returns when the chief ends. A notebook or an
interactive session is often the chief itself, as in TensorFlow's
parameter-server tutorial: `start_servers` starts only the worker and ps
tasks, returns at once, and gives the caller the chief's `TF_CONFIG`.
"""

from __future__ import annotations

import atexit
import sys
import threading
from typing import IO, Mapping, Sequence

from keras_strategies.launcher.processes import LineWriter, WorkerProcess, describe_exit, stop_all
from keras_strategies.launcher.supervisor import (
    DEFAULT_GRACE,
    MESSAGE_PREFIX,
    _check_positive,
    check_job_arguments,
    worker_env,
)
from keras_strategies.launcher.tf_config import free_ports, task_name, tf_config_for


class Servers:
    """The running worker and ps tasks of a cluster whose chief is the caller (see `start_servers`).

    Stop them with `stop()`, or use the object as a context manager; they are
    also stopped when the caller's interpreter exits, and on Linux when the
    caller dies in any way (a notebook kernel that is killed, say).

    Examples:
        ```python
        from keras_strategies.launch import start_servers

        with start_servers("serve.py", workers=2, ps=1) as servers:
            print(servers.cluster_spec)  # {"chief": [...], "worker": [...], "ps": [...]}
            ...  # train as the chief with servers.tf_config
        print(servers.exited())  # after the block every task has ended, with its exit code
        ```
    """

    def __init__(self, tasks: Sequence[WorkerProcess], tf_config: dict, grace: float,
                 stopping: threading.Event) -> None:
        self._tasks = list(tasks)
        self._grace = grace
        self._stopping = stopping
        self.tf_config: dict = tf_config
        """The chief's `TF_CONFIG` (a dict; `json.dumps` it into the environment variable)."""

    @property
    def cluster_spec(self) -> dict:
        """The cluster: `{"chief": [...], "worker": [...], "ps": [...]}`, addresses on 127.0.0.1."""
        return self.tf_config["cluster"]

    def exited(self) -> dict[str, int]:
        """The tasks that have ended so far, as `{"ps 0": returncode}` (negative: killed by a signal)."""
        return {task.name: task.returncode for task in self._tasks if task.returncode is not None}

    def stop(self) -> None:
        """Stops every task (SIGTERM, then SIGKILL after the grace period); idempotent."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        atexit.unregister(self.stop)
        stop_all(self._tasks, self._grace)
        for task in self._tasks:
            task.join(timeout=2.0)

    def __enter__(self) -> "Servers":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        names = ", ".join(task.name for task in self._tasks)
        return f"<Servers {names} of cluster {self.cluster_spec}>"


def start_servers(
    script: str,
    args: Sequence[str] = (),
    workers: int = 1,
    ps: int = 1,
    devices_per_worker: int | None = None,
    backend: str | None = None,
    env: Mapping[str, str | None] | None = None,
    stdout: IO[str] | None = None,
    stderr: IO[str] | None = None,
    *,
    module: bool = False,
    grace: float = DEFAULT_GRACE,
) -> Servers:
    """Starts the worker and ps tasks of a parameter-server cluster; the caller is its chief.

    Each task runs `python script args...` with its own `TF_CONFIG` (free
    ports on 127.0.0.1), as with `launch`; the script serves there with
    `ks.Server(...).join()`. Nothing runs the chief: the caller takes the
    chief's `TF_CONFIG` (`servers.tf_config`) and creates the
    `ks.ParameterServerStrategy` itself. Returns at once; the tasks run
    until `stop()` or the caller's exit (on Linux they get SIGTERM when the
    caller dies, even by SIGKILL: call this from the main thread, or from a
    thread that lives as long as the tasks should). Their output lines are
    prefixed with the task (`"[ps 0] "`); a task that ends before `stop()`
    is reported on `stderr`.

    Args:
        script: The script's path, or a module name with `module=True`.
        args: The script's own arguments.
        workers: The number of `"worker"` tasks (the chief, the caller, is not counted).
        ps: The number of parameter-server (`"ps"`) tasks.
        devices_per_worker: Sets `KERAS_STRATEGIES_CPU_DEVICES` (virtual CPU devices).
        backend: Sets `KERAS_BACKEND` (default: inherited).
        env: Extra environment variables (`None` values unset a variable).
        stdout: Where the tasks' output goes; default `sys.stdout`.
        stderr: The same for their error output; default `sys.stderr`.
        module: Run `python -m script`.
        grace: Seconds between SIGTERM and SIGKILL when stopping the tasks.

    Returns:
        The running tasks: `tf_config` (the chief's), `cluster_spec`, `exited()`, `stop()`.

    Examples:
        ```python
        import json, os
        from keras_strategies.launch import start_servers

        servers = start_servers("serve.py", workers=2, ps=1)  # worker 0, worker 1, ps 0
        os.environ["TF_CONFIG"] = json.dumps(servers.tf_config)  # this process is the chief
        strategy = ks.ParameterServerStrategy(ks.cluster_resolver.TFConfigClusterResolver())
        ...
        servers.stop()
        ```
    """
    check_job_arguments(script, args, module, workers, devices_per_worker, grace)
    _check_positive("ps", ps, integer=True)

    command = [sys.executable, *(["-m"] if module else []), script, *map(str, args)]
    lock = threading.Lock()
    out = LineWriter(stdout if stdout is not None else sys.stdout, lock)
    err = LineWriter(stderr if stderr is not None else sys.stderr, lock)
    ports = free_ports(1 + workers + ps)
    stopping = threading.Event()

    def on_exit(task: WorkerProcess, returncode: int) -> None:
        if not stopping.is_set():
            err.write_line(f"{MESSAGE_PREFIX}{task.name} {describe_exit(returncode)} while serving the chief.")

    tasks: list[WorkerProcess] = []
    try:
        for index in range(1, 1 + workers + ps):
            config = tf_config_for(index, ports, chief=True, ps=ps)
            tasks.append(WorkerProcess(task_name(config["task"]), command,
                                       worker_env(config, backend, devices_per_worker, env), out, err, on_exit,
                                       stop_with_parent=True))
    except BaseException:
        stopping.set()
        stop_all(tasks, grace)
        raise
    servers = Servers(tasks, tf_config_for(0, ports, chief=True, ps=ps), grace, stopping)
    atexit.register(servers.stop)
    return servers

