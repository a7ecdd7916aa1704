"""`ReduceOp` names and conversions."""

import pytest

import keras_strategies as ks


@pytest.mark.parametrize("name", ["sum", "SUM", "Sum"])
def test_strings_are_accepted_case_insensitively(name):
    assert ks.ReduceOp.parse(name) is ks.ReduceOp.SUM
    assert ks.ReduceOp.parse(name.replace("um", "ean").replace("UM", "EAN").replace("S", "M").replace("s", "m")) is ks.ReduceOp.MEAN


def test_unknown_reduce_op_names_the_value():
    with pytest.raises(ValueError, match="'max'"):
        ks.ReduceOp.parse("max")


def test_sum_and_mean_aggregations_map_to_reduce_ops_and_others_are_refused():
    assert ks.ReduceOp.from_variable_aggregation("sum") is ks.ReduceOp.SUM
    assert ks.ReduceOp.from_variable_aggregation("mean") is ks.ReduceOp.MEAN
    with pytest.raises(ValueError, match="only_first_replica"):
        ks.ReduceOp.from_variable_aggregation("only_first_replica")
