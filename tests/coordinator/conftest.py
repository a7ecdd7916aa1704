"""One Ray runtime on 127.0.0.1 for every coordinator test of the run (helpers in ray_cluster.py)."""

import pytest

from ray_cluster import SHARED


@pytest.fixture(scope="session")
def ray_runtime(shared_ray_runtime):
    """The run's Ray runtime (tests/conftest.py): 3 parameter-server and 2 worker actors.

    `cluster()` starts each test over on the first few of them; the third
    parameter server is the one a test may kill.
    """
    SHARED.append(shared_ray_runtime)
    yield shared_ray_runtime
    SHARED.remove(shared_ray_runtime)
