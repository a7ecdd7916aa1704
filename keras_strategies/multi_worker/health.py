"""Bounded failures: heartbeats between workers and a watchdog on cross-worker collectives.

Every worker publishes a heartbeat (a counter and how many collectives it has
completed) once a second in the backend's own key-value store (the torch
`TCPStore`, the `jax.distributed` coordination service, TensorFlow's
coordination service), all hosted by the chief. While a collective is in
flight, the watchdog fails this worker, naming the culprit, when a peer's
heartbeat stayed unchanged for `dead_after` seconds of reads of the store (it
died), a peer has left, calls to the chief's store failed for `dead_after`
seconds (slow calls do not count), or the collective has waited
`timeout_seconds` for peers that never joined it (they hang). Collectives
blocked inside a backend cannot be interrupted, so after reporting the error
the watchdog ends the process if the collective has not failed by itself.

So a killed worker fails the others about `DEAD_AFTER` (10 s) after its last
heartbeat; one whose collective stays blocked is ended `EXIT_GRACE` (3 s) later.
"""

from __future__ import annotations

import atexit
import os
import socket
import sys
import threading
import time
from typing import Callable, Optional

from keras_strategies.backend.common.loopback import host_of

HEARTBEAT_INTERVAL = 1.0
DEAD_AFTER = 10.0
EXIT_GRACE = 3.0
REFUSAL_WAIT = 2.0  # how long a failed collective looks for a dead chief's refused store port
LEFT = "left"


class LostWorkerError(RuntimeError):
    """A worker of the cluster died, left or hung: the collective cannot complete.

    Raised on the other workers of a `MultiWorkerMirroredStrategy` within
    about 10 s of a worker's death (heartbeats), or after
    `CommunicationOptions.timeout_seconds` when a worker hangs; the message
    names the worker (where `tf.distribute` raises errors such as
    `tf.errors.UnavailableError`). Restart all workers; Keras'
    `BackupAndRestore` callback resumes from the chief's backup.

    Examples:
        ```python
        try:
            model.fit(x, y, epochs=10, callbacks=[keras.callbacks.BackupAndRestore("/shared/backup")])
        except ks.LostWorkerError as error:
            print(error)  # e.g. "worker 1 (127.0.0.1:2223) sent no heartbeat for 10 s"
            raise SystemExit(1)
        ```
    """


class HealthMonitor:
    """Heartbeats and the collective watchdog of one worker (see the module docstring)."""

    def __init__(self, cluster, kv_set: Callable[[str, str], None], kv_try_get: Callable[[str], Optional[str]],
                 timeout: float, dead_after: float = DEAD_AFTER, interval: float = HEARTBEAT_INTERVAL):
        self._cluster = cluster
        self._kv_set, self._kv_try_get = kv_set, kv_try_get
        self._timeout, self._dead_after, self._interval = timeout, dead_after, interval
        self._me = cluster.worker_index
        self._peers = [i for i in range(cluster.num_workers) if i != self._me]
        now = time.monotonic()
        # Per peer: its last heartbeat value, when it changed, and how many of our reads of the
        # store since then found it unchanged.
        self._seen = {i: (None, now, 0) for i in self._peers}
        self._store_ok_at = now
        self._store_failing_since: Optional[float] = None  # calls to the store raise since then
        self._store_error = ""  # what the last failing call raised (named when contact is lost)
        # The store's host refused a connection: its process is gone, so no more store calls (each
        # failing one costs a timeout, and torch logs it with a C++ stack).
        self._store_gone = False
        self._completed = 0
        self._in_flight_since: Optional[float] = None
        self._what = ""
        self.error: Optional[LostWorkerError] = None
        self._stop = threading.Event()
        self._failed_exit = False
        self._threads = [
            threading.Thread(target=self._beat, name="ks-heartbeat", daemon=True),
            threading.Thread(target=self._watch, name="ks-watchdog", daemon=True),
        ]
        for thread in self._threads:
            thread.start()
        atexit.register(self._at_exit)

    @staticmethod
    def _key(worker: int) -> str:
        return f"keras_strategies/heartbeat/{worker}"

    # --- collectives -------------------------------------------------------------------
    def begin(self, what: str) -> None:
        """Called before a collective; raises at once when a peer is already known lost."""
        if self.error is not None:
            raise self.error
        self._what = what
        self._in_flight_since = time.monotonic()

    def end(self, completed: bool = True) -> None:
        """Called after a collective; `completed=False` after only starting one (it completes in a later wait)."""
        self._in_flight_since = None
        self._completed += int(completed)

    def failed(self, error: BaseException) -> LostWorkerError:
        """The error to raise when a collective failed inside the backend: names the lost worker if found.

        A dead chief is named at once (its store refuses connections); another lost peer is
        found by its heartbeats, which takes up to `dead_after` seconds.
        """
        started = time.monotonic()
        deadline = started + self._dead_after + 2 * self._interval
        while self.error is None and time.monotonic() < deadline:
            # A killed process closes its sockets one by one: the collective's may reset before
            # the store's listening socket is gone, so the refusal is looked for a little while.
            if self._me != 0 and time.monotonic() - started < REFUSAL_WAIT and (
                    self._store_gone or self._store_refuses()):
                self._store_gone = True
                self.error = LostWorkerError(
                    f"Lost a worker during a cross-worker collective ({self._what}) on {self._describe_me()}: "
                    f"{self._cluster.describe(0)}, which hosts the cluster's store, refuses connections: it died. "
                    "Restart all workers (BackupAndRestore resumes from the last backup)."
                )
                break
            time.sleep(0.1)
        self._in_flight_since = None
        self._failed_exit = True
        if self.error is not None:
            return self.error
        return LostWorkerError(f"A cross-worker collective ({self._what}) failed on {self._describe_me()}: {error}")

    # --- threads ----------------------------------------------------------------------
    def _describe_me(self) -> str:
        return self._cluster.describe(self._me)

    def _store_refuses(self) -> bool:
        """Whether the chief's store address refuses a TCP connection (no process listens there).

        A refusal is conclusive; a timeout or an unreachable network is not (a busy or distant
        chief): those stay for the heartbeats to judge.
        """
        address = self._cluster.chief_address
        try:
            socket.create_connection((host_of(address) or "127.0.0.1", int(address.rpartition(":")[2])),
                                     timeout=1.0).close()
        except ConnectionRefusedError:
            return True
        except (OSError, ValueError):
            return False
        return False

    def _beat(self) -> None:
        seq = 0
        while not self._stop.is_set():
            seq += 1
            values = None  # stays None unless both calls succeed
            try:
                if not self._store_gone:
                    self._kv_set(self._key(self._me), f"{seq} {self._completed}")
                    values = {i: self._kv_try_get(self._key(i)) for i in self._peers}
            except Exception as error:  # noqa: BLE001 - the store is gone: the watchdog reports the chief
                self._store_error = f"{type(error).__name__}: {str(error).strip()[:200]}"
                if self._me != 0 and self._store_refuses():
                    self._store_gone = True
            now = time.monotonic()
            if values is None and self._store_failing_since is None:
                self._store_failing_since = now
            if values is not None:
                self._store_ok_at = now
                self._store_failing_since = None
                for peer, value in values.items():
                    last, changed_at, unchanged = self._seen[peer]
                    if value is not None and value != last:
                        self._seen[peer] = (value, now, 0)
                    else:
                        self._seen[peer] = (last, changed_at, unchanged + 1)
            self._stop.wait(self._interval)

    def _diagnose(self, now: float, waited: float) -> Optional[str]:
        # Calls to the store that fail, not calls that are slow (a busy chief answers late).
        failing = self._store_failing_since
        if self._me != 0 and failing is not None and now - failing > self._dead_after:
            # What the calls raised, where the chief's address still takes connections (a refusal says it all).
            raised = f"; its store's calls raised {self._store_error}" if self._store_error else ""
            raised = "" if self._store_gone else raised
            return (f"lost contact with {self._cluster.describe(0)}, which hosts the cluster's "
                    f"store, for {now - self._store_ok_at:.0f} s: it died or the network failed{raised}")
        # A peer that left after completing this collective is not missed by it.
        left = [p for p in self._peers if self._state(p)[0] == LEFT and self._state(p)[1] <= self._completed]
        if left:
            return f"{self._names(left)} left the cluster (its program ended or failed) before this collective"
        dead = [p for p in self._peers if self._silent(p)]
        if dead:
            return f"{self._names(dead)} sent no heartbeat for {self._dead_after:.0f} s: it died or was stopped"
        if waited > self._timeout:
            behind = [p for p in self._peers if self._state(p)[1] <= self._completed]
            who = self._names(behind) if behind else "a peer"
            return (f"{who} did not join it within timeout_seconds={self._timeout:g} s (hung, or much "
                    "slower than the others)")
        return None

    def _silent(self, peer: int) -> bool:
        """Whether `peer`'s heartbeat stayed unchanged for `dead_after` seconds of our reads of the store.

        Counted in reads as well as in time: when this process or the store is stalled (a saturated
        CPU, a long call holding the GIL), time passes without a read, and the peer is not blamed
        for heartbeats that nobody looked at.
        """
        _, changed_at, unchanged = self._seen[peer]
        return (self._store_ok_at - changed_at > self._dead_after
                and unchanged * self._interval >= self._dead_after)

    def _state(self, peer: int) -> tuple:
        """(`"left"` or the heartbeat counter, collectives completed) of a peer's last heartbeat."""
        value = self._seen[peer][0]
        if not value:
            return ("", 0)
        tag, completed = value.split()
        return tag, int(completed)

    def _names(self, workers: list) -> str:
        return ", ".join(self._cluster.describe(w) for w in workers)

    def _watch(self) -> None:
        while not self._stop.wait(0.25):
            started = self._in_flight_since
            if started is None or self.error is not None:
                continue
            now = time.monotonic()
            reason = self._diagnose(now, now - started)
            if reason is None:
                continue
            self.error = LostWorkerError(
                f"Lost a worker during a cross-worker collective ({self._what}) on "
                f"{self._describe_me()}: {reason}. Restart all workers (BackupAndRestore "
                "resumes from the last backup)."
            )
            # The collective may fail by itself (then the caller raises `error`); if it stays
            # blocked inside the backend, end this worker so that it never hangs.
            if self._stop.wait(EXIT_GRACE) or self._in_flight_since is None:
                continue
            sys.stderr.write(f"keras_strategies: LostWorkerError: {self.error}\n")
            sys.stderr.flush()
            os._exit(1)

    def _at_exit(self) -> None:
        self._stop.set()
        # No store call may be in flight while the interpreter tears the store clients down.
        for thread in self._threads:
            thread.join(timeout=2 * self._interval)
        try:
            if not self._store_gone:
                self._kv_set(self._key(self._me), f"{LEFT} {self._completed}")
        except Exception:  # noqa: BLE001 - the store may be gone already
            pass
        if self._failed_exit:
            # Skip backend shutdown barriers that would wait for the lost worker.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)

    def stop(self) -> None:
        """Stops the threads and the exit handler (the process goes on normally)."""
        self._stop.set()
        self._failed_exit = False
        atexit.unregister(self._at_exit)
