"""What the newer bench scripts share: a child process's one result line, and a median with its range."""

from __future__ import annotations

import json
import statistics
import subprocess


def result_of(cmd: list, env: dict, prefix: str, timeout: float, what: str) -> dict:
    """The JSON after `prefix` on the child's stdout; else SystemExit with the end of its stderr."""
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    for line in proc.stdout.splitlines():
        if line.startswith(prefix):
            return json.loads(line[len(prefix):])
    tail = "\n".join((proc.stderr or "").strip().splitlines()[-15:])
    raise SystemExit(f"{what} exited {proc.returncode} without a result:\n{tail}")


def spread(values: list) -> str:
    """`median (min–max)`, or the median alone for one value."""
    middle = f"{statistics.median(values):.2f}"
    return f"{middle} ({min(values):.2f}–{max(values):.2f})" if len(values) > 1 else middle
