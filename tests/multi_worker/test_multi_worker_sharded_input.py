"""The per-worker input opt-out: unequal shards never hang and train exactly on the union of the batches."""

import sys

import numpy as np
import pytest

from mw_launch import PROGRAMS, run_together

sys.path.insert(0, PROGRAMS)
from common import build_model, data  # noqa: E402

TOL = dict(rtol=1e-5, atol=1e-5)
SPLIT, BATCH = 30, 8


def _global_batches(x, y):
    """Step k's global batch: worker 0's k-th batch followed by worker 1's (if it has one)."""
    shards = [(x[:SPLIT], y[:SPLIT]), (x[SPLIT:], y[SPLIT:])]
    steps = max(-(-len(sx) // BATCH) for sx, _ in shards)
    for k in range(steps):
        parts = [(sx[k * BATCH:(k + 1) * BATCH], sy[k * BATCH:(k + 1) * BATCH]) for sx, sy in shards if k * BATCH < len(sx)]
        yield np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = run_together(("sharded_input.py",), 2, tmp_path_factory)
    return out, [np.load(out / f"worker_{i}.npz") for i in range(2)]


def test_unequal_shards_train_like_one_process_on_the_concatenated_batches(results):
    out, workers = results
    archive = np.load(out / "initial.npz")
    x, y = data(44)
    model = build_model()
    model.set_weights([archive[f"arr_{i}"] for i in range(len(archive.files))])
    for _ in range(2):
        for xb, yb in _global_batches(x, y):
            model.train_on_batch(xb, yb)
    evaluate = model.evaluate(x, y, batch_size=44, verbose=0)
    order = np.concatenate([xb for xb, _ in _global_batches(x, y)])
    predict = model.predict(order, verbose=0)
    for worker in workers:
        for i, expected in enumerate(model.get_weights()):
            np.testing.assert_allclose(worker[f"weights_{i}"], expected, **TOL)
        np.testing.assert_allclose(worker["evaluate"], evaluate, **TOL)
        np.testing.assert_allclose(worker["predict"], predict, **TOL)


def test_custom_loop_over_unequal_pipelines_takes_the_same_steps_everywhere(results):
    _, (first, second) = results
    # Per-replica batches of 4 on 2 local replicas: worker 0's 30 rows last 4 steps, worker 1's 14
    # rows only 2; worker 1 takes part in steps 3 and 4 with empty batches.
    assert int(first["loop_steps"]) == int(second["loop_steps"]) == 4
    for key in first.files:
        if key.startswith("loop_weights"):
            np.testing.assert_array_equal(first[key], second[key])
