"""One Ray runtime on 127.0.0.1 for every coordinator test of the run, and small clusters on it.

The clusters are the Ray engine's shard and worker actors (real processes).
`Strategy` below gives the tests the few strategy methods they use, so that
they read like the `ks.ParameterServerStrategy` code they exercise.
"""

import contextlib

import pytest

ray = pytest.importorskip("ray", reason="the coordinator's Ray engine needs `pip install ray`")


@pytest.fixture(scope="session")
def ray_runtime():
    """Ray on 127.0.0.1 with 3 parameter-server and 2 worker actors, shared by every test of the run.

    `cluster()` starts each test over on the first few of them; the third
    parameter server is the one a test may kill.
    """
    from keras_strategies.backend.common.ray_parameter_server import connect, runtime

    started = not ray.is_initialized()
    runtime.ensure_ray()
    spec = {"chief": ["127.0.0.1:1"], "ps": [f"127.0.0.1:{10 + i}" for i in range(3)],
            "worker": [f"127.0.0.1:{20 + i}" for i in range(2)]}
    shared = connect(spec, "chief", 0, None)
    SHARED.append(shared)
    yield shared
    SHARED.remove(shared)
    shared.shutdown()
    if started:
        ray.shutdown()


SHARED = []


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
