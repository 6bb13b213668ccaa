"""A reader that goes away (`carve status | head`) ends `carve` quietly, not as a network error:
BrokenPipeError is an OSError, so its handler must come before the unreachable-apiserver one."""

from __future__ import annotations

import argparse
import io
from pathlib import Path
from typing import TextIO

import pytest

from carvecli import main as cli


def test_a_closed_pipe_is_not_told_as_an_unreachable_apiserver(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    def closed(args: argparse.Namespace, out: TextIO) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(cli, "cmd_status", closed)
    monkeypatch.setattr(cli.os, "dup2", lambda fd, fd2: None)  # keep pytest's stdout
    monkeypatch.setattr(cli.sys, "stdout", tmp_path.joinpath("out").open("w"))  # has a fileno
    assert cli.main(["status"], io.StringIO()) == 1
    assert capsys.readouterr().err == ""
