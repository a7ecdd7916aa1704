"""The local multi-worker launcher, with real worker processes.

Workers are tiny scripts written to tmp_path that never import Keras, so these
tests take seconds on every backend. Each worker records its pid (and its
grandchild's) in files, so tests can prove that nothing is left running.
"""

import io
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from keras_strategies import launch as launch_module
from keras_strategies.launch import (
    TIMEOUT_EXIT_CODE, free_ports, launch, main, split_command, start_servers, tf_config_for,
)

pytestmark = pytest.mark.skipif(os.name != "posix", reason="the launcher tests use POSIX signals")

REPO_ROOT = Path(__file__).resolve().parents[1]

# One worker script for every test: argv[1] is a JSON plan {"worker 0": {"do": ...}, "*": ...}
# keyed by the task name the launcher prints, so each worker can behave differently.
WORKER = textwrap.dedent(
    r'''
    import json, os, signal, subprocess, sys, time

    config = json.loads(os.environ["TF_CONFIG"])
    task = config["task"]
    name = f"{task['type']} {task['index']}"
    plan = json.loads(sys.argv[1])
    step = plan.get(name, plan.get("*", {"do": "report"}))
    pid_dir = os.environ["PID_DIR"]

    def note_pid(label, pid):
        path = os.path.join(pid_dir, f"{name.replace(' ', '-')}.{label}")
        with open(path + ".tmp", "w") as f:
            f.write(str(pid))
        os.replace(path + ".tmp", path)

    def wait_for(files):
        deadline = time.monotonic() + 20
        while not all(os.path.exists(os.path.join(pid_dir, f)) for f in files):
            if time.monotonic() > deadline:
                sys.exit("peer files never appeared: %s" % files)
            time.sleep(0.02)

    def wait_gone(files):  # until the processes whose pids these files hold have exited
        deadline = time.monotonic() + 20
        wait_for(files)
        for f in files:
            with open(os.path.join(pid_dir, f)) as pid_file:
                pid = int(pid_file.read())
            while True:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                if time.monotonic() > deadline:
                    sys.exit("peer never exited: %s" % f)
                time.sleep(0.02)

    note_pid("pid", os.getpid())
    if int(os.environ.get("KERAS_STRATEGIES_RESTART_COUNT", "0")) < step.get("fail_attempts", 0):
        print("failing this attempt", file=sys.stderr, flush=True)
        sys.exit(3)
    do = step["do"]
    wait_for(step.get("wait_for", []))
    wait_gone(step.get("wait_gone", []))
    if do in ("report", "serve"):
        keys = ["KERAS_BACKEND", "KERAS_STRATEGIES_CPU_DEVICES", "PYTHONUNBUFFERED",
                "KERAS_STRATEGIES_LAUNCHED", "EXTRA", "UNSET_ME"]
        print(json.dumps({"config": config, "argv": sys.argv[2:],
                          "env": {k: os.environ.get(k) for k in keys},
                          "pid": os.getpid(), "group": os.getpgid(0), "session": os.getsid(0)}))
        print("a line on stderr", file=sys.stderr, flush=True)
        if do == "serve":  # a ps or worker task of a parameter-server job: serve until stopped
            note_pid("ready", os.getpid())
            time.sleep(60)
    elif do == "chatter":  # many lines, each written in pieces
        for i in range(step["lines"]):
            for piece in (f"line {i} ", "of ", name, "\n"):
                sys.stdout.write(piece)
                sys.stdout.flush()
    elif do == "sleep":
        if step.get("ignore_term"):
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if step.get("grandchild"):
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
            note_pid("grandchild", child.pid)
        note_pid("ready", os.getpid())
        print("sleeping", flush=True)
        time.sleep(60)
    elif do == "exit":
        print("failing on purpose", file=sys.stderr, flush=True)
        sys.exit(step["code"])
    elif do == "kill_self":
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(step.get("code", 0))
    '''
)



LINE = re.compile(r"^\[(worker|chief|ps) (\d+)\] (.*)$")


def _running(pid):
    """True if `pid` is a live process; zombies (exited, never reaped by PID 1) count as gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


@pytest.fixture
def job(tmp_path, monkeypatch):
    """A worker script plus a pid directory; kills any recorded pid left over by a failing test."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    monkeypatch.setenv("PID_DIR", str(pid_dir))

    class Job:
        path = str(script)
        pids = pid_dir

        @staticmethod
        def recorded_pids():
            return {p.name: int(p.read_text()) for p in pid_dir.iterdir() if not p.name.endswith(".tmp")}

        @staticmethod
        def wait_for_files(names, timeout=60.0):
            deadline = time.monotonic() + timeout
            while not all((pid_dir / n).exists() for n in names):
                assert time.monotonic() < deadline, f"workers never wrote {names}"
                time.sleep(0.05)

    yield Job
    for pid in set(Job.recorded_pids().values()):
        if _running(pid):
            os.kill(pid, signal.SIGKILL)


def _run(job, plan, **kwargs):
    out, err = io.StringIO(), io.StringIO()
    start = time.monotonic()
    code = launch(job.path, [json.dumps(plan), *kwargs.pop("args", [])], stdout=out, stderr=err, **kwargs)
    return code, out.getvalue(), err.getvalue(), time.monotonic() - start


def _by_task(text):
    """{"worker 0": [lines...]} from launcher output; every line must carry a task prefix."""
    lines = {}
    for line in text.splitlines():
        match = LINE.match(line)
        assert match, f"line without a task prefix: {line!r}"
        lines.setdefault(f"{match[1]} {match[2]}", []).append(match[3])
    return lines


def _assert_all_gone(job, timeout=5.0):
    pids = job.recorded_pids()
    deadline = time.monotonic() + timeout
    while any(_running(p) for p in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [name for name, pid in pids.items() if _running(pid)], "processes left running"


# --- cluster layout ---------------------------------------------------------------------------


def test_free_ports_are_distinct_and_bindable():
    import socket

    ports = free_ports(6)
    assert len(set(ports)) == 6 and all(0 < p < 65536 for p in ports)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports[0]))
    assert free_ports(0) == []
    with pytest.raises(ValueError, match="-1"):
        free_ports(-1)


def test_tf_config_for_workers_and_chief_layouts():
    assert tf_config_for(1, [5000, "127.0.0.1:5001"]) == {
        "cluster": {"worker": ["127.0.0.1:5000", "127.0.0.1:5001"]},
        "task": {"type": "worker", "index": 1},
    }
    addresses = ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]
    cluster = {"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2", "127.0.0.1:3"]}
    assert tf_config_for(0, addresses, chief=True) == {"cluster": cluster, "task": {"type": "chief", "index": 0}}
    assert tf_config_for(2, addresses, chief=True)["task"] == {"type": "worker", "index": 1}
    with pytest.raises(ValueError, match="3"):
        tf_config_for(3, addresses)


# --- successful jobs ----------------------------------------------------------------------------


def test_two_workers_succeed_with_prefixed_lines_and_their_own_tf_config(job):
    code, out, err, _ = _run(job, {"*": {"do": "report"}}, workers=2)
    assert code == 0, err
    lines = _by_task(out)
    assert sorted(lines) == ["worker 0", "worker 1"]
    reports = {task: json.loads(lines[task][0]) for task in lines}
    cluster = reports["worker 0"]["config"]["cluster"]
    assert reports["worker 1"]["config"]["cluster"] == cluster
    assert list(cluster) == ["worker"] and len(cluster["worker"]) == 2
    ports = [int(a.split(":")[1]) for a in cluster["worker"]]
    assert len(set(ports)) == 2 and all(a.startswith("127.0.0.1:") for a in cluster["worker"])
    for index in (0, 1):
        assert reports[f"worker {index}"]["config"]["task"] == {"type": "worker", "index": index}
    assert _by_task(err) == {"worker 0": ["a line on stderr"], "worker 1": ["a line on stderr"]}


def test_each_worker_has_its_own_process_group_in_the_launchers_session(job):
    # Own group: stopping a worker stops its children. Same session: Linux shares the CPU
    # between sessions (autogroup), which slowed the workers' collectives.
    code, out, err, _ = _run(job, {"*": {"do": "report"}}, workers=2)
    assert code == 0, err
    reports = [json.loads(lines[0]) for lines in _by_task(out).values()]
    assert len(reports) == 2
    for report in reports:
        assert report["group"] == report["pid"]
        assert report["session"] == os.getsid(0)


def test_a_chief_and_workers_each_get_their_own_address_and_task_in_tf_config(job):
    code, out, err, _ = _run(job, {"*": {"do": "report"}}, workers=3, chief=True)
    assert code == 0, err
    reports = {task: json.loads(lines[0]) for task, lines in _by_task(out).items()}
    assert sorted(reports) == ["chief 0", "worker 0", "worker 1"]
    cluster = reports["chief 0"]["config"]["cluster"]
    assert len(cluster["chief"]) == 1 and len(cluster["worker"]) == 2
    assert len(set(cluster["chief"] + cluster["worker"])) == 3
    for task, report in reports.items():
        kind, index = task.split()
        assert report["config"] == {"cluster": cluster, "task": {"type": kind, "index": int(index)}}


def test_env_vars_and_script_args_reach_every_worker(job, monkeypatch):
    monkeypatch.setenv("UNSET_ME", "inherited")
    code, out, err, _ = _run(
        job,
        {"*": {"do": "report"}},
        args=["--workers", "7", "two words"],
        workers=2,
        backend="jax",
        devices_per_worker=3,
        env={"EXTRA": "x", "UNSET_ME": None},
    )
    assert code == 0, err
    for lines in _by_task(out).values():
        report = json.loads(lines[0])
        assert report["argv"] == ["--workers", "7", "two words"]
        assert report["env"] == {
            "KERAS_BACKEND": "jax",
            "KERAS_STRATEGIES_CPU_DEVICES": "3",
            "PYTHONUNBUFFERED": "1",
            "KERAS_STRATEGIES_LAUNCHED": "1",
            "EXTRA": "x",
            "UNSET_ME": None,
        }


def test_without_backend_option_workers_inherit_the_environment(job, monkeypatch):
    monkeypatch.setenv("KERAS_BACKEND", "torch")
    monkeypatch.delenv("KERAS_STRATEGIES_CPU_DEVICES")
    code, out, err, _ = _run(job, {"*": {"do": "report"}}, workers=1)
    assert code == 0, err
    env = json.loads(_by_task(out)["worker 0"][0])["env"]
    assert env["KERAS_BACKEND"] == "torch" and env["KERAS_STRATEGIES_CPU_DEVICES"] is None


def test_output_lines_never_interleave(job):
    code, out, err, _ = _run(job, {"*": {"do": "chatter", "lines": 300}}, workers=2)
    assert code == 0, err
    lines = _by_task(out)
    for task in ("worker 0", "worker 1"):
        assert lines[task] == [f"line {i} of {task}" for i in range(300)]


# --- failures, timeouts and signals ---------------------------------------------------------------


def test_first_failure_stops_other_workers_and_their_children(job):
    plan = {
        "worker 0": {"do": "sleep", "grandchild": True},
        "worker 1": {"do": "exit", "code": 3, "wait_for": ["worker-0.ready"]},
    }
    code, out, err, elapsed = _run(job, plan, workers=2)
    assert code == 3
    assert elapsed < 10
    assert "[worker 1] failing on purpose" in err.splitlines()
    assert re.search(r"^keras_strategies\.launch: worker 1 exited with code 3\b", err, re.M), err
    assert set(job.recorded_pids()) >= {"worker-0.pid", "worker-0.grandchild", "worker-1.pid"}
    _assert_all_gone(job)


def test_worker_ignoring_sigterm_is_killed_after_the_grace_period(job):
    plan = {
        "worker 0": {"do": "sleep", "ignore_term": True},
        "worker 1": {"do": "exit", "code": 1, "wait_for": ["worker-0.ready"]},
    }
    code, _, err, elapsed = _run(job, plan, workers=2, grace=0.5)
    assert code == 1, err
    assert 0.5 <= elapsed < 8
    _assert_all_gone(job)


def test_worker_killed_by_a_signal_gives_128_plus_signal(job):
    plan = {
        "worker 0": {"do": "sleep"},
        "worker 1": {"do": "kill_self", "wait_for": ["worker-0.ready"]},
    }
    code, _, err, _ = _run(job, plan, workers=2)
    assert code == 128 + signal.SIGKILL
    assert "worker 1 was killed by SIGKILL (exit code 137)" in err
    _assert_all_gone(job)


def test_timeout_stops_a_hanging_job(job):
    code, _, err, elapsed = _run(job, {"*": {"do": "sleep", "grandchild": True}}, workers=2, timeout=1)
    assert code == launch_module.TIMEOUT_EXIT_CODE != 0
    assert 1 <= elapsed < 8
    assert "timed out after 1 s" in err
    _assert_all_gone(job)


def _default_stop_signals():
    # A test run started in the background (`make test &`) ignores SIGINT, and the launcher
    # rightly keeps an ignored signal ignored (as under nohup): give it the default handling.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


def _start_launcher(command):
    return subprocess.Popen(
        command,
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=_default_stop_signals,
    )


def _stop_launcher(launcher, job, sig, tasks=("worker-0", "worker-1")):
    """Sends `sig` to the launcher once every worker is up; returns (exit code, stdout, stderr)."""
    try:
        job.wait_for_files([f"{task}.{kind}" for task in tasks for kind in ("ready", "grandchild")])
        launcher.send_signal(sig)
        out, err = launcher.communicate(timeout=60)  # generous: CI machines may be loaded
        return launcher.returncode, out, err
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()


def test_cli_sigint_exits_130_and_leaves_no_workers(job):
    plan = json.dumps({"*": {"do": "sleep", "grandchild": True}})
    launcher = _start_launcher(
        [sys.executable, "-m", "keras_strategies.launch", "--workers", "2", job.path, plan]
    )
    code, out, err = _stop_launcher(launcher, job, signal.SIGINT)
    assert code == 130, err
    assert "[worker 0] sleeping" in out and "[worker 1] sleeping" in out
    assert "keras_strategies.launch: received SIGINT; stopping all workers." in err
    _assert_all_gone(job)


@pytest.mark.parametrize("module", [["-m", "keras_strategies.launch"], ["-mkeras_strategies.launch"]])
def test_the_launcher_process_imports_no_ml_framework(module):
    """`python -m keras_strategies.launch` defers the package's API (and Keras) to first use."""
    result = subprocess.run(  # -X importtime lists every module the process imports
        [sys.executable, "-X", "importtime", *module, "--help"], capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("usage: python -m keras_strategies.launch")
    imported = {line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if "|" in line}
    assert not imported & {"keras", "tensorflow", "jax", "torch"}, sorted(imported)[:20]


def test_any_other_process_importing_the_package_gets_the_whole_api_at_once():
    """The laziness is the launcher's alone: `import keras_strategies` installs the hooks (imports Keras)."""
    probe = "import sys; print(sorted({'keras', 'tensorflow', 'jax', 'torch'} & set(sys.modules)))"
    full = subprocess.run([sys.executable, "-c", "import keras_strategies as ks; " + probe], capture_output=True,
                          text=True, timeout=120)
    assert "keras" in full.stdout, full.stderr[-2000:]


# Runs keras_strategies/launch.py as __main__ without executing the package __init__:
# proves the launcher modules themselves import no ML framework.
_BARE_LAUNCHER = textwrap.dedent(
    """
    import runpy, sys, types
    package = types.ModuleType("keras_strategies")
    package.__path__ = [sys.argv.pop(1)]
    sys.modules["keras_strategies"] = package
    import keras_strategies.launch
    heavy = {"keras", "tensorflow", "jax", "torch"} & set(sys.modules)
    assert not heavy, heavy
    del sys.modules["keras_strategies.launch"]
    runpy.run_module("keras_strategies.launch", run_name="__main__", alter_sys=True)
    """
)


def _bare_launcher_command(*args):
    package_dir = str(REPO_ROOT / "keras_strategies")
    return [sys.executable, "-c", _BARE_LAUNCHER, package_dir, *args]


def test_cli_sigterm_exits_143_and_leaves_no_workers(job):
    plan = json.dumps({"*": {"do": "sleep", "grandchild": True}})
    launcher = _start_launcher(_bare_launcher_command("--workers", "2", "--chief", job.path, plan))
    code, out, err = _stop_launcher(launcher, job, signal.SIGTERM, tasks=("chief-0", "worker-0"))
    assert code == 143, err
    assert "[chief 0] sleeping" in out and "[worker 0] sleeping" in out
    assert "received SIGTERM" in err
    _assert_all_gone(job)


def test_cli_process_exit_code_for_bad_arguments():
    result = subprocess.run(
        _bare_launcher_command("--workers", "0", "train.py"), cwd=REPO_ROOT, capture_output=True, text=True
    )
    assert result.returncode == 2
    assert "--workers: must be an integer >= 1, got '0'" in result.stderr


# --- command line -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--workers", "0", "{script}"], "got '0'"),
        (["--workers", "two", "{script}"], "got 'two'"),
        (["--workers", "2"], "missing the script"),
        (["--workers", "2", "no_such_script.py"], "'no_such_script.py' not found"),
        (["--workers", "2", "-m"], "-m needs a module name"),
        (["--backend", "theano", "{script}"], "invalid choice: 'theano'"),
        (["--devices-per-worker", "-1", "{script}"], "got '-1'"),
        (["--timeout", "0", "{script}"], "got '0'"),
        (["--no-such-option", "{script}"], "unrecognized arguments: --no-such-option"),
    ],
)
def test_bad_arguments_exit_2_and_name_the_bad_value(job, capsys, argv, message):
    code = main([a.format(script=job.path) for a in argv])
    assert code == 2
    assert message in capsys.readouterr().err
    assert not job.recorded_pids()


def test_launch_api_rejects_bad_values(job, tmp_path):
    with pytest.raises(ValueError, match="workers.*0"):
        launch(job.path, workers=0)
    with pytest.raises(ValueError, match="timeout.*-1"):
        launch(job.path, timeout=-1)
    with pytest.raises(FileNotFoundError, match="missing.py"):
        launch(str(tmp_path / "missing.py"))
    assert not job.recorded_pids()


def test_split_command_keeps_the_script_arguments_intact():
    assert split_command(["--workers", "2", "s.py", "--workers", "5", "--"]) == (
        ["--workers", "2"],
        ["s.py", "--workers", "5", "--"],
    )
    assert split_command(["--chief", "-m", "pkg.mod", "--lr", "1"]) == (["--chief"], ["-m", "pkg.mod", "--lr", "1"])
    assert split_command(["-mpkg.mod", "x"]) == ([], ["-m", "pkg.mod", "x"])
    assert split_command(["--timeout=3", "--", "-weird.py"]) == (["--timeout=3"], ["-weird.py"])
    assert split_command(["--workers", "2"]) == (["--workers", "2"], [])


def test_main_runs_a_module_with_m(job, tmp_path, monkeypatch, capsys):
    (tmp_path / "launched_mod.py").write_text(WORKER)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    plan = json.dumps({"*": {"do": "report"}})
    code = main(["--workers", "2", "--chief", "--backend", "torch", "-m", "launched_mod", plan, "extra"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    reports = {task: json.loads(lines[0]) for task, lines in _by_task(captured.out).items()}
    assert sorted(reports) == ["chief 0", "worker 0"]
    assert all(r["argv"] == ["extra"] and r["env"]["KERAS_BACKEND"] == "torch" for r in reports.values())


# --- parameter-server jobs (--ps) ------------------------------------------------------------------


def test_tf_config_for_a_parameter_server_cluster():
    addresses = [5000, 5001, 5002, 5003, 5004]
    cluster = {"chief": ["127.0.0.1:5000"], "worker": ["127.0.0.1:5001", "127.0.0.1:5002"],
               "ps": ["127.0.0.1:5003", "127.0.0.1:5004"]}
    tasks = [tf_config_for(i, addresses, chief=True, ps=2) for i in range(5)]
    assert all(config["cluster"] == cluster for config in tasks)
    assert list(tasks[0]["cluster"]) == ["chief", "worker", "ps"]
    assert [config["task"] for config in tasks] == [
        {"type": "chief", "index": 0}, {"type": "worker", "index": 0}, {"type": "worker", "index": 1},
        {"type": "ps", "index": 0}, {"type": "ps", "index": 1}]
    assert tf_config_for(2, [1, 2, 3], ps=1) == {  # no chief: workers and ps
        "cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"], "ps": ["127.0.0.1:3"]},
        "task": {"type": "ps", "index": 0}}
    with pytest.raises(ValueError, match="ps tasks must be an int >= 0, got -1"):
        tf_config_for(0, addresses, ps=-1)
    with pytest.raises(ValueError, match="2 ps task.s. needs at least one chief or worker address besides them"):
        tf_config_for(0, [1, 2], ps=2)


def _ps_plan(chief, **others):
    """Every task serves (reports its TF_CONFIG, then blocks until stopped) unless given another step."""
    return {"chief 0": chief, "*": {"do": "serve"}, **{k.replace("_", " "): v for k, v in others.items()}}


def test_a_ps_job_gives_every_role_its_tf_config_and_ends_when_the_chief_ends(job):
    serving = ["worker-0.ready", "worker-1.ready", "ps-0.ready", "ps-1.ready"]
    code, out, err, elapsed = _run(job, _ps_plan({"do": "report", "wait_for": serving}), workers=3, chief=True,
                                   ps=2, backend="jax")
    assert code == 0, err
    reports = {task: json.loads(lines[0]) for task, lines in _by_task(out).items()}
    assert sorted(reports) == ["chief 0", "ps 0", "ps 1", "worker 0", "worker 1"]
    cluster = reports["chief 0"]["config"]["cluster"]
    assert list(cluster) == ["chief", "worker", "ps"]
    assert [len(cluster[job_name]) for job_name in cluster] == [1, 2, 2]
    addresses = [a for job_name in cluster for a in cluster[job_name]]
    assert len(set(addresses)) == 5 and all(a.startswith("127.0.0.1:") for a in addresses)
    for task, report in reports.items():
        kind, index = task.split()
        assert report["config"] == {"cluster": cluster, "task": {"type": kind, "index": int(index)}}
        assert report["env"]["KERAS_BACKEND"] == "jax" and report["argv"] == []
    # The serving tasks were stopped when the chief ended, quietly: no message, no error.
    assert not [line for line in err.splitlines() if line.startswith("keras_strategies.launch")], err
    assert elapsed < 10
    _assert_all_gone(job)


def test_a_ps_job_fails_with_the_chief_s_exit_code(job):
    plan = _ps_plan({"do": "exit", "code": 3, "wait_for": ["worker-0.ready", "ps-0.ready"]})
    code, _, err, _ = _run(job, plan, workers=2, chief=True, ps=1)
    assert code == 3
    assert "keras_strategies.launch: chief 0 exited with code 3; stopping the other 2 task(s)." in err.splitlines()
    _assert_all_gone(job)


def test_a_ps_that_ends_before_the_chief_stops_the_job(job):
    plan = _ps_plan({"do": "sleep"}, ps_0={"do": "kill_self", "wait_for": ["chief-0.ready", "worker-0.ready"]})
    code, _, err, _ = _run(job, plan, workers=2, chief=True, ps=1)
    assert code == 128 + signal.SIGKILL
    assert ("keras_strategies.launch: ps 0 was killed by SIGKILL (exit code 137) before the chief finished; "
            "the chief cannot go on without its parameter servers: stopping all tasks.") in err.splitlines()
    _assert_all_gone(job)


def test_a_worker_that_ends_early_is_reported_and_the_chief_goes_on(job):
    plan = _ps_plan({"do": "report", "wait_gone": ["worker-1.pid"], "wait_for": ["worker-0.ready", "ps-0.ready"]},
                    worker_1={"do": "exit", "code": 1})
    code, out, err, _ = _run(job, plan, workers=3, chief=True, ps=1)
    assert code == 0, err
    assert ("keras_strategies.launch: worker 1 exited with code 1 before the chief finished; "
            "the chief goes on with the other 1 worker task(s).") in err.splitlines()
    assert "chief 0" in _by_task(out)
    _assert_all_gone(job)


def test_the_last_worker_ending_stops_the_job_and_says_to_serve(job):
    plan = _ps_plan({"do": "sleep"}, worker_0={"do": "exit", "code": 0, "wait_for": ["chief-0.ready"]})
    code, _, err, _ = _run(job, plan, workers=2, chief=True, ps=1)
    assert code == 1
    assert ("keras_strategies.launch: worker 0 exited with code 0 before the chief finished (worker and ps tasks "
            "must serve until the chief ends: ks.Server(...).join()), and no worker task is left: stopping all "
            "tasks.") in err.splitlines()
    _assert_all_gone(job)


def test_a_ps_job_times_out_like_any_other(job):
    code, _, err, elapsed = _run(job, _ps_plan({"do": "sleep"}), workers=2, chief=True, ps=1, timeout=1)
    assert code == launch_module.TIMEOUT_EXIT_CODE
    assert "timed out after 1 s with 3 of 3 task(s) still running; stopping all tasks." in err
    assert elapsed < 8
    _assert_all_gone(job)


@pytest.mark.parametrize("argv, message", [
    (["--ps", "1", "{script}"], "--ps 1 needs --chief (chief=True): a parameter-server job is driven by its chief"),
    (["--ps", "0", "--chief", "{script}"], "--ps: must be an integer >= 1, got '0'"),
    (["--ps", "x", "--chief", "{script}"], "--ps: must be an integer >= 1, got 'x'"),
    (["--ps", "2", "--chief", "--workers", "1", "{script}"],
     "needs at least one worker task besides the chief, but --workers 1 counts the chief: use --workers 2 or more"),
])
def test_bad_ps_arguments_exit_2_and_say_what_to_do(job, capsys, argv, message):
    assert main([a.format(script=job.path) for a in argv]) == 2
    assert message in capsys.readouterr().err
    assert not job.recorded_pids()


def test_launch_api_rejects_bad_ps_values(job):
    for kwargs, message in [(dict(ps=1), "needs --chief"), (dict(ps=-1, chief=True), "`ps` must be an int >= 0"),
                            (dict(ps=True, chief=True), "got True"), (dict(ps=1, chief=True, workers=1), "--workers 2")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            launch(job.path, **kwargs)
    assert not job.recorded_pids()


@pytest.mark.parametrize("argv, message", [
    (["--nnodes", "2", "{script}"], "needs the master's address as HOST:PORT"),
    (["--nnodes", "2", "--master-addr", "host0", "{script}"], "got 'host0'"),
    (["--nnodes", "2", "--node-rank", "2", "--master-addr", "host0:29500", "{script}"],
     "`node_rank` must be an int in [0, 2), got 2"),
    (["--nnodes", "2", "--master-addr", "host0:29500", "--chief", "{script}"],
     "A multi-node job runs MultiWorkerMirroredStrategy workers only"),
    (["--nnodes", "0", "{script}"], "--nnodes: must be an integer >= 1, got '0'"),
])
def test_bad_node_arguments_exit_2_and_say_what_to_do(job, capsys, argv, message):
    assert main([a.format(script=job.path) for a in argv]) == 2
    assert message in capsys.readouterr().err
    assert not job.recorded_pids()


def test_split_command_knows_the_node_options_take_values():
    assert split_command(["--nnodes", "2", "--node-rank", "1", "--master-addr", "h:1", "--workers-per-node", "2",
                          "train.py", "--nnodes", "3"]) == (
        ["--nnodes", "2", "--node-rank", "1", "--master-addr", "h:1", "--workers-per-node", "2"],
        ["train.py", "--nnodes", "3"])


# --- restarts -----------------------------------------------------------------------------------


def test_a_job_that_fails_is_restarted_whole_until_it_succeeds(job):
    code, out, err, _ = _run(job, {"worker 1": {"do": "report", "fail_attempts": 2}, "*": {"do": "report"}},
                             workers=2, max_restarts=3)
    assert code == 0, err
    assert "worker 1 exited with code 3" in err
    assert "restarting all 2 processes (restart 1 of 3)" in err and "(restart 2 of 3)" in err
    assert "(restart 3 of 3)" not in err
    assert err.count("[worker 1] failing this attempt") == 2, err
    assert len(_by_task(out)["worker 1"]) == 1  # its report, in the third attempt


def test_restarts_end_with_the_last_failure_and_never_follow_a_timeout(job):
    code, _, err, _ = _run(job, {"*": {"do": "exit", "code": 5}}, workers=2, max_restarts=1)
    assert code == 5 and err.count("restarting all 2 processes") == 1, err
    code, _, err, _ = _run(job, {"*": {"do": "sleep"}}, workers=2, max_restarts=2, timeout=3)
    assert code == TIMEOUT_EXIT_CODE and "restarting" not in err, err
    with pytest.raises(ValueError, match="`max_restarts` must be an int >= 0, got -1"):
        launch(job.path, max_restarts=-1)
    _assert_all_gone(job)


def test_split_command_knows_that_ps_takes_a_value():
    assert split_command(["--ps", "2", "--chief", "train.py", "--ps", "3"]) == (
        ["--ps", "2", "--chief"], ["train.py", "--ps", "3"])


# --- a parameter-server cluster whose chief is the caller (start_servers) -------------------------


def test_start_servers_starts_only_the_worker_and_ps_tasks_and_gives_the_caller_the_chief_s_tf_config(job):
    out, err = io.StringIO(), io.StringIO()
    servers = start_servers(job.path, [json.dumps({"*": {"do": "serve"}})], workers=2, ps=1, backend="jax",
                            stdout=out, stderr=err)
    try:
        job.wait_for_files(["worker-0.ready", "worker-1.ready", "ps-0.ready"])
        assert servers.tf_config["task"] == {"type": "chief", "index": 0}
        cluster = servers.cluster_spec
        assert list(cluster) == ["chief", "worker", "ps"] and [len(v) for v in cluster.values()] == [1, 2, 1]
        assert len({a for v in cluster.values() for a in v}) == 4
        assert servers.exited() == {}
    finally:
        servers.stop()
    servers.stop()  # idempotent
    reports = {task: json.loads(lines[0]) for task, lines in _by_task(out.getvalue()).items()}
    assert sorted(reports) == ["ps 0", "worker 0", "worker 1"]  # no chief process: the caller is the chief
    for task, report in reports.items():
        kind, index = task.split()
        assert report["config"] == {"cluster": cluster, "task": {"type": kind, "index": int(index)}}
        assert report["env"]["KERAS_BACKEND"] == "jax"
    assert not [line for line in err.getvalue().splitlines() if line.startswith("keras_strategies.launch")]
    _assert_all_gone(job)


def test_start_servers_reports_a_task_that_ends_while_serving(job):
    err = io.StringIO()
    plan = {"*": {"do": "serve"}, "worker 1": {"do": "exit", "code": 3}}
    with start_servers(job.path, [json.dumps(plan)], workers=2, ps=1, stdout=io.StringIO(), stderr=err) as servers:
        message = "keras_strategies.launch: worker 1 exited with code 3 while serving the chief."
        deadline = time.monotonic() + 60
        while message not in err.getvalue().splitlines():
            assert time.monotonic() < deadline, f"worker 1's exit was never reported: {err.getvalue()!r}"
            time.sleep(0.05)
        assert servers.exited() == {"worker 1": 3}
    _assert_all_gone(job)


def test_start_servers_rejects_bad_values(job, tmp_path):
    for kwargs, message in [(dict(workers=0), "`workers` must be an int >= 1, got 0"),
                            (dict(ps=0), "`ps` must be an int >= 1, got 0"),
                            (dict(grace=-1), "`grace` must be a number >= 0")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            start_servers(job.path, **kwargs)
    with pytest.raises(FileNotFoundError, match="not found"):
        start_servers(str(tmp_path / "missing.py"))
    assert not job.recorded_pids()  # nothing was started


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a parent-death signal is Linux's")
def test_start_servers_tasks_stop_when_the_caller_is_killed(job, tmp_path):
    caller = tmp_path / "chief.py"
    caller.write_text(textwrap.dedent(f"""
        import sys, time, types
        package = types.ModuleType("keras_strategies")  # the launcher alone, without Keras: a fast start
        package.__path__ = [{str(REPO_ROOT / "keras_strategies")!r}]
        sys.modules["keras_strategies"] = package
        from keras_strategies.launcher.serving import start_servers
        start_servers(sys.argv[1], [sys.argv[2]], workers=1, ps=1)
        time.sleep(60)
    """))
    chief = subprocess.Popen([sys.executable, str(caller), job.path, json.dumps({"*": {"do": "serve"}})],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        job.wait_for_files(["worker-0.ready", "ps-0.ready"])
    finally:
        chief.kill()  # SIGKILL: no exit handler of the caller runs
        chief.wait()
    _assert_all_gone(job)
