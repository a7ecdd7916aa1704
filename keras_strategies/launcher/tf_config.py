"""Cluster layout for local multi-worker jobs: free ports and `TF_CONFIG`.

Every worker learns the cluster and its own role from the `TF_CONFIG`
environment variable, the format `tf.distribute` multi-worker strategies read.
Processes are numbered chief (if any), workers, then parameter servers (`ps`).
"""

from __future__ import annotations

import socket
from typing import Sequence, Union

LOCALHOST = "127.0.0.1"

Address = Union[str, int]


def free_ports(n: int, host: str = LOCALHOST) -> list[int]:
    """`n` distinct TCP ports that are free on `host` right now.

    All sockets stay bound until every port is picked, so the ports are
    unique; they are closed before returning so workers can bind them (another
    process could still grab one in between; that race is inherent).

    Examples:
        >>> from keras_strategies.launch import free_ports
        >>> ports = free_ports(2)
        >>> len(set(ports))
        2
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"The number of ports must be an int >= 0, got {n!r}.")
    sockets = []
    try:
        for _ in range(n):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _address(address: Address) -> str:
    return f"{LOCALHOST}:{address}" if isinstance(address, int) else str(address)


def _ps_count(ps: object, num_addresses: int) -> int:
    if isinstance(ps, bool) or not isinstance(ps, int) or ps < 0:
        raise ValueError(f"The number of ps tasks must be an int >= 0, got {ps!r}.")
    if num_addresses - ps < 1:
        raise ValueError(
            f"A cluster with {ps} ps task(s) needs at least one chief or worker address besides them, "
            f"got {num_addresses} address(es) in all."
        )
    return ps


def cluster_spec(addresses: Sequence[Address], chief: bool = False, ps: int = 0) -> dict[str, list[str]]:
    """`{"worker": [...]}`, or `{"chief": [first], "worker": [rest]}` with `chief=True`.

    With `ps=N` the last N addresses form a `"ps"` job (parameter servers).
    Integers in `addresses` are ports on 127.0.0.1.
    """
    addresses = [_address(a) for a in addresses]
    if not addresses:
        raise ValueError("A cluster needs at least one address.")
    ps = _ps_count(ps, len(addresses))
    trainers, servers = addresses[: len(addresses) - ps], addresses[len(addresses) - ps :]
    spec = {"chief": trainers[:1], "worker": trainers[1:]} if chief else {"worker": trainers}
    if ps:
        spec["ps"] = servers
    return spec


def task_for(index: int, num_tasks: int, chief: bool = False, ps: int = 0) -> dict[str, object]:
    """The `TF_CONFIG` task of process `index` (0-based over all processes: chief, workers, then ps)."""
    if not 0 <= index < num_tasks:
        raise ValueError(f"Task index {index!r} is out of range for {num_tasks} process(es).")
    trainers = num_tasks - _ps_count(ps, num_tasks)
    if index >= trainers:
        return {"type": "ps", "index": index - trainers}
    if chief:
        return {"type": "chief", "index": 0} if index == 0 else {"type": "worker", "index": index - 1}
    return {"type": "worker", "index": index}


def task_name(task: dict[str, object]) -> str:
    """`"worker 1"`, `"chief 0"`, `"ps 0"`: how the launcher names a task in output and messages."""
    return f"{task['type']} {task['index']}"


def tf_config_for(
    index: int, addresses: Sequence[Address], chief: bool = False, ps: int = 0
) -> dict[str, object]:
    """The `TF_CONFIG` (as a dict; `json.dumps` it) for process `index` of the cluster.

    Integers in `addresses` are ports on 127.0.0.1; with `chief=True` process 0
    is the chief; with `ps=N` the last N processes are parameter servers (a
    `"ps"` job). For starting workers by other means than the launcher.

    Examples:
        >>> from keras_strategies.launch import tf_config_for
        >>> tf_config_for(1, [5000, 5001])
        {'cluster': {'worker': ['127.0.0.1:5000', '127.0.0.1:5001']}, 'task': {'type': 'worker', 'index': 1}}
        >>> tf_config_for(0, ["host0:2222", "host1:2222"], chief=True)["task"]
        {'type': 'chief', 'index': 0}
        >>> config = tf_config_for(2, [5000, 5001, 5002], chief=True, ps=1)
        >>> config["cluster"]
        {'chief': ['127.0.0.1:5000'], 'worker': ['127.0.0.1:5001'], 'ps': ['127.0.0.1:5002']}
        >>> config["task"]
        {'type': 'ps', 'index': 0}
    """
    return {
        "cluster": cluster_spec(addresses, chief=chief, ps=ps),
        "task": task_for(index, len(addresses), chief=chief, ps=ps),
    }
