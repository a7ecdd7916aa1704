"""The workers of a strategy, as the shared trainer and input code see them.

Every strategy has workers: one, unless it is a multi-worker strategy
(`MultiWorkerMirroredStrategy`, `TPUStrategy` over several hosts), which
overrides these methods with collectives across its processes. The trainer
(`trainer/`) and the input pipeline (`input/`) call them on every strategy, so
the one-worker answers here keep them free of multi-worker branches. A mixin
of `StrategyExtended` (`strategy.py`).
"""

from __future__ import annotations

from typing import Any, Sequence


class OneWorker:
    """The workers of a strategy that runs in one process (see the module docstring)."""

    @property
    def _num_workers(self) -> int:
        return 1

    @property
    def _worker_index(self) -> int:
        return 0

    @property
    def _is_chief(self) -> bool:
        return True

    def _in_multi_worker_mode(self) -> bool:
        """Whether this strategy has several workers, as tf.distribute's extended says (keras-tuner
        asks, to let the chief alone report trial results)."""
        return self._num_workers > 1

    def _cross_worker_sum(self, values: list, what: str = "all-reduce", donated: Any = False) -> list:
        """Element-wise sums of a list of tensors over all workers (one worker: unchanged).

        `donated` (a bool, or one per value) hands the values over: the engine
        may then sum them in place instead of copying them.
        """
        return values

    def _any_worker_has(self, flag: bool, what: str = "end-of-input agreement") -> bool:
        """Whether `flag` is true on any worker (one worker: `flag`)."""
        return flag

    def _sync_variables_from_chief(self, also: Sequence[Any] = ()) -> None:
        """Gives every worker the chief's values of new variables and `also` (one worker: nothing to do)."""

    def _sync_optimizer_state_from_chief(self, optimizer: Any, variables: Sequence[Any]) -> None:
        """Gives every worker the chief's state of `optimizer` where it lives outside its variables
        (split over the replicas of every worker), after the chief alone may have restored it (one
        worker: nothing to do)."""

    def _broadcast_from_chief(self, number: int) -> int:
        """The chief's value of a small integer (one worker: `number`)."""
        return number

    def _use_chief_input_rngs(self) -> None:
        """Makes every worker's input shuffles draw as the chief's (one worker: nothing to do)."""
