"""Errors a remote engine raises to the coordinator's closure queue.

The queue (written once, above the engines) tells a lost worker, whose closure
it runs again elsewhere, from a lost parameter server, which ends training.
"""

from __future__ import annotations


class WorkerUnavailableError(RuntimeError):
    """The worker running a closure died or could not be reached; the closure did not finish there."""

    def __init__(self, worker: str, detail: str = ""):
        self.worker = worker
        super().__init__(f"worker {worker} is unavailable{': ' + detail if detail else ''}")


def parameter_server_device(index: int) -> str:
    """The name of parameter server `index`, as TensorFlow names its device and its errors."""
    return f"/job:ps/replica:0/task:{index}"


class ParameterServerUnavailableError(RuntimeError):
    """A parameter server died or could not be reached: its variables are lost until the cluster restarts.

    `task` is its name as in TensorFlow's errors, "/job:ps/replica:0/task:N".
    """

    def __init__(self, task: str, detail: str = ""):
        self.task = task
        super().__init__(
            f"parameter server {task} is unavailable{' (' + detail + ')' if detail else ''}. The variables it "
            "held are lost: restart the cluster and resume from a checkpoint (for example with "
            "keras.callbacks.BackupAndRestore on the chief)."
        )
