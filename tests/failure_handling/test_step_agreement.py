"""Workers noticed at different steps save at one same step boundary (the protocol of
`failure_handling/step_agreement.py`, here with worker threads whose steps meet at a barrier as
all-reduces do, over one in-memory store; over the engines' stores in
tests/multi_worker/test_multi_worker_preemption.py)."""

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
