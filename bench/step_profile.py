"""Where a training step's time goes: the backend's own profiler over `fit` of ours, the native
peer and plain Keras, in one process.

The step-time scripts say how long a step takes; this one says what the step is
made of. For each backend and model, one process with N virtual CPU devices
trains the three models of `same_process_step_time.py` (ours under
`ks.MirroredStrategy()`, the native peer on the same devices, plain Keras on
one device) and reports, per training step:

- the step's wall time and the processor time the whole process spent in it
  (both cores), medians over unprofiled epochs that rotate between the models;
- from one epoch of each model under the backend's profiler, right after the
  warm-up epoch: the operations the backend ran (TensorFlow: executor
  operations; JAX: XLA's compiled operations, the thunks, on every device;
  PyTorch: `aten` operations called from outside another one), the time spent
  in them summed over the threads that ran them, the part of it in collectives
  and cross-device transfers, and (JAX) the part in which a device waited for
  the others to reach a collective.

Virtual devices share the machine's cores, so operation times summed over
threads include time a thread waited for a core; the counts do not.

Usage:
    python bench/step_profile.py                        # every backend, MLP and CNN, 4 devices
    python bench/step_profile.py --backends jax --models mlp --rounds 5
    python bench/step_profile.py --smoke                # tiny sizes (the test suite's run)
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import re
import shutil
import statistics
import sys
import tempfile

from child_runs import NATIVE, SideBySide, selected, side_by_side_child, side_by_side_options, spread, step_timer

RESULT_PREFIX = "STEP-PROFILE-RESULT "
CONFIGURATIONS = {"ours": "ks.MirroredStrategy", "native": None, "plain": "plain Keras, 1 device"}

# XLA's compiled operations (thunks) carry their HLO names: `dot.2`, `ynn_fusion.4`, `all-reduce`.
_HLO_NAME = re.compile(r"^[a-z][a-z0-9_\-]*(\.\d+)*$")
_JAX_COLLECTIVE = re.compile(r"^(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)")
# TensorFlow's executor names an operation's event `<node name>:<op type>`.
_TF_OPERATION = re.compile(r"^[^:\s]+:([A-Za-z_]\w*)$")
_TF_COLLECTIVES = {"CollectiveReduceV2", "CollectiveGatherV2", "CollectiveBcastSendV2", "CollectiveBcastRecvV2",
                   "NcclAllReduce", "_Send", "_Recv", "_HostSend", "_HostRecv"}


class Profile:
    """Per-step totals of one profiled epoch: operations, their time, collectives, waiting (ms)."""

    def __init__(self, steps: int):
        self.steps, self.operations, self.op_us, self.collective_us, self.waiting_us = steps, 0, 0.0, 0.0, 0.0

    def add(self, duration_us: float, collective: bool) -> None:
        self.operations += 1
        self.op_us += duration_us
        self.collective_us += duration_us if collective else 0.0

    def summary(self) -> dict:
        per_step = lambda us: us / self.steps / 1e3  # noqa: E731
        return {"operations": self.operations / self.steps, "op_ms": per_step(self.op_us),
                "collective_ms": per_step(self.collective_us), "waiting_ms": per_step(self.waiting_us)}


def _jax_profile(train_epoch, steps: int, directory: str) -> dict:
    import jax

    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0  # Python calls traced would cost more than the steps
    jax.profiler.start_trace(directory, profiler_options=options)
    try:
        train_epoch()
    finally:
        jax.profiler.stop_trace()
    (path,) = glob.glob(os.path.join(directory, "**", "*.trace.json.gz"), recursive=True)
    events = json.load(gzip.open(path))["traceEvents"]
    threads = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    profile = Profile(steps)
    for event in events:
        if event.get("ph") != "X" or not threads.get(event.get("tid"), "").startswith("tf_XLA"):
            continue  # the devices' execution threads only
        name = event["name"]
        if name.startswith("Wait: pending_threads"):  # a device at a collective, waiting for the others
            profile.waiting_us += event["dur"]
        elif _HLO_NAME.match(name):
            profile.add(event["dur"], bool(_JAX_COLLECTIVE.match(name)))
    return profile.summary()


def _tensorflow_profile(train_epoch, steps: int, directory: str) -> dict:
    import tensorflow as tf

    try:
        from tensorflow.tsl.profiler.protobuf import xplane_pb2
    except ImportError:  # where TensorFlow does not expose its profiler's protocol buffers
        from tsl.profiler.protobuf import xplane_pb2

    # Its default options trace no Python calls. (TensorFlow 2.21 refuses every level passed from Python,
    # "host_tracer_level expects an i value", and keeps the defaults.)
    tf.profiler.experimental.start(directory)
    try:
        train_epoch()
    finally:
        tf.profiler.experimental.stop()
    (path,) = glob.glob(os.path.join(directory, "**", "*.xplane.pb"), recursive=True)
    space = xplane_pb2.XSpace()
    with open(path, "rb") as file:
        space.ParseFromString(file.read())
    profile = Profile(steps)
    for plane in space.planes:
        for line in plane.lines:
            for event in line.events:
                match = _TF_OPERATION.match(plane.event_metadata[event.metadata_id].name)
                if match:
                    profile.add(event.duration_ps / 1e6, match.group(1) in _TF_COLLECTIVES)
    return profile.summary()


def _torch_profile(train_epoch, steps: int, directory: str) -> dict:
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        train_epoch()
    profile = Profile(steps)
    dispatched = lambda event: event is not None and event.name.startswith(("aten::", "c10d::"))  # noqa: E731
    for event in profiler.events():
        if dispatched(event) and not dispatched(event.cpu_parent):
            profile.add(event.time_range.elapsed_us(), event.name.startswith("c10d::"))
    return profile.summary()


PROFILERS = {"jax": _jax_profile, "tensorflow": _tensorflow_profile, "torch": _torch_profile}


def run_worker(args) -> None:
    side = SideBySide(args)
    for name in side.names:  # warm-up: tracing and compilation
        side.epoch(name)
    # Profiled right after the warm-up: TensorFlow's executor learns which operations are cheap and
    # then runs them without the events its profiler reports at the default level (the only one
    # TensorFlow 2.21's Python API can set), so a later epoch would show only part of the step.
    profiles = {}
    for name in side.names:
        directory = tempfile.mkdtemp(prefix=f"ks_step_profile_{name}_")
        try:
            profiles[name] = PROFILERS[args.backend](lambda: side.epoch(name), args.steps, directory)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
    wall: dict = {name: [] for name in side.names}
    cpu: dict = {name: [] for name in side.names}
    for name in side.rotation(args.rounds):
        timer = step_timer(side.keras)
        side.epoch(name, timer)
        wall[name].append(statistics.median(timer.wall) * 1e3)
        cpu[name].append(statistics.median(timer.cpu) * 1e3)
    print(RESULT_PREFIX + json.dumps({"backend": args.backend, "model": args.model, "devices": args.devices,
                                         "wall": wall, "cpu": cpu, "profiles": profiles}), flush=True)


def table(results: list) -> str:
    lines = ["| backend | model | configuration | ms/step | CPU ms/step | operations/step | operation ms/step "
             "| of which collectives and transfers | of which waiting for the other devices |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for result in results:
        backend = result["backend"]
        for name, profile in result["profiles"].items():
            label = CONFIGURATIONS[name] or NATIVE[backend]
            label += f", {result['devices']} devices" if name != "plain" else ""
            waiting = f"{profile['waiting_ms']:.2f}" if backend == "jax" else "—"
            lines.append(f"| {backend} | {result['model']} | {label} | {spread(result['wall'][name])} "
                         f"| {spread(result['cpu'][name])} | {profile['operations']:.0f} | {profile['op_ms']:.2f} "
                         f"| {profile['collective_ms']:.2f} | {waiting} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = side_by_side_options(__doc__.split("\n\n")[0], 3, "unprofiled epochs of each model")
    args = parser.parse_args(argv)
    if args.worker:
        run_worker(args)
        return 0
    backends, models = selected(args)
    if args.smoke:
        args.devices, args.steps, args.rounds, models = 2, 3, 1, models[:1]
    print(f"One process per backend and model, {args.devices} virtual CPU devices, {args.rounds} unprofiled and one "
          f"profiled epoch ({args.steps} steps) per model, one intra-op thread, load {os.getloadavg()[0]:.1f}\n",
          flush=True)
    results = [side_by_side_child(__file__, RESULT_PREFIX, args, backend, model)
               for backend in backends for model in models]
    print(table(results))
    if args.smoke:
        print("\nSMOKE run: tiny sizes, the numbers mean nothing.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
