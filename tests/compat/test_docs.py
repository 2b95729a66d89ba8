"""Every shell block in README.md and docs/*.md, and every python block of README.md, runs
verbatim: the shell blocks against the default server, the README's Python as a script.

A fenced block tagged `bash`, `sh`, `shell` or `console` is a list of commands; every other fence
must say what it holds (`text`, `python`, `yaml`, ...), so no command hides in an untagged block.
A block that cannot run in CI (a GPU, a Ray cluster, a package install) carries a
`<!-- no-ci: why -->` line right before its fence; those are reported as skipped with the reason.

How a block runs: each command in a fresh `bash` in a scratch directory, with `localhost:8000` and
`127.0.0.1:8000` pointing at the session's `boundgen serve` (no `--model`), `curl` failing on any
HTTP status ≥ 400 (`--fail-with-body`) and its JSON reply checked for an `error` key. A
`boundgen serve ...` command is started on a free port, must become ready, and is stopped.
A README python block runs in a fresh interpreter in a scratch directory and must exit 0.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from boundgen.server.testing import ServeProcess

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = [README, *sorted((REPO / "docs").glob("*.md"))]
SHELL = {"bash", "sh", "shell", "console"}
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```\s*$", re.M | re.S)
NO_CI = re.compile(r"^<!--\s*no-ci:\s*(\S.*?)\s*-->$")
SERVER_ADDRESS = re.compile(r"(?:localhost|127\.0\.0\.1):8000")
COMMAND_TIMEOUT_S = 300
CURL = 'curl() { command curl --fail-with-body --silent --show-error "$@"; }\n'


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    lang: str
    text: str
    no_ci: str | None

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"

    @property
    def commands(self) -> list[str]:
        """One entry per command: continuation lines joined, a quote left open (a JSON body over
        several lines) continued on the next line, comment-only lines dropped."""
        joined = re.sub(r"\\\n\s*", " ", self.text)
        commands, pending = [], ""
        for line in joined.splitlines():
            if not pending and (not line.strip() or line.lstrip().startswith("#")):
                continue
            pending = f"{pending}\n{line}" if pending else line
            try:
                shlex.split(pending, comments=True)
            except ValueError:  # no closing quotation yet
                continue
            commands.append(pending)
            pending = ""
        assert not pending, f"{self.name}: a quote is never closed: {pending!r}"
        return commands


def fenced_blocks() -> list[Block]:
    blocks = []
    for path in DOCS:
        text = path.read_text()
        for match in FENCE.finditer(text):
            before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
            marker = NO_CI.match(before.strip())
            line = text.count("\n", 0, match.start()) + 1
            lang = match.group(1).strip()
            blocks.append(Block(path, line, lang, match.group(2), marker and marker.group(1)))
    return blocks


BLOCKS = fenced_blocks()
SHELL_BLOCKS = [b for b in BLOCKS if b.lang in SHELL]
# the README's Python is its users' first program: it runs too (the docs' Python are excerpts)
PYTHON_BLOCKS = [b for b in BLOCKS if b.lang == "python" and b.path == README]


def block_params(blocks: list[Block] = SHELL_BLOCKS):
    for block in blocks:
        marks = [pytest.mark.skip(reason=f"no-ci: {block.no_ci}")] if block.no_ci else []
        yield pytest.param(block, id=block.name, marks=marks)


def test_every_fence_says_what_it_holds():
    untagged = [b.name for b in BLOCKS if not b.lang]
    assert not untagged, f"tag these fences (bash for commands, text for the rest): {untagged}"


def test_no_ci_markers_sit_on_blocks_that_run():
    misplaced = [b.name for b in BLOCKS if b.no_ci and b not in SHELL_BLOCKS + PYTHON_BLOCKS]
    assert not misplaced, misplaced


def test_the_readme_has_python_to_run():
    assert PYTHON_BLOCKS


def run_serve(argv: list[str]) -> None:
    """`boundgen serve ARGS` on a free port (a --host/--port given is dropped): ready, stopped."""
    args, skip = [], False
    for arg in argv[2:]:
        if skip:
            skip = False
        elif arg in ("--host", "--port"):
            skip = True
        elif not arg.startswith(("--host=", "--port=")):
            args.append(arg)
    ServeProcess(*args).stop()


def run_command(command: str, server_address: str, cwd: Path) -> None:
    command = SERVER_ADDRESS.sub(server_address, command)
    argv = shlex.split(command, comments=True)
    if argv[:2] == ["boundgen", "serve"]:
        run_serve(argv)
        return
    run = subprocess.run(
        ["bash", "-o", "pipefail", "-c", CURL + command],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT_S,
    )
    assert run.returncode == 0, f"{command}\nexit {run.returncode}\n{run.stdout}\n{run.stderr}"
    if argv[0] == "curl":
        reply = json.loads(run.stdout)
        assert not (isinstance(reply, dict) and "error" in reply), f"{command}\n{run.stdout}"


@pytest.mark.parametrize("block", list(block_params()))
def test_block_runs(block: Block, demo_server, tmp_path):
    server_address = demo_server.url.removeprefix("http://")
    for command in block.commands:
        run_command(command, server_address, tmp_path)


@pytest.mark.parametrize("block", list(block_params(PYTHON_BLOCKS)))
def test_readme_python_runs(block: Block, tmp_path):
    run = subprocess.run(
        [sys.executable, "-c", block.text],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT_S,
    )
    assert run.returncode == 0, f"{block.name}\n{run.stdout}\n{run.stderr}"
