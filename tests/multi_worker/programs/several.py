"""One worker running several programs one after another: `several.py PROGRAM OUT [ARGS...] -- PROGRAM OUT ...`.

Each program runs as `__main__` with its own arguments and output directory,
so that the tests of several programs share one start of the workers and one
cluster: the first program creates its strategy in a fresh process, each later
one creates another strategy for the same cluster, which shares it.
"""

import os
import runpy
import sys
import time

programs, current = [], []
for arg in sys.argv[1:] + ["--"]:
    if arg == "--":
        if current:
            programs.append(current)
        current = []
    else:
        current.append(arg)
if not programs:
    raise SystemExit("usage: several.py PROGRAM OUT [ARGS...] -- PROGRAM OUT [ARGS...] ...")

for name, *args in programs:
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), name)
    sys.argv = [path, *args]
    print(f"=== {name} {' '.join(args)}", flush=True)
    started = time.monotonic()
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as stop:  # a program that ends early with sys.exit(0) lets the next one run
        if stop.code not in (0, None):
            raise
    print(f"=== {name} took {time.monotonic() - started:.1f} s", flush=True)
