"""Workers noticed at different steps save at one same step boundary (the protocol of
`failure_handling/step_agreement.py`, here with worker threads whose steps meet at a barrier as
all-reduces do, over one in-memory store; over the engines' stores in
tests/multi_worker/test_multi_worker_preemption.py)."""

import os
import subprocess
import sys
import textwrap
import threading

import pytest

from keras_strategies.failure_handling.step_agreement import StepAgreement
from keras_strategies.multi_worker.health import LostWorkerError
from keras_strategies.multi_worker.worker_cluster import LOCAL_CLUSTER, WorkerCluster


def _cluster(workers, me):
    names = tuple(["chief 0"] + [f"worker {i}" for i in range(1, workers)])
    return WorkerCluster(workers, me, "chief" if me == 0 else "worker", me, tuple(f"127.0.0.1:{i}" for i in range(workers)),
                         names, me == 0, None, None)


def _train(notices, workers=3, steps=40, prefix="t"):
    """Each worker's step at which it saved; `notices`: {worker: step after which it is noticed}."""
    store, saved = {}, {}
    barrier = threading.Barrier(workers, timeout=10)  # a worker that does not save where the others do breaks it

    def worker(me):
        agreement = StepAgreement(_cluster(workers, me), store.__setitem__, store.get, timeout=20, key_prefix=prefix)
        for completed in range(1, steps + 1):
            try:
                barrier.wait()  # the step's all-reduce: nobody finishes step k before all entered it
            except threading.BrokenBarrierError:
                break
            noticed = notices.get(me) is not None and completed >= notices[me]
            if agreement.should_save(completed, noticed):
                saved[me] = completed
                agreement.saved()
                break
        agreement.close()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return saved


def test_one_noticed_worker_makes_every_worker_save_after_the_next_step():
    assert _train({2: 5}) == {0: 6, 1: 6, 2: 6}


def test_workers_noticed_at_different_steps_save_at_the_earliest_agreed_step():
    assert _train({1: 9, 0: 4, 2: 4}, prefix="t2") == {0: 5, 1: 5, 2: 5}


def test_alone_a_worker_saves_where_it_is_noticed():
    agreement = StepAgreement(LOCAL_CLUSTER)
    assert not agreement.should_save(3, False) and agreement.should_save(3, True)


def test_a_peer_that_never_acknowledges_fails_within_the_timeout_naming_it():
    store = {}
    agreement = StepAgreement(_cluster(2, 0), store.__setitem__, store.get, timeout=0.5, key_prefix="t3")
    with pytest.raises(LostWorkerError, match=r"worker 1 \(127.0.0.1:1\) did not acknowledge"):
        agreement.should_save(2, True)
    agreement.close()


def test_the_watcher_finishes_its_store_call_before_the_interpreter_exits():
    # A daemon thread still inside a backend's store call while the interpreter finalizes aborts
    # the process on JAX; the watcher is stopped and waited for at exit.
    program = textwrap.dedent("""
        import time
        from keras_strategies.failure_handling.step_agreement import StepAgreement
        from keras_strategies.multi_worker.worker_cluster import WorkerCluster

        def slow_get(key):
            print("call", flush=True)
            time.sleep(0.3)
            print("returned", flush=True)

        cluster = WorkerCluster(2, 0, "chief", 0, ("127.0.0.1:0", "127.0.0.1:1"), ("chief 0", "worker 1"),
                                True, None, None)
        agreement = StepAgreement(cluster, lambda key, value: None, slow_get, key_prefix="exit")
        time.sleep(0.1)
        print("exiting", flush=True)
    """)
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "KERAS_BACKEND": os.environ.get("KERAS_BACKEND", "jax")})
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.split()
    assert lines[-1] == "returned" and lines.index("exiting") < len(lines) - 1, done.stdout


def test_close_stops_the_watcher_thread():
    agreement = StepAgreement(_cluster(2, 1), {}.__setitem__, {}.get, key_prefix="t4")
    agreement.close()
    assert not agreement._thread.is_alive()
