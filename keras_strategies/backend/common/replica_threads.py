"""Replicas as Python threads that take turns, for engines without a single-process SPMD program.

Exactly one replica runs at a time, as in TensorFlow's MirroredStrategy:
Keras layers keep per-call bookkeeping that concurrent calls would race on.
Control passes to the next replica when the running one reaches a collective
(`exchange`) or finishes; the last replica to reach a collective completes it
and hands control back to replica 0. An error in any replica stops them all.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, ContextManager, Optional


class Aborted(Exception):
    """Another replica failed; this one stops."""


class ThreadState:
    """State that every replica must see as its own although replicas share it (`save` / `restore` at switches)."""

    def save(self, replica_id: int) -> None:
        """Called when replica `replica_id` hands control to another one."""

    def restore(self, replica_id: int) -> None:
        """Called when replica `replica_id` gets control back."""


class ReplicaGroup:
    def __init__(self, size: int, state: Optional[ThreadState] = None):
        self.size = size
        self.state = state or ThreadState()
        self.condition = threading.Condition()
        self.turn = 0
        self.generation = 0
        self.slots: list = [None] * size
        self.results: dict = {}
        self.error: Optional[BaseException] = None
        self.pending = 0  # replicas waiting in the current collective
        self.finished: set = set()

    def _wait(self, predicate: Callable[[], bool]) -> None:
        self.condition.wait_for(lambda: self.error is not None or predicate())
        if self.error is not None:
            raise Aborted() from self.error

    def start(self, replica_id: int) -> None:
        with self.condition:
            self._wait(lambda: self.turn == replica_id)
            self.state.restore(replica_id)

    def _mismatch(self, replica_id: int) -> RuntimeError:
        return RuntimeError(
            f"Replica {replica_id} and other replicas made different collective calls (all_reduce, "
            "all_gather, merge_call, apply_gradients): every replica must make the same calls in the "
            "same order, or the others would wait forever."
        )

    def finish(self, replica_id: int) -> None:
        with self.condition:
            if self.pending:
                self.error = self._mismatch(replica_id)
            self.finished.add(replica_id)
            self.state.save(replica_id)
            self.turn = replica_id + 1
            self.condition.notify_all()

    def abort(self, error: BaseException) -> None:
        with self.condition:
            self.error = error
            self.condition.notify_all()

    def exchange(self, replica_id: int, value: Any) -> list:
        """Every replica's `value`, once all replicas have reached this collective."""
        with self.condition:
            if self.finished:
                self.error = self._mismatch(replica_id)
                self.condition.notify_all()
                raise self.error
            self.slots[replica_id] = value
            self.state.save(replica_id)
            generation = self.generation
            if replica_id == self.size - 1:
                self.results = {generation: list(self.slots)}
                self.generation += 1
                self.pending = 0
                self.turn = 0
            else:
                self.pending += 1
                self.turn = replica_id + 1
            self.condition.notify_all()
            self._wait(lambda: self.generation > generation and self.turn == replica_id)
            self.state.restore(replica_id)
            return self.results[generation]


_local = threading.local()


def current() -> tuple[Optional[ReplicaGroup], int]:
    """The group and replica id of the calling thread (`(None, 0)` outside replica threads)."""
    return getattr(_local, "group", None), getattr(_local, "replica_id", 0)


def exchange(value: Any) -> list:
    """Every replica's `value` (`[value]` outside replica threads)."""
    group, replica_id = current()
    return [value] if group is None else group.exchange(replica_id, value)


def merge_call(fn: Callable[[list], Any], value: Any) -> Any:
    """Calls `fn(values_of_all_replicas)` once (on replica 0) and returns its result everywhere."""
    group, replica_id = current()
    if group is None:
        return fn([value])
    values = group.exchange(replica_id, value)
    result = fn(values) if replica_id == 0 else None
    return group.exchange(replica_id, result)[0]


def run(fn: Callable[[int], Any], size: int, replica_scope: Callable[[int], ContextManager] = lambda i: contextlib.nullcontext(),
        state: Optional[ThreadState] = None) -> list:
    """`[fn(0), ..., fn(size - 1)]`, each in its own replica thread inside `replica_scope(i)`."""
    group = ReplicaGroup(size, state)
    results: list = [None] * size
    errors: list = []

    def target(replica_id: int) -> None:
        _local.group, _local.replica_id = group, replica_id
        try:
            group.start(replica_id)
            with replica_scope(replica_id):
                results[replica_id] = fn(replica_id)
            group.finish(replica_id)
        except Aborted:
            if group.error is not None and not errors:
                errors.append(group.error)
        except BaseException as error:  # noqa: BLE001 - re-raised in the caller
            errors.append(error)
            group.abort(error)
        finally:
            _local.group = None

    threads = [threading.Thread(target=target, args=(i,), daemon=True) for i in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results
