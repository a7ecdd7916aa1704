"""Cross-worker collectives on PyTorch: `torch.distributed` with the gloo backend.

Rank = the worker's index (chief 0); the chief's `TF_CONFIG` address hosts
the `TCPStore` rendezvous, which also carries our heartbeats.
"""

from __future__ import annotations

import datetime
import math
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist

from keras_strategies.backend.common import loopback, packing, timeouts

_state: dict = {}


def _split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]") or "127.0.0.1", int(port)


_started: dict = {}


def initialize(cluster: Any, options: Any) -> None:
    """Joins the process group (blocks until every worker has joined, up to the timeout)."""
    backend = "nccl" if options.implementation.value == "NCCL" else "gloo"
    host, port = _split_address(cluster.chief_address)
    timeout = datetime.timedelta(seconds=options.effective_timeout)
    listen_fd = None
    if cluster.worker_index == 0 and loopback.all_loopback(cluster.addresses):
        listen_fd = loopback.listening_socket(host, port)  # not on every interface, as by default
    store = dist.TCPStore(
        host, port, cluster.num_workers, is_master=cluster.worker_index == 0,
        timeout=timeout + datetime.timedelta(seconds=timeouts.ENGINE_MARGIN_SECONDS),
        wait_for_workers=True, master_listen_fd=listen_fd,
    )
    store.set_timeout(timeout)
    if not dist.is_initialized():
        dist.init_process_group(backend, store=store, rank=cluster.worker_index,
                                world_size=cluster.num_workers, timeout=timeout)
        _started["group"] = True
    # A second gloo group: large tensors are spread over both, whose connections and I/O
    # threads then carry data in parallel (measured on loopback: 16 MB in 10 tensors went
    # from ~0.9 to ~1.05 of one pre-flattened all-reduce's rate).
    _state["groups"] = [None, dist.new_group(list(range(cluster.num_workers)), backend="gloo", timeout=timeout)]
    _state["packs"] = _PackBuffers()
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


class _PackBuffers:
    """Pack buffers reused across calls, each only while no earlier result still uses it.

    A pack copied into a fresh tensor on every call made the all-reduce
    slower than one copied into a buffer already used (measured with gloo on
    loopback, calls alternating: 1 MB at 0.77-0.79 of the raw rate from a
    fresh pack, 0.96-1.0 from a reused one). The results are views of the
    pack, so a buffer is taken again only when nothing else refers to its
    memory: results stay valid for as long as the caller holds them.
    """

    PER_SIZE = 4  # buffers kept per (dtype, size); more live results get fresh ones

    def __init__(self) -> None:
        self._kept: dict = {}  # (dtype, numel) -> [(buffer, its storage use count when unused)]

    def take(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        kept = self._kept.setdefault((dtype, numel), [])
        for buffer, unused in kept:
            if _storage_uses(buffer) == unused:
                return buffer
        buffer = torch.empty(numel, dtype=dtype)
        uses = _storage_uses(buffer)
        if uses is not None and len(kept) < self.PER_SIZE:
            kept.append((buffer, uses))
        return buffer


def _storage_uses(tensor: torch.Tensor) -> Optional[int]:
    """How many tensors share `tensor`'s memory (None where torch does not tell: never reused)."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    return None if use_count is None else use_count(tensor.untyped_storage()._cdata)


def _spread(tensors: list) -> list:
    """`(tensor, group)` pairs: each tensor goes to the group with the fewest bytes so far (the
    same choice on every worker, as the plan is the same)."""
    groups = _state["groups"]
    loads = [0] * len(groups)
    pairs = []
    for tensor in tensors:
        least = min(range(len(groups)), key=loads.__getitem__)
        loads[least] += tensor.numel() * tensor.element_size()
        pairs.append((tensor, groups[least]))
    return pairs


def _as_torch(value: Any) -> torch.Tensor:
    """`value` as a tensor; NumPy's bfloat16 (`ml_dtypes`, e.g. predictions under
    `mixed_bfloat16`), which `torch.as_tensor` refuses, by its bits."""
    if isinstance(value, np.ndarray) and value.dtype.name == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(value).view(np.uint16)).view(torch.bfloat16)
    return torch.as_tensor(value)


def all_reduce_sum(values: list, donated: Any = False) -> list:
    """Element-wise sums of `values` over all workers (same shapes and dtypes on every worker).

    Small tensors go in one packed gloo all-reduce per dtype, in a reused
    buffer. With `donated=True` the caller gives up `values`: large ones are
    then summed in place, with no copy (the train step donates its
    gradients). `donated` is a bool for all values or one bool per value.
    The packs are sent first: while the large tensors stream, their short
    round trips are already done. The collectives are spread over two gloo
    groups, which run in parallel.
    """
    return start_all_reduce_sum(values, donated).wait()


class _PendingSum:
    """An `all_reduce_sum` under way in gloo's threads; `wait()` gives its sums."""

    def __init__(self, originals: list, tensors: list, alone: list, groups: list, packs: list, works: list):
        self._originals, self._tensors, self._alone = originals, tensors, alone
        self._groups, self._packs, self._works = groups, packs, works

    def wait(self) -> list:
        for work in self._works:
            work.wait()
        tensors = self._tensors
        outputs: list = [None] * len(tensors)
        for group, flat in zip(self._groups, self._packs):
            for i, piece in zip(group, flat.split([tensors[i].numel() for i in group])):
                outputs[i] = piece.view(tensors[i].shape)
        for i in self._alone:
            outputs[i] = tensors[i]
        return [out.to(original.device) for out, original in zip(outputs, self._originals)]


def start_all_reduce_sum(values: list, donated: Any = False) -> _PendingSum:
    """Starts `all_reduce_sum(values, donated)` and returns at once: gloo sends while the caller
    goes on (a backward pass sends its first gradients while it computes the others)."""
    originals = [_as_torch(v) for v in values]
    tensors = [t.detach().cpu() for t in originals]
    alone, groups = packing.plan([t.dtype for t in tensors], [t.numel() * t.element_size() for t in tensors],
                                 _in_place_candidates(tensors, packing.per_value(donated, len(tensors))))
    packs = []
    for group in groups:
        flat = _state["packs"].take(tensors[group[0]].dtype, sum(tensors[i].numel() for i in group))
        torch.cat([tensors[i].reshape(-1) for i in group], out=flat)
        packs.append(flat.view(-1))  # a view holds the buffer: no call takes it while this one is under way
    works = [dist.all_reduce(t, op=dist.ReduceOp.SUM, async_op=True, group=group)
             for t, group in _spread(packs + [tensors[i] for i in alone])]
    return _PendingSum(originals, tensors, alone, groups, packs, works)


def all_gather(values: list) -> list:
    """Each of `values` from every worker, stacked in worker order: `(num_workers, *shape)`.

    One gloo all-gather per dtype, of the values packed flat (same shapes and
    dtypes on every worker).
    """
    originals = [_as_torch(v) for v in values]
    tensors = [t.detach().cpu().reshape(-1) for t in originals]
    workers = dist.get_world_size()
    outputs: list = [None] * len(tensors)
    for group in packing.group_by_dtype(tensors):
        flat = torch.cat([tensors[i] for i in group]) if len(group) > 1 else tensors[group[0]].contiguous()
        parts = [torch.empty_like(flat) for _ in range(workers)]
        dist.all_gather(parts, flat)
        stacked = torch.stack(parts)
        offset = 0
        for i in group:
            size = tensors[i].numel()
            outputs[i] = stacked[:, offset:offset + size].reshape((workers, *originals[i].shape))
            offset += size
    return [out.to(original.device) for out, original in zip(outputs, originals)]


def reduce_scatter_sum(values: list) -> list:
    """This worker's row of each of `values` (`(num_workers, *shape)`), summed over the workers.

    One gloo reduce-scatter per dtype, of the values packed `(num_workers, -1)`
    side by side (the same shapes and dtypes on every worker).
    """
    originals = [_as_torch(v) for v in values]
    workers = dist.get_world_size()
    sizes = [math.prod(tuple(t.shape[1:])) for t in originals]
    tensors = [t.detach().cpu().reshape(workers, size) for t, size in zip(originals, sizes)]
    outputs: list = [None] * len(tensors)
    for group in packing.group_by_dtype(tensors):
        pack = torch.cat([tensors[i] for i in group], dim=1).contiguous()
        mine = torch.zeros(pack.shape[1], dtype=pack.dtype)
        if pack.shape[1]:  # nothing sent for empty values
            dist.reduce_scatter(mine, list(pack.unbind(0)))
        offset = 0
        for i in group:
            outputs[i] = mine[offset:offset + sizes[i]].reshape(tuple(originals[i].shape[1:]))
            offset += sizes[i]
    return [out.to(original.device) for out, original in zip(outputs, originals)]


def kv_set(key: str, value: str) -> None:
    _state["store"].set(key, value)


def started_process_group() -> bool:
    """Whether this package started the process group (not the user, before a strategy joined it)."""
    return _started.get("group", False) and dist.is_initialized()


def kv_try_get(key: str) -> Optional[str]:
    store = _state["store"]
    if not store.check([key]):
        return None
    return store.get(key).decode()


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    _state.clear()
    _started.clear()
