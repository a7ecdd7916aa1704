"""The Keras functions this engine replaces: Keras' TF optimizer in cross-replica context, and
Keras variables on parameter servers.

The replacements live in `optimizer.py` and `parameter_server.py`, each declared with its reason
in the patch registry (`keras_strategies.backend.common.patches`); this module installs them.
"""

from __future__ import annotations

from typing import Any

from keras_strategies.backend.tensorflow import optimizer, parameter_server


def install(strategy_context: Any) -> None:
    """Installs the replacements (idempotent); they need no strategy context."""
    optimizer.install()
    parameter_server.install_keras_hooks()
