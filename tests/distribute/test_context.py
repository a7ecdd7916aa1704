"""The strategy stack: current strategy, contexts, scopes."""

import keras
import numpy as np
import pytest

import keras_strategies as ks


def test_outside_every_scope_the_default_strategy_is_current():
    strategy = ks.get_strategy()
    assert strategy is ks.get_strategy()  # a singleton
    assert strategy.num_replicas_in_sync == 1
    assert not ks.has_strategy()
    assert not ks.in_cross_replica_context()
    replica_context = ks.get_replica_context()
    assert replica_context.replica_id_in_sync_group == 0
    assert replica_context.num_replicas_in_sync == 1
    assert replica_context.strategy is strategy


def test_scope_enters_cross_replica_context_and_run_enters_replica_context():
    strategy = ks.OneDeviceStrategy("cpu:0")
    with strategy.scope():
        assert ks.get_strategy() is strategy
        assert ks.has_strategy()
        assert ks.in_cross_replica_context()
        assert ks.get_replica_context() is None

        def fn():
            assert not ks.in_cross_replica_context()
            context = ks.get_replica_context()
            return context.replica_id_in_sync_group, context.num_replicas_in_sync, ks.get_strategy()

        assert strategy.run(fn) == (0, 1, strategy)
    assert ks.get_strategy() is not strategy
    assert not ks.has_strategy()


def test_run_outside_scope_is_in_replica_context_of_that_strategy():
    strategy = ks.OneDeviceStrategy("cpu:0")
    seen = strategy.run(lambda: (ks.get_strategy(), ks.has_strategy(), ks.in_cross_replica_context()))
    assert seen == (strategy, True, False)


def test_nesting_the_same_scope_is_fine_and_mixing_strategies_raises():
    first, second = ks.OneDeviceStrategy("cpu:0"), ks.OneDeviceStrategy("cpu:1")
    with first.scope():
        with first.scope():
            assert ks.get_strategy() is first
        assert ks.get_strategy() is first
        with pytest.raises(RuntimeError, match="Mixing different distribution strategies"):
            with second.scope():
                pass
        assert ks.get_strategy() is first


def test_scope_of_the_same_strategy_inside_run_keeps_replica_context():
    strategy = ks.OneDeviceStrategy("cpu:0")

    def fn():
        with strategy.scope():
            return ks.get_replica_context() is not None

    assert strategy.run(fn) is True


def test_experimental_set_strategy_sets_and_clears():
    strategy = ks.OneDeviceStrategy("cpu:0")
    ks.experimental_set_strategy(strategy)
    try:
        assert ks.get_strategy() is strategy
        assert ks.in_cross_replica_context()
    finally:
        ks.experimental_set_strategy(None)
    assert not ks.has_strategy()
    assert ks.get_replica_context().replica_id_in_sync_group == 0


def test_default_strategy_scope_is_a_pass_through():
    strategy = ks.get_strategy()
    with strategy.scope():
        assert ks.get_strategy() is strategy
        assert not ks.has_strategy()
        assert not ks.in_cross_replica_context()
        assert ks.get_replica_context() is not None


def test_seed_idiom_with_the_default_strategy_trains_like_plain_keras():
    """`if GPUs: MirroredStrategy() else: ks.get_strategy()` then `with strategy.scope()`."""
    gpus = [d for d in ks.list_devices() if d.startswith("gpu")]
    assert not gpus  # this test documents the CPU branch of the idiom
    strategy = ks.get_strategy()
    x, y = np.full((8, 1), 2.0, "float32"), np.ones((8, 1), "float32")
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((1,)), keras.layers.Dense(1, kernel_initializer="ones", use_bias=False)]
        )
        model.compile(loss="mse", optimizer=keras.optimizers.SGD(0.01))
    history = model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    # One SGD step on (2 -> 1): loss 1, gradient 2 * (2 - 1) * 2 = 4, w = 1 - 0.01 * 4.
    assert history.history["loss"] == pytest.approx([1.0])
    np.testing.assert_allclose(keras.ops.convert_to_numpy(model.weights[0]), [[0.96]], atol=1e-6)


def test_replica_context_collectives_with_one_replica_return_the_value():
    strategy = ks.OneDeviceStrategy("cpu:0")

    def fn():
        context = ks.get_replica_context()
        merged = context.merge_call(lambda s, v: (s is strategy, ks.in_cross_replica_context(), v), args=(5,))
        return context.all_reduce("sum", 3.0), context.all_gather(7, axis=0), merged

    assert strategy.run(fn) == (3.0, 7, (True, True, 5))
