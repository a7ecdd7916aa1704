"""The replicas' shared state, packed into one buffer per dtype and cut back inside the program."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from keras_strategies.backend.jax import shared_state
from keras_strategies.backend.jax.replicas import make_replicated


def _leaves():
    first, second = jax.devices()[:2]
    return [
        jax.device_put(np.arange(6, dtype="float32").reshape(2, 3), first),
        jax.device_put(np.array(7, dtype="int32"), first),
        jax.device_put(np.array(2.5, dtype="float32"), first),
        jax.device_put(np.arange(4, dtype="int32"), second),  # elsewhere: moved before packing
        np.ones((0, 2), "float32"),  # a NumPy leaf, and an empty one
    ]


def test_leaves_come_back_bit_for_bit_with_their_shapes_and_dtypes_from_one_buffer_per_dtype():
    leaves = _leaves()
    layout = shared_state.layout_of(leaves)
    assert layout == (("float32", (2, 3), 0), ("int32", (), 0), ("float32", (), 6), ("int32", (4,), 1),
                      ("float32", (0, 2), 7))
    buffers = shared_state.pack(leaves, layout, jax.devices()[0])
    assert [(b.dtype.name, b.shape) for b in buffers] == [("float32", (7,)), ("int32", (5,))]
    mesh = Mesh(np.array(jax.devices()[:2]), ("r",))
    replicated = jax.device_put(buffers, NamedSharding(mesh, P()))
    unpacked = jax.jit(lambda b: shared_state.unpack(b, layout))(replicated)
    for got, want in zip(unpacked, leaves):
        assert got.dtype == np.asarray(want).dtype and got.shape == np.shape(want)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_every_replica_reads_the_shared_state_and_a_new_layout_gets_its_own_program():
    devices = ["cpu:0", "cpu:1", "cpu:2"]
    run = make_replicated(
        lambda replica_id, weights, count, x: (jnp.sum(weights) * x + count, replica_id), devices, compiled=True
    )
    per_replica = [(np.full((2,), i, "float32"),) for i in range(3)]
    outputs = run((jnp.arange(4.0), jnp.array(3, "int32")), per_replica)
    for i, (value, replica_id) in enumerate(outputs):
        np.testing.assert_array_equal(np.asarray(value), np.full((2,), 6.0 * i + 3))
        assert int(replica_id) == i
    # Other shapes and dtypes of the shared state: another layout, traced on its own.
    outputs = run((jnp.ones((2, 2)), jnp.array(1.5)), per_replica)
    np.testing.assert_allclose([np.asarray(v) for v, _ in outputs], [np.full((2,), 4.0 * i + 1.5) for i in range(3)])
