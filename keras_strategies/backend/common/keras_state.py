"""Carrying Keras' thread-local global state into replica threads.

Keras keeps the dtype policy, device scope, random seed and other settings in
thread-local storage. Replicas that run in their own threads (PyTorch
replicas; TensorFlow's MirroredStrategy) must see the caller's settings.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from keras.src.backend.common import global_state


def capture() -> dict:
    """A copy of this thread's Keras global state."""
    return dict(vars(global_state.GLOBAL_STATE_TRACKER))


@contextlib.contextmanager
def installed(snapshot: dict) -> Iterator[None]:
    """Runs code with `snapshot` as Keras' global state, restoring this thread's afterwards."""
    tracker = global_state.GLOBAL_STATE_TRACKER
    saved = dict(vars(tracker))
    if saved == snapshot:
        yield
        return
    vars(tracker).update(snapshot)
    try:
        yield
    finally:
        vars(tracker).clear()
        vars(tracker).update(saved)
