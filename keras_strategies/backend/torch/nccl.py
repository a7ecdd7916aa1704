"""NCCL between this process's GPUs on PyTorch: `torch.cuda.nccl`, one call for all of them.

`ks.NcclAllReduce` hands each pack here, and the replica threads' in-step
all-reduce does when every replica has its own GPU (`replicas.py`).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.cuda.nccl


def one_per_gpu(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether `tensors` sit one per GPU (dense): what one NCCL all-reduce between them needs."""
    devices = [t.device for t in tensors]
    return (
        len(tensors) > 1 and all(d.type == "cuda" for d in devices) and len(set(devices)) == len(devices)
        and not any(t.is_sparse for t in tensors) and len({(t.shape, t.dtype) for t in tensors}) == 1
    )


def all_reduce_sum(per_value: Sequence[Sequence[torch.Tensor]], devices: Sequence[str]) -> list:
    """`per_value[k][i]` is value k's part on GPU `devices[i]`; returns value k's sum on each of them.

    The inputs stay as they are: NCCL writes new tensors.
    """
    results = []
    for components in per_value:
        inputs = [torch.as_tensor(c).contiguous() for c in components]
        outputs = [torch.empty_like(t) for t in inputs]
        torch.cuda.nccl.all_reduce(inputs, outputs, op=torch.cuda.nccl.SUM)
        results.append(outputs)
    return results
