"""`ReduceOp`: how values from several replicas are combined (as `tf.distribute.ReduceOp`)."""

from __future__ import annotations

import enum


class ReduceOp(enum.Enum):
    """Reduction used by `reduce`, `all_reduce` and variable aggregation."""

    SUM = "SUM"
    MEAN = "MEAN"

    @staticmethod
    def from_variable_aggregation(aggregation: str) -> "ReduceOp":
        """Maps a Keras variable aggregation ("sum"/"mean") to a `ReduceOp`."""
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
    def parse(value: "ReduceOp | str") -> "ReduceOp":
        """Accepts a `ReduceOp` or its name in any case (`"sum"`, `"MEAN"`)."""
        if isinstance(value, ReduceOp):
            return value
        if isinstance(value, str) and value.upper() in ReduceOp.__members__:
            return ReduceOp[value.upper()]
        raise ValueError(
            f"Unknown reduce op {value!r}: use ks.ReduceOp.SUM or ks.ReduceOp.MEAN "
            "(or the strings 'sum' / 'mean')."
        )
