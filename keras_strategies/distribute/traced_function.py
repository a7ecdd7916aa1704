"""`ks.function` on engines that compile a custom step as one program over the replicas (JAX).

JAX cannot trace stateful Keras variables, so the step is traced as Keras'
own JAX trainer traces `fit`'s: over the values of the variables it reads
and writes, on every device of the strategy's replicas at once
(`engine.compiler.custom_step_program`). Inside that trace `strategy.run`
runs the device's own replica inline (each device holds its replica's
component of a `PerReplica` argument), the replicas' sums are the engine's
collectives, and `merge_call` (the optimizer's one update) runs on every
device on the same summed values. The first call finds the strategy by
tracing the step up to its `strategy.run`.

Steps that cannot be traced this way (Python control flow on values, a
strategy whose replicas do not keep copies of the variables, several
workers, shards of different sizes) run eagerly, as before; a step whose
trace fails runs eagerly from then on, with a one-time warning that says why.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from typing import Any, Callable, Optional

from keras.src.backend.common.stateless_scope import StatelessScope

from keras_strategies.backend import engine
from keras_strategies.distribute.values import DistributedValues, PerReplica, flatten, map_structure

_tracing = threading.local()  # .strategy: whose replicas the step being traced runs on; .probing


def traced_strategy() -> Any:
    """The strategy whose replicas the step being traced runs on, else None."""
    return getattr(_tracing, "strategy", None)


class _StrategyFound(Exception):
    def __init__(self, strategy: Any):
        super().__init__("strategy found")
        self.strategy = strategy


def note_run(strategy: Any) -> None:
    """Called by `strategy.run`: while a step is probed, stops it and reports `strategy`."""
    if getattr(_tracing, "probing", False):
        raise _StrategyFound(strategy)


class _OwnComponent(PerReplica):
    """A `PerReplica` argument inside a traced step: each device holds its own replica's component."""

    def __init__(self, own: Any):
        super().__init__(())
        self._own = own

    def _get_on_replica(self, replica_id: Any) -> Any:
        return self._own

    @property
    def values(self) -> tuple:
        raise RuntimeError("a distributed argument's components are read outside strategy.run")


class TracedFunction:
    """`fn` compiled as one program over its strategy's replicas where it can be; `eager` otherwise."""

    def __init__(self, fn: Callable, eager: Callable):
        self._fn, self._eager = fn, eager
        self._strategy: Optional[weakref.ref] = None
        self._program: Any = None
        self._untraceable: Optional[str] = None
        self._packs: dict = {}  # signature -> how its program's output arrays become the step's output
        self._ran: set = set()  # signatures whose program ran

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._untraceable is None:
            strategy = self._strategy() if self._strategy is not None else self._probe(args, kwargs)
            if strategy is not None and self._untraceable is None:
                signature = _signature((args, kwargs))
                if signature is not None:
                    return self._traced(strategy, signature, args, kwargs)
        return self._eager(*args, **kwargs)

    def _give_up(self, why: str) -> None:
        self._untraceable = why
        warnings.warn(f"ks.function runs this step eagerly: {why}", stacklevel=3)

    def _probe(self, args: tuple, kwargs: dict) -> Any:
        """The strategy whose `run` the step calls (traced up to that call, nothing computed)."""
        _tracing.probing = True
        try:
            with StatelessScope():
                engine.compiler.trace_only(lambda: self._fn(*args, **kwargs))
        except _StrategyFound as found:
            strategy = found.strategy
        except Exception as error:  # noqa: BLE001 - whatever stops the trace, the eager step reports
            self._give_up(f"it cannot be traced ({_described(error)}).")
            return None
        else:
            self._untraceable = "it calls no strategy.run"  # nothing to compile over replicas
            return None
        finally:
            _tracing.probing = False
        why = strategy.extended._custom_steps_untraceable()
        if why is not None:
            self._untraceable = why
            return None
        self._strategy = weakref.ref(strategy)
        self._program = engine.compiler.custom_step_program(strategy.extended._devices)
        return strategy

    def _traced(self, strategy: Any, signature: tuple, args: tuple, kwargs: dict) -> Any:
        kinds, statics = signature
        leaves = flatten((args, kwargs))
        stacked = [engine.replicas.stack([(c,) for c in leaf.values])[0] for leaf, kind in zip(leaves, kinds) if kind == "per_replica"]
        replicated = [leaf for leaf, kind in zip(leaves, kinds) if kind == "array"]
        if any(len(leaf.values) != strategy.num_replicas_in_sync for leaf, kind in zip(leaves, kinds) if kind == "per_replica"):
            return self._eager(*args, **kwargs)

        def body(stacked_blocks: list, replicated_values: list) -> list:
            own, shared = iter(stacked_blocks), iter(replicated_values)
            rebuilt = [
                _OwnComponent(next(own)[0]) if kind == "per_replica" else next(shared) if kind == "array" else leaf
                for leaf, kind in zip(leaves, kinds)
            ]
            found = iter(rebuilt)
            call_args, call_kwargs = map_structure(lambda _: next(found), (args, kwargs))
            _tracing.strategy = strategy
            try:
                output = self._fn(*call_args, **call_kwargs)
            finally:
                _tracing.strategy = None
            arrays, self._packs[signature] = _unpacked(output)
            return arrays

        try:
            output = self._program(body, signature, stacked, replicated, [])
        except Exception as error:  # noqa: BLE001 - a program that ran before fails like the eager step
            if signature in self._ran:
                raise
            self._give_up(f"it cannot be traced ({_described(error)}).")
            return self._eager(*args, **kwargs)
        self._ran.add(signature)
        return self._packs[signature](output)


def _described(error: Exception) -> str:
    lines = str(error).splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def _signature(structure: Any) -> Optional[tuple]:
    """Per leaf: `"per_replica"`, `"array"` or `"static"`, and what a program depends on (shapes,
    dtypes, static values); None when per-replica components differ in shape."""
    kinds, key = [], []
    for leaf in flatten(structure):
        if isinstance(leaf, DistributedValues):
            shapes = {(tuple(getattr(c, "shape", ())), str(getattr(c, "dtype", type(c).__name__))) for c in leaf.values}
            if len(shapes) != 1:
                return None
            kinds.append("per_replica")
            key.append(("per_replica", len(leaf.values), *shapes))
        elif hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
            kinds.append("array")
            key.append(("array", tuple(leaf.shape), str(leaf.dtype)))
        else:
            kinds.append("static")
            key.append(("static", _hashable(leaf)))
    return tuple(kinds), tuple(key)


def _hashable(value: Any) -> Any:
    try:
        hash(value)
        return value
    except TypeError:
        return ("id", id(value))


def _unpacked(output: Any) -> tuple[list, Callable[[list], Any]]:
    """The arrays of a step's output (a `PerReplica` as its components stacked), and how to pack
    them back into the output's structure."""
    arrays: list = []
    kinds: list = []

    def take(leaf: Any) -> None:
        if isinstance(leaf, DistributedValues):
            import keras  # noqa: PLC0415

            arrays.append(keras.ops.stack([keras.ops.convert_to_tensor(c) for c in leaf.values]))
            kinds.append(("per_replica", type(leaf)))
        elif hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
            arrays.append(leaf)
            kinds.append(("array", None))
        else:
            kinds.append(("static", leaf))

    map_structure(take, output)
    skeleton = map_structure(lambda _: None, output)

    def pack(values: list) -> Any:
        found = iter(values)
        kind_of = iter(kinds)

        def rebuild(_: Any) -> Any:
            kind, detail = next(kind_of)
            if kind == "per_replica":
                stacked = next(found)
                return detail([stacked[i] for i in range(stacked.shape[0])])
            if kind == "array":
                return next(found)
            return detail

        return map_structure(rebuild, skeleton)

    return arrays, pack
