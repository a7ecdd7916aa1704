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


def _in_place_candidates(tensors: list, donated: list) -> list:
    """Which tensors gloo may sum in place: donated, dense, not sharing memory with another value."""
    storages: dict = {}
    for t in tensors:
        key = t.untyped_storage().data_ptr()
        storages[key] = storages.get(key, 0) + 1
    return [
        given and t.device.type == "cpu" and t.is_floating_point() and t.is_contiguous() and not t.requires_grad
        and storages[t.untyped_storage().data_ptr()] == 1
        for t, given in zip(tensors, donated)
    ]


def all_reduce_sum(values: list, donated: Any = False) -> list:
    """Element-wise sums of `values` over all workers (same shapes and dtypes on every worker).

    Small tensors go in one packed gloo all-reduce per dtype. With
    `donated=True` the caller gives up `values`: large ones are then summed in
    place, with no copy (the train step donates its gradients). `donated` is
    a bool for all values or one bool per value.
    """
    originals = [torch.as_tensor(v) for v in values]
    tensors = [t.detach().cpu() for t in originals]
    alone, groups = packing.plan([t.dtype for t in tensors], [t.numel() * t.element_size() for t in tensors],
                                 _in_place_candidates(tensors, packing.per_value(donated, len(tensors))))
    pending = [dist.all_reduce(tensors[i], op=dist.ReduceOp.SUM, async_op=True) for i in alone]
    outputs: list = [None] * len(tensors)
    for group in groups:
        flat = torch.cat([tensors[i].reshape(-1) for i in group])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        for i, piece in zip(group, flat.split([tensors[i].numel() for i in group])):
            outputs[i] = piece.view(tensors[i].shape)
    for work in pending:
        work.wait()
    for i in alone:
        outputs[i] = tensors[i]
    return [out.to(original.device) for out, original in zip(outputs, originals)]


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
