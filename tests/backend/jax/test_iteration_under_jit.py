"""Taking a distributed dataset's next batch inside `jax.jit` is refused with a clear error.

The batches are split on the host; read while JAX traces, one batch would be baked into the
program. The error says to take batches in Python and call the compiled step per batch.
"""

import jax
import numpy as np
import pytest

import keras_strategies as ks


def test_next_batch_inside_jax_jit_is_refused_and_python_iteration_works():
    strategy = ks.MirroredStrategy(["cpu:0", "cpu:1"])
    dataset = strategy.experimental_distribute_dataset(strategy.make_experimental_numpy_dataset(np.ones((6, 2), "float32")).batch(4))
    iterator = iter(dataset)
    with pytest.raises(RuntimeError, match="cannot be iterated inside a compiled function"):
        jax.jit(lambda: strategy.experimental_local_results(next(iterator))[0].sum())()
    assert [sum(int(v.shape[0]) for v in strategy.experimental_local_results(batch)) for batch in dataset] == [4, 2]
