"""PyTorch engine."""

from keras_strategies.backend.torch import devices  # noqa: F401
