"""The step at which every worker saves after a preemption notice, agreed through the chief's store.

Synchronous workers are at most one step apart: a worker that has finished
step k met every other worker in step k's all-reduce, and none can finish
step k + 1 without it. So a worker noticed at the boundary after step k
publishes "save after step k + 1" in the cluster's key-value store (the one
the heartbeats use) and waits until every peer has acknowledged it before it
starts step k + 1. A peer's watcher thread reads the notice and acknowledges
it; no peer can finish step k + 1 before it has. Each worker saves at the first
boundary that reaches the smallest published step, which is then the same
boundary on every worker, also when several workers are noticed at once (a
whole cluster preempted). After the save the chief says it is done, and the
others wait for that before they exit, so that a launcher that restarts the
cluster never stops the chief mid-write.
"""

from __future__ import annotations

import atexit
import itertools
import threading
import time
from typing import Callable, Optional

from keras_strategies.multi_worker.health import LostWorkerError

_POLL_SECONDS = 0.25
_instances = itertools.count()  # every worker creates its agreements in the same order


class StepAgreement:
    """Says, at each step boundary, whether this worker saves now (see the module docstring)."""

    def __init__(self, cluster, kv_set: Optional[Callable[[str, str], None]] = None,
                 kv_try_get: Optional[Callable[[str], Optional[str]]] = None, timeout: float = 60.0,
                 key_prefix: Optional[str] = None):
        self._cluster = cluster
        self._kv_set, self._kv_try_get = kv_set, kv_try_get
        self._timeout = timeout
        self._prefix = key_prefix or f"ks/preemption/{next(_instances)}"
        self._me = cluster.worker_index
        self._peers = [i for i in range(cluster.num_workers) if i != self._me]
        self._step: Optional[int] = None  # the smallest published step
        self._published = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        if self._peers:
            self._thread = threading.Thread(target=self._watch_peers, name="ks-preemption-watcher", daemon=True)
            self._thread.start()
            # The watcher calls into the backend's store client; a daemon thread still inside such a
            # call while the interpreter finalizes aborts the process (JAX: "FATAL: exception not
            # rethrown"), so it is stopped before that.
            atexit.register(self.close)

    def _key(self, worker: int, suffix: str = "") -> str:
        return f"{self._prefix}/{worker}{suffix}"

    def _note(self, step: int) -> None:
        with self._lock:
            self._step = step if self._step is None else min(self._step, step)

    def _watch_peers(self) -> None:
        unseen = set(self._peers)
        while unseen and not self._stop.is_set():
            for peer in sorted(unseen):
                try:
                    value = self._kv_try_get(self._key(peer))
                except Exception:  # noqa: BLE001 - the store is the chief's; the heartbeats report its loss
                    value = None
                if value is not None:
                    self._note(int(value))
                    self._kv_set(self._key(peer, f"/ack/{self._me}"), "1")
                    unseen.discard(peer)
            self._stop.wait(_POLL_SECONDS)

    def _wait_for(self, keys: dict, what: str) -> None:
        """Waits until every key of `keys` ({worker: key}) is in the store, at most `timeout` seconds."""
        deadline = time.monotonic() + self._timeout
        missing = dict(keys)
        while missing:
            missing = {w: k for w, k in missing.items() if self._kv_try_get(k) is None}
            if not missing:
                return
            if time.monotonic() > deadline:
                names = ", ".join(self._cluster.describe(w) for w in sorted(missing))
                raise LostWorkerError(f"{names} did not {what} within {self._timeout:.0f} s.")
            time.sleep(_POLL_SECONDS / 5)

    def should_save(self, completed: int, noticed: bool) -> bool:
        """At the boundary after `completed` steps: True when every worker saves here.

        `noticed`: this worker has a termination notice due. Alone, it saves at once.
        """
        if not self._peers:
            return noticed
        with self._lock:
            step = self._step
        if step is not None and completed >= step:
            return True
        if noticed and not self._published:
            self._published = True
            self._note(completed + 1)
            self._kv_set(self._key(self._me), str(completed + 1))
            self._wait_for({p: self._key(self._me, f"/ack/{p}") for p in self._peers},
                           "acknowledge this worker's preemption notice")
        return False

    def saved(self) -> None:
        """After the save: the chief says it is written; the others wait for that."""
        if not self._peers:
            return
        if self._cluster.is_chief:
            self._kv_set(f"{self._prefix}/saved", "1")
        else:
            self._wait_for({0: f"{self._prefix}/saved"}, "finish writing the preemption checkpoint")

    def close(self) -> None:
        """Stops the watcher thread and waits for its store call in flight."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5 * _POLL_SECONDS)
            atexit.unregister(self.close)
