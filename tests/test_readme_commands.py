"""The README says what the program does: its Quick start is two commands, every command line
it shows names a real subcommand with options that subcommand takes, and the ones that need
no model folder or network run."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
NO_MODEL = ["--version", "plugins", "architectures", "renderers", "parsers", "drafts", "models",
            "list"]


def _blocks() -> list[str]:
    return re.findall(r"```\n(.*?)```", README.read_text(encoding="utf-8"), re.S)


def _command_lines() -> list[list[str]]:
    """Every ``mlxrunner ...`` command of the README's shell blocks, comments cut off,
    pipes and ``&&`` split into their commands."""
    lines = []
    for block in _blocks():
        for raw in block.splitlines():
            text = re.split(r"\s#\s", raw)[0].strip()
            for part in re.split(r"\s*(?:&&|\|)\s*", text):
                words = shlex.split(part) if part else []
                if words[:1] == ["mlxrunner"]:
                    lines.append(words[1:])
    return lines


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mlxrunner.cli", *args], capture_output=True,
                          text=True, timeout=120, stdin=subprocess.DEVNULL,
                          env={**os.environ, **(env or {})})


@cache
def _help(command: str) -> str:
    out = _cli(command, "--help")
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_the_quick_start_is_two_commands():
    text = README.read_text(encoding="utf-8")
    section = text.split("## Quick start", 1)[1]
    block = re.match(r"\s*```\n(.*?)```", section, re.S)
    assert block, "a fenced block right after the Quick start heading"
    commands = [line for line in block.group(1).splitlines() if line.strip()]
    assert len(commands) == 2
    assert commands[0].startswith("pip install -r requirements.txt && mlxrunner run")
    assert commands[1] == "pip install -r requirements-test.txt && pytest"


def test_every_command_shown_is_a_subcommand_with_those_options():
    lines = _command_lines()
    assert len(lines) > 15, "the README's command examples"
    top = _cli("--help").stdout
    for words in lines:
        if not words or words[0].startswith("-"):
            assert words[0] in ("--version",), words
            continue
        command = words[0]
        assert re.search(rf"\b{re.escape(command)}\b", top), f"`mlxrunner {command}` in --help"
        if command in NO_MODEL:
            continue
        options = _help(command)
        for word in words[1:]:
            if word.startswith("--"):
                flag = word.split("=")[0]
                assert flag in options, f"`mlxrunner {command}` takes no {flag}"


@pytest.mark.parametrize("command", NO_MODEL)
def test_the_commands_that_need_no_model_run(command, tmp_path):
    out = _cli(command, env={"MLXRUNNER_MODELS": str(tmp_path / "store")})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip()
