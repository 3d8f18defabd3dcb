"""The renderer plugins as installed packages: names, entry points, public-API-only imports."""

from __future__ import annotations

import ast
import json
from importlib.metadata import entry_points
from pathlib import Path

import pytest

import mlxrunner
import mlxrunner.nn
import mlxrunner.plugin
from mlxrunner.chat import load_conversation_file
from mlxrunner.plugin import ParsedMessage, RenderContext

pytest.importorskip("mlxrunner_renderer_qwen3_5", reason="mlxrunner-renderer-qwen3-5 not installed")
pytest.importorskip("mlxrunner_renderer_gemma4", reason="mlxrunner-renderer-gemma4 not installed")

REPO = Path(__file__).resolve().parent.parent
PACKAGES = {"mlxrunner-renderer-qwen3-5": REPO / "renderers" / "qwen3_5",
            "mlxrunner-renderer-gemma4": REPO / "renderers" / "gemma4"}
RENDERERS = {"jinja": "mlxrunner.builtins", "qwen3.5": "renderer-qwen3-5",
             "gemma4": "renderer-gemma4", "gemma4-small": "renderer-gemma4",
             "gemma4-large": "renderer-gemma4", "gemma4-nemotron": "renderer-gemma4"}
PARSERS = {"qwen3.5": "renderer-qwen3-5", "gemma4": "renderer-gemma4"}


def test_entry_points_register_every_name():
    from mlxrunner import host as plugins

    found = {ep.dist.name: ep.value for ep in entry_points(group="mlxrunner") if ep.dist}
    assert found["mlxrunner-renderer-qwen3-5"] == "mlxrunner_renderer_qwen3_5.plugin"
    assert found["mlxrunner-renderer-gemma4"] == "mlxrunner_renderer_gemma4.plugin"
    renderers = plugins.host().registry("renderers")
    parsers = plugins.host().registry("parsers")
    for name, plugin in RENDERERS.items():
        assert renderers[name].plugin == plugin
    for name, plugin in PARSERS.items():
        assert parsers[name].plugin == plugin


@pytest.mark.parametrize("name", [n for n in RENDERERS if n != "jinja"])
def test_every_renderer_builds_with_and_without_a_context(name):
    for context in (None, RenderContext(model_name="x", num_parameters=10**9)):
        renderer = mlxrunner.get_renderer(name, context)
        assert isinstance(renderer, mlxrunner.plugin.Renderer)
        assert renderer.render([{"role": "user", "content": "Bonjour"}]).count("Bonjour") == 1


@pytest.mark.parametrize("name", list(PARSERS))
def test_every_parser_follows_the_protocol(name):
    parser = mlxrunner.get_parser(name, RenderContext())
    assert isinstance(parser, mlxrunner.plugin.Parser)
    parser.reset(None, start_in_thinking=False, tools=[])
    assert parser.parse("plain answer").content == "plain answer"
    assert parser.feed("more ") + parser.finish() == [ParsedMessage(content="more")]


PUBLIC_MODULES = ("mlxrunner.plugin", "mlxrunner.nn")


@pytest.mark.parametrize("package", list(PACKAGES))
def test_plugins_import_only_the_public_api(package):
    folder = PACKAGES[package]
    sources = [p for p in folder.rglob("*.py") if ".egg-info" not in str(p)]
    assert sources
    # the user API and the plugin author's (mlxrunner.plugin, mlxrunner.nn): mlxrunner.NAME
    public = set(mlxrunner.__all__) | set(mlxrunner.plugin.__all__) | set(mlxrunner.nn.__all__)
    for path in sources:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                assert not node.module.startswith("mlxrunner.") or \
                    node.module in PUBLIC_MODULES, f"{path}: {node.module}"
            if isinstance(node, ast.Import):
                for alias in node.names:
                    assert not alias.name.startswith("mlxrunner.") or \
                        alias.name in PUBLIC_MODULES, f"{path}: {alias.name}"
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                    and node.value.id == "mlxrunner":
                assert node.attr in public, f"{path}: mlxrunner.{node.attr}"


def test_a_conversation_file_renders_with_each_format(tmp_path):
    path = tmp_path / "chat.json"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "Weather?"}],
                                "tools": [{"type": "function", "function": {"name": "w"}}]}))
    messages, tools = load_conversation_file(path)
    qwen = mlxrunner.get_renderer("qwen3.5").render(messages, tools, think=False)
    gemma = mlxrunner.get_renderer("gemma4").render(messages, tools, think=True)
    assert '"name": "w"' in qwen and qwen.endswith("<think>\n\n</think>\n\n")
    assert "<|tool>declaration:w{" in gemma and gemma.startswith("<bos><|turn>system\n<|think|>")
