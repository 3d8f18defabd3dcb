"""The command line's small promises: `--version`, one `mlxrunner:` prefix on usage errors,
logprobs in text mode, `--json` keys as the README lists them, a Modelfile's stop strings and
FROM inheritance, and the README's Python example as written."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

demo = pytest.importorskip("mlxrunner_demo", reason="the demo plugin is not installed")

README = Path(__file__).resolve().parents[1] / "README.md"
PROMPT = "def add(a, b):"


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("MLXRUNNER_LOAD_PLUGINS", None)
    return subprocess.run([sys.executable, "-m", "mlxrunner.cli", *args], capture_output=True,
                          text=True, cwd=cwd, env=env, timeout=300)


def demo_folder() -> Path:
    from mlxrunner import host as plugins

    return Path(plugins.host().registry("models")["demo-qwen3.5"].obj)


def run_json(*args: str, cwd: Path) -> dict:
    result = cli("run", *args, "--json", cwd=cwd)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_version_names_the_installed_distribution(tmp_path):
    result = cli("--version", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"mlxrunner {metadata.version('mlxrunner')}"


@pytest.mark.parametrize("args, expected", [
    (["--bogus"], "mlxrunner: error: unrecognized arguments: --bogus"),
    (["run", "--max-tokens", "0"],
     "mlxrunner: error: run: argument --max-tokens/-n/--num-predict: '0' is not"),
    # the bounds the server's APIs take (it refused what the command line took)
    (["run", "--temperature", "-1"],
     "mlxrunner: error: run: argument --temperature: '-1' is not a number >= 0"),
])
def test_a_usage_error_is_one_line_with_one_prefix(tmp_path, args, expected):
    result = cli(*args, cwd=tmp_path)
    assert result.returncode == 2
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(expected), result.stderr
    assert lines[0].count("mlxrunner") == 1


def test_logprobs_follow_the_text_in_text_mode(tmp_path):
    flags = ("demo-qwen3.5", PROMPT, "--max-tokens", "3", "--logprobs", "--top-logprobs", "2")
    expected = run_json(*flags, cwd=tmp_path)["logprobs"]
    result = cli("run", *flags, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    at = lines.index("logprobs (token, log-probability, most likely tokens):")
    rows = lines[at + 1:]
    assert len(rows) == len(expected) == 3
    for row, info in zip(rows, expected):
        numbers = re.findall(r"-?\d+\.\d{4}", row)
        assert numbers[0] == f"{info['logprob']:.4f}", row
        assert numbers[1:] == [f"{lp:.4f}" for _, lp in info["top_logprobs"]], row


def test_json_keys_are_the_ones_the_readme_lists(tmp_path):
    text = " ".join(README.read_text(encoding="utf-8").split())
    sentence = re.search(r"`run --json` prints one object: (.*?)\. ", text)
    assert sentence, "the README's sentence on run --json"
    documented = set(re.findall(r"`([a-z_]+)`", sentence.group(1)))
    out = run_json("demo-qwen3.5", PROMPT, "--max-tokens", "4", "--compare", cwd=tmp_path)
    assert set(out) | set(out["statistics"]) | set(out["message"]) <= documented, documented
    out = run_json("demo-qwen3.5", PROMPT, "--max-tokens", "4", "--logprobs", cwd=tmp_path)
    assert "logprobs" in out and set(out) <= documented


@pytest.fixture
def stop_bundle(tmp_path) -> tuple[Path, str, str]:
    """A Modelfile FROM the demo folder whose stop string falls inside the demo's greedy
    reply; with the reply up to it."""
    plain = run_json("demo-qwen3.5", PROMPT, "--max-tokens", "16", cwd=tmp_path)["text"]
    words = re.findall(r"[A-Za-z]{3,}", plain)
    assert len(words) >= 2, plain
    stop = words[1]  # some text before it, some after
    folder = tmp_path / "custom"
    folder.mkdir()
    (folder / "Modelfile").write_text(f"FROM {demo_folder()}\nPARAMETER stop {json.dumps(stop)}"
                                      "\nPARAMETER num_predict 16\n", encoding="utf-8")
    return folder, stop, plain[:plain.index(stop)]


def test_a_modelfile_stop_string_ends_run_in_text_json_and_compare(stop_bundle, tmp_path):
    folder, _, expected = stop_bundle
    out = run_json(str(folder), PROMPT, "--compare", cwd=tmp_path)
    assert out["text"] == expected and out["finish_reason"] == "stop"
    assert out["statistics"]["identical_to_plain"]
    result = cli("run", str(folder), PROMPT, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected + "\n"


def test_a_modelfile_stop_string_ends_chat_replies_and_is_the_servers_default(stop_bundle):
    import mlxrunner
    from mlxrunner.cli import chat_loop
    from mlxrunner.serve import Service

    folder, stop, expected = stop_bundle
    bundle = mlxrunner.load(folder)
    assert bundle.stop_strings() == [stop]
    lines = iter([PROMPT, "/bye"])
    messages = chat_loop(bundle, bundle.defaults, max_tokens=16, read=lambda _: next(lines),
                         write=lambda _: None)
    assert messages[-1]["content"] == expected.strip()  # the parser trims the reply
    service = Service(bundle)
    try:
        assert service.generation([1, 2], {}, max_tokens=None).stops == [stop]
        assert service.generation([1, 2], {}, max_tokens=None, stops=["x"]).stops == ["x"]
    finally:
        service.engine.close()


def test_from_a_folder_builds_on_that_folders_modelfile(tmp_path):
    import shutil

    import mlxrunner

    base = tmp_path / "base"
    shutil.copytree(demo_folder(), base)
    (base / "Modelfile").write_text('FROM .\nPARAMETER top_k 7\nPARAMETER num_predict 50\n'
                                    'SYSTEM "from the base"\n', encoding="utf-8")
    child = tmp_path / "child"
    child.mkdir()
    (child / "Modelfile").write_text("FROM ../base\nPARAMETER num_predict 16\n",
                                     encoding="utf-8")
    bundle = mlxrunner.load(child)
    assert bundle.path.resolve() == base.resolve()
    assert bundle.defaults.top_k == 7 and bundle.extra["system"] == "from the base"
    assert bundle.extra["max_tokens"] == 16  # the child's, over the base's
    (base / "Modelfile").write_text("FROM ../child\n", encoding="utf-8")
    with pytest.raises(mlxrunner.ModelfileError, match="comes back to"):
        mlxrunner.load(child)


def test_show_says_stored_and_computed_precision(tmp_path):
    result = cli("show", "demo-qwen3.5", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    # The demo stores bfloat16 and its config.json declares float32.
    assert "target precision  bfloat16 (stored), computed in float32" in \
        result.stdout.splitlines()
    info = json.loads(cli("show", "demo-qwen3.5", "--json", cwd=tmp_path).stdout)
    assert (info["target_stored_precision"], info["target_compute_dtype"]) == \
        ("bfloat16", "float32")


def test_the_readmes_python_example_runs_as_written(tmp_path):
    block = re.search(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.S)
    assert block
    env = dict(os.environ)
    env.pop("MLXRUNNER_LOAD_PLUGINS", None)
    result = subprocess.run([sys.executable, "-c", block.group(1)], capture_output=True,
                            text=True, cwd=tmp_path, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
