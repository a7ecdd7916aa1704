"""keras-hub's task models, built from their configs, train under the strategies as on one device.

A BERT-style text classifier, a GPT-2-style causal language model and a ResNet image
classifier (random weights, no downloads, `tests/multi_worker/programs/hub_models.py`) are
fitted, evaluated, used to predict, saved and loaded under `MirroredStrategy` (3 replicas:
the last batch of each epoch is partial and splits unevenly, one replica getting no row) and
one of them under `CentralStorageStrategy`, and compared with plain Keras on one device, the
global batch the same. (Two replicas split every batch evenly, which the other strategy tests
cover; each further pairing would repeat the same code paths.) The
two-worker runs are in `tests/multi_worker/test_multi_worker_training.py`.
"""

import sys

import keras
import numpy as np
import pytest

import keras_strategies as ks

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "multi_worker" / "programs"))
import hub_models  # noqa: E402

TOL = dict(rtol=1e-5, atol=1e-5)
STRATEGIES = {
    "mirrored-3": lambda: ks.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"]),
    "central-storage-2": lambda: ks.CentralStorageStrategy(["cpu:0", "cpu:1"]),
}
# Every model under Mirrored; the causal language model (the one with the most outputs per row)
# under CentralStorage too.
CASES = [(name, "mirrored-3") for name in hub_models.MODELS] + [("gpt2_causal_lm", "central-storage-2")]


def _assert_close(got, expected, what):
    for i, (a, b) in enumerate(zip(keras.tree.flatten(got), keras.tree.flatten(expected))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), err_msg=f"{what} [{i}]", **TOL)


@pytest.mark.parametrize("model_name, strategy_name", CASES, ids=[f"{m}-{s}" for m, s in CASES])
def test_a_keras_hub_model_fits_evaluates_predicts_saves_and_loads_as_on_one_device(model_name, strategy_name,
                                                                                     tmp_path):
    build, make_data, batch_normalized = hub_models.MODELS[model_name]
    data = make_data()
    keras.utils.set_random_seed(1)
    reference = build()
    strategy = STRATEGIES[strategy_name]()
    with strategy.scope():
        model = build()
    model.set_weights(reference.get_weights())
    expected, got = hub_models.fit(reference, data), hub_models.fit(model, data)
    assert sorted(got) == sorted(expected)
    if batch_normalized:
        # Each replica normalizes its own rows in training (as under tf.distribute): the run
        # trains, and with the same weights, inference equals one device.
        assert all(np.isfinite(got["loss"])) and got["loss"][-1] < got["loss"][0]
        reference.set_weights(model.get_weights())
    else:
        for key in expected:
            np.testing.assert_allclose(got[key], expected[key], err_msg=key, **TOL)
        _assert_close(model.get_weights(), reference.get_weights(), "weights")
    _assert_close(hub_models.evaluate(model, data), hub_models.evaluate(reference, data), "evaluate")
    predictions = hub_models.predict(model, data)
    _assert_close(predictions, hub_models.predict(reference, data), "predict")

    path = str(tmp_path / f"{model_name}.keras")
    model.save(path)
    loaded = keras.models.load_model(path)  # outside every scope: a plain model
    assert type(loaded) is type(model)
    _assert_close(hub_models.predict(loaded, data), predictions, "predict after loading")
    with strategy.scope():
        loaded_in_scope = keras.models.load_model(path)
    assert strategy.extended.variable_created_in_scope(loaded_in_scope.trainable_variables[0])
    _assert_close(hub_models.evaluate(loaded_in_scope, data), hub_models.evaluate(model, data), "evaluate after loading")
