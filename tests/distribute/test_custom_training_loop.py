"""The distributed-training guide's custom loop, ported to ks, equals the same loop without a strategy."""

import os
import sys

import keras
import numpy as np
import pytest
from keras import ops

import keras_strategies as ks

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "multi_worker", "programs"))
from common import GLOBAL_BATCH, build_sync_bn_model, guide_loop, single_process_statistics  # noqa: E402
from common import data as regression_data  # noqa: E402

TOL = dict(rtol=1e-5, atol=1e-5)


def data(n=48):
    rng = np.random.default_rng(11)
    x = rng.normal(size=(n, 1)).astype("float32")
    return x, (x > 0.2).astype("float32")


def run_guide_loop(strategy, global_batch_size, n=48, pass_global_batch_size=False, explicit_steps=10):
    """The guide's loop with `ks` for `tf.distribute` and `ks.value_and_grad` for the tape."""
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((1,)), keras.layers.Dense(1, kernel_initializer="ones", kernel_regularizer=keras.regularizers.L2(1e-4))]
        )
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


@pytest.mark.parametrize("replicas", [1, 2, 3, 4])
def test_guide_loop_equals_no_strategy(replicas):
    expected_losses, expected_weights = run_guide_loop(ks.get_strategy(), 12)
    strategy = ks.MirroredStrategy(devices=[f"cpu:{i}" for i in range(replicas)])
    losses, weights = run_guide_loop(strategy, 12)
    np.testing.assert_allclose(losses, expected_losses, **TOL)
    for got, expected in zip(weights, expected_weights):
        np.testing.assert_allclose(got, expected, **TOL)


def test_explicit_global_batch_size_with_a_partial_last_batch_trains_like_one_device():
    # 10 samples, batch 4 on 3 replicas: shards [2, 1, 1] twice, then [1, 1, 0].
    expected_losses, expected_weights = run_guide_loop(ks.get_strategy(), 4, n=10, pass_global_batch_size=True, explicit_steps=3)
    strategy = ks.MirroredStrategy(devices=["cpu:0", "cpu:1", "cpu:2"])
    losses, weights = run_guide_loop(strategy, 4, n=10, pass_global_batch_size=True, explicit_steps=3)
    np.testing.assert_allclose(losses, expected_losses, **TOL)
    for got, expected in zip(weights, expected_weights):
        np.testing.assert_allclose(got, expected, **TOL)


def run_sync_bn_loop(strategy, reference=False):
    """The guide's loop on Dense -> BatchNormalization(synchronized=True) -> Dense (50 samples, batches of 16)."""
    keras.utils.set_random_seed(1)
    with strategy.scope():
        model = build_sync_bn_model()
        optimizer = keras.optimizers.SGD(0.05)
    if reference:
        single_process_statistics(model)
    dataset = strategy.make_experimental_numpy_dataset(regression_data()).batch(GLOBAL_BATCH)
    return guide_loop(strategy, model, optimizer, dataset, ks), model.get_weights()


@pytest.mark.parametrize("replicas", [2, 3])
def test_synchronized_batch_norm_in_the_guide_loop_trains_like_one_device(replicas):
    # On 3 replicas the shards are uneven (6, 5, 5, and 1, 1, 0 for the last batch). The batch
    # statistics, their gradients and the moving statistics (written once, not once per
    # replica) are exact.
    expected_losses, expected_weights = run_sync_bn_loop(ks.get_strategy(), reference=True)
    losses, weights = run_sync_bn_loop(ks.MirroredStrategy(devices=[f"cpu:{i}" for i in range(replicas)]))
    np.testing.assert_allclose(losses, expected_losses, **TOL)
    for got, expected in zip(weights, expected_weights):
        np.testing.assert_allclose(got, expected, **TOL)

if keras.backend.backend() == "tensorflow":

    def test_the_guide_verbatim_on_tensorflow_with_gradient_tape_and_tf_function():
        import tensorflow as tf

        def run(strategy):
            with strategy.scope():
                model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1, kernel_initializer="ones", kernel_regularizer=keras.regularizers.L2(1e-4))])
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

        expected_losses, expected_weights = run(ks.get_strategy())
        losses, weights = run(ks.MirroredStrategy(devices=["cpu:0", "cpu:1", "cpu:2"]))
        np.testing.assert_allclose(losses, expected_losses, **TOL)
        for got, expected in zip(weights, expected_weights):
            np.testing.assert_allclose(got, expected, **TOL)


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
    expected = run_two_updates_per_step(ks.get_strategy())
    got = run_two_updates_per_step(ks.MirroredStrategy(devices=["cpu:0", "cpu:1", "cpu:2"]))
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, **TOL)


def test_unsynchronized_batch_norm_ignores_replicas_with_empty_shards():
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
    for features in strategy.experimental_distribute_dataset(dataset):
        strategy.run(step, args=(features,))
    bn = model.layers[1]
    np.testing.assert_allclose(ops.convert_to_numpy(bn.moving_mean), 3.75, atol=1e-6)
    np.testing.assert_allclose(ops.convert_to_numpy(bn.moving_variance), 0.25, atol=1e-6)


def run_activity_regularized_loop(strategy):
    """The guide's loop on a model whose activity regularizer adds a loss in `call` (`model.losses`)."""
    keras.utils.set_random_seed(3)
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((5,)),
            keras.layers.Dense(4, activation="tanh", activity_regularizer=keras.regularizers.L2(0.1)),
            keras.layers.Dense(1),
        ])
        optimizer = keras.optimizers.SGD(0.05)
    dataset = strategy.make_experimental_numpy_dataset(regression_data()).batch(GLOBAL_BATCH)
    return guide_loop(strategy, model, optimizer, dataset, ks), model.get_weights()


def test_add_loss_terms_count_on_every_replica_in_the_guide_loop():
    # Shards are even on 2 replicas (8 + 8, then 1 + 1), where the guide's
    # scale_regularization_loss of per-shard means is exact.
    expected_losses, expected_weights = run_activity_regularized_loop(ks.get_strategy())
    losses, weights = run_activity_regularized_loop(ks.MirroredStrategy(devices=["cpu:0", "cpu:1"]))
    np.testing.assert_allclose(losses, expected_losses, **TOL)
    for got, expected in zip(weights, expected_weights):
        np.testing.assert_allclose(got, expected, **TOL)


def run_lazily_built_loop(strategy, steps=3):
    """A model without `keras.Input`, as in TensorFlow's custom-training guide: it builds on its
    first call, inside `strategy.run`."""
    keras.utils.set_random_seed(5)
    with strategy.scope():
        model = keras.Sequential([keras.layers.Dense(4, activation="relu"), keras.layers.Dense(1)])
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
    for _ in range(steps):
        losses += [float(ops.convert_to_numpy(distributed_train_step(inputs))) for inputs in strategy.experimental_distribute_dataset(dataset)]
    return losses, model.get_weights()


@pytest.mark.parametrize("replicas", [2, 3])
def test_a_model_built_on_its_first_call_inside_run_trains_like_one_device(replicas):
    # Its variables were created in the first replica's stateless scope, where Keras defers them:
    # the other replicas read fresh initial values (TensorFlow: an AttributeError, PyTorch: "does
    # not require grad", JAX: wrong values). They are now created as in `strategy.scope()`.
    expected_losses, expected_weights = run_lazily_built_loop(ks.get_strategy())
    losses, weights = run_lazily_built_loop(ks.MirroredStrategy(devices=[f"cpu:{i}" for i in range(replicas)]))
    np.testing.assert_allclose(losses, expected_losses, **TOL)
    for got, expected in zip(weights, expected_weights):
        np.testing.assert_allclose(got, expected, **TOL)


def run_loop_with_optimizer(strategy, make_optimizer, batches, scale_loss=False):
    """The guide's loop with the optimizer `make_optimizer()` gives, one step per `(x, y)` batch
    of 6 rows; returns `(losses, model, optimizer)`. With `scale_loss`, the loss is scaled as in
    TensorFlow's mixed-precision guide (`optimizer.scale_loss`, then the scaled gradients applied)."""
    with strategy.scope():
        model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(3, activation="tanh"), keras.layers.Dense(1)])
        optimizer = make_optimizer()
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
    x, y = data(n)
    return [(x[i:i + 6], y[i:i + 6]) for i in range(0, n, 6)]


@pytest.mark.parametrize("replicas", [1, 3])
def test_a_loss_scale_optimizer_in_the_guide_loop_skips_non_finite_steps_like_one_device(replicas):
    """4 batches, the third with a NaN feature: the loss-scaled loop skips that batch's update and
    halves the scale; its finite steps equal the inner optimizer's (one device, NaN batch left out).

    On TensorFlow the loss-scaled update failed with several replicas ("apply() must be called
    in a replica context"), on JAX with one ("unexpected tracer", from its `cond`)."""
    batches = batches_of_six(24)
    batches[2][0][1, 0] = np.nan
    adam = lambda: keras.optimizers.Adam(0.05, global_clipnorm=1.0)  # noqa: E731
    keras.utils.set_random_seed(3)
    _, expected, _ = run_loop_with_optimizer(ks.get_strategy(), adam, batches[:2] + batches[3:])
    keras.utils.set_random_seed(3)
    _, model, optimizer = run_loop_with_optimizer(
        ks.MirroredStrategy(devices=[f"cpu:{i}" for i in range(replicas)]),
        lambda: keras.optimizers.LossScaleOptimizer(adam(), initial_scale=2.0**10, dynamic_growth_steps=2),
        batches, scale_loss=True,
    )
    assert float(ops.convert_to_numpy(optimizer.dynamic_scale)) == 2.0**10  # x2 after steps 1-2, /2 at the NaN step 3
    for got, want in zip(model.get_weights(), expected.get_weights()):
        np.testing.assert_allclose(got, want, **TOL)


@pytest.mark.parametrize(
    "make_optimizer",
    [
        lambda: keras.optimizers.SGD(0.2, gradient_accumulation_steps=2),
        lambda: keras.optimizers.Adam(0.05, use_ema=True, ema_momentum=0.5, ema_overwrite_frequency=2),
    ],
    ids=["gradient_accumulation", "ema"],
)
def test_accumulating_and_averaging_optimizers_in_the_guide_loop_train_like_one_device(make_optimizer):
    """On TensorFlow both failed with several replicas: the accumulation and the EMA overwrite
    went through the optimizer's own strategy from our cross-replica update."""
    state = lambda model, optimizer: model.get_weights() + [ops.convert_to_numpy(v) for v in optimizer.variables]  # noqa: E731
    keras.utils.set_random_seed(5)
    expected_losses, *reference = run_loop_with_optimizer(ks.get_strategy(), make_optimizer, batches_of_six(36))
    keras.utils.set_random_seed(5)
    losses, *mirrored = run_loop_with_optimizer(ks.MirroredStrategy(devices=["cpu:0", "cpu:1", "cpu:2"]), make_optimizer, batches_of_six(36))
    np.testing.assert_allclose(losses, expected_losses, **TOL)
    expected, got = state(*reference), state(*mirrored)
    assert len(got) == len(expected)
    for value, want in zip(got, expected):
        np.testing.assert_allclose(value, want, **TOL)
