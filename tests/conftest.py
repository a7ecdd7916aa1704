"""Test set-up shared by every backend run.

The backend comes from KERAS_BACKEND (set by `make test`). Every test process
gets 4 virtual CPU devices before the backend initialises, so tests can use
1 to 4 replicas through device subsets. On JAX, the run shares a persistent
compilation cache (below). `scripts/test_all_backends.py` runs the backends
side by side; their tests that start processes take turns (below).
"""

import atexit
import contextlib
import fcntl
import os
import resource
import shutil
import tempfile
import time

os.environ.setdefault("KERAS_STRATEGIES_CPU_DEVICES", "4")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# JAX: one persistent compilation cache for the run, shared with the workers, kernels and
# scripts the tests start. The tests build the same small programs again and again (new
# models, new processes), which XLA then compiles once each. Results are the same; the JAX
# training tests take about a quarter less time.
if os.environ.get("KERAS_BACKEND") == "jax" and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _jax_cache = tempfile.mkdtemp(prefix="ks-tests-jax-cache-")
    atexit.register(shutil.rmtree, _jax_cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _jax_cache
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"

import keras  # noqa: E402
import pytest  # noqa: E402

import keras_strategies  # noqa: E402,F401  (applies the device count)

BACKEND = keras.backend.backend()

# An engine's own tests (tests/backend/<name>/) run in that backend's run only.
collect_ignore_glob = [f"backend/{name}/*" for name in ("jax", "tensorflow", "torch") if name != BACKEND]


@pytest.fixture
def gpus():
    """The first two GPUs the backend sees (`["gpu:0", "gpu:1"]`); skips the test with fewer."""
    found = [d for d in keras_strategies.list_devices() if d.startswith("gpu:")]
    if len(found) < 2:
        pytest.skip(f"needs 2 GPUs visible to the {BACKEND} backend; it sees {len(found)}")
    return found[:2]


@pytest.fixture(scope="session")
def shared_ray_runtime():
    """The Ray engine on 127.0.0.1 with 3 parameter-server and 2 worker actors, once per test run.

    Every `ks.ParameterServerStrategy` of the run (JAX, PyTorch) starts over on the
    first few of these actors, and the coordinator tests use them directly.
    """
    import ray  # a pinned test requirement (requirements-dev.txt)
    from keras_strategies.backend.common.ray_parameter_server import connect, runtime

    started = not ray.is_initialized()
    runtime.ensure_ray()
    spec = {"chief": ["127.0.0.1:1"], "ps": [f"127.0.0.1:{10 + i}" for i in range(3)],
            "worker": [f"127.0.0.1:{20 + i}" for i in range(2)]}
    shared = connect(spec, "chief", 0, None)
    yield shared
    shared.shutdown()
    if started:
        ray.shutdown()


@pytest.fixture(autouse=True)
def _fresh_keras_state():
    """Each test starts from the same seed and an empty Keras session.

    `free_memory=False` skips a full `gc.collect()` (0.2 s per test).
    """
    keras.utils.clear_session(free_memory=False)
    keras.utils.set_random_seed(1337)
    yield


# Tests that start processes (workers, the launcher, notebook kernels) or time a watchdog.
# `scripts/test_all_backends.py` runs them apart from the other tests, in lanes (KS_TEST_SELECT,
# below). The runs name a shared lock file (KS_TEST_PROCESS_LOCK): a process test holds it shared,
# and a test that bounds a time (`_TIMED_TESTS`) holds it alone, so that its bound never depends
# on another backend's processes.
_PROCESS_TESTS = (
    "tests/multi_worker/test_multi_worker_",
    "tests/test_launch.py::",
    "tests/tutorials/",
    "tests/distribute/test_devices.py::test_environment_variable_and_function_in_a_fresh_process",
    "tests/test_readme.py::",
    "tests/test_guides.py::test_the_",
    "tests/console/test_quiet_tensorflow.py::test_keras_importing_tensorflow_",
    "tests/strategies/test_parameter_server.py::test_cluster_",
    "tests/strategies/test_parameter_server.py::test_ray_",
    "tests/coordinator/",
    "tests/bench/",
    "tests/keras_integration/test_plain_keras.py::",
)


# The tests on the run's one Ray runtime (`shared_ray_runtime`) run last, so that it lives (and
# loads the machine) only while they run.
_RAY_TESTS = (
    "tests/strategies/test_parameter_server.py::test_ray_",
    "tests/coordinator/",
)


_TIMED_TESTS = (
    "tests/multi_worker/test_multi_worker_recovery.py::test_a_killed_worker_",
    "tests/multi_worker/test_multi_worker_recovery.py::test_a_killed_chief_",
    "tests/multi_worker/test_multi_worker_recovery.py::test_a_hung_worker_",
    "tests/multi_worker/test_multi_worker_recovery.py::test_a_stopped_worker_",
    "tests/multi_worker/test_multi_worker_config.py::test_watchdog_",
    "tests/strategies/test_parameter_server.py::test_cluster_a_dead_parameter_server_",
    "tests/strategies/test_parameter_server.py::test_ray_a_killed_parameter_server_",
    "tests/coordinator/test_closure_queue.py::test_a_lost_parameter_server_",
    "tests/coordinator/test_closure_queue.py::test_a_worker_that_never_comes_back_",
    "tests/test_launch.py::test_timeout_",
)


def pytest_collection_modifyitems(config, items):
    """`KS_TEST_SELECT=in-process` keeps the tests that start no process, `processes` the others.

    `scripts/test_all_backends.py` runs each backend as two pytest runs: its tests that start no
    process beside the other backends', and its process tests in the lanes shared by the backends.
    """
    # Stable sorts: Ray's tests last; before the others, whole modules that hold a test that bounds
    # a time. Such a test holds the process lock alone; early, while the tests without processes
    # keep the machine busy anyway, the lanes it makes wait leave no core idle.
    timed_modules = {item.nodeid.split("::")[0] for item in items if item.nodeid.startswith(_TIMED_TESTS)}
    items.sort(key=lambda item: (item.nodeid.startswith(_RAY_TESTS), item.nodeid.split("::")[0] not in timed_modules))
    select = os.environ.get("KS_TEST_SELECT", "all")
    if select not in ("all", "in-process", "processes"):
        raise pytest.UsageError(f"KS_TEST_SELECT must be all, in-process or processes; got {select!r}.")
    if os.environ.get("KS_TEST_FIRST_VARIANTS") == "1":
        # Every test function once, with its first parameters (`make test`'s run on the lowest Keras).
        seen, firsts, variants = set(), [], []
        for item in items:
            function = item.nodeid.split("[")[0]
            (variants if function in seen else firsts).append(item)
            seen.add(function)
        config.hook.pytest_deselected(items=variants)
        items[:] = firsts
    if select == "all":
        return
    keep, drop = [], []
    for item in items:
        (keep if item.nodeid.startswith(_PROCESS_TESTS) == (select == "processes") else drop).append(item)
    config.hook.pytest_deselected(items=drop)
    items[:] = keep


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Holds the process lock for a process test (`_process_lock`); logs each test's CPU time
    where `KS_TEST_CPU_LOG` names a file (`_cpu_time_logged`)."""
    with _cpu_time_logged(item), _process_lock(item):
        yield


@contextlib.contextmanager
def _process_lock(item):
    """Holds the shared lock for a process test: shared, or alone for a test that bounds a time.

    A second file is a turnstile: a test waiting to hold the lock alone keeps new holders out
    until the current ones are done, so that it never waits for a whole lane.
    """
    lock_path = os.environ.get("KS_TEST_PROCESS_LOCK")
    if not lock_path or not item.nodeid.startswith(_PROCESS_TESTS):
        yield
        return
    mode = fcntl.LOCK_EX if item.nodeid.startswith(_TIMED_TESTS) else fcntl.LOCK_SH
    with open(lock_path + ".turnstile", "a") as turnstile, open(lock_path, "a") as lock:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(lock, mode)
        finally:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _cpu_seconds():
    return sum(usage.ru_utime + usage.ru_stime
               for usage in (resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)))


@contextlib.contextmanager
def _cpu_time_logged(item):
    """Appends `cpu seconds, wall seconds, run, test` to the file `KS_TEST_CPU_LOG` names: the CPU
    time of the test's set-up, call and tear-down, its processes' included (once they have ended).
    On a shared machine wall times say little; these show what makes the suite long."""
    path = os.environ.get("KS_TEST_CPU_LOG")
    if not path:
        yield
        return
    cpu, wall = _cpu_seconds(), time.monotonic()
    try:
        yield
    finally:
        first = "-first" if os.environ.get("KS_TEST_FIRST_VARIANTS") else ""
        run = f"{BACKEND}-{os.environ.get('KS_TEST_SELECT', 'all')}{first}"
        with open(path, "a") as log:
            log.write(f"{_cpu_seconds() - cpu:.2f}\t{time.monotonic() - wall:.2f}\t{run}\t{item.nodeid}\n")
