"""keras-tuner searches with `distribution_strategy=` one of ours, as it does with tf.distribute's.

keras-tuner builds each trial's model in `distribution_strategy.scope()` and reads
`extended._in_multi_worker_mode()` and `extended.should_checkpoint` (only the chief reports
results). The same search without a strategy gives the same trials and scores: each trial's
`fit` equals one device on the same global batch.
"""

import keras
import numpy as np
import pytest

import keras_strategies as ks

keras_tuner = pytest.importorskip("keras_tuner")


def _data(rows, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 3)).astype("float32")
    return x, (x @ np.array([[1.0], [-2.0], [0.5]], "float32")).astype("float32")


def _search(directory, strategy):
    built = []

    def build(hp):
        model = keras.Sequential([
            keras.Input((3,)),
            keras.layers.Dense(hp.Int("units", 2, 6, step=2), activation="tanh"),
            keras.layers.Dense(1),
        ])
        model.compile(keras.optimizers.Adam(hp.Choice("learning_rate", [0.01, 0.05])), "mse")
        built.append(model)
        return model

    keras.utils.set_random_seed(5)
    tuner = keras_tuner.RandomSearch(build, objective="val_loss", max_trials=2, seed=3, directory=str(directory),
                                     project_name="search", distribution_strategy=strategy)
    x, y = _data(23, 0)  # batches of 8, 8 and 7 rows
    tuner.search(x, y, epochs=2, batch_size=8, validation_data=_data(9, 1), shuffle=False, verbose=0)
    trials = sorted(tuner.oracle.trials.values(), key=lambda trial: trial.trial_id)
    return tuner, built, [(trial.hyperparameters.values, trial.score) for trial in trials]


def test_a_search_under_mirrored_strategy_builds_in_its_scope_and_scores_trials_as_on_one_device(tmp_path):
    strategy = ks.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"])
    tuner, built, trials = _search(tmp_path / "mirrored", strategy)
    _, _, expected = _search(tmp_path / "plain", None)
    # keras-tuner's first build, outside the strategy, only declares the search space; every
    # trial's model is built in the strategy's scope.
    assert len(trials) == 2 and len(built) == 3
    assert all(strategy.extended.variable_created_in_scope(m.weights[0]) for m in built[1:])
    assert [values for values, _ in trials] == [values for values, _ in expected]
    np.testing.assert_allclose([score for _, score in trials], [score for _, score in expected], rtol=1e-5)
    assert not strategy.extended._in_multi_worker_mode() and strategy.extended.should_checkpoint
    best = tuner.get_best_models(1)[0]
    assert np.isfinite(best.evaluate(*_data(9, 1), verbose=0))
