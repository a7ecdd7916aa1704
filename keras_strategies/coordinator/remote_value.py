"""`RemoteValue`: the future result of a closure scheduled with `ClusterCoordinator.schedule`."""

from __future__ import annotations

import abc
import threading
from typing import Any, Optional


class CancelledError(RuntimeError):
    """A scheduled closure did not run because an earlier closure failed."""


class RemoteValue(metaclass=abc.ABCMeta):
    """The value a scheduled function returns, available once a worker has run it.

    `fetch()` waits for the closure and returns its result as NumPy values
    (nested structures keep their shape); `get()` returns the same. If the
    closure failed, both raise its error; if it was cancelled because an
    earlier closure failed, both raise `CancelledError`. On TensorFlow, `schedule`
    returns TensorFlow's own remote values, which are registered as instances of
    this class.
    """

    def __init__(self) -> None:
        self._done = threading.Event()
        self._value: Any = None
        self._error: Optional[BaseException] = None

    # Set by the queue.
    def _set_value(self, value: Any) -> None:
        self._value, self._error = value, None
        self._done.set()

    def _set_error(self, error: BaseException) -> None:
        self._value, self._error = None, error
        self._done.set()

    def _reset(self) -> None:
        self._done.clear()

    def _wait(self) -> Any:
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._value

    def fetch(self) -> Any:
        """Waits for the closure and returns its result (NumPy values); raises its error if it failed."""
        return self._wait()

    def get(self) -> Any:
        """The result, as `fetch()` returns it (waits for the closure)."""
        return self._wait()

    def __reduce__(self):
        raise ValueError(
            "A RemoteValue cannot be passed to a scheduled function: call `.fetch()` on it first (after "
            "`coordinator.join()`), and pass the fetched value."
        )

    def __repr__(self) -> str:
        state = "pending" if not self._done.is_set() else ("failed" if self._error is not None else "ready")
        return f"<RemoteValue {state}>"
