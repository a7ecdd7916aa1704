"""`ks.cluster_resolver.ClusterSpec` reproduces `tf.train.ClusterSpec`."""

import os

import pytest

from keras_strategies.cluster_resolver import ClusterSpec


def test_a_dense_spec_lists_its_jobs_tasks_and_addresses():
    spec = ClusterSpec({"worker": ["w0:1", "w1:1", "w2:1"], "ps": ("p0:1",)})
    assert spec.jobs == ["worker", "ps"]
    assert spec.num_tasks("worker") == 3
    assert spec.num_tasks("ps") == 1
    assert spec.task_indices("worker") == [0, 1, 2]
    assert spec.task_address("worker", 2) == "w2:1"
    assert spec.job_tasks("ps") == ["p0:1"]
    assert spec.as_dict() == {"worker": ["w0:1", "w1:1", "w2:1"], "ps": ["p0:1"]}
    assert bool(spec) is True


def test_sparse_spec_keeps_gaps():
    spec = ClusterSpec({"worker": {1: "h1:1", 3: "h3:1"}})
    assert spec.num_tasks("worker") == 2
    assert spec.task_indices("worker") == [1, 3]
    assert spec.task_address("worker", 3) == "h3:1"
    assert spec.job_tasks("worker") == [None, "h1:1", None, "h3:1"]
    assert spec.as_dict() == {"worker": {1: "h1:1", 3: "h3:1"}}


def test_sparse_indices_are_cast_with_int_and_dense_dicts_become_lists():
    spec = ClusterSpec({"worker": {"1": "b", "0": "a"}, "ps": {2: "p2"}})
    assert spec.task_indices("worker") == [0, 1]
    assert spec.as_dict() == {"worker": ["a", "b"], "ps": {2: "p2"}}


def test_an_empty_spec_is_false_and_an_empty_job_has_no_tasks():
    assert not ClusterSpec({})
    assert ClusterSpec({}).jobs == []
    assert ClusterSpec({}).as_dict() == {}
    spec = ClusterSpec({"worker": []})
    assert bool(spec) is True
    assert spec.num_tasks("worker") == 0
    assert spec.as_dict() == {"worker": {}}
    assert spec.job_tasks("worker") == []


def test_copy_from_cluster_spec_orders_jobs_by_name_like_tf():
    original = ClusterSpec({"worker": ["a"], "chief": ["c"]})
    copy = ClusterSpec(original)
    assert copy.jobs == ["chief", "worker"]
    assert copy == original
    assert copy is not original


def test_bytes_names_and_addresses_are_decoded():
    assert ClusterSpec({b"worker": [b"a:1"]}).as_dict() == {"worker": ["a:1"]}


def test_equality_compares_the_indexed_form_like_tf():
    spec = ClusterSpec({"worker": ["a", "b"]})
    assert spec == ClusterSpec({"worker": {0: "a", 1: "b"}})
    assert spec == {"worker": {0: "a", 1: "b"}}
    assert spec != {"worker": ["a", "b"]}
    assert spec != ClusterSpec({"worker": ["a"]})
    assert ClusterSpec({}) == {}
    with pytest.raises(TypeError):
        hash(spec)


def test_repr_sorts_jobs():
    spec = ClusterSpec({"worker": {1: "h1", 3: "h3"}, "ps": ["p"]})
    assert repr(spec) == "ClusterSpec({'ps': ['p'], 'worker': {1: 'h1', 3: 'h3'}})"


@pytest.mark.parametrize(
    "cluster, message",
    [
        (["a:1"], "`cluster` must be a dictionary"),
        ("worker", "got 'worker'"),
        (None, "got None"),
        ({"worker": "a:1"}, "The tasks for job 'worker' must be a list"),
        ({"worker": [1]}, "Task address 1 must be bytes or unicode"),
        ({"worker": [None]}, "Task address None must be bytes or unicode"),
        ({3: ["a"]}, "Job name 3 must be bytes or unicode"),
        ({"worker": {"x": "a"}}, "Task index 'x' of job 'worker' must be an integer"),
        ({"worker": {-1: "a"}}, "Task index -1 of job 'worker' must be non-negative"),
    ],
)
def test_bad_input_is_both_type_error_and_value_error(cluster, message):
    with pytest.raises(TypeError, match=message):
        ClusterSpec(cluster)
    with pytest.raises(ValueError, match=message):
        ClusterSpec(cluster)


@pytest.mark.parametrize("method", ["num_tasks", "task_indices", "job_tasks"])
def test_unknown_job_names_the_job(method):
    spec = ClusterSpec({"worker": ["a"]})
    with pytest.raises(ValueError, match=r"^No such job in cluster: 'ps'$"):
        getattr(spec, method)("ps")


def test_task_address_errors_name_job_and_index():
    spec = ClusterSpec({"worker": {1: "a"}})
    with pytest.raises(ValueError, match=r"^No such job in cluster: 'chief'$"):
        spec.task_address("chief", 0)
    with pytest.raises(ValueError, match=r"^No task with index 0 in job 'worker'$"):
        spec.task_address("worker", 0)
    with pytest.raises(ValueError, match=r"^No task with index '1' in job 'worker'$"):
        spec.task_address("worker", "1")


CASES = [
    {},
    {"worker": ["a:1", "b:1"]},
    {"chief": ["c:1"], "worker": ("w:1",), "ps": ["p0:1", "p1:1"]},
    {"worker": {1: "h1:1", 3: "h3:1"}, "ps": {0: "p:1"}},
    {"worker": {"2": "h2:1"}},
    {"worker": []},
]

if os.environ.get("KERAS_BACKEND") == "tensorflow":

    @pytest.mark.parametrize("cluster", CASES)
    def test_matches_tensorflow_cluster_spec(cluster):
        import tensorflow as tf

        ours, theirs = ClusterSpec(cluster), tf.train.ClusterSpec(cluster)
        assert ours.as_dict() == theirs.as_dict()
        assert ours.jobs == theirs.jobs
        assert repr(ours) == repr(theirs)
        assert bool(ours) == bool(theirs)
        for job in theirs.jobs:
            assert ours.num_tasks(job) == theirs.num_tasks(job)
            assert ours.task_indices(job) == theirs.task_indices(job)
            if theirs.num_tasks(job):
                assert ours.job_tasks(job) == theirs.job_tasks(job)
        copied = ClusterSpec(theirs)  # a real tf.train.ClusterSpec is accepted
        assert copied.as_dict() == tf.train.ClusterSpec(theirs).as_dict()
        assert copied.jobs == tf.train.ClusterSpec(theirs).jobs
