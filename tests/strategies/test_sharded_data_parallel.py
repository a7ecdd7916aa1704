"""`ShardedDataParallelStrategy`: training equals one device, each device holds 1/N of the
optimizer state, checkpoints are whole and load across replica counts and strategies."""

import json
import math
import os

import keras
import numpy as np
import pytest

import keras_strategies as ks
from keras_strategies.backend import engine

TORCH = keras.backend.backend() == "torch"  # torch's CPU replicas share the one "cpu" device
ROWS, FEATURES = 14, 5


def devices(n):
    return [f"cpu:{i}" for i in range(n)]


def data():
    x = np.linspace(-1, 1, ROWS * FEATURES, dtype="float32").reshape(ROWS, FEATURES)
    return x, np.tanh(x @ np.linspace(-1, 1, FEATURES * 3, dtype="float32").reshape(FEATURES, 3))


def build(optimizer):
    # Dense(7): a kernel of 35 and a bias of 7 elements, neither divisible by 2 or 4.
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(7, activation="tanh", name="hidden"),
                              keras.layers.Dense(3, name="out")])
    model.compile(loss="mse", optimizer=optimizer(), metrics=["mae"])
    return model


def assert_close(got, expected):
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)


def built_and_reference(strategy, builder):
    """`builder()` under `strategy` and without one, with the same weights."""
    with strategy.scope():
        model = builder()
    reference = builder()
    model.set_weights(reference.get_weights())
    return model, reference


def sharded_and_reference(strategy, optimizer):
    return built_and_reference(strategy, lambda: build(optimizer))


def adamw_without_decay_on_biases():
    optimizer = keras.optimizers.AdamW(0.02, weight_decay=0.1)
    optimizer.exclude_from_weight_decay(var_names=["bias"])
    return optimizer


OPTIMIZERS = {
    "adam-global-clipnorm": lambda: keras.optimizers.Adam(0.02, global_clipnorm=0.5),
    "sgd-momentum-clipnorm": lambda: keras.optimizers.SGD(0.1, momentum=0.9, clipnorm=0.3),
    "adamw-excluded-biases": adamw_without_decay_on_biases,
    "rmsprop-schedule": lambda: keras.optimizers.RMSprop(keras.optimizers.schedules.ExponentialDecay(0.01, 2, 0.5)),
    "adam-accumulated-clipvalue": lambda: keras.optimizers.Adam(0.05, gradient_accumulation_steps=2, clipvalue=0.02),
}


# Each optimizer at both stages, on 2 replicas at one stage and 4 at the other (alternating, so
# that each stage meets every replica count with half of the optimizers).
FIT_CASES = [(optimizer, *((4, 6) if (k + stage) % 2 else (2, 4)), stage)
             for k, optimizer in enumerate(OPTIMIZERS) for stage in (1, 2)]


@pytest.mark.parametrize("optimizer, replicas, batch_size, stage", FIT_CASES,
                         ids=[f"{o}-{r}-{b}-{s}" for o, r, b, s in FIT_CASES])
def test_fit_evaluate_predict_equal_one_device(replicas, batch_size, optimizer, stage):
    """Uneven shards (6 rows on 4 replicas), a partial last batch (14 rows), clipping after the sum."""
    strategy = ks.experimental.ShardedDataParallelStrategy(devices(replicas), stage=stage)
    model, reference = sharded_and_reference(strategy, OPTIMIZERS[optimizer])
    x, y = data()
    kwargs = dict(batch_size=batch_size, epochs=2, shuffle=False, verbose=0)
    got, expected = model.fit(x, y, **kwargs).history, reference.fit(x, y, **kwargs).history
    for key in expected:
        np.testing.assert_allclose(got[key], expected[key], rtol=1e-5, atol=1e-6)
    assert_close(model.get_weights(), reference.get_weights())
    state = strategy.extended.optimizer_state(model.optimizer)
    assert_close(state.whole_values(), [v.numpy() for v in reference.optimizer.variables])
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == int(
        keras.ops.convert_to_numpy(reference.optimizer.iterations))
    assert_close([model.evaluate(x, y, batch_size=batch_size, verbose=0)],
                 [reference.evaluate(x, y, batch_size=batch_size, verbose=0)])
    assert_close([model.predict(x, batch_size=batch_size, verbose=0)],
                 [reference.predict(x, batch_size=batch_size, verbose=0)])


class HalveTheBias(keras.callbacks.Callback):
    """Writes a variable between two steps, as a user's callback may."""

    def on_train_batch_end(self, batch, logs=None):
        if batch == 1:
            bias = self.model.get_layer("hidden").bias
            bias.assign(bias * 0.5)


@pytest.mark.parametrize("constrained", [False, True], ids=["written", "constrained"])
@pytest.mark.parametrize("stage", [1, 2])
def test_variables_written_between_steps_or_constrained_are_cut_again(stage, constrained):
    # Where the devices' pieces may stay from one update to the next (JAX), a variable written
    # between steps (a callback, set_weights) or by its constraint must be read again.
    def builder():
        model = build(lambda: keras.optimizers.Adam(0.05))
        if constrained:
            model.get_layer("out").kernel.constraint = keras.constraints.MaxNorm(0.3)
        return model

    model, reference = built_and_reference(ks.experimental.ShardedDataParallelStrategy(devices(2), stage=stage),
                                           builder)
    x, y = data()
    kwargs = dict(batch_size=4, epochs=2, shuffle=False, verbose=0, callbacks=[HalveTheBias()])
    got, expected = model.fit(x, y, **kwargs).history, reference.fit(x, y, **kwargs).history
    np.testing.assert_allclose(got["loss"], expected["loss"], rtol=1e-5, atol=1e-6)
    weights = [w * 2 for w in reference.get_weights()]
    model.set_weights(weights)
    reference.set_weights(weights)
    kwargs["callbacks"] = []
    np.testing.assert_allclose(model.fit(x, y, **kwargs).history["loss"], reference.fit(x, y, **kwargs).history["loss"],
                               rtol=1e-5, atol=1e-6)
    assert_close(model.get_weights(), reference.get_weights())



@pytest.mark.parametrize("stage", [1, 2])
def test_each_device_holds_its_piece_of_the_optimizer_state(stage):
    """The pieces' shapes, devices and bytes: ceil(size / 4) elements of each slot per device; the
    optimizer itself is never built whole; at stage 2 each device holds one piece of the summed
    gradients, at stage 1 the whole sum."""
    strategy = ks.experimental.ShardedDataParallelStrategy(devices(4), stage=stage)
    with strategy.scope():
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(130), keras.layers.Dense(1)])
        model.compile(loss="mse", optimizer="adam")
    x = np.random.default_rng(0).normal(size=(8, 64)).astype("float32")
    model.fit(x, x[:, :1], batch_size=8, verbose=0)
    state = strategy.extended.optimizer_state(model.optimizer)
    assert not model.optimizer.built and len(model.optimizer.variables) == 2  # iterations, learning rate
    for i, pieces in enumerate(state.pieces):
        assert [tuple(p.shape) for p in pieces] == [(math.ceil(math.prod(v.shape) / 4),) for v in model.trainable_variables]
        if not TORCH:
            assert {engine.devices.device_of(v) for v in pieces + state.optimizers[i].variables} == {f"cpu:{i}"}
    # Adam: two slots per variable, float32.
    whole = sum(2 * 4 * math.prod(v.shape) for v in model.trainable_variables)
    expected = [2 * 4 * sum(math.ceil(math.prod(v.shape) / 4) for v in model.trainable_variables)] * 4
    assert state.slot_bytes_per_replica() == expected
    assert max(expected) / whole <= 0.27
    whole_gradients, piece_gradients = whole // 2, expected[0] // 2
    assert state.gradient_bytes == ([piece_gradients] * 4 if stage == 2 else [whole_gradients] * 4)
    assert state.bytes_per_replica()[0] - expected[0] == sum(
        np.asarray(v.numpy()).nbytes for v, ref in zip(state.optimizers[0].variables, state.references) if ref is None)


def loss_scaled():
    """A LossScaleOptimizer whose first scales overflow gradients of targets x100 (`scaled_data`)."""
    return keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.02, global_clipnorm=0.5),
                                               initial_scale=2.0 ** 127, dynamic_growth_steps=2)


def scaled_data():
    x, y = data()
    return x, y * 100.0


@pytest.mark.parametrize("scaled", [False, True], ids=["adam", "loss-scaled"])
@pytest.mark.parametrize("stage", [1, 2])
def test_custom_loop_equals_one_device(stage, scaled):
    """`strategy.run` with `optimizer.apply_gradients`: the gradients summed (at stage 2
    reduce-scattered), the update in pieces; with a LossScaleOptimizer, the loss scaled by the
    guide's `optimizer.scale_loss` and overflowing steps skipped, as in `fit`."""
    strategy = ks.experimental.ShardedDataParallelStrategy(devices(2), stage=stage)
    model, reference = sharded_and_reference(strategy, loss_scaled if scaled else OPTIMIZERS["adam-global-clipnorm"])
    x, y = scaled_data() if scaled else data()
    global_batch = 6
    dataset = strategy.experimental_distribute_dataset(
        strategy.make_experimental_numpy_dataset((x, y)).batch(global_batch))

    def replica_step(inputs, targets):
        def loss_fn():
            per_example = keras.ops.mean(keras.ops.square(model(inputs) - targets), axis=-1)
            # The actual global batch: 6, 6, then 2 rows.
            return model.optimizer.scale_loss(ks.compute_average_loss(per_example))

        loss, grads = ks.value_and_grad(loss_fn, model.trainable_variables)
        model.optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @ks.function
    def step(inputs, targets):
        return strategy.run(replica_step, args=(inputs, targets))

    for _ in range(3 if scaled else 1):
        for inputs, targets in dataset:
            step(inputs, targets)
        for start in range(0, ROWS, global_batch):
            reference.train_on_batch(x[start:start + global_batch], y[start:start + global_batch])
    assert_close(model.get_weights(), reference.get_weights())
    own = [v.numpy() for v in model.optimizer.variables[:4]] if scaled else []  # the scaler's, then the inner's
    assert_close(own + strategy.extended.optimizer_state(model.optimizer).whole_values(),
                 [v.numpy() for v in reference.optimizer.variables])
    # Its state lives in pieces only, never whole.
    assert not (model.optimizer.inner_optimizer if scaled else model.optimizer).built


def trained_under(replicas, path):
    """A model trained one epoch under `replicas` sharded replicas and saved to `path`; its reference."""
    strategy = ks.experimental.ShardedDataParallelStrategy(devices(replicas))
    model, reference = sharded_and_reference(strategy, OPTIMIZERS["adam-global-clipnorm"])
    x, y = data()
    kwargs = dict(batch_size=4, epochs=1, shuffle=False, verbose=0)
    model.fit(x, y, **kwargs)
    reference.fit(x, y, **kwargs)
    model.save(path)
    return reference


def test_saved_under_four_replicas_loads_under_two_and_under_none(tmp_path):
    x, y = data()
    path = str(tmp_path / "model.keras")
    reference = trained_under(4, path)
    kwargs = dict(batch_size=4, epochs=1, shuffle=False, verbose=0)
    plain = keras.models.load_model(path)  # no strategy: the whole state, as the optimizer built whole
    assert_close([v.numpy() for v in plain.optimizer.variables], [v.numpy() for v in reference.optimizer.variables])
    with ks.experimental.ShardedDataParallelStrategy(devices(2)).scope():
        resumed = keras.models.load_model(path)
    # The saved state waits for the pieces: no whole copy of it is made.
    assert not resumed.optimizer.built and len(resumed.optimizer.variables) == 2  # iterations, learning rate
    for model in (plain, resumed, reference):
        history = model.fit(x, y, **kwargs).history
    assert_close(resumed.get_weights(), reference.get_weights())
    assert_close(plain.get_weights(), reference.get_weights())
    assert_close([history["loss"]], [resumed.history.history["loss"]])
    assert not resumed.optimizer.built


def test_weights_and_checkpoints_load_into_pieces(tmp_path):
    """`load_weights` and `ks.experimental.Checkpoint` into a model whose optimizer has not updated
    yet: the whole state goes straight into the pieces (never built whole)."""
    x, y = data()
    strategy = ks.experimental.ShardedDataParallelStrategy(devices(4))
    model, reference = sharded_and_reference(strategy, OPTIMIZERS["adam-global-clipnorm"])
    kwargs = dict(batch_size=4, epochs=1, shuffle=False, verbose=0)
    model.fit(x, y, **kwargs)
    reference.fit(x, y, **kwargs)
    weights = str(tmp_path / "model.weights.h5")
    model.save_weights(weights)
    checkpoint = ks.experimental.Checkpoint(model=model, optimizer=model.optimizer).write(str(tmp_path / "ckpt"))
    assert os.path.exists(checkpoint + ".npz")
    reference.fit(x, y, **kwargs)  # the second epoch, which each restored model trains
    for load in ("weights", "checkpoint"):
        two = ks.experimental.ShardedDataParallelStrategy(devices(2))
        with two.scope():
            restored = build(OPTIMIZERS["adam-global-clipnorm"])
            if load == "weights":
                restored.load_weights(weights)
            else:
                ks.experimental.Checkpoint(model=restored, optimizer=restored.optimizer).read(checkpoint)
        assert not restored.optimizer.built
        assert int(restored.optimizer.iterations.numpy()) == 4
        restored.fit(x, y, **kwargs)
        assert not restored.optimizer.built
        assert_close(two.extended.optimizer_state(restored.optimizer).whole_values(),
                     [v.numpy() for v in reference.optimizer.variables])
        assert_close(restored.get_weights(), reference.get_weights())


def test_refusals_name_the_fix():
    with pytest.raises(ValueError, match="stage must be 1, 2 or 3"):
        ks.experimental.ShardedDataParallelStrategy(stage=0)
    with pytest.raises(ValueError, match="stage 3 .*not available yet"):
        ks.experimental.ShardedDataParallelStrategy(stage=3)
    x, y = data()
    for optimizer, match in ((lambda: keras.optimizers.Adafactor(), "Adafactor reads whole rows"),
                             (lambda: keras.optimizers.SGD(gradient_accumulation_steps=2, clipnorm=1.0),
                              "with gradient_accumulation_steps use clipvalue")):
        strategy = ks.experimental.ShardedDataParallelStrategy(devices(2))
        with strategy.scope():
            model = build(optimizer)
        with pytest.raises(ValueError, match=match):
            model.fit(x, y, batch_size=4, verbose=0)


@pytest.mark.parametrize("stage", [1, 2])
def test_moving_averages_are_kept_in_pieces_and_written_like_one_device(stage):
    """`use_ema`: each device averages its pieces (overwriting them every 4 of its 9 steps), and `fit` ends
    with the averages in the variables, as on one device."""
    strategy = ks.experimental.ShardedDataParallelStrategy(devices(4), stage=stage)
    model, reference = sharded_and_reference(
        strategy, lambda: keras.optimizers.Adam(0.05, use_ema=True, ema_momentum=0.8, ema_overwrite_frequency=4))
    x, y = data()
    kwargs = dict(batch_size=6, epochs=3, shuffle=False, verbose=0)
    got, expected = model.fit(x, y, **kwargs).history, reference.fit(x, y, **kwargs).history
    np.testing.assert_allclose(got["loss"], expected["loss"], rtol=1e-5, atol=1e-6)
    assert_close(model.get_weights(), reference.get_weights())
    state = strategy.extended.optimizer_state(model.optimizer)
    assert_close(state.whole_values(), [v.numpy() for v in reference.optimizer.variables])
    # Adam's two moments and the averages: three slots, each device holding a piece of each.
    kernel = model.get_layer("hidden").kernel
    assert state.slot_bytes_per_replica() == [3 * sum(math.ceil(math.prod(v.shape) / 4) * 4
                                                      for v in model.trainable_variables)] * 4
    assert not model.optimizer.built and kernel.shape == (FEATURES, 7)


@pytest.mark.parametrize("replicas, stage", [(2, 1), (4, 2)])
def test_a_loss_scale_optimizer_skips_and_rescales_like_one_device(replicas, stage):
    """`LossScaleOptimizer` over a sharded Adam: targets and a scale so large that the gradients
    overflow at first (those steps are skipped and the scale halved), then doubled after 2 finite
    steps, which overflows again."""
    strategy = ks.experimental.ShardedDataParallelStrategy(devices(replicas), stage=stage)
    model, reference = sharded_and_reference(strategy, loss_scaled)
    x, y = scaled_data()
    kwargs = dict(batch_size=6, epochs=3, shuffle=False, verbose=0)
    got, expected = model.fit(x, y, **kwargs).history, reference.fit(x, y, **kwargs).history
    np.testing.assert_allclose(got["loss"], expected["loss"], rtol=1e-5, atol=1e-6)
    assert_close(model.get_weights(), reference.get_weights())
    skipped = 9 - int(keras.ops.convert_to_numpy(reference.optimizer.iterations))
    assert 0 < skipped < 9  # both kinds of step happened
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == 9 - skipped
    state = strategy.extended.optimizer_state(model.optimizer)
    assert state is strategy.extended.optimizer_state(model.optimizer.inner_optimizer)
    assert not model.optimizer.inner_optimizer.built
    # The whole state as Keras' own holds it: the scaler's variables, then the inner optimizer's.
    assert [v.name for v in model.optimizer.variables[:4]] == [v.name for v in reference.optimizer.variables[:4]]
    assert_close([v.numpy() for v in model.optimizer.variables[:4]],
                 [v.numpy() for v in reference.optimizer.variables[:4]])
    assert_close(state.whole_values(), [v.numpy() for v in reference.optimizer.inner_optimizer.variables])


def test_a_loss_scale_optimizer_saved_under_four_replicas_loads_under_two_and_under_none(tmp_path):
    model, reference = sharded_and_reference(ks.experimental.ShardedDataParallelStrategy(devices(4)), loss_scaled)
    x, y = scaled_data()
    kwargs = dict(batch_size=6, epochs=2, shuffle=False, verbose=0)
    model.fit(x, y, **kwargs)
    reference.fit(x, y, **kwargs)
    path = str(tmp_path / "scaled.keras")
    model.save(path)
    plain = keras.models.load_model(path)
    assert_close([v.numpy() for v in plain.optimizer.variables], [v.numpy() for v in reference.optimizer.variables])
    two = ks.experimental.ShardedDataParallelStrategy(devices(2))
    with two.scope():
        resumed = keras.models.load_model(path)
    for trained in (plain, resumed, reference):
        trained.fit(x, y, **kwargs)
    assert not resumed.optimizer.inner_optimizer.built
    assert_close([v.numpy() for v in resumed.optimizer.variables[:4]],
                 [v.numpy() for v in reference.optimizer.variables[:4]])
    assert_close(two.extended.optimizer_state(resumed.optimizer).whole_values(),
                 [v.numpy() for v in reference.optimizer.inner_optimizer.variables])
    assert_close(resumed.get_weights(), reference.get_weights())
    assert_close(plain.get_weights(), reference.get_weights())


EMBEDDING_OPTIMIZERS = {
    "slices": lambda: keras.optimizers.Adam(0.05),
    "clipped": lambda: keras.optimizers.Adam(0.05, global_clipnorm=1.0),
    # Keras' LossScaleOptimizer divides the slices by its scale, which makes them dense.
    "loss-scaled": lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.05), initial_scale=2.0 ** 8),
}


@pytest.mark.parametrize("optimizer", list(EMBEDDING_OPTIMIZERS))
@pytest.mark.parametrize("stage", [1, 2])
def test_an_embedding_trained_with_adam_equals_one_device(stage, optimizer):
    # On TensorFlow an Embedding's gradient is an IndexedSlices, which Keras' Adam applies slice by
    # slice (squaring each before the repeated tokens add up): each device's piece takes the slices
    # of its elements, so the pieces' update equals the whole one.
    rng = np.random.default_rng(5)
    tokens, y = rng.integers(0, 20, size=(50, 6)).astype("int32"), rng.normal(size=(50, 1)).astype("float32")

    def build_embedding():
        model = keras.Sequential([keras.Input((6,), dtype="int32"), keras.layers.Embedding(20, 4),
                                  keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(1)])
        model.compile(optimizer=EMBEDDING_OPTIMIZERS[optimizer](), loss="mse")
        return model

    strategy = ks.experimental.ShardedDataParallelStrategy(devices(2), stage=stage)
    model, reference = built_and_reference(strategy, build_embedding)
    kwargs = dict(batch_size=16, epochs=2, shuffle=False, verbose=0)  # a partial last batch of 2 rows
    history = model.fit(tokens, y, **kwargs).history
    expected = reference.fit(tokens, y, **kwargs).history
    assert_close([history["loss"]], [expected["loss"]])
    assert_close(model.get_weights(), reference.get_weights())
    own = [v.numpy() for v in model.optimizer.variables[:4]] if optimizer == "loss-scaled" else []
    assert_close(own + strategy.extended.optimizer_state(model.optimizer).whole_values(),
                 [v.numpy() for v in reference.optimizer.variables])


def test_one_device_is_plain_keras():
    strategy = ks.experimental.ShardedDataParallelStrategy(devices(1))
    model, reference = sharded_and_reference(strategy, OPTIMIZERS["adam-global-clipnorm"])
    x, y = data()
    kwargs = dict(batch_size=4, epochs=1, shuffle=False, verbose=0)
    model.fit(x, y, **kwargs)
    reference.fit(x, y, **kwargs)
    assert_close(model.get_weights(), reference.get_weights())
    assert strategy.extended.optimizer_state(model.optimizer) is None and model.optimizer.built


def test_backup_and_restore_resumes_exactly_under_another_replica_count(tmp_path):
    """A `fit` stopped after its first epoch resumes from `BackupAndRestore`'s backup under 2
    replicas (the optimizer state loaded into the new pieces) and ends where one device does."""
    x, y = data()
    kwargs = dict(batch_size=4, epochs=3, shuffle=False, verbose=0)

    class StopAfterFirstEpoch(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 1:
                raise RuntimeError("stopped")

    backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
    strategy = ks.experimental.ShardedDataParallelStrategy(devices(4), stage=2)
    model, reference = sharded_and_reference(strategy, OPTIMIZERS["adam-global-clipnorm"])
    initial = reference.get_weights()
    with pytest.raises(RuntimeError, match="stopped"):
        model.fit(x, y, callbacks=[backup, StopAfterFirstEpoch()], **kwargs)
    two = ks.experimental.ShardedDataParallelStrategy(devices(2), stage=1)
    with two.scope():
        resumed = build(OPTIMIZERS["adam-global-clipnorm"])
    resumed.set_weights(initial)  # overwritten by the backup
    history = resumed.fit(x, y, callbacks=[backup], **kwargs).history
    expected = reference.fit(x, y, **kwargs).history
    assert len(history["loss"]) == 2
    np.testing.assert_allclose(history["loss"], expected["loss"][1:], rtol=1e-5, atol=1e-6)
    assert_close(resumed.get_weights(), reference.get_weights())


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_mixed_precision_equals_one_device_to_its_precision(policy):
    """Layers computing in bfloat16 (no loss scaling) or float16 (a LossScaleOptimizer), float32 variables."""
    def optimizer():
        adam = keras.optimizers.Adam(0.02)
        return keras.optimizers.LossScaleOptimizer(adam) if policy == "mixed_float16" else adam

    def mixed():
        model = keras.Sequential([keras.Input((FEATURES,)),
                                  keras.layers.Dense(7, activation="tanh", dtype=policy),
                                  keras.layers.Dense(3, dtype=policy)])
        model.compile(loss="mse", optimizer=optimizer())
        return model

    strategy = ks.experimental.ShardedDataParallelStrategy(devices(4), stage=2)
    with strategy.scope():
        model = mixed()
    reference = mixed()
    model.set_weights(reference.get_weights())
    x, y = data()
    kwargs = dict(batch_size=6, epochs=2, shuffle=False, verbose=0)
    got, expected = model.fit(x, y, **kwargs).history, reference.fit(x, y, **kwargs).history
    np.testing.assert_allclose(got["loss"], expected["loss"], rtol=2e-2)
    for g, e in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(g, e, rtol=2e-2, atol=5e-3)
    assert {keras.backend.standardize_dtype(p.dtype) for p in strategy.extended.optimizer_state(
        model.optimizer).pieces[0]} == {"float32"}
