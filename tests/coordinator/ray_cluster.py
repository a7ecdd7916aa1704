"""Small clusters on the coordinator tests' shared Ray runtime (see conftest.py).

The clusters are the Ray engine's shard and worker actors (real processes).
`Strategy` below gives the tests the few strategy methods they use, so that
they read like the `ks.ParameterServerStrategy` code they exercise.
"""

import contextlib

SHARED = []  # the session's runtime, set by conftest.py


class Strategy:
    """`scope()` and `run()` of a parameter-server strategy over a Ray `Runtime`."""

    def __init__(self, runtime):
        self.runtime = runtime

    def scope(self):
        return self.runtime.variable_scope()

    def run(self, fn, args=(), kwargs=None):
        return fn(*args, **(kwargs or {}))

    def _ks_worker_copy(self):
        return WorkerStrategy()


class WorkerStrategy:
    def run(self, fn, args=(), kwargs=None):
        return fn(*args, **(kwargs or {}))


@contextlib.contextmanager
def cluster(num_ps, num_workers, partitioner=None):
    """The shared runtime started over with `num_ps` shards and `num_workers` workers, its strategy and queue."""
    from keras_strategies.coordinator.closure_queue import ClosureQueue

    runtime = SHARED[-1]._reuse(partitioner, num_ps, num_workers)
    queue = ClosureQueue(runtime.workers())
    try:
        yield Strategy(runtime), queue
    finally:
        queue.shutdown()
