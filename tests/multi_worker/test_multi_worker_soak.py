"""Soak: one launch under `--max-restarts` loses a random worker at a random step several times,
and ends with the weights of an uninterrupted run, in bounded time, with no process left behind.

Each run draws a new kill plan (its seed is in the failure message; `KS_SOAK_SEED` repeats
it). What it tests is the launcher's and `BackupAndRestore`'s, the same code on every backend,
so `make test` runs it on the backends of `KS_SOAK_BACKENDS` (default: PyTorch, the quickest
to start); `make soak` runs it several times on every backend.
"""

import json
import os
import random
import sys
import time

import numpy as np
import pytest

from mw_launch import PROGRAMS, check, run_program
from test_launch import _running  # noqa: E402  (tests/ is on the path: its conftest)

sys.path.insert(0, PROGRAMS)
from common import GLOBAL_BATCH, N, build_model, data  # noqa: E402

pytestmark = pytest.mark.skipif(
    os.environ.get("KERAS_BACKEND") not in os.environ.get("KS_SOAK_BACKENDS", "torch").split(","),
    reason="the soak runs on the backends of KS_SOAK_BACKENDS (make test: torch; make soak: every backend)",
)

KILLS = 3
EPOCHS = 4  # programs/soak.py
STEPS = -(-N // GLOBAL_BATCH)
BOUND_SECONDS = 600


def _kill_plan(seed):
    """`{attempt: [worker, epoch, batch]}`: one kill per attempt, in later epochs each time
    (each attempt resumes at the start of the epoch its predecessor died in)."""
    rng = random.Random(seed)
    epochs = sorted(rng.sample(range(EPOCHS), KILLS))
    return {str(a): [rng.randrange(2), epoch, rng.randrange(STEPS)] for a, epoch in enumerate(epochs)}


def test_random_kills_under_max_restarts_lose_nothing_and_leave_no_process(tmp_path):
    seed = int(os.environ.get("KS_SOAK_SEED", time.time_ns() % 10_000))
    _soak(tmp_path, _kill_plan(seed), f"seed {seed}")


def test_a_worker_lost_right_after_an_epochs_last_step_leaves_a_whole_backup(tmp_path):
    # The chief may be saving the epoch's backup when the launcher stops it: the backup must be
    # the previous one or the new one, never the new weights beside the previous epoch number.
    _soak(tmp_path, {"0": [1, 1, STEPS - 1]}, "kill after the last step of epoch 2")


def test_the_chief_lost_right_after_the_first_epochs_last_step_leaves_workers_that_agree(tmp_path):
    # The other worker still ends the epoch and backs up what the chief never saved. At the
    # restart it restores that backup and the chief has none: the workers must still agree on
    # their variables, and all resume from the chief's state (the beginning).
    _soak(tmp_path, {"0": [0, 0, STEPS - 1]}, "kill the chief after the last step of epoch 1")


def _soak(tmp_path, plan, what):
    kills = len(plan)
    started = time.monotonic()
    run = run_program("soak.py", [tmp_path, json.dumps(plan)], workers=2, devices_per_worker=1,
                      timeout=BOUND_SECONDS, max_restarts=kills)
    seconds = time.monotonic() - started
    context = f"{what}, plan {plan}"
    check(run)
    assert seconds < BOUND_SECONDS, context
    assert run.stdout.count("KILLING") == kills, (context, run.stdout)
    assert run.stderr.count("restarting all 2 processes") == kills, (context, run.stderr[-3000:])

    x, y = data()
    reference = build_model()
    initial = np.load(tmp_path / "initial.npz")
    reference.set_weights([initial[f"arr_{i}"] for i in range(len(initial.files))])
    reference.fit(x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    for task in (0, 1):
        final = np.load(tmp_path / f"worker_{task}.npz")
        for i, expected in enumerate(reference.get_weights()):
            np.testing.assert_allclose(final[f"arr_{i}"], expected, rtol=1e-5, atol=1e-5, err_msg=context)

    pids = [int(path.read_text()) for path in tmp_path.glob("pid_*")]
    assert len(pids) == 2 * (kills + 1), context
    assert not [pid for pid in pids if _running(pid)], f"processes left running ({context})"
