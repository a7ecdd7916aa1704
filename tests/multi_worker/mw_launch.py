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


def run_program(name, args=(), workers=2, devices_per_worker=1, timeout=240, env=None, max_restarts=0):
    out, err = io.StringIO(), io.StringIO()
    started = time.monotonic()
    code = launch(
        os.path.join(PROGRAMS, name), [str(a) for a in args], workers=workers,
        devices_per_worker=devices_per_worker, backend=keras.backend.backend(), timeout=timeout,
        env={"TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})}, stdout=out, stderr=err, max_restarts=max_restarts,
    )
    return Run(code, out.getvalue(), err.getvalue(), time.monotonic() - started)


# The programs whose tests share one start of the workers, per number of devices per worker: the
# first keeps a fresh process, the others join its cluster (`programs/several.py`). Starting two
# workers costs about 17 s of CPU time before they compute anything; the tutorial, the recovery
# runs and the checks of a fresh process keep starts of their own.
TOGETHER = {
    1: (("train.py",), ("collectives.py",), ("keras_hub_fit.py",), ("sharded.py",)),
    2: (("train.py",), ("collectives.py", "wide-only"), ("sharded_input.py",), ("sharded.py",))
    # On JAX, TPUStrategy over the hosts of a slice (`programs/tpu_hosts.py`): TensorFlow's TPU
    # runtime drives a slice's hosts itself, and PyTorch has no TPU runtime.
    + ((("tpu_hosts.py",),) if keras.backend.backend() == "jax" else ()),
}
_together: dict = {}


def run_together(program, devices_per_worker, tmp_path_factory):
    """The output directory of `program` (a `TOGETHER` entry: name and arguments) after its
    workers ran it with the other programs of its entry, once per test run; fails the test
    with the workers' output unless every worker exited 0."""
    if devices_per_worker not in _together:
        entries = TOGETHER[devices_per_worker]
        outs, args = {}, []
        for entry in entries:
            out = tmp_path_factory.mktemp("_".join(part.replace(".py", "") for part in entry) + f"_2x{devices_per_worker}")
            outs[entry] = out
            args += [*(["--"] if args else []), entry[0], out, *entry[1:]]
        run = run_program("several.py", args, workers=2, devices_per_worker=devices_per_worker,
                          timeout=240 * len(entries))
        _together[devices_per_worker] = run, outs
    run, outs = _together[devices_per_worker]
    check(run)
    return outs[program]


_results: dict = {}


def worker_results(program, devices_per_worker, tmp_path_factory, results_file):
    """`(out, devices_per_worker, [worker 0's npz, worker 1's npz])` of `program` run together
    (`run_together`), where each worker saved `results_file` (with `{worker}` for its index); loaded
    once per test run."""
    import numpy as np

    key = (program, devices_per_worker)
    if key not in _results:
        out = run_together(program, devices_per_worker, tmp_path_factory)
        _results[key] = out, devices_per_worker, [np.load(out / results_file.format(worker=i)) for i in range(2)]
    return _results[key]


def check(run):
    """Fails the test with the workers' output unless every worker exited 0."""
    import pytest

    if run.code != 0:
        pytest.fail(repr(run), pytrace=False)
    return run
