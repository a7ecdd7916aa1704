"""Two real worker processes on 127.0.0.1 train like one process on the same global batch.

MultiWorkerMirroredStrategy: `fit` / `evaluate` / `predict` and the guide's
custom loop on 2 workers x 1 and 2 workers x 2 devices give identical weights
on every worker, equal to a single-process run within 1e-5, including a
partial last batch (50 samples, global batch 16).
"""

import functools
import os
import sys

import keras
import numpy as np
import pytest

import mw_launch
from mw_launch import PROGRAMS, run_together, worker_results

sys.path.insert(0, PROGRAMS)
from common import (  # noqa: E402
    GLOBAL_BATCH, LOOPS, N, build_embedding_model, build_mixed_model, build_model, build_own_steps_model,
    build_penalty_model, build_sync_bn_model, build_two_output_model, data, embedding_run, evaluate_first_run, keras_run,
    reshuffled_run, seeded_shuffle_run, stopped_run, two_output_run, uneven_run,
)
import hub_models  # noqa: E402
from reference_loops import average_loss, split, squared_error, train  # noqa: E402

TOL = dict(rtol=1e-5, atol=1e-5)


def _load(path):
    archive = np.load(path)
    return [archive[f"arr_{i}"] for i in range(len(archive.files))]


def _weights(results, key):
    return [results[k] for k in sorted((k for k in results.files if k.startswith(key + "_")), key=lambda k: int(k.rsplit("_", 1)[1]))]


@pytest.fixture(scope="module", params=[1, 2], ids=["2x1", "2x2"])
def run(request, tmp_path_factory):
    # Tests that check one configuration only parametrize `run` themselves, which makes pytest
    # set the fixture up again: each configuration's program still runs once.
    return worker_results(("train.py",), request.param, tmp_path_factory, "worker_{worker}.npz")


def test_every_worker_holds_identical_weights(run):
    _, _, (first, second) = run
    for key in ("fit_weights", "loop_weights", "bn_loop_weights", "embedding_loop_weights", "unsync_loop_weights",
                "shuffled_weights", "own_weights", "bn_weights", "embedding_weights", "outputs_weights",
                "dropout_weights", "penalty_weights"):  # outputs: 2 x 1 only, dropout and penalty: 2 x 2 only
        for a, b in zip(_weights(first, key), _weights(second, key)):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("name, size", [("py_dataset", -(-N // GLOBAL_BATCH)), ("data_loader", N)],
                         ids=["PyDataset batches", "DataLoader rows"])
def test_shuffled_fit_reads_the_same_order_on_every_worker(run, name, size):
    # Each worker seeded its RNGs differently: in fit(shuffle=True) every worker takes over the
    # chief's states of the ones Keras' adapters shuffle with, so all read the same batches, each
    # epoch a permutation.
    _, _, (first, second) = run
    order = first[f"{name}_order"]
    np.testing.assert_array_equal(order, second[f"{name}_order"])
    epochs = order[-2 * size:].reshape(2, size)
    for epoch in epochs:
        assert sorted(epoch.tolist()) == list(range(size)), epochs
    assert epochs[0].tolist() != epochs[1].tolist()  # reshuffled each epoch


@pytest.mark.parametrize("run", [2], indirect=True, ids=["2x2"])  # the workers run it on 2 x 2 only
def test_every_replica_of_every_worker_draws_its_own_random_numbers(run):
    _, replicas, results = run
    first, second = results
    draws = first["replica_draws"]
    assert len(set(draws.tolist())) == 2 * replicas, draws
    np.testing.assert_array_equal(draws, second["replica_draws"])
    np.testing.assert_array_equal(first["seed_state"], second["seed_state"])
    # One row per replica: a dropout mask repeated on every replica would keep each feature in
    # 0 or all rows (the identical weights of both workers are checked above).
    counts = first["dropout_counts"]
    assert ((counts > 0) & (counts < 2 * replicas)).any(), counts


def test_a_callback_stopping_one_worker_stops_every_worker_after_that_epoch(run):
    _, _, results = run
    assert [int(worker["chief_stop_epochs"]) for worker in results] == [2, 2]


def _assert_equal_to_one_process(out, results, name, build, run_keras, keys, tol=TOL):
    """Every worker's `<name>_<key>` results and weights equal `run_keras` in this one process,
    from the chief's initial weights; returns the one-process results."""
    model = build()
    model.set_weights(_load(out / f"{name}_initial.npz"))
    expected = run_keras(model, *data())
    for worker in results:
        for key in keys:
            np.testing.assert_allclose(worker[f"{name}_{key}"], expected[key], err_msg=key, **tol)
        for got, weights in zip(_weights(worker, f"{name}_weights"), expected["weights"]):
            np.testing.assert_allclose(got, weights, **tol)
    return expected


def _check_stopped_run(out, results, name, build):
    # In one process the callback stops the run: one epoch of 2 steps, one batch of predictions.
    expected = _assert_equal_to_one_process(out, results, name, build, stopped_run, ("loss", "evaluate", "predict"))
    assert expected["epochs"] == 1 and len(expected["predict"]) == GLOBAL_BATCH
    assert [int(worker[f"{name}_epochs"]) for worker in results] == [1, 1]


def test_fit_after_evaluate_on_a_new_model_equals_a_single_process_run(run):
    # Evaluate's steps have already agreed how the workers exchange their rows, so the first
    # train step of the model is not the first step of all (on TensorFlow it runs with its
    # exchange inside the compiled step at once).
    out, _, results = run
    _assert_equal_to_one_process(out, results, "evaluated_first", build_model, evaluate_first_run,
                                 ("evaluate_first", "loss"))


@pytest.mark.parametrize("run", [2], indirect=True, ids=["2x2"])  # the workers run it on 2 x 2 only
def test_a_callback_stopping_one_worker_within_an_epoch_stops_every_worker_at_that_step(run):
    # fit after batch 1, evaluate and predict after batch 0, asked on the chief alone: every
    # worker stops there, and the results equal one process stopped by the same callback.
    out, _, results = run
    _check_stopped_run(out, results, "stopped", build_model)


@pytest.mark.parametrize("run", [1], indirect=True, ids=["2x1"])  # the workers run it on 2 x 1 only
def test_a_one_worker_stop_within_an_epoch_stops_a_model_with_its_own_steps_at_that_step(run):
    out, _, results = run
    _check_stopped_run(out, results, "own_stopped", build_own_steps_model)


@pytest.mark.parametrize(
    "name, build, run_keras",
    [("fit", build_model, keras_run), ("own", build_own_steps_model, keras_run), ("bn", build_sync_bn_model, keras_run),
     ("embedding", build_embedding_model, embedding_run)],
    ids=["Keras steps", "model's own steps", "synchronized BatchNormalization", "Embedding with Adam"],
)
def test_fit_evaluate_predict_equal_a_single_process_run(run, name, build, run_keras):
    out, _, results = run
    _assert_equal_to_one_process(out, results, name, build, run_keras, ("loss", "mae", "evaluate", "predict"))


@pytest.mark.parametrize("run", [2], indirect=True, ids=["2x2"])  # the workers run it on 2 x 2 only
def test_add_loss_and_synchronized_batch_norm_on_uneven_shards_equal_a_single_process_run(run):
    # A global batch of 15 on 4 replicas: shards (4, 4 | 4, 3), the last batch (2, 1 | 1, 1). JAX would
    # pad one worker's shards, and padding rows would enter the add_loss term: every worker runs
    # those steps eagerly, unpadded, with matching cross-worker sums for the batch statistics.
    out, _, results = run
    _assert_equal_to_one_process(out, results, "penalty", build_penalty_model, uneven_run,
                                 ("loss", "mae", "evaluate", "predict"))


@pytest.mark.parametrize("run", [1], indirect=True, ids=["2x1"])  # the workers run it on 2 x 1 only
def test_dict_targets_and_per_loss_reductions_equal_a_single_process_run(run):
    out, _, results = run
    _assert_equal_to_one_process(out, results, "outputs", build_two_output_model, two_output_run,
                                 ("loss", "c_loss", "r_loss", "c_accuracy", "evaluate"))


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
@pytest.mark.parametrize("run", [1], indirect=True, ids=["2x1"])  # the workers run it on 2 x 1 only
def test_mixed_precision_equals_a_single_process_run(run, policy):
    # Half floats round differently when summed in another order: the in-process tolerance.
    out, _, results = run
    for a, b in zip(_weights(results[0], f"{policy}_weights"), _weights(results[1], f"{policy}_weights")):
        np.testing.assert_array_equal(a, b)
    _assert_equal_to_one_process(out, results, policy, functools.partial(build_mixed_model, policy), keras_run,
                                 ("loss", "mae", "evaluate", "predict"), tol=dict(rtol=1e-2, atol=1e-2))


@pytest.mark.parametrize("run", [1], indirect=True, ids=["2x1"])  # the workers run it on 2 x 1 only
def test_without_a_shared_file_system_only_the_chiefs_directory_keeps_files(run):
    # Each worker wrote through CSVLogger, ModelCheckpoint, TensorBoard, Model.save / save_weights
    # and keras.saving / keras.models functions into a directory of its own.
    out, _, _ = run

    def files(task):
        root = out / f"files_{task}"
        return sorted(os.path.relpath(os.path.join(path, name), root).split(os.sep)[0]
                      for path, _, names in os.walk(root) for name in names)

    assert sorted(set(files(0))) == ["ckpt", "log.csv", "method.keras", "method.weights.h5", "models_function.keras",
                                     "saving_function.keras", "saving_function.weights.h5", "tb"]
    assert files(1) == []
    assert not [path for path, dirs, _ in os.walk(out / "files_1") if any("workertemp" in d for d in dirs)]
    assert len((out / "files_0" / "log.csv").read_text().splitlines()) == 2  # header, one epoch


@pytest.mark.parametrize("run", [1], indirect=True, ids=["2x1"])  # the workers run it on 2 x 1 only
def test_a_seeded_tf_data_dataset_that_reshuffles_trains_like_one_process(run):
    out, _, results = run
    _assert_equal_to_one_process(out, results, "reshuffled", build_model, reshuffled_run, ("loss",))


@pytest.mark.parametrize("run", [1], indirect=True, ids=["2x1"])  # the workers run it on 2 x 1 only
def test_a_second_strategy_shares_the_cluster_and_another_cluster_is_refused(run):
    out, _, results = run
    _assert_equal_to_one_process(out, results, "again", build_model, keras_run, ("loss", "evaluate", "predict"))
    for index, worker in enumerate(results):
        message = str(worker["other_cluster_error"])
        assert f"already joined a cluster as worker {index} (127.0.0.1:" in message, message
        assert "cannot join another (worker" in message and "same TF_CONFIG" in message, message


def test_evaluate_on_a_py_dataset_equals_evaluate_on_arrays(run):
    # Same weights (after the 2 unshuffled epochs), same global batches: the arrays' result is
    # checked against a single process above.
    _, _, results = run
    for worker in results:
        np.testing.assert_allclose(worker["evaluate_py_dataset"], worker["fit_evaluate"], **TOL)


@pytest.mark.parametrize("name", list(LOOPS), ids=["Dense model", "synchronized BatchNormalization", "Embedding with Adam"])
def test_custom_loop_equals_a_single_process_run(run, name):
    # One process: the backend's own gradient step without ks (`tests/reference_loops.py`) on
    # each global batch's mean squared error plus the regularization losses. In one process the
    # global batch statistics are the local ones: unsynchronized BatchNormalization (Keras' own
    # synchronized moments on TensorFlow compute E[x^2] - E[x]^2, whose rounding differs by about
    # 1e-5 from the two-pass variance after a few steps).
    out, _, results = run
    build, make_optimizer, make_data = LOOPS[name]
    model = build_sync_bn_model(synchronized=False) if build is build_sync_bn_model else build()
    model.set_weights(_load(out / f"{name}_initial.npz"))
    losses = train(model, make_optimizer(), average_loss(squared_error), split(make_data(), GLOBAL_BATCH))
    for worker in results:
        np.testing.assert_allclose(worker[f"{name}_losses"], losses, **TOL)
        for got, expected in zip(_weights(worker, f"{name}_weights"), model.get_weights()):
            np.testing.assert_allclose(got, expected, **TOL)


def test_metrics_updated_in_strategy_run_are_global_on_every_worker(run):
    # Every sample once: the mean of the first feature and the row count of the whole dataset.
    _, _, results = run
    x, _ = data()
    for worker in results:
        np.testing.assert_allclose(worker["loop_metrics"], [x[:, 0].mean(), len(x)], **TOL)


def test_count_metrics_of_fit_and_evaluate_count_every_row_once_on_every_worker(run):
    # True positives plus false negatives of every row: `fit`'s epoch log, `evaluate`'s and
    # `get_metrics_result()` afterwards are the row count, not a multiple of it.
    _, _, results = run
    for worker in results:
        np.testing.assert_array_equal(worker["count_metrics"], [N, N, N])


def test_collectives_span_every_replica_of_every_worker(run):
    _, devices, results = run
    replicas = 2 * devices
    for worker in results:
        assert int(worker["num_replicas"]) == replicas
        np.testing.assert_allclose(worker["all_reduce"], [replicas * (replicas + 1) / 2] * 2)
        np.testing.assert_allclose(worker["gather"], np.arange(replicas, dtype="float32"))
        np.testing.assert_allclose(worker["reduce_to"], [replicas * (replicas - 1) / 2])
        np.testing.assert_allclose(worker["value_ids"], np.arange(replicas, dtype="float32"))


def test_all_reduce_in_strategy_run_is_differentiable_across_workers(run):
    _, devices, results = run
    replicas = 2 * devices
    total = replicas * (replicas + 1) / 2  # S, the sum of the scales 1..R
    for index, worker in enumerate(results):
        scales = np.arange(index * devices, (index + 1) * devices) + 1
        np.testing.assert_allclose(worker["all_reduce_grads"], replicas * 2 * total * scales)


def test_a_shuffled_fit_with_validation_draws_the_order_of_one_process_seeded_like_the_chief(run):
    # The workers seeded their RNGs differently (300 + task id); fit(shuffle=True) reads the
    # backend's own pipeline with the chief's RNG states on every worker, so the run equals one
    # process seeded with the chief's 300, validation (a torch DataLoader draws a seed) included.
    out, _, results = run
    _assert_equal_to_one_process(out, results, "seeded_shuffle", build_model,
                                 functools.partial(seeded_shuffle_run, seed=300), ("loss", "val_loss"))


def test_a_model_built_inside_run_takes_the_chiefs_initial_values_at_once(run):
    _, _, (first, second) = run
    kernel, bias, out_kernel, out_bias = _weights(first, "lazy_weights")
    for a, b in zip(_weights(first, "lazy_weights"), _weights(second, "lazy_weights")):
        np.testing.assert_array_equal(a, b)  # the workers seeded differently: these are the chief's
    x, _ = data()
    expected = np.tanh(x[:GLOBAL_BATCH] @ kernel + bias) @ out_kernel + out_bias
    for worker in (first, second):
        np.testing.assert_allclose(worker["lazy_outputs"], expected, **TOL)


if keras.backend.backend() == "torch":  # `TorchModuleWrapper` exists on PyTorch only (not skipped elsewhere: absent)

    def test_torch_module_buffers_are_averaged_over_every_replica_of_every_worker(run):
        _, devices_per_worker, (first, second) = run
        replicas = 2 * devices_per_worker
        for a, b in zip(_weights(first, "torch_buffers"), _weights(second, "torch_buffers")):
            np.testing.assert_array_equal(a, b)
        x, _ = data()
        mean, var = np.zeros(5), np.ones(5)
        for start in range(0, 46, GLOBAL_BATCH):
            batch = x[start:min(start + GLOBAL_BATCH, 46)]
            sizes = [len(batch) // replicas + (i < len(batch) % replicas) for i in range(replicas)]
            shards = np.split(batch, np.cumsum(sizes)[:-1])
            mean = np.mean([0.9 * mean + 0.1 * shard.mean(0) for shard in shards], 0)
            var = np.mean([0.9 * var + 0.1 * shard.var(0, ddof=1) for shard in shards], 0)
        running_mean, running_var, batches = _weights(first, "torch_buffers")
        np.testing.assert_allclose(running_mean, mean, **TOL)
        np.testing.assert_allclose(running_var, var, **TOL)
        assert int(batches) == 3


def test_a_cluster_on_127_0_0_1_listens_on_the_loopback_interface_only(run):
    """TensorFlow's gRPC server is the exception: TensorFlow binds it to every interface, with no
    option to change it (docs/guide/multi-worker.md#network-exposure); it is on the task's own port."""
    import ipaddress

    _, _, workers = run
    for task, results in enumerate(workers):
        listening = [entry.split() for entry in results["listening"].tolist()]
        assert listening, f"worker {task} listens on nothing"
        outside = []
        for host, port in listening:
            address = ipaddress.ip_address(host)
            if not (getattr(address, "ipv4_mapped", None) or address).is_loopback:
                outside.append((host, port))
        if keras.backend.backend() == "tensorflow":
            assert outside == [("::", str(results["own_port"]))], (task, listening)
        else:
            assert not outside, (task, listening)


def test_the_launcher_relays_no_gloo_connection_lines(run):
    # JAX's gloo prints one per communicator and worker; the launcher keeps them out.
    _, devices, _ = run
    launched, _ = mw_launch._together[devices]
    assert "[worker 0]" in launched.stdout and "[Gloo]" not in launched.stdout + launched.stderr, launched


@pytest.mark.parametrize("model_name", hub_models.TWO_WORKER_MODELS)
def test_keras_hub_models_on_two_workers_equal_a_single_process_run(tmp_path_factory, model_name):
    """keras-hub's task models (`programs/hub_models.TWO_WORKER_MODELS`) fitted by two workers equal
    one process on the global batch (a model with BatchNormalization, which normalizes each
    worker's rows by their own statistics as under tf.distribute, is checked by its inference
    with the trained weights)."""
    out = run_together(("keras_hub_fit.py",), 1, tmp_path_factory)
    workers = [np.load(out / f"hub_worker_{i}.npz") for i in range(2)]
    build, make_data, batch_normalized = hub_models.MODELS[model_name]
    data = make_data()
    reference = build()
    reference.set_weights(_load(out / f"hub_{model_name}_initial.npz"))
    history = hub_models.fit(reference, data)
    tol = dict(rtol=1e-5, atol=1e-5)
    # The chief's saved model, loaded as a plain model, predicts what it did (one device computes
    # in another order); the other worker's save wrote no file there.
    assert float(workers[0][f"{model_name}/loaded_difference"]) <= 1e-5
    assert f"{model_name}/loaded_difference" not in workers[1].files
    assert sorted(p.name for p in out.glob(f"hub_{model_name}*.keras")) == [f"hub_{model_name}.keras"]
    for results in workers:
        weights = _weights_of(results, model_name)
        for a, b in zip(weights, _weights_of(workers[0], model_name)):
            np.testing.assert_array_equal(a, b)  # every worker holds the same weights
        if batch_normalized:
            losses = results[f"{model_name}/history/loss"]
            assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
            reference.set_weights(weights)
        else:
            for key, values in history.items():
                np.testing.assert_allclose(results[f"{model_name}/history/{key}"], values, err_msg=key, **tol)
            for got, expected in zip(weights, reference.get_weights()):
                np.testing.assert_allclose(got, expected, **tol)
        for key, value in hub_models.evaluate(reference, data).items():
            np.testing.assert_allclose(results[f"{model_name}/evaluate/{key}"], value, err_msg=key, **tol)
        np.testing.assert_allclose(results[f"{model_name}/predict"], hub_models.predict(reference, data), **tol)


def _weights_of(results, model_name):
    keys = [k for k in results.files if k.startswith(f"{model_name}/weight/")]
    return [results[k] for k in sorted(keys, key=lambda k: int(k.rsplit("/", 1)[1]))]
