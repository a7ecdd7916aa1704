"""Resolvers read `TF_CONFIG` and report cluster roles exactly as TF's do."""

import json
import os

import pytest

from keras_strategies.cluster_resolver import (
    ClusterResolver,
    ClusterSpec,
    SimpleClusterResolver,
    TFConfigClusterResolver,
    roles,
)


TWO_WORKERS = {
    "cluster": {"worker": ["w0:2222", "w1:2222"]},
    "task": {"type": "worker", "index": 1},
}


def _set(monkeypatch, config):
    monkeypatch.setenv("TF_CONFIG", config if isinstance(config, str) else json.dumps(config))


def _assert_local(resolver):
    assert resolver.cluster_spec() == ClusterSpec({})
    assert not resolver.cluster_spec()
    assert resolver.task_type is None
    assert resolver.task_id is None
    assert resolver.rpc_layer is None
    assert resolver.master() == ""


def test_unset_tf_config_means_local(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    resolver = TFConfigClusterResolver()
    _assert_local(resolver)
    assert resolver.environment is None
    assert resolver.num_accelerators() == {}


def test_empty_json_object_means_local(monkeypatch):
    _set(monkeypatch, "{}")
    _assert_local(TFConfigClusterResolver())


@pytest.mark.parametrize("raw", ["", "{not json", "{'cluster': {}}"])
def test_invalid_json_is_a_value_error(monkeypatch, raw):
    _set(monkeypatch, raw)
    with pytest.raises(ValueError, match="TF_CONFIG is not valid JSON"):
        TFConfigClusterResolver().cluster_spec()


def test_json_that_is_not_an_object_is_rejected(monkeypatch):
    _set(monkeypatch, "[1, 2]")
    with pytest.raises(ValueError, match=r"TF_CONFIG must be a JSON object, got '\[1, 2\]'"):
        TFConfigClusterResolver().task_type


def test_reads_cluster_task_and_master(monkeypatch):
    _set(monkeypatch, TWO_WORKERS)
    resolver = TFConfigClusterResolver()
    assert resolver.cluster_spec().as_dict() == {"worker": ["w0:2222", "w1:2222"]}
    assert resolver.task_type == "worker"
    assert resolver.task_id == 1
    assert resolver.rpc_layer is None
    assert resolver.master() == "w1:2222"
    assert resolver.master("worker", 0) == "w0:2222"
    assert resolver.master("worker", 0, rpc_layer="grpc") == "grpc://w0:2222"


def test_rpc_layer_prefixes_master(monkeypatch):
    _set(monkeypatch, {**TWO_WORKERS, "rpc_layer": "grpc"})
    resolver = TFConfigClusterResolver()
    assert resolver.rpc_layer == "grpc"
    assert resolver.master() == "grpc://w1:2222"


def test_task_type_and_index_are_cast(monkeypatch):
    _set(monkeypatch, {"cluster": {"worker": ["a", "b"]}, "task": {"type": 7, "index": "1"}})
    resolver = TFConfigClusterResolver()
    assert resolver.task_id == 1 and isinstance(resolver.task_id, int)
    assert resolver.task_type == "7"


def test_task_without_keys_gives_none(monkeypatch):
    _set(monkeypatch, {"cluster": {"worker": ["a"]}, "task": {}})
    resolver = TFConfigClusterResolver()
    assert resolver.task_type is None
    assert resolver.task_id is None


def test_tf_config_is_reread_on_every_access(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    resolver = TFConfigClusterResolver()
    assert resolver.task_type is None
    _set(monkeypatch, TWO_WORKERS)
    assert resolver.task_type == "worker"
    assert resolver.cluster_spec().num_tasks("worker") == 2
    _set(monkeypatch, {"cluster": {"chief": ["c"]}, "task": {"type": "chief", "index": 0}})
    assert resolver.task_type == "chief"
    assert resolver.task_id == 0
    assert resolver.cluster_spec().jobs == ["chief"]


def test_constructor_arguments_override_tf_config(monkeypatch):
    _set(monkeypatch, {**TWO_WORKERS, "rpc_layer": "grpc"})
    resolver = TFConfigClusterResolver(
        task_type="worker", task_id="0", rpc_layer="grpc+verbs", environment="google"
    )
    assert resolver.task_type == "worker"
    assert resolver.task_id == 0
    assert resolver.rpc_layer == "grpc+verbs"
    assert resolver.environment == "google"
    assert resolver.master() == "grpc+verbs://w0:2222"


def test_setters_override_and_none_falls_back(monkeypatch):
    _set(monkeypatch, {**TWO_WORKERS, "rpc_layer": "grpc"})
    resolver = TFConfigClusterResolver()
    resolver.task_type = "ps"
    resolver.task_id = 3
    resolver.rpc_layer = "local"
    assert (resolver.task_type, resolver.task_id, resolver.rpc_layer) == ("ps", 3, "local")
    resolver.task_type = None
    resolver.task_id = None
    resolver.rpc_layer = None
    assert (resolver.task_type, resolver.task_id, resolver.rpc_layer) == ("worker", 1, "grpc")


def test_session_master_wins(monkeypatch):
    _set(monkeypatch, {**TWO_WORKERS, "rpc_layer": "grpc", "session_master": "sm:1"})
    assert TFConfigClusterResolver().master() == "sm:1"
    assert TFConfigClusterResolver().master("worker", 0) == "sm:1"
    _set(monkeypatch, {"session_master": "sm:2"})
    assert TFConfigClusterResolver().master() == "sm:2"


def test_single_task_cluster_has_no_master(monkeypatch):
    _set(monkeypatch, {"cluster": {"worker": ["w0"]}, "task": {"type": "worker", "index": 0},
                       "rpc_layer": "grpc"})
    assert TFConfigClusterResolver().master() == ""


def test_one_task_per_job_in_two_jobs_has_a_master(monkeypatch):
    _set(monkeypatch, {"cluster": {"chief": ["c:1"], "worker": ["w:1"]},
                       "task": {"type": "chief", "index": 0}})
    assert TFConfigClusterResolver().master() == "c:1"


def test_master_without_task_names_the_missing_job(monkeypatch):
    _set(monkeypatch, {"cluster": {"worker": ["a", "b"]}})
    with pytest.raises(ValueError, match="No such job in cluster: None"):
        TFConfigClusterResolver().master()


def test_num_accelerators_is_empty_without_a_device_query(monkeypatch):
    _set(monkeypatch, TWO_WORKERS)
    assert TFConfigClusterResolver().num_accelerators() == {}
    assert TFConfigClusterResolver().num_accelerators("worker", 0) == {}


def test_cluster_resolver_is_abstract_with_tf_defaults():
    with pytest.raises(TypeError):
        ClusterResolver()

    class Minimal(ClusterResolver):
        def cluster_spec(self):
            return ClusterSpec({})

        def master(self, task_type=None, task_id=None, rpc_layer=None):
            return ""

    resolver = Minimal()
    assert (resolver.task_type, resolver.task_id, resolver.rpc_layer) == (None, None, None)
    assert resolver.environment == ""
    assert resolver.num_accelerators() == {}
    resolver.task_type, resolver.task_id, resolver.rpc_layer = "worker", 2, "grpc"
    assert (resolver.task_type, resolver.task_id, resolver.rpc_layer) == ("worker", 2, "grpc")


def test_simple_resolver_returns_what_it_was_given():
    spec = ClusterSpec({"worker": ["w0:1", "w1:1"]})
    resolver = SimpleClusterResolver(
        spec, task_type="worker", task_id=1, num_accelerators={"GPU": 2}, rpc_layer="grpc"
    )
    assert resolver.cluster_spec() is spec
    assert (resolver.task_type, resolver.task_id, resolver.rpc_layer) == ("worker", 1, "grpc")
    assert resolver.environment == ""
    assert resolver.num_accelerators() == {"GPU": 2}
    assert resolver.num_accelerators("worker", 0) == {"GPU": 2}
    assert resolver.master() == "grpc://"
    assert resolver.master("worker", 0) == "grpc://w0:1"
    assert resolver.master("worker", 0, rpc_layer="http") == "http://w0:1"
    assert resolver.master("worker") == "grpc://"  # both task_type and task_id needed
    resolver.task_id = 0
    resolver.rpc_layer = None
    assert resolver.task_id == 0
    assert resolver.master("worker", 1) == "w1:1"


def test_simple_resolver_defaults():
    resolver = SimpleClusterResolver(ClusterSpec({}), master="local:0", environment="google")
    assert resolver.master() == "local:0"
    assert resolver.num_accelerators() == {}
    assert resolver.environment == "google"
    assert (resolver.task_type, resolver.task_id, resolver.rpc_layer) == (None, None, None)


def test_simple_resolver_checks_types():
    with pytest.raises(TypeError, match="cluster_spec must be a `ClusterSpec`, got dict"):
        SimpleClusterResolver({"worker": ["a"]})
    with pytest.raises(TypeError, match="master must be a string, got 3"):
        SimpleClusterResolver(ClusterSpec({}), master=3)


TF_CONFIGS = [
    None,
    {},
    TWO_WORKERS,
    {**TWO_WORKERS, "rpc_layer": "grpc"},
    {**TWO_WORKERS, "session_master": "sm:1"},
    {"cluster": {"worker": ["w0"]}, "task": {"type": "worker", "index": "0"}, "rpc_layer": "grpc"},
    {"cluster": {"chief": ["c"], "worker": {2: "w2"}}, "task": {"type": "worker", "index": 2}},
    {"task": {"type": "evaluator", "index": 0}},
]

if os.environ.get("KERAS_BACKEND") == "tensorflow":

    @pytest.mark.parametrize("config", TF_CONFIGS)
    def test_matches_tensorflow_tf_config_resolver(monkeypatch, config):
        import tensorflow as tf

        if config is None:
            monkeypatch.delenv("TF_CONFIG", raising=False)
        else:
            _set(monkeypatch, config)
        ours = TFConfigClusterResolver()
        theirs = tf.distribute.cluster_resolver.TFConfigClusterResolver()
        assert ours.cluster_spec().as_dict() == theirs.cluster_spec().as_dict()
        for name in ("task_type", "task_id", "rpc_layer", "environment"):
            assert getattr(ours, name) == getattr(theirs, name), name
        assert ours.master() == theirs.master()
        assert ours.master(rpc_layer="x") == theirs.master(rpc_layer="x")
        ours.task_id = theirs.task_id = "0"
        assert ours.task_id == theirs.task_id

    def test_matches_tensorflow_simple_resolver():
        import tensorflow as tf

        spec = {"worker": ["w0:1", "w1:1"]}
        kwargs = dict(master="m:1", task_type="worker", task_id=1, rpc_layer="grpc")
        ours = SimpleClusterResolver(ClusterSpec(spec), **kwargs)
        theirs = tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec(spec), **kwargs
        )
        for args in [(), ("worker", 0), ("worker", 0, "http"), ("worker", None)]:
            assert ours.master(*args) == theirs.master(*args)
        assert ours.environment == theirs.environment
        assert ours.num_accelerators() == theirs.num_accelerators()


def test_a_ps_task_of_a_parameter_server_cluster(monkeypatch):
    cluster = {"chief": ["c:2222"], "worker": ["w0:2222", "w1:2222"], "ps": ["p0:2222", "p1:2222"]}
    _set(monkeypatch, {"cluster": cluster, "task": {"type": "ps", "index": 1}, "rpc_layer": "grpc"})
    resolver = TFConfigClusterResolver()
    assert (resolver.task_type, resolver.task_id) == ("ps", 1)
    assert resolver.cluster_spec().as_dict() == cluster
    assert resolver.cluster_spec().jobs == ["chief", "worker", "ps"]
    assert resolver.cluster_spec().job_tasks("ps") == ["p0:2222", "p1:2222"]
    assert resolver.master() == "grpc://p1:2222"
    assert resolver.master("chief", 0) == "grpc://c:2222"
    resolver.task_id = 2
    with pytest.raises(ValueError, match="^The `task_id` 2 exceeds the maximum id of ps.$"):
        roles.validate_parameter_server_config(resolver.cluster_spec(), resolver.task_type, resolver.task_id)
