"""Joining the cluster: a progress line while peers are missing, one clear error after the timeout.

Each engine blocks inside its own code until every worker has joined, silent
and deaf to Python (torch's `TCPStore`, the `jax.distributed` coordinator;
TensorFlow's `WaitForAllTasks` even holds the GIL and catches SIGTERM), and
each fails its own way when one never comes (a C++ abort on JAX). So while a
worker joins, a small watcher process prints where it waits every few seconds
and, after `timeout_seconds`, prints a `LostWorkerError` naming the missing
workers and the fix and ends the worker (the engines get a margin, so that
this comes first). SIGTERM to the worker's process group and Ctrl-C end a
waiting worker at once. Joined, the worker closes the watcher's pipe and it exits.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from typing import Optional

from keras_strategies.multi_worker.worker_cluster import WorkerCluster

_WATCHER = r"""
import os, select, signal, sys, time
parent, timeout, interval, waiting, message = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), sys.argv[4], sys.argv[5]

def end_parent(*_):
    try:
        os.kill(parent, signal.SIGKILL)
    finally:
        os._exit(1)

signal.signal(signal.SIGTERM, end_parent)
signal.signal(signal.SIGINT, end_parent)
started = time.monotonic()
while True:
    ready, _, _ = select.select([sys.stdin], [], [], interval)
    if ready:  # the parent joined (it closed the pipe) or died
        sys.exit(0)
    waited = time.monotonic() - started
    if waited >= timeout:
        sys.stderr.write("keras_strategies: " + message + "\n")
        sys.stderr.flush()
        end_parent()
    sys.stderr.write(f"keras_strategies: {waiting} ({waited:.0f} s of timeout_seconds={timeout:g})\n")
    sys.stderr.flush()
"""


def _interval(timeout: float) -> float:
    return max(1.0, min(10.0, timeout / 3))


class JoinWatch:
    """The context of `engine.collectives.initialize` (see the module docstring)."""

    def __init__(self, cluster: WorkerCluster, timeout: float):
        self._cluster, self._timeout = cluster, timeout
        self._watcher: Optional[subprocess.Popen] = None
        self._previous_sigint = None

    def message(self) -> str:
        """The error after `timeout_seconds`: who waited, for whom, and what to check."""
        cluster = self._cluster
        peers = [cluster.describe(i) for i in range(cluster.num_workers) if i != cluster.worker_index]
        return (
            f"LostWorkerError: the cluster did not form within timeout_seconds={self._timeout:g}: "
            f"{cluster.describe(cluster.worker_index)} waited for {', '.join(peers)} to join through the chief "
            f"at {cluster.chief_address}. Start every worker of the cluster (python -m keras_strategies.launch "
            "starts them all), and check that TF_CONFIG gives each task's host:port as the others reach it."
        )

    def __enter__(self) -> "JoinWatch":
        if threading.current_thread() is threading.main_thread():
            # The engine blocks in native code, where Python's KeyboardInterrupt never arrives.
            self._previous_sigint = signal.signal(signal.SIGINT, signal.SIG_DFL)
        waiting = (f"{self._cluster.describe(self._cluster.worker_index)} is waiting for the other "
                   f"{self._cluster.num_workers - 1} worker(s) to join")
        self._watcher = subprocess.Popen(
            [sys.executable, "-c", _WATCHER, str(os.getpid()), str(self._timeout), str(_interval(self._timeout)),
             waiting, self.message()],
            stdin=subprocess.PIPE,
        )
        return self

    def __exit__(self, *exc) -> None:
        if self._watcher is not None:
            self._watcher.stdin.close()
            try:
                self._watcher.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._watcher.kill()
        if self._previous_sigint is not None:
            signal.signal(signal.SIGINT, self._previous_sigint)
