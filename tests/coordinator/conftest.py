"""One Ray runtime on 127.0.0.1 for every coordinator test of the run (helpers in ray_cluster.py)."""

import pytest

ray = pytest.importorskip("ray", reason="the coordinator's Ray engine needs `pip install ray`")

from ray_cluster import SHARED  # noqa: E402


@pytest.fixture(scope="session")
def ray_runtime():
    """Ray on 127.0.0.1 with 3 parameter-server and 2 worker actors, shared by every test of the run.

    `cluster()` starts each test over on the first few of them; the third
    parameter server is the one a test may kill.
    """
    from keras_strategies.backend.common.ray_parameter_server import connect, runtime

    started = not ray.is_initialized()
    runtime.ensure_ray()
    spec = {"chief": ["127.0.0.1:1"], "ps": [f"127.0.0.1:{10 + i}" for i in range(3)],
            "worker": [f"127.0.0.1:{20 + i}" for i in range(2)]}
    shared = connect(spec, "chief", 0, None)
    SHARED.append(shared)
    yield shared
    SHARED.remove(shared)
    shared.shutdown()
    if started:
        ray.shutdown()
