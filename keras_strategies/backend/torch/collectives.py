"""Cross-worker collectives on PyTorch: `torch.distributed` with the gloo backend.

Rank = the worker's index (chief 0); the chief's `TF_CONFIG` address hosts
the `TCPStore` rendezvous, which also carries our heartbeats.
"""

from __future__ import annotations

import datetime
from typing import Any, Optional

import torch
import torch.distributed as dist

from keras_strategies.multi_worker import packing

_state: dict = {}


def _split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]") or "127.0.0.1", int(port)


def initialize(cluster: Any, options: Any) -> None:
    """Joins the process group (blocks until every worker has joined, up to the timeout)."""
    backend = "nccl" if options.implementation.value == "NCCL" else "gloo"
    host, port = _split_address(cluster.chief_address)
    timeout = datetime.timedelta(seconds=options.effective_timeout)
    store = dist.TCPStore(
        host, port, cluster.num_workers, is_master=cluster.worker_index == 0, timeout=timeout,
        wait_for_workers=True,
    )
    if not dist.is_initialized():
        dist.init_process_group(backend, store=store, rank=cluster.worker_index,
                                world_size=cluster.num_workers, timeout=timeout)
    # A second client for heartbeats, so they never queue behind a blocked collective.
    _state["store"] = dist.TCPStore(host, port, cluster.num_workers, is_master=False,
                                    timeout=datetime.timedelta(seconds=5))
    _state["master_store"] = store


def tracing() -> bool:
    """Collectives always run eagerly on PyTorch."""
    return False


def _all_reduce_flat(flat: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    return flat


def all_reduce_sum(values: list) -> list:
    """Element-wise sums of `values` over all workers: one gloo all-reduce per dtype."""
    return packing.packed_sum(
        [torch.as_tensor(v) for v in values],
        lambda tensors: torch.cat([t.detach().reshape(-1).cpu() for t in tensors]),
        _all_reduce_flat,
        lambda piece, like: piece.reshape(like.shape).to(like.device),
    )


def kv_set(key: str, value: str) -> None:
    _state["store"].set(key, value)


def kv_try_get(key: str) -> Optional[str]:
    store = _state["store"]
    if not store.check([key]):
        return None
    return store.get(key).decode()


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    _state.clear()
