"""`TPUStrategy`: static shapes, exact partial batches, `steps_per_execution`, and the errors without a TPU.

No TPU was available: the replica program runs on virtual CPU devices through the
test-only `_test_devices` keyword (docs/development.md). Tests marked `tpu` need TPU
cores and skip without them. PyTorch has no TPU runtime: it raises a clear error.
"""

import keras
import numpy as np
import pytest
from keras import ops

import keras_strategies as ks
from keras_strategies.strategies.mirrored import MirroredExtended
from keras_strategies.trainer import replica_step

TORCH = keras.backend.backend() == "torch"
DEVICES = ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]
needs_runtime = pytest.mark.skipif(TORCH, reason="PyTorch has no TPU runtime (see test_pytorch_says_it_has_no_tpu_runtime)")


def build_model():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="relu"), keras.layers.Dense(1)])
    model.compile(loss="mse", optimizer=keras.optimizers.SGD(0.05), metrics=["mae"], steps_per_execution=2)
    return model


def assert_fit_like_one_device(strategy, build, x, y, epochs, rtol=1e-5, atol=1e-6):
    """`fit` of `build()` under `strategy`, from the same weights, ends with the weights of one device."""
    with strategy.scope():
        model = build()
    reference = build()
    reference.set_weights(model.get_weights())
    model.fit(x, y, batch_size=8, epochs=epochs, shuffle=False, verbose=0)
    reference.fit(x, y, batch_size=8, epochs=epochs, shuffle=False, verbose=0)
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    x = rng.uniform(size=(19, 3)).astype("float32")  # batches of 8: 8, 8 and a partial 3
    return x, (x @ np.array([[1.0], [-2.0], [0.5]], "float32")).astype("float32")


@pytest.fixture
def shard_rows(monkeypatch):
    """The rows of every replica shard the Keras steps cut, one list per step."""
    seen = []
    original = replica_step.make_shards

    def recording(*args, **kwargs):
        shards = original(*args, **kwargs)
        seen.append([int(np.shape(x)[0]) for x, *_ in shards.per_replica])
        return shards

    monkeypatch.setattr(replica_step, "make_shards", recording)
    return seen


@needs_runtime
def test_extended_requires_static_shapes_and_reuses_the_mirrored_machinery():
    strategy = ks.TPUStrategy(_test_devices=DEVICES[:2])
    assert strategy.extended.experimental_require_static_shapes is True
    assert ks.MirroredStrategy(DEVICES[:2]).extended.experimental_require_static_shapes is False
    assert isinstance(strategy.extended, MirroredExtended) and strategy.num_replicas_in_sync == 2
    assert ks.experimental.TPUStrategy is ks.TPUStrategy and strategy.cluster_resolver is None
    per_replica = strategy.run(lambda: ops.ones(()) * (ks.get_replica_context().replica_id_in_sync_group + 1))
    assert float(ops.convert_to_numpy(strategy.reduce("sum", per_replica, axis=None))) == 3.0


@needs_runtime
@pytest.mark.filterwarnings("ignore:Your input ran out of data")  # Keras' own, with steps_per_execution
def test_partial_last_batches_keep_the_shard_shape_and_train_exactly(data, shard_rows):
    x, y = data
    strategy = ks.TPUStrategy(_test_devices=DEVICES)
    with strategy.scope():
        model = build_model()
    reference = build_model()
    reference.set_weights(model.get_weights())
    batch_ends, expected_ends = [], []
    history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: batch_ends.append(batch))])
    expected = reference.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[
        keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: expected_ends.append(batch))])
    # Batches of 8 over 4 replicas: every step's shards have 2 rows; the partial batch's (1, 1, 1 and 0 real
    # rows) too, padded with rows of weight 0.
    assert shard_rows == [[2, 2, 2, 2]] * 6
    # steps_per_execution=2: the callbacks see one batch end per execution (2 steps, then the last 1), as in Keras.
    assert len(batch_ends) == 4 and batch_ends == expected_ends
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(history.history["loss"], expected.history["loss"], rtol=1e-5)
    del shard_rows[:]
    np.testing.assert_allclose(model.evaluate(x, y, batch_size=8, verbose=0),
                               reference.evaluate(x, y, batch_size=8, verbose=0), rtol=1e-5)
    predictions = model.predict(x, batch_size=8, verbose=0)
    assert predictions.shape == (19, 1) and shard_rows == [[2, 2, 2, 2]] * 6
    np.testing.assert_allclose(predictions, reference.predict(x, batch_size=8, verbose=0), rtol=1e-5, atol=1e-6)


class ActivityPenalty(keras.layers.Layer):
    """An `add_loss` term of the batch mean, which padding rows would enter."""

    def call(self, inputs):
        self.add_loss(0.1 * ops.mean(inputs))
        return inputs


@needs_runtime
def test_a_model_whose_loss_padding_rows_would_enter_trains_exactly(data, shard_rows):
    # Its padded partial batch runs eagerly at the shards' own sizes: exact, one slower step.
    x, y = data
    strategy = ks.TPUStrategy(_test_devices=DEVICES[:2])

    def build(run_eagerly=False):
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), ActivityPenalty(), keras.layers.Dense(1)])
        model.compile(loss="mse", optimizer=keras.optimizers.SGD(0.05), run_eagerly=run_eagerly)
        return model

    assert_fit_like_one_device(strategy, build, x, y, epochs=1)
    # Eager steps compile nothing: they cut each shard at its own size, with no padding rows.
    with strategy.scope():
        eager = build(run_eagerly=True)
    del shard_rows[:]
    eager.predict(x[16:], batch_size=8, verbose=0)
    assert shard_rows == [[2, 1]]


@needs_runtime
def test_without_a_tpu_the_errors_are_tensorflow_s():
    with pytest.raises(ValueError, match="^Please provide a TPU Name to connect to."):
        ks.cluster_resolver.TPUClusterResolver()
    with pytest.raises(ValueError, match="^Please provide a TPU Name to connect to."):
        ks.TPUStrategy()
    resolver = ks.cluster_resolver.TPUClusterResolver(tpu="local")  # this host's chips: it has none
    assert resolver.master() == "" and resolver.cluster_spec().as_dict() == {}
    ks.experimental_connect_to_cluster(resolver)  # nothing to connect to for local chips
    with pytest.raises(RuntimeError, match="^TPUs not found in the cluster."):
        ks.initialize_tpu_system(resolver)
    with pytest.raises(RuntimeError, match="^TPUs not found in the cluster."):
        ks.TPUStrategy(resolver)
    with pytest.raises(TypeError, match="must be a ks.cluster_resolver.TPUClusterResolver"):
        ks.TPUStrategy(ks.cluster_resolver.TFConfigClusterResolver())


def test_the_hosts_of_a_slice_come_from_cloud_tpu_s_environment_on_jax_only(monkeypatch):
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "10.0.0.2,10.0.0.3:9000")
    monkeypatch.setenv("TPU_WORKER_ID", "1")
    if TORCH:  # no TPU runtime, whatever the environment says
        with pytest.raises(RuntimeError, match="not available on the PyTorch backend"):
            ks.cluster_resolver.TPUClusterResolver()
        return
    if keras.backend.backend() == "tensorflow":
        # TensorFlow's TPU runtime drives a slice's hosts itself, from the TPU's name: the variables
        # name no hosts for this package, and a machine without a TPU still gets TensorFlow's error.
        with pytest.raises(ValueError, match="^Please provide a TPU Name to connect to."):
            ks.cluster_resolver.TPUClusterResolver()
        assert ks.TPUStrategy(_test_devices=DEVICES[:2]).num_replicas_in_sync == 2
        return
    # JAX reads the hosts without looking for its devices, which exist once the hosts have joined
    # (the strategy joins them: tests/multi_worker/test_multi_worker_tpu_hosts.py).
    resolver = ks.cluster_resolver.TPUClusterResolver()
    assert resolver.cluster_spec().as_dict() == {"worker": ["10.0.0.2:8482", "10.0.0.3:9000"]}
    assert resolver.master() == ""
    monkeypatch.setenv("TPU_WORKER_ID", "2")
    with pytest.raises(ValueError, match="names 2 hosts, but TPU_WORKER_ID is '2': set it to this host's index"):
        ks.cluster_resolver.TPUClusterResolver()
    monkeypatch.delenv("TPU_WORKER_ID")
    with pytest.raises(ValueError, match="TPU_WORKER_ID is ''"):
        ks.TPUStrategy(_test_devices=DEVICES[:2])


@pytest.mark.skipif(not TORCH, reason="the PyTorch backend's error")
def test_pytorch_says_it_has_no_tpu_runtime():
    for call in (lambda: ks.TPUStrategy(_test_devices=DEVICES[:2]), ks.cluster_resolver.TPUClusterResolver,
                 ks.initialize_tpu_system, lambda: ks.experimental_connect_to_cluster(None)):
        with pytest.raises(RuntimeError, match="not available on the PyTorch backend: .*torch-xla"):
            call()


@pytest.mark.tpu
@needs_runtime
def test_on_tpu_cores_fit_matches_one_device(data):
    if not any(d.startswith("tpu:") for d in ks.list_devices()):
        pytest.skip(f"needs TPU cores visible to the {keras.backend.backend()} backend; it sees none")
    resolver = ks.cluster_resolver.TPUClusterResolver(tpu="")
    ks.experimental_connect_to_cluster(resolver)
    ks.initialize_tpu_system(resolver)
    strategy = ks.TPUStrategy(resolver)
    assert strategy.cluster_resolver is resolver
    assert_fit_like_one_device(strategy, build_model, *data, epochs=2, rtol=1e-3, atol=1e-4)
