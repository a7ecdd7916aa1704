"""The coordinator's queue of scheduled closures, written once for every engine that has no queue of its own.

`schedule` returns at once; one thread per worker takes closures from the
queue and runs them on its worker. The rules (TensorFlow's):

- a closure runs at least once: if its worker dies, it goes back to the front
  of the queue and another worker runs it (the engine keeps each step's update
  from being applied twice);
- the first error of a closure is raised by the next `schedule`, `join` or
  `done`, then cleared; closures still queued behind it are cancelled (their
  `RemoteValue` raises `CancelledError`, which says to schedule them again);
- a lost parameter server is an error like any other, so `join` never hangs
  on it.

A worker handle (`runtime.workers()`) has `name`, `index`, `run(closure_id, fn,
args, kwargs)` (raises `WorkerUnavailableError` when the worker is lost) and
`wait_until_available()`. The list of handles may have `before_dispatch()`
(called when work starts after an idle queue) and `after_join()` (called when
the queue becomes idle), which engines use to move the chief's variable values.
"""

from __future__ import annotations

import collections
import itertools
import threading
import uuid
from typing import Any, Callable, Optional, Sequence

from keras_strategies.backend.common.remote_errors import WorkerUnavailableError
from keras_strategies.coordinator.remote_value import CancelledError, RemoteValue
from keras_strategies.coordinator.values import GraphDataset, PerWorkerDataset, PerWorkerValues, WorkerResource


class _Closure:
    def __init__(self, closure_id: str, fn: Callable[..., Any], args: tuple, kwargs: dict):
        self.id, self.fn, self.args, self.kwargs = closure_id, fn, args, kwargs
        self.remote_value = RemoteValue()


class ClosureQueue:
    """Runs scheduled closures on `workers` (handles from an engine's `Runtime.workers()`)."""

    def __init__(self, workers: Sequence[Any]):
        if not len(workers):
            raise ValueError("ClosureQueue needs at least one worker; the cluster has no `worker` task.")
        self._pool = workers
        self._workers = list(workers)
        self._lock = threading.Condition()
        self._queue: collections.deque = collections.deque()
        self._in_flight = 0
        self._error: Optional[BaseException] = None
        self._synced = True
        self._stopped = False
        self._prefix = uuid.uuid4().hex[:12]
        self._ids = itertools.count()
        self._threads: list = []

    # -- the public operations -------------------------------------------------------------

    def schedule(self, fn: Callable[..., Any], args: Optional[Sequence[Any]] = None,
                 kwargs: Optional[dict] = None) -> RemoteValue:
        """Queues `fn(*args, **kwargs)` to run on some worker; returns its `RemoteValue` at once."""
        if not callable(fn):
            raise ValueError(f"schedule needs a function to run on a worker; got {fn!r} of type {type(fn).__name__}.")
        args = tuple(args) if args is not None else ()
        kwargs = dict(kwargs) if kwargs is not None else {}
        _refuse_remote_values((args, kwargs))
        with self._lock:
            self._raise_error_locked()
            idle = not self._queue and not self._in_flight
        if idle:
            hook = getattr(self._pool, "before_dispatch", None)
            if hook is not None:
                hook()
        closure = _Closure(f"{self._prefix}:{next(self._ids)}", fn, args, kwargs)
        with self._lock:
            self._start_threads_locked()
            self._synced = False
            self._queue.append(closure)
            self._lock.notify_all()
        return closure.remote_value

    def join(self) -> None:
        """Waits until every scheduled closure has finished; raises the first error since the last one raised."""
        with self._lock:
            while self._queue or self._in_flight:
                self._lock.wait()
            error, self._error = self._error, None
        self._sync(error)
        if error is not None:
            raise error

    def done(self) -> bool:
        """Whether every scheduled closure has finished; raises the first error since the last one raised."""
        with self._lock:
            finished = not self._queue and not self._in_flight
            error = self._error
            if error is not None:
                self._error = None
        if error is not None:
            raise error
        if finished:
            self._sync(None)
        return finished

    def fetch(self, values: Any) -> Any:
        """The fetched value of every `RemoteValue` in `values` (nested lists, tuples, dicts, `PerWorkerValues`)."""
        if isinstance(values, RemoteValue):
            return values.fetch()
        if isinstance(values, PerWorkerValues):
            return [self.fetch(v) for v in values._values]
        if isinstance(values, (list, tuple)):
            fetched = [self.fetch(v) for v in values]
            return type(values)(fetched) if type(values) in (list, tuple) else type(values)(*fetched)
        if isinstance(values, dict):
            return {k: self.fetch(v) for k, v in values.items()}
        return values

    def create_per_worker_dataset(self, dataset_or_fn: Any) -> PerWorkerDataset:
        """A dataset built on every worker by `dataset_or_fn` (a function with no argument or one `InputContext`)."""
        if isinstance(dataset_or_fn, PerWorkerDataset):
            return dataset_or_fn
        fn = getattr(dataset_or_fn, "_ks_dataset_fn", None) or dataset_or_fn
        if not callable(fn) and hasattr(fn, "_as_serialized_graph"):
            fn = GraphDataset(fn)  # a tf.data.Dataset: its graph is sent and rebuilt on each worker
        if not callable(fn):
            raise ValueError(
                f"create_per_worker_dataset needs a function that builds the dataset (each worker calls it to "
                f"build its own); got {type(dataset_or_fn).__name__}. Pass `lambda: dataset` built inside the "
                f"function, e.g. `def dataset_fn(): return tf.data.Dataset.from_tensor_slices(...).batch(...)`."
            )
        from keras_strategies.input.options import InputContext

        count = len(self._workers)
        return PerWorkerDataset(fn, count, lambda i: InputContext(count, i, count))

    def shutdown(self) -> None:
        """Stops the queue's threads once they finish their closures (the queue cannot be used afterwards)."""
        with self._lock:
            self._stopped = True
            self._lock.notify_all()

    # -- the workers' threads --------------------------------------------------------------

    def _start_threads_locked(self) -> None:
        if self._threads:
            return
        for handle in self._workers:
            thread = threading.Thread(target=self._serve, args=(handle,), daemon=True,
                                      name=f"ks-closure-queue-{handle.name}")
            thread.start()
            self._threads.append(thread)

    def _serve(self, handle: Any) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._stopped:
                    self._lock.wait()
                if self._stopped:
                    return
                closure = self._queue.popleft()
                self._in_flight += 1
            try:
                args, kwargs = _for_worker((closure.args, closure.kwargs), handle.index)
                result = handle.run(closure.id, closure.fn, args, kwargs)
            except WorkerUnavailableError:
                with self._lock:
                    self._in_flight -= 1
                    if self._error is not None:
                        closure.remote_value._set_error(_cancelled(self._error))
                    else:
                        self._queue.appendleft(closure)
                    self._lock.notify_all()
                if not self._wait_for(handle):
                    return
                continue
            except BaseException as error:  # noqa: BLE001  (a closure's error goes to its RemoteValue and join)
                closure.remote_value._set_error(error)
                with self._lock:
                    self._in_flight -= 1
                    self._fail_queued(error)
                continue
            closure.remote_value._set_value(result)
            with self._lock:
                self._in_flight -= 1
                self._lock.notify_all()

    def _wait_for(self, handle: Any) -> bool:
        """Waits until a lost worker is back; False if the queue stopped meanwhile.

        A worker that stays away past the engine's limit is an error like a
        closure's (raised by `join`), so that nothing waits for it forever.
        """
        while True:
            try:
                handle.wait_until_available()
                return True
            except WorkerUnavailableError as error:
                with self._lock:
                    if self._stopped:
                        return False
                    self._fail_queued(error)
                    self._lock.wait(1.0)  # then ask again, unless the queue stops meanwhile

    def _fail_queued(self, error: BaseException) -> None:
        """Keeps the first error for `join`/`done`/`schedule` and cancels the queued closures (lock held)."""
        if self._error is None:
            self._error = error
        for queued in self._queue:
            queued.remote_value._set_error(_cancelled(error))
        self._queue.clear()
        self._lock.notify_all()

    # -- helpers ---------------------------------------------------------------------------

    def _raise_error_locked(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _sync(self, error: Optional[BaseException]) -> None:
        if self._synced:
            return
        hook = getattr(self._pool, "after_join", None)
        try:
            if hook is not None:
                hook()
            self._synced = True
        except BaseException:
            if error is None:
                raise


def _cancelled(error: BaseException) -> CancelledError:
    return CancelledError(
        f"This closure was cancelled because an earlier closure failed ({type(error).__name__}: {error}). "
        "Schedule it again (`coordinator.schedule(...)`) once the error is handled."
    )


def _refuse_remote_values(structure: Any) -> None:
    if isinstance(structure, RemoteValue):
        raise ValueError(
            "A RemoteValue cannot be passed to a scheduled function: call `.fetch()` on it first (after "
            "`coordinator.join()`), and pass the fetched value."
        )
    if isinstance(structure, (list, tuple, set)):
        for item in structure:
            _refuse_remote_values(item)
    elif isinstance(structure, dict):
        for item in structure.values():
            _refuse_remote_values(item)


def _for_worker(structure: Any, index: int) -> Any:
    """`structure` with each `PerWorkerValues` replaced by the value of worker `index`."""
    if isinstance(structure, PerWorkerValues):
        return structure._values[index]
    if type(structure) in (list, tuple):
        return type(structure)(_for_worker(item, index) for item in structure)
    if isinstance(structure, tuple) and hasattr(structure, "_fields"):
        return type(structure)(*(_for_worker(item, index) for item in structure))
    if type(structure) is dict:
        return {key: _for_worker(item, index) for key, item in structure.items()}
    return structure


__all__ = ["ClosureQueue", "CancelledError", "RemoteValue", "PerWorkerValues", "WorkerResource"]
