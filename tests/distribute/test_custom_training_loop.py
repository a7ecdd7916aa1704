"""The distributed-training guide's custom loop, ported to ks, trains like one device.

Each test runs the loop under a `MirroredStrategy` and compares it with the same training
written without keras_strategies (`tests/reference_loops.py`: the backend's own gradient step
on one device, from the same initial weights).
"""

import os
import sys

import keras
import numpy as np
import pytest
from keras import ops

import keras_strategies as ks

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "multi_worker", "programs"))
from common import GLOBAL_BATCH, build_sync_bn_model, guide_loop  # noqa: E402
from common import data as regression_data  # noqa: E402
from reference_loops import average_loss, binary_crossentropy_from_logits, split, squared_error, train  # noqa: E402

TOL = dict(rtol=1e-5, atol=1e-5)


def data(n=48):
    rng = np.random.default_rng(11)
    x = rng.normal(size=(n, 1)).astype("float32")
    return x, (x > 0.2).astype("float32")


def assert_trained_alike(losses, weights, expected_losses, expected_weights):
    np.testing.assert_allclose(losses, expected_losses, **TOL)
    assert len(weights) == len(expected_weights)
    for got, expected in zip(weights, expected_weights):
        np.testing.assert_allclose(got, expected, **TOL)


def guide_model():
    return keras.Sequential(
        [keras.Input((1,)), keras.layers.Dense(1, kernel_initializer="ones", kernel_regularizer=keras.regularizers.L2(1e-4))]
    )


def run_guide_loop(strategy, global_batch_size, n=48, pass_global_batch_size=False, explicit_steps=10):
    """The guide's loop with `ks` for `tf.distribute` and `ks.value_and_grad` for the tape: one pass
    over the distributed dataset, then `explicit_steps` steps from an iterator over it repeated."""
    with strategy.scope():
        model = guide_model()
        optimizer = keras.optimizers.SGD(0.1)
    dataset = strategy.make_experimental_numpy_dataset(data(n)).batch(global_batch_size)
    dist_dataset = strategy.experimental_distribute_dataset(dataset)
    loss_object = keras.losses.BinaryCrossentropy(from_logits=True, reduction="none")

    def compute_loss(labels, predictions):
        per_example_loss = loss_object(labels, predictions)
        if pass_global_batch_size:
            loss = ks.compute_average_loss(per_example_loss, global_batch_size=global_batch_size)
        else:
            loss = ks.compute_average_loss(per_example_loss)
        if model.losses:
            loss += ks.scale_regularization_loss(ops.sum(ops.stack(model.losses)))
        return loss

    def train_step(inputs):
        features, labels = inputs

        def loss_fn():
            return compute_loss(labels, model(features, training=True))

        loss, gradients = ks.value_and_grad(loss_fn, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        return loss

    @ks.function
    def distributed_train_step(dist_inputs):
        per_replica_losses = strategy.run(train_step, args=(dist_inputs,))
        return strategy.reduce(ks.ReduceOp.SUM, per_replica_losses, axis=None)

    losses = [float(ops.convert_to_numpy(distributed_train_step(inputs))) for inputs in dist_dataset]
    iterator = iter(strategy.experimental_distribute_dataset(dataset.repeat()))
    losses += [float(ops.convert_to_numpy(distributed_train_step(next(iterator)))) for _ in range(explicit_steps)]
    return losses, model.get_weights()


def reference_guide_loop(global_batch_size, n=48, explicit_steps=10):
    """`run_guide_loop` on one device: each step's loss is divided by `global_batch_size`, that of
    a partial last batch too."""
    model = guide_model()
    batches = split(data(n), global_batch_size) + split(data(n), global_batch_size, steps=explicit_steps)
    loss_fn = average_loss(binary_crossentropy_from_logits, global_batch_size)
    losses = train(model, keras.optimizers.SGD(0.1), loss_fn, batches)
    return losses, model.get_weights()


@pytest.mark.parametrize("replicas", [1, 2, 3, 4])
def test_guide_loop_with_a_regularized_model_trains_like_one_device(replicas):
    # Batches of 12 split evenly on 1 to 4 replicas: the default divisor is the global batch size.
    strategy = ks.MirroredStrategy(devices=[f"cpu:{i}" for i in range(replicas)])
    assert_trained_alike(*run_guide_loop(strategy, 12), *reference_guide_loop(12))


@pytest.mark.parametrize("strategy_class", [ks.MirroredStrategy, ks.CentralStorageStrategy])
def test_explicit_global_batch_size_with_a_partial_last_batch_trains_like_one_device(strategy_class):
    # 10 samples, batch 4 on 3 replicas: shards [2, 1, 1] twice, then [1, 1, 0].
    strategy = strategy_class(["cpu:0", "cpu:1", "cpu:2"])
    losses, weights = run_guide_loop(strategy, 4, n=10, pass_global_batch_size=True, explicit_steps=3)
    assert_trained_alike(losses, weights, *reference_guide_loop(4, n=10, explicit_steps=3))


def run_regression_loop(strategy, build, initial_weights):
    """The guide's loop (`common.guide_loop`) on `build()` from `initial_weights`, SGD(0.05), 50
    samples in global batches of 16 (the last one of 2)."""
    with strategy.scope():
        model = build()
        optimizer = keras.optimizers.SGD(0.05)
    model.set_weights(initial_weights)
    dataset = strategy.make_experimental_numpy_dataset(regression_data()).batch(GLOBAL_BATCH)
    return guide_loop(strategy, model, optimizer, dataset, ks), model.get_weights()


def reference_regression_loop(model):
    """`run_regression_loop` on one device: the mean squared error of each global batch, plus the
    call's losses; returns `(initial weights, losses, weights)`."""
    initial_weights = model.get_weights()
    losses = train(model, keras.optimizers.SGD(0.05), average_loss(squared_error), split(regression_data(), GLOBAL_BATCH))
    return initial_weights, losses, model.get_weights()


@pytest.mark.parametrize("replicas", [2, 3])
def test_synchronized_batch_norm_in_the_guide_loop_trains_like_one_device(replicas):
    # On 3 replicas the shards are uneven (6, 5, 5, and 1, 1, 0 for the last batch). The batch
    # statistics, their gradients and the moving statistics (written once, not once per
    # replica) are exact. On one device the global statistics are the local ones: the
    # reference normalizes unsynchronized (Keras' own synchronized moments on TensorFlow
    # compute E[x^2] - E[x]^2, whose rounding differs by about 1e-5 after a few steps).
    keras.utils.set_random_seed(1)
    initial_weights, *expected = reference_regression_loop(build_sync_bn_model(synchronized=False))
    strategy = ks.MirroredStrategy(devices=[f"cpu:{i}" for i in range(replicas)])
    assert_trained_alike(*run_regression_loop(strategy, build_sync_bn_model, initial_weights), *expected)

if keras.backend.backend() == "tensorflow":

    def test_the_guide_verbatim_on_tensorflow_with_gradient_tape_and_tf_function():
        import tensorflow as tf

        def run(strategy):
            with strategy.scope():
                model = guide_model()
                optimizer = keras.optimizers.SGD(0.1)
            dataset = tf.data.Dataset.from_tensor_slices(data()).batch(12)
            dist_dataset = strategy.experimental_distribute_dataset(dataset)
            loss_object = keras.losses.BinaryCrossentropy(from_logits=True, reduction="none")

            def train_step(inputs):
                features, labels = inputs
                with tf.GradientTape() as tape:
                    predictions = model(features, training=True)
                    loss = ks.compute_average_loss(loss_object(labels, predictions))
                    loss += ks.scale_regularization_loss(tf.add_n(model.losses))
                gradients = tape.gradient(loss, model.trainable_variables)
                optimizer.apply_gradients(zip(gradients, model.trainable_variables))
                return loss

            @tf.function
            def distributed_train_step(dist_inputs):
                per_replica_losses = strategy.run(train_step, args=(dist_inputs,))
                return strategy.reduce(ks.ReduceOp.SUM, per_replica_losses, axis=None)

            losses = [float(distributed_train_step(x)) for x in dist_dataset]
            return losses, model.get_weights()

        losses, weights = run(ks.MirroredStrategy(devices=["cpu:0", "cpu:1", "cpu:2"]))
        assert_trained_alike(losses, weights, *reference_guide_loop(12, explicit_steps=0))


def row_sums_batch_norm_model(learning_rate):
    """2 replicas; Dense(3) with unit kernel (each output is the row sum) -> BatchNormalization(momentum 0.5) -> Dense."""
    strategy = ks.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((2,)),
            keras.layers.Dense(3, kernel_initializer="ones", use_bias=False),
            keras.layers.BatchNormalization(momentum=0.5),
            keras.layers.Dense(1),
        ])
        optimizer = keras.optimizers.SGD(learning_rate)
    return strategy, model, optimizer


def test_unsynchronized_batch_norm_in_the_guide_loop_averages_the_replicas_moving_statistics():
    # Two replicas whose shards are constant after the first layer (0 and 8): each replica's
    # batch variance is 0 and its mean 0 or 8. The moving statistics are the replicas' mean, as
    # tf-keras' ON_READ / MEAN statistics read (the first replica's alone: mean 0).
    x = np.concatenate([np.zeros((2, 2)), np.full((2, 2), 4.0)]).astype("float32")
    strategy, model, optimizer = row_sums_batch_norm_model(learning_rate=0.05)
    dataset = strategy.make_experimental_numpy_dataset((x, np.zeros((4, 1), "float32"))).batch(GLOBAL_BATCH)
    guide_loop(strategy, model, optimizer, dataset, ks, n=4)
    bn = model.layers[1]
    np.testing.assert_allclose(ops.convert_to_numpy(bn.moving_mean), 2.0, atol=1e-6)
    np.testing.assert_allclose(ops.convert_to_numpy(bn.moving_variance), 0.5, atol=1e-6)


def run_two_updates_per_step(strategy):
    """A GAN-style step: update `a`, then a loss through the updated `a` updates `b` (8 samples, 3 steps)."""
    with strategy.scope():
        a = keras.Variable(np.ones((1,), "float32"), name="a")
        b = keras.Variable(np.ones((1,), "float32"), name="b")
        optimizer_a, optimizer_b = keras.optimizers.SGD(0.01), keras.optimizers.SGD(0.01)
    x = np.arange(1, 9, dtype="float32").reshape(8, 1) / 4

    def step(features):
        def loss_of(fn):
            return lambda: ks.compute_average_loss(ops.square(fn(features[:, 0]) - 1.0), global_batch_size=8)

        _, grads = ks.value_and_grad(loss_of(lambda f: f * a), [a])
        optimizer_a.apply_gradients(zip(grads, [a]))
        loss, grads = ks.value_and_grad(loss_of(lambda f: f * a * b), [b])
        optimizer_b.apply_gradients(zip(grads, [b]))
        return loss

    dataset = strategy.make_experimental_numpy_dataset(x).batch(8)
    for _ in range(3):
        for features in strategy.experimental_distribute_dataset(dataset):
            strategy.run(step, args=(features,))
    return [ops.convert_to_numpy(v) for v in (a, b)]


def test_a_second_update_in_the_same_step_sees_the_first_one():
    # Every replica's second loss must use `a` as the first update left it (on every replica).
    # One device: mean squared errors of x a and x a b (x = 1/4 .. 8/4), their gradients by hand.
    x, a, b = np.arange(1, 9) / 4, 1.0, 1.0
    for _ in range(3):
        a -= 0.01 * np.mean(2 * (x * a - 1) * x)
        b -= 0.01 * np.mean(2 * (x * a * b - 1) * x * a)
    got = run_two_updates_per_step(ks.MirroredStrategy(devices=["cpu:0", "cpu:1", "cpu:2"]))
    np.testing.assert_allclose(np.concatenate(got), [a, b], **TOL)


@pytest.mark.parametrize("in_function", [False, True], ids=["run", "ks.function"])
def test_unsynchronized_batch_norm_ignores_replicas_with_empty_shards(in_function):
    # In `ks.function` on JAX, the second step's shards are padded to the first's rows and the
    # empty replica's statistics are weighed 0 by its row mask.
    # Batches of 3 then 1 on 2 replicas: shards [2, 1], then [1, 0]. The learning rate is 0, so the
    # Dense outputs are the row sums (2, 2 | 4, then 6). Momentum 0.5:
    # step 1: mean 0.5 * mean(2, 4) = 1.5, variance 0.5 * 1 + 0.5 * mean(0, 0) = 0.5;
    # step 2 (the empty replica's NaN statistics do not count): 0.5 * 1.5 + 0.5 * 6 = 3.75, 0.25.
    x = np.array([[1, 1], [1, 1], [2, 2], [3, 3]], "float32")
    strategy, model, optimizer = row_sums_batch_norm_model(learning_rate=0.0)

    def step(features):
        loss_fn = lambda: ks.compute_average_loss(ops.square(model(features, training=True))[:, 0])  # noqa: E731
        loss, grads = ks.value_and_grad(loss_fn, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    dataset = strategy.make_experimental_numpy_dataset(x).batch(3)
    run = ks.function(lambda features: strategy.run(step, args=(features,))) if in_function else \
        (lambda features: strategy.run(step, args=(features,)))
    for features in strategy.experimental_distribute_dataset(dataset):
        run(features)
    bn = model.layers[1]
    np.testing.assert_allclose(ops.convert_to_numpy(bn.moving_mean), 3.75, atol=1e-6)
    np.testing.assert_allclose(ops.convert_to_numpy(bn.moving_variance), 0.25, atol=1e-6)


def test_a_replica_without_rows_leaves_batch_norm_finite_and_adds_nothing():
    # A global batch of 2 on 4 replicas: shards [1, 1, 0, 0]. The empty replicas' statistics
    # would be NaN; their gradients must be 0, so the step equals the same step on 2 replicas.
    rng = np.random.default_rng(4)
    x, y = rng.normal(size=(2, 4)).astype("float32"), rng.normal(size=(2, 1)).astype("float32")

    def trained(devices):
        strategy = ks.MirroredStrategy(devices)
        with strategy.scope():
            keras.utils.set_random_seed(1)
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.BatchNormalization(),
                                      keras.layers.Dense(1)])
            optimizer = keras.optimizers.SGD(0.1)

        def step(features, labels):
            def loss_fn():
                per_example = keras.losses.mean_squared_error(labels, model(features, training=True))
                return ks.compute_average_loss(per_example, global_batch_size=2)

            loss, grads = ks.value_and_grad(loss_fn, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        dataset = strategy.make_experimental_numpy_dataset((x, y)).batch(2)
        for features, labels in strategy.experimental_distribute_dataset(dataset):
            strategy.run(step, args=(features, labels))
        return model.get_weights()

    got, expected = trained(["cpu:0", "cpu:1", "cpu:2", "cpu:3"]), trained(["cpu:0", "cpu:1"])
    assert all(np.all(np.isfinite(w)) for w in got)
    for weight, expected_weight in zip(got, expected):
        np.testing.assert_allclose(weight, expected_weight, **TOL)


def activity_regularized_model():
    """A model whose activity regularizer adds a loss in `call` (`model.losses`)."""
    return keras.Sequential([
        keras.Input((5,)),
        keras.layers.Dense(4, activation="tanh", activity_regularizer=keras.regularizers.L2(0.1)),
        keras.layers.Dense(1),
    ])


def test_add_loss_terms_count_on_every_replica_in_the_guide_loop():
    # Shards are even on 2 replicas (8 + 8, then 1 + 1), where the guide's
    # scale_regularization_loss of per-shard means is exact.
    keras.utils.set_random_seed(3)
    initial_weights, *expected = reference_regression_loop(activity_regularized_model())
    strategy = ks.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    assert_trained_alike(*run_regression_loop(strategy, activity_regularized_model, initial_weights), *expected)


def lazily_built_model():
    """A model without `keras.Input`, as in TensorFlow's custom-training guide."""
    return keras.Sequential([keras.layers.Dense(4, activation="relu"), keras.layers.Dense(1)])


def run_lazily_built_loop(strategy, epochs=3):
    """The guide's loop on `lazily_built_model()`, which builds on its first call, inside `strategy.run`."""
    keras.utils.set_random_seed(5)
    with strategy.scope():
        model = lazily_built_model()
        optimizer = keras.optimizers.Adam(0.05)
    x, y = regression_data(24)
    dataset = strategy.make_experimental_numpy_dataset((x, y)).batch(8)

    def train_step(inputs):
        features, labels = inputs
        model(features)  # builds the model on the first step (replica 0), a forward pass after that

        def loss_fn():
            per_example_loss = ops.mean(ops.square(model(features, training=True) - labels), axis=-1)
            return ks.compute_average_loss(per_example_loss, global_batch_size=8)

        loss, gradients = ks.value_and_grad(loss_fn, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        return loss

    @ks.function
    def distributed_train_step(inputs):
        return strategy.reduce("sum", strategy.run(train_step, args=(inputs,)), axis=None)

    losses = []
    for _ in range(epochs):
        losses += [float(ops.convert_to_numpy(distributed_train_step(inputs))) for inputs in strategy.experimental_distribute_dataset(dataset)]
    return losses, model.get_weights()


@pytest.mark.parametrize("replicas", [2, 3])
def test_a_model_built_on_its_first_call_inside_run_trains_like_one_device(replicas):
    # Its variables are created in the first replica, as in `strategy.scope()`, and every replica
    # reads them: created in that replica's stateless scope, where Keras defers them, the other
    # replicas read fresh initial values. The same seed gives the one-device model the same ones.
    keras.utils.set_random_seed(5)
    model = lazily_built_model()
    model.build((None, 5))
    loss_fn = average_loss(squared_error, global_batch_size=8)
    expected_losses = train(model, keras.optimizers.Adam(0.05), loss_fn, split(regression_data(24), 8, steps=9))
    losses, weights = run_lazily_built_loop(ks.MirroredStrategy(devices=[f"cpu:{i}" for i in range(replicas)]))
    assert_trained_alike(losses, weights, expected_losses, model.get_weights())


def small_model():
    return keras.Sequential([keras.Input((1,)), keras.layers.Dense(3, activation="tanh"), keras.layers.Dense(1)])


def run_loop_with_optimizer(strategy, make_optimizer, batches, initial_weights, scale_loss=False):
    """The guide's loop on `small_model()` from `initial_weights` with the optimizer
    `make_optimizer()` gives, one step per `(x, y)` batch of 6 rows; returns `(losses, model,
    optimizer)`. With `scale_loss`, the loss is scaled as in TensorFlow's mixed-precision guide
    (`optimizer.scale_loss`, then the scaled gradients applied)."""
    with strategy.scope():
        model = small_model()
        optimizer = make_optimizer()
    model.set_weights(initial_weights)
    loss_object = keras.losses.BinaryCrossentropy(from_logits=True, reduction="none")

    def train_step(inputs):
        features, labels = inputs

        def loss_fn():
            loss = ks.compute_average_loss(loss_object(labels, model(features, training=True)), global_batch_size=6)
            return optimizer.scale_loss(loss) if scale_loss else loss

        loss, gradients = ks.value_and_grad(loss_fn, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        return loss

    @ks.function
    def distributed_train_step(dist_inputs):
        return strategy.reduce("sum", strategy.run(train_step, args=(dist_inputs,)), axis=None)

    losses = []
    for batch in batches:
        dataset = strategy.experimental_distribute_dataset(strategy.make_experimental_numpy_dataset(batch).batch(6))
        losses.append(float(ops.convert_to_numpy(distributed_train_step(next(iter(dataset))))))
    return losses, model, optimizer


def batches_of_six(n):
    return split(data(n), 6)


def reference_loop_with_optimizer(make_optimizer, batches):
    """`run_loop_with_optimizer` on one device from `small_model()`'s initial weights; returns
    `(initial weights, losses, model, optimizer)`."""
    model, optimizer = small_model(), make_optimizer()
    initial_weights = model.get_weights()
    loss_fn = average_loss(binary_crossentropy_from_logits, global_batch_size=6, regularization=False)
    return initial_weights, train(model, optimizer, loss_fn, batches), model, optimizer


@pytest.mark.parametrize("replicas", [1, 3])
def test_a_loss_scale_optimizer_in_the_guide_loop_skips_non_finite_steps_like_one_device(replicas):
    """4 batches, the third with a NaN feature: the loss-scaled loop skips that batch's update and
    halves the scale; its finite steps equal the inner optimizer's (one device, NaN batch left out).

    On TensorFlow the loss-scaled update failed with several replicas ("apply() must be called
    in a replica context"), on JAX with one ("unexpected tracer", from its `cond`)."""
    batches = batches_of_six(24)
    batches[2][0][1, 0] = np.nan
    adam = lambda: keras.optimizers.Adam(0.05, global_clipnorm=1.0)  # noqa: E731
    initial_weights, _, expected, _ = reference_loop_with_optimizer(adam, batches[:2] + batches[3:])
    _, model, optimizer = run_loop_with_optimizer(
        ks.MirroredStrategy(devices=[f"cpu:{i}" for i in range(replicas)]),
        lambda: keras.optimizers.LossScaleOptimizer(adam(), initial_scale=2.0**10, dynamic_growth_steps=2),
        batches, initial_weights, scale_loss=True,
    )
    assert float(ops.convert_to_numpy(optimizer.dynamic_scale)) == 2.0**10  # x2 after steps 1-2, /2 at the NaN step 3
    assert_trained_alike([], model.get_weights(), [], expected.get_weights())


@pytest.mark.parametrize(
    "make_optimizer",
    [
        lambda: keras.optimizers.SGD(0.2, gradient_accumulation_steps=2),
        lambda: keras.optimizers.Adam(0.05, use_ema=True, ema_momentum=0.5, ema_overwrite_frequency=2),
    ],
    ids=["gradient_accumulation", "ema"],
)
def test_accumulating_and_averaging_optimizers_in_the_guide_loop_train_like_one_device(make_optimizer):
    """The weights and every optimizer variable (accumulators, moving averages) end as on one
    device. The accumulation and the EMA overwrite must run once, in the summed update, not
    through the optimizer's own strategy."""
    state = lambda model, optimizer: model.get_weights() + [ops.convert_to_numpy(v) for v in optimizer.variables]  # noqa: E731
    keras.utils.set_random_seed(5)
    initial_weights, expected_losses, *reference = reference_loop_with_optimizer(make_optimizer, batches_of_six(36))
    strategy = ks.MirroredStrategy(devices=["cpu:0", "cpu:1", "cpu:2"])
    losses, *mirrored = run_loop_with_optimizer(strategy, make_optimizer, batches_of_six(36), initial_weights)
    assert_trained_alike(losses, state(*mirrored), expected_losses, state(*reference))
