"""Runs the test suite once per Keras backend and prints a per-backend summary.

Usage: python scripts/test_all_backends.py [pytest args]. Exits non-zero if
any backend fails. `KS_TEST_BACKENDS=jax,torch` limits the backends.

`KS_TEST_KERAS_MIN_PYTHON` names a Python whose Keras is the lowest supported
release (`make test` builds it from requirements-keras-min.txt): the JAX suite
then runs a fourth time, on that Python, as the run `jax-keras-min`. The other
runs use this script's Python, which has the newest supported Keras.

Most tests keep one core busy, so the backends run side by side
(`KS_TEST_JOBS` at a time, default all; `KS_TEST_JOBS=1` runs everything one
after the other). The tests that start processes (workers, the launcher,
notebook kernels; `tests/conftest.py` lists them) run apart: each backend runs
as two pytest runs (`KS_TEST_SELECT`), its other tests beside the other
backends', and its process tests in one of `KS_TEST_PROCESS_LANES` lanes
(default 2) that take the backends in turn. A thread whose side-by-side runs
are done takes process tests too (PyTorch's tests without processes end first):
they start sooner, and less is left for the end, when fewer runs share the
cores. Process tests of the lanes share
the machine; a test that bounds a time holds a lock alone (`tests/conftest.py`),
so that its bound never depends on another backend's processes. Beside other runs,
`jax-keras-min` runs only the tests that start no process (the `jax` run runs
those with the newest Keras), each test function once with its first parameters
(`KS_TEST_FIRST_VARIANTS`: the other parameters repeat the same code paths on
other replica counts and inputs, which the `jax` run covers); alone
(`KS_TEST_BACKENDS=jax-keras-min`, as in `make test-keras-min`) it runs them all.
"""

from __future__ import annotations

import os
import queue
import re
import subprocess
import sys
import tempfile
import threading
import time

BACKENDS = ("tensorflow", "jax", "torch")
KERAS_MIN_RUN = "jax-keras-min"  # the JAX suite on the lowest supported Keras
# Started longest first, so that the runs end close together.
START_ORDER = ("jax", KERAS_MIN_RUN, "tensorflow", "torch")
# Every run and every process it starts (workers, kernels) computes each op on one thread. The
# tests' models are tiny, and many processes share the cores: a pool of threads per op and per
# process only makes them wait for one another (threads that spin while they wait, on cores another
# run needs). Set any of them to use other values.
ONE_THREAD_PER_OP = {
    "OMP_NUM_THREADS": "1",  # PyTorch's intra-op threads
    "TF_NUM_INTRAOP_THREADS": "1",  # TensorFlow's; its inter-op threads stay (collectives wait in them)
    "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1",  # JAX's
}
_SUMMARY = re.compile(r"^=*\s*(no tests ran|\d+ (passed|failed|errors?|skipped|deselected))")
_COUNT = re.compile(r"(\d+) (passed|failed|errors?|skipped)")
_print_lock = threading.Lock()
# pytest's short summary lines (`-rfE`, its default): repeated at the end, so a log's tail names them.
_FAILURE_LINES = ("FAILED ", "ERROR ")
_LABELS = {"all": "all tests", "in-process": "tests without processes", "processes": "tests that start processes"}


def run_part(backend: str, select: str, pytest_args: list[str], directory: str) -> tuple[int, dict, float, list]:
    """Runs one backend's (or `jax-keras-min`'s) tests of `select`.

    Returns (exit code, counts, seconds, pytest's FAILED/ERROR lines).

    `directory` holds what the runs share: the lock of the tests that start
    processes and, for the two JAX runs, one persistent compilation cache
    (`tests/conftest.py` makes one per run otherwise). Both Kerases build
    mostly the same XLA programs, and a cached one is the program XLA would
    compile: whichever run reaches a test second loads them instead. JAX
    writes an entry in place, so a run may read one the other is still
    writing: it warns and compiles that program itself (tests that fail on
    any warning let that one pass).
    """
    python = sys.executable
    env = dict(os.environ, KERAS_BACKEND=backend.split("-")[0],
               KS_TEST_PROCESS_LOCK=os.path.join(directory, "processes.lock"))
    for name, value in ONE_THREAD_PER_OP.items():
        env.setdefault(name, value)
    if backend == KERAS_MIN_RUN:
        python = os.environ["KS_TEST_KERAS_MIN_PYTHON"]
        if select != "all":  # beside the other runs: each test function once, with its first parameters
            env["KS_TEST_FIRST_VARIANTS"] = "1"
    env["KS_TEST_SELECT"] = select
    if env["KERAS_BACKEND"] == "jax" and "JAX_COMPILATION_CACHE_DIR" not in env:
        env.update(JAX_COMPILATION_CACHE_DIR=os.path.join(directory, "jax-cache"),
                   JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    tag = f"{backend} processes" if select == "processes" else backend
    started = time.monotonic()
    with _print_lock:
        print(f"\n===== {backend} ({_LABELS[select]}): KERAS_BACKEND={env['KERAS_BACKEND']} on {python} =====",
              flush=True)
    process = subprocess.Popen(
        [python, "-m", "pytest", "-q", *pytest_args],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    last = ""
    failures = []
    for line in process.stdout:
        with _print_lock:
            print(f"[{tag}] {line}", end="", flush=True)
        if line.startswith(_FAILURE_LINES):
            failures.append(line.strip())
        if _SUMMARY.match(line):  # pytest's last line, unless a thread prints after it at exit
            last = line
    code = process.wait()
    counts = {kind.rstrip("s"): int(n) for n, kind in _COUNT.findall(last)}
    with _print_lock:
        print(f"===== {backend} ({_LABELS[select]}) done in {time.monotonic() - started:.0f}s =====", flush=True)
    return code, counts, time.monotonic() - started, failures


def _parts(backends: list[str]) -> tuple[list, list]:
    """(the runs side by side, the process lane): (backend, KS_TEST_SELECT) pairs, longest first."""
    if len(backends) == 1:
        return [(backends[0], "all")], []
    ordered = sorted(backends, key=START_ORDER.index)
    side_by_side = [(b, "in-process") for b in ordered]
    lane = [(b, "processes") for b in ordered if b != KERAS_MIN_RUN]
    return side_by_side, lane


def _combine(parts: list) -> tuple[int, dict, float, list]:
    """One backend's result from its parts; "no tests collected" (exit 5) in one part is fine."""
    codes = [code for code, _, _, _ in parts]
    counts: dict = {}
    for _, part_counts, _, _ in parts:
        for kind, n in part_counts.items():
            counts[kind] = counts.get(kind, 0) + n
    failing = [c for c in codes if c not in (0, 5)]
    code = failing[0] if failing else (5 if all(c == 5 for c in codes) else 0)
    return code, counts, sum(part[2] for part in parts), [line for part in parts for line in part[3]]


def run_all(backends: list[str], pytest_args: list[str], jobs: int, lanes: int) -> dict:
    """Runs the backends, `jobs` pytest runs at a time; returns {backend: `_combine`'s result}.

    With several backends, the process tests run in `lanes` threads of their own besides the
    `jobs` threads, which take process tests too once their own runs are done (never more
    pytest runs at once than at the start); `KS_TEST_JOBS=1` runs everything in one thread.
    """
    side_by_side, lane = _parts(backends)
    pending: queue.Queue = queue.Queue()
    for part in side_by_side + (lane if jobs == 1 else []):
        pending.put(part)
    lane_parts: queue.Queue = queue.Queue()
    for part in lane:
        lane_parts.put(part)
    results: dict = {b: [] for b in backends}
    with tempfile.TemporaryDirectory(prefix="ks-tests-") as directory:

        def run(part: tuple) -> None:
            results[part[0]].append(run_part(*part, pytest_args, directory))

        def worker(*sources: queue.Queue) -> None:
            for parts in sources:
                while True:
                    try:
                        part = parts.get_nowait()
                    except queue.Empty:
                        break
                    run(part)

        threads = [threading.Thread(target=worker, args=(pending, lane_parts) if jobs > 1 else (pending,))
                   for _ in range(max(1, min(jobs, len(side_by_side))))]
        if jobs > 1:
            threads += [threading.Thread(target=worker, args=(lane_parts,)) for _ in range(min(lanes, len(lane)))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    return {b: _combine(results[b]) for b in backends}


def main() -> int:
    keras_min_python = os.environ.get("KS_TEST_KERAS_MIN_PYTHON")
    known = [*BACKENDS, KERAS_MIN_RUN]
    wanted = os.environ.get("KS_TEST_BACKENDS")
    backends = wanted.split(",") if wanted else [*BACKENDS, *([KERAS_MIN_RUN] if keras_min_python else [])]
    unknown = [b for b in backends if b not in known]
    if unknown:
        print(f"KS_TEST_BACKENDS names unknown backend(s) {unknown}; choose from {known}.")
        return 2
    if KERAS_MIN_RUN in backends and not (keras_min_python and os.access(keras_min_python, os.X_OK)):
        print(f"The run {KERAS_MIN_RUN} needs KS_TEST_KERAS_MIN_PYTHON, the Python of a virtual environment "
              f"with the lowest supported Keras (`make test-keras-min` builds one); got {keras_min_python!r}.")
        return 2
    jobs_text = os.environ.get("KS_TEST_JOBS", str(len(backends)))
    if not jobs_text.isdigit() or int(jobs_text) < 1:
        print(f"KS_TEST_JOBS must be a positive whole number of backends run at once, got {jobs_text!r}.")
        return 2
    jobs = int(jobs_text)
    lanes_text = os.environ.get("KS_TEST_PROCESS_LANES", "2")
    if not lanes_text.isdigit() or int(lanes_text) < 1:
        print(f"KS_TEST_PROCESS_LANES must be a positive whole number of lanes, got {lanes_text!r}.")
        return 2
    started = time.monotonic()
    results = run_all(backends, sys.argv[1:], jobs, int(lanes_text))
    print("\n===== summary =====")
    total_passed = total_failed = 0
    for backend, (code, counts, seconds, failures) in results.items():
        failed = counts.get("failed", 0) + counts.get("error", 0)
        if code != 0 and failed == 0:
            failed = 1  # pytest itself failed (collection error, no tests run, ...)
        total_passed += counts.get("passed", 0)
        total_failed += failed
        status = "ok" if code == 0 else f"FAILED (exit {code})"
        print(f"{backend:>13}: {counts.get('passed', 0)} passed, {failed} failed, "
              f"{counts.get('skipped', 0)} skipped in {seconds:.0f}s of pytest runs  {status}")
        for line in failures:
            print(f"{'':>15}{line}")
    print(f"total: {total_passed} passed, {total_failed} failed in {time.monotonic() - started:.0f}s "
          f"({min(jobs, len(backends))} backend(s) at a time, process tests in {lanes_text} lane(s))")
    return 0 if all(result[0] == 0 for result in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
