"""Runnable pages of the operator's guide: the files and console sessions a page shows.

A page is Markdown. A fenced ``yaml`` block whose first line is ``# <name>.yaml`` is a file the
reader saves under that name. A fenced ``console`` block is a session: each ``$ `` line is a
command, and the lines under it, up to the next command, are output it must print (each line
somewhere in its output, in any order; none shown: anything). In an output line, ``...``
stands for any text (a UUID, a name with a random suffix); ``(no output)`` means the command
prints nothing at all. Tests run the sessions against a real cluster, so a page cannot drift
from what carve does.
"""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
_FILE_NAME = re.compile(r"^# ([\w.-]+\.ya?ml)\n")


@dataclass(frozen=True)
class Step:
    command: str
    expected: tuple[str, ...]


@dataclass(frozen=True)
class GuidePage:
    files: Mapping[str, str]
    steps: tuple[Step, ...]


def read_page(path: Path) -> GuidePage:
    files: dict[str, str] = {}
    steps: list[Step] = []
    for lang, body in _FENCE.findall(path.read_text()):
        if lang == "yaml" and (m := _FILE_NAME.match(body)):
            if m.group(1) in files:
                raise ValueError(f"{path}: file {m.group(1)} is shown twice")
            files[m.group(1)] = body
        elif lang == "console":
            command: str | None = None
            expected: list[str] = []
            for line in body.splitlines():
                if line.startswith("$ "):
                    if command is not None:
                        steps.append(Step(command, tuple(expected)))
                    command, expected = line[2:].strip(), []
                elif command is None:
                    raise ValueError(f"{path}: console block output before any command: {line}")
                elif line.strip():
                    expected.append(line.rstrip())
            if command is not None:
                steps.append(Step(command, tuple(expected)))
    return GuidePage(files, tuple(steps))


NO_OUTPUT = "(no output)"


def missing_lines(expected: Sequence[str], output: str) -> list[str]:
    """The expected lines that ``output`` lacks (see the module docstring for the forms)."""
    lines = [line.rstrip() for line in output.splitlines()]
    if list(expected) == [NO_OUTPUT]:
        return [] if not output.strip() else [f"{NO_OUTPUT}, got {len(lines)} line(s)"]
    missing = []
    for want in expected:
        pattern = ".*".join(re.escape(part) for part in want.split("..."))
        if not any(re.fullmatch(pattern, line) for line in lines):
            missing.append(want)
    return missing


def expected_in(step: Step, namespace: str) -> list[str]:
    """The step's output lines as they read when its commands run in ``namespace`` instead of
    the reader's ``default`` (kubectl names the namespace when it deletes)."""
    return [
        e.replace(" from default namespace", f" from {namespace} namespace") for e in step.expected
    ]


def run_step(
    step: Step,
    attempt: Callable[[], subprocess.CompletedProcess[str]],
    expected: Sequence[str],
    *,
    retry: bool,
    diagnostics: Callable[[], str],
    timeout: float = 120.0,
) -> str:
    """Run one step (``attempt`` runs its command once) until it succeeds and prints every
    ``expected`` line; its output. A read-only command (``retry``) is asked again for up to
    ``timeout`` seconds, until what the page shows has happened; any other fails at once."""
    deadline = time.monotonic() + timeout
    while True:
        done = attempt()
        output = done.stdout + done.stderr
        missing = missing_lines(expected, output)
        if done.returncode == 0 and not missing:
            return output
        if not retry or time.monotonic() > deadline:
            raise AssertionError(
                f"$ {step.command}\nexit {done.returncode}, missing {missing}, printed:\n"
                f"{output}\n{diagnostics()}"
            )
        time.sleep(1.0)
