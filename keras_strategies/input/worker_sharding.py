"""How the input of a multi-worker `fit` / `evaluate` / `predict` is shared between workers.

Default (every input type): every worker reads the same input in the same
order; each global batch is split across all replicas of all workers and each
worker takes its replicas' consecutive shards. The shuffles of Keras' `fit`
(NumPy arrays with NumPy's global RNG, `PyDataset` batch order with Python's
`random`, a torch `DataLoader` with torch's default generator) draw from the
chief's RNG states, which every worker takes over (`host_rng_states`), so they
agree and draw what one process seeded like the chief draws; other shuffles,
such as `tf.data`'s, need a seed.

Opt-out, for users who shard themselves: a `tf.data.Dataset` whose
`options().experimental_distribute.auto_shard_policy` is
`tf.data.experimental.AutoShardPolicy.OFF` is taken as this worker's own
share. Each worker's batch is then its part of the global batch (the global
batch is the concatenation of the workers' batches, whose sizes may differ),
and workers whose input runs out first take part with empty batches until
every worker's input is exhausted, so no worker waits forever.
"""

from __future__ import annotations

import contextlib
import pickle
import random
import sys
import threading
from typing import Any, Iterator

import numpy as np
from keras.src import tree

_state = threading.local()


def host_rng_states() -> bytes:
    """The states of the RNGs Keras' input adapters shuffle with, as bytes to send to other workers.

    NumPy's global RNG shuffles arrays, Python's `random` a `PyDataset`'s batch
    order, torch's default CPU generator a `DataLoader`'s sampler (only if
    torch is loaded; CUDA generators are left alone).
    """
    torch = sys.modules.get("torch")
    torch_state = torch.default_generator.get_state().numpy().tobytes() if torch is not None else None
    return pickle.dumps((np.random.get_state(), random.getstate(), torch_state))


def set_host_rng_states(states: bytes) -> None:
    """Takes over the states `host_rng_states` gave (on another worker): the same draws from now on."""
    numpy_state, python_state, torch_state = pickle.loads(states)
    np.random.set_state(numpy_state)
    random.setstate(python_state)
    torch = sys.modules.get("torch")
    if torch is not None and torch_state is not None:
        torch.default_generator.set_state(torch.from_numpy(np.frombuffer(torch_state, np.uint8).copy()))


def is_worker_sharded(data: Any) -> bool:
    """True for a `tf.data.Dataset` with auto-sharding turned off (the user shards per worker)."""
    options = getattr(data, "options", None)
    if not callable(options) or not hasattr(data, "element_spec"):
        return False
    try:
        import tensorflow as tf

        policy = options().experimental_distribute.auto_shard_policy
        return policy == tf.data.experimental.AutoShardPolicy.OFF
    except (AttributeError, ImportError):
        return False


@contextlib.contextmanager
def per_worker_input(enabled: bool) -> Iterator[None]:
    """Marks the steps run inside as reading per-worker batches."""
    previous = getattr(_state, "enabled", False)
    _state.enabled = enabled
    try:
        yield
    finally:
        _state.enabled = previous


def active() -> bool:
    return getattr(_state, "enabled", False)


def empty_like(batch: Any) -> Any:
    """`batch` with zero rows (same structure, trailing shapes and dtypes)."""
    return tree.map_structure(
        lambda leaf: None if leaf is None else np.zeros((0,) + np.shape(leaf)[1:], np.asarray(leaf).dtype), batch
    )


def agreed_steps(epoch_iterator: Any, any_worker_has: Any, steps_per_execution: int) -> Iterator[tuple]:
    """Like iterating `epoch_iterator`, but every worker takes the same number of steps.

    Each step the workers agree whether any of them still has a batch; a
    worker without one runs the step on an empty batch.
    """
    source = iter(epoch_iterator)
    pending: list = []
    last = None
    step = 0

    def next_batch():
        nonlocal pending
        if not pending:
            try:
                _, _, group = next(source)
            except StopIteration:
                return None
            pending = list(group)
        return pending.pop(0)

    while True:
        group = []
        for _ in range(steps_per_execution):
            batch = next_batch()
            if batch is not None:
                last = batch
            if not any_worker_has(batch is not None):
                break
            if batch is None and last is None:
                raise RuntimeError(
                    "This worker's input is empty while other workers still have batches; with "
                    "per-worker input (AutoShardPolicy.OFF) every worker needs at least one batch."
                )
            group.append(batch if batch is not None else empty_like(last))
        if not group:
            return
        yield step, step + len(group) - 1, group
        step += len(group)
