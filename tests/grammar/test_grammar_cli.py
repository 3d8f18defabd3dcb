"""`mlxrunner run --format json|SCHEMA_FILE`, as `ollama run --format json`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jsonschema_rs
import pytest

from mlxrunner import host as plugins

pytestmark = pytest.mark.skipif("demo-qwen3.5" not in plugins.host().registry("models"),
                                reason="the demo plugin (mlxrunner-demo) is not installed")

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["ok", "n"], "additionalProperties": False}


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mlxrunner.cli", "run", "demo-qwen3.5",
                           "def f():", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=300, stdin=subprocess.DEVNULL)


def test_a_schema_file_makes_the_reply_valid_json(tmp_path: Path) -> None:
    (tmp_path / "schema.json").write_text(json.dumps(SCHEMA))
    done = run("--format", "schema.json", "--temperature", "0", "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["finish_reason"] == "stop" and out["statistics"]["run"]["mode"] == "speculative"
    jsonschema_rs.validator_for(SCHEMA).validate(json.loads(out["text"]))


@pytest.mark.parametrize("content, needle", [
    (None, "argument --format: 'schema.json' is neither 'json' nor a schema file"),
    ("[1, 2]", "holds a list, not a JSON Schema object"),
    ("{oops", "is not JSON"),
    ('{"type": "strin"}', "--format: the JSON Schema is not supported"),
])
def test_a_bad_format_is_one_line(tmp_path: Path, content: str | None, needle: str) -> None:
    if content is not None:
        (tmp_path / "schema.json").write_text(content)
    done = run("--format", "schema.json", "--max-tokens", "2", cwd=tmp_path)
    assert done.returncode != 0 and done.stdout == ""
    assert needle in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
