"""Every code block of the user guide (docs/guide/*.md) runs as pasted, on the current backend.

A page's ```python blocks, in page order, form a program: a reader who pastes
them one after the other into a script gets what the test runs. The Markdown
source may hold directives in HTML comments, which the rendered page does not
show:

- `<!-- docs-test: run ... -->`: Python run at that point and not shown: the
  data and the `build_model()` a block only names, or checks of what a block
  printed or trained;
- `<!-- docs-test: program NAME [alone] [launch: ARGS] -->`: the blocks that
  follow belong to the program NAME (started, or resumed where an earlier part
  of the page began it); `alone`, it runs in an interpreter of its own; with
  `launch:`, it runs as
  `python -m keras_strategies.launch ARGS program.py`, once per task, as the
  multi-worker and parameter-server pages say to run their scripts;
- `<!-- docs-test: file NAME -->`: the next block is written to the file NAME
  in the program's directory (a script that a later block starts);
- `<!-- docs-test: skip REASON -->`: the next block is not run; only the
  blocks of `SKIPPED` may be skipped, so a new skip fails this test.

A block of `>>>` lines runs as a doctest: its outputs are checked. Shell, JSON
and other blocks show commands and files and are not run (the launcher's
commands have tests of their own, tests/test_launch.py).

The programs of one-process pages run one after the other in one fresh
interpreter (each page in a namespace and a directory of its own; the page
that sets a global mixed-precision policy last), with 4 virtual CPU devices;
each launched program runs in its own job.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import keras
import pytest

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "guide"
# The blocks that are not run, with the reason; any other skip fails the test.
SKIPPED = {("tpu.md", 1): "needs a Cloud TPU"}
# One-process pages that change a process-wide setting run last (mixed-precision's global policy),
# and the page that sets the virtual devices first (before any backend operation).
FIRST, LAST = ("virtual-devices.md",), ("mixed-precision.md",)
_TOKEN = re.compile(
    r"<!--\s*docs-test:\s*(?P<directive>\w+)(?P<argument>.*?)-->|^```(?P<lang>[\w-]*)[^\n]*\n(?P<code>.*?)^```",
    re.MULTILINE | re.DOTALL,
)
_DIRECTIVES = ("run", "program", "file", "skip")
_DOCTEST = """\
import doctest as _doctest
_runner = _doctest.DocTestRunner(optionflags=_doctest.ELLIPSIS | _doctest.NORMALIZE_WHITESPACE)
_runner.run(_doctest.DocTestParser().get_doctest({block!r}, globals(), {name!r}, {name!r}, 0), clear_globs=False)
assert not _runner.failures, "the doctest block {name} printed other values than the page shows"
"""


@dataclasses.dataclass
class Program:
    page: str
    name: str
    launch: list[str] | None = None  # launcher arguments; None: one plain process
    alone: bool = False  # in an interpreter of its own (else beside the other one-process pages)
    parts: list[str] = dataclasses.field(default_factory=list)
    files: dict[str, str] = dataclasses.field(default_factory=dict)
    blocks: int = 0

    @property
    def id(self) -> str:
        stem = self.page[:-3]
        return stem if self.name == stem else f"{stem}-{self.name}"

    @property
    def code(self) -> str:
        return "\n".join(self.parts)


def parse(page: Path) -> tuple[list[Program], dict[int, str]]:
    """The page's programs, and its skipped ```python blocks (block number from 1: reason)."""
    programs = {page.stem: Program(page.name, page.stem)}
    current = programs[page.stem]
    pending: tuple[str, str] | None = None  # ("file", NAME) or ("skip", REASON) for the next block
    skipped, number = {}, 0
    text = page.read_text(encoding="utf-8")
    for token in _TOKEN.finditer(text):
        line = text.count("\n", 0, token.start()) + 1
        directive = token.group("directive")
        if directive:
            argument = token.group("argument")
            assert directive in _DIRECTIVES, f"{page.name}:{line}: unknown directive {directive!r}"
            if directive == "run":
                current.parts.append(f"# {page.name}:{line} (not shown)\n{textwrap.dedent(argument).strip()}\n")
            elif directive == "program":
                head, _, launch = argument.strip().partition("launch:")
                name, *options = head.split()
                assert set(options) <= {"alone"}, f"{page.name}:{line}: unknown program options {options}"
                if name not in programs:
                    programs[name] = Program(page.name, name, shlex.split(launch) if launch else None,
                                             alone="alone" in options or bool(launch))
                current = programs[name]
            else:
                pending = (directive, argument.strip())
            continue
        if token.group("lang") != "python":
            assert pending is None, f"{page.name}:{line}: a docs-test directive before a non-Python block"
            continue
        number += 1
        code = token.group("code")
        if pending and pending[0] == "skip":
            skipped[number] = pending[1]
        elif pending and pending[0] == "file":
            current.files[pending[1]] = code
            current.blocks += 1
        elif code.lstrip().startswith(">>>"):
            current.parts.append(_DOCTEST.format(block=code, name=f"{page.name}:{line}"))
            current.blocks += 1
        else:
            current.parts.append(f"# {page.name}:{line}\n{code}")
            current.blocks += 1
        pending = None
    return [p for p in programs.values() if p.blocks], skipped


def _all_programs() -> tuple[list[Program], dict]:
    programs, skipped = [], {}
    for page in sorted(GUIDE.glob("*.md")):
        page_programs, page_skipped = parse(page)
        programs += page_programs
        skipped.update({(page.name, n): reason for n, reason in page_skipped.items()})
    return programs, skipped


PROGRAMS, SKIPS = _all_programs()


def _environment() -> dict:
    return dict(
        os.environ,
        KERAS_BACKEND=keras.backend.backend(),
        KERAS_STRATEGIES_CPU_DEVICES="4",
        TF_CPP_MIN_LOG_LEVEL="2",
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    )


def _write(program: Program, directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for name, content in program.files.items():
        (directory / name).write_text(content, encoding="utf-8")
    script = directory / f"{program.name}.py"
    script.write_text(program.code, encoding="utf-8")
    return script


def _numbered(code: str) -> str:
    return "\n".join(f"{n:4} {line}" for n, line in enumerate(code.splitlines(), 1))


def test_every_python_block_of_the_guide_is_run_or_skipped_for_a_listed_reason():
    assert SKIPS == SKIPPED
    pages = {page.name for page in GUIDE.glob("*.md")}
    run = {program.page for program in PROGRAMS}
    with_python = {page.name for page in GUIDE.glob("*.md") if "```python" in page.read_text(encoding="utf-8")}
    assert with_python - {page for page, _ in SKIPPED} <= run <= pages


def test_the_one_process_pages_run_as_pasted(tmp_path):
    """All one-process programs, each in its own namespace and directory, in one fresh interpreter."""
    order = {page: i for i, page in enumerate(FIRST)}
    order.update({page: len(PROGRAMS) + i for i, page in enumerate(LAST)})
    programs = sorted((p for p in PROGRAMS if not p.alone), key=lambda p: order.get(p.page, len(FIRST)))
    runs = []
    for program in programs:
        script = _write(program, tmp_path / program.id)
        runs.append((program.id, str(script)))
    driver = tmp_path / "driver.py"
    driver.write_text(textwrap.dedent(f"""\
        import os, runpy, sys, traceback
        failed = []
        for name, script in {runs!r}:
            os.chdir(os.path.dirname(script))
            print(f"===== {{name}}", flush=True)
            try:
                runpy.run_path(script, run_name="__main__")
            except BaseException:
                traceback.print_exc()
                failed.append(name)
            sys.stdout.flush()
        print("failed:", ",".join(failed))
        sys.exit(1 if failed else 0)
        """), encoding="utf-8")
    result = subprocess.run([sys.executable, str(driver)], cwd=tmp_path, env=_environment(),
                            capture_output=True, text=True, timeout=900)
    failed = re.search(r"^failed: (.*)$", result.stdout, re.MULTILINE)
    names = failed.group(1).split(",") if failed and failed.group(1) else []
    listings = "\n".join(f"--- {p.id}\n{_numbered(p.code)}" for p in programs if p.id in names)
    assert result.returncode == 0 and failed, (
        f"exit {result.returncode}; failed: {names}\n{listings}\n{result.stdout[-20000:]}\n{result.stderr[-20000:]}")


@pytest.mark.parametrize("program", [p for p in PROGRAMS if p.alone], ids=lambda p: p.id)
def test_the_programs_of_their_own_run_as_pasted(program, tmp_path):
    """A launched program (every task of the job), or one that needs a fresh interpreter alone."""
    script = _write(program, tmp_path)
    env = _environment()
    if program.launch is None:
        command = [sys.executable, script.name]
    else:
        command = [sys.executable, "-m", "keras_strategies.launch", "--timeout", "420", *program.launch, script.name]
        del env["KERAS_STRATEGIES_CPU_DEVICES"]  # the launcher's --devices-per-worker (default 1 per task)
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=480)
    assert result.returncode == 0, (
        f"{' '.join(command)}: exit {result.returncode}\n{_numbered(program.code)}\n"
        f"{result.stdout[-20000:]}\n{result.stderr[-20000:]}")
