"""The Keras functions this engine replaces: `TorchModuleWrapper.call` in replica steps, and
the channels-last layout conversion of convolutions in vectorised replica programs.

Replicas run the model statelessly (`stateless_call`), which a wrapped
`torch.nn.Module` ignores: it would compute with, and never train, its own
parameters. Keras' convolutions ask for a channels-last memory layout
(`Tensor.contiguous(memory_format=...)`), which `torch.func.vmap` does not
support (torch 2.13); the layout changes speed, never values, so inside a
vectorised program the tensor stays as it is. Both are declared in the patch
registry (`keras_strategies.backend.common.patches`).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from keras.src.backend.common.stateless_scope import get_stateless_scope

from keras_strategies.backend.common import patches
from keras_strategies.backend.torch import collectives, module_buffers, vectorized

_MODULE_CALL = patches.declare("keras.src.utils.torch_utils.TorchModuleWrapper.call",
                               "a wrapped torch.nn.Module runs on the replica's values of its parameters and buffers")
_CHANNELS_LAST = patches.declare(
    "keras.src.backend.torch.nn._maybe_convert_to_channels_last",
    "no layout conversion inside a vectorised replica program (vmap cannot make one; the layout changes speed, "
    "not values)", optional=True,  # Keras releases that convert
    moved=("keras.src.backend.torch.ops.nn._maybe_convert_to_channels_last",))
# Keras 3.16's own data parallelism on PyTorch: when `torch.distributed` is initialised (as a
# ks multi-worker strategy initialises it) Keras wraps the model in DDP and sums every metric
# variable over the processes. A model of a ks strategy already exchanges its gradients and holds
# global metric state, so for it both are Keras' single-process behaviour; so are they for any
# model while the process group is the one a strategy started (the user asked for no other).
_TORCH_TRAINER = "keras.src.backend.torch.trainer.Trainer"
_INITIALIZE_DDP = patches.declare(f"{_TORCH_TRAINER}._initialize_ddp", "a model of a strategy (or any model in the "
                                  "process group a strategy started) is not wrapped in Keras' DDP: the strategy "
                                  "exchanges its gradients (Keras 3.16)", optional=True)
_METRICS_RESULT = patches.declare(f"{_TORCH_TRAINER}.get_metrics_result", "a model of a strategy holds global "
                                  "metric state: Keras' sum over the processes would count it once per worker; in "
                                  "the process group a strategy started, no model's metrics are summed (Keras 3.16)", optional=True)
_POOLING_LAYOUT = patches.declare(
    "keras.src.backend.torch.ops.nn._transpose_spatial_inputs",
    "pooling inputs keep the default layout inside a vectorised replica program (vmap cannot clone into "
    "channels-last; Keras 3.16 asks for it)", optional=True)


def _wrap_channels_last(original: Callable) -> Callable:
    @functools.wraps(original)
    def convert(tensor):
        return tensor if vectorized.active() else original(tensor)

    return convert


def _single_process_for_strategy_models(strategy_context: Any, keras_single_process: Callable) -> Callable:
    """`keras_single_process` for a model created under a strategy, and for every model where the
    process group is the one a strategy started (Keras' own data parallelism is for a group the
    user started: without the package there would be none); Keras' method otherwise."""

    def wrap(original: Callable) -> Callable:
        @functools.wraps(original)
        def method(self, *args, **kwargs):
            if strategy_context.strategy_of(self) is None and not collectives.started_process_group():
                return original(self, *args, **kwargs)
            return keras_single_process(self, *args, **kwargs)

        return method

    return wrap


def _no_ddp(model: Any) -> None:
    return None


def _base_metrics_result(model: Any) -> dict:
    """The method of the class Keras' PyTorch trainer derives from: the metrics without a sum over processes."""
    from keras.src.backend.torch import trainer  # noqa: PLC0415 - the releases with this hook

    return super(trainer.Trainer, model).get_metrics_result()


def _wrap_pooling_layout(original: Callable) -> Callable:
    @functools.wraps(original)
    def transpose(inputs, **kwargs):
        if vectorized.active():
            kwargs.pop("channels_last_memory_format", None)
        return original(inputs, **kwargs)

    return transpose


def _wrap_torch_module_call(original: Callable, strategy_context: Any) -> Callable:
    @functools.wraps(original)
    def call(self, *args, training=None, **kwargs):
        scope = get_stateless_scope()
        if scope is None or not strategy_context.has_strategy():
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
        replica_context = strategy_context.get_replica_context()
        if training is not False and replica_context is not None and replica_context.num_replicas_in_sync > 1:
            # Its buffers too, each replica its own copies (combined when the replicas are done).
            rows = args[0].shape[0] if args and isinstance(args[0], torch.Tensor) and args[0].ndim else None
            values.update(module_buffers.replica_copies(self, replica_context, rows))
        return torch.func.functional_call(self.module, values, args, kwargs, strict=False)

    return call


def install(strategy_context: Any) -> None:
    """Installs the replacements (idempotent).

    `strategy_context` answers `has_strategy()` and `get_replica_context()`
    (`keras_strategies.distribute.context`); it is passed in so that the engine
    depends on nothing outside `keras_strategies.backend`.
    """
    _MODULE_CALL.apply(lambda original: _wrap_torch_module_call(original, strategy_context))
    _CHANNELS_LAST.apply(_wrap_channels_last)
    _POOLING_LAYOUT.apply(_wrap_pooling_layout)
    _INITIALIZE_DDP.apply(_single_process_for_strategy_models(strategy_context, _no_ddp))
    _METRICS_RESULT.apply(_single_process_for_strategy_models(strategy_context, _base_metrics_result))
