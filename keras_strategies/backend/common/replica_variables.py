"""What replica threads write to variables in `strategy.run` and in a model's own steps.

Replica threads share the primary variables. If every replica assigned them,
each update would be applied once per replica (BatchNormalization's moving
statistics would move several steps at once). So each replica runs in a
Keras `StatelessScope` that records its writes and reads the primaries for
everything it has not written (no copies; a replica on another device reads
a copy there, refreshed when the primary changes). Merges (`merge_call`,
the optimizer's update) run outside that scope and write the primaries.
After the run, writes to `aggregation="sum"` variables (metric state) add up
as deltas, and float variables with `aggregation="none"` or `"mean"` get the
mean of the values the replicas wrote: what tf-keras' BatchNormalization
statistics (`ON_READ`, `MEAN`) read as in `tf.distribute`, and what `fit`
does (a replica whose shard is empty does not count: `weigh_writes`). With
synchronized BatchNormalization every replica computes the same statistics,
so the mean is exact. Other variables take the first writing replica's value
(`tf.VariableAggregation.ONLY_FIRST_REPLICA`)."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional, Sequence

from keras import ops
from keras.src.backend.common import global_state
from keras.src.backend.common.stateless_scope import StatelessScope, get_stateless_scope


# How the replicas' writes of a variable combine (`ReplicaWrites` items).
DELTA, MEAN, FIRST = "delta", "mean", "first"


class RecordingScope(StatelessScope):
    """A `StatelessScope` that records which variables were assigned.

    Lookups fall back to an enclosing scope, then to the variable itself, so
    nested stateless code (e.g. `ks.value_and_grad` inside a replica) still
    sees the outer mapping. It collects `add_loss` terms (a `StatelessScope`
    without `collect_losses` drops them): each replica keeps its own.
    """

    def __init__(self, state_mapping: list):
        self.parent = get_stateless_scope()
        super().__init__(state_mapping=state_mapping, collect_losses=True)
        self.assigned: dict = {}

    def add_update(self, update: tuple) -> None:
        super().add_update(update)
        self.assigned[id(update[0])] = update[0]

    def get_current_value(self, variable: Any) -> Any:
        value = super().get_current_value(variable)
        if value is None and self.parent is not None:
            value = self.parent.get_current_value(variable)
        if value is None:
            # Mapped nowhere: the variable's own value (Keras asks the scope directly for
            # weight regularization losses).
            value = self._unmapped(variable)
        return value

    def _unmapped(self, variable: Any) -> Any:
        return getattr(variable, "_value", None)


class ReplicaScope(RecordingScope):
    """One replica's scope: its own writes, and the primaries as seen from its device."""

    def __init__(self, device: str, view: Callable[[Any, str], Any]):
        super().__init__([])
        self._device, self._view = device, view
        self._views: dict = {}
        self.weights: dict = {}

    def weigh(self, variable: Any, weight: Any) -> None:
        """Whether this replica's write of `variable` counts in the replicas' mean (1, the default, or 0)."""
        self.weights[id(variable)] = weight

    def _unmapped(self, variable: Any) -> Any:
        primary = getattr(variable, "_value", None)
        if primary is None:
            return None
        cached = self._views.get(id(variable))
        if cached is None or cached[0] is not primary:  # new, or assigned by a merge since
            cached = self._views[id(variable)] = (primary, self._view(primary, self._device))
        return cached[1]


def _replica_scope(through_keras_scopes: bool) -> Optional[ReplicaScope]:
    """The calling replica's scope, found through our recording scopes (and, if asked, through
    Keras' own stateless scopes nested in it), or None."""
    scope = get_stateless_scope()
    while scope is not None and not isinstance(scope, ReplicaScope):
        enclosing = getattr(scope, "parent", None)
        if enclosing is None and through_keras_scopes:
            enclosing = getattr(scope, "original_scope", None)
        scope = enclosing
    return scope


def in_replica_scope() -> bool:
    """Whether the caller runs inside a replica's scope, also through Keras' own nested stateless
    scopes (a layer's first call builds it inside one, `compute_output_spec`)."""
    return _replica_scope(through_keras_scopes=True) is not None


def weigh_writes(variables: Sequence[Any], weight: Callable[[], Any]) -> None:
    """Weighs the calling replica's writes of `variables` (e.g. 0 for statistics of an empty shard).

    `weight()` is computed only inside a replica's scope: elsewhere (Keras'
    own steps, one replica) nothing combines the writes.
    """
    scope = _replica_scope(through_keras_scopes=False)
    if scope is not None:
        value = weight()
        for variable in variables:
            scope.weigh(variable, value)


@contextlib.contextmanager
def outside_stateless_scopes() -> Iterator[None]:
    """Leaves every stateless scope (the replica's and Keras' own nested in it): a variable
    created there is a real one, initialized at once, as outside `strategy.run`."""
    scope = get_stateless_scope()
    global_state.set_global_attribute("stateless_scope", None)
    try:
        yield
    finally:
        global_state.set_global_attribute("stateless_scope", scope)


@contextlib.contextmanager
def outside_replica_scope() -> Iterator[None]:
    """Leaves the calling replica's scope: a merge writes the primary variables."""
    scope = get_stateless_scope()
    if not isinstance(scope, ReplicaScope):
        yield
        return
    global_state.set_global_attribute("stateless_scope", scope.parent)
    try:
        yield
    finally:
        global_state.set_global_attribute("stateless_scope", scope)


class ReplicaWrites:
    """The replicas' scopes for one run on `devices`, and their writes combined into the primaries.

    `view(value, device)` is a primary value as a replica on `device` reads
    it; `onto(value, primary)` places a replica's value where the primary
    value lives. `record`: scopes even for one replica (whose writes other
    workers' must join); by default only for several.
    """

    def __init__(self, devices: Sequence[str], view: Callable[[Any, str], Any], onto: Callable[[Any, Any], Any],
                 record: Optional[bool] = None):
        self._devices = list(devices)
        self._view, self._onto = view, onto
        self._record = len(self._devices) > 1 if record is None else record
        self._scopes: dict = {}

    def scope(self, replica_id: int) -> contextlib.AbstractContextManager:
        """Entered by replica `replica_id` in its own thread, around its computation."""
        if not self._record:
            return contextlib.nullcontext()
        scope = self._scopes[replica_id] = ReplicaScope(self._devices[replica_id], self._view)
        return scope

    def written(self, replica_id: int) -> list:
        """The variables replica `replica_id` wrote in this run (before `combine`)."""
        scope = self._scopes.get(replica_id)
        return [] if scope is None else list(scope.assigned.values())

    def combine(self, across_workers: Optional[Callable[[list], list]] = None) -> None:
        """Merges the replicas' writes into the primaries (after every replica has finished).

        `across_workers(items)` turns this worker's `(variable, kind, value,
        weight)` items into every worker's (same kinds and order).
        """
        items = self._local_items()
        if across_workers is not None:
            items = across_workers(items)
        for variable, kind, value, weight in items:
            if kind == DELTA:
                variable.assign(variable.value + value)
            elif kind == MEAN:
                # Weights count replicas (0 or 1 each). None counted (every write weighed 0): the value stays.
                count = ops.cast(ops.maximum(weight, 1.0), value.dtype)
                variable.assign(ops.where(weight > 0, value / count, variable.value))
            else:
                variable.assign(value)

    def _local_items(self) -> list:
        """Per written variable: `(variable, DELTA, summed change, 1)`, `(variable, MEAN, weighted sum, total
        weight)` or `(variable, FIRST, first replica's value, 1)`."""
        scopes, self._scopes = sorted(self._scopes.items()), {}
        written: dict = {}
        for _, scope in scopes:
            written.update(scope.assigned)
        items = []
        for variable in written.values():
            primary = variable.value
            writers = [scope for _, scope in scopes if id(variable) in scope.assigned]
            finals = [self._onto(scope.get_current_value(variable), primary) for scope in writers]
            aggregation = getattr(variable, "aggregation", "none")
            if aggregation == "sum":
                changes = [final - primary for final in finals]
                items.append((variable, DELTA, sum(changes[1:], changes[0]), 1.0))
            elif aggregation in ("none", "mean") and "float" in str(variable.dtype):
                weights = [ops.cast(scope.weights.get(id(variable), 1.0), "float32") for scope in writers]
                # A write weighed 0 may be NaN (statistics of no rows): select, do not multiply.
                parts = [ops.where(w > 0, f * ops.cast(w, f.dtype), ops.zeros_like(f)) for f, w in zip(finals, weights)]
                items.append((variable, MEAN, sum(parts[1:], parts[0]), sum(weights[1:], weights[0])))
            else:
                items.append((variable, FIRST, finals[0], 1.0))
        return items
