"""Step time of `ks.MirroredStrategy` beside the native peer and plain Keras, in one process.

`bench/mirrored_step_time.py` gives each measurement a process of its own, so
that its baselines run unmodified Keras. Processes differ, though (thread
placement, memory layout), and on a small shared machine a few percent between
two processes is noise that back-to-back pairs do not remove. This script puts
the three side by side in one process instead, with epochs that alternate:

- ours: `ks.MirroredStrategy()` over the process's N virtual CPU devices;
- the native peer on the same devices: TensorFlow's `tf.distribute.MirroredStrategy`
  (the model built in its scope), JAX's `keras.distribution.DataParallel` (the
  model built and trained in its `scope()`); PyTorch has none;
- plain Keras: the same model outside any strategy, on one device.

The models are the MLP and the CNN of `mirrored_step_time.py`, with its data,
optimizer, loss and metric, built from the same seed (so the three end their first
epoch with the same loss to four decimals, printed as a check; rounding
differences grow from epoch to epoch after that). After one warm-up epoch each,
every round trains one epoch of each model, in an order that rotates from round
to round; a callback times each step, and a round's value is the median step.
The table shows the median over rounds with its range, and the medians of the
round-by-round ratios.

Caveat: `keras_strategies` is imported in this process, so its Keras hooks are
installed for the native and plain models too; they leave a model outside a
strategy as Keras' own, at the cost of a check per call.

Usage:
    python bench/same_process_step_time.py                      # every backend, 4 devices, MLP and CNN
    python bench/same_process_step_time.py --backends jax --models cnn --rounds 12
    python bench/same_process_step_time.py --smoke               # tiny sizes (the test suite's run)
"""

from __future__ import annotations

import json
import os
import statistics
import sys

from child_runs import NATIVE, SideBySide, selected, side_by_side_child, side_by_side_options, spread, step_timer

RESULT_PREFIX = "SAME-PROCESS-RESULT "


def run_worker(args) -> None:
    side = SideBySide(args)

    def epoch(name: str) -> tuple:
        timer = step_timer(side.keras)
        history = side.epoch(name, timer)
        return statistics.median(timer.wall) * 1e3, history.history["loss"][-1]

    losses = {name: [epoch(name)[1]] for name in side.names}  # the warm-up epoch: tracing and compilation
    ms: dict = {name: [] for name in side.names}
    for name in side.rotation(args.rounds):
        step, loss = epoch(name)
        ms[name].append(step)
        losses[name].append(loss)
    print(RESULT_PREFIX + json.dumps({"backend": args.backend, "model": args.model, "devices": args.devices,
                                         "ms": ms, "losses": losses}), flush=True)


def _ratio(result: dict, a: str, b: str) -> str:
    if a not in result["ms"] or b not in result["ms"]:
        return "—"
    return spread([x / y for x, y in zip(result["ms"][a], result["ms"][b])])


def table(results: list) -> str:
    lines = ["| backend | model | devices | ours ms/step | native peer | native ms/step | plain Keras, 1 device, "
             "ms/step | ours / native | ours / plain | same first-epoch loss |",
             "|---|---|---:|---:|---|---:|---:|---:|---:|---|"]
    for result in results:
        ms, backend = result["ms"], result["backend"]
        native = f"{spread(ms['native'])}" if "native" in ms else "—"
        first = {name: f"{losses[0]:.4f}" for name, losses in result["losses"].items()}
        same = "yes" if len(set(first.values())) == 1 else ", ".join(f"{k} {v}" for k, v in first.items())
        lines.append(f"| {backend} | {result['model']} | {result['devices']} | {spread(ms['ours'])} "
                     f"| {NATIVE[backend] or 'none'} | {native} | {spread(ms['plain'])} "
                     f"| {_ratio(result, 'ours', 'native')} | {_ratio(result, 'ours', 'plain')} | {same} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = side_by_side_options(__doc__.split("\n\n")[0], 8, "measured epochs of each model")
    args = parser.parse_args(argv)
    if args.worker:
        run_worker(args)
        return 0
    backends, models = selected(args)
    if args.smoke:
        args.devices, args.steps, args.rounds, models = 2, 2, 2, models[:1]
    print(f"One process per backend and model, {args.devices} virtual CPU devices, {args.rounds} rounds of one "
          f"epoch ({args.steps} steps) per model, one intra-op thread, load {os.getloadavg()[0]:.1f}\n", flush=True)
    results = [side_by_side_child(__file__, RESULT_PREFIX, args, backend, model)
               for backend in backends for model in models]
    print(table(results))
    if args.smoke:
        print("\nSMOKE run: tiny sizes, the numbers mean nothing.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
