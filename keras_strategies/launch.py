"""Run a script as N local workers of one multi-worker job, on any Keras backend.

    python -m keras_strategies.launch --workers 2 train.py --epochs 3
    python -m keras_strategies.launch --workers 3 --chief --backend jax -m my.module
    keras-strategies-launch --workers 2 --devices-per-worker 2 --timeout 600 train.py
    python -m keras_strategies.launch --workers 3 --chief --ps 2 train.py
    python -m keras_strategies.launch --nnodes 2 --node-rank 0 --master-addr host0:29500 --workers-per-node 2 train.py

Every worker is `python script.py args...` with its own `TF_CONFIG` (free
ports on 127.0.0.1), so multi-worker strategies find their peers; output lines
are prefixed with the task (`[worker 0] ...`). The exit code is 0 when all
workers succeed, else the first failing worker's code (128 + S when killed by
signal S), 130/143 when the launcher is interrupted, 124 on `--timeout`; any
failure stops all workers. From Python, call `launch(...)`.

`--ps N` (with `--chief`) makes a parameter-server job: N more processes are
`ps` tasks, and every task runs the same script, which reads its role from
`TF_CONFIG` (training on the chief, `ks.Server(...).join()` on the worker and
ps tasks, as in TensorFlow's parameter-server tutorial). The job ends when the
chief ends; the worker and ps tasks are then stopped and the exit code is the
chief's. A worker ending early is reported and the chief goes on with the
others; a ps ending early, or the last worker, stops the job.

On several machines, run the launcher on each with `--nnodes N --node-rank R
--master-addr HOST:PORT --workers-per-node M` (torchrun's shape): its workers
get torchrun's variables instead of a `TF_CONFIG`, and
`ks.MultiWorkerMirroredStrategy()` makes one cluster of the N x M workers,
which exchange their addresses through the master
(`ks.cluster_resolver.TorchrunClusterResolver`).

When the chief is the caller itself (a notebook, as in TensorFlow's
parameter-server tutorial), `start_servers("serve.py", workers=2, ps=1)`
starts only the worker and ps tasks, returns at once, and gives the chief's
`TF_CONFIG` (`.tf_config`); `.stop()` (or the caller's exit) stops them.

This module and `keras_strategies.launcher` use only the standard library, and
in the launcher process the package defers importing its API (and so Keras and
its backend) to first use: the launcher starts in well under a second.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from keras_strategies.launcher.tf_config import free_ports, tf_config_for
from keras_strategies.launcher.serving import Servers, start_servers
from keras_strategies.launcher.supervisor import DEFAULT_GRACE, TIMEOUT_EXIT_CODE, check_nodes, check_roles, launch

__all__ = [
    "Servers",
    "TIMEOUT_EXIT_CODE",
    "build_parser",
    "free_ports",
    "launch",
    "main",
    "split_command",
    "start_servers",
    "tf_config_for",
]

BACKENDS = ("tensorflow", "jax", "torch")
# Launcher options that take a value: the first other non-option token starts the command.
_VALUE_OPTIONS = frozenset(
    {"-n", "--workers", "--workers-per-node", "--devices-per-worker", "--backend", "--timeout", "--grace", "--ps",
     "--nnodes", "--node-rank", "--master-addr", "--max-restarts"}
)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text!r}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The launcher's options; the command after them is split off by `split_command`.

    Examples:
        >>> from keras_strategies.launch import build_parser
        >>> options = build_parser().parse_args(["--workers", "3", "--backend", "jax"])
        >>> options.workers, options.backend, options.chief
        (3, 'jax', False)
    """
    prog = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    if prog != "keras-strategies-launch":
        prog = "python -m keras_strategies.launch"
    parser = argparse.ArgumentParser(
        prog=prog,
        usage="%(prog)s [options] (script.py | -m module) [args ...]",
        description="Run a Python script (or module) as N local workers of one multi-worker "
        "job, each with its own TF_CONFIG on 127.0.0.1 (with --nnodes: this machine's workers "
        "of a job on several machines). Everything after the script or module name is passed "
        "to it unchanged.",
        epilog="Exit code: 0 if all workers succeed; else the first failing worker's code "
        "(128+S if killed by signal S), 130/143 on SIGINT/SIGTERM, "
        f"{TIMEOUT_EXIT_CODE} on timeout, 2 on bad arguments. With --ps: the chief's code, "
        "or that of a ps task (or the last worker) that ended before the chief. When the chief "
        "is your own Python process (a notebook), start only the worker and ps tasks with "
        "keras_strategies.launch.start_servers(script, workers=W, ps=P) instead.",
        allow_abbrev=False,
    )
    parser.add_argument("-n", "--workers", type=_positive_int, default=2, metavar="N",
                        help="number of worker processes (default: 2)")
    parser.add_argument("--workers-per-node", type=_positive_int, metavar="M",
                        help="with --nnodes: the worker processes of each node (the same as --workers)")
    parser.add_argument("--devices-per-worker", type=_positive_int, metavar="K",
                        help="virtual CPU devices per worker (sets KERAS_STRATEGIES_CPU_DEVICES)")
    parser.add_argument("--backend", choices=BACKENDS,
                        help="Keras backend of the workers (sets KERAS_BACKEND; default: inherited)")
    parser.add_argument("--chief", action="store_true",
                        help="make process 0 the chief (a 'chief' job) and the rest workers")
    parser.add_argument("--ps", type=_positive_int, default=0, metavar="P",
                        help="add P parameter-server ('ps') tasks, for ParameterServerStrategy; needs "
                        "--chief and --workers 2 or more (which counts the chief). The job ends when "
                        "the chief ends: the worker and ps tasks, which serve with ks.Server(...).join(), "
                        "are then stopped")
    parser.add_argument("--timeout", type=_positive_float, metavar="SECONDS",
                        help="stop all workers and fail if the job is not done by then")
    parser.add_argument("--grace", type=_non_negative_float, default=DEFAULT_GRACE,
                        metavar="SECONDS",
                        help="time between SIGTERM and SIGKILL when stopping workers "
                        f"(default: {DEFAULT_GRACE:g})")
    parser.add_argument("--max-restarts", type=int, default=0, metavar="K",
                        help="when the job fails, stop every process and start them all again, up to K "
                        "times; the script resumes with keras.callbacks.BackupAndRestore (default: 0)")
    parser.add_argument("--nnodes", type=_positive_int, default=1, metavar="NODES",
                        help="machines of a multi-node job: run the launcher on each, with the same "
                        "--nnodes, --workers-per-node and --master-addr and its own --node-rank")
    parser.add_argument("--node-rank", type=int, default=0, metavar="R",
                        help="this machine's index in a multi-node job (0 holds the chief)")
    parser.add_argument("--master-addr", metavar="HOST:PORT",
                        help="node 0's address in a multi-node job, reachable from every node; its "
                        "workers use the following ports")
    return parser


def split_command(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Splits argv into (launcher options, command) at the script, `-m` or `--`.

    Done by hand rather than with argparse.REMAINDER so that the script's own
    arguments (even `--workers` or `--`) reach it unchanged.

    Examples:
        >>> from keras_strategies.launch import split_command
        >>> split_command(["--workers", "2", "train.py", "--workers", "5"])
        (['--workers', '2'], ['train.py', '--workers', '5'])
        >>> split_command(["-n", "2", "-m", "my.module", "--epochs", "3"])
        (['-n', '2'], ['-m', 'my.module', '--epochs', '3'])
    """
    argv = list(argv)
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--":
            return argv[:i], argv[i + 1 :]
        if token == "-m" or (token.startswith("-m") and not token.startswith("--")):
            return argv[:i], ["-m", token[2:], *argv[i + 1 :]] if token != "-m" else argv[i:]
        if token in _VALUE_OPTIONS:
            i += 2
        elif token.startswith("-") and token != "-":
            i += 1
        else:
            return argv[:i], argv[i:]
    return argv, []


def main(argv: Sequence[str] | None = None) -> int:
    """The `keras-strategies-launch` command; returns the exit code (2 for bad arguments).

    Args:
        argv: The command line after the program name (default: `sys.argv[1:]`).

    Examples:
        ```python
        import sys
        from keras_strategies.launch import main

        sys.exit(main(["--workers", "2", "--backend", "torch", "train.py", "--epochs", "3"]))
        ```
    """
    parser = build_parser()
    options, command = split_command(sys.argv[1:] if argv is None else argv)
    try:
        ns = parser.parse_args(options)
        if ns.workers_per_node is not None:
            ns.workers = ns.workers_per_node
        try:
            if ns.max_restarts < 0:
                raise ValueError(f"--max-restarts must be >= 0, got {ns.max_restarts}")
            check_roles(ns.workers, ns.chief, ns.ps)
            if ns.nnodes != 1 or ns.master_addr is not None:
                check_nodes(ns.nnodes, ns.node_rank, ns.master_addr, ns.chief, ns.ps)
        except ValueError as error:
            parser.error(str(error))
        if not command:
            parser.error("missing the script to run: give script.py [args ...] or -m module [args ...]")
        module = command[0] == "-m"
        if module:
            if len(command) < 2 or not command[1]:
                parser.error("-m needs a module name, e.g. -m my_package.train")
            target, args = command[1], command[2:]
        else:
            target, args = command[0], command[1:]
            if not os.path.isfile(target):
                parser.error(f"script {target!r} not found (cwd: {os.getcwd()})")
    except SystemExit as exit_:  # argparse reports errors (2) and --help (0) this way
        return exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 2)
    try:
        return launch(
            target,
            args,
            workers=ns.workers,
            devices_per_worker=ns.devices_per_worker,
            backend=ns.backend,
            chief=ns.chief,
            timeout=ns.timeout,
            module=module,
            grace=ns.grace,
            ps=ns.ps,
            nodes=ns.nnodes,
            node_rank=ns.node_rank,
            master_addr=ns.master_addr,
            max_restarts=ns.max_restarts,
        )
    except (OSError, ValueError) as error:
        print(f"keras_strategies.launch: error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
