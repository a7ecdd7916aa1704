"""Role rules and validation errors match TF's `multi_worker_util` and strategies."""

import json
import os
import re

import pytest

from keras_strategies.cluster_resolver import ClusterSpec, TFConfigClusterResolver
from keras_strategies.cluster_resolver import roles
from keras_strategies.launch import tf_config_for


ALLOWED = "('chief', 'worker', 'evaluator', 'ps', None)"
W2 = {"worker": ["a:1", "b:1"]}
CW = {"chief": ["c:1"], "worker": ["a:1"]}
FULL = {"chief": ["c:1"], "worker": ["w0:1", "w1:1", "w2:1"], "ps": ["p0:1", "p1:1"],
        "evaluator": ["e:1"]}


def _validate_mwms(cluster, task_type, task_id):
    roles.validate_multi_worker_config(cluster, task_type, task_id)


def _validate_pss(cluster, task_type, task_id):
    roles.validate_parameter_server_config(cluster, task_type, task_id)


# Ten invalid cluster configurations, each refused with TF's exact text.
ERROR_CASES = [
    ("disallowed job", roles.validate_cluster_spec, ({"foo": ["a"]}, None, None),
     "Disallowed task type found in cluster spec. Allowed types are "
     f"{ALLOWED} and the cluster spec is ClusterSpec({{'foo': ['a']}})."),
    ("unrecognized task_type", roles.validate_cluster_spec, (W2, "master", 0),
     f"Unrecognized task_type: master, valid task types are: {ALLOWED}"),
    ("task_type not in cluster", roles.validate_cluster_spec, (W2, "chief", 0),
     "`task_type` 'chief' not found in cluster_spec."),
    ("two chiefs", roles.validate_cluster_spec, ({"chief": ["a", "b"]}, "chief", 0),
     "There must be at most one 'chief' job."),
    ("two evaluators", roles.validate_cluster_spec, ({"evaluator": ["a", "b"]}, None, None),
     "There must be at most one 'evaluator' job."),
    ("task_id too large", roles.validate_cluster_spec, (W2, "worker", 2),
     "The `task_id` 2 exceeds the maximum id of worker."),
    ("mwms missing role", _validate_mwms, (W2, "worker", None),
     "When `cluster_spec` is given, you must also specify `task_type` and `task_id`."),
    ("mwms no workers", _validate_mwms, ({"ps": ["p"]}, "evaluator", 0),
     "No `worker`, `chief` or `evaluator` tasks can be found in `cluster_spec`."),
    ("pss no ps", _validate_pss, (W2, "worker", 0), "There must be at least one ps."),
    ("pss no worker", _validate_pss, ({"ps": ["p"], "chief": ["c"]}, "chief", 0),
     "There must be at least one worker."),
]


@pytest.mark.parametrize("name, fn, args, message", ERROR_CASES, ids=[c[0] for c in ERROR_CASES])
def test_validation_errors_have_tf_texts(name, fn, args, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        fn(*args)


def test_mwms_requires_both_type_and_id():
    with pytest.raises(ValueError, match="must also specify"):
        roles.validate_multi_worker_config(W2, None, 0)


def test_pss_requires_a_non_empty_cluster():
    message = "Cluster spec must be non-empty in `tf.distribute.cluster_resolver.ClusterResolver`."
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        roles.validate_parameter_server_config({})


def test_valid_configs_pass_and_return_the_spec():
    roles.validate_cluster_spec(FULL, "worker", 2)
    roles.validate_cluster_spec(W2, "evaluator", 0)  # evaluator may be absent
    roles.validate_cluster_spec(W2, None, None)
    assert roles.validate_multi_worker_config(W2, "worker", 1) == ClusterSpec(W2)
    local = roles.validate_multi_worker_config({}, None, None)  # local training
    assert isinstance(local, ClusterSpec) and not local
    assert roles.validate_parameter_server_config(FULL, "chief", 0).num_tasks("ps") == 2
    assert roles.validate_parameter_server_config({"ps": ["p"], "worker": ["w"]})


def test_mwms_rejects_ps_tasks_like_tf():
    with pytest.raises(ValueError, match="^There is no id for task_type 'ps'$"):
        roles.validate_multi_worker_config(FULL, "ps", 0)


@pytest.mark.parametrize(
    "cluster, task_type, task_id, expected",
    [
        (W2, "worker", 0, True),
        (W2, "worker", 1, False),
        (CW, "worker", 0, False),
        (CW, "chief", 0, True),
        (CW, "evaluator", 0, True),
        (FULL, "evaluator", 0, True),
        (FULL, "ps", 0, False),
        ({"worker": {0: "a", 2: "b"}}, "worker", 0, True),
    ],
)
def test_the_chief_is_the_chief_task_or_worker_0_without_one_and_each_evaluator(cluster, task_type, task_id, expected):
    assert roles.is_chief(cluster, task_type, task_id) is expected


def test_is_chief_refuses_a_task_id_beyond_the_job():
    with pytest.raises(ValueError, match="exceeds the maximum id of worker"):
        roles.is_chief(W2, "worker", 5)


def test_task_id_is_checked_against_the_task_count_even_when_sparse():
    # As in TF: a sparse job's ids are compared with `num_tasks`, not its indices.
    with pytest.raises(ValueError, match="^The `task_id` 2 exceeds the maximum id of worker.$"):
        roles.is_chief({"worker": {0: "a", 2: "b"}}, "worker", 2)


@pytest.mark.parametrize(
    "cluster, task_type, count",
    [(W2, "worker", 2), (CW, "chief", 2), (CW, "worker", 2), (FULL, "worker", 4),
     (FULL, "evaluator", 1), (W2, "evaluator", 0)],
)
def test_worker_count_counts_chief_and_workers_and_one_for_an_evaluator(cluster, task_type, count):
    assert roles.worker_count(cluster, task_type) == count


def test_worker_count_rejects_ps():
    with pytest.raises(ValueError, match="^Unexpected `task_type` 'ps'$"):
        roles.worker_count(FULL, "ps")


@pytest.mark.parametrize(
    "cluster, task_type, task_id, expected",
    [(W2, "worker", 1, 1), (CW, "chief", 0, 0), (CW, "worker", 0, 1), (FULL, "worker", 2, 3),
     (FULL, "evaluator", 0, 0)],
)
def test_id_in_cluster_numbers_the_chief_first_then_the_workers(cluster, task_type, task_id, expected):
    assert roles.id_in_cluster(cluster, task_type, task_id) == expected


def test_id_in_cluster_has_no_id_for_ps():
    with pytest.raises(ValueError, match="^There is no id for task_type 'ps'$"):
        roles.id_in_cluster(FULL, "ps", 1)


def test_collective_and_coordination_leaders_are_the_first_chief_worker_or_ps_task():
    assert roles.collective_leader({}, None, None) == ""
    assert roles.collective_leader(W2, "worker", 1) == "/job:worker/replica:0/task:0"
    assert roles.collective_leader(CW, "worker", 0) == "/job:chief/replica:0/task:0"
    assert roles.collective_leader(FULL, "evaluator", 0) == ""
    assert roles.coordination_leader({}) == ""
    assert roles.coordination_leader(FULL) == "/job:ps/replica:0/task:0"
    assert roles.coordination_leader(CW) == "/job:chief/replica:0/task:0"
    assert roles.coordination_leader(W2) == "/job:worker/replica:0/task:0"


def test_cluster_specs_normalize_from_dicts_and_count_tasks_per_job():
    spec = ClusterSpec(W2)
    assert roles.normalize_cluster_spec(spec) is spec
    assert roles.normalize_cluster_spec(W2) == spec
    with pytest.raises(ValueError, match="should be dict or a `tf.train.ClusterSpec`"):
        roles.normalize_cluster_spec([("worker", "a")])
    assert roles.task_count(FULL, "worker") == 3
    assert roles.task_count(W2, "ps") == 0


CROSS_CASES = [
    (W2, "worker", 0), (W2, "worker", 1), (W2, "worker", 2), (CW, "worker", 0),
    (CW, "chief", 0), (FULL, "evaluator", 0), (FULL, "ps", 1), (FULL, "worker", 2),
    (W2, "chief", 0), (W2, "master", 0), ({"foo": ["a"]}, None, None),
    ({"chief": ["a", "b"]}, "chief", 0), ({"evaluator": ["a", "b"]}, "evaluator", 0),
    ({"worker": {0: "a", 2: "b"}}, "worker", 2), ({"worker": {1: "a"}}, "worker", 0),
]

if os.environ.get("KERAS_BACKEND") == "tensorflow":

    def _outcome(fn, *args):
        try:
            return fn(*args)
        except ValueError as err:
            return ("ValueError", str(err))

    @pytest.mark.parametrize("cluster, task_type, task_id", CROSS_CASES)
    def test_matches_tensorflow_multi_worker_util(cluster, task_type, task_id):
        from tensorflow.python.distribute import multi_worker_util as mwu

        checks = [
            (roles.validate_cluster_spec, mwu._validate_cluster_spec,
             (cluster, task_type, task_id)),
            (roles.is_chief, mwu.is_chief, (cluster, task_type, task_id)),
            (roles.id_in_cluster, mwu.id_in_cluster, (cluster, task_type, task_id)),
            (roles.collective_leader, mwu.collective_leader, (cluster, task_type, task_id)),
            (roles.worker_count, mwu.worker_count, (cluster, task_type)),
        ]
        for ours, theirs, args in checks:
            assert _outcome(ours, *args) == _outcome(theirs, *args), ours.__name__
        if "foo" not in cluster and "evaluator" not in cluster or "ps" in cluster:
            assert roles.coordination_leader(cluster) == mwu.coordination_leader(cluster)


# --- parameter-server clusters --------------------------------------------------------------------

PS_CLUSTER = {"chief": ["c:1"], "worker": ["w0:1", "w1:1"], "ps": ["p0:1", "p1:1"]}

# ParameterServerStrategy's refusals, in TF's order and with TF's texts.
PS_ERROR_CASES = [
    ("empty", ({}, None, None), "Cluster spec must be non-empty in `tf.distribute.cluster_resolver.ClusterResolver`."),
    ("no ps", ({"chief": ["c:1"], "worker": ["w:1"]}, "chief", 0), "There must be at least one ps."),
    ("no ps, worker task", ({"worker": ["w:1"]}, "worker", 0), "There must be at least one ps."),
    ("no worker", ({"chief": ["c:1"], "ps": ["p:1"]}, "chief", 0), "There must be at least one worker."),
    ("ps id too large", (PS_CLUSTER, "ps", 2), "The `task_id` 2 exceeds the maximum id of ps."),
    ("worker id too large", (PS_CLUSTER, "worker", 2), "The `task_id` 2 exceeds the maximum id of worker."),
    ("ps not in cluster", ({"chief": ["c:1"], "worker": ["w:1"]}, "ps", 0), "`task_type` 'ps' not found in cluster_spec."),
    ("unknown role", (PS_CLUSTER, "coordinator", 0),
     f"Unrecognized task_type: coordinator, valid task types are: {ALLOWED}"),
    ("unknown job", ({**PS_CLUSTER, "param_server": ["x:1"]}, "chief", 0),
     "Disallowed task type found in cluster spec. Allowed types are "
     f"{ALLOWED} and the cluster spec is {ClusterSpec({**PS_CLUSTER, 'param_server': ['x:1']})}."),
    ("two chiefs", ({**PS_CLUSTER, "chief": ["c:1", "c:2"]}, "chief", 0), "There must be at most one 'chief' job."),
]


@pytest.mark.parametrize("name, args, message", PS_ERROR_CASES, ids=[c[0] for c in PS_ERROR_CASES])
def test_parameter_server_validation_errors_have_tf_texts(name, args, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        roles.validate_parameter_server_config(*args)


@pytest.mark.parametrize("task_type, task_id", [("chief", 0), ("worker", 1), ("ps", 0), ("ps", 1), (None, None),
                                                ("evaluator", 0)])
def test_every_role_of_a_parameter_server_cluster_passes(task_type, task_id):
    spec = roles.validate_parameter_server_config(PS_CLUSTER, task_type, task_id)
    assert spec == ClusterSpec(PS_CLUSTER)
    assert (spec.num_tasks("ps"), spec.num_tasks("worker")) == (2, 2)
    assert roles.validate_parameter_server_config({"worker": ["w:1"], "ps": ["p:1"]}, "worker", 0)  # no chief


def test_the_launcher_s_ps_layout_is_valid_for_every_role(monkeypatch):
    seen = []
    for index in range(5):
        monkeypatch.setenv("TF_CONFIG", json.dumps(tf_config_for(index, [1, 2, 3, 4, 5], chief=True, ps=2)))
        resolver = TFConfigClusterResolver()
        roles.validate_parameter_server_config(resolver.cluster_spec(), resolver.task_type, resolver.task_id)
        seen.append((resolver.task_type, resolver.task_id, roles.is_chief(resolver.cluster_spec(), resolver.task_type,
                                                                         resolver.task_id)))
    assert seen == [("chief", 0, True), ("worker", 0, False), ("worker", 1, False), ("ps", 0, False), ("ps", 1, False)]


if os.environ.get("KERAS_BACKEND") == "tensorflow":

    PS_CROSS_CASES = [args for _, args, _ in PS_ERROR_CASES] + [
        (PS_CLUSTER, "chief", 0), (PS_CLUSTER, "ps", 1), (PS_CLUSTER, "worker", 0), (PS_CLUSTER, "evaluator", 0),
        ({"worker": ["w:1"], "ps": ["p:1"]}, "worker", 0), ({**PS_CLUSTER, "evaluator": ["e:1"]}, "evaluator", 0),
    ]

    @pytest.mark.parametrize("cluster, task_type, task_id", PS_CROSS_CASES)
    def test_parameter_server_checks_match_tensorflow_s_strategy(cluster, task_type, task_id):
        import tensorflow as tf
        from tensorflow.python.distribute import parameter_server_strategy_v2 as pss

        resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec(cluster), task_type=task_type, task_id=task_id)

        def outcome(fn):
            try:
                fn()
                return "accepted"
            except ValueError as err:
                return str(err)

        # The strategy's own checks (they use only the resolver), before it connects to the cluster.
        theirs = outcome(lambda: pss.ParameterServerStrategyV2._verify_args_and_config(None, resolver))
        ours = outcome(lambda: roles.validate_parameter_server_config(cluster, task_type, task_id))
        assert ours == theirs
