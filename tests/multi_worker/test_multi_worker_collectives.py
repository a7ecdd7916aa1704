"""The engines' cross-worker sum, with real processes on 127.0.0.1.

Small tensors travel packed per dtype; large donated tensors are summed on
their own without a copy (`multi_worker/packing.py`). Both must give exact
sums, leave kept inputs alone, and train a model with a large gradient like
one process.
"""

import json
import os
import sys

import keras
import numpy as np
import pytest

from mw_launch import PROGRAMS, run_together

sys.path.insert(0, PROGRAMS)
from common import (  # noqa: E402
    GLOBAL_BATCH, WIDE, build_model, build_wide_model, collective_values, data, keras_run, scatter_values, wide_data,
)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = run_together(("collectives.py",), 1, tmp_path_factory)
    return out, [np.load(out / f"worker_{i}.npz") for i in range(2)]


def _expected():
    return [a + b for a, b in zip(collective_values(0), collective_values(1))]


def test_kept_values_are_summed_exactly_and_left_unchanged(results):
    _, workers = results
    for worker in workers:
        assert bool(worker["inputs_unchanged"])
        for i, expected in enumerate(_expected()):
            got = worker[f"kept_{i}"]
            assert got.shape == expected.shape and got.dtype == expected.dtype, i
            np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


def test_all_gather_stacks_every_workers_values_in_worker_order(results):
    _, workers = results
    for worker in workers:
        for i, (first, second) in enumerate(zip(collective_values(0), collective_values(1))):
            got = worker[f"gathered_{i}"]
            assert got.shape == (2, *first.shape) and got.dtype == first.dtype, i
            np.testing.assert_array_equal(got, np.stack([first, second]))


def test_reduce_scatter_gives_each_worker_its_row_summed(results):
    _, workers = results
    for w, worker in enumerate(workers):
        for i, (first, second) in enumerate(zip(scatter_values(0), scatter_values(1))):
            expected = first[w] + second[w]
            for k in range(2):
                got = worker[f"scattered_{k}_{i}"]
                assert got.shape == expected.shape and got.dtype == expected.dtype, (i, k)
                np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


def test_results_held_by_the_caller_survive_later_sums(results):
    _, workers = results
    for worker in workers:
        for i, expected in enumerate(_expected()):
            np.testing.assert_allclose(worker[f"held_{i}"], expected, rtol=1e-6, atol=1e-6)


def test_repeated_signatures_get_the_sums_of_each_call(results):
    _, workers = results
    for worker in workers:
        for k in range(4):
            for i, expected in enumerate(_expected()):
                np.testing.assert_allclose(worker[f"repeated_{k}_{i}"], expected * (k + 1), rtol=1e-6, atol=1e-5)
            np.testing.assert_array_equal(worker[f"between_{k}"], np.full((3,), 2 * k + 1.0))
        past_cap = sorted(name for name in worker.files if name.startswith("past_cap_"))
        assert len(past_cap) == (4 if keras.backend.backend() == "tensorflow" else 0)  # TF's keyed programs
        for name in past_cap:
            k, n = (int(part) for part in name.split("_")[2:])
            np.testing.assert_array_equal(worker[name], np.full((n,), 2 * k + 1.0))


def test_donated_values_are_summed_once_even_when_given_twice(results):
    _, workers = results
    expected = _expected()
    expected.append(expected[0])
    for worker in workers:
        for i, value in enumerate(expected):
            np.testing.assert_allclose(worker[f"donated_{i}"], value, rtol=1e-6, atol=1e-6)


@pytest.fixture(scope="module")
def wide_on_2x2(tmp_path_factory):
    out = run_together(("collectives.py", "wide-only"), 2, tmp_path_factory)
    return out, [np.load(out / f"worker_{i}.npz") for i in range(2)]


@pytest.fixture(params=["results", "wide_on_2x2"], ids=["2x1", "2x2"])
def wide(request):
    """The wide model's `fit` on 2 workers x 1 device (with the other checks) and x 2 devices (alone)."""
    return request.getfixturevalue(request.param)


def test_a_model_with_large_gradients_trains_like_one_process(wide):
    out, workers = wide
    initial = np.load(os.path.join(out, "wide_initial.npz"))
    model = build_wide_model()
    model.set_weights([initial[f"arr_{i}"] for i in range(len(initial.files))])
    x, y = wide_data()
    reference = keras_run(model, x, y)
    for worker in workers:
        for i, weight in enumerate(reference["weights"]):
            # Adam moves a weight by up to its learning rate (1e-3) a step whatever the gradient's size,
            # so where a gradient element is near zero, the rounding of its sum (two workers' 128-row
            # products against one 256-row product) can move that weight differently by about 1e-5 over
            # the two epochs: seen on one element of the 512 x 512 kernel on some CPUs. One worker's
            # gradient lost or counted twice would change the update by the order of a whole step.
            np.testing.assert_allclose(worker[f"weights_{i}"], weight, rtol=1e-5, atol=2e-5)
        for key in ("loss", "mae", "evaluate", "predict"):
            np.testing.assert_allclose(worker[key], np.asarray(reference[key]), rtol=1e-5, atol=1e-5)


def test_every_step_hands_its_large_gradients_to_the_exchange_as_they_are(wide, request):
    # The engine decides the layout: torch and JAX sum each 1 MiB gradient on its own, without a
    # copy into a pack, TF packs per dtype as its own strategy does. Torch with one replica per
    # worker sends its gradients in buckets during the backward pass, copied into the bucket (a
    # gradient autograd reports may still be in use), but the last bucket after it, as above.
    # (Packing all gradients into one buffer in JAX's replica program was tried: the copy cost
    # what fewer gloo calls saved.)
    _, workers = wide
    for worker in workers:
        sent = [size for call in json.loads(str(worker["large_sent"])) for size in call]
        eager_steps = 8 - _steps_exchanging_in_program(worker, request)
        assert sent == [WIDE * WIDE] * 2 * eager_steps, sent  # both gradients, every step of 2 epochs


def test_a_train_step_leaves_no_reference_cycles(wide):
    # Its exchange holds the predictions and, through them, the autograd graph: in a cycle, every
    # step's graph would stay alive until the garbage collector ran (and steps got slower).
    _, workers = wide
    for worker in workers:
        assert json.loads(str(worker["step_objects_in_cycles"])) == []


def _overlaps(request) -> bool:
    """Whether the wide model's gradients go in buckets during the backward pass: PyTorch, one replica per worker."""
    return keras.backend.backend() == "torch" and request.node.callspec.id == "2x1"


def test_gradients_are_sent_during_the_backward_pass_where_the_engine_reports_them(wide, request):
    # With bytes_per_pack=1, each gradient is a bucket of its own, sent as soon as autograd has
    # computed it, but the last, which goes after the backward pass with the loss, predictions
    # and targets. TensorFlow and JAX compute the gradients in one program: everything goes
    # after it. Every path sends the first step's rows again (see `ReplicaStep._start_exchange`).
    _, workers = wide
    for worker in workers:
        started = json.loads(str(worker["sums_started"]))
        assert {what for what, _ in started} >= {"gradient all-reduce"}
        grads = [inside for what, inside in started if what == "gradient all-reduce"]
        in_program = _steps_exchanging_in_program(worker, request)
        if _overlaps(request):
            assert len(grads) == 8 * 6 + 1 and sum(grads) == 8 * 5, started  # 6 gradients per step, 8 steps
        else:
            assert len(grads) == 8 - in_program + 1 and not any(inside for _, inside in started), started


def _steps_exchanging_in_program(worker, request) -> int:
    """Train steps (of 8) whose exchange ran inside the compiled step: on TensorFlow every step but
    the first, which agrees the rows capacity in the eager exchange, and, on 2 x 2 devices, the
    two partial batches of 2 rows (fewer than the 4 replicas); elsewhere none."""
    in_program = int(worker["steps_exchanging_in_program"])
    expected = (7 if request.node.callspec.id == "2x1" else 5) if keras.backend.backend() == "tensorflow" else 0
    assert in_program == expected
    return in_program


@pytest.mark.parametrize("name", ["keras_steps", "own_steps"], ids=["Keras steps", "model's own steps"])
def test_workers_reading_batches_of_different_sizes_get_a_clear_error_and_stay_in_step(results, name):
    _, workers = results
    for worker in workers:
        message = str(worker[f"{name}_different_sizes_error"])
        assert "global batches of different sizes" in message and "seed" in message, message
    # Both failed at the same step, before its update, and then trained in step.
    assert len({int(worker[f"{name}_iterations_after_error"]) for worker in workers}) == 1
    first, second = (worker[f"{name}_fit_after_error"] for worker in workers)
    np.testing.assert_array_equal(first, second)


def test_a_model_freed_by_one_workers_garbage_collector_alone_leaves_the_workers_in_step(results):
    _, workers = results
    first, second = workers
    np.testing.assert_array_equal(first["after_dropped_loss"], second["after_dropped_loss"])
    np.testing.assert_array_equal(first["after_dropped_weights"], second["after_dropped_weights"])


def test_a_model_changed_by_the_chief_alone_as_training_begins_trains_from_the_chiefs_state(results):
    _, workers = results
    first, second = workers
    np.testing.assert_array_equal(first["chief_set_loss"], second["chief_set_loss"])
    np.testing.assert_array_equal(first["chief_set_weights"], second["chief_set_weights"])
    # Not the weights the model was built with: training began from the chief's 0.05s.
    x, y = data()
    reference = build_model()
    reference.set_weights([np.full(w.shape, 0.05, w.dtype) for w in reference.get_weights()])
    reference.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, verbose=0, shuffle=False)
    np.testing.assert_allclose(first["chief_set_weights"],
                               np.concatenate([w.ravel() for w in reference.get_weights()]), rtol=1e-5, atol=1e-6)


def test_workers_with_different_variables_get_a_clear_error(results):
    _, workers = results
    for worker in workers:
        message = str(worker["different_variables_error"])
        assert "created different variables" in message, message
        assert "worker 0: 1 variable(s), 3 values, worker 1: 2 variable(s), 6 values" in message, message
