"""`ks.MultiWorkerMirroredStrategy()` picks the resolver of the launcher that started the process."""

import json

import pytest

import keras_strategies as ks
from keras_strategies.cluster_resolver.environment import resolver_from_environment
from test_launchers import LAUNCH_VARIABLES

SLURM_VARIABLES = ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_NODELIST", "SLURM_STEP_TASKS_PER_NODE")


@pytest.fixture
def clean(monkeypatch):
    for name in (*LAUNCH_VARIABLES, *SLURM_VARIABLES, "TF_CONFIG", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _set(monkeypatch, **values):
    for name, value in values.items():
        monkeypatch.setenv(name, str(value))


def test_nothing_set_is_one_local_worker(clean):
    resolver = resolver_from_environment()
    assert isinstance(resolver, ks.cluster_resolver.TFConfigClusterResolver) and not resolver.cluster_spec()


def test_tf_config_comes_first(clean):
    clean.setenv("TF_CONFIG", json.dumps({"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": 0}}))
    _set(clean, RANK=1, WORLD_SIZE=2)
    assert isinstance(resolver_from_environment(), ks.cluster_resolver.TFConfigClusterResolver)


def test_torchrun_slurm_and_mpi_are_found(clean):
    _set(clean, SLURM_PROCID=1, SLURM_STEP_NUM_TASKS=2, SLURM_STEP_NODELIST="n[1-2]", SLURM_STEP_TASKS_PER_NODE="1(x2)")
    resolver = resolver_from_environment()
    assert isinstance(resolver, ks.cluster_resolver.SlurmClusterResolver) and resolver.task_id == 1
    _set(clean, RANK=0, WORLD_SIZE=2, MASTER_ADDR="127.0.0.1", MASTER_PORT=29500)
    assert isinstance(resolver_from_environment(), ks.cluster_resolver.TorchrunClusterResolver)  # torchrun in srun
    for name in (*LAUNCH_VARIABLES, *SLURM_VARIABLES):
        clean.delenv(name, raising=False)
    _set(clean, PMI_RANK=0, PMI_SIZE=2, MASTER_ADDR="127.0.0.1", MASTER_PORT=29500)
    assert isinstance(resolver_from_environment(), ks.cluster_resolver.MPIClusterResolver)


def test_a_launch_of_one_process_is_one_local_worker(clean):
    _set(clean, RANK=0, WORLD_SIZE=1, SLURM_PROCID=0, SLURM_STEP_NUM_TASKS=1)
    assert not resolver_from_environment().cluster_spec()


def test_a_launch_missing_the_chiefs_address_fails_instead_of_training_alone(clean):
    _set(clean, RANK=1, WORLD_SIZE=2)
    with pytest.raises(RuntimeError, match="MASTER_ADDR, MASTER_PORT not found"):
        ks.MultiWorkerMirroredStrategy()


@pytest.mark.parametrize("name", ["GCEClusterResolver", "KubernetesClusterResolver"])
def test_tensorflow_resolvers_that_are_not_provided_say_so(name):
    with pytest.raises(AttributeError, match=f"does not provide tf.distribute.cluster_resolver.{name}"):
        getattr(ks.cluster_resolver, name)
    with pytest.raises(AttributeError, match="has no attribute 'NoSuchResolver'"):
        ks.cluster_resolver.NoSuchResolver
