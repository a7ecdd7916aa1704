"""Clear errors for `tf.distribute` names that keras-strategies does not provide (yet).

A script moved over with `s/tf.distribute/ks/` should learn at once which part
has no counterpart here, not meet a bare "has no attribute".
"""

from __future__ import annotations

from typing import Callable

NOT_PROVIDED = {
    "PreemptionCheckpointHandler": "preemption handling (use keras.callbacks.BackupAndRestore)",
    "PreemptionWatcher": "preemption handling (use keras.callbacks.BackupAndRestore)",
    "TerminationConfig": "preemption handling (use keras.callbacks.BackupAndRestore)",
    "CollectiveHints": "TF's deprecated collective hints (use ks.CommunicationOptions)",
    "rpc": "TF's experimental RPC",
}

PROVIDED = (
    "OneDeviceStrategy, MirroredStrategy, CentralStorageStrategy, MultiWorkerMirroredStrategy, "
    "ParameterServerStrategy and TPUStrategy"
)


def attribute_error(module: str, tf_name: str, name: str) -> AttributeError:
    """The error for `module.name`: what it is in TF and what to use here, or the usual message."""
    what = NOT_PROVIDED.get(name)
    if what is None:
        return AttributeError(f"module {module!r} has no attribute {name!r}")
    return AttributeError(
        f"keras-strategies does not provide {tf_name} ({what}). It provides {PROVIDED}, with the "
        "tf.distribute API on every Keras backend."
    )


def module_getattr(module: str, tf_module: str) -> Callable[[str], None]:
    """A module's `__getattr__`: the error of `attribute_error` for `module.<name>`."""

    def __getattr__(name: str) -> None:
        raise attribute_error(module, f"{tf_module}.{name}", name)

    return __getattr__
