"""The JAX engine's eager replica threads."""

import jax
import jax.numpy as jnp
import pytest

import keras_strategies as ks


def test_a_sum_over_replicas_inside_jax_jit_in_strategy_run_says_what_to_do():
    strategy = ks.MirroredStrategy(devices=["cpu:0", "cpu:1"])

    def fn():
        return jax.jit(lambda x: ks.get_replica_context().all_reduce("sum", x))(jnp.ones(2))

    with pytest.raises(NotImplementedError, match="jax.jit"):
        strategy.run(fn)
