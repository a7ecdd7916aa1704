"""What a replica thread other than the first writes to variables in `strategy.run`.

Replica threads share the primary variables. If every replica assigned them,
each update would be applied once per replica (BatchNormalization's moving
statistics would move several steps at once). So replicas after the first
read copies and record their writes in a Keras `StatelessScope`; at the end,
writes to `aggregation="sum"` variables (metric state) are added to the
primary as deltas, and other writes are dropped: the primary value is the
first replica's (what `tf.VariableAggregation.ONLY_FIRST_REPLICA` gives in
`tf.distribute`). With synchronized BatchNormalization every replica computes
the same statistics, so the result is exact.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Sequence

from keras.src.backend.common.stateless_scope import StatelessScope, get_stateless_scope


class RecordingScope(StatelessScope):
    """A `StatelessScope` that records which variables were assigned.

    Lookups fall back to an enclosing scope, then to the variable itself, so
    nested stateless code (e.g. `ks.value_and_grad` inside a replica) still
    sees the outer mapping.
    """

    def __init__(self, state_mapping: list):
        self.parent = get_stateless_scope()
        super().__init__(state_mapping=state_mapping)
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
            value = getattr(variable, "_value", None)
        return value


@contextlib.contextmanager
def replica_copies(
    variables: Sequence[Any], copy: Callable[[Any], Any], to_primary: Callable[[Any, Any], Any]
) -> Iterator[None]:
    """A replica after the first computes with `copy(value)` of each of `variables`.

    `to_primary(delta, primary value)` places a metric delta where the
    primary value lives before it is added.
    """
    copies = {id(v): copy(v.value) for v in variables}
    with RecordingScope([(v, copies[id(v)]) for v in variables]) as scope:
        yield
    for variable in scope.assigned.values():
        if getattr(variable, "aggregation", None) == "sum" and id(variable) in copies:
            delta = scope.get_current_value(variable) - copies[id(variable)]
            primary = variable.value
            variable.assign(primary + to_primary(delta, primary))
