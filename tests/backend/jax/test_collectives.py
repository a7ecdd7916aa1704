"""The JAX engine's cross-worker plumbing that needs no second process."""

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from keras_strategies.backend.jax import collectives


def test_worker_block_is_the_global_array_jax_would_build_without_a_copy(monkeypatch):
    device = jax.devices()[0]
    mesh = Mesh(np.array([device]), ("workers",))
    monkeypatch.setattr(collectives, "_state", {"mesh": mesh, "device": device,
                                                "split": NamedSharding(mesh, P("workers"))})
    block = jax.device_put(np.arange(12, dtype="float32").reshape(3, 4), device)
    expected = jax.make_array_from_single_device_arrays((3, 4), collectives._state["split"], [block])

    # The fast path must not fall back to JAX's checked constructor.
    def checked(*args, **kwargs):
        raise AssertionError("fell back to jax.make_array_from_single_device_arrays")

    monkeypatch.setattr(jax, "make_array_from_single_device_arrays", checked)
    for _ in range(2):  # the second call reuses the cached abstract value
        wrapped = collectives._worker_block(block)
        assert wrapped.shape == expected.shape and wrapped.dtype == expected.dtype
        assert wrapped.sharding == expected.sharding and wrapped.aval == expected.aval
        assert wrapped.addressable_data(0).unsafe_buffer_pointer() == block.unsafe_buffer_pointer()
        np.testing.assert_array_equal(np.asarray(wrapped), np.asarray(expected))
