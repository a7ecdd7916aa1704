"""JAX engine."""

from keras_strategies.backend.jax import devices  # noqa: F401
from keras_strategies.backend.jax import compiler  # noqa: F401
from keras_strategies.backend.jax import gradients  # noqa: F401
from keras_strategies.backend.jax import replicas  # noqa: F401
from keras_strategies.backend.jax import optimizer  # noqa: F401
from keras_strategies.backend.jax import trainer  # noqa: F401
from keras_strategies.backend.jax import collectives  # noqa: F401
from keras_strategies.backend.jax import keras_hooks  # noqa: F401
from keras_strategies.backend.jax import nccl  # noqa: F401
from keras_strategies.backend.jax import parameter_server  # noqa: F401
from keras_strategies.backend.jax import tpu  # noqa: F401
