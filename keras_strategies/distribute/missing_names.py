"""Clear errors for `tf.distribute` names that keras-strategies does not provide (yet).

A script moved over with `s/tf.distribute/ks/` should learn at once which part
has no counterpart here, not meet a bare "has no attribute".
"""

from __future__ import annotations

from typing import Callable

NOT_PROVIDED = {
    "PreemptionWatcher": "a watcher of preemption notices from TensorFlow's coordination service (use "
                         "ks.experimental.PreemptionCheckpointHandler, or BackupAndRestore(save_before_preemption=True))",
    "CollectiveHints": "TF's deprecated collective hints (use ks.CommunicationOptions)",
    "rpc": "TF's experimental RPC",
}

# `tf.distribute.cluster_resolver` names without a counterpart in `ks.cluster_resolver`.
NOT_PROVIDED_RESOLVERS = {
    "GCEClusterResolver": "a resolver of Google Compute Engine instance groups (pass a SimpleClusterResolver "
                          "or set TF_CONFIG)",
    "KubernetesClusterResolver": "a resolver that queries the Kubernetes API (a Kubeflow TFJob sets TF_CONFIG, "
                                 "which ks.cluster_resolver.TFConfigClusterResolver reads)",
}

PROVIDED = (
    "OneDeviceStrategy, MirroredStrategy, CentralStorageStrategy, MultiWorkerMirroredStrategy, "
    "ParameterServerStrategy and TPUStrategy"
)


def attribute_error(module: str, tf_name: str, name: str, not_provided: dict = NOT_PROVIDED) -> AttributeError:
    """The error for `module.name`: what it is in TF and what to use here, or the usual message."""
    what = not_provided.get(name)
    if what is None:
        return AttributeError(f"module {module!r} has no attribute {name!r}")
    return AttributeError(
        f"keras-strategies does not provide {tf_name} ({what}). It provides {PROVIDED}, with the "
        "tf.distribute API on every Keras backend."
    )


def module_getattr(module: str, tf_module: str, not_provided: dict = NOT_PROVIDED) -> Callable[[str], None]:
    """A module's `__getattr__`: the error of `attribute_error` for `module.<name>`."""

    def __getattr__(name: str) -> None:
        raise attribute_error(module, f"{tf_module}.{name}", name, not_provided)

    return __getattr__
