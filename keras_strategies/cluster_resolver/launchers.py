"""Resolvers for the environments that `torchrun` and `mpirun` give the processes they start.

These launchers give each process its rank and the world size, and the
address of rank 0 (`MASTER_ADDR`, `MASTER_PORT`), but no address of the other
processes, which TensorFlow's workers need. Worker `r` listens on port
`MASTER_PORT + 1 + r` (the port `MASTER_PORT` itself belongs to torchrun's own
store) of its node: on one node that is `MASTER_ADDR`; across nodes each
process publishes its address through the launcher's own exchange, torchrun's
store (`torch.distributed.TCPStore`) or MPI (`mpi4py`'s allgather).
"""

from __future__ import annotations

import os
import socket
from typing import Any, Optional

from keras_strategies.cluster_resolver.cluster_spec import ClusterSpec
from keras_strategies.cluster_resolver.resolvers import ClusterResolver, task_master

_EXCHANGE_TIMEOUT_S = 300


def _int_env(*names: str) -> Optional[int]:
    for name in names:
        value = os.environ.get(name)
        if value not in (None, ""):
            return int(value)
    return None


def own_host(master_addr: str) -> str:
    """This node's address as seen on the route to `master_addr` (no packet is sent)."""
    if master_addr in ("127.0.0.1", "localhost"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((master_addr, 9))
            return probe.getsockname()[0]
        except OSError:
            return socket.getfqdn()


class _RankEnvironmentResolver(ClusterResolver):
    """A cluster of `world_size` workers, this process being `rank`; see the module docstring."""

    _launcher = ""

    def __init__(self, rank: int, world_size: int, local_world_size: int, master_addr: str, master_port: int,
                 rpc_layer: Optional[str] = "grpc"):
        if not 0 <= rank < world_size:
            raise ValueError(f"{self._launcher} gave rank {rank} of a world of {world_size} processes.")
        self._rank, self._world_size = rank, world_size
        self._one_node = local_world_size == world_size
        self._master_addr, self._master_port = master_addr, master_port
        self.task_type, self.task_id = "worker", rank
        self.rpc_layer = rpc_layer
        self._addresses: Optional[list[str]] = None

    @property
    def rank(self) -> int:
        """This process's rank (its worker index)."""
        return self._rank

    @property
    def world_size(self) -> int:
        """The number of processes (workers)."""
        return self._world_size

    def _exchange(self, address: str) -> list[str]:
        """Every process's address, in rank order (processes on several nodes)."""
        raise NotImplementedError

    def cluster_spec(self) -> ClusterSpec:
        """`{"worker": [address of rank 0, rank 1, ...]}`; across nodes exchanged once, then kept."""
        if self._addresses is None:
            if self._one_node:
                self._addresses = [f"{self._master_addr}:{self._master_port + 1 + r}" for r in range(self._world_size)]
            else:
                self._addresses = self._exchange(f"{own_host(self._master_addr)}:{self._master_port + 1 + self._rank}")
        return ClusterSpec({"worker": list(self._addresses)})

    def master(self, task_type: Optional[str] = None, task_id: Optional[int] = None,
               rpc_layer: Optional[str] = None) -> str:
        """`grpc://host:port` of a task (this one by default)."""
        return task_master(self, task_type, task_id, rpc_layer)

    def num_accelerators(self, task_type: Optional[str] = None, task_id: Optional[int] = None,
                         config_proto: Any = None) -> dict[str, int]:
        """`{}`: strategies use the local devices."""
        return {}


class TorchrunClusterResolver(_RankEnvironmentResolver):
    """Reads the cluster from the variables `torchrun` (and `torch.distributed.launch`) set.

    `RANK`, `WORLD_SIZE`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR` and
    `MASTER_PORT`: every process is a `worker`, rank 0 the chief. Worker `r`
    listens on port `MASTER_PORT + 1 + r` of its node (`MASTER_ADDR` on one
    node); across nodes the workers exchange their addresses through torchrun's store at
    `MASTER_ADDR:MASTER_PORT` (so PyTorch must be installed, as it is wherever
    torchrun runs). TensorFlow has no counterpart. `ks.MultiWorkerMirroredStrategy()`
    uses it by itself under torchrun when `TF_CONFIG` is not set.

    Examples:
        ```python
        # torchrun --nproc-per-node 2 train.py
        strategy = ks.MultiWorkerMirroredStrategy()  # 2 workers, found through torchrun
        ```
    """

    _launcher = "torchrun"

    def __init__(self, rpc_layer: Optional[str] = "grpc"):
        missing = [n for n in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if not os.environ.get(n)]
        if missing:
            raise RuntimeError(
                f"{', '.join(missing)} not found in environment: TorchrunClusterResolver reads the variables that "
                "torchrun sets (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Start the script with torchrun."
            )
        world_size = int(os.environ["WORLD_SIZE"])
        super().__init__(int(os.environ["RANK"]), world_size, _int_env("LOCAL_WORLD_SIZE") or world_size,
                         os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), rpc_layer)

    def _exchange(self, address: str) -> list[str]:
        from datetime import timedelta

        try:
            import torch.distributed as dist
        except ImportError:
            raise RuntimeError("The workers of a job on several nodes exchange their addresses through "
                               "torch.distributed's TCPStore, and PyTorch is not installed: install it "
                               "(`pip install torch`), or set TF_CONFIG on each node.") from None

        # torchrun's agent hosts the store; without it (our launcher, TORCHELASTIC_USE_AGENT_STORE
        # unset) rank 0 does, and keeps it while the process lives: the others may still be reading.
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        self._store = dist.TCPStore(self._master_addr, self._master_port, self._world_size,
                                    is_master=self._rank == 0 and not agent_store,
                                    timeout=timedelta(seconds=_EXCHANGE_TIMEOUT_S))
        prefix = f"keras_strategies/address/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
        self._store.set(prefix + str(self._rank), address)
        return [self._store.get(prefix + str(r)).decode() for r in range(self._world_size)]


class MPIClusterResolver(_RankEnvironmentResolver):
    """Reads the cluster from the variables `mpirun` sets (Open MPI, MPICH, Intel MPI).

    The rank and size come from `OMPI_COMM_WORLD_RANK` / `OMPI_COMM_WORLD_SIZE`
    (and `OMPI_COMM_WORLD_LOCAL_SIZE`) or `PMI_RANK` / `PMI_SIZE`;
    the chief's address from `MASTER_ADDR` and `MASTER_PORT`, which MPI does not
    set: export them to every process (`mpirun -x MASTER_ADDR=host0 -x MASTER_PORT=29500`).
    Across nodes the workers exchange their addresses with `mpi4py`.
    TensorFlow has no counterpart.

    Examples:
        ```python
        # MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 mpirun -np 2 -x MASTER_ADDR -x MASTER_PORT python train.py
        strategy = ks.MultiWorkerMirroredStrategy()  # 2 workers, found through MPI
        ```
    """

    _launcher = "mpirun"

    def __init__(self, rpc_layer: Optional[str] = "grpc"):
        rank = _int_env("OMPI_COMM_WORLD_RANK", "PMI_RANK")
        size = _int_env("OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
        if rank is None or size is None:
            raise RuntimeError("OMPI_COMM_WORLD_RANK / PMI_RANK not found in environment: MPIClusterResolver reads "
                               "the variables that mpirun sets. Start the script with mpirun.")
        if not os.environ.get("MASTER_ADDR") or not os.environ.get("MASTER_PORT"):
            raise RuntimeError(
                "mpirun started this process, but MASTER_ADDR and MASTER_PORT are not set: MPI gives no address "
                "for the chief. Export them to every process, e.g. "
                "`mpirun -x MASTER_ADDR=<first host> -x MASTER_PORT=29500 ...`."
            )
        local_size = _int_env("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS") or size
        super().__init__(rank, size, local_size, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), rpc_layer)

    def _exchange(self, address: str) -> list[str]:
        try:
            from mpi4py import MPI
        except ImportError:
            raise RuntimeError("mpirun started this job on several nodes: the workers exchange their addresses "
                               "with mpi4py, which is not installed (`pip install mpi4py`).") from None
        return list(MPI.COMM_WORLD.allgather(address))
