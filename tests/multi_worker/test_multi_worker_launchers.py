"""One script, `ks.MultiWorkerMirroredStrategy()` and nothing else, trains as one cluster when
torchrun, a SLURM step or our launcher on two "nodes" starts it, equal to one process."""

import json
import os
import socket
import subprocess
import sys

import keras
import pytest

PROGRAM = os.path.join(os.path.dirname(__file__), "programs", "from_environment.py")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLEARED = ("TF_CONFIG", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
           "KERAS_STRATEGIES_CPU_DEVICES", "CUDA_VISIBLE_DEVICES")


def _ports_free(base, count):
    for port in range(base, base + count):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                return False
    return True


def _port_base(count=3):
    """A port whose `count` successors are free on 127.0.0.1 (the master's and each worker's)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base + count < 65536 and _ports_free(base, count):
            return base
    raise RuntimeError("no free run of ports on 127.0.0.1")


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in CLEARED and not k.startswith("SLURM_")}
    env.update(KERAS_BACKEND=keras.backend.backend(), TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p), **extra)
    return {k: str(v) for k, v in env.items()}


def _results(out, resolver):
    results = {}
    for task_id in (0, 1):
        with open(out / f"worker_{task_id}.json") as file:
            results[task_id] = json.load(file)
    for task_id, result in results.items():
        assert result["resolver"] == resolver and result["task"] == ["worker", task_id], results
        assert result["num_replicas"] == 2 and result["is_chief"] == (task_id == 0), results
    assert results[0]["max_difference"] < 1e-5, results
    return results


def _check(runs):
    outputs = []
    for run in runs:
        try:
            stdout, stderr = run.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            for other in runs:
                other.kill()
            pytest.fail("the workers did not finish within 300 s")
        outputs.append(f"exit {run.returncode}\n{stdout[-3000:]}\n{stderr[-6000:]}")
    assert all(run.returncode == 0 for run in runs), "\n---\n".join(outputs)


def test_torchrun_starts_one_cluster_of_two_workers(tmp_path):
    port = _port_base()
    run = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
         "--master-port", str(port), PROGRAM, str(tmp_path)],
        env=_env(OMP_NUM_THREADS=1), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
    )
    _check([run])
    _results(tmp_path, "TorchrunClusterResolver")


def test_a_slurm_step_of_two_tasks_is_one_cluster_of_two_workers(tmp_path):
    port = _port_base()
    slurm = dict(SLURM_JOB_ID=4242, SLURM_STEP_NUM_TASKS=2, SLURM_STEP_NODELIST="127.0.0.1",
                 SLURM_STEP_TASKS_PER_NODE=2, SLURM_NTASKS=2, MASTER_PORT=port)
    runs = [subprocess.Popen([sys.executable, PROGRAM, str(tmp_path)], env=_env(SLURM_PROCID=rank, **slurm),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
            for rank in (0, 1)]
    _check(runs)
    _results(tmp_path, "SlurmClusterResolver")


def test_two_launchers_as_two_nodes_make_one_cluster_through_the_master(tmp_path):
    port = _port_base()
    runs = [subprocess.Popen(
        [sys.executable, "-m", "keras_strategies.launch", "--nnodes", "2", "--node-rank", str(node),
         "--master-addr", f"127.0.0.1:{port}", "--workers-per-node", "1", "--timeout", "280",
         PROGRAM, str(tmp_path)],
        env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT) for node in (0, 1)]
    _check(runs)
    _results(tmp_path, "TorchrunClusterResolver")
