"""Backend engines: one sub-package per Keras backend, each with the same modules.

Shared code imports `engine` from here, an `Engine` typed by the contract
(`contract.py`: a protocol per engine module, `Capabilities` for the ways they
differ), and never branches on the backend name, following Keras' own
`keras/src/backend/<name>/` split.
"""

from __future__ import annotations

import importlib

import keras

from keras_strategies.backend.contract import Engine

SUPPORTED_BACKENDS = ("tensorflow", "jax", "torch")


def backend_name() -> str:
    """Keras' backend, as `keras.backend.backend()`."""
    return keras.backend.backend()


def _load() -> Engine:
    name = backend_name()
    if name not in SUPPORTED_BACKENDS:
        raise RuntimeError(
            f"keras_strategies supports the Keras backends {', '.join(SUPPORTED_BACKENDS)}; "
            f"the current backend is {name!r}. Set KERAS_BACKEND to one of them."
        )
    return Engine(name, importlib.import_module(f"keras_strategies.backend.{name}"))


engine = _load()
