"""`ks.function` on engines that compile a custom step as one program over the replicas (JAX).

JAX cannot trace stateful Keras variables, so the step is traced as Keras'
own JAX trainer traces `fit`'s: over the values of the variables it reads
and writes, on every device of the strategy's replicas at once
(`engine.compiler.custom_step_program`). Inside that trace `strategy.run`
runs the device's own replica inline (each device holds its replica's
component of a `PerReplica` argument), the replicas' sums are the engine's
collectives, and `merge_call` (the optimizer's one update) runs on every
device on the same summed values. The strategy is the one whose distributed
values the step is given (a distributed dataset's elements), else the one in
whose scope it is called; a step given neither runs eagerly.

Shards of different sizes (a partial last batch) are padded to the rows of
a program traced before, with copies of real rows, and each replica gets a
row mask (`ReplicaContext._row_mask`), so no new shape is compiled. The mask
keeps the padding rows out of `ks.compute_average_loss`, of metrics built on
`keras.metrics.Mean`, of BatchNormalization's statistics and of the
per-replica values the step returns. Where the trace shows work the mask
cannot reach (a Keras loss that reduces the rows itself, another metric's or
layer's state written from the rows, a reduction or gather of per-replica
rows), the step runs its uneven batches eagerly, with a one-time warning.
A reduction over the rows written by hand (`ops.mean` of the shard's losses)
is not seen: it is the per-replica mean that TensorFlow's guide warns against.

Steps that cannot be traced (Python control flow on values, a strategy
whose replicas do not keep copies of the variables, several workers) run
eagerly, as before; a step whose trace fails runs eagerly from then on,
with a one-time warning that says why.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from typing import Any, Callable, Optional

import numpy as np
from keras import ops

from keras_strategies.backend import engine
from keras_strategies.distribute import context
from keras_strategies.distribute.values import DistributedValues, PerReplica, flatten, map_structure, strategy_of
from keras_strategies.input import padding

# .strategy: whose replicas the step being traced runs on; .row_mask: the device's row mask in it;
# .rows_enter: why padding rows would enter its results.
_tracing = threading.local()


def traced_strategy() -> Any:
    """The strategy whose replicas the step being traced runs on, else None."""
    return getattr(_tracing, "strategy", None)


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
        self._programs: dict = {}  # id(strategy) -> (the strategy, weakly; its program, or None)
        self._untraceable: Optional[str] = None
        self._packs: dict = {}  # program key -> how its output arrays become the step's output
        self._rows_enter: dict = {}  # program key -> why padding rows would enter its results (or None)
        self._capacities: dict = {}  # arguments' layout -> the row counts its programs were traced for
        self._warned_uneven = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._untraceable is None:
            strategy = _strategy_of((args, kwargs))
            program = None if strategy is None else self._program_for(strategy)
            if program is not None:
                layout = _Layout.of((args, kwargs), strategy.num_replicas_in_sync)
                if layout is not None:
                    return self._traced(strategy, program, layout, args, kwargs)
        return self._eager(*args, **kwargs)

    def _give_up(self, why: str) -> None:
        self._untraceable = why
        warnings.warn(f"ks.function runs this step eagerly: {why}", stacklevel=3)

    def _program_for(self, strategy: Any) -> Any:
        """The engine's program for steps on `strategy`'s replicas, or None where they run eagerly."""
        if id(strategy) not in self._programs:
            program = None
            if strategy.extended._custom_steps_untraceable() is None:
                program = engine.compiler.custom_step_program(strategy.extended._devices)
            self._programs[id(strategy)] = (weakref.ref(strategy), program)
        owner, program = self._programs[id(strategy)]
        return program if owner() is strategy else None

    def _traced(self, strategy: Any, program: Any, layout: "_Layout", args: tuple, kwargs: dict) -> Any:
        # Uneven shards are padded to the rows of a program traced before (the full batches').
        known = self._capacities.setdefault(layout.key, set())
        rows = min((r for r in known if r >= layout.largest), default=layout.largest) if layout.sizes else 0
        key = (layout.key, rows)
        stacked, replicated = layout.arguments(rows)

        def body(blocks: list, replicated_values: list) -> list:
            own, shared = iter(blocks), iter(replicated_values)
            mask = next(own) if layout.sizes else None
            rebuilt = []
            for kind, rank in zip(layout.kinds, layout.ranks):
                if kind in ("rows", "per_replica"):
                    block = next(own)
                    rebuilt.append(_OwnComponent(block if rank else block[0]))  # rank 0: a block of one
                elif kind == "array":
                    rebuilt.append(next(shared))
            call_args, call_kwargs = layout.rebuilt(rebuilt)
            _tracing.strategy, _tracing.row_mask, _tracing.rows_enter = strategy, mask, []
            try:
                output = self._fn(*call_args, **call_kwargs)
            finally:
                self._rows_enter[key] = "; ".join(dict.fromkeys(_tracing.rows_enter)) or None
                _tracing.strategy = _tracing.row_mask = _tracing.rows_enter = None
            arrays, self._packs[key] = _unpacked(output)
            return arrays

        try:
            program.prepare(body, key, stacked, replicated, [])
        except Exception as error:  # noqa: BLE001 - the eager step reports a real error as it would anyway
            self._give_up(f"it cannot be traced ({_described(error)}).")
            return self._eager(*args, **kwargs)
        known.add(rows)
        if layout.padded(rows) and self._rows_enter.get(key):
            if not self._warned_uneven:
                self._warned_uneven = True
                warnings.warn(
                    f"ks.function runs the steps whose shards differ in size eagerly: {self._rows_enter[key]}, "
                    "which the padding rows of one compiled shape would enter. Use ks.compute_average_loss "
                    "(and Keras losses with reduction=None) to keep them compiled.",
                    stacklevel=3,
                )
            return self._eager(*args, **kwargs)
        output = self._packs[key](program(key, stacked, replicated))
        return layout.unpadded(output, rows)


class _Layout:
    """How a call's arguments enter a program: per leaf `"per_replica"` (shards of the same shape),
    `"rows"` (shards of the same rows in every leaf, padded to one count with a row mask),
    `"array"` (the same for every replica) or `"static"` (part of the program's key)."""

    def __init__(self, structure: Any, leaves: list, kinds: list, key: tuple, sizes: Optional[list]):
        self.structure, self.leaves, self.kinds, self.key, self.sizes = structure, leaves, kinds, key, sizes
        self.largest = max(sizes) if sizes else 0

    @classmethod
    def of(cls, structure: Any, replicas: int) -> Optional["_Layout"]:
        """The layout of `structure`, or None when it cannot enter a program (per-replica values
        that differ in more than their rows, or do not have one component per replica).

        The rows of the first per-replica value of rank >= 1 are the shards' sizes; every
        per-replica value with those leading dimensions is rows of the same shards.
        """
        leaves = flatten(structure)
        shapes_of = {}
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, DistributedValues):
                if len(leaf.values) != replicas:
                    return None
                shapes_of[i] = [tuple(getattr(c, "shape", ())) for c in leaf.values]
        sizes = next(([s[0] for s in shapes] for shapes in shapes_of.values() if shapes[0]), None)
        kinds, key = [], []
        for i, leaf in enumerate(leaves):
            if i in shapes_of:
                shapes = shapes_of[i]
                dtypes = {str(getattr(c, "dtype", type(c).__name__)) for c in leaf.values}
                if len(dtypes) != 1:
                    return None
                if shapes[0] and [s[0] for s in shapes] == sizes and len({s[1:] for s in shapes}) == 1:
                    kinds.append("rows")
                    key.append(("rows", shapes[0][1:], *dtypes))
                elif len(set(shapes)) == 1:
                    kinds.append("per_replica")
                    key.append(("per_replica", shapes[0], *dtypes))
                else:
                    return None
            elif hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
                kinds.append("array")
                key.append(("array", tuple(leaf.shape), str(leaf.dtype)))
            else:
                kinds.append("static")
                key.append(("static", _hashable(leaf)))
        return cls(structure, leaves, kinds, tuple(key), sizes if "rows" in kinds else None)

    def padded(self, rows: int) -> bool:
        return bool(self.sizes) and any(size != rows for size in self.sizes)

    def arguments(self, rows: int) -> tuple[list, list]:
        """Per-replica arguments, each a list of its components in replica order (the row mask
        first, then each per-replica leaf, its shards padded to `rows` with copies of real rows
        where they differ), and the replicated ones."""
        per_replica = []
        if self.sizes:
            per_replica.append([(np.arange(rows) < size).astype("float32") for size in self.sizes])
        for leaf, kind in zip(self.leaves, self.kinds):
            if kind == "per_replica" or (kind == "rows" and not self.padded(rows)):
                per_replica.append(list(leaf.values))
            elif kind == "rows":
                shards = [np.asarray(ops.convert_to_numpy(c)) for c in leaf.values]
                source = next((s for s in shards if s.shape[0]), None)
                if source is None:  # no replica has rows: nothing to copy, and nothing counts
                    source = np.zeros((1,) + shards[0].shape[1:], shards[0].dtype)
                per_replica.append([padding.pad_with_copies(s, rows, source[:1]) for s in shards])
        replicated = [leaf for leaf, kind in zip(self.leaves, self.kinds) if kind == "array"]
        return per_replica, replicated

    @property
    def ranks(self) -> list:
        """Each leaf's rank (its first component's, for a per-replica value)."""
        return [len(getattr(leaf.values[0] if isinstance(leaf, DistributedValues) else leaf, "shape", ())) for leaf in self.leaves]

    def rebuilt(self, traced: list) -> tuple:
        """The call's `(args, kwargs)` with its non-static leaves replaced by `traced`, in order."""
        found = iter(traced)
        values = iter([next(found) if kind != "static" else leaf for leaf, kind in zip(self.leaves, self.kinds)])
        return map_structure(lambda _: next(values), self.structure)

    def unpadded(self, output: Any, rows: int) -> Any:
        """`output` with each per-replica value of `rows` rows cut back to its replica's rows."""
        if not self.padded(rows):
            return output

        def cut(leaf: Any) -> Any:
            if not isinstance(leaf, PerReplica) or any(tuple(getattr(c, "shape", ()))[:1] != (rows,) for c in leaf.values):
                return leaf
            return type(leaf)([c[:size] for c, size in zip(leaf.values, self.sizes)])

        return map_structure(cut, output)


def _strategy_of(structure: Any) -> Any:
    """The strategy of the step's distributed arguments (a distributed dataset's elements), else
    the strategy of the scope it is called in, else None (the step then runs eagerly)."""
    for leaf in flatten(structure):
        strategy = strategy_of(leaf)
        if strategy is not None:
            return strategy
    return context.get_strategy() if context.has_strategy() else None


def note_rows_enter(why: str, values: Any = None) -> None:
    """Called where a step's trace does work that padding rows would enter (a reduction over the
    rows that no row mask reaches), on `values` if given (then only if some value has the shard's
    rows): such a step runs its uneven batches eagerly."""
    mask = traced_row_mask()
    if mask is None:
        return
    if values is not None:
        leaves = [c for leaf in flatten(values) for c in (leaf.values if isinstance(leaf, DistributedValues) else (leaf,))]
        if not any(tuple(getattr(c, "shape", ()))[:1] == tuple(mask.shape) for c in leaves):
            return
    _tracing.rows_enter.append(why)


def traced_row_mask() -> Any:
    """The device's row mask in a step traced with rows (padded or not), else None."""
    return getattr(_tracing, "row_mask", None)


def _described(error: Exception) -> str:
    lines = str(error).splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


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
            arrays.append(ops.stack([ops.convert_to_tensor(c) for c in leaf.values]))
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
