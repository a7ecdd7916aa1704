"""`SlurmClusterResolver` reads a SLURM step as TensorFlow's resolver does (its test cases)."""

import pytest

from keras_strategies.cluster_resolver import SlurmClusterResolver
from keras_strategies.cluster_resolver.slurm import expand_hostlist, expand_tasks_per_node


def _step(monkeypatch, procid, num_tasks, nodelist, tasks_per_node, **extra):
    for name in ("CUDA_VISIBLE_DEVICES", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    env = {"SLURM_PROCID": procid, "SLURM_STEP_NUM_TASKS": num_tasks, "SLURM_STEP_NODELIST": nodelist,
           "SLURM_STEP_TASKS_PER_NODE": tasks_per_node, **extra}
    for name, value in env.items():
        monkeypatch.setenv(name, str(value))


@pytest.mark.parametrize("hostlist, hosts", [
    ("n1", ["n1"]),
    ("n1,n2", ["n1", "n2"]),
    ("n[1-2],m5,o[3-4,6,7-9]", ["n1", "n2", "m5", "o3", "o4", "o6", "o7", "o8", "o9"]),
    ("node[08-11]", ["node08", "node09", "node10", "node11"]),
    ("127.0.0.1", ["127.0.0.1"]),
])
def test_host_lists_expand_in_order(hostlist, hosts):
    assert expand_hostlist(hostlist) == hosts


def test_tasks_per_node_expand_in_order():
    assert expand_tasks_per_node("3(x2),2,1") == [3, 3, 2, 1]
    assert expand_tasks_per_node("2") == [2]
    with pytest.raises(ValueError, match="tasks-per-node"):
        expand_tasks_per_node("2(x)")
    with pytest.raises(ValueError, match="hostlist"):
        expand_hostlist("n[1-")


def test_a_step_of_four_tasks_on_two_nodes_is_four_workers(monkeypatch):
    _step(monkeypatch, 3, 4, "t02n[13,41]", "2(x2)", CUDA_VISIBLE_DEVICES="0,1")
    resolver = SlurmClusterResolver()
    assert resolver.cluster_spec().as_dict() == {
        "worker": ["t02n13:8888", "t02n13:8889", "t02n41:8888", "t02n41:8889"]}
    assert (resolver.task_type, resolver.task_id) == ("worker", 3)
    assert resolver.master() == "grpc://t02n41:8889"
    assert resolver.num_accelerators() == {"GPU": 1}
    import os
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "1"  # the second task of its node: the second GPU


def test_jobs_split_the_tasks_in_sorted_job_order(monkeypatch):
    _step(monkeypatch, 1, 3, "n[1-3]", "1(x3)", CUDA_VISIBLE_DEVICES="")
    resolver = SlurmClusterResolver(jobs={"worker": 2, "ps": 1}, port_base=9000)
    assert resolver.cluster_spec().as_dict() == {"ps": ["n1:9000"], "worker": ["n2:9000", "n3:9000"]}
    assert (resolver.task_type, resolver.task_id) == ("worker", 0)


def test_without_gpus_no_gpu_is_assigned_and_master_port_sets_the_ports(monkeypatch):
    _step(monkeypatch, 0, 2, "127.0.0.1", "2", MASTER_PORT=23456, PATH="/nonexistent")
    resolver = SlurmClusterResolver()
    assert resolver.cluster_spec().as_dict() == {"worker": ["127.0.0.1:23456", "127.0.0.1:23457"]}
    assert resolver.num_accelerators() == {"GPU": 0}
    import os
    assert "CUDA_VISIBLE_DEVICES" not in os.environ


def test_errors_are_tensorflows(monkeypatch):
    _step(monkeypatch, 0, 2, "n1", "2", CUDA_VISIBLE_DEVICES="0")
    with pytest.raises(RuntimeError, match="Requested more GPUs per node than available"):
        SlurmClusterResolver(gpus_per_task=1)
    with pytest.raises(RuntimeError, match="Requested 3 tasks but only 2 were assigned"):
        SlurmClusterResolver(jobs={"worker": 3})
    monkeypatch.delenv("SLURM_PROCID")
    with pytest.raises(RuntimeError, match="SLURM_PROCID not found in environment. Not running inside a SLURM step"):
        SlurmClusterResolver()
