"""`UnionResolver` merges clusters as TensorFlow's `UnionClusterResolver` does."""

import pytest

from keras_strategies.cluster_resolver import ClusterSpec, SimpleClusterResolver, UnionResolver


def _simple(cluster, **kwargs):
    return SimpleClusterResolver(ClusterSpec(cluster), **kwargs)


def test_lists_of_one_job_are_concatenated_in_order_and_properties_come_from_the_first():
    union = UnionResolver(_simple({"worker": ["a:1"]}, task_type="worker", task_id=1, rpc_layer="grpc"),
                          _simple({"worker": ["b:1"], "ps": ["c:1"]}, task_type="ps", task_id=0))
    assert union.cluster_spec().as_dict() == {"worker": ["a:1", "b:1"], "ps": ["c:1"]}
    assert (union.task_type, union.task_id, union.rpc_layer) == ("worker", 1, "grpc")
    assert union.master("ps", 0) == "grpc://c:1"
    union.task_type, union.task_id = "ps", 0
    assert (union.task_type, union.task_id) == ("ps", 0)


def test_sparse_jobs_merge_by_index_and_a_duplicate_index_is_a_key_error():
    union = UnionResolver(_simple({"worker": {0: "a:1"}}), _simple({"worker": {3: "b:1"}}))
    assert union.cluster_spec().as_dict() == {"worker": {0: "a:1", 3: "b:1"}}
    with pytest.raises(KeyError, match="Duplicate keys"):
        UnionResolver(_simple({"worker": {1: "a:1"}}), _simple({"worker": {1: "b:1"}})).cluster_spec()


def test_bad_arguments():
    with pytest.raises(ValueError, match="At least one ClusterResolver"):
        UnionResolver()
    with pytest.raises(TypeError, match="sub-class of `ClusterResolver`"):
        UnionResolver({"worker": ["a:1"]})
