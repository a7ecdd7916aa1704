"""Callbacks that stop a loop on one worker stop every worker, at the same step.

Keras leaves the batch loop as soon as a callback sets `model.stop_training`
(or `stop_evaluating` / `stop_predicting`). One process does the same here.
Several workers must take the same steps, though, or the next collective
would pair different steps (gloo aborts, or a worker waits for the watchdog).
A callback may set the flag on one worker only: a time limit, a file, a
condition on that worker's own state.

So a worker that asked to stop runs the next step with the flag, which rides
in that step's all-reduce (`ReplicaStep`, no extra collective). Every worker
sees it there, skips that step's update and metrics (the step returns
`STOPPED`) and leaves the loop. The result equals stopping right after the
step where the flag was set, as one process would. A stop asked on the last
step of an epoch is agreed at the epoch's end (`loops.fit`).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

from keras_strategies.trainer.cross_worker import STOPPED


class StopAgreement:
    """Runs a loop's steps and tells it when to leave, on every worker at once."""

    def __init__(self, model: Any, strategy: Any, flag: str):
        self._model = model
        self._flag = flag  # "stop_training", "stop_evaluating" or "stop_predicting"
        self._several_workers = strategy.extended._num_workers > 1
        self._asked = False

    def run(self, step: Callable[..., Any], batches: Iterable, group: Optional[Callable[[list], Any]] = None) -> list | None:
        """The step's results on each batch; None when the workers agreed to stop first.

        `group(batches)`, where given, runs all the batches as one program and returns the
        results after the last (or None, and each batch takes `step`); one worker only.
        """
        if group is not None and not self._several_workers:
            batches = list(batches)
            result = group(batches)
            if result is not None:
                return [result]
        results = []
        for data in batches:
            result = step(data, stop_asked=self._asked)
            if result is STOPPED:
                setattr(self._model, self._flag, True)
                return None
            results.append(result)
        return results

    def leave_now(self) -> bool:
        """Called after the batch-end callbacks: True when the loop must end here."""
        if not getattr(self._model, self._flag):
            return False
        if not self._several_workers:
            return True
        self._asked = True  # the next step tells the other workers
        return False
