"""Runs a multi-worker job on this machine and turns its outcome into one exit code.

The job fails fast: the first worker to fail, a SIGINT/SIGTERM/SIGHUP to the
launcher, or the timeout stops every worker (and everything they started),
because a multi-worker job with a missing peer would otherwise hang forever in
its next collective.
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
MESSAGE_PREFIX = "keras_strategies.launch: "
_STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))


def worker_env(
    tf_config: Mapping[str, object],
    backend: str | None = None,
    devices_per_worker: int | None = None,
    env: Mapping[str, str | None] | None = None,
) -> dict[str, str]:
    """The environment of one worker: ours, `env` on top (None unsets), then the launcher's variables."""
    result = dict(os.environ)
    for key, value in (env or {}).items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = str(value)
    result["TF_CONFIG"] = json.dumps(tf_config)
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


class _SignalCatcher:
    """Turns stop signals into queue events while installed (main thread only).

    Signals the process ignores (e.g. SIGHUP under nohup) stay ignored.
    """

    def __init__(self, events: "queue.SimpleQueue[tuple]") -> None:
        self._events = events
        self.received: list[int] = []
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame: object) -> None:
        self.received.append(signum)  # list.append and SimpleQueue.put are reentrant-safe
        self._events.put(("signal", None, signum))

    def __enter__(self) -> "_SignalCatcher":
        if threading.current_thread() is threading.main_thread():
            for sig in _STOP_SIGNALS:
                if signal.getsignal(sig) is not signal.SIG_IGN:
                    self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)


def _supervise(
    workers: Sequence[WorkerProcess],
    events: "queue.SimpleQueue[tuple]",
    timeout: float | None,
    message: Callable[[str], None],
) -> int:
    """Waits for the job's outcome and returns its exit code; leaves stopping to the caller."""
    deadline = None if timeout is None else time.monotonic() + timeout
    pending = len(workers)
    while pending:
        wait = 0.5 if deadline is None else min(0.5, deadline - time.monotonic())
        if wait <= 0:
            message(
                f"timed out after {timeout:g} s with {pending} of {len(workers)} worker(s) "
                "still running; stopping all workers."
            )
            return TIMEOUT_EXIT_CODE
        try:
            kind, worker, value = events.get(timeout=wait)
        except queue.Empty:
            continue
        if kind == "signal":
            name = signal.Signals(value).name
            message(f"received {name}; stopping all workers.")
            return 128 + value
        pending -= 1
        if value != 0:
            others = f"stopping the other {pending} worker(s)." if pending else "stopping."
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
) -> int:
    """Runs `python script args...` as `workers` local processes of one multi-worker job.

    The Python form of `python -m keras_strategies.launch`. Each process gets
    its own `TF_CONFIG` (free ports on 127.0.0.1), so that
    `ks.MultiWorkerMirroredStrategy()` finds its peers. Any failure stops
    the whole job, since the other workers would wait forever for a missing peer.

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

    Returns:
        0 when every worker exits 0; else the exit code of the first worker to
        fail (128 + S if killed by signal S), 128 + S when the launcher gets
        signal S (130 for Ctrl-C), or 124 on timeout. In every case all workers
        and their children are stopped first.

    Examples:
        ```python
        from keras_strategies.launch import launch

        exit_code = launch("train.py", ["--epochs", "3"], workers=2, backend="jax", timeout=600)
        ```
    """
    if not isinstance(script, str) or not script:
        raise ValueError(f"`script` must be a non-empty path or module name, got {script!r}.")
    if not module and not os.path.isfile(script):
        raise FileNotFoundError(f"Script {script!r} not found (cwd: {os.getcwd()}).")
    if isinstance(args, str):
        raise TypeError(f"`args` must be a sequence of strings, not the string {args!r}.")
    _check_positive("workers", workers, integer=True)
    if devices_per_worker is not None:
        _check_positive("devices_per_worker", devices_per_worker, integer=True)
    if timeout is not None:
        _check_positive("timeout", timeout, integer=False)
    if isinstance(grace, bool) or not isinstance(grace, (int, float)) or grace < 0:
        raise ValueError(f"`grace` must be a number >= 0, got {grace!r}.")

    command = [sys.executable, *(["-m"] if module else []), script, *map(str, args)]
    lock = threading.Lock()
    out = LineWriter(stdout if stdout is not None else sys.stdout, lock)
    err = LineWriter(stderr if stderr is not None else sys.stderr, lock)

    def message(text: str) -> None:
        err.write_line(MESSAGE_PREFIX + text)

    events: "queue.SimpleQueue[tuple]" = queue.SimpleQueue()
    ports = free_ports(workers)
    started: list[WorkerProcess] = []
    with _SignalCatcher(events) as catcher:
        try:
            for index in range(workers):
                config = tf_config_for(index, ports, chief=chief)
                started.append(
                    WorkerProcess(
                        task_name(config["task"]),
                        command,
                        worker_env(config, backend, devices_per_worker, env),
                        out,
                        err,
                        on_exit=lambda worker, rc: events.put(("exit", worker, rc)),
                    )
                )
            return _supervise(started, events, timeout, message)
        finally:
            signals_before = len(catcher.received)
            stop_all(started, grace, hurry=lambda: len(catcher.received) > signals_before)
            for worker in started:
                worker.join(timeout=2.0)
