"""`ShardedDataParallelStrategy` on two real worker processes on 127.0.0.1 (stages 1 and 2).

On 2 workers x 1 and 2 workers x 2 devices: `fit` / `evaluate` / `predict` and the guide's
custom loop equal one process on the same global batch within 1e-5 (50 samples in global
batches of 16: a partial last batch; a bias of one element, which 2 and 4 do not divide), every
replica holds one piece of each variable and the optimizer's slots for it alone, and the model
saved under every replica of the cluster loads under fewer replicas and under none.
"""

import math
import sys

import keras
import numpy as np
import pytest

import keras_strategies as ks
from mw_launch import PROGRAMS, worker_results
from test_multi_worker_training import _load, _weights

sys.path.insert(0, PROGRAMS)
from common import (GLOBAL_BATCH, adam, build_embedding_model, build_model, build_scaled_averaged_model,  # noqa: E402
                    data, embedding_data, keras_run, scaled_data)
from reference_loops import average_loss, split, squared_error, train  # noqa: E402

TOL = dict(rtol=1e-5, atol=1e-5)
@pytest.fixture(scope="module", params=[1, 2], ids=["2x1", "2x2"])
def run(request, tmp_path_factory):
    return worker_results(("sharded.py",), request.param, tmp_path_factory, "sharded_worker_{worker}.npz")


def _assert_close(got, expected):
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, **TOL)


def _one_process(out, initial="sharded_initial.npz"):
    model = build_model()
    model.set_weights(_load(out / initial))
    return model, keras_run(model, *data())


@pytest.mark.parametrize("stage", [1, 2])
def test_fit_evaluate_predict_equal_one_process(run, stage):
    out, per_worker, results = run
    _, expected = _one_process(out, "sharded_initial.npz" if stage == 1 else "sharded_initial_2.npz")
    prefix = "fit" if stage == 1 else "fit2"
    for worker in results:
        assert int(worker["num_replicas"]) == 2 * per_worker
        assert int(worker["stage" if stage == 1 else "stage_2"]) == stage
        for key in ("loss", "mae", "evaluate", "predict"):
            np.testing.assert_allclose(worker[f"{prefix}_{key}"], expected[key], err_msg=key, **TOL)
        _assert_close(_weights(worker, f"{prefix}_weights"), expected["weights"])


def test_stage_2_replicas_hold_one_piece_of_the_summed_gradients(run):
    out, per_worker, results = run
    replicas = 2 * per_worker
    sizes = [math.prod(w.shape) for w in _load(out / "sharded_initial_2.npz")]
    piece_bytes = 4 * sum(math.ceil(size / replicas) for size in sizes)  # float32
    for worker in results:
        assert worker["gradient_bytes_2"].tolist() == [piece_bytes] * per_worker


def test_every_replica_of_every_worker_holds_one_piece(run):
    out, per_worker, results = run
    replicas = 2 * per_worker
    sizes = [math.prod(w.shape) for w in _load(out / "sharded_initial.npz")]
    lengths = [math.ceil(size / replicas) for size in sizes]
    for task_id, worker in enumerate(results):
        assert int(worker["num_pieces"]) == replicas and int(worker["first_piece"]) == task_id * per_worker
        np.testing.assert_array_equal(worker["piece_lengths"], [lengths] * per_worker)
        # Adam's two moments, float32, for this replica's pieces: about 1/replicas of the whole slots.
        assert worker["slot_bytes"].tolist() == [2 * 4 * sum(lengths)] * per_worker
        assert 2 * 4 * sum(lengths) <= 2 * 4 * sum(sizes) / replicas + 2 * 4 * len(sizes)
        assert not bool(worker["optimizer_built_whole"])


def test_saved_under_the_cluster_loads_under_fewer_replicas_and_under_none(run):
    out, _, _ = run
    reference, _ = _one_process(out)
    plain = keras.models.load_model(out / "sharded.keras")  # no strategy: the optimizer built whole
    _assert_close([v.numpy() for v in plain.optimizer.variables], [v.numpy() for v in reference.optimizer.variables])
    _assert_close(plain.get_weights(), reference.get_weights())
    two = ks.experimental.ShardedDataParallelStrategy(["cpu:0", "cpu:1"])
    with two.scope():
        resumed = build_model()
        resumed.load_weights(out / "sharded.weights.h5")
    x, y = data()
    for model in (plain, resumed, reference):
        model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)
    assert not resumed.optimizer.built  # its state lives in two pieces
    _assert_close(two.extended.optimizer_state(resumed.optimizer).whole_values(),
                  [v.numpy() for v in reference.optimizer.variables])
    _assert_close(resumed.get_weights(), reference.get_weights())
    _assert_close(plain.get_weights(), reference.get_weights())


@pytest.mark.parametrize("stage", [1, 2])
def test_custom_loop_equals_one_process(run, stage):
    out, _, results = run
    model = build_model()
    model.set_weights(_load(out / ("sharded_loop_initial.npz" if stage == 1 else "sharded_loop_initial_2.npz")))
    losses = train(model, adam(), average_loss(squared_error), split(data(), GLOBAL_BATCH))
    prefix = "loop" if stage == 1 else "loop2"
    for worker in results:
        np.testing.assert_allclose(worker[f"{prefix}_losses"], losses, **TOL)
        _assert_close(_weights(worker, f"{prefix}_weights"), model.get_weights())


@pytest.mark.parametrize("name", ["scaled", "embedding"])
def test_stage_2_with_a_loss_scale_optimizer_averages_or_an_embedding_equals_one_process(run, name):
    """A LossScaleOptimizer (steps skipped while the gradients overflow, the scale of every worker
    the same) over use_ema's averages; an Embedding, whose gradient is sliced on TensorFlow."""
    out, _, results = run
    build, fit_data = {"scaled": (build_scaled_averaged_model, scaled_data),
                       "embedding": (build_embedding_model, embedding_data)}[name]
    model = build()
    model.set_weights(_load(out / f"sharded_{name}_initial.npz"))
    expected = keras_run(model, *fit_data())
    iterations = int(keras.ops.convert_to_numpy(model.optimizer.iterations))
    if name == "scaled":
        assert 0 < iterations < 8  # of 8 steps, some were skipped
    for worker in results:
        assert int(worker[f"{name}_iterations"]) == iterations
        for key in ("loss", "mae", "evaluate", "predict"):
            np.testing.assert_allclose(worker[f"{name}_{key}"], expected[key], err_msg=key, **TOL)
        _assert_close(_weights(worker, f"{name}_weights"), expected["weights"])
