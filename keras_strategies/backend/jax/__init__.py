"""JAX engine."""

from keras_strategies.backend.jax import devices  # noqa: F401
