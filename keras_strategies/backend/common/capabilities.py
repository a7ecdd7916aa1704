"""`Capabilities`: how an engine differs where the backend-neutral code must know.

Each engine package gives one (`CAPABILITIES` in `backend/<name>/__init__.py`);
`keras_strategies/backend/contract.py` says which optional names each one asks for.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """How an engine differs where the backend-neutral code must know (each engine's `CAPABILITIES`)."""

    stateful_steps: bool
    """Keras' steps write the model's variables themselves (TensorFlow, PyTorch); where not (JAX)
    a step returns new state, which `trainer/custom_step.py` combines across replicas."""
    defers_build: bool
    """Keras builds a model when its step is first traced, not from the first batch before `fit`."""
    pipeline_draws_rng: bool
    """Reading an unshuffled input pipeline draws from the global generator (PyTorch's `DataLoader`)."""
    equal_shards: bool
    """Compiled replica programs need one shard shape: uneven shards are padded and masked."""
    native_sync_batch_norm: bool
    """Keras synchronises `BatchNormalization(synchronized=True)` itself (TensorFlow)."""
    overlaps_backward: bool
    """`gradients.value_and_grad` reports each gradient while the backward pass still runs."""
    traces_custom_steps: bool
    """`ks.function` traces a custom step over its variables' state (`InProgramCustomSteps`)."""
    exchanges_in_program: bool
    """A multi-worker step's cross-worker sums are ops of its compiled program (`InProgramExchange`)."""
    programs_span_devices: bool = False
    """One compiled program may place its operations on several devices (TensorFlow's `tf.function`
    with device scopes), so an update that touches every device can be one program."""
    immutable_values: bool = False
    """A variable's value is an immutable array (JAX): while a variable holds the very array an
    update assigned it, nothing has written it since, so what was cut from it still holds."""
    untraceable_errors: tuple = ()
    """What tracing a model's own step raises where the engine cannot compile it (then it runs eagerly)."""
