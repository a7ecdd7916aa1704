"""Runs a program under `keras_strategies.launch` on 127.0.0.1 with the current backend."""

import io
import os
import time

import keras

from keras_strategies.launcher.supervisor import launch

PROGRAMS = os.path.join(os.path.dirname(__file__), "programs")


class Run:
    def __init__(self, code, stdout, stderr, seconds):
        self.code, self.stdout, self.stderr, self.seconds = code, stdout, stderr, seconds

    def __repr__(self):
        return f"exit code {self.code} after {self.seconds:.0f} s\n--- stdout\n{self.stdout}\n--- stderr\n{self.stderr[-6000:]}"


def run_program(name, args=(), workers=2, devices_per_worker=1, timeout=240, env=None):
    out, err = io.StringIO(), io.StringIO()
    started = time.monotonic()
    code = launch(
        os.path.join(PROGRAMS, name), [str(a) for a in args], workers=workers,
        devices_per_worker=devices_per_worker, backend=keras.backend.backend(), timeout=timeout,
        env={"TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})}, stdout=out, stderr=err,
    )
    return Run(code, out.getvalue(), err.getvalue(), time.monotonic() - started)


def check(run):
    """Fails the test with the workers' output unless every worker exited 0."""
    import pytest

    if run.code != 0:
        pytest.fail(repr(run), pytrace=False)
    return run
