"""`ks.experimental.TerminationConfig` and the watch for this worker's own termination notice.

A platform that preempts a machine warns first: SIGTERM (the default here, as
in TensorFlow), or a notice that a `termination_watcher_fn` polls for. The
notice only marks the worker; the handlers save at the next step boundary all
workers agree on (`step_agreement.py`).
"""

from __future__ import annotations

import signal
import sys
import threading
import time
import weakref
from numbers import Real
from typing import Callable, Optional

from keras_strategies.launcher.processes import PREEMPTED_EXIT_CODE as RESTART_EXIT_CODE  # TensorFlow's 42
_POLL_SECONDS = 1.0


def default_exit() -> None:
    """Ends the program with `RESTART_EXIT_CODE` (42), which the launcher's `--max-restarts` restarts."""
    sys.exit(RESTART_EXIT_CODE)


class TerminationConfig:
    """How a preemption is noticed, how long there is, what saves and how to exit.

    As `tf.distribute.experimental.TerminationConfig`.

    Args:
        termination_watcher_fn: A quick, non-blocking function that returns True
            once a termination notice is there (polled every second). None:
            SIGTERM is the notice.
        exit_fn: Called after the save; by default the program exits with code
            42, which `python -m keras_strategies.launch --max-restarts K`
            restarts (so does a scheduler told that 42 means "restart").
        grace_period: Seconds from the notice to the actual termination. With
            0 (the default) every worker saves at the next step boundary; with
            more, training goes on and saves when about a fifth of the grace
            period (and at least three times the last save's duration) is left.
        save_fn: Called on every worker instead of the checkpoint save.

    Examples:
        ```python
        config = ks.experimental.TerminationConfig(grace_period=30)  # SIGTERM 30 s before the end
        handler = ks.experimental.PreemptionCheckpointHandler(resolver, checkpoint, "/ckpt", config)
        ```
    """

    def __init__(self, termination_watcher_fn: Optional[Callable[[], bool]] = None,
                 exit_fn: Optional[Callable[[], None]] = None, grace_period: Optional[float] = None,
                 save_fn: Optional[Callable[[], None]] = None):
        for name, value in (("termination_watcher_fn", termination_watcher_fn), ("exit_fn", exit_fn),
                            ("save_fn", save_fn)):
            if value is not None and not callable(value):
                raise ValueError(f"TerminationConfig({name}=...) must be a function, got {value!r}.")
        if grace_period is not None and (isinstance(grace_period, bool) or not isinstance(grace_period, Real)
                                         or grace_period < 0):
            raise ValueError(f"TerminationConfig(grace_period=...) must be seconds >= 0, got {grace_period!r}.")
        self.termination_watcher_fn = termination_watcher_fn
        self.exit_fn = exit_fn or default_exit
        self.grace_period = float(grace_period or 0)
        self.save_fn = save_fn

    def __repr__(self) -> str:
        return (f"TerminationConfig(termination_watcher_fn={self.termination_watcher_fn!r}, "
                f"exit_fn={self.exit_fn!r}, grace_period={self.grace_period}, save_fn={self.save_fn!r})")


def _sigterm_handler(watch: "weakref.ref[TerminationWatch]") -> Callable:
    """SIGTERM marks the watch while it lives; once the program dropped it, SIGTERM acts as before."""

    def on_sigterm(signum, frame) -> None:
        current = watch()
        if current is not None:
            current.notice()
            return
        previous = on_sigterm.previous
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
        signal.raise_signal(signal.SIGTERM)

    return on_sigterm


class TerminationWatch:
    """Notices this worker's termination notice; `due()` says when to save."""

    def __init__(self, config: TerminationConfig):
        self._config = config
        self.received_at: Optional[float] = None
        self.save_seconds = 0.0  # how long the last save took (leaves room within a grace period)
        self._stop = threading.Event()
        self._previous_handler = None
        self._thread: Optional[threading.Thread] = None
        if config.termination_watcher_fn is not None:
            self._thread = threading.Thread(target=self._poll, name="ks-termination-watcher", daemon=True)
            self._thread.start()
        elif threading.current_thread() is threading.main_thread():
            handler = _sigterm_handler(weakref.ref(self))
            self._previous_handler = handler.previous = signal.signal(signal.SIGTERM, handler)
        else:
            raise RuntimeError(
                "Preemption handling listens for SIGTERM, and Python delivers signals to the main thread "
                "only: create it in the main thread, or pass TerminationConfig(termination_watcher_fn=...)."
            )

    def notice(self) -> None:
        """Marks the termination notice as received (the first time counts)."""
        if self.received_at is None:
            self.received_at = time.monotonic()

    def _poll(self) -> None:
        while not self._stop.is_set():
            if self._config.termination_watcher_fn():
                self.notice()
                return
            self._stop.wait(_POLL_SECONDS)

    def due(self) -> bool:
        """Whether this worker must ask for a save now (a notice came and its grace period runs out)."""
        if self.received_at is None:
            return False
        grace = self._config.grace_period
        if grace <= 0:
            return True
        reserve = max(0.2 * grace, 3 * self.save_seconds)
        return time.monotonic() >= self.received_at + grace - reserve

    def close(self) -> None:
        """Stops watching; SIGTERM gets its previous handler back."""
        self._stop.set()
        if self._previous_handler is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous_handler)
            self._previous_handler = None
