"""Runs a multi-worker job on this machine and turns its outcome into one exit code.

The job fails fast: the first worker to fail, a SIGINT/SIGTERM/SIGHUP to the
launcher, or the timeout stops every worker (and everything they started),
because a multi-worker job with a missing peer would otherwise hang forever in
its next collective.

A parameter-server job (`ps > 0`) is driven by its chief: the worker and ps
tasks serve (`ks.Server(...).join()`) until the chief, which runs the training,
exits; then they are stopped and the chief's exit code is the job's. A worker
that ends early is reported and the chief goes on with the others (the
coordinator gives its work to them); a ps that ends early, or the last worker,
stops the job, since the chief cannot finish without them.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import sys
import threading
import time
from typing import IO, Callable, Mapping, Sequence

from keras_strategies.launcher.tf_config import free_ports, task_name, tf_config_for
from keras_strategies.launcher.processes import (
    LineWriter,
    WorkerProcess,
    describe_exit,
    exit_code,
    stop_all,
)

TIMEOUT_EXIT_CODE = 124
"""The launcher's exit code when the job times out (as coreutils' `timeout`)."""
DEFAULT_GRACE = 5.0
RESTART_COUNT_VAR = "KERAS_STRATEGIES_RESTART_COUNT"
MESSAGE_PREFIX = "keras_strategies.launch: "
_STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))


def worker_env(
    tf_config: Mapping[str, object] | None,
    backend: str | None = None,
    devices_per_worker: int | None = None,
    env: Mapping[str, str | None] | None = None,
    ranks: Mapping[str, object] | None = None,
) -> dict[str, str]:
    """The environment of one worker: ours, `env` on top (None unsets), then the launcher's variables.

    A worker of a multi-node job gets torchrun's variables (`ranks`) instead of a `TF_CONFIG`.
    """
    result = dict(os.environ)
    for key, value in (env or {}).items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = str(value)
    if tf_config is not None:
        result["TF_CONFIG"] = json.dumps(tf_config)
    else:
        result.pop("TF_CONFIG", None)
        result.update({key: str(value) for key, value in (ranks or {}).items()})
    if backend is not None:
        result["KERAS_BACKEND"] = backend
    if devices_per_worker is not None:
        result["KERAS_STRATEGIES_CPU_DEVICES"] = str(devices_per_worker)
    result["PYTHONUNBUFFERED"] = "1"
    result["KERAS_STRATEGIES_LAUNCHED"] = "1"
    return result


def _check_positive(name: str, value: object, integer: bool) -> None:
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not value > 0:
        kind = "an int >= 1" if integer else "a number > 0"
        raise ValueError(f"`{name}` must be {kind}, got {value!r}.")


def check_job_arguments(script: object, args: object, module: bool, workers: object,
                        devices_per_worker: object, grace: object) -> None:
    """The checks `launch` and `start_servers` share: a clear error naming the bad value."""
    if not isinstance(script, str) or not script:
        raise ValueError(f"`script` must be a non-empty path or module name, got {script!r}.")
    if not module and not os.path.isfile(script):
        raise FileNotFoundError(f"Script {script!r} not found (cwd: {os.getcwd()}).")
    if isinstance(args, str):
        raise TypeError(f"`args` must be a sequence of strings, not the string {args!r}.")
    _check_positive("workers", workers, integer=True)
    if devices_per_worker is not None:
        _check_positive("devices_per_worker", devices_per_worker, integer=True)
    if isinstance(grace, bool) or not isinstance(grace, (int, float)) or grace < 0:
        raise ValueError(f"`grace` must be a number >= 0, got {grace!r}.")


class _SignalCatcher:
    """Turns stop signals into queue events while installed (main thread only).

    Signals the process ignores (e.g. SIGHUP under nohup) stay ignored.
    """

    def __init__(self, events: "queue.SimpleQueue[tuple]") -> None:
        self.events = events  # replaced between attempts of a restarted job
        self.received: list[int] = []
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame: object) -> None:
        self.received.append(signum)  # list.append and SimpleQueue.put are reentrant-safe
        self.events.put(("signal", None, signum))

    def __enter__(self) -> "_SignalCatcher":
        if threading.current_thread() is threading.main_thread():
            for sig in _STOP_SIGNALS:
                if signal.getsignal(sig) is not signal.SIG_IGN:
                    self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)


def check_nodes(nodes: object, node_rank: object, master_addr: object, chief: bool, ps: int) -> tuple[str, int]:
    """`(host, port)` of a multi-node job's master, after checking the node arguments."""
    _check_positive("nodes", nodes, integer=True)
    if chief or ps:
        raise ValueError("A multi-node job runs MultiWorkerMirroredStrategy workers only: --chief and --ps "
                         "are for a job on one machine (or set TF_CONFIG on each machine).")
    if isinstance(node_rank, bool) or not isinstance(node_rank, int) or not 0 <= node_rank < nodes:
        raise ValueError(f"`node_rank` must be an int in [0, {nodes}), got {node_rank!r}.")
    host, _, port = str(master_addr or "").rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f"A multi-node job needs the master's address as HOST:PORT (the first node, reachable from "
            f"every node; the port and the ports after it must be free), got {master_addr!r}."
        )
    return host, int(port)


def node_ranks(rank: int, world_size: int, local_rank: int, workers_per_node: int, node_rank: int,
               master: tuple[str, int]) -> dict[str, object]:
    """The variables torchrun gives a worker, which `ks.MultiWorkerMirroredStrategy()` reads."""
    return {"RANK": rank, "WORLD_SIZE": world_size, "LOCAL_RANK": local_rank, "LOCAL_WORLD_SIZE": workers_per_node,
            "GROUP_RANK": node_rank, "MASTER_ADDR": master[0], "MASTER_PORT": master[1]}


def check_roles(workers: int, chief: bool, ps: int) -> None:
    """Raises ValueError unless `ps` parameter servers fit the job: they need a chief and a worker.

    `workers` counts the chief: `workers=3, chief=True, ps=2` is chief 0,
    worker 0, worker 1, ps 0 and ps 1.
    """
    if isinstance(ps, bool) or not isinstance(ps, int) or ps < 0:
        raise ValueError(f"`ps` must be an int >= 0, got {ps!r}.")
    if not ps:
        return
    if not chief:
        raise ValueError(
            f"--ps {ps} needs --chief (chief=True): a parameter-server job is driven by its chief, "
            "the coordinator that runs the training."
        )
    if workers < 2:
        raise ValueError(
            "A parameter-server job needs at least one worker task besides the chief, but "
            f"--workers {workers} counts the chief: use --workers 2 or more."
        )


def _ps_job_outcome(task: WorkerProcess, returncode: int, running: Sequence[WorkerProcess],
                    message: Callable[[str], None]) -> int | None:
    """The exit code once `task` has ended in a parameter-server job, or None while the job goes on."""
    kind = task.name.split()[0]
    if kind == "chief":
        if returncode != 0:
            others = f"stopping the other {len(running)} task(s)." if running else "stopping."
            message(f"{task.name} {describe_exit(returncode)}; {others}")
        return exit_code(returncode)
    what = f"{task.name} {describe_exit(returncode)} before the chief finished"
    if returncode == 0:
        what += " (worker and ps tasks must serve until the chief ends: ks.Server(...).join())"
    workers_left = sum(1 for other in running if other.name.split()[0] == "worker")
    if kind == "ps":
        message(f"{what}; the chief cannot go on without its parameter servers: stopping all tasks.")
    elif not workers_left:
        message(f"{what}, and no worker task is left: stopping all tasks.")
    else:
        message(f"{what}; the chief goes on with the other {workers_left} worker task(s).")
        return None
    return exit_code(returncode) or 1


def _supervise(
    workers: Sequence[WorkerProcess],
    events: "queue.SimpleQueue[tuple]",
    timeout: float | None,
    message: Callable[[str], None],
    chief_ends_job: bool = False,
    deadline: float | None = None,
) -> int:
    """Waits for the job's outcome and returns its exit code; leaves stopping to the caller.

    With `chief_ends_job` (a parameter-server job) the outcome is the chief's
    exit, or the loss of a task the chief cannot do without. `deadline` (of
    `time.monotonic()`) ends a job that `timeout` seconds allowed, restarts
    included; by default `timeout` seconds from now.
    """
    if deadline is None and timeout is not None:
        deadline = time.monotonic() + timeout
    running = list(workers)
    noun = "task(s)" if chief_ends_job else "worker(s)"
    while running:
        wait = 0.5 if deadline is None else min(0.5, deadline - time.monotonic())
        if wait <= 0:
            message(
                f"timed out after {timeout:g} s with {len(running)} of {len(workers)} {noun} "
                f"still running; stopping all {noun[:-3]}s."
            )
            return TIMEOUT_EXIT_CODE
        try:
            kind, worker, value = events.get(timeout=wait)
        except queue.Empty:
            continue
        if kind == "signal":
            name = signal.Signals(value).name
            message(f"received {name}; stopping all {noun[:-3]}s.")
            return 128 + value
        running.remove(worker)
        if chief_ends_job:
            outcome = _ps_job_outcome(worker, value, running, message)
            if outcome is not None:
                return outcome
        elif value != 0:
            others = f"stopping the other {len(running)} worker(s)." if running else "stopping."
            message(f"{worker.name} {describe_exit(value)}; {others}")
            return exit_code(value)
    return 0


def launch(
    script: str,
    args: Sequence[str] = (),
    workers: int = 2,
    devices_per_worker: int | None = None,
    backend: str | None = None,
    chief: bool = False,
    timeout: float | None = None,
    env: Mapping[str, str | None] | None = None,
    stdout: IO[str] | None = None,
    stderr: IO[str] | None = None,
    *,
    module: bool = False,
    grace: float = DEFAULT_GRACE,
    ps: int = 0,
    nodes: int = 1,
    node_rank: int = 0,
    master_addr: str | None = None,
    max_restarts: int = 0,
) -> int:
    """Runs `python script args...` as `workers` local processes of one multi-worker job.

    The Python form of `python -m keras_strategies.launch`. Each process gets
    its own `TF_CONFIG` (free ports on 127.0.0.1), so that
    `ks.MultiWorkerMirroredStrategy()` finds its peers. Any failure stops
    the whole job, since the other workers would wait forever for a missing peer.

    With `ps=N` (and `chief=True`) it is a parameter-server job: N more
    processes are `"ps"` tasks, and every task runs the same script, which
    picks its role from `TF_CONFIG` (training on the chief,
    `ks.Server(...).join()` on workers and parameter servers). The job ends
    when the chief ends: then the worker and ps tasks are stopped, and the
    chief's exit code is the job's. A worker that exits early is reported and
    the chief goes on with the other workers; a ps that exits early, or the
    last worker, stops the job with that task's exit code (1 if it was 0).

    Args:
        script: The script's path, or a module name with `module=True`.
        args: The script's own arguments.
        workers: The number of worker processes.
        devices_per_worker: Sets `KERAS_STRATEGIES_CPU_DEVICES` (virtual CPU devices).
        backend: Sets `KERAS_BACKEND` (default: inherited).
        chief: Make process 0 a `"chief"` task and the others `"worker"` tasks.
        timeout: Stop all workers and return 124 after this many seconds.
        env: Extra environment variables (`None` values unset a variable).
        stdout: Where the workers' output goes, each line prefixed with its
            task (`"[worker 1] "`); default `sys.stdout`.
        stderr: The same for their error output; default `sys.stderr`.
        module: Run `python -m script`.
        grace: Seconds between SIGTERM and SIGKILL when stopping workers.
        ps: The number of parameter-server (`"ps"`) tasks, started after the
            chief and the workers; needs `chief=True` and `workers >= 2`
            (`workers` counts the chief).
        nodes: The number of machines of a multi-node job; run the launcher
            on each with the same `nodes`, `workers` (per node) and
            `master_addr`, and its own `node_rank`. Its workers get torchrun's
            variables (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, ...) instead of a
            `TF_CONFIG`, and agree on the cluster through the master.
        node_rank: This machine's index in `[0, nodes)`; node 0 holds the chief.
        master_addr: `"HOST:PORT"` of node 0, reachable from every node; the
            workers use the ports after it.
        max_restarts: When the job fails (not on timeout or a signal to the
            launcher), stop every process and start them all again, up to this
            many times; the workers see the attempt in
            `KERAS_STRATEGIES_RESTART_COUNT` and resume from
            `keras.callbacks.BackupAndRestore`. On several nodes each
            launcher restarts its own workers (the others' fail within the
            lost-worker bound and restart too).

    Returns:
        0 when every worker exits 0; else the exit code of the first worker to
        fail (128 + S if killed by signal S), 128 + S when the launcher gets
        signal S (130 for Ctrl-C), or 124 on timeout. With `ps`, the chief's
        exit code, or that of a task the chief could not do without. In every
        case all workers and their children are stopped first.

    Examples:
        ```python
        from keras_strategies.launch import launch

        exit_code = launch("train.py", ["--epochs", "3"], workers=2, backend="jax", timeout=600)
        # A parameter-server job: chief 0, worker 0, worker 1, ps 0, ps 1.
        exit_code = launch("train.py", workers=3, chief=True, ps=2, timeout=600)
        ```
    """
    check_job_arguments(script, args, module, workers, devices_per_worker, grace)
    if timeout is not None:
        _check_positive("timeout", timeout, integer=False)
    check_roles(workers, chief, ps)
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise ValueError(f"`max_restarts` must be an int >= 0, got {max_restarts!r}.")
    multi_node = nodes != 1 or master_addr is not None
    if multi_node:
        master = check_nodes(nodes, node_rank, master_addr, chief, ps)

    command = [sys.executable, *(["-m"] if module else []), script, *map(str, args)]
    lock = threading.Lock()
    out = LineWriter(stdout if stdout is not None else sys.stdout, lock)
    err = LineWriter(stderr if stderr is not None else sys.stderr, lock)

    def message(text: str) -> None:
        err.write_line(MESSAGE_PREFIX + text)

    events: "queue.SimpleQueue[tuple]" = queue.SimpleQueue()
    deadline = None if timeout is None else time.monotonic() + timeout
    with _SignalCatcher(events) as catcher:
        for restart in range(max_restarts + 1):
            ports = [] if multi_node else free_ports(workers + ps)
            started: list[WorkerProcess] = []
            restart_env = {**(env or {}), RESTART_COUNT_VAR: str(restart)}
            try:
                for index in range(workers + ps):
                    if multi_node:
                        rank = node_rank * workers + index
                        name, config = f"worker {rank}", None
                        ranks = node_ranks(rank, nodes * workers, index, workers, node_rank, master)
                    else:
                        config, ranks = tf_config_for(index, ports, chief=chief, ps=ps), None
                        name = task_name(config["task"])
                    started.append(
                        WorkerProcess(
                            name,
                            command,
                            worker_env(config, backend, devices_per_worker, restart_env, ranks),
                            out,
                            err,
                            on_exit=lambda worker, rc, events=events: events.put(("exit", worker, rc)),
                        )
                    )
                code = _supervise(started, events, timeout, message, chief_ends_job=ps > 0, deadline=deadline)
            finally:
                signals_before = len(catcher.received)
                stop_all(started, grace, hurry=lambda: len(catcher.received) > signals_before)
                for worker in started:
                    worker.join(timeout=2.0)
            if code == 0 or code == TIMEOUT_EXIT_CODE or catcher.received or restart == max_restarts:
                return code
            events = queue.SimpleQueue()  # nothing of the stopped workers reaches the next attempt
            catcher.events = events
            message(f"restarting all {workers + ps} processes (restart {restart + 1} of {max_restarts}); "
                    "they resume from their last backup (keras.callbacks.BackupAndRestore, "
                    "ks.experimental.PreemptionCheckpointHandler).")
    raise AssertionError("unreachable: the last attempt returns")  # pragma: no cover
