"""The resolvers of torchrun's and mpirun's environments give every worker an address of its own."""

import pytest

from keras_strategies.cluster_resolver import MPIClusterResolver, TorchrunClusterResolver

LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMPI_COMM_WORLD_RANK",
                    "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "PMI_RANK", "PMI_SIZE")


def _env(monkeypatch, **values):
    for name in LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in values.items():
        monkeypatch.setenv(name, str(value))


def test_torchrun_on_one_node_puts_worker_r_after_the_master_port(monkeypatch):
    _env(monkeypatch, RANK=1, WORLD_SIZE=3, LOCAL_WORLD_SIZE=3, MASTER_ADDR="127.0.0.1", MASTER_PORT=29500)
    resolver = TorchrunClusterResolver()
    assert resolver.cluster_spec().as_dict() == {"worker": ["127.0.0.1:29501", "127.0.0.1:29502", "127.0.0.1:29503"]}
    assert (resolver.task_type, resolver.task_id) == ("worker", 1)
    assert resolver.master() == "grpc://127.0.0.1:29502"


def test_torchrun_without_its_variables_says_which_are_missing(monkeypatch):
    _env(monkeypatch, RANK=0, WORLD_SIZE=2)
    with pytest.raises(RuntimeError, match="MASTER_ADDR, MASTER_PORT not found in environment.*torchrun"):
        TorchrunClusterResolver()


@pytest.mark.parametrize("rank, size", [("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), ("PMI_RANK", "PMI_SIZE")])
def test_mpi_ranks_of_open_mpi_and_mpich(monkeypatch, rank, size):
    _env(monkeypatch, **{rank: 0, size: 2}, MASTER_ADDR="10.0.0.5", MASTER_PORT=1234)
    resolver = MPIClusterResolver()
    assert resolver.cluster_spec().as_dict() == {"worker": ["10.0.0.5:1235", "10.0.0.5:1236"]}
    assert (resolver.task_type, resolver.task_id) == ("worker", 0)


def test_mpi_without_a_master_address_says_how_to_export_it(monkeypatch):
    _env(monkeypatch, OMPI_COMM_WORLD_RANK=0, OMPI_COMM_WORLD_SIZE=2)
    with pytest.raises(RuntimeError, match="MASTER_ADDR and MASTER_PORT are not set.*mpirun -x MASTER_ADDR"):
        MPIClusterResolver()
