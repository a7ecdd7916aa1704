"""The buffers of wrapped `torch.nn.Module`s (a `BatchNorm1d`'s running statistics) under a strategy.

Keras tracks a `TorchModuleWrapper`'s parameters as variables but not its
buffers, which the module updates in place in its forward pass. Replica
threads that shared them would each move them in turn, and workers would each
follow their own shards and drift apart. So, as TensorFlow does for
BatchNormalization's statistics (`ON_READ`, `MEAN`), each training replica
runs the module on its own copies of the buffers, and when the replicas are
done the float buffers become the mean of the copies of the replicas that had
rows, over every worker; integer ones (`num_batches_tracked`), which every
replica moves alike, take the first replica's.
"""

from __future__ import annotations

import threading
from typing import Any, Optional

import torch
from keras import ops

from keras_strategies.backend.torch import vectorized

_lock = threading.Lock()
# id(wrapper) -> (wrapper, strategy, {replica_id: (copies by buffer name, weight)}), in first-use order.
_pending: dict = {}


def replica_copies(wrapper: Any, replica_context: Any, rows: Optional[int]) -> dict:
    """The calling replica's copies of `wrapper.module`'s buffers, for `functional_call`.

    The first call of a run (per replica) copies the primary buffers; later
    calls in the same run (a module used twice) continue from that replica's
    copies. `rows`: the rows of the replica's input when known, for its weight.
    """
    vectorized.only_in_threads("a wrapped torch module's buffers, kept per replica id,")
    replica_id = replica_context.replica_id_in_sync_group
    with _lock:
        _, _, replicas = _pending.setdefault(id(wrapper), (wrapper, replica_context.strategy, {}))
        if replica_id not in replicas:
            copies = {name: buffer.detach().clone() for name, buffer in wrapper.module.named_buffers()}
            replicas[replica_id] = (copies, _weight(replica_context, rows))
        return replicas[replica_id][0]


def _weight(replica_context: Any, rows: Optional[int]) -> float:
    """1 for a replica with real rows, 0 for one that runs padding (or nothing) only."""
    mask = replica_context._row_mask
    if mask is not None:
        return float(torch.as_tensor(mask).sum() > 0)
    return 0.0 if rows == 0 else 1.0


def discard() -> None:
    """Forgets the copies of a run that failed."""
    with _lock:
        _pending.clear()


def combine() -> None:
    """Writes the replicas' copies back into the modules' buffers (after every local replica finished).

    Every worker writes the same buffers in the same order (the same model
    trains everywhere), so their sums cross workers in one all-reduce.
    """
    with _lock:
        pending = list(_pending.values())
        _pending.clear()
    if not pending:
        return
    strategy = pending[0][1]
    floats, weights, ints = [], [], []
    for wrapper, _, replicas in pending:
        ordered = [replicas[i] for i in sorted(replicas)]
        weight = sum(w for _, w in ordered)
        weights.append(weight)
        for name, buffer in wrapper.module.named_buffers():
            if buffer.is_floating_point():
                parts = [copies[name] * w for copies, w in ordered if w > 0]  # an empty shard's may be NaN
                floats.append((buffer, sum(parts[1:], parts[0]) if parts else torch.zeros_like(buffer), len(weights) - 1))
            else:
                ints.append((buffer, ordered[0][0][name]))
    extended = strategy.extended
    sums = [total.cpu().numpy() for _, total, _ in floats] + [torch.tensor(weights, dtype=torch.float32).numpy()]
    if extended._num_workers > 1:
        sums = extended._cross_worker_sum(sums, "all-reduce of torch module buffers")
    *totals, counts = [torch.as_tensor(ops.convert_to_numpy(s)) for s in sums]
    with torch.no_grad():
        for (buffer, _, index), total in zip(floats, totals):
            if counts[index] > 0:  # no replica had rows: the buffer keeps its value
                buffer.copy_((total / counts[index]).to(buffer.dtype))
        for buffer, value in ints:
            buffer.copy_(value)
