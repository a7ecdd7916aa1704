"""Every change keras-strategies makes to Keras, installed by one `install()` at import.

Each module here declares the Keras functions it replaces, with the reason, in
the one patch registry (`keras_strategies.backend.common.patches`); the
engines declare theirs there too. Each replacement first checks whether a
strategy is involved and otherwise calls Keras' own code unchanged, so models
built outside every strategy scope behave exactly as without this package.
The table of every replacement, generated from the registry, is the docs page
`reference/keras-patches.md`.
"""

from __future__ import annotations

from keras_strategies.backend import engine
from keras_strategies.backend.common import patches
from keras_strategies.distribute import context
from keras_strategies.keras_integration import (
    backup_and_restore,
    batch_norm,
    chief_only,
    loss_reduction,
    loss_scaling,
    metric_weighting,
    optimizer_hooks,
    ownership,
    replica_seeds,
    sharded_averages,
    sharded_saving,
)


def replaced() -> list:
    """Every declared replacement of the current backend (`patches.Patch`), in declaration order."""
    return patches.registered()


def install() -> None:
    """Installs the replacements declared to be in place from import on (idempotent)."""
    ownership.install()
    batch_norm.install()
    optimizer_hooks.install()
    loss_scaling.install()
    loss_reduction.install()
    metric_weighting.install()
    chief_only.install()
    backup_and_restore.install()
    replica_seeds.install()
    sharded_saving.install()
    sharded_averages.install()
    engine.keras_hooks.install(context)
