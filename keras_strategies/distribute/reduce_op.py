"""`ReduceOp`: how values from several replicas are combined (as `tf.distribute.ReduceOp`)."""

from __future__ import annotations

import enum


class ReduceOp(enum.Enum):
    """How `reduce`, `all_reduce` and variable aggregation combine replicas, as `tf.distribute.ReduceOp`.

    Wherever a `ReduceOp` is taken, its name is accepted too (`"sum"`, `"MEAN"`).

    Examples:
        >>> strategy = ks.MirroredStrategy(["cpu:0", "cpu:1"])
        >>> values = ks.PerReplica([1.0, 3.0])
        >>> float(strategy.reduce(ks.ReduceOp.SUM, values, axis=None)), float(strategy.reduce("mean", values, axis=None))
        (4.0, 2.0)
    """

    SUM = "SUM"
    MEAN = "MEAN"

    @staticmethod
    def from_variable_aggregation(aggregation: str) -> ReduceOp:
        """Maps a Keras variable aggregation ("sum"/"mean") to a `ReduceOp`.

        Examples:
            >>> ks.ReduceOp.from_variable_aggregation("sum")
            <ReduceOp.SUM: 'SUM'>
        """
        name = str(getattr(aggregation, "name", aggregation)).lower()
        if name == "sum":
            return ReduceOp.SUM
        if name == "mean":
            return ReduceOp.MEAN
        raise ValueError(
            f"Could not convert from variable aggregation {aggregation!r} to a "
            "ReduceOp: only 'sum' and 'mean' have a reduction."
        )

    @staticmethod
    def parse(value: ReduceOp | str) -> ReduceOp:
        """Accepts a `ReduceOp` or its name in any case (`"sum"`, `"MEAN"`).

        Examples:
            >>> ks.ReduceOp.parse("mean")
            <ReduceOp.MEAN: 'MEAN'>
        """
        if isinstance(value, ReduceOp):
            return value
        if isinstance(value, str) and value.upper() in ReduceOp.__members__:
            return ReduceOp[value.upper()]
        raise ValueError(
            f"Unknown reduce op {value!r}: use ks.ReduceOp.SUM or ks.ReduceOp.MEAN "
            "(or the strings 'sum' / 'mean')."
        )
