"""The chief's JAX coordination service, in a small process of its own.

`jax.distributed` runs the cluster's coordination service (its key-value store,
which also carries our heartbeats, and its error propagation) inside process 0.
When that process is killed, every other worker's JAX client aborts within a
fraction of a second with a C++ check failure ("Terminating process because the
JAX distributed service detected fatal errors"), before anything can name the
chief. Started by the chief as a process of its own, the service outlives a
killed chief for `LINGER_SECONDS`, long enough for the other workers'
heartbeats to report a `LostWorkerError` naming it. A normal shutdown of the
chief stops it at once; it is in the chief's process group, so a launcher
that stops the chief's group stops it too.

Run as a script (`python coordination_service.py ADDRESS NODES HEARTBEAT SHUTDOWN`),
it imports only `jaxlib`'s extension (about 0.1 s), not Keras.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from typing import Iterator, Optional

# After the chief is gone: its heartbeats are missed after 10 s (`multi_worker/health.py`), and
# a worker blocked in a collective gets 3 s more to raise before it is ended.
LINGER_SECONDS = 30.0
_READY = b"ready"


class ServiceProcess:
    """What `jax.distributed` keeps as its service: started in a child process; `shutdown()` stops it."""

    def __init__(self, address: str, num_nodes: int, heartbeat_timeout: Optional[int] = None,
                 cluster_register_timeout: Optional[int] = None, shutdown_timeout: Optional[int] = None,
                 recoverable: Optional[bool] = None) -> None:
        del cluster_register_timeout, recoverable  # JAX's defaults, as in the chief
        # Its log goes to a file of its own: inherited, the chief's stderr would stay open while it
        # lingers after the chief, and whoever reads the chief's output would wait for it.
        self._log = tempfile.TemporaryFile()
        self._process = subprocess.Popen(
            # -I: the script's folder (this engine's modules) stays off the module path.
            [sys.executable, "-I", os.path.abspath(__file__), address, str(num_nodes),
             str(heartbeat_timeout or 0), str(shutdown_timeout or 0)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
        )
        line = self._process.stdout.readline().strip()
        if line != _READY:
            code = self._process.wait()
            self._log.seek(0)
            log = self._log.read().decode("utf-8", "replace").strip()[-3000:]
            raise RuntimeError(
                f"The JAX coordination service could not start on {address} (its process exited with "
                f"code {code}): {log or 'no output'}. Check that the chief's port in TF_CONFIG is free on "
                "this machine."
            )

    def shutdown(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self._process.stdin.write(b"shutdown\n")
            self._process.stdin.close()
        try:
            self._process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


@contextlib.contextmanager
def in_own_process(distributed_module: object, is_chief: bool) -> Iterator[None]:
    """While `jax.distributed.initialize` runs in it, the chief starts the service as a `ServiceProcess`."""
    if not is_chief:
        yield
        return
    real = distributed_module._jax

    class _Extension:
        def __getattr__(self, name: str) -> object:
            return getattr(real, name)

        get_distributed_runtime_service = ServiceProcess

    distributed_module._jax = _Extension()
    try:
        yield
    finally:
        distributed_module._jax = real


def _serve(address: str, num_nodes: int, heartbeat_timeout: int, shutdown_timeout: int) -> None:
    from jaxlib import _jax

    service = _jax.get_distributed_runtime_service(
        address, num_nodes, heartbeat_timeout=heartbeat_timeout or None, shutdown_timeout=shutdown_timeout or None)
    sys.stdout.buffer.write(_READY + b"\n")
    sys.stdout.flush()
    if sys.stdin.readline().strip() == "shutdown":
        service.shutdown()
        return
    # End of input without "shutdown": the chief is gone. Let the other workers name it, then
    # end without an orderly shutdown (it would wait for every client).
    time.sleep(LINGER_SECONDS)
    os._exit(0)


if __name__ == "__main__":
    try:
        _serve(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
    except KeyboardInterrupt:
        os._exit(130)
