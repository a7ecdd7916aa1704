"""TensorFlow's multi-worker Keras tutorial runs with `ks` on two local workers."""

import os

import numpy as np

from mw_launch import check, run_program


def test_tf_multi_worker_keras_tutorial_flow(tmp_path):
    run = check(run_program("tf_tutorial.py", [tmp_path], workers=2, devices_per_worker=1))
    assert "[worker 0] Epoch 2/2" in run.stdout, run.stdout
    assert "accuracy" in run.stdout
    assert not [line for line in run.stdout.splitlines() if line.startswith("[worker 1] Epoch")]
    assert run.stdout.count("RELOADED") == 2
    assert sorted(os.listdir(tmp_path)) == ["keras-model.keras", "weights_0.npz", "weights_1.npz"]
    first, second = np.load(tmp_path / "weights_0.npz"), np.load(tmp_path / "weights_1.npz")
    for key in first.files:
        np.testing.assert_array_equal(first[key], second[key])
