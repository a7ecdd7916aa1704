"""One Ray runtime on 127.0.0.1 for every coordinator test of the run (helpers in ray_cluster.py).

The closure queue and its Ray workers are the parameter-server engine of JAX and
PyTorch; TensorFlow's runs on TensorFlow's own coordinator (tested in
tests/strategies/test_parameter_server.py), so these tests run on those two.
"""

import keras
import pytest

from ray_cluster import SHARED


def pytest_collection_modifyitems(config, items):
    """On TensorFlow these tests do not apply (its parameter-server training uses TensorFlow's own
    coordinator): they are deselected, not skipped."""
    if keras.backend.backend() != "tensorflow":
        return
    deselected = [item for item in items if "tests/coordinator/" in item.nodeid]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if "tests/coordinator/" not in item.nodeid]


@pytest.fixture(scope="session")
def ray_runtime(shared_ray_runtime):
    """The run's Ray runtime (tests/conftest.py): 3 parameter-server and 2 worker actors.

    `cluster()` starts each test over on the first few of them; the third
    parameter server is the one a test may kill.
    """
    SHARED.append(shared_ray_runtime)
    yield shared_ray_runtime
    SHARED.remove(shared_ray_runtime)
