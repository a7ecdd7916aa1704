"""TensorFlow engine."""

from keras_strategies.backend.tensorflow import devices  # noqa: F401
