"""Runs the test suite once per Keras backend and prints a per-backend summary.

Usage: python scripts/test_all_backends.py [pytest args]. Exits non-zero if
any backend fails. `KS_TEST_BACKENDS=jax,torch` limits the backends.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

BACKENDS = ("tensorflow", "jax", "torch")
_COUNT = re.compile(r"(\d+) (passed|failed|errors?|skipped)")


def run_backend(backend: str, pytest_args: list[str]) -> tuple[int, dict, float]:
    env = dict(os.environ, KERAS_BACKEND=backend)
    started = time.monotonic()
    print(f"\n===== KERAS_BACKEND={backend} =====", flush=True)
    process = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", *pytest_args],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    last = ""
    for line in process.stdout:
        print(f"[{backend}] {line}", end="", flush=True)
        if line.strip():
            last = line
    code = process.wait()
    counts = {kind.rstrip("s"): int(n) for n, kind in _COUNT.findall(last)}
    return code, counts, time.monotonic() - started


def main() -> int:
    wanted = os.environ.get("KS_TEST_BACKENDS")
    backends = wanted.split(",") if wanted else BACKENDS
    results = {b: run_backend(b, sys.argv[1:]) for b in backends}
    print("\n===== summary =====")
    total_passed = total_failed = 0
    for backend, (code, counts, seconds) in results.items():
        failed = counts.get("failed", 0) + counts.get("error", 0)
        if code != 0 and failed == 0:
            failed = 1  # pytest itself failed (collection error, no tests run, ...)
        total_passed += counts.get("passed", 0)
        total_failed += failed
        status = "ok" if code == 0 else f"FAILED (exit {code})"
        print(f"{backend:>10}: {counts.get('passed', 0)} passed, {failed} failed, "
              f"{counts.get('skipped', 0)} skipped in {seconds:.0f}s  {status}")
    print(f"total: {total_passed} passed, {total_failed} failed")
    return 0 if all(code == 0 for code, _, _ in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
