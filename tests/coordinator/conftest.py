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
    from keras_strategies.backend.common.ray_parameter_server import runtime

    started = not ray.is_initialized()
    runtime.ensure_ray()
    yield
    if started:
        ray.shutdown()


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
    """A Ray runtime with `num_ps` shards and `num_workers` workers, its strategy and closure queue."""
    from keras_strategies.backend.common.ray_parameter_server import connect
    from keras_strategies.coordinator.closure_queue import ClosureQueue

    spec = {"chief": ["127.0.0.1:1"], "ps": [f"127.0.0.1:{10 + i}" for i in range(num_ps)],
            "worker": [f"127.0.0.1:{20 + i}" for i in range(num_workers)]}
    runtime = connect(spec, "chief", 0, partitioner)
    queue = ClosureQueue(runtime.workers())
    try:
        yield Strategy(runtime), queue
    finally:
        queue.shutdown()
        runtime.shutdown()
