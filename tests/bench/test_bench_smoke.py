"""Each benchmark script of `bench/` runs its `--smoke` mode on this run's backend and prints its table.

A smoke run takes every code path of the script with tiny sizes (its numbers
mean nothing), so a script that no longer runs against the package fails here.
No timing is checked: a benchmark is not a test.
"""

import os
import re
import subprocess
import sys

import keras
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BACKEND = keras.backend.backend()
NUMBER = re.compile(r"^\d+(\.\d+)?( \(\d+(\.\d+)?[–-]\d+(\.\d+)?\))?$")  # 1.23, or 1.23 (1.01–1.45)


def run_smoke(script: str, timeout: float = 600) -> str:
    env = {**os.environ, "KERAS_BACKEND": BACKEND, "TF_CPP_MIN_LOG_LEVEL": "3",
           "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    env.pop("KERAS_STRATEGIES_CPU_DEVICES", None)  # the scripts give each process its own devices
    run = subprocess.run([sys.executable, os.path.join(ROOT, "bench", script), "--smoke", "--backends", BACKEND],
                         env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    if run.returncode != 0:
        pytest.fail(f"{script} --smoke exited {run.returncode}\n{run.stdout[-4000:]}\n{run.stderr[-4000:]}",
                    pytrace=False)
    assert "SMOKE" in run.stdout, run.stdout
    return run.stdout


def table(output: str, header: str) -> list:
    """The rows (lists of cells) of the Markdown table whose header row starts with `header`."""
    lines = output.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(header)), None)
    assert start is not None, f"no table starting with {header!r} in:\n{output}"
    rows = []
    for line in lines[start + 2:]:  # past the header and the |---| line
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    assert rows, f"the table {header!r} has no rows:\n{output}"
    return rows


def is_number(cell: str) -> bool:
    return bool(NUMBER.match(cell))


def test_mirrored_step_time_smoke():
    output = run_smoke("mirrored_step_time.py")
    mlp, cnn = output.split("### CNN")  # each model's tables, the MLP's first
    assert mlp.lstrip().startswith("### MLP"), output
    rows = table(mlp, "| backend | devices | ours | ours ms/step |")
    devices = "2"  # the smoke run's comparison per backend: its multi-device one
    assert [row[:3] for row in rows] == [[BACKEND, devices, "ks.MirroredStrategy"],
                                         [BACKEND, devices, "ks.CentralStorageStrategy"],
                                         [BACKEND, devices, "ks.MirroredStrategy custom loop"]], rows
    assert rows[1][4] == rows[2][4] == "ks.MirroredStrategy", rows
    cnn_rows = table(cnn, "| backend | devices | ours | ours ms/step |")
    assert [row[:3] for row in cnn_rows] == [[BACKEND, devices, "ks.MirroredStrategy"]], cnn_rows
    for row in rows + cnn_rows:
        ours, baseline, ratio = row[3], row[5], row[6]
        assert is_number(ours) and is_number(baseline) and is_number(ratio), rows + cnn_rows
    # Against plain Keras on one device: measured on PyTorch (its baseline), not run for the others.
    against_plain = rows[0][8].split(",")[0]
    assert is_number(against_plain) if BACKEND == "torch" else against_plain == "—", rows
    memory = table(mlp, "| backend | devices | run | peak RSS MiB |")
    # ours, the baseline, CentralStorage, the custom loop
    assert {row[0] for row in memory} == {BACKEND} and len(memory) == 4, memory
    assert all(is_number(row[3]) and is_number(row[4].lstrip("-")) for row in memory), memory
    for part in (mlp, cnn):
        assert table(part, "| backend | devices | train_step ms |")[0][0] == BACKEND  # the breakdown ran


def test_multi_worker_step_time_smoke():
    output = run_smoke("multi_worker_step_time.py")
    steps = table(output, "| backend | ours ms/step (p10) |")
    assert [row[0] for row in steps] == [BACKEND], steps
    assert is_number(steps[0][1].split(" (")[0]) and is_number(steps[0][3].split(" (")[0]), steps
    assert is_number(steps[0][4]), steps
    reduce = table(output, "| backend | payload | ours ms |")
    assert [row[0] for row in reduce] == [BACKEND], reduce
    assert all(is_number(reduce[0][i]) for i in (2, 3, 5, 6, 7)), reduce
    assert table(output, "| backend | train_step ms |")[0][0] == BACKEND  # the breakdown ran
    if BACKEND == "torch":  # DDP without Keras, for reference
        reference = table(output, "| backend | reference without Keras |")
        assert reference[0][0] == BACKEND and all(is_number(reference[0][i].split(" (")[0]) for i in (2, 3, 4)), reference


def test_parameter_server_step_time_smoke():
    output = run_smoke("parameter_server_step_time.py")
    rows = table(output, "| backend | measurement |")
    assert [(row[0], row[1].split(",")[0]) for row in rows] == [(BACKEND, "fit"), (BACKEND, "round trip")], rows
    for row in rows:
        assert is_number(row[2]) and is_number(row[4]) and is_number(row[5]), row
    assert rows[1][6].startswith(">= 0.80"), rows[1]


def test_virtual_device_cost_smoke():
    output = run_smoke("virtual_device_cost.py")
    if BACKEND == "torch":  # no virtual devices: the script says why there is nothing to measure
        assert "torch: no virtual devices" in output and "| backend |" not in output, output
        return
    rows = table(output, "| backend | devices | gradients summed by |")
    sums = {"jax": ["psum (a tuple all-reduce)", "one buffer, one psum"],
            "tensorflow": ["ReductionToOneDevice"]}[BACKEND]
    assert [row[:3] for row in rows] == [[BACKEND, "2", how] for how in sums], rows
    for row in rows:
        assert all(is_number(cell) for cell in row[3:6]), rows
        several, one = row[6].split(", ")
        assert several == one, rows  # the same first loss: the steps compute the same thing


def test_same_process_step_time_smoke():
    output = run_smoke("same_process_step_time.py")
    rows = table(output, "| backend | model | devices | ours ms/step |")
    assert [row[:3] for row in rows] == [[BACKEND, "mlp", "2"]], rows
    row = rows[0]
    assert is_number(row[3]) and is_number(row[6]) and is_number(row[8]), rows  # ours, plain, ours / plain
    if BACKEND == "torch":  # no native peer
        assert row[4] == "none" and row[5] == row[7] == "—", rows
    else:
        assert is_number(row[5]) and is_number(row[7]), rows


def test_step_profile_smoke():
    output = run_smoke("step_profile.py")
    rows = table(output, "| backend | model | configuration |")
    native = {"jax": ["keras.distribution.DataParallel, 2 devices"],
              "tensorflow": ["tf.distribute.MirroredStrategy, 2 devices"], "torch": []}[BACKEND]
    expected = ["ks.MirroredStrategy, 2 devices"] + native + ["plain Keras, 1 device"]
    assert [row[:3] for row in rows] == [[BACKEND, "mlp", label] for label in expected], rows
    for row in rows:
        assert all(is_number(cell) for cell in row[3:8]), rows
        assert float(row[5]) > 0 and float(row[6]) > 0, rows  # the profiler saw the step's operations
    ours, plain = rows[0], rows[-1]
    assert float(plain[7]) == 0, rows  # one device: no collective, no transfer between devices
    if BACKEND == "torch":  # the replicas run as one vectorised program on one device: nothing to exchange
        assert float(ours[7]) == 0 and ours[8] == "—", rows
    else:  # two devices sum their gradients
        assert float(ours[7]) > 0, rows
        assert is_number(ours[8]) if BACKEND == "jax" else ours[8] == "—", rows


def test_sharded_memory_smoke():
    output = run_smoke("sharded_memory.py")
    rows = table(output, "| backend | devices | strategy |")
    names = ["ks.MirroredStrategy", "ShardedDataParallel, stage 1", "ShardedDataParallel, stage 2"]
    names += ["keras.distribution.ModelParallel"] if BACKEND == "jax" else []  # Keras' own sharding, JAX only
    assert [row[:3] for row in rows] == [[BACKEND, "2", name] for name in names], rows
    for row in rows[:3]:
        assert all(is_number(cell) for cell in row[3:9]), rows
    mirrored, stage1, stage2 = ([int(cell) for cell in row[3:6]] for row in rows[:3])
    assert mirrored[0] == stage1[0] == stage2[0]  # the parameters stay whole at stages 1 and 2
    assert stage1[2] < 0.6 * mirrored[2] and stage1[1] == mirrored[1]  # half the optimizer state on 2 devices
    assert stage2[1] <= 0.51 * mirrored[1] and stage2[2] == stage1[2]  # and half the summed gradients
    if BACKEND == "jax":  # parameters and optimizer state sharded by the layout map (all but one bias)
        model_parallel = rows[3]
        assert model_parallel[4] == "—" and all(is_number(cell) for cell in (*model_parallel[3:4], *model_parallel[5:6]))
        assert int(model_parallel[3]) < 0.52 * mirrored[0] and int(model_parallel[5]) < 0.52 * mirrored[2]
