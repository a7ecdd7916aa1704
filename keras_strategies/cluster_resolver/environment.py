"""Which resolver `ks.MultiWorkerMirroredStrategy()` uses when it is given none.

The first environment present wins: `TF_CONFIG` (our launcher, a Kubernetes
TFJob, a hand-written config), then torchrun's variables, a SLURM step of
several tasks, `mpirun`'s variables. Without any of them the script is one
local worker. A process that looks launched as one of several (the rank
variables are there) but lacks what its resolver needs gets that resolver's
error rather than training alone, unnoticed.
"""

from __future__ import annotations

import os

from keras_strategies.cluster_resolver.launchers import MPIClusterResolver, TorchrunClusterResolver
from keras_strategies.cluster_resolver.resolvers import ClusterResolver, TFConfigClusterResolver, load_tf_config
from keras_strategies.cluster_resolver.slurm import SlurmClusterResolver


def _more_than_one(*names: str) -> bool:
    values = [os.environ.get(name, "") for name in names]
    return any(value.isdigit() and int(value) > 1 for value in values)


def resolver_from_environment() -> ClusterResolver:
    """The resolver of the launcher that started this process (see the module docstring)."""
    if load_tf_config():
        return TFConfigClusterResolver()
    if _more_than_one("WORLD_SIZE") and "RANK" in os.environ:
        return TorchrunClusterResolver()
    if _more_than_one("SLURM_STEP_NUM_TASKS") and "SLURM_PROCID" in os.environ:
        return SlurmClusterResolver()
    if _more_than_one("OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        return MPIClusterResolver()
    return TFConfigClusterResolver()
