"""SIGTERM to one worker mid-training: every worker saves at the same step and exits with code 42,
the launcher restarts them, and both a custom loop (`ks.experimental.PreemptionCheckpointHandler`)
and `fit` (`BackupAndRestore(save_before_preemption=True)`) resume where they stopped, equal to an
uninterrupted run. Real processes on 127.0.0.1 (`programs/preempt.py`)."""

import os
import re
import sys

import keras
import numpy as np
import pytest

import keras_strategies as ks
from mw_launch import PROGRAMS, check, run_program

sys.path.insert(0, PROGRAMS)
from common import GLOBAL_BATCH, PREEMPTION_STEPS, build_model, data, loop_step  # noqa: E402


@pytest.fixture(scope="module")
def preempted(tmp_path_factory):
    out = tmp_path_factory.mktemp("preempt")
    # Two preemptions; one more restart would let an attempt that fails to start (a port taken by
    # another process between the launcher's pick and the worker's bind) not fail the test.
    run = run_program("preempt.py", [out], workers=2, devices_per_worker=1, timeout=480, max_restarts=3)
    return out, check(run)


def _weights(path):
    archive = np.load(path)
    return [archive[f"arr_{i}"] for i in range(len(archive.files))]


def _assert_same(actual, expected):
    for a, e in zip(actual, expected):
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-5)


def _starts(stdout, task):
    """The step each attempt of worker `task` started its loop at, an attempt that failed to start
    and was run again counted once."""
    starts = re.findall(rf"\[worker {task}\] attempt \d+: the loop starts at step (\d+)", stdout)
    return [step for i, step in enumerate(starts) if i == 0 or step != starts[i - 1]]


def test_every_worker_saves_exits_42_and_the_launcher_restarts_them(preempted):
    _, run = preempted
    checks = {
        "worker 1 got SIGTERM twice": run.stdout.count("SIGTERM to worker 1") == 2,
        "two attempts ended with the preemption exit code":
            run.stderr.count("exited with code 42 (saved its state after a preemption notice)") == 2,
        # The loop: noticed after step 5, saved after step 6; the finished loop is skipped in the last attempt.
        "every worker's loop resumed at step 6, then skipped": all(
            _starts(run.stdout, task)[-2:] == ["6", str(PREEMPTION_STEPS)] for task in (0, 1)),
        # fit: stopped in epoch 2, resumed inside it: 2 epochs logged in the last attempt.
        "fit resumed inside epoch 2":
            re.findall(r"\[worker 0\] attempt \d+: fit trained (\d) epoch", run.stdout) == ["2"],
        "both workers finished": run.stdout.count("DONE") == 2,
    }
    failed = [what for what, held in checks.items() if not held]
    if failed:
        pytest.fail(f"not so: {failed}\n{run!r}", pytrace=False)  # the whole output, not cut short


def test_the_custom_loop_resumes_at_the_saved_step_equal_to_an_uninterrupted_loop(preempted):
    out, _ = preempted
    model = build_model()
    model.set_weights(_weights(out / "loop_initial.npz"))
    optimizer = keras.optimizers.SGD(0.05)
    step = loop_step(ks.get_strategy(), model, optimizer, ks)
    for k in range(PREEMPTION_STEPS):
        step(k)
    _assert_same(_weights(out / "loop_final.npz"), model.get_weights())


def test_fit_resumes_inside_the_preempted_epoch_equal_to_an_uninterrupted_fit(preempted):
    out, _ = preempted
    x, y = data()
    model = build_model()
    model.set_weights(_weights(out / "fit_initial.npz"))
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=3, shuffle=False, verbose=0)
    for task in (0, 1):
        _assert_same(_weights(out / f"fit_final_{task}.npz"), model.get_weights())
