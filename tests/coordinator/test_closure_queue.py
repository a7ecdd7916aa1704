"""The closure queue's rules on real worker processes (Ray actors), on every backend.

`schedule` returns at once; the first error is raised by the next `schedule`,
`join` or `done`, then cleared; closures queued behind it are cancelled; a
closure whose worker dies runs again on another worker, whose datasets are
rebuilt when it comes back; a lost parameter server is an error naming it.
"""

import os
import signal
import threading
import time

import numpy as np
import pytest

import ray

from ray_cluster import cluster
from keras_strategies.backend.common.remote_errors import ParameterServerUnavailableError, WorkerUnavailableError
from keras_strategies.coordinator.remote_value import CancelledError, RemoteValue

pytestmark = pytest.mark.usefixtures("ray_runtime")


@pytest.fixture(scope="module")
def two_workers(ray_runtime):
    with cluster(num_ps=1, num_workers=2) as (strategy, queue):
        queue.join()
        yield queue


def _square(x):
    return x * x


def _fail(message):
    raise ValueError(message)


def _sleep(seconds, value):
    time.sleep(seconds)
    return value


def test_schedule_returns_at_once_and_fetch_gives_each_result(two_workers):
    queue = two_workers
    started = time.monotonic()
    # Each closure takes 1 s: a schedule that waited for one would take that long; one that
    # returns at once takes milliseconds, well under it also on a loaded machine.
    values = [queue.schedule(_sleep, args=(1.0, i)) for i in range(4)]
    assert time.monotonic() - started < 0.8, "schedule waited for the closures"
    queue.join()
    assert [v.fetch() for v in values] == [0, 1, 2, 3]
    assert queue.fetch({"a": values[:2], "b": values[3]}) == {"a": [0, 1], "b": 3}
    assert queue.done()
    assert queue.fetch(queue.schedule(_square, args=(np.float32(3.0),))) == 9.0


def _worker_index():
    from keras_strategies.coordinator.values import experimental_get_current_worker_index

    time.sleep(0.2)
    return experimental_get_current_worker_index()


def test_closures_run_on_both_workers(two_workers):
    queue = two_workers
    indices = [queue.schedule(_worker_index) for _ in range(6)]
    queue.join()
    assert {v.fetch() for v in indices} == {0, 1}
    from keras_strategies.coordinator.values import experimental_get_current_worker_index

    with pytest.raises(RuntimeError, match="only available inside a function scheduled"):
        experimental_get_current_worker_index()


def test_first_error_raised_by_join_then_cleared_and_queued_closures_cancelled(two_workers):
    queue = two_workers
    queue.schedule(_fail, args=("first",))
    queue.schedule(_fail, args=("second",))
    # Queued behind the errors on two busy workers: cancelled.
    late = [queue.schedule(_sleep, args=(0.05, i)) for i in range(20)]
    with pytest.raises(ValueError, match="first|second"):
        queue.join()
    queue.join()  # cleared
    cancelled = [v for v in late if _raises(v, CancelledError)]
    assert cancelled, "no queued closure was cancelled"
    with pytest.raises(CancelledError, match="Schedule it again"):
        cancelled[0].fetch()
    assert queue.schedule(_square, args=(4,)).fetch() == 16


def test_error_raised_by_schedule_and_done(two_workers):
    queue = two_workers
    failed = queue.schedule(_fail, args=("boom",))
    with pytest.raises(ValueError, match="boom"):
        failed.fetch()
    with pytest.raises(ValueError, match="boom"):
        queue.schedule(_square, args=(2,))
    assert queue.done()
    failed = queue.schedule(_fail, args=("again",))
    with pytest.raises(ValueError, match="again"):
        failed.fetch()
    with pytest.raises(ValueError, match="again"):
        queue.done()
    assert queue.done()


def test_invalid_schedule_arguments(two_workers):
    queue = two_workers
    with pytest.raises(ValueError, match="needs a function"):
        queue.schedule(3)
    value = queue.schedule(_square, args=(2,))
    with pytest.raises(ValueError, match=r"RemoteValue cannot be passed.*fetch\(\)"):
        queue.schedule(_square, args=([value],))
    queue.join()
    with pytest.raises(ValueError, match="function that builds the dataset"):
        queue.create_per_worker_dataset([1, 2, 3])


def _kill_worker_during_closures(queue, kill):
    """Schedules slow closures, kills the worker that runs closure 0 while it runs, checks every result arrives."""
    values = [queue.schedule(_sleep_and_pid, args=(0.8, i)) for i in range(6)]
    handle = queue._workers[0]
    pid = ray.get(handle.actor.ping.remote())
    time.sleep(0.3)
    kill(handle, pid)
    queue.join()
    results = [v.fetch() for v in values]
    assert [index for index, _ in results] == list(range(6))
    return pid, {p for _, p in results}


def _sleep_and_pid(seconds, index):
    time.sleep(seconds)
    return index, os.getpid()


def test_closure_on_a_killed_worker_runs_elsewhere_and_the_worker_comes_back(two_workers):
    queue = two_workers
    dead, pids = _kill_worker_during_closures(queue, lambda handle, pid: ray.kill(handle.actor, no_restart=False))
    # The worker came back (a new process) and runs closures again.
    handle = queue._workers[0]
    handle.wait_until_available()
    assert ray.get(handle.actor.ping.remote()) != dead


def test_closure_on_a_sigkilled_worker_runs_elsewhere_and_its_dataset_is_rebuilt(two_workers):
    queue = two_workers
    dataset = queue.create_per_worker_dataset(lambda: iter(range(1000)))
    iterator = iter(dataset)
    before = _by_worker(queue, [queue.schedule(_next_and_pid, args=(iterator,)) for _ in range(6)])
    for values in before.values():
        assert values == list(range(len(values)))  # each worker reads its own dataset in order
    dead, _ = _kill_worker_during_closures(queue, lambda handle, pid: os.kill(pid, signal.SIGKILL))
    queue._workers[0].wait_until_available()
    restarted = ray.get(queue._workers[0].actor.ping.remote())
    after = {}
    for _ in range(10):  # until the restarted worker has run a closure
        after = _by_worker(queue, [queue.schedule(_sleep_next_and_pid, args=(iterator,)) for _ in range(4)], after)
        if restarted in after:
            break
    assert dead not in after
    # The restarted worker rebuilt its dataset: it reads from the start again.
    assert after[restarted] == list(range(len(after[restarted])))
    survivor = ray.get(queue._workers[1].actor.ping.remote())
    if survivor in before and survivor in after:
        assert after[survivor][0] == before[survivor][-1] + 1


def test_a_worker_killed_between_closures_gets_its_functions_variables_and_datasets_again(ray_runtime):
    with cluster(num_ps=1, num_workers=1) as (strategy, queue):
        import keras

        with strategy.scope():
            counter = keras.Variable(0.0)

        def count(iterator):
            counter.assign_add(1.0)
            return next(iterator), os.getpid()

        iterator = iter(queue.create_per_worker_dataset(lambda: iter(range(1000))))
        before = [queue.schedule(count, args=(iterator,)) for _ in range(3)]
        queue.join()
        (pid,) = {p for _, p in (v.fetch() for v in before)}
        os.kill(pid, signal.SIGKILL)  # while the worker is idle: the queue learns of it only by the next closure
        queue._workers[0].wait_until_available()  # (Ray has restarted it by then)
        after = [queue.schedule(count, args=(iterator,)) for _ in range(2)]
        queue.join()
        results = [v.fetch() for v in after]
        assert [value for value, _ in results] == [0, 1]  # the new process built the dataset anew
        assert {p for _, p in results} != {pid}
        assert float(counter.numpy()) == 5.0  # and read the variable from the parameter server


def _by_worker(queue, values, into=None):
    queue.join()
    into = {} if into is None else into
    for value, pid in (v.fetch() for v in values):
        into.setdefault(pid, []).append(value)
    return into


def _sleep_next_and_pid(iterator):
    time.sleep(0.1)
    return next(iterator), os.getpid()


def _next(iterator):
    return next(iterator)


def _next_and_pid(iterator):
    return next(iterator), os.getpid()


def test_a_lost_parameter_server_is_an_error_naming_it(ray_runtime):
    # The shared runtime's third parameter server is the one tests may kill.
    with cluster(num_ps=3, num_workers=1) as (strategy, queue):
        import keras

        with strategy.scope():
            counters = [keras.Variable(0.0) for _ in range(3)]  # one on each parameter server

        def bump():
            for counter in counters:
                counter.assign_add(1.0)
            return 1

        queue.schedule(bump).fetch()
        queue.join()
        assert [float(c.numpy()) for c in counters] == [1.0, 1.0, 1.0]
        ray.kill(strategy.runtime.shards[2], no_restart=True)
        started = time.monotonic()
        for _ in range(3):
            queue.schedule(bump)
        with pytest.raises(ParameterServerUnavailableError, match="/job:ps/replica:0/task:2"):
            queue.join()
        assert time.monotonic() - started < 30


def _raises(value: RemoteValue, error: type) -> bool:
    try:
        value.fetch()
    except error:
        return True
    except Exception:  # noqa: BLE001
        return False
    return False


def test_engine_interface_errors_and_server():
    from keras_strategies.backend.common.ray_parameter_server import connect, serve

    import keras_strategies as ks

    with pytest.raises(ValueError, match="at least one `ps` task"):
        connect(ks.ClusterSpec({"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]}), "chief", 0, None)
    with pytest.raises(ValueError, match="at least one `worker` task"):
        connect({"chief": ["127.0.0.1:1"], "ps": ["127.0.0.1:2"]}, "chief", 0, None)
    with pytest.raises(ValueError, match="chief trains"):
        serve({"ps": ["127.0.0.1:2"]}, "chief", 0)
    server = serve({"ps": ["127.0.0.1:2"], "worker": ["127.0.0.1:3"]}, "ps", 0)
    waiter = threading.Thread(target=server.join)
    waiter.start()
    waiter.join(0.1)
    assert waiter.is_alive()  # a ps task serves until stopped
    server.stop()
    waiter.join(5)
    assert not waiter.is_alive()


class _InProcessWorker:
    """A worker of the queue's handle protocol that runs closures in the queue's thread; it can be lost for good."""

    def __init__(self, index):
        self.index, self.name = index, f"worker:{index}"
        self.lost = False

    def run(self, closure_id, fn, args, kwargs):
        if self.lost:
            raise WorkerUnavailableError(self.name, "lost")
        return fn(*args, **kwargs)

    def wait_until_available(self):
        if self.lost:
            raise WorkerUnavailableError(self.name, "did not come back within 0 s")


def test_a_worker_that_never_comes_back_is_an_error_not_a_hang():
    from keras_strategies.coordinator.closure_queue import ClosureQueue

    worker = _InProcessWorker(0)
    queue = ClosureQueue([worker])
    assert queue.schedule(_square, args=(3,)).fetch() == 9
    worker.lost = True
    values = [queue.schedule(_square, args=(i,)) for i in range(3)]
    with pytest.raises(WorkerUnavailableError, match="did not come back"):
        queue.join()
    for value in values:
        with pytest.raises(CancelledError):
            value.fetch()
    queue.shutdown()
