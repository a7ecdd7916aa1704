"""`TPUStrategy` over the hosts of a TPU slice (JAX), on two worker processes on 127.0.0.1.

Cloud TPU's environment names the slice's hosts (`TPU_WORKER_HOSTNAMES`) and
each host's index (`TPU_WORKER_ID`); the strategy joins them as the workers of
one cluster, each host's cores (here 2 virtual CPU devices, through the
test-only `_test_devices`) its replicas. Every step's shards keep one static
shape, a partial last batch included, and training equals one device.
"""

import keras
import numpy as np
import pytest

from mw_launch import run_together

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "jax",
    reason="JAX only: TensorFlow's TPU runtime drives a slice's hosts itself, PyTorch has no TPU runtime",
)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = run_together(("tpu_hosts.py",), 2, tmp_path_factory)
    return [np.load(out / f"worker_{i}.npz") for i in range(2)]


def _listed(archive, key):
    return [archive[k] for k in sorted((k for k in archive.files if k.startswith(key + "_")), key=lambda k: int(k.rsplit("_", 1)[1]))]


def test_the_hosts_of_a_slice_are_one_strategy_with_static_shard_shapes(results):
    for worker in results:
        assert int(worker["replicas"]) == 4 and bool(worker["static"])
        # Global batches of 8 over 2 hosts x 2 cores: 2 rows a shard, the partial batch of 3 (real rows 1, 1, 1
        # and 0) too; fit's 6 steps, evaluate's 3 and predict's 3, each host cutting its 2 shards.
        assert worker["rows"].tolist() == [[2, 2]] * 12


def test_fit_evaluate_and_predict_over_the_hosts_equal_one_device(results):
    first = results[0]
    reference = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="relu"), keras.layers.Dense(1)])
    reference.compile(loss="mse", optimizer=keras.optimizers.SGD(0.05), metrics=["mae"], steps_per_execution=2)
    reference.set_weights(_listed(first, "initial"))
    x, y = first["x"], first["y"]
    history = reference.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history
    evaluated = reference.evaluate(x, y, batch_size=8, verbose=0)
    predicted = reference.predict(x, batch_size=8, verbose=0)
    for worker in results:
        for got, want in zip(_listed(worker, "weights"), reference.get_weights()):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(worker["loss"], history["loss"], rtol=1e-5)
        np.testing.assert_allclose(worker["mae"], history["mae"], rtol=1e-5)
        np.testing.assert_allclose(worker["evaluated"], evaluated, rtol=1e-5)
        np.testing.assert_allclose(worker["predicted"], predicted, rtol=1e-5, atol=1e-6)
