"""Every ``python`` block of the README and of ``docs/`` runs as written.

The pages mark their blocks so that a reader and this test read them alike.
The first line of a block says how it runs:

* ``# torchrun --nproc_per_node N train.py`` or ``# python train.py`` (with
  ``VAR=value`` assignments in front where the page needs them, as in
  ``# DS_ACCELERATOR=cpu torchrun ...``): a complete program, launched by
  that command;
* ``# continues the block above``: the block runs after the page's previous
  block (and what that one continues), as one program, under the first
  block's command.

A block that is not meant to run (an API signature, printed output) has
``<!-- not-run: <reason> -->`` on the line before its fence. Any other
``python`` block fails :func:`test_every_python_block_is_marked`, so a new
block is either complete or says what it is.

Programs that need a framework (Lightning, DeepSpeed, Ray, accelerate,
torchft) run each under its own command where the framework is importable
and skip with its ``pip install`` otherwise. The others are batched to keep
the test short: one ``torchrun`` per process count (and one ``python``)
runs ``tests/doc_blocks_runner.py``, which executes the programs one after
another, each in a fresh ``__main__``, its own working directory and its
own store, with ``torch.distributed`` and ``ringlet`` torn down between
them; the launch must exit 0 within its timeout, and every program must
report that it ran to the end.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from test_recipes import FRAMEWORKS, _ray_run, _run, _torchft_replicas, _torchrun

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
RUNNER = Path(__file__).resolve().parent / "doc_blocks_runner.py"

LAUNCH = re.compile(
    r"^# ((?:[A-Z_]+=\S+ )*)(torchrun --nproc_per_node (\d+)|python) [\w./-]+\.py\b"
)
CONTINUES = re.compile(r"^# continues the block above\b")
NOT_RUN = re.compile(r"^<!-- not-run: \S.* -->$")

# The module each framework's programs import, and the command that installs it.
INSTALLS = {module: install for module, install in FRAMEWORKS.values()}


@dataclass
class Block:
    """One fenced ``python`` block: its page, its first line's number, its code."""

    page: str
    line: int
    code: str
    not_run: bool


@dataclass
class Program:
    """A runnable block with the blocks that continue it."""

    name: str  # page:line of the first block
    command: str  # the launch line, without "# "
    launcher: str  # "python" or "torchrun"
    nproc: int  # 1 for ``python``
    env: dict[str, str]
    code: str
    framework: str | None = None
    lines: list[int] = field(default_factory=list)


def _page_blocks(page: str, text: str) -> list[Block]:
    """The ``python`` blocks of one page's ``text``, in order."""
    out = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip().startswith("```"))
            before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            code = "\n".join(lines[i + 1 : end]) + "\n"
            out.append(Block(page, i + 2, code, bool(NOT_RUN.match(before.strip()))))
            i = end
        i += 1
    return out


def _blocks() -> list[Block]:
    """Every ``python`` block of the README and the docs, in page order."""
    return [
        b for path in PAGES for b in _page_blocks(str(path.relative_to(ROOT)), path.read_text())
    ]


def _framework(code: str) -> str | None:
    """The framework a program imports, if any."""
    for module in INSTALLS:
        if re.search(rf"^\s*(import|from) {module}\b", code, re.M):
            return module
    return None


def _programs(blocks: list[Block] | None = None) -> tuple[list[Program], list[str]]:
    """The runnable programs of ``blocks`` (default: every page's), each
    launch block with its continuations, and what is wrong with the blocks
    that are none of the three kinds."""
    programs: list[Program] = []
    errors: list[str] = []
    last: dict[str, Program] = {}
    for block in _blocks() if blocks is None else blocks:
        if block.not_run:
            last.pop(block.page, None)
            continue
        first = block.code.splitlines()[0] if block.code.strip() else ""
        where = f"{block.page}:{block.line}"
        if CONTINUES.match(first):
            if block.page not in last:
                errors.append(f"{where}: continues no runnable block above it")
                continue
            program = last[block.page]
            program.code += "\n" + block.code
            program.lines.append(block.line)
            continue
        launch = LAUNCH.match(first)
        if not launch:
            last.pop(block.page, None)
            errors.append(
                f"{where}: a python block starts with its launch command (`# torchrun "
                f"--nproc_per_node N train.py` or `# python train.py`) or with `# continues "
                f"the block above`, or has `<!-- not-run: reason -->` before it; this one "
                f"starts {first!r}"
            )
            continue
        env = dict(a.split("=", 1) for a in launch[1].split())
        program = Program(
            where,
            first[2:].strip(),
            launch[2].split()[0],
            int(launch[3] or 1),
            env,
            block.code,
            lines=[block.line],
        )
        programs.append(program)
        last[block.page] = program
    for program in programs:
        program.framework = _framework(program.code)
    return programs, errors


def test_every_python_block_is_marked() -> None:
    """Each block is a program, continues one, or says why it does not run;
    and the test finds the blocks it is meant to run."""
    programs, errors = _programs()
    assert not errors, "\n".join(errors)
    assert len(programs) >= 20, [p.name for p in programs]
    for program in programs:
        compile(program.code, program.name, "exec")  # at least valid Python


def _alone(program: Program) -> bool:
    """Whether the program runs under its own command, not in a batch: it
    needs a framework, or it ends a rank itself (``os._exit``), which would
    end the batch's runner on that rank."""
    return program.framework is not None or "os._exit(" in program.code


def test_markers_are_read() -> None:
    """The three kinds of block on a made-up page: a launch line (with the
    environment it sets), a continuation joined to it, a marked block left
    out, and an unmarked one reported with its line."""
    page = (
        "text\n\n```python\n# DS_ACCELERATOR=cpu torchrun --nproc_per_node 3 train.py\n"
        "a = 1\n```\n\n```python\n# continues the block above\nb = a\n```\n\n"
        "<!-- not-run: torch's signature -->\n```python\ndef f(x): ...\n```\n\n"
        "```python\nc = b\n```\n\n```python\n# continues the block above\nd = 1\n```\n"
        "\n```python\n# python other.py\nimport lightning\n```\n"
    )
    programs, errors = _programs(_page_blocks("p.md", page))
    assert [(p.name, p.launcher, p.nproc, p.env, p.lines) for p in programs] == [
        ("p.md:4", "torchrun", 3, {"DS_ACCELERATOR": "cpu"}, [4, 9]),
        ("p.md:28", "python", 1, {}, [28]),
    ]
    assert programs[0].code.splitlines()[1:] == [
        "a = 1",
        "",
        "# continues the block above",
        "b = a",
    ]
    assert programs[1].framework == "lightning" and programs[0].framework is None
    assert len(errors) == 2 and errors[0].startswith("p.md:19: a python block starts with")
    assert errors[1] == "p.md:23: continues no runnable block above it"


def _group(program: Program) -> str:
    if _alone(program):
        return program.name
    return "python" if program.launcher == "python" else f"torchrun-{program.nproc}"


def _groups() -> dict[str, list[Program]]:
    out: dict[str, list[Program]] = {}
    for program in _programs()[0]:
        out.setdefault(_group(program), []).append(program)
    return out


def _run_batch(tmp: Path, programs: list[Program], timeout: float) -> None:
    """Runs ``programs`` in one launch of the runner; fails naming the first
    program that did not report its end."""
    spec = [
        {"name": p.name, "code": p.code, "dir": str(tmp / f"block{i}")}
        for i, p in enumerate(programs)
    ]
    (tmp / "spec.json").write_text(json.dumps(spec))
    first = programs[0]
    cmd = (
        [sys.executable, str(RUNNER), str(tmp / "spec.json")]
        if first.launcher == "python"
        else _torchrun(first.nproc, RUNNER, str(tmp / "spec.json"))
    )
    out = _run(cmd, tmp, timeout=timeout, env=first.env)
    done = re.findall(r"^DOC-BLOCK-OK (\S+) ", out, re.M)
    missing = [p.name for p in programs if p.name not in done]
    assert not missing, f"{missing} did not finish:\n{out[-6000:]}"


@pytest.mark.parametrize("group", sorted(_groups()))
def test_blocks_run(group: str, tmp_path: Path) -> None:
    """The programs of one launch command run to the end, each under that
    command (a framework's programs alone, where the framework is installed)."""
    programs = _groups()[group]
    framework = programs[0].framework
    if framework is not None and importlib.util.find_spec(framework) is None:
        pytest.skip(f"{framework} is not installed ({INSTALLS[framework]})")
    if not _alone(programs[0]):
        assert len({(p.launcher, p.nproc, tuple(p.env.items())) for p in programs}) == 1
        _run_batch(tmp_path, programs, timeout=120)
        return
    (program,) = programs
    script = tmp_path / next(w for w in shlex.split(program.command) if w.endswith(".py"))
    script.write_text(program.code)
    if framework == "torchft":
        _torchft_replicas([script, script], [tmp_path, tmp_path])
        return
    if framework == "ray":  # Ray's session files in a fresh folder of a short path
        _ray_run(tmp_path, script)
        return
    cmd = (
        [sys.executable, str(script)]
        if program.launcher == "python"
        else _torchrun(program.nproc, script)
    )
    _run(cmd, tmp_path, timeout=300, env=program.env)
