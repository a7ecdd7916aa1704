"""`SlurmClusterResolver`: the cluster of a SLURM job step, as TensorFlow's resolver reads it.

A port of `tf.distribute.cluster_resolver.SlurmClusterResolver` (TensorFlow's
`slurm_cluster_resolver.py`): the same variables, host-list syntax, port and
GPU rules, and errors. Two differences, both where TensorFlow fails: a node
without NVIDIA GPUs (no `nvidia-smi`) counts 0 GPUs instead of raising, and
`port_base=None` takes `MASTER_PORT` when the job script sets it (as job
scripts for PyTorch do), else TensorFlow's 8888.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from typing import Any

from keras_strategies.cluster_resolver.cluster_spec import ClusterSpec
from keras_strategies.cluster_resolver.resolvers import ClusterResolver, task_master

DEFAULT_PORT_BASE = 8888  # TensorFlow's


def expand_hostlist(hostlist: str) -> list[str]:
    """SLURM's compressed host list in order: `"n[1-2],m5,o[08-09]"` -> `n1 n2 m5 o08 o09`."""
    parts, current, depth = [], "", False
    for char in hostlist:
        if char == "," and not depth:
            parts.append(current)
            current = ""
            continue
        depth = (depth or char == "[") and char != "]"
        current += char
    parts.append(current)
    hosts = []
    for part in parts:
        match = re.fullmatch(r"([^,\[\]]*)(?:\[([^\]]+)\])?", part)
        if not part or match is None:
            raise ValueError(f'Invalid hostlist format "{hostlist}": bad part {part!r}')
        prefix, ranges = match.group(1), match.group(2)
        if ranges is None:
            hosts.append(prefix)
            continue
        for item in ranges.split(","):
            bounds = item.split("-")
            if len(bounds) not in (1, 2) or not all(b.isdigit() for b in bounds):
                raise ValueError(f'Invalid hostlist format "{hostlist}": bad range {item!r}')
            width = len(bounds[0])
            hosts.extend(prefix + str(i).zfill(width) for i in range(int(bounds[0]), int(bounds[-1]) + 1))
    return hosts


def expand_tasks_per_node(tasks_per_node: str) -> list[int]:
    """SLURM's tasks-per-node list in node order: `"3(x2),2,1"` -> `[3, 3, 2, 1]`."""
    counts = []
    for part in tasks_per_node.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part)
        if match is None:
            raise ValueError(f'Invalid tasks-per-node list format "{tasks_per_node}": bad part {part!r}')
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def slurm_var(name: str) -> str:
    """`SLURM_<name>`, or TensorFlow's error when the process is not in a SLURM step."""
    try:
        return os.environ["SLURM_" + name]
    except KeyError:
        raise RuntimeError(f"SLURM_{name} not found in environment. Not running inside a SLURM step?") from None


def num_gpus() -> int:
    """GPUs of this node: `CUDA_VISIBLE_DEVICES`, else `nvidia-smi --list-gpus`, else 0."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip()])
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        output = subprocess.check_output(["nvidia-smi", "--list-gpus"], encoding="utf-8")
    except subprocess.CalledProcessError as err:
        raise RuntimeError(f"Could not get number of GPUs from nvidia-smi. Maybe it is missing?\nOutput: {err.output}")
    return sum(line.startswith("GPU ") for line in output.strip().split("\n"))


class SlurmClusterResolver(ClusterResolver):
    """Reads the cluster from the SLURM job step this process runs in (`srun`).

    As `tf.distribute.cluster_resolver.SlurmClusterResolver`. It reads
    `SLURM_PROCID` (this task's rank), `SLURM_STEP_NUM_TASKS`,
    `SLURM_STEP_NODELIST` and `SLURM_STEP_TASKS_PER_NODE`, places the tasks on
    the step's nodes (sorted by host name) with ports `port_base`,
    `port_base + 1`, ... per node, and gives each task its own GPUs through
    `CUDA_VISIBLE_DEVICES` (when `cluster_spec()` is first called, so create
    the strategy before any backend operation). `ks.MultiWorkerMirroredStrategy()`
    uses it by itself when a SLURM step of more than one task starts the script
    and `TF_CONFIG` is not set.

    Args:
        jobs: Job names and their task counts, e.g. `{"worker": 4}`; by
            default every task of the step is a `worker`.
        port_base: The first port on each node; `None` takes `MASTER_PORT`
            when set, else 8888 (TensorFlow's default).
        gpus_per_node: GPUs of each node; by default counted on this node
            (`CUDA_VISIBLE_DEVICES`, else `nvidia-smi`; 0 without either).
        gpus_per_task: GPUs of each task; by default the node's GPUs shared
            evenly between its tasks.
        tasks_per_node: Tasks of each node: a number, a dict of host names to
            numbers, or `None` to read the SLURM step.
        auto_set_gpu: Set `CUDA_VISIBLE_DEVICES` to this task's GPUs.
        rpc_layer: The protocol between tasks (`"grpc"`).

    Examples:
        ```python
        # srun --nodes 2 --ntasks-per-node 2 python train.py
        strategy = ks.MultiWorkerMirroredStrategy()  # 4 workers, found through SLURM
        # or explicitly:
        resolver = ks.cluster_resolver.SlurmClusterResolver(port_base=15000)
        strategy = ks.MultiWorkerMirroredStrategy(cluster_resolver=resolver)
        ```
    """

    def __init__(self, jobs: dict[str, int] | None = None, port_base: int | None = None,
                 gpus_per_node: int | None = None, gpus_per_task: int | None = None,
                 tasks_per_node: int | dict[str, int] | None = None, auto_set_gpu: bool = True,
                 rpc_layer: str | None = "grpc"):
        self._rank = int(slurm_var("PROCID"))
        if jobs is None:
            jobs = {"worker": int(slurm_var("STEP_NUM_TASKS"))}
        self._jobs = dict(jobs)
        if port_base is None:
            port_base = int(os.environ.get("MASTER_PORT", DEFAULT_PORT_BASE))
        self._port_base = int(port_base)
        if tasks_per_node is None:
            hosts = expand_hostlist(slurm_var("STEP_NODELIST"))
            self._task_configuration = dict(zip(hosts, expand_tasks_per_node(slurm_var("STEP_TASKS_PER_NODE"))))
        elif isinstance(tasks_per_node, dict):
            self._task_configuration = dict(tasks_per_node)
        else:
            hosts = expand_hostlist(slurm_var("STEP_NODELIST"))
            self._task_configuration = {host: int(tasks_per_node) for host in hosts}
        max_tasks_per_node = max(self._task_configuration.values())
        num_tasks = sum(self._task_configuration.values())
        if gpus_per_node is None:
            gpus_per_node = num_gpus()
        if gpus_per_task is None:
            gpus_per_task = gpus_per_node // max_tasks_per_node
        self._gpus_per_node, self._gpus_per_task = int(gpus_per_node), int(gpus_per_task)
        self._auto_set_gpu = auto_set_gpu
        self.task_type = None
        self.task_id = None
        self.rpc_layer = rpc_layer
        self._gpu_allocation: list[str] = []
        if max_tasks_per_node * self._gpus_per_task > self._gpus_per_node:
            raise RuntimeError("Requested more GPUs per node than available.")
        if sum(self._jobs.values()) != num_tasks:
            raise RuntimeError(f"Requested {sum(self._jobs.values())} tasks but only {num_tasks} were assigned.")
        self.cluster_spec()  # sets task_type and task_id, as TensorFlow's does on first use

    def cluster_spec(self) -> ClusterSpec:
        """The step's tasks by job, in rank order; sets this task's type, id and GPUs."""
        addresses, self._gpu_allocation = [], []
        for host, count in sorted(self._task_configuration.items()):
            for offset in range(count):
                addresses.append(f"{host}:{self._port_base + offset}")
                first = offset * self._gpus_per_task
                self._gpu_allocation.append(",".join(str(g) for g in range(first, first + self._gpus_per_task)))
        cluster, start = {}, 0
        for job, count in sorted(self._jobs.items()):
            cluster[job] = addresses[start:start + count]
            if start <= self._rank < start + count:
                self.task_type, self.task_id = job, self._rank - start
            start += count
        if self._auto_set_gpu and self._gpus_per_task:
            os.environ["CUDA_VISIBLE_DEVICES"] = self._gpu_allocation[self._rank]
        return ClusterSpec(cluster)

    def get_task_info(self) -> tuple[str | None, int | None]:
        """(task type, task id) of this process."""
        return self.task_type, self.task_id

    def master(self, task_type: str | None = None, task_id: int | None = None, rpc_layer: str | None = None) -> str:
        """`grpc://host:port` of a task (this one by default), or `""` before the task is known."""
        return task_master(self, task_type, task_id, rpc_layer)

    def num_accelerators(self, task_type: str | None = None, task_id: int | None = None,
                         config_proto: Any = None) -> dict[str, int]:
        """`{"GPU": gpus_per_task}`."""
        del task_type, task_id, config_proto
        return {"GPU": self._gpus_per_task}
