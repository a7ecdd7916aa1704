"""How a Keras model's own step is called here: statefully, `step(data) -> logs`."""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterable, Optional

import torch
from keras.src.backend.common.stateless_scope import get_stateless_scope
from keras.src.utils.torch_utils import TorchModuleWrapper

from keras_strategies import context
from keras_strategies.backend.torch import module_buffers

# The step writes the model's variables itself (see `keras_strategies.replica_variables`).
STATEFUL_STEPS = True
# Keras' own PyTorch trainer builds a model from the first batch before `fit`; one it cannot build fails.
DEFERS_BUILD = False
# Each `DataLoader` iterator draws its base seed from torch's global generator, even unshuffled:
# Keras' own loops (validation, `evaluate`, `predict`) all move the order of later shuffles.
PIPELINE_DRAWS_RNG = True


def state_parts(model: Any, kind: str) -> list:
    """Stateful steps update the model's variables themselves: no state to combine."""
    return []


def call_step(model: Any, kind: str, data: Any, device: str) -> tuple[Any, Any]:
    """Calls `model.<kind>_step(data)` (on `device`, set by the replica); returns `(logs or outputs, None)`."""
    return getattr(model, f"{kind}_step")(data), None


def epoch_batches(data_adapter: Any) -> Callable[[], Iterable]:
    """The training batches Keras' own torch trainer reads: its `DataLoader`.

    So that `fit(shuffle=True)` draws the same order from torch's seed as
    training without a strategy.
    """
    return data_adapter.get_torch_dataloader


def build_batch(data_adapter: Any, batches: Optional[Callable[[], Iterable]]) -> Optional[Any]:
    """None: Keras' own PyTorch trainer reads the first batch to build the model before `fit`, and so do we."""
    return None


def pipeline_order_seed() -> Optional[int]:
    """What fixes the order in which Keras' own pipeline shuffles: host RNGs, the same key on every worker.

    Every worker takes over the chief's RNG states before reading
    (`_use_chief_input_rngs`), so all read the chief's order.
    """
    return 0


def _wrap_torch_module_call(original: Callable) -> Callable:
    @functools.wraps(original)
    def call(self, *args, training=None, **kwargs):
        scope = get_stateless_scope()
        if scope is None or not context.has_strategy():
            return original(self, *args, training=training, **kwargs)
        # The module's own forward reads its `nn.Parameter`s, not the replica's values of the
        # variables that wrap them: run it on those values, so that gradients reach them.
        by_parameter = {id(variable._value): variable for variable in self.variables}  # `.value` reads the scope
        values = {}
        for name, parameter in self.module.named_parameters():
            variable = by_parameter.get(id(parameter))
            value = None if variable is None else scope.get_current_value(variable)
            if value is not None:
                values[name] = value
        self.train(training is not False)
        replica_context = context.get_replica_context()
        if training is not False and replica_context is not None and replica_context.num_replicas_in_sync > 1:
            # Its buffers too, each replica its own copies (combined when the replicas are done).
            rows = args[0].shape[0] if args and isinstance(args[0], torch.Tensor) and args[0].ndim else None
            values.update(module_buffers.replica_copies(self, replica_context, rows))
        return torch.func.functional_call(self.module, values, args, kwargs, strict=False)

    call._ks_original = original
    return call


def install() -> None:
    """Keras hooks this engine needs (idempotent): `TorchModuleWrapper` in replica steps.

    Replicas run the model statelessly (`stateless_call`), which a wrapped
    `torch.nn.Module` ignores: it would compute with, and never train, its own
    parameters.
    """
    if hasattr(TorchModuleWrapper.call, "_ks_original"):
        return
    TorchModuleWrapper.call = _wrap_torch_module_call(TorchModuleWrapper.call)
