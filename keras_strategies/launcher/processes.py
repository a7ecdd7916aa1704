"""Worker processes: own process group, line-prefixed output, exit notification.

Each worker runs in its own process group so that stopping it also stops
anything it started (data loaders, backend helper processes): the launcher
signals the whole group, and no grandchild outlives the job. The groups stay
in the launcher's session: Linux's scheduler (autogroup) shares the CPU
between sessions, and workers in sessions of their own made every hand-off
between a collective's threads slower (measured: a 16 MB all-reduce in 10
tensors at 0.84-0.93 of one flat all-reduce's rate with a session per
worker, 0.99-1.13 in one session).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import IO, Callable, Iterable, Sequence

from keras_strategies.console.worker_output import is_engine_noise

_POSIX = os.name == "posix"
_PROC_STAT = sys.platform.startswith("linux") and os.path.isdir("/proc/self")
_PR_SET_PDEATHSIG = 1


def _parent_death_signal() -> Callable[[], None] | None:
    """A `preexec_fn` that makes the child get SIGTERM when its parent dies (Linux), else None.

    libc is loaded here, before any fork: the child only makes the system call.
    """
    if not sys.platform.startswith("linux"):
        return None  # pragma: no cover - other systems: the caller's exit handler stops its tasks
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # pragma: no cover - a libc without prctl
        return None
    parent = os.getpid()

    def set_parent_death_signal() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before the call took effect
            os._exit(1)

    return set_parent_death_signal


PREEMPTED_EXIT_CODE = 42  # `ks.experimental.PreemptionCheckpointHandler`'s (and TensorFlow's) exit after its save


def exit_code(returncode: int) -> int:
    """A `Popen.returncode` as a shell reports it: killed by signal S -> 128 + S."""
    return 128 - returncode if returncode < 0 else returncode


def describe_exit(returncode: int) -> str:
    """`"exited with code 3"` / `"was killed by SIGKILL (exit code 137)"`, for messages."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name} (exit code {exit_code(returncode)})"
    if returncode == PREEMPTED_EXIT_CODE:
        return f"exited with code {returncode} (saved its state after a preemption notice)"
    return f"exited with code {returncode}"


class LineWriter:
    """Writes whole lines to a text stream; the shared lock keeps lines from interleaving.

    A stream that stops accepting output (closed pipe, `| head`) is ignored from
    then on, so workers never block on a full pipe.
    """

    def __init__(self, stream: IO[str], lock: threading.Lock) -> None:
        self._stream = stream
        self._lock = lock
        self._broken = False

    def write_line(self, text: str) -> None:
        with self._lock:
            if self._broken:
                return
            try:
                try:
                    self._stream.write(text + "\n")
                except UnicodeEncodeError:
                    encoding = getattr(self._stream, "encoding", None) or "ascii"
                    safe = text.encode(encoding, "backslashreplace").decode(encoding)
                    self._stream.write(safe + "\n")
                self._stream.flush()
            except (OSError, ValueError):
                self._broken = True


def _pump(pipe: IO[bytes], prefix: str, writer: LineWriter) -> None:
    """Copies `pipe` to `writer` line by line, each line prefixed with the task name, without the
    engines' lines that say nothing to act on (`console.worker_output`)."""
    with pipe:
        for raw in iter(pipe.readline, b""):
            line = raw.decode("utf-8", "replace")
            if line.endswith("\n"):
                line = line[:-2] if line.endswith("\r\n") else line[:-1]
            if not is_engine_noise(line):
                writer.write_line(prefix + line)


class WorkerProcess:
    """One running worker: its process group, two output pumps and a waiter thread.

    `on_exit(worker, returncode)` is called from the waiter thread once the
    worker process itself has exited (its grandchildren may still run). With
    `stop_with_parent` (Linux), the worker gets SIGTERM if this process dies,
    even by SIGKILL, so that no worker outlives a caller that cannot stop it.
    """

    def __init__(
        self,
        name: str,
        command: Sequence[str],
        env: dict[str, str],
        stdout: LineWriter,
        stderr: LineWriter,
        on_exit: Callable[["WorkerProcess", int], None],
        stop_with_parent: bool = False,
    ) -> None:
        self.name = name
        self.returncode: int | None = None
        if _POSIX and sys.version_info >= (3, 11):
            group = {"process_group": 0}
        elif _POSIX:  # pragma: no cover - Python 3.10
            group = {"preexec_fn": os.setpgrp}
        else:  # pragma: no cover - Windows
            group = {"creationflags": subprocess.CREATE_NEW_PROCESS_GROUP}
        preexec = _parent_death_signal() if stop_with_parent else None
        if preexec is not None:
            group["preexec_fn"] = preexec
        self.process = subprocess.Popen(
            list(command),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            **group,
        )
        self.pid = self.process.pid
        prefix = f"[{name}] "
        self._threads = [
            threading.Thread(target=self._wait, args=(on_exit,), daemon=True),
            threading.Thread(target=_pump, args=(self.process.stdout, prefix, stdout), daemon=True),
            threading.Thread(target=_pump, args=(self.process.stderr, prefix, stderr), daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def _wait(self, on_exit: Callable[["WorkerProcess", int], None]) -> None:
        returncode = self.process.wait()
        self.returncode = returncode
        on_exit(self, returncode)

    def terminate(self) -> None:
        """SIGTERM to the worker's whole process group."""
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL to the worker's whole process group."""
        self._signal(getattr(signal, "SIGKILL", signal.SIGTERM))

    def _signal(self, sig: int) -> None:
        if _POSIX:
            try:
                os.killpg(self.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        elif self.returncode is None:  # pragma: no cover - Windows
            self.process.terminate() if sig == signal.SIGTERM else self.process.kill()

    def join(self, timeout: float) -> None:
        """Waits (at most `timeout` s) for the exit notification and the end of its output."""
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))


def live_groups(pgids: Iterable[int]) -> set[int]:
    """The process groups among `pgids` that still have a live (non-zombie) member.

    Zombies are ignored: orphans are reparented to PID 1, which in containers
    may never reap them, and a zombie runs nothing.
    """
    wanted = set(pgids)
    live: set[int] = set()
    if not wanted:
        return live
    if _PROC_STAT:
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/stat", "rb") as stat_file:
                    stat = stat_file.read()
            except OSError:
                continue
            fields = stat[stat.rfind(b")") + 2 :].split()  # state, ppid, pgrp, ...
            if len(fields) > 2 and fields[0] not in (b"Z", b"X") and int(fields[2]) in wanted:
                live.add(int(fields[2]))
        return live
    for pgid in wanted:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            continue
        except PermissionError:
            pass
        live.add(pgid)
    return live


def _alive(workers: Sequence[WorkerProcess]) -> list[WorkerProcess]:
    if _POSIX:
        groups = live_groups(w.pid for w in workers)
        return [w for w in workers if w.pid in groups or w.returncode is None]
    return [w for w in workers if w.returncode is None]  # pragma: no cover - Windows


def stop_all(
    workers: Sequence[WorkerProcess],
    grace: float,
    hurry: Callable[[], bool] = lambda: False,
    poll: float = 0.05,
) -> None:
    """SIGTERM every worker group still alive, then SIGKILL what is left after `grace` s.

    `hurry()` returning True (e.g. a second Ctrl-C) skips the rest of the grace period.
    """
    remaining = _alive(workers)
    for worker in remaining:
        worker.terminate()
    deadline = time.monotonic() + grace
    while remaining and time.monotonic() < deadline and not hurry():
        time.sleep(poll)
        remaining = _alive(remaining)
    if not remaining:
        return
    for worker in remaining:
        worker.kill()
    deadline = time.monotonic() + 5.0
    while remaining and time.monotonic() < deadline:
        time.sleep(poll)
        remaining = _alive(remaining)
