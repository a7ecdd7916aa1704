"""Hooks that connect Keras objects to the strategy they were built under.

Installed once at import. Each hook first checks whether a strategy is
involved and otherwise calls Keras' own code unchanged, so models built
outside every strategy scope behave exactly as without this package.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator


from keras_strategies.distribute import context
from keras_strategies.backend.common import patches, replica_variables

# Model methods whose work runs under the model's strategy.
KERAS_METHODS = ("fit", "evaluate", "predict", "train_on_batch", "test_on_batch", "predict_on_batch")

_STRATEGY_ATTR = "_ks_strategy"  # read by `context.strategy_of`
strategy_of = context.strategy_of


def _record_current_strategy(obj: Any) -> None:
    if context.has_strategy():
        strategy = context.get_strategy()
        object.__setattr__(obj, _STRATEGY_ATTR, strategy)
        strategy.extended._track(obj)


def _wrap_init(original: Callable) -> Callable:
    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        _record_current_strategy(self)

    return __init__


@contextlib.contextmanager
def _as_in_scope(strategy: Any) -> Iterator[None]:
    """Where state first needed inside `strategy.run` is created: as in `strategy.scope()`.

    In a replica's stateless scope Keras would defer a new variable (every
    read before the replica ends draws new initial values) and the other
    replicas could not share it. tf.distribute lets a layer build on its first
    call inside `run` (TensorFlow's custom-training guide does), so the build
    runs outside the replica: outside its stateless scope, any compiled trace
    and the backend's own replica context, in cross-replica context (a build
    that calls the layer symbolically meets no other replica at a collective),
    on the primary device.
    """
    from keras_strategies.backend import engine  # noqa: PLC0415 - the engine imports these hooks' users

    with replica_variables.outside_stateless_scopes(), context.enter_frame(strategy, None), \
            engine.compiler.outside_replicas(), strategy.extended._scope_placement():
        yield
        # Several workers: every worker builds at the same point; all take the chief's values.
        strategy.extended._sync_variables_from_chief()


def _wrap_maybe_build(original: Callable) -> Callable:
    @functools.wraps(original)
    def _maybe_build(self, call_spec):
        if self.built or not replica_variables.in_replica_scope():
            return original(self, call_spec)
        with _as_in_scope(context.get_strategy()):
            return original(self, call_spec)

    return _maybe_build


def _wrap_variable_init(original: Callable) -> Callable:
    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        # Inside a replica: created by the replica function itself (a metric, a seed generator).
        inside = replica_variables.in_replica_scope()
        with _as_in_scope(context.get_strategy()) if inside else contextlib.nullcontext():
            original(self, *args, **kwargs)
            _record_current_strategy(self)

    return __init__


def _wrap_compile(original: Callable) -> Callable:
    @functools.wraps(original)
    def compile(self, *args, **kwargs):
        if context.has_strategy():
            current, own = context.get_strategy(), strategy_of(self)
            if own is not None and own is not current:
                raise ValueError(
                    f"This model was created under {own!r} but is compiled under {current!r}. "
                    "Build and compile a model inside the scope of one strategy."
                )
            object.__setattr__(self, _STRATEGY_ATTR, current)
        return original(self, *args, **kwargs)

    return compile


def _check_call_site(name: str, model: Any) -> None:
    """Clear errors for the two ways to call a Keras method where it cannot work under a strategy."""
    if not context.has_strategy():
        return
    replica_context = context.get_replica_context()
    if replica_context is not None and not replica_context._runs_keras_method:
        raise RuntimeError(
            f"`Model.{name}` cannot be called inside `strategy.run` (in a replica context): call it "
            "outside `strategy.run`, where it splits each batch across the replicas itself."
        )
    own, current = strategy_of(model), context.get_strategy()
    if own is not None and own is not current:
        raise ValueError(
            f"This model belongs to {own!r} (it was built in its scope), but `{name}` is called inside "
            f"the scope of another strategy, {current!r}. Call `{name}` outside that scope (the model "
            "runs on its own strategy), or build the model in the scope of the strategy to use."
        )
    if own is None and name in ("fit", "train_on_batch"):
        raise ValueError(
            f"This model was built and compiled outside any strategy scope, but `{name}` is called "
            f"inside the scope of {context.get_strategy()!r}: its variables are not distributed. "
            "Create and compile the model inside `with strategy.scope():` (then call `fit` inside or "
            f"outside it), or call `{name}` outside the scope to train on one device."
        )


def _wrap_method(name: str, original: Callable) -> Callable:
    @functools.wraps(original)
    def method(self, *args, **kwargs):
        _check_call_site(name, self)
        strategy = strategy_of(self)
        if strategy is None:
            return original(self, *args, **kwargs)
        return strategy.extended._run_keras_method(name, original, self, args, kwargs)

    return method


# Keras 3.16 renamed the class that every backend's trainer derives from to `BaseTrainer`.
_TRAINER = "keras.src.trainers.trainer.Trainer"
_BASE_TRAINER = "keras.src.trainers.trainer.BaseTrainer"
_MODEL = "keras.src.models.model.Model"
_TRAINER_INIT = patches.declare(f"{_TRAINER}.__init__", "a model remembers the strategy it was created under",
                                moved=(f"{_BASE_TRAINER}.__init__",))
# On the base trainer itself: Keras' `compile_from_config` compares `cls.compile` with its `compile`.
_COMPILE = patches.declare(f"{_TRAINER}.compile", "a model is compiled under the strategy it was created under",
                           moved=(f"{_BASE_TRAINER}.compile",))
_VARIABLE_INIT = patches.declare(
    "keras.src.backend.common.variables.Variable.__init__",
    "a variable remembers its strategy; one made inside `strategy.run` is made as in `scope()`, shared by the replicas")
_MAYBE_BUILD = patches.declare("keras.src.layers.layer.Layer._maybe_build",
                               "a layer first called inside `strategy.run` builds as in `scope()`")
_METHODS = {name: patches.declare(f"{_MODEL}.{name}", "runs under the model's strategy: each global batch split "
                                  "across the replicas") for name in KERAS_METHODS}


def install() -> None:
    """Installs the hooks (idempotent)."""
    _TRAINER_INIT.apply(_wrap_init)
    _VARIABLE_INIT.apply(_wrap_variable_init)
    _MAYBE_BUILD.apply(_wrap_maybe_build)
    _COMPILE.apply(_wrap_compile)
    for name, patch in _METHODS.items():
        patch.apply(functools.partial(_wrap_method, name))
