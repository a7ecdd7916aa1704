"""Servers of a cluster that lives on one machine listen on the loopback interface only.

The engines' servers (TensorFlow's gRPC server and coordination service, the
`jax.distributed` coordinator, torch's `TCPStore`) listen on every interface by
default. When every task of the cluster is on a loopback address, nothing
outside the machine has any business with them, so they listen there alone.
"""

from __future__ import annotations

import ipaddress
import socket
from typing import Iterable


def host_of(address: str) -> str:
    """`"127.0.0.1:2222"` -> `"127.0.0.1"`, `"[::1]:2222"` -> `"::1"`."""
    host = address.rpartition(":")[0] if ":" in address else address
    return host.strip("[]")


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or `localhost`) names this machine's loopback interface."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def all_loopback(addresses: Iterable[str]) -> bool:
    """Whether every `host:port` of a cluster is on the loopback interface."""
    return all(is_loopback(host_of(address)) for address in addresses)


def listening_socket(host: str, port: int) -> int:
    """A TCP socket listening on `host:port` alone; returns its file descriptor (the caller owns it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host if host != "localhost" else "127.0.0.1", port))
    sock.listen(128)
    return sock.detach()
